"""Accuracy: memcalc's estimate against a real run of the same step, over a matrix of configs.

On a CUDA machine the real run is measured with ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` (:func:`memcalc.measure.step.measure_cuda`), and the estimate is made
for the device's catalogue profile (matched from ``torch.cuda.get_device_name()``, or ``--gpu``),
so that it models that GPU's kernels and workspaces. Without a GPU the step is measured with the
CPU profiler (labelled as such: CPU kernels have their own workspaces, so CPU figures say less
about CUDA). Writes, under ``--out`` (default ``benchmarks/results/``), with the stem
``accuracy-<device>-<suite>-<date>``:

- ``.jsonl``: the raw figures in the format of ``../shared/gpu/*/suite-gpu.jsonl``, so that a
  new GPU run compares with the shared data line by line. The first line is the environment
  (``device``, ``torch``, ``cuda``, ``cudnn``, ``n``, then ``driver``, ``profile``, ``date``,
  ``suite``, ``python``, ``memcalc``: the commit); then one record per config, written as it is
  done: ``config``, ``estimate_s``, ``estimate`` {``peak_allocated``, ``peak_reserved``,
  ``where``, ``attention``}, ``measured`` {``peak_allocated``, ``peak_reserved``, ``oom``,
  ``note``}, ``error_allocated``, ``error_reserved``, ``wall_s``, and ``error`` where the config
  failed (an exception in its estimate or its measurement: the suite goes on). On a CPU,
  ``estimate.peak_allocated`` is the figure compared, the unrounded estimate for the CPU.
- ``.json``: the same run with more per config (the options, the estimate's peak requested);
- ``.md``: a markdown table with the median and worst |error|.

Run: ``python benchmarks/accuracy.py [--suite quick|cpu|gpu] [--gpu NAME] [--configs SUBSTRING]
[--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import memcalc
from memcalc.core.errors import MemcalcError
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu, measure_cuda
from memcalc.targets.cuda.gpus.catalogue import get_gpu, match_profile
from models_zoo import plain_torch

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Config:
    model: str
    batch: int
    optimizer: str = "adam"
    mode: str = "train"
    input_shape: tuple[int, ...] | None = None
    seq_len: int | None = None
    # further estimate() options (precision, ...), which the measurement takes too: never the GPU
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """The model as estimated and measured: the zoo's plain-torch definition (``torch:gpt2``),
        which every recorded run (``results/``, ``tests/data/gpu/``) used, where ``gpt2`` alone now
        builds transformers' model. The label keeps the zoo name the records are keyed by."""
        return plain_torch(self.model)

    @property
    def label(self) -> str:
        shape = f" {'x'.join(map(str, self.input_shape))}" if self.input_shape else ""
        seq = f" seq {self.seq_len}" if self.seq_len else ""
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        return f"{self.model}{shape}{seq} b{self.batch} {self.optimizer} {self.mode}{extra}"


def suite(name: str) -> list[Config]:
    """Config matrices: quick (seconds, CI-sized), cpu (this laptop), gpu (an H100-sized card)."""
    if name == "quick":
        return [Config("mlp", 64, "sgd"), Config("mlp", 64, "adam"), Config("fc-32-16", 100, "none", "eval")]
    if name == "cpu":
        return [
            Config("fc-32-16", 100, "none", "eval"),
            Config("mlp", 256, "sgd"), Config("mlp", 256, "sgd-momentum"), Config("mlp", 256, "adam"),
            Config("mlp", 1024, "adamw"), Config("mlp", 1024, "none", "eval"),
            Config("resnet18", 8, "sgd", input_shape=(3, 64, 64)),
            Config("resnet18", 8, "adam", input_shape=(3, 64, 64)),
            Config("resnet50", 4, "sgd-momentum", input_shape=(3, 96, 96)),
            Config("mobilenet_v2", 8, "adam", input_shape=(3, 64, 64)),
            Config("llama-tiny", 2, "adamw", seq_len=128),
            Config("lstm-lm", 20, "sgd"),
            # reduced precision and checkpointing: the CPU's own autocast lists and oneDNN's bf16
            # matmul scratchpad (memcalc.targets.cpu.kernels), the recomputation
            Config("mlp", 256, "adam", extra={"precision": "amp-bf16"}),
            Config("llama-tiny", 2, "adamw", seq_len=128, extra={"precision": "bf16"}),
            Config("llama-tiny", 2, "adamw", seq_len=128, extra={"precision": "amp-bf16"}),
            Config("llama-tiny", 2, "adamw", seq_len=128, extra={"checkpoint": True}),
        ]
    if name == "gpu":
        configs: list[Config] = []
        for model, batches in (("resnet18", (1, 64, 256)), ("resnet50", (1, 32, 128)), ("resnet152", (16,)),
                               ("vgg16", (16,)), ("mobilenet_v2", (64,)), ("efficientnet_b0", (32,)),
                               ("densenet121", (32,)), ("unet", (2,)), ("vit_b_16", (32,))):
            for batch in batches:
                for opt in ("sgd", "adam"):
                    configs.append(Config(model, batch, opt))
        for model, batch, seq in (("bert-base", 8, 512), ("gpt2", 8, 1024), ("gpt2-medium", 4, 1024),
                                  ("llama-tiny", 8, 512)):
            for opt in ("sgd-momentum", "adamw"):
                configs.append(Config(model, batch, opt, seq_len=seq))
        configs += [Config("resnet50", 64, "none", "eval"), Config("gpt2", 8, "none", "eval", seq_len=1024)]
        # precisions, checkpointing, accumulation and inference (issue 8's matrix)
        for precision in ("amp-fp16", "amp-bf16", "bf16"):
            configs += [Config("resnet50", 64, "sgd-momentum", extra={"precision": precision}),
                        Config("gpt2", 8, "adamw", seq_len=1024, extra={"precision": precision}),
                        Config("vit_b_16", 32, "adamw", extra={"precision": precision})]
        configs += [Config("resnet50", 64, "sgd", extra={"checkpoint": True}),
                    Config("gpt2", 8, "adamw", seq_len=1024, extra={"precision": "amp-bf16", "checkpoint": True}),
                    Config("llama-tiny", 8, "adamw", seq_len=512, extra={"precision": "amp-bf16", "checkpoint": True}),
                    Config("gpt2", 4, "adamw", seq_len=1024, extra={"precision": "amp-bf16", "accum_steps": 4}),
                    Config("llama-tiny", 8, "none", "inference", seq_len=512, extra={"precision": "bf16"}),
                    Config("llama-tiny", 8, "none", "inference", seq_len=512,
                           extra={"precision": "bf16", "kv_cache": 512})]
        return configs
    raise SystemExit(f"unknown suite {name!r}: quick, cpu or gpu")


def run_config(config: Config, cuda: bool, gpu: str | None = None) -> dict[str, Any]:
    """Estimate ``config`` (for the catalogue GPU ``gpu``; None: the generic profile) and measure
    it for real. An exception in either is recorded in the record's ``"error"``, beside what was
    done before it, instead of ending the suite."""
    started = time.perf_counter()
    record: dict[str, Any] = {"config": config.label, "model": config.model, "batch_size": config.batch,
                              "optimizer": config.optimizer, "mode": config.mode, **config.extra}
    try:
        _estimate_and_measure(config, cuda, gpu, record)
    except Exception as exc:  # one config's failure is a result; the next config still runs
        record["error"] = f"{type(exc).__name__}: {exc}".split("\n")[0]
    record["wall_s"] = round(time.perf_counter() - started, 2)
    return record


def _estimate_and_measure(config: Config, cuda: bool, gpu: str | None, record: dict[str, Any]) -> None:
    """Fill ``record`` in as the config runs: the estimate, then the measurement, then the errors."""
    kwargs = dict(batch_size=config.batch, input_shape=config.input_shape, seq_len=config.seq_len)
    start = time.perf_counter()
    report = memcalc.estimate(config.source, optimizer=config.optimizer, mode=config.mode, gpu=gpu, **kwargs,
                              **config.extra)
    record["estimate_seconds"] = round(time.perf_counter() - start, 3)
    record["estimate"] = {"gpu": report.gpu.key, "peak_allocated": report.bytes.peak_allocated,
                          "peak_reserved": report.peak_reserved, "peak_requested": report.peak_requested,
                          "peak_location": report.peak_location, "attention": dict(report.attention_calls)}
    step = build_step(config.source, optimizer=config.optimizer, mode=config.mode, **kwargs, **config.extra)
    torch.manual_seed(0)
    if cuda:
        if not report.gpu_named:
            record["note"] = "estimate used the generic GPU profile; pass --gpu to match the device"
        # config.extra holds estimate options only: the GPU is the estimate's, never the measurement's
        measured = measure_cuda(step)
        compared = report.bytes.peak_allocated
    else:
        # the CPU runs CPU kernels: compare with the CPU-faithful simulation (no CUDA emulation)
        cpu_report = memcalc.estimate(config.source, optimizer=config.optimizer, mode=config.mode, gpu="cpu",
                                      **kwargs, **config.extra)
        measured = measure_cpu(step.on_cpu())
        compared = cpu_report.peak_requested  # the CPU allocator does not round
    record["measured"] = {"peak_allocated": measured.peak_allocated, "peak_reserved": measured.peak_reserved,
                          "oom": measured.oom, "note": measured.note}
    record["estimate"]["compared"] = compared
    record["error_allocated"] = measured.relative_error(compared)
    if measured.peak_reserved:
        record["error_reserved"] = (report.peak_reserved - measured.peak_reserved) / measured.peak_reserved


def jsonl_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` in the shape of ``../shared/gpu/*/suite-gpu.jsonl``: every key present (None
    where the config failed before that figure), plus ``"error"`` when it failed."""
    estimate = record.get("estimate")
    measured = record.get("measured")
    line: dict[str, Any] = {
        "config": record["config"],
        "estimate_s": None if "estimate_seconds" not in record else round(record["estimate_seconds"], 2),
        "estimate": None if estimate is None else {
            "peak_allocated": estimate.get("compared", estimate["peak_allocated"]),
            "peak_reserved": estimate["peak_reserved"], "where": estimate["peak_location"],
            "attention": estimate["attention"]},
        "measured": None if measured is None else {key: measured[key] for key in
                                                   ("peak_allocated", "peak_reserved", "oom", "note")},
        "error_allocated": record.get("error_allocated"),
        "error_reserved": record.get("error_reserved"),
        "wall_s": record["wall_s"],
    }
    if "error" in record:
        line["error"] = record["error"]
    return line


def environment(cuda: bool, gpu: str | None, suite_name: str, n: int) -> dict[str, Any]:
    """What the results were measured with: the first line of the ``.jsonl`` (its first five
    keys those of the shared data), and the head of the ``.json``."""
    return {
        "device": device_name(cuda), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None, "n": n,
        "driver": driver_version() if cuda else None, "profile": gpu,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "suite": suite_name,
        "python": platform.python_version(), "memcalc": memcalc_commit(),
    }


def driver_version() -> str | None:
    """The NVIDIA driver's version, from NVML or nvidia-smi; None when neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML: ask nvidia-smi
        pass
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=15, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def memcalc_commit() -> str | None:
    """The commit memcalc's tree is at (``+dirty`` with uncommitted changes); None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def device_profile(cuda: bool, gpu: str | None) -> str | None:
    """The catalogue key the estimates use: ``gpu`` when given (checked now, not at the first
    config), else the local device's match; None (the generic profile) when there is none."""
    if gpu is not None:
        try:
            return get_gpu(gpu).key
        except MemcalcError as exc:
            raise SystemExit(f"--gpu {gpu}: {exc}") from None
    if not cuda:
        return None
    profile = match_profile(torch.cuda.get_device_name())
    return None if profile is None else profile.key


def device_name(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name()
    return f"cpu-{platform.machine()}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def markdown(results: dict[str, Any]) -> str:
    rows = results["configs"]
    cuda = f", CUDA {results['cuda']}, cuDNN {results['cudnn']}, driver {results['driver']}" if results["cuda"] else ""
    profile = (f" Estimates for the catalogue profile {results['profile']}." if results["profile"]
               else " Estimates for the generic profile." if results["method"].startswith("torch.cuda") else "")
    lines = [f"# memcalc accuracy — {results['device']}",
             "",
             f"torch {results['torch']}{cuda}, Python {results['python']}, {results['date']}, memcalc "
             f"{results['memcalc']}; measured with {results['method']}.{profile} Errors are (estimate − measured) / "
             f"measured; the estimate compared is the CUDA-rounded peak on a GPU, the unrounded one on a CPU.",
             "",
             "| config | estimate allocated | measured allocated | error "
             "| estimate reserved | measured reserved | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "measured" not in r:
            lines.append(f"| {r['config']} | failed: {r.get('error', '?')} | | | | | |")
            continue
        m = r["measured"]
        lines.append(
            f"| {r['config']} | {_mib(r['estimate'].get('compared', r['estimate']['peak_allocated']))} | "
            f"{'OOM' if m['oom'] else _mib(m['peak_allocated'])} | {_pct(r.get('error_allocated'))} | "
            f"{_mib(r['estimate']['peak_reserved'])} | {_mib(m['peak_reserved'])} | {_pct(r.get('error_reserved'))} |")
    errors = [abs(r["error_allocated"]) for r in rows if r.get("error_allocated") is not None]
    if errors:
        lines += ["", f"{len(errors)} configs: median |error| {statistics.median(errors):.2%}, "
                      f"worst {max(errors):.2%} (peak allocated)."]
    failed = sum(1 for r in rows if "error" in r)
    if failed:
        lines += ["", f"{failed} config{'s' if failed > 1 else ''} failed (the error is in its row)."]
    return "\n".join(lines) + "\n"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2%}"


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="memcalc estimate vs a real run of the same step")
    cuda = torch.cuda.is_available()
    parser.add_argument("--suite", default="gpu" if cuda else "cpu", help="quick, cpu or gpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the .jsonl, .json and .md")
    parser.add_argument("--gpu", default=None,
                        help="catalogue profile the estimates use (e.g. h100-80gb): kernel choices and workspaces. "
                             "Default: the one matching this machine's CUDA device")
    parser.add_argument("--configs", default=None, metavar="SUBSTRING",
                        help="run only the configs whose label contains SUBSTRING (case-insensitive)")
    args = parser.parse_args(argv)
    configs = suite(args.suite)
    if args.configs:
        configs = [c for c in configs if args.configs.lower() in c.label.lower()]
        if not configs:
            raise SystemExit(f"no config of suite {args.suite!r} contains {args.configs!r}")
    gpu = device_profile(cuda, args.gpu)
    env = environment(cuda, gpu, args.suite, len(configs))
    _progress(f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}: "
              f"{len(configs)} configs, estimates for {gpu or 'the generic GPU profile'}")
    results: dict[str, Any] = {
        **env,
        "method": "torch.cuda.max_memory_allocated / max_memory_reserved" if cuda
        else "torch.profiler CPU allocations + pre-existing storages",
        "configs": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"accuracy-{slug(env['device'])}-{args.suite}-{dt.date.today().isoformat()}"
    with open(f"{stem}.jsonl", "w") as lines:  # written as the suite goes: a crash keeps what was done
        lines.write(json.dumps(env) + "\n")
        for i, config in enumerate(configs, 1):
            _progress(f"[{i}/{len(configs)}] {config.label} ...")
            record = run_config(config, cuda, gpu)
            results["configs"].append(record)
            lines.write(json.dumps(jsonl_record(record)) + "\n")
            lines.flush()
            if "error" in record:
                _progress(f"[{i}/{len(configs)}] {config.label}: FAILED {record['error']}")
                continue
            _progress(f"[{i}/{len(configs)}] {config.label}: estimate "
                      f"{_mib(record['estimate']['compared'])}, measured "
                      f"{'OOM' if record['measured']['oom'] else _mib(record['measured']['peak_allocated'])}, "
                      f"error {_pct(record.get('error_allocated'))} ({record['wall_s']:.1f} s)")
    Path(f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    Path(f"{stem}.md").write_text(markdown(results))
    print(markdown(results), flush=True)
    _progress(f"wrote {stem}.jsonl, .json and .md")


if __name__ == "__main__":
    main()

"""Accuracy: memcalc's estimate against a real run of the same step, over a matrix of configs.

On a CUDA machine the real run is measured with ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved``; without one, with the CPU profiler (labelled as such: CPU kernels
have their own workspaces, so CPU figures say less about CUDA). Writes, under
``benchmarks/results/``:

- ``accuracy-<device>-<date>.json``: raw figures of every config (device name, torch
  version, date, estimate and measurement in bytes, relative errors);
- ``accuracy-<device>-<date>.md``: the same as a markdown table with the median and worst
  |error|.

Run: ``python benchmarks/accuracy.py [--suite quick|cpu|gpu] [--out benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import memcalc
from memcalc.report.measure import measure_cpu, measure_cuda
from memcalc.sources.resolve import resolve

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Config:
    model: str
    batch: int
    optimizer: str = "adam"
    mode: str = "train"
    input_shape: tuple[int, ...] | None = None
    seq_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # further estimate() options (precision, ...)

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
            # matmul scratchpad (memcalc.cuda.cpu), the recomputation
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


def run_config(config: Config, cuda: bool) -> dict[str, Any]:
    kwargs = dict(batch_size=config.batch, input_shape=config.input_shape, seq_len=config.seq_len)
    record: dict[str, Any] = {"config": config.label, "model": config.model, "batch_size": config.batch,
                              "optimizer": config.optimizer, "mode": config.mode, **config.extra}
    start = time.perf_counter()
    report = memcalc.estimate(config.model, optimizer=config.optimizer, mode=config.mode, **kwargs, **config.extra)
    record["estimate_seconds"] = round(time.perf_counter() - start, 3)
    record["estimate"] = {"peak_allocated": report.bytes.peak_allocated, "peak_reserved": report.peak_reserved,
                          "peak_requested": report.peak_requested, "peak_location": report.peak_location}
    record["estimate"]["attention"] = dict(report.attention_calls)
    resolved = resolve(config.model, **kwargs)
    torch.manual_seed(0)
    if cuda:
        if report.gpu_named is False:
            record["note"] = "estimate used the generic GPU profile; pass --gpu to match the device"
        measured = measure_cuda(resolved, optimizer=config.optimizer, mode=config.mode, **config.extra)
        compared = report.bytes.peak_allocated
    else:
        # the CPU runs CPU kernels: compare with the CPU-faithful simulation (no CUDA emulation)
        cpu_report = memcalc.estimate(config.model, optimizer=config.optimizer, mode=config.mode, gpu="cpu",
                                      **kwargs, **config.extra)
        measured = measure_cpu(resolved, optimizer=config.optimizer, mode=config.mode, **config.extra)
        compared = cpu_report.peak_requested  # the CPU allocator does not round
    record["measured"] = {"peak_allocated": measured.peak_allocated, "peak_reserved": measured.peak_reserved,
                          "oom": measured.oom, "note": measured.note}
    record["estimate"]["compared"] = compared
    record["error_allocated"] = measured.relative_error(compared)
    if measured.peak_reserved:
        record["error_reserved"] = (report.peak_reserved - measured.peak_reserved) / measured.peak_reserved
    return record


def device_name(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name()
    return f"cpu-{platform.machine()}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def markdown(results: dict[str, Any]) -> str:
    rows = results["configs"]
    lines = [f"# memcalc accuracy — {results['device']}",
             "",
             f"torch {results['torch']}, Python {results['python']}, {results['date']}; "
             f"measured with {results['method']}. Errors are (estimate − measured) / measured; "
             f"the estimate compared is the CUDA-rounded peak on a GPU, the unrounded one on a CPU.",
             "",
             "| config | estimate allocated | measured allocated | error | estimate reserved | measured reserved | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["measured"]
        lines.append(
            f"| {r['config']} | {_mib(r['estimate'].get('compared', r['estimate']['peak_allocated']))} | "
            f"{'OOM' if m['oom'] else _mib(m['peak_allocated'])} | {_pct(r.get('error_allocated'))} | "
            f"{_mib(r['estimate']['peak_reserved'])} | {_mib(m['peak_reserved'])} | {_pct(r.get('error_reserved'))} |")
    errors = [abs(r["error_allocated"]) for r in rows if r.get("error_allocated") is not None]
    if errors:
        lines += ["", f"{len(errors)} configs: median |error| {statistics.median(errors):.2%}, "
                      f"worst {max(errors):.2%} (peak allocated)."]
    return "\n".join(lines) + "\n"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2%}"


def main() -> None:
    parser = argparse.ArgumentParser(description="memcalc estimate vs a real run of the same step")
    cuda = torch.cuda.is_available()
    parser.add_argument("--suite", default="gpu" if cuda else "cpu", help="quick, cpu or gpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and markdown")
    parser.add_argument("--gpu", default=None,
                        help="catalogue profile of the device (e.g. h100-80gb): kernel choices and workspaces")
    args = parser.parse_args()
    configs = suite(args.suite)
    if cuda and not args.gpu:
        from memcalc.cuda.gpus.catalogue import match_profile

        profile = match_profile(torch.cuda.get_device_name())
        args.gpu = profile.key if profile is not None else None
    if args.gpu:
        configs = [Config(c.model, c.batch, c.optimizer, c.mode, c.input_shape, c.seq_len,
                          {**c.extra, "gpu": args.gpu}) for c in configs]
    device = device_name(cuda)
    results: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "method": "torch.cuda.max_memory_allocated / max_memory_reserved" if cuda
        else "torch.profiler CPU allocations + pre-existing storages",
        "suite": args.suite, "configs": [],
    }
    for i, config in enumerate(configs, 1):
        record = run_config(config, cuda)
        results["configs"].append(record)
        print(f"[{i}/{len(configs)}] {config.label}: estimate {_mib(record['estimate']['peak_allocated'])}, "
              f"measured {_mib(record['measured']['peak_allocated'])}, error {_pct(record.get('error_allocated'))}",
              file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"accuracy-{slug(device)}-{args.suite}-{dt.date.today().isoformat()}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {args.out / stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()

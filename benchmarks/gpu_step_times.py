"""Real step times beside memcalc's, on the local GPU: the method of ``times.jsonl``.

    python benchmarks/gpu_step_times.py OUT.jsonl [--gpu h200]

For each config, memcalc's estimate on the named catalogue GPU (``memcalc.estimate(...,
time=True)``), then memcalc's own loop run for real: ``WARMUP + STEPS`` iterations in one
``run_step``, a CUDA event recorded after each optimizer step, and the median of the last
``STEPS`` intervals. One JSON line per config, in ``times.jsonl``'s format (``predicted_s``,
``measured_s``, ``ratio``, ``all_s``), written as it goes; a config that fails is written with
its error. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import sys
import traceback
import warnings
from typing import Any

import torch

import memcalc
from memcalc.engine.step import NullObserver, run_step
from memcalc.fields import build_step
from memcalc.measure.step import _config, _prepare  # the measured step, prepared as --measure does
from memcalc.sources.resolve import resolve
from models_zoo import plain_torch

WARMUP = 4
STEPS = 8
CONFIGS: tuple[dict[str, Any], ...] = (
    # the eight of times.jsonl (H100, 2026-11-25)
    {"model": "resnet50", "batch": 64, "seq": None, "opt": "sgd-momentum", "precision": "amp-bf16"},
    {"model": "resnet50", "batch": 256, "seq": None, "opt": "sgd-momentum", "precision": "amp-bf16"},
    {"model": "vit_b_16", "batch": 64, "seq": None, "opt": "adamw", "precision": "amp-bf16"},
    {"model": "gpt2", "batch": 8, "seq": 1024, "opt": "adamw", "precision": "amp-bf16"},
    {"model": "gpt2", "batch": 16, "seq": 1024, "opt": "adamw", "precision": "amp-bf16", "checkpoint": True},
    {"model": "bert-base", "batch": 32, "seq": 512, "opt": "adamw", "precision": "amp-bf16"},
    {"model": "gpt2-medium", "batch": 8, "seq": 1024, "opt": "adamw", "precision": "bf16"},
    {"model": "resnet50", "batch": 64, "seq": None, "opt": "adam", "precision": "fp32"},
    # others: smaller and larger batches, another model
    {"model": "resnet50", "batch": 16, "seq": None, "opt": "sgd-momentum", "precision": "amp-bf16"},
    {"model": "gpt2", "batch": 2, "seq": 512, "opt": "adamw", "precision": "amp-bf16"},
    {"model": "llama-tiny", "batch": 16, "seq": 1024, "opt": "adamw", "precision": "amp-bf16"},
    {"model": "mobilenet_v2", "batch": 128, "seq": None, "opt": "sgd-momentum", "precision": "amp-fp16"},
)


class _StepEvents(NullObserver):
    """A CUDA event after each optimizer step."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)


def prepared_step(config: dict[str, Any], iterations: int, device: torch.device | None = None) -> tuple[Any, ...]:
    """``config``'s model and inputs built on ``device`` (default: the current CUDA device) and
    memcalc's loop for ``iterations`` steps, as ``--measure`` prepares them: what ``run_step``
    takes, then what must stay alive while it runs."""
    kwargs = {"batch_size": config["batch"], "seq_len": config["seq"], "optimizer": config["opt"],
              "precision": config["precision"], "checkpoint": bool(config.get("checkpoint"))}
    # the zoo's plain-torch models (torch:NAME), which the committed step times were measured with
    model = plain_torch(config["model"])
    built = build_step(model, **kwargs)
    resolved = resolve(model, batch_size=config["batch"], seq_len=config["seq"])
    device = device or torch.device("cuda", torch.cuda.current_device())
    module, inputs, keep = _prepare(resolved, device, built)
    step = dataclasses.replace(_config(resolved, built, device), iterations=iterations)
    return module, inputs, step, keep


def measure_steps(config: dict[str, Any], device: torch.device | None = None) -> list[float]:
    """Seconds between consecutive optimizer steps of memcalc's loop, run for real."""
    module, inputs, step, _keep = prepared_step(config, WARMUP + STEPS + 1, device)
    observer = _StepEvents()
    run_step(module, inputs, step, observer)
    torch.cuda.synchronize()
    events = observer.events
    return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--gpu", default="h200", help="the catalogue GPU memcalc estimates for")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with open(args.out, "a") as out:
        for config in CONFIGS:
            record: dict[str, Any] = {**config, "gpu": args.gpu, "device": torch.cuda.get_device_name()}
            try:
                report = memcalc.estimate(plain_torch(config["model"]), batch_size=config["batch"],
                                          seq_len=config["seq"], optimizer=config["opt"], precision=config["precision"],
                                          gpu=args.gpu, checkpoint=bool(config.get("checkpoint")), time=True)
                assert report.time is not None
                record["predicted_s"] = report.time.seconds
                record["flops"] = report.time.flops.total
                intervals = measure_steps(config)
                record["all_s"] = [round(s, 5) for s in intervals]
                record["measured_s"] = statistics.median(intervals[WARMUP:])
                record["ratio"] = record["predicted_s"] / record["measured_s"]
            except Exception as exc:  # one config's failure is recorded, the others still run
                record["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(json.dumps({k: record.get(k) for k in ("model", "batch", "predicted_s", "measured_s", "ratio",
                                                          "error")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

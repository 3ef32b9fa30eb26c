"""The kernels of real steps on the local GPU, in the format of ``tests/data/gpu/*/profile.json``.

    python benchmarks/gpu_profile.py OUT.json [--history]

For each of the eight configs of ``times.jsonl`` (``benchmarks/gpu_step_times.py``'s first eight),
memcalc's own loop is run for real, ``WARMUP`` steps and then ``STEPS`` steps under
``torch.profiler`` (CPU and CUDA activities, a profiler step at each optimizer step). Written
per config: every aten op's calls and self CUDA time (µs) over the profiled steps, the top
kernels, and the wall time per step measured with CUDA events in the same run. This is what
``scripts/fit_step_time.py`` fits memcalc's step-time model to (:mod:`memcalc.timing.calibration`).

``--history`` records the CUDA caching allocator's history (``torch.cuda.memory.
_record_memory_history``, Python and C++ stacks) during the steps, as a memory-snapshot run
does: to see what that recording costs a step. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import traceback
import warnings
from typing import Any

import torch
from gpu_step_times import CONFIGS, _StepEvents, prepared_step  # the same configs and steps (benchmarks/)
from torch.profiler import ProfilerActivity, profile, schedule

from memcalc.engine.step import run_step

WARMUP = 3
STEPS = 2
TOP_KERNELS = 15


class _ProfiledSteps(_StepEvents):
    """A CUDA event and a profiler step after each optimizer step."""

    def __init__(self, profiler: profile) -> None:
        super().__init__()
        self.profiler = profiler

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        super().optimizer_stepped(optimizer)
        self.profiler.step()


def _self_cuda_us(event: Any) -> float:
    """Self device time of an averaged profiler event in µs (renamed across torch releases)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_config(config: dict[str, Any], history: bool, device: torch.device | None = None) -> dict[str, Any]:
    module, inputs, step, _keep = prepared_step(config, WARMUP + STEPS + 1, device)
    if history:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     schedule=schedule(wait=0, warmup=WARMUP, active=STEPS, repeat=1)) as prof:
            observer = _ProfiledSteps(prof)
            run_step(module, inputs, step, observer)
            torch.cuda.synchronize()
    finally:
        if history:
            torch.cuda.memory._record_memory_history(enabled=None)
    intervals = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(observer.events)]
    averages = prof.key_averages()
    ops = [{"op": e.key, "calls": e.count, "self_cuda_us": _self_cuda_us(e)} for e in averages
           if e.key.startswith("aten::") and _self_cuda_us(e) > 0]
    kernels = [{"kernel": e.key[:160], "calls": e.count, "us": _self_cuda_us(e)} for e in averages
               if not e.key.startswith(("aten::", "cuda", "ProfilerStep", "Optimizer")) and _self_cuda_us(e) > 0]
    return {"config": config, "steps": STEPS, "history": history,
            "step_s": statistics.median(intervals[WARMUP:]) if len(intervals) > WARMUP else None,
            "all_s": [round(s, 5) for s in intervals],
            "aten_ops": sorted(ops, key=lambda o: -o["self_cuda_us"]),
            "top_kernels": sorted(kernels, key=lambda k: -k["us"])[:TOP_KERNELS]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--history", action="store_true", help="record the allocator's history during the steps")
    parser.add_argument("--configs", type=int, default=8, help="the first N configs (default: the eight)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "configs": []}
    for config in CONFIGS[:args.configs]:
        try:
            record = profile_config(config, args.history)
        except Exception as exc:  # one config's failure is recorded, the others still run
            traceback.print_exc()
            record = {"config": config, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        results["configs"].append(record)
        print(json.dumps({"config": config, "step_s": record.get("step_s"), "error": record.get("error")}), flush=True)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

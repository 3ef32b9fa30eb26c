"""Speed and footprint of the estimator. Prints figures; asserts nothing (machines are noisy:
compare ratios measured in one run).

1. resnet50, batch 64, Adam, fp32: memcalc vs PyTorch's own ``MemTracker`` under
   ``FakeTensorMode`` on the same model and the same step (one iteration: forward, loss,
   backward, step, zero_grad). Times (best of N), the ratio, and both peaks.
2. Large models: time and peak RSS of estimating gpt2-xl (batch 8, seq 1024, AdamW) and
   llama-2-7b (batch 1, seq 2048, AdamW), each in a fresh process: the zoo's plain-torch models
   (``torch:NAME``, what the README's figures were measured with), then the same names as
   transformers' models (the zoo's default where transformers is installed, which imports it).
3. Fit time / one-estimate time for resnet50 and gpt2 (``benchmarks/speed_fit.py``).

Run: ``python benchmarks/speed.py [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import memcalc
import models_zoo
from memcalc.engine import allocator
from memcalc.engine.timeline import allocator_events
from memcalc.fields import build_step
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import trace_step as trace_model

MiB = 2**20


def memcalc_first_iteration(batch: int) -> tuple[float, int, int, int]:
    """(seconds, first-iteration peak with CUDA block rounding, unrounded, steady-state peak)."""
    start = time.perf_counter()
    report = memcalc.estimate("resnet50", batch_size=batch, optimizer="adam")
    seconds = time.perf_counter() - start
    # target="cpu": tensors only — MemTracker knows nothing of CUDA workspaces
    traced = trace_model(resolve("resnet50", batch_size=batch), build_step(optimizer="adam", gpu="cpu"))
    program = traced.program()
    first = allocator.replay(allocator_events(program, traced.trace.nbytes, until=program.iteration_starts[-1]))
    return seconds, first.peak_allocated, first.peak_requested, report.bytes.peak_allocated


def memtracker_peak(batch: int) -> tuple[float, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    start = time.perf_counter()
    with FakeTensorMode():
        model = models_zoo.get("resnet50").build()
        optimizer = torch.optim.Adam(model.parameters(), foreach=True)
        x = torch.randn(batch, 3, 224, 224)
        y = torch.randint(0, 1000, (batch,))
        tracker = MemTracker()
        tracker.track_external(model, optimizer, x, y)
        with tracker:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        peaks = tracker.get_tracker_snapshot("peak")
    peak = max(snap["Total"] for snap in peaks.values())
    return seconds, peak


_CHILD = """
import json, resource, sys, time
import memcalc
name, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
report = memcalc.estimate(name, batch_size=batch, seq_len=seq, optimizer="adamw")
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak": report.bytes.peak_allocated, "phase": report.peak_location}))
"""


def large_model(name: str, batch: int, seq: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, name, str(batch), str(seq)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each timing; the best is kept")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads")

    memcalc_first_iteration(8)  # warm up imports and caches for both sides
    memtracker_peak(8)
    ours = min((memcalc_first_iteration(64) for _ in range(args.repeat)), key=lambda r: r[0])
    theirs = min((memtracker_peak(64) for _ in range(args.repeat)), key=lambda r: r[0])
    t_ours, first_rounded, first_raw, steady = ours
    t_theirs, peak_theirs = theirs
    print("\nresnet50, batch 64, Adam (foreach), fp32 — one iteration, best of", args.repeat)
    print(f"  memcalc estimate       {t_ours:7.3f} s   (whole estimate: two iterations replayed, report)")
    print(f"  MemTracker + FakeTensor{t_theirs:7.3f} s")
    print(f"  speed-up               {t_theirs / t_ours:7.1f} x")
    print(f"  peak, memcalc first iteration, unrounded, no workspaces   {first_raw / MiB:10.1f} MiB")
    print(f"  peak, memcalc first iteration, CUDA blocks, no workspaces {first_rounded / MiB:10.1f} MiB")
    print(f"  peak, MemTracker (one iteration)                          {peak_theirs / MiB:10.1f} MiB"
          f"   (memcalc unrounded {100 * (first_raw - peak_theirs) / peak_theirs:+.2f}%,"
          f" CUDA blocks {100 * (first_rounded - peak_theirs) / peak_theirs:+.2f}%)")
    print(f"  memcalc steady-state peak (2nd iteration, Adam state alive) {steady / MiB:10.1f} MiB")

    print("\nlarge models (fresh process each): time and peak RSS of the estimator")
    for name, batch, seq in (("torch:gpt2-xl", 8, 1024), ("torch:llama-2-7b", 1, 2048), ("gpt2-xl", 8, 1024),
                             ("llama-2-7b", 1, 2048)):
        r = large_model(name, batch, seq)
        print(f"  {name:17s} batch {batch} seq {seq:5d} AdamW: {r['seconds']:6.2f} s, "
              f"RSS {r['rss'] / 2**30:5.2f} GiB, estimated peak {r['peak'] / 2**30:8.2f} GiB ({r['phase']})")

    print("\nmemcalc fit: time in units of one estimate")
    import speed_fit  # beside this file

    speed_fit.main()


if __name__ == "__main__":
    main()

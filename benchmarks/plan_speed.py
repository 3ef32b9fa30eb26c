"""How long does ``memcalc plan`` take on the question it is for? Issue 33's target: ``memcalc plan
llama-3-70b --gpus 64 --gpu h100-80gb --global-batch 64 --seq-len 8192`` answers in under a
minute. The target lives here, not in a timed test (a shared machine makes a wall-clock assertion
flaky): the line gives the wall time, the process's CPU time (user + system: what the search
costs whatever else runs on the machine) and each one's ratio to the target, and the number of
traces the search ran, then the rows it answers (the same configurations must come back whatever
makes the search faster: the pruning is sound, tests/test_plan.py).

Measured 2026-12-06 on 2 shared cores (CPU seconds are the comparable figure): before this
round's bounds (main at e3afd87) 29 traces, 549 CPU-s, 30.6 min wall (as issue 33 last measured
it; a rerun at load 12–36 was killed at 27 min, 18 traces and 218 CPU-s in, inside its first
pipeline trace); after (the probes, the bubble bound, the interleaved memory bound) 23 traces,
262.6 CPU-s, 395 s wall at load 4–9, the same five rows. 170 CPU-s of it is one pipeline that
does not fit (dp_shard=2,tp=2,pp=16, interleaved 1F1B). Plan then stopped a pipeline at its first
rank that does not fit (rank 0 of that one): 23 traces, 142.4 CPU-s against 244.5 CPU-s without
the stop (main at 4942e79), the two run side by side at load 4–7 (6.7 and 8.5 min wall), the same
five rows (JSON equal). The minute needs that pipeline ruled out untraced, or cheaper traces.
Then (branch plansearch: the most sharded sibling traced first, scaled peaks) 23 → 19 traces,
134.3 → 84.3 CPU-s under loads of 12–34 and 14–15, main again 118.9 at 15–16 (/usr/bin/time -v
on the CLI, back to back),
the same five rows: docs/many-gpus.md says what is left. Then (branch planmin: depth
extrapolation composes the cost records and HSDP's meshes, every trace without a pipeline
composed) 15 traces, 99.0 → 53.7 CPU-s, main then the branch at load 14–20 and 11–14, and
94.8 → 49.1 CPU-s, the branch first (load 8–14, main then at 4–8), and 59.4 → 30.9 CPU-s
(59.7 → 31.0 s wall) at load 1.8, JSON equal.

    python benchmarks/plan_speed.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

TARGET_SECONDS = 60.0
COMMAND = ["plan", "llama-3-70b", "--gpus", "64", "--gpu", "h100-80gb", "--global-batch", "64", "--seq-len", "8192",
           "--format", "json"]


def main() -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memcalc", *COMMAND], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 1):
        sys.exit(done.stderr or done.stdout)
    data = json.loads(done.stdout)
    print(f"memcalc {' '.join(COMMAND[:-2])}")
    print(f"  wall {wall:.1f} s (ratio to the {TARGET_SECONDS:.0f} s target: {wall / TARGET_SECONDS:.2f}), "
          f"CPU {cpu:.1f} s (ratio {cpu / TARGET_SECONDS:.2f}); {data['estimates']} traces, "
          f"{data['traces_reused']} reused, {data['configurations']} configurations")
    for rank, row in enumerate(data["best"], 1):
        print(f"  {rank}. {row['mesh']} {row['pp_schedule'] or ''} micro-batch {row['micro_batch']} × "
              f"{row['accum_steps']}, checkpointing {row['checkpoint']}, {row['peak_allocated'] / 2**30:.2f} GiB, "
              f"{row['step_seconds']:.2f} s per step")


if __name__ == "__main__":
    main()

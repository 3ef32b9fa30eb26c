"""What does ``report.timeline()`` cost, in units of one estimate?

The timeline is built only when asked for (one more replay of the step through the recording
allocator model, then the per-event arrays), so an estimate pays nothing for it; asking for
it must add less than half an estimate. For each case this prints the median time of one
estimate (warm), the median time of ``timeline()`` on a fresh report, and their ratio, and the
snapshot export (``snapshot_dict``) on top. Ratios are what to compare: they are measured in
one run, on one machine.

    python benchmarks/timeline.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

from tabulate import tabulate

import memcalc
from memcalc.measure.snapshot_export import snapshot_dict

#: (model, estimate keyword arguments): the first is the case the target is set on.
CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("resnet50", {"batch_size": 64, "optimizer": "adam"}),
    ("gpt2", {"batch_size": 8, "seq_len": 256, "optimizer": "adamw"}),
    ("gpt2", {"batch_size": 8, "seq_len": 256, "optimizer": "adamw",
              "distributed": memcalc.Distributed("fsdp", world_size=2)}),
)
#: The target: the timeline adds less than this fraction of one estimate's time.
TARGET_RATIO = 0.5


def measure(model: str, options: dict[str, Any], repeat: int) -> tuple[float, float, float, int]:
    """(estimate seconds, timeline seconds, snapshot seconds, events), medians over ``repeat``."""
    memcalc.estimate(model, **options)  # warm: imports, the meta-kernel caches
    estimates, timelines, snapshots = [], [], []
    events = 0
    for _ in range(repeat):
        start = time.perf_counter()
        report = memcalc.estimate(model, **options)
        estimates.append(time.perf_counter() - start)
        start = time.perf_counter()
        events = report.timeline().num_events
        timelines.append(time.perf_counter() - start)
        start = time.perf_counter()
        snapshot_dict(report)  # the timeline is kept: this is the export alone
        snapshots.append(time.perf_counter() - start)
    return statistics.median(estimates), statistics.median(timelines), statistics.median(snapshots), events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for model, options in CASES:
        estimate, timeline, snapshot, events = measure(model, options, args.repeat)
        what = ", ".join(f"{k}={v.strategy.value if isinstance(v, memcalc.Distributed) else v}"
                         for k, v in options.items())
        rows.append((f"{model} ({what})", events, f"{estimate * 1000:.0f}", f"{timeline * 1000:.1f}",
                     f"{timeline / estimate:.1%}", f"{snapshot * 1000:.1f}"))
    print(tabulate(rows, headers=("case", "events", "estimate ms", "timeline() ms", "timeline / estimate",
                                  "snapshot_dict ms")))
    print(f"\ntarget: timeline / estimate < {TARGET_RATIO:.0%} (first row)")


if __name__ == "__main__":
    main()

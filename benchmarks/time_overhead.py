"""What does timing the step add to an estimate?

Two costs: recording every kernel's FLOPs and bytes while the step is traced
(:class:`memcalc.timing.flops.OpCostRecorder`, paid only by an estimate that asks for a time:
``estimate(time=True)``, ``--time``), and the roofline over the recorded kernels
(:func:`memcalc.step_time`). For resnet50 (224×224, batch 64) and gpt2 (512 tokens, batch 8),
Adam, on an A100 80GB, fp32 and amp-bf16, this prints the median time of a plain estimate
(nothing recorded), of an estimate with recording on (the step's costs recorded, no roofline
yet), of ``step_time`` on a recorded report, and the ratio (estimate with recording + step time)
/ (plain estimate): what asking for a time costs. The target: under 1.30. A plain estimate
paid the recording too before issue 22.

    python benchmarks/time_overhead.py
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from tabulate import tabulate

import memcalc
from memcalc.estimation import run_estimate
from memcalc.fields import build_step
from memcalc.timing.performance import step_time

CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("resnet50", {"batch_size": 64}),
    ("gpt2", {"batch_size": 8, "seq_len": 512}),
)
PRECISIONS = ("fp32", "amp-bf16")
GPU = "a100-80gb"
#: Runs per measurement; medians are taken (a full garbage collection now and then adds ~0.1 s,
#: and the machine may be shared).
REPEATS = 9


def recording(model: str, kwargs: dict[str, Any]) -> Any:
    """An estimate whose kernels' costs are recorded as it is traced, not yet timed: what
    ``estimate(time=True)`` traces (the step with ``record_costs`` set)."""
    return run_estimate(replace(build_step(model, **kwargs), record_costs=True))


def seconds(run: Callable[[], object]) -> float:
    """CPU seconds of this process (not wall-clock: other processes on a shared machine would
    count; an estimate is single-threaded Python)."""
    start = time.process_time()
    run()
    return time.process_time() - start


def paired_medians(model: str, kwargs: dict[str, Any]) -> tuple[float, float]:
    """Median times of a plain estimate and of one recording its costs, the two alternated run by
    run so that the load of a shared machine weighs on both alike."""
    without, with_recording = [], []
    for _ in range(REPEATS):
        without.append(seconds(lambda: memcalc.estimate(model, **kwargs)))
        with_recording.append(seconds(lambda: recording(model, kwargs)))
    return statistics.median(without), statistics.median(with_recording)


def main() -> None:
    warnings.simplefilter("ignore")  # approximation notes are not what is measured here
    rows = []
    for model, options in CASES:
        for precision in PRECISIONS:
            kwargs: dict[str, Any] = {**options, "precision": precision, "gpu": GPU}
            memcalc.estimate(model, **kwargs)  # warm-up: imports, first-call caches
            without, with_recording = paired_medians(model, kwargs)
            reports = [recording(model, kwargs) for _ in range(REPEATS)]
            timing = statistics.median(seconds(partial(step_time, r)) for r in reports)  # each on a fresh report
            kernels = sum(p.kernels for p in step_time(reports[0]).phases)
            ratio = (with_recording + timing) / without
            rows.append([model, precision, kernels, f"{without:.3f}", f"{with_recording:.3f}",
                         f"{(with_recording / without - 1):+.1%}", f"{timing * 1e3:.1f}", f"{ratio:.3f}"])
    print(tabulate(rows, headers=["model", "precision", "kernels", "estimate, no recording (s)",
                                  "estimate, recording (s)", "recording", "step_time (ms)",
                                  "(estimate + time) / before"], disable_numparse=True))


if __name__ == "__main__":
    main()

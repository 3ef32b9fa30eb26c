"""What does timing the step add to an estimate?

Two costs: recording every kernel's FLOPs and bytes while the step is traced
(:class:`memcalc.engine.flops.OpCostRecorder`, paid by every estimate), and the roofline over
the recorded kernels when a time is asked for (:func:`memcalc.step_time`, paid only then). For
resnet50 (224×224, batch 64) and gpt2 (512 tokens, batch 8), Adam, on an A100 80GB, fp32 and
amp-bf16, this prints the median estimate time with the recorder switched off (the estimate
before issue 17), with it on, the median time of ``step_time`` on a fresh report, and the
ratio (estimate with recording + step time) / (estimate without recording). The target: under
1.30.

    python benchmarks/time_overhead.py
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from tabulate import tabulate

import memcalc
from memcalc.cuda.gpus.performance import step_time
from memcalc.engine import flops

CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("resnet50", {"batch_size": 64}),
    ("gpt2", {"batch_size": 8, "seq_len": 512}),
)
PRECISIONS = ("fp32", "amp-bf16")
GPU = "a100-80gb"
#: Runs per measurement; medians are taken (a full garbage collection now and then adds ~0.1 s,
#: and the machine may be shared).
REPEATS = 9


@contextmanager
def recording_off() -> Iterator[None]:
    """The recorder passes every op straight to the backend's hook and records nothing: the
    estimate as it was before step times existed."""
    original = flops.OpCostRecorder.__call__

    def passthrough(self: flops.OpCostRecorder, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if self._then is not None:  # the benchmark switches the recorder off
            self._then(func, args, kwargs, out)

    flops.OpCostRecorder.__call__ = passthrough  # type: ignore[method-assign]
    try:
        yield
    finally:
        flops.OpCostRecorder.__call__ = original  # type: ignore[method-assign]


def seconds(run: Callable[[], object]) -> float:
    """CPU seconds of this process (not wall-clock: other processes on a shared machine would
    count; an estimate is single-threaded Python)."""
    start = time.process_time()
    run()
    return time.process_time() - start


def paired_medians(model: str, kwargs: dict[str, Any]) -> tuple[float, float]:
    """Median estimate times without and with recording, the two alternated run by run so that
    the load of a shared machine weighs on both alike."""
    without, with_recording = [], []
    for _ in range(REPEATS):
        with recording_off():
            without.append(seconds(lambda: memcalc.estimate(model, **kwargs)))
        with_recording.append(seconds(lambda: memcalc.estimate(model, **kwargs)))
    return statistics.median(without), statistics.median(with_recording)


def main() -> None:
    warnings.simplefilter("ignore")  # approximation notes are not what is measured here
    rows = []
    for model, options in CASES:
        for precision in PRECISIONS:
            kwargs: dict[str, Any] = {**options, "precision": precision, "gpu": GPU}
            memcalc.estimate(model, **kwargs)  # warm-up: imports, first-call caches
            without, with_recording = paired_medians(model, kwargs)
            reports = [memcalc.estimate(model, **kwargs) for _ in range(REPEATS)]
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

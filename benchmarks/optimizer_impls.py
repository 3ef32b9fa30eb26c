"""How much the optimizer and its implementation move the peak.

For each model, every optimizer memcalc knows in every implementation it has (torch's for-loop,
foreach and fused; bitsandbytes' own kernel for its 8-bit and paged AdamW): the simulated peak
allocated on the generic CUDA GPU, its ratio to the same optimizer's foreach step (the default
on CUDA), the phase it falls in, the highest allocation during ``optimizer.step()`` itself
(the gradients and everything else alive included: it is where the implementations differ,
whether or not the step is the peak) and its ratio to
foreach's, the optimizer state at the peak, and the state a paged optimizer keeps in unified
memory (outside the peak). Estimates only: no GPU is needed.

    python benchmarks/optimizer_impls.py
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from tabulate import tabulate

import memcalc
from memcalc.core.categories import Phase
from memcalc.core.loop import OptimizerImpl
from memcalc.core.report import MemoryReport
from memcalc.core.units import format_bytes
from memcalc.engine.optimizers import OPTIMIZERS, Optimizer

#: (label, model, estimate keyword arguments)
CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("gpt2 small, seq 512, batch 4", "gpt2", {"batch_size": 4, "seq_len": 512}),
    ("resnet50, batch 32", "resnet50", {"batch_size": 32}),
)
_ORDER = (OptimizerImpl.FOR_LOOP, OptimizerImpl.FOREACH, OptimizerImpl.FUSED)


def step_peak(report: MemoryReport) -> int:
    """The most allocated at any moment of an ``optimizer.step()`` (either iteration): from the
    level backward leaves to the last event before ``zero_grad`` (a step that allocates
    nothing, as plain SGD's, holds the level backward left)."""
    timeline = report.timeline()
    peak = 0
    for iteration in {span.iteration for span in timeline.spans}:
        spans = [span for span in timeline.spans if span.iteration == iteration]
        backward_end = max((span.end for span in spans if span.phase is Phase.BACKWARD), default=None)
        if backward_end is None:
            continue
        zero_grad = min((span.start for span in spans if span.phase is Phase.ZERO_GRAD), default=spans[-1].end)
        peak = max(peak, int(timeline.allocated[backward_end - 1:max(zero_grad, backward_end)].max()))
    return peak


def _ratio(value: int, reference: int | None) -> str:
    return f"{value / reference:.3f}" if reference else "-"


def rows_for(model: str, options: dict[str, Any]) -> list[list[str]]:
    """One row per optimizer × implementation (the optimizer ``none`` left out)."""
    rows = []
    for key, spec in OPTIMIZERS.items():
        if key is Optimizer.NONE:
            continue
        reports = {impl: memcalc.estimate(model, optimizer=key.value, loop=memcalc.Loop(optimizer_impl=impl),
                                          **options) for impl in _ORDER if impl in spec.impls}
        foreach = reports.get(OptimizerImpl.FOREACH)
        foreach_step = step_peak(foreach) if foreach is not None else None
        for impl, r in reports.items():
            peak, step = r.bytes.peak_allocated, step_peak(r)
            auto = " (auto)" if impl is spec.auto_cuda else ""
            rows.append([key.value, impl.value + auto, format_bytes(peak, "MiB"),
                         _ratio(peak, foreach.bytes.peak_allocated if foreach is not None else None),
                         r.peak_phase.value, format_bytes(step, "MiB"), _ratio(step, foreach_step),
                         format_bytes(r.bytes.optimizer_state, "MiB"),
                         format_bytes(r.paged_optimizer_state, "MiB") if r.paged_optimizer_state else "-"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    warnings.simplefilter("ignore")
    headers = ["optimizer", "implementation", "peak allocated", "÷ foreach", "peak in", "step's peak", "÷ foreach",
               "optimizer state", "paged (apart)"]
    for label, model, options in CASES:
        print(f"{label}, fp32, generic CUDA GPU (MiB = 2^20 B)\n")
        print(tabulate(rows_for(model, options), headers=headers, disable_numparse=True,
                       colalign=("left", "left", "right", "right", "left", "right", "right", "right", "right")))
        print()


if __name__ == "__main__":
    main()

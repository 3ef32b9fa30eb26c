"""One validated estimate request, and the estimate of it on one GPU or under a strategy.

:class:`EstimateRequest` is everything :func:`memcalc.estimate` was asked, converted once at
the API boundary; the batch search (:mod:`memcalc.search`) varies its batch size, capacity,
optimizer and precision with :func:`dataclasses.replace` and calls :func:`run_estimate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from memcalc.core.report import MemoryReport
from memcalc.core.throughput import DeviceRates, StepFlops, StepTime
from memcalc.cuda.backend import trace_step
from memcalc.distributed.options import Distributed
from memcalc.distributed.strategies import estimate_per_rank
from memcalc.engine.model import InputsLike
from memcalc.engine.options import EstimateOptions
from memcalc.engine.run import TracedStep, build_report
from memcalc.sources.adapters import apply_finetune, step_precision
from memcalc.sources.resolve import resolve

__all__ = ("CostsOnRequest", "EstimateRequest", "run_estimate")


@dataclass(frozen=True)
class EstimateRequest:
    """A model, its inputs, the step and the GPUs, validated.

    ``model`` is whatever the user named (resolved anew for each estimate: a meta twin is
    cheap, and a strategy resolves each role at its own batch). ``capacity``: the bytes the
    caching allocator may reserve (None: no limit, ``fits`` stays None).
    """

    model: Any
    options: EstimateOptions
    distributed: Distributed = field(default_factory=Distributed)
    batch_size: int | None = None
    input_shape: tuple[int, ...] | None = None
    seq_len: int | None = None
    inputs: InputsLike | None = None
    capacity: int | None = None


def run_estimate(request: EstimateRequest, on_trace: Callable[[TracedStep], None] | None = None) -> MemoryReport:
    """Estimate ``request``.

    Args:
        request: the validated request.
        on_trace: single GPU only: called with the raw traced step before the report is
            made (the batch search replays the same step at other batch sizes with it).

    Returns:
        The report; under a strategy, that of the busiest GPU with every role in ``roles``.
    """
    options = request.options
    if not request.distributed.is_single:  # each role's model is fine-tuned there, before its program wraps it
        report = estimate_per_rank(request.model, distributed=request.distributed, options=options,
                                   batch_size=request.batch_size, input_shape=request.input_shape,
                                   seq_len=request.seq_len, inputs=request.inputs, capacity=request.capacity)
    else:
        resolved = resolve(request.model, batch_size=request.batch_size, input_shape=request.input_shape,
                           seq_len=request.seq_len, inputs=request.inputs)
        resolved = apply_finetune(resolved, options.finetune, precision=options.precision, mode=options.mode,
                                  checkpoint=options.checkpoint)
        options = replace(options, precision=step_precision(resolved, options.finetune, options.precision,
                                                            options.mode))
        traced = trace_step(resolved, options)
        if on_trace is not None:
            on_trace(traced)
        report = build_report(resolved, traced, options, request.capacity)
    return report if options.record_costs else replace(report, _costs=CostsOnRequest(request))


class CostsOnRequest:
    """A report's FLOPs and step times when its kernels' costs were not recorded
    (``options.record_costs`` off, as for every estimate that asks for no time): the first
    request traces the estimate again, recording them, and keeps that report. A step time
    asked for after the fact costs one more trace; an estimate never timed costs nothing."""

    def __init__(self, request: EstimateRequest) -> None:
        self._request = request
        self._recorded: MemoryReport | None = None

    def _report(self) -> MemoryReport:
        if self._recorded is None:
            request = self._request
            self._recorded = run_estimate(replace(request, options=replace(request.options, record_costs=True)))
        return self._recorded

    def flops(self) -> StepFlops:
        """The step's FLOPs per phase, module and op."""
        return self._report().flops()

    def time(self, rates: DeviceRates) -> StepTime:
        """The step's time on the GPU of ``rates``."""
        return self._report().time_on(rates)

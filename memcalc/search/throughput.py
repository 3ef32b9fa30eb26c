"""The fastest training setting that fits a budget: ``memcalc fit --objective throughput``.

Memory alone picks the largest batch; throughput picks among the settings that fit — with or
without activation checkpointing, and, for a target batch per optimizer step, how many micro-batches to
accumulate — the one with the most samples per second. For each checkpointing choice the batch
search (:func:`memcalc.search.fit.find_max_batch`) finds the largest micro-batch; a few
micro-batches up to it are then estimated and timed (:func:`memcalc.step_time`): the
largest, and with a target batch ``G`` the largest divisors of ``G`` (so that micro-batch ×
accumulation is ``G`` exactly).

Accumulation keeps the gradients alive from one micro-batch to the next, so a setting that
accumulates is fitted and estimated with two micro-batches (what is alive in the second is what
is alive in every later one). Its step time is then ``a`` micro-batches' forward and backward
plus one optimizer step, both read from that estimate's phases.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memcalc.core.checkpointing import FULL, OFF
from memcalc.core.errors import InvalidInputError
from memcalc.core.report import MemoryReport
from memcalc.core.throughput import StepTime
from memcalc.distributed.setting import Distributed
from memcalc.engine.step_spec import Step
from memcalc.estimation import SINGLE, run_estimate
from memcalc.search.fit import MAX_BATCH, find_max_batch
from memcalc.search.fit_result import DoesNotFitError, margin_capacity
from memcalc.targets.budget import Budget
from memcalc.timing.performance import step_time

__all__ = ("Candidate", "ThroughputChoice", "find_fastest")

#: Micro-batches timed per checkpointing choice (the largest that fit; the largest divisors of a
#: target batch): the time per sample falls as the batch grows, so the best is among the largest.
CANDIDATES = 3
#: Phases that run once per optimizer step, whatever the accumulation.
_ONCE_PER_STEP = ("optimizer", "zero_grad")


@dataclass(frozen=True)
class Candidate:
    """One setting: checkpointing, micro-batch, accumulation; its estimate (with one or two
    micro-batches, see the module docstring) and its time per optimizer step."""

    checkpoint: bool
    micro_batch: int
    accum_steps: int
    report: MemoryReport
    seconds: float

    @property
    def samples_per_step(self) -> int:
        """Samples per optimizer step: micro-batch × accumulation."""
        return self.micro_batch * self.accum_steps

    @property
    def samples_per_second(self) -> float:
        """Samples per second of this setting."""
        return self.samples_per_step / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens per second (None for a model that takes no token ids)."""
        time = self.report.time
        if time is None or time.tokens is None or not time.samples:
            return None
        return self.samples_per_second * time.tokens / time.samples

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of one candidate."""
        return {"checkpoint": self.checkpoint, "micro_batch": self.micro_batch, "accum_steps": self.accum_steps,
                "samples_per_step": self.samples_per_step, "peak_allocated": self.report.bytes.peak_allocated,
                "seconds": self.seconds, "samples_per_second": self.samples_per_second,
                "tokens_per_second": self.tokens_per_second}


@dataclass(frozen=True)
class ThroughputChoice:
    """The fastest setting that fits, every setting timed, and the choices left out (with why)."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    budget: Budget
    margin: float
    target_batch: int | None
    left_out: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc fit --objective throughput --format json`` contract."""
        return {"objective": "throughput", "target_batch": self.target_batch, "budget_bytes": self.budget.capacity,
                "margin": self.margin, "best": self.best.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates], "left_out": list(self.left_out),
                "report": self.best.report.to_dict()}


def find_fastest(step: Step, budget: Budget, *, distributed: Distributed = SINGLE, margin: float = 0.0,
                 target_batch: int | None = None, max_batch: int = MAX_BATCH) -> ThroughputChoice:
    """The setting of ``step`` with the most samples per second whose step fits ``budget``
    less ``margin`` (see the module docstring).

    Args:
        step: the step to search over; its batch size, checkpointing, accumulation and
            capacity are replaced.
        distributed: the multi-GPU setting (the budget is each GPU's).
        budget: the bytes the caching allocator may reserve (a GPU with figures, to be timed).
        margin: the fraction of ``budget`` held back.
        target_batch: samples per optimizer step to reach exactly (None: any, no accumulation).
        max_batch: the largest micro-batch tried.

    Returns:
        The choice, with every candidate timed.

    Raises:
        DoesNotFitError: no setting fits (batch 1 without and with checkpointing).
        InvalidInputError: a step that cannot be timed (no GPU with figures).
    """
    if target_batch is not None and target_batch < 1:
        raise InvalidInputError(f"the target batch must be at least 1, got {target_batch}")
    candidates: list[Candidate] = []
    left_out: list[str] = []
    failure: DoesNotFitError | None = None
    for checkpoint in (False, True):
        base = replace(step, checkpoint=FULL if checkpoint else OFF, accum_steps=1)
        try:
            candidates += _candidates(base, distributed, budget, margin, target_batch, max_batch)
        except DoesNotFitError as exc:
            failure = failure or exc
            left_out.append(f"{_ckpt(checkpoint)}: not even batch 1 fits")
        except InvalidInputError as exc:
            if not checkpoint:
                raise
            left_out.append(f"checkpointing: {exc}")
    if not candidates:
        assert failure is not None
        raise failure
    best = max(candidates, key=lambda c: (c.samples_per_second, -c.report.bytes.peak_allocated))
    return ThroughputChoice(best=best, candidates=tuple(candidates), budget=budget, margin=margin,
                            target_batch=target_batch, left_out=tuple(left_out))


def _candidates(step: Step, distributed: Distributed, budget: Budget, margin: float, target_batch: int | None,
                max_batch: int) -> list[Candidate]:
    # only the batch is read: the raw boundary and the expandable-segments batch are not searched
    largest = find_max_batch(step, budget, distributed=distributed, margin=margin, max_batch=max_batch,
                             extras=False).batch_size
    if target_batch is None:
        settings = [(b, 1) for b in _halvings(largest)]
    elif target_batch <= largest:
        settings = [(b, target_batch // b) for b in _divisors_up_to(target_batch, largest)]
    else:  # accumulation: fit again with the gradients alive across micro-batches
        accumulating = replace(step, accum_steps=2)
        largest = find_max_batch(accumulating, budget, distributed=distributed, margin=margin,
                                 max_batch=max_batch, extras=False).batch_size
        settings = [(b, target_batch // b) for b in _divisors_up_to(target_batch, largest)]
    timed = [_timed(step, distributed, budget, margin, b, a) for b, a in settings[:CANDIDATES]]
    # a micro-batch under the fit's answer can still fail (fragmentation, or the gradients kept
    # across accumulated micro-batches): only the settings whose own estimate fits compete
    return [c for c in timed if c.report.fits is not False]


def _timed(step: Step, distributed: Distributed, budget: Budget, margin: float, micro_batch: int,
           accum_steps: int) -> Candidate:
    traced = min(accum_steps, 2)
    timed = replace(step, batch_size=micro_batch, accum_steps=traced, record_costs=True,  # timed below
                    capacity=margin_capacity(budget.capacity, margin))
    report = run_estimate(timed, distributed)
    time = step_time(report)
    return Candidate(checkpoint=bool(step.checkpoint), micro_batch=micro_batch, accum_steps=accum_steps,
                     report=replace(report, time=time), seconds=_seconds(time, traced, accum_steps))


def _seconds(time: StepTime, traced: int, accum_steps: int) -> float:
    """The time of ``accum_steps`` micro-batches and one optimizer step, from an estimate that
    traced ``traced`` micro-batches."""
    once = sum(p.seconds for p in time.phases if p.phase in _ONCE_PER_STEP)
    return (time.seconds - once) / traced * accum_steps + once


def _halvings(largest: int) -> list[int]:
    """``largest``, its half, its quarter... (distinct, ≥ 1), largest first."""
    out: list[int] = []
    batch = largest
    while batch >= 1 and len(out) < CANDIDATES:
        out.append(batch)
        batch //= 2
    return out


def _divisors_up_to(number: int, limit: int) -> list[int]:
    """The divisors of ``number`` that are at most ``limit``, largest first."""
    return [d for d in range(min(number, limit), 0, -1) if number % d == 0]


def _ckpt(checkpoint: bool) -> str:
    return "with checkpointing" if checkpoint else "without checkpointing"

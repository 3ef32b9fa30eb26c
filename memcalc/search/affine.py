"""Batch-affine trace families: the same step at any batch size, from two traces.

For most models the step at batch ``B`` allocates the same storages in the same order as at
any other batch, and each storage's size is affine in ``B`` (activations grow with the
batch, weights and their state do not). Two traces at batches ``b1 < b2`` with identical
structure then give every storage's size at any ``B`` — ``a + s·B`` — and a replay through
the allocator model answers "does batch ``B`` fit?" in milliseconds instead of a new
symbolic run. Whether the assumption holds at the batch that matters is never assumed: the
search confirms its answer with real estimates (see :mod:`memcalc.search`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from memcalc.engine import allocator
from memcalc.engine.run import TracedStep
from memcalc.engine.timeline import Program, allocator_events

__all__ = ("AffineFamily", "SyntheticPoint")


class SyntheticPoint(NamedTuple):
    """What a replay at batch ``batch_size`` says, in the terms the search uses."""

    batch_size: int
    fits: bool
    peak_allocated: int
    reserved_within_capacity: int


@dataclass(frozen=True)
class AffineFamily:
    """One step at every batch size: its alloc/free ``program`` (the same at any batch) and
    each storage's size ``intercepts[uid] + slopes[uid]·B``."""

    program: Program
    intercepts: tuple[int, ...]
    slopes: tuple[int, ...]

    @classmethod
    def from_traces(cls, first: TracedStep, b1: int, second: TracedStep, b2: int) -> AffineFamily | None:
        """The family through two traced steps (``TracedStep``), or None when they differ in
        structure (events, categories) or a size is not an integer-affine function of the batch."""
        if b1 == b2:
            return None
        t1, t2 = first.trace, second.trace
        if t1.events != t2.events or t1.preexisting != t2.preexisting or first.categories != second.categories:
            return None
        program = first.program()
        if program.events != second.program().events:
            return None
        intercepts: list[int] = []
        slopes: list[int] = []
        # equal events and pre-existing storages name every uid: the lists have the same length
        for n1, n2 in zip(t1.nbytes, t2.nbytes, strict=True):
            step, remainder = divmod(n2 - n1, b2 - b1)
            if remainder or step < 0:
                return None
            intercept = n1 - step * b1
            if intercept < 0:
                return None
            intercepts.append(intercept)
            slopes.append(step)
        return cls(program=program, intercepts=tuple(intercepts), slopes=tuple(slopes))

    def nbytes(self, batch: int) -> list[int]:
        """Every storage's size at ``batch``, indexed by uid."""
        return [a + s * batch for a, s in zip(self.intercepts, self.slopes, strict=True)]

    def probe(self, batch: int, capacity: int) -> SyntheticPoint:
        """Replay the step at ``batch`` through the allocator model under ``capacity``."""
        sizes = self.nbytes(batch)
        free_run = allocator.replay(allocator_events(self.program, sizes))
        if free_run.peak_reserved <= capacity:
            return SyntheticPoint(batch, True, free_run.peak_allocated, free_run.peak_reserved)
        limited = allocator.replay(allocator_events(self.program, sizes), capacity=capacity)
        return SyntheticPoint(batch, limited.oom_at is None, free_run.peak_allocated, limited.peak_reserved)

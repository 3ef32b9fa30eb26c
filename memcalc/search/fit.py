"""The largest batch that fits a memory budget.

A batch fits when its step, replayed through the caching-allocator model under the budget,
never runs out of memory — not when its peak is under the budget (fragmentation can make a
step whose peak allocated is under the budget fail). One estimate costs the same at any batch
size, so the search minimises the number of estimates: batch 2, one jump toward the budget,
then a batch-affine trace family (:mod:`memcalc.search.affine`) answers the probes by
replay, and real estimates at B and B + 1 confirm the answer; otherwise regula falsi with
bisection steps on real estimates. It stops only when batch ``lo`` fits and ``lo + 1`` does
not, both estimated. The algorithm and its cost are written up in docs/architecture.md,
"The batch search".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from memcalc.core.report import MemoryReport
from memcalc.distributed.estimate import EstimateRequest, run_estimate
from memcalc.engine.run import TracedStep
from memcalc.search.affine import AffineFamily
from memcalc.search.budget import BatchLimitError, Budget, DoesNotFitError, FitResult, Probe, batch_bytes

__all__ = ("MAX_BATCH", "find_max_batch")

#: Largest batch the search tries: beyond it a model is "too small to bound".
MAX_BATCH = 2**20
#: While expanding, one jump multiplies the largest fitting batch by at most this.
_MAX_GROWTH = 256
#: While expanding on a curve that does not grow (or a per-sample guess of 0), multiply by this.
_FLAT_GROWTH = 16
#: Narrowing steps in a row that may fail to halve the bracket before a bisection step.
_SLOW_STEPS = 2


def find_max_batch(request: EstimateRequest, budget: Budget, *, neighbours: int = 0,
                   max_batch: int = MAX_BATCH) -> FitResult:
    """The largest batch whose step of ``request`` fits ``budget`` (see the module docstring).

    Args:
        request: the estimate to search over; its batch size and capacity are replaced.
        budget: the bytes the caching allocator may reserve.
        neighbours: also estimate the batches within this distance of the answer.
        max_batch: the largest batch tried.

    Returns:
        The batch, its report, the budget and every probe.

    Raises:
        DoesNotFitError: batch 1 does not fit.
        BatchLimitError: ``max_batch`` still fits.
    """
    resolved = budget
    reports: dict[int, MemoryReport] = {}
    traces: dict[int, TracedStep] = {}
    order: list[_Point] = []
    single_gpu = request.distributed.is_single

    def measure(batch: int) -> _Point:
        """A real estimate (each batch at most once)."""
        if batch not in reports:
            keep = (lambda traced: traces.__setitem__(batch, traced)) if single_gpu else None
            reports[batch] = run_estimate(replace(request, batch_size=batch, capacity=resolved.capacity),
                                          on_trace=keep)
            order.append(_point(reports[batch], batch))
        return _point(reports[batch], batch)

    # Batch 2 first: batch 1 is often a special case of the step (a batch dimension of 1
    # broadcasts without a reduction), which would keep the two-trace family from forming.
    start = min(2, max_batch)
    first = measure(start)
    if not first.fits:
        if not measure(1).fits:
            raise DoesNotFitError(reports[1], resolved)
        first = _point(reports[1], 1)
    slope_hint = _per_sample_guess(reports[first.batch_size])
    best: int | None
    if first.batch_size == 1 and start == 2:  # 1 fits, 2 does not
        best = 1
    elif single_gpu:
        best = _affine_search(measure, traces, order, resolved.capacity, first, slope_hint, max_batch)
    else:
        best = None
    if best is None:
        try:
            best, _ = _search(measure, resolved.capacity, first=first, slope_hint=slope_hint, max_batch=max_batch)
        except _Unbounded:
            raise BatchLimitError(max_batch, reports[max_batch], resolved) from None
    points = order
    report = reports[best]
    probes = tuple(_as_probe(p) for p in points)
    around = range(max(1, best - neighbours), best + neighbours + 1) if neighbours else range(0)
    return FitResult(
        batch_size=best,
        report=report,
        budget=resolved,
        headroom=resolved.capacity - report.bytes.peak_allocated,
        # synthetic probes are exact replays of the same step: they widen the span of the secant
        bytes_per_sample=_slope_near(best, probes),
        probes=probes,
        neighbours=tuple(_as_probe(reports[b] if b in reports else measure(b)) for b in around),
    )


def _as_probe(point: MemoryReport | _Point) -> Probe:
    if isinstance(point, MemoryReport):
        return Probe(point.batch_size, bool(point.fits), point.bytes.peak_allocated)
    return Probe(point.batch_size, point.fits, point.peak_allocated, point.synthetic)


def _affine_search(measure: Callable[[int], _Point], traces: dict[int, TracedStep], order: list[_Point],
                   capacity: int, first: _Point, slope_hint: float | None, max_batch: int) -> int | None:
    """The search on a batch-affine family built from two real traces, its answer confirmed by
    real estimates at B and B + 1; None when the step is not batch-affine or the confirmation
    disagrees (the caller then searches with real estimates, reusing the ones made here).

    Real estimates: the first probe (batch 2), one jump toward the budget, B and B + 1 — four
    for a batch-affine step, whatever the allocator's fragmentation (the synthetic replays
    include it). When the first two differ in structure the family comes from the jump and
    the next point on the line through them — five."""
    start = first.batch_size
    seen = {start: first}
    jump = min(max(_extrapolate(seen, start, capacity, slope_hint), start + 1), start * _MAX_GROWTH, max_batch)
    seen[jump] = measure(jump)
    family = _family(traces, start, jump)
    if family is None and jump < max_batch:
        line = _extrapolate(seen, jump, capacity, slope_hint) if seen[jump].fits else (start + jump) // 2
        second = min(max(line, 2), max_batch)
        if second != jump:
            measure(second)
            family = _family(traces, min(jump, second), max(jump, second))
    if family is None:
        return None

    def synthetic(batch: int) -> _Point:
        if batch in seen:  # estimated for real already
            return seen[batch]
        probe = family.probe(batch, capacity)
        needed = probe.peak_allocated if probe.fits else max(probe.peak_allocated, probe.reserved_within_capacity)
        point = _Point(batch, probe.fits, probe.peak_allocated, needed, synthetic=True)
        order.append(point)
        return point

    try:
        best, _ = _search(synthetic, capacity, first=first, slope_hint=slope_hint, max_batch=max_batch)
    except _Unbounded:
        return None
    at, after = measure(best), measure(best + 1)
    if at.fits and not after.fits:
        return best
    return None


def _family(traces: dict[int, TracedStep], b1: int, b2: int) -> AffineFamily | None:
    if b1 not in traces or b2 not in traces:
        return None
    return AffineFamily.from_traces(traces[b1], b1, traces[b2], b2)


class _Point(NamedTuple):
    """A probe as the search sees it. ``needed``: for a batch that does not fit, the reserved
    peak of the replay under the budget, which runs on past its OOM — what the step needed,
    fragmentation included; the peak allocated for a batch that fits."""

    batch_size: int
    fits: bool
    peak_allocated: int
    needed: int
    synthetic: bool = False


def _point(report: MemoryReport, batch: int) -> _Point:
    fits = bool(report.fits)
    peak = report.bytes.peak_allocated
    reserved = report.reserved_within_capacity
    return _Point(batch, fits, peak, peak if fits or reserved is None else max(peak, reserved))


def _per_sample_guess(report: MemoryReport) -> float:
    """Bytes per sample guessed from one report: what is not model state, over the batch.
    Usually too high (it counts batch-independent temporaries), so the first jump undershoots."""
    return batch_bytes(report) / report.batch_size


class _Unbounded(Exception):
    """The expansion reached ``max_batch`` and it fits."""


def _search(
    measure: Callable[[int], _Point],
    capacity: int,
    *,
    first: _Point,
    slope_hint: float | None,
    max_batch: int = MAX_BATCH,
) -> tuple[int, list[_Point]]:
    """A fitting batch ``lo`` with ``lo + 1`` estimated not to fit (the largest, where fits is
    monotone in the batch), and every probe in order. ``measure(b)`` estimates batch ``b``; ``first`` is a fitting probe
    already made. The algorithm is described in the module docstring."""
    seen: dict[int, _Point] = {first.batch_size: first}
    order = [first]

    def take(batch: int) -> bool:
        point = measure(batch)
        seen[batch] = point
        order.append(point)
        return point.fits

    lo, hi = first.batch_size, None
    while hi is None:  # expand
        if lo >= max_batch:
            raise _Unbounded
        batch = min(max(_extrapolate(seen, lo, capacity, slope_hint), lo + 1), lo * _MAX_GROWTH, max_batch)
        if take(batch):
            lo = batch
        else:
            hi = batch
    slow, gallop = 0, 1  # steps in a row that did not halve the bracket; stride above lo
    while hi - lo > 1:  # narrow
        width, middle = hi - lo, (lo + hi) // 2
        # The peak allocated may reach the capacity less the fragmentation seen at hi, taken
        # as a fraction of the peak (it grows with the batch on some models).
        target = capacity * seen[hi].peak_allocated // max(seen[hi].needed, 1)
        crossing = _crossing(seen[lo], seen[hi], target)
        if slow >= _SLOW_STEPS or crossing is None:
            batch, slow, gallop = middle, 0, 1
        elif crossing <= lo:  # confirm the predicted boundary; if lo + 1 fits too, gallop up
            batch, gallop = max(min(lo + gallop, middle), lo + 1), gallop * 2
        else:
            batch, gallop = min(crossing, hi - 1), 1
        if take(batch):
            lo = batch
        else:
            hi = batch
        slow = slow + 1 if hi - lo > width // 2 else 0
    return lo, order


def _extrapolate(seen: dict[int, _Point], lo: int, capacity: int, slope_hint: float | None) -> int:
    """Where the line through the two largest fitting batches (or through ``lo`` with the
    per-sample guess) reaches ``capacity``; a geometric step when that line does not rise."""
    fitting = sorted(b for b, p in seen.items() if p.fits)
    if len(fitting) >= 2:
        crossing = _crossing(seen[fitting[-2]], seen[fitting[-1]], capacity)
    elif slope_hint and slope_hint > 0:
        crossing = lo + math.floor((capacity - seen[lo].peak_allocated) / slope_hint)
    else:
        crossing = None
    return lo * _FLAT_GROWTH if crossing is None else crossing


def _crossing(a: _Point, b: _Point, target: int) -> int | None:
    """The largest batch on or under ``target`` on the line through ``a`` and ``b``; None
    when the line does not rise."""
    rise = b.peak_allocated - a.peak_allocated
    run = b.batch_size - a.batch_size
    if run == 0 or rise * run <= 0:
        return None
    return a.batch_size + math.floor((target - a.peak_allocated) * run / rise)


def _slope_near(batch: int, probes: Sequence[Probe]) -> float:
    """Peak bytes per sample near ``batch``: the secant over the widest span of probes in
    [batch/2, 2·batch + 1], or over all probes when that window holds only one."""
    window = [p for p in probes if batch / 2 <= p.batch_size <= 2 * batch + 1]
    points = window if len({p.batch_size for p in window}) >= 2 else list(probes)
    low = min(points, key=lambda p: p.batch_size)
    high = max(points, key=lambda p: p.batch_size)
    if high.batch_size == low.batch_size:
        return 0.0
    return (high.peak_allocated - low.peak_allocated) / (high.batch_size - low.batch_size)

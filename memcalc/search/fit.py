"""The largest batch that fits a memory budget, less a margin held back for what the estimate
does not know.

A batch fits when its step, replayed through the caching-allocator model under the budget less
the margin, never runs out of memory — not when its peak is under it (fragmentation can make a
step whose peak allocated is under the budget fail). One estimate costs the same at any batch
size, so the search minimises the number of estimates: batch 2, one jump toward the budget,
then a batch-affine trace family (:mod:`memcalc.search.affine`) answers the probes by replay;
the boundary it finds is checked downward by replays (fragmentation is not monotone in the
batch: a batch below a fitting one can fail), and the answer is traced for real and must be
the family's step, storage for storage. Otherwise regula falsi with bisection steps on real
estimates, which stops when batch ``lo`` fits and ``lo + 1`` does not, both estimated. The
algorithm, its guarantee and its cost are written up in docs/architecture.md, "The batch search".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Mode
from memcalc.core.checkpointing import Checkpointing, CheckpointKind
from memcalc.core.progress import report_progress
from memcalc.core.report import MemoryReport
from memcalc.distributed.checkpoint_auto import block_count, candidates
from memcalc.distributed.setting import Distributed
from memcalc.engine.allocator import AllocatorStats
from memcalc.engine.run import TracedStep
from memcalc.engine.step_spec import Step
from memcalc.engine.timeline import category_totals_at
from memcalc.estimation import SINGLE, TracedEstimate, run_estimate, trace_estimate
from memcalc.search.affine import AffineFamily, SyntheticPoint, replay_stats, replay_under
from memcalc.search.fit_result import (
    MODEL_STATES,
    BatchLimitError,
    DoesNotFitError,
    FitResult,
    Probe,
    batch_bytes,
    margin_capacity,
)
from memcalc.targets.budget import Budget

__all__ = ("FITTING", "MAX_BATCH", "find_max_batch")

#: The progress task of a fit: its units are the batches estimated (for real, not replayed).
FITTING = "estimating batch sizes"

#: Largest batch the search tries: beyond it a model is "too small to bound".
MAX_BATCH = 2**20
#: While expanding, one jump multiplies the largest fitting batch by at most this.
_MAX_GROWTH = 256
#: While expanding on a curve that does not grow (or a per-sample guess of 0), multiply by this.
_FLAT_GROWTH = 16
#: Narrowing steps in a row that may fail to halve the bracket before a bisection step.
_SLOW_STEPS = 2
#: The check below the boundary (:func:`_check_below`) replays at least this many batches under
#: the answer ...
_CHECK_WINDOW = 4
#: ... and goes on down while a batch could still fail with this many times the worst
#: fragmentation met: while its peak allocated × (1 + this × (f − 1)) exceeds the budget, f
#: being the largest bytes needed / peak allocated of a failing replay. Chosen on a survey of
#: 40 zoo model × GPU cases (resnet18/50, vgg11/16/19, efficientnet_b0, vit_b_16, bert-base,
#: llama-tiny on a T4, 24 GiB, an A100 40 GB and an H100, with a 6% margin, every batch from
#: 60% of the budget up replayed): with 1.25 to 2 the check stops under the first failing
#: batch in all 40; with 1 in 38 (vgg16 on an H100 has a failing batch 53 under a run of 52
#: that fit, and f grows as it goes down: 1.48 → 1.51).
_CHECK_FRAGMENTATION = 1.5
#: The check's cost bound: after this many replays it only finishes its window under the answer
#: (``FitResult.check_capped``). The survey's non-VGG cases need at most 116 replays; the VGGs
#: on the largest GPUs, where the fragmentation reaches 20% under the boundary, up to 650, and
#: with this bound 2 of the 40 answers would be above the first failing batch (by 5% and 6%).
_MAX_CHECK_REPLAYS = 256
#: Without a batch-affine family, the raw boundary (under the whole budget, for the report)
#: may cost at most this many more real estimates; past them it is left unknown (None).
_RAW_ESTIMATES = 4


def find_max_batch(step: Step, budget: Budget, *, distributed: Distributed = SINGLE, margin: float = 0.0,
                   neighbours: int = 0, max_batch: int = MAX_BATCH, extras: bool = True) -> FitResult:
    """The largest batch whose ``step`` fits ``budget`` less ``margin`` (see the module
    docstring and docs/architecture.md, "The batch search", for what is checked).

    Args:
        step: the step to search over; its batch size and capacity are replaced.
        distributed: the multi-GPU setting (the budget is each GPU's).
        budget: the bytes the caching allocator may reserve.
        margin: the fraction of ``budget`` held back (0 ≤ margin < 1, checked by the caller).
        neighbours: also estimate the batches within this distance of the answer.
        max_batch: the largest batch tried.
        extras: also search the raw boundary and the batch with expandable segments (replays of
            the family, about half an estimate's time); a caller that reads only the batch (the
            throughput search) leaves them out, and they are None.

    Returns:
        The batch, its report against the whole budget, the budget, the margin, the raw
        boundary, the checked range and every probe.

    Raises:
        DoesNotFitError: batch 1 does not fit the budget less the margin.
        BatchLimitError: ``max_batch`` still fits.
    """
    if step.checkpoint.kind is CheckpointKind.AUTO and distributed.is_single:
        return _fit_each_setting(step, budget, distributed=distributed, margin=margin, neighbours=neighbours,
                                 max_batch=max_batch, extras=extras)
    capacity = budget.capacity
    limit = margin_capacity(capacity, margin)
    real = _Estimates(step, distributed, capacity, limit)
    # Batch 2 first: batch 1 is often a special case of the step (a batch dimension of 1
    # broadcasts without a reduction), which would keep the two-trace family from forming.
    start = min(2, max_batch)
    first = real.point(start)
    if not first.fits:
        if not real.point(1).fits:
            raise DoesNotFitError(real.estimate(1), budget, margin)
        first = real.points[1]
    slope_hint = real.per_sample(first.batch_size)
    found: _Found | None = None
    if first.batch_size == 1 and start == 2:  # 1 fits, 2 does not
        found = _Found(1, 1, 1, ())
    elif real.single:
        found = _affine_search(real, first, slope_hint, max_batch)
    if found is None:
        try:
            best, _ = _search(real.point, limit, first=first, slope_hint=slope_hint, max_batch=max_batch)
        except _Unbounded:
            raise BatchLimitError(max_batch, real.estimate(max_batch), budget) from None
        found = _Found(best, best, best, ())
    best = found.best
    report = real.report_under_budget(best)
    # The search judged each batch under the margin budget; the report is under the whole one. A
    # caching allocator is not monotonic in its capacity (a larger one frees its cache later, and its
    # streams' pools fragment otherwise), so a batch that fits under the margin can still run out
    # under the whole budget: the answer steps down until its own report fits too.
    while report.fits is False and best > 1:
        best -= 1
        report = real.report_under_budget(best)
    if report.fits is False:
        raise DoesNotFitError(report, budget, margin)
    expandable = (_with_expandable_segments(found.family, best, limit, step, max_batch, real.known(best + 1))
                  if extras else None)
    raw = (_raw_boundary(real, found, first.batch_size, slope_hint, max_batch)
           if extras or real.limit == real.capacity else None)  # with no margin it is the search's own boundary
    probes = tuple(_as_probe(p) for p in real.order)
    around = range(max(1, best - neighbours), best + neighbours + 1) if neighbours else range(0)
    return FitResult(
        batch_size=best,
        report=report,
        budget=budget,
        headroom=capacity - report.bytes.peak_allocated,
        # synthetic probes are exact replays of the same step: they widen the span of the secant
        bytes_per_sample=_slope_near(best, probes),
        probes=probes,
        neighbours=tuple(_as_probe(real.point(b)) for b in around),
        margin=margin,
        raw_batch_size=raw,
        checked_from=found.checked_from,
        failing_above=found.failing,
        check_capped=found.capped,
        replays=real.replays,
        batch_size_with_expandable_segments=expandable,
    )


def _fit_each_setting(step: Step, budget: Budget, *, distributed: Distributed, margin: float, neighbours: int,
                      max_batch: int, extras: bool) -> FitResult:
    """``--checkpoint auto`` on one GPU: the batch search replays one setting's trace at other
    batches, so each of ``checkpoint auto``'s settings (torchtitan's every:N ladder, off to full,
    and selective-op; :mod:`memcalc.distributed.checkpoint_auto`) is fitted on its own, and the
    largest batch wins; on a tie, the setting that recomputes the fewest FLOPs at that batch
    (the lower peak on a tie of those). Each answer is its setting's own fit, so the chosen one
    fits the budget less the margin as any fit's does. The report's notes name the choice and
    every setting's batch."""
    settings = [*candidates(block_count(replace(step, batch_size=1))), Checkpointing(CheckpointKind.SELECTIVE_OP)]
    fitted: dict[Checkpointing, FitResult] = {}
    refused: DoesNotFitError | None = None
    for setting in settings:
        try:
            fitted[setting] = find_max_batch(replace(step, checkpoint=setting), budget, distributed=distributed,
                                             margin=margin, neighbours=neighbours, max_batch=max_batch, extras=extras)
        except DoesNotFitError as exc:
            refused = exc
    if not fitted:
        assert refused is not None
        raise refused
    best = max(result.batch_size for result in fitted.values())
    tied = [setting for setting, result in fitted.items() if result.batch_size == best]

    def cost(setting: Checkpointing) -> tuple[int, int]:
        report = run_estimate(replace(step, checkpoint=setting, batch_size=best, capacity=budget.capacity,
                                      record_costs=True), distributed)
        return report.flops().phase("recompute"), report.bytes.peak_allocated

    costs = {setting: cost(setting) for setting in tied} if len(tied) > 1 else {}
    chosen = min(tied, key=lambda setting: costs.get(setting, (0, 0)))
    result = fitted[chosen]
    recompute = (f", recomputing the fewest FLOPs of those ({costs[chosen][0] / 1e9:,.2f} GFLOP per step)"
                 if costs else "")
    notes = (f"checkpoint auto chose {chosen.label}: the largest batch, {best}, of its settings, each fitted"
             f"{recompute}",
             "checkpoint auto fitted: " + "; ".join(
                 f"{setting.label}: batch {fitted[setting].batch_size}" if setting in fitted
                 else f"{setting.label}: batch 1 does not fit" for setting in settings))
    return replace(result, report=replace(result.report, notes=(*notes, *result.report.notes)))


class _Point(NamedTuple):
    """A probe as the search sees it. ``needed``: for a batch that does not fit, the reserved
    peak of the replay under the budget, which runs on past its OOM — what the step needed,
    fragmentation included; the peak allocated for a batch that fits."""

    batch_size: int
    fits: bool
    peak_allocated: int
    needed: int
    synthetic: bool = False


@dataclass(frozen=True)
class _Found:
    """What a search found: ``best`` (the answer), ``top`` (the boundary it met first: ``top``
    fits, ``top + 1`` does not), every batch from ``checked_from`` to ``best`` fits, and the
    batches above ``best`` that do not."""

    best: int
    top: int
    checked_from: int
    failing: tuple[int, ...]
    family: AffineFamily | None = None
    capped: bool = False


class _Estimates:
    """The real estimates of one fit, each batch traced at most once, and the replays of the family.

    On one GPU a batch is traced for the whole budget and judged by replays of its trace alone:
    the replay without a limit that its report reads its peak off, and, when that one reserves
    more than the margin budget, one under it. Only a batch whose report is asked for (batch 2,
    whose breakdown gives the first jump, and the answer) is reported: the same report,
    built from the same trace. Under a multi-GPU strategy (no trace to replay) a batch is
    estimated under the margin budget.
    """

    def __init__(self, step: Step, distributed: Distributed, capacity: int, limit: int):
        self.step = step
        self.distributed = distributed
        self.capacity = capacity
        self.limit = limit
        self.single = distributed.is_single
        self.reports: dict[int, MemoryReport] = {}
        self.traces: dict[int, TracedStep] = {}
        self._unreported: dict[int, TracedEstimate] = {}  # traced, the report not made yet
        self._unlimited: dict[int, AllocatorStats] = {}  # replays without a limit, of traces not reported
        self.points: dict[int, _Point] = {}  # real estimates, judged under the margin budget
        self.order: list[_Point] = []  # the search's probes, real and synthetic, in order
        self.replays = 0
        self.made = 0  # real estimates (traces, on one GPU) made
        self._synthetic: dict[tuple[int, int], _Point] = {}
        report_progress(FITTING, 0, None)

    def point(self, batch: int) -> _Point:
        """A real estimate, judged under the margin budget."""
        if batch not in self.points:
            self.adopt(self._judge(batch))
        return self.points[batch]

    def adopt(self, point: _Point) -> None:
        """Record ``point`` as the real estimate of its batch (already traced): the family's
        replay at a batch whose trace is the family's is that trace's own."""
        real = point._replace(synthetic=False)
        self.points[point.batch_size] = real
        self.order.append(real)

    def whole(self, batch: int) -> _Point:
        """A real estimate, judged under the whole budget (one GPU, or no margin), as its report
        judges it."""
        self.point(batch)
        if not self._replayable(batch):
            return _point(self.estimate(batch), batch)
        return self._whole(batch)

    def _whole(self, batch: int) -> _Point:
        free = self._free(batch)
        peak = free.peak_allocated
        settings = self.step.allocator_settings
        # engine.run._fit_under: a replay under the budget where the one without a limit exceeds it
        if free.peak_reserved <= self.capacity and not (settings and settings.garbage_collection_threshold > 0.0):
            return _Point(batch, True, peak, peak)
        limited = self._replay(batch, self.capacity)
        return _Point(batch, limited.fits, peak, peak if limited.fits else max(peak, limited.reserved_within_capacity))

    def per_sample(self, batch: int) -> float:
        """Bytes per sample guessed from ``batch``'s peak: what is not model state, over the batch
        (:func:`batch_bytes`, read off the replay its report reads it off). Usually too high (it
        counts batch-independent temporaries), so the first jump undershoots."""
        if not self._replayable(batch):
            return batch_bytes(self.estimate(batch)) / batch
        traced = self.traces[batch]
        totals = category_totals_at(traced.program(), traced.trace.nbytes, traced.categories,
                                    max(self._free(batch).peak_index, 0))
        return sum(nbytes for category, nbytes in totals.items() if category not in MODEL_STATES) / batch

    def trace(self, batch: int) -> None:
        """Trace ``batch`` for the whole budget (each batch at most once) and keep its trace; under
        a strategy, estimate it."""
        if batch in self.traces or batch in self.reports:
            return
        if not self.single:
            self.estimate(batch)
            return
        traced = trace_estimate(replace(self.step, batch_size=batch, capacity=self.capacity))
        self.traces[batch] = traced.traced
        self._unreported[batch] = traced
        self._count()

    def estimate(self, batch: int) -> MemoryReport:
        """The report at ``batch`` (each batch traced at most once)."""
        if batch in self.reports:
            return self.reports[batch]
        if self.single:
            self.trace(batch)
            report = self._unreported.pop(batch).report()
        else:
            report = run_estimate(replace(self.step, batch_size=batch, capacity=self.limit), self.distributed)
            self._count()
        self.reports[batch] = report
        return report

    def _count(self) -> None:
        self.made += 1
        report_progress(FITTING, self.made, None)  # how many the search takes is not known ahead

    def _replayable(self, batch: int) -> bool:
        """Whether ``batch`` is judged off replays of its trace (one GPU, not yet reported; a
        generation's report replays it faster than a plain replay), traced if it is."""
        if not self.single or batch in self.reports or self.step.mode is Mode.GENERATE:
            return False
        self.trace(batch)
        return batch not in self.reports

    def _judge(self, batch: int) -> _Point:
        if not self._replayable(batch):
            report = self.estimate(batch)
            if not self.single or self.limit == self.capacity:
                return _point(report, batch)
            peak, reserved = report.bytes.peak_allocated, report.peak_reserved_unconstrained
        elif self.limit == self.capacity:
            return self._whole(batch)
        else:  # the replay the report reads its peak off, without the report
            free = self._free(batch)
            peak, reserved = free.peak_allocated, free.peak_reserved
        if reserved <= self.limit:  # never meets the limit: no replay needed
            return _Point(batch, True, peak, peak)
        self.replays += 1
        replayed = self._replay(batch, self.limit)
        return _Point(batch, replayed.fits, peak, _needed(replayed))

    def _free(self, batch: int) -> AllocatorStats:
        """The replay of ``batch``'s trace without a limit: the one its report reads its peak off."""
        if batch not in self._unlimited:
            traced = self.traces[batch]
            self._unlimited[batch] = replay_stats(traced.program(), traced.trace.nbytes, None,
                                                  self.step.allocator_settings, host=not self.step.emulate_cuda)
        return self._unlimited[batch]

    def _replay(self, batch: int, capacity: int) -> SyntheticPoint:
        traced = self.traces[batch]
        return replay_under(traced.program(), traced.trace.nbytes, capacity, batch, self.step.allocator_settings,
                            host=not self.step.emulate_cuda)

    def known(self, batch: int) -> _Point | None:
        """The search's judgement of ``batch`` under the margin budget, when it made one (a real
        estimate or a replay of the family); None otherwise."""
        return self.points.get(batch) or self._synthetic.get((batch, self.limit))

    def synthetic(self, family: AffineFamily, batch: int, capacity: int, *, probe: bool = False) -> _Point:
        """The family's replay at ``batch`` under ``capacity`` (a real estimate where there is
        one); ``probe``: a probe of the search, listed in ``order``."""
        if batch in self.points:
            return self.points[batch] if capacity == self.limit else self.whole(batch)
        key = (batch, capacity)
        if key not in self._synthetic:
            self.replays += 1
            replayed = family.probe(batch, capacity, self.step.allocator_settings)
            self._synthetic[key] = _Point(batch, replayed.fits, replayed.peak_allocated, _needed(replayed), True)
            if probe:
                self.order.append(self._synthetic[key])
        return self._synthetic[key]

    def report_under_budget(self, batch: int) -> MemoryReport:
        """The estimate at ``batch`` against the whole budget (under a strategy with a margin,
        one more estimate: the search's were made under the margin budget)."""
        self.point(batch)
        if self.single or self.limit == self.capacity:
            return self.estimate(batch)
        return run_estimate(replace(self.step, batch_size=batch, capacity=self.capacity), self.distributed)


def _needed(replayed: SyntheticPoint) -> int:
    return replayed.peak_allocated if replayed.fits else max(replayed.peak_allocated,
                                                             replayed.reserved_within_capacity)


def _as_probe(point: _Point) -> Probe:
    return Probe(point.batch_size, point.fits, point.peak_allocated, point.synthetic)


def _affine_search(real: _Estimates, first: _Point, slope_hint: float | None, max_batch: int) -> _Found | None:
    """The search on a batch-affine family built from two real traces, its boundary checked
    downward by replays (:func:`_check_below`) and its answer traced for real; None when the
    step is not batch-affine or the answer's trace is not the family's (the caller then
    searches with real estimates, reusing the ones made here).

    Real estimates: the first probe (batch 2), one jump toward the budget and the answer —
    three for a batch-affine step, whatever the allocator's fragmentation (the replays include
    it). When the first two differ in structure the family comes from the jump and the next
    point on the line through them — four."""
    limit = real.limit
    start = first.batch_size
    jump = min(max(_extrapolate({start: first}, start, limit, slope_hint), start + 1), start * _MAX_GROWTH,
               max_batch)
    seen = {start: first, jump: real.point(jump)}
    family = _family(real.traces, start, jump)
    if family is None and jump < max_batch:
        line = _extrapolate(seen, jump, limit, slope_hint) if seen[jump].fits else (start + jump) // 2
        second = min(max(line, 2), max_batch)
        if second != jump:
            real.point(second)
            family = _family(real.traces, min(jump, second), max(jump, second))
    if family is None:
        return None
    affine = family

    def under_limit(batch: int) -> _Point:
        return real.synthetic(affine, batch, limit, probe=True)

    try:
        top, _ = _search(under_limit, limit, first=first, slope_hint=slope_hint, max_batch=max_batch)
    except _Unbounded:
        return None
    check = _check_below(lambda b: real.synthetic(affine, b, limit), top, limit, floor=start, seen=real.order)
    best = check.answer
    # traced for real: it must be the family's step at that batch, whose replay is then its own
    if best not in real.points:
        real.trace(best)
        if not family.matches(real.traces[best], best):
            real.point(best)  # an estimate like the others: judged, and listed among the probes
            return None
        replayed = real.synthetic(affine, best, limit)
        real.adopt(replayed._replace(peak_allocated=real.estimate(best).bytes.peak_allocated))
    elif not family.matches(real.traces[best], best) or not real.points[best].fits:
        return None
    return _Found(best, top, check.checked_from, check.failing, family, check.capped)


#: The replays the search for a larger batch under expandable segments may make (gallop up,
#: then bisect). A replay of a large model's step costs about a second, and the gain is a few
#: batches (fragmentation is a few percent of the peak), so the search is short: its answer is
#: a batch that fits, the largest it found.
_MAX_EXPANDABLE_REPLAYS = 8


def _with_expandable_segments(family: AffineFamily | None, best: int, limit: int, step: Step,
                              max_batch: int, above: _Point | None) -> int | None:
    """A batch larger than ``best`` (found with segments that do not expand) that fits ``limit``
    with ``expandable_segments:True``, the largest found, or None. Asked only when the next
    batch, ``above`` (as the search judged it), failed for fragmentation alone (its peak
    allocated under the limit), which expandable segments mostly remove (one growing segment per
    pool, mapped page by page). Found on the batch-affine ``family`` by replays alone, so it
    costs no estimate; None without a family (a strategy, a step not affine in the batch), on the
    CPU target, or when the settings already expand."""
    settings = step.allocator_settings
    if family is None or family.host or (settings is not None and settings.expandable_segments):
        return None
    if above is None or above.fits or above.peak_allocated > limit:
        return None  # not a fragmentation failure (or not judged): no segment layout saves it
    expanding = replace(settings or AllocConf(), expandable_segments=True)
    replays = 0

    def fits(batch: int) -> bool:
        nonlocal replays
        replays += 1  # a batch the floor rules out counts as a replay: the search's path stays the same
        return family.least_peak(batch) <= limit and family.probe(batch, limit, expanding).fits

    if best >= max_batch or not fits(best + 1):
        return None
    lo, hi, stride = best + 1, None, 1  # lo fits; hi (when known) does not
    while hi is None and replays < _MAX_EXPANDABLE_REPLAYS:
        stride *= 2
        probe = min(lo + stride, max_batch)
        if fits(probe):
            lo = probe
            if probe == max_batch:
                return lo
        else:
            hi = probe
    while hi is not None and hi - lo > 1 and replays < _MAX_EXPANDABLE_REPLAYS:
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if fits(middle) else (lo, middle)
    return lo


def _check_below(point: Callable[[int], _Point], top: int, limit: int, *, floor: int,
                 seen: Sequence[_Point] = ()) -> _Check:
    """Walk down from the boundary ``top`` (it fits, ``top + 1`` does not), replaying every
    batch: each that does not fit moves the answer under it. Stop at a fitting batch at least
    ``_CHECK_WINDOW`` under the answer that is *clear*: its peak allocated would stay within
    ``limit`` with ``_CHECK_FRAGMENTATION`` times the worst fragmentation of a failing probe on
    top — ``top + 1``, those in ``seen`` (the search's) whose peak allocated is within ``limit``,
    and those the walk meets. Or at ``floor`` (a real estimate that fits). After
    ``_MAX_CHECK_REPLAYS`` the walk only finishes its window under the answer (``capped``)."""
    factor = max(_fragmentation(p) for p in (point(top + 1), *(p for p in seen if p.peak_allocated <= limit)))
    answer = lowest = top
    failing: list[int] = []
    batch, replays, capped = top - 1, 0, False
    while batch >= floor:
        replayed = point(batch)
        replays += 1
        if not replayed.fits:
            failing.append(batch)
            answer = batch - 1
            factor = max(factor, _fragmentation(replayed))
        else:
            lowest = batch
            if answer - batch >= _CHECK_WINDOW:
                if _clear(replayed, factor, limit):
                    break
                if replays >= _MAX_CHECK_REPLAYS:  # the cost bound: the window under the answer, no more
                    capped = True
                    break
        batch -= 1
    return _Check(answer, min(lowest, answer), tuple(sorted(failing)), capped)


class _Check(NamedTuple):
    """What :func:`_check_below` found: every batch from ``checked_from`` to ``answer`` fits,
    ``failing`` (ascending) are the batches above it that do not; ``capped``: the walk met its
    cost bound."""

    answer: int
    checked_from: int
    failing: tuple[int, ...]
    capped: bool = False


def _clear(point: _Point, factor: float, limit: int) -> bool:
    """Whether ``point`` would fit with ``_CHECK_FRAGMENTATION`` times fragmentation ``factor``."""
    return point.fits and point.peak_allocated * (1 + _CHECK_FRAGMENTATION * (factor - 1)) <= limit


def _fragmentation(point: _Point) -> float:
    """Bytes a failing probe needed per byte it had allocated at its peak (1 for one that fits)."""
    return 1.0 if point.fits else point.needed / max(point.peak_allocated, 1)


def _raw_boundary(real: _Estimates, found: _Found, first: int, slope_hint: float | None,
                  max_batch: int) -> int | None:
    """The boundary under the whole budget that a search with no margin meets (``top`` then): the
    same search — from the same first probe, with the same per-sample guess — under the whole
    budget, on the family's replays when there is one; without a family, on real estimates
    from the answer up, at most ``_RAW_ESTIMATES`` more (one GPU; None when they do not settle
    it, and under a strategy, whose estimates were made under the margin budget). Where fits is
    monotone in the batch there is one boundary; where the allocator's fragmentation makes it
    ragged, this one."""
    if real.limit == real.capacity:
        return found.top
    family = found.family
    measure: Callable[[int], _Point]
    if family is not None:
        measure = lambda batch: real.synthetic(family, batch, real.capacity)
    elif real.single:
        measure, first = _limited(real, _RAW_ESTIMATES), found.best
    else:
        return None
    start = real.whole(first)  # estimated for real
    if not start.fits:
        return None
    try:
        raw, _ = _search(measure, real.capacity, first=start, slope_hint=slope_hint, max_batch=max_batch)
    except _Unbounded:
        return None
    return raw


def _limited(real: _Estimates, estimates: int) -> Callable[[int], _Point]:
    """``real.whole`` that raises :class:`_Unbounded` rather than make more than ``estimates``
    new estimates."""
    spent = real.made

    def measure(batch: int) -> _Point:
        if batch not in real.traces and real.made - spent >= estimates:
            raise _Unbounded  # not worth more estimates: the caller leaves the answer unknown
        return real.whole(batch)

    return measure


def _family(traces: dict[int, TracedStep], b1: int, b2: int) -> AffineFamily | None:
    if b1 not in traces or b2 not in traces:
        return None
    return AffineFamily.from_traces(traces[b1], b1, traces[b2], b2)


def _point(report: MemoryReport, batch: int) -> _Point:
    fits = bool(report.fits)
    peak = report.bytes.peak_allocated
    reserved = report.reserved_within_capacity
    return _Point(batch, fits, peak, peak if fits or reserved is None else max(peak, reserved))


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

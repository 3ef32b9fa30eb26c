"""The largest batch that fits a memory budget, and sweeps over batch sizes and settings.

Fit criterion
-------------
A batch fits when :func:`memcalc.estimate` with ``capacity=`` says so: the step's alloc/free
sequence replayed through the caching-allocator model under that limit never runs out of
memory (the allocator frees its cache and retries first, as PyTorch does). It is *not* a
comparison of the peak with the budget: fragmentation can make a step whose peak allocated
is under the budget fail.

The search
----------
One estimate costs the same at any batch size (meta tensors), so the search minimises the
number of estimates, not their size. Memory is close to affine in the batch size for most
models (a constant for the model states plus a per-sample part), but only piecewise: at small
batches the peak is often in the optimizer step, later in backward (the peak is the maximum
of several lines), and padding, kernel choices or attention can add steps. So the line is a
guide and never the answer:

0. *Batch-affine shortcut* (single GPU). Estimate batch 2 (if it does not fit, batch 1: the
   answer is 1, or :class:`DoesNotFitError`), then one jump toward the budget. When the two
   traces have the same structure and every storage's size is affine in the batch
   (:mod:`memcalc.affine`), the steps below run on *synthetic* probes — the same alloc/free
   sequence at any batch, replayed through the allocator model in milliseconds — and the
   answer is then confirmed by real estimates at B and B + 1. Batch 1 is skipped because it is
   often structurally special (a batch dimension of 1 broadcasts without a reduction). If
   the first two traces differ, the family comes from the jump and the next point on the
   line; if no family forms or the confirmation disagrees, the search below runs on real
   estimates, reusing those already made.
1. Estimate batch 1. If it does not fit, raise :class:`DoesNotFitError`.
2. *Expand*: extrapolate the line through the two largest fitting batches (after batch 1
   alone, a per-sample guess from batch 1's breakdown) to the budget and estimate there,
   until a batch does not fit. A flat curve grows the batch geometrically, up to
   ``max_batch`` (:class:`BatchLimitError` if even that fits).
3. *Narrow* the bracket ``lo`` (fits) < ``hi`` (does not) with the line through both ends
   (regula falsi). Its target is the budget less the fragmentation ``hi`` showed: a replay
   under the limit runs on past its OOM, so the reserved peak of a failing batch is what it
   needed; the ratio of that to its peak allocated scales the budget down. A boundary
   predicted at ``lo`` is confirmed at ``lo + 1``; if that fits too, the line was short and
   the search gallops up (``lo + 2``, ``+ 4``, ...). Two steps in a row that do not halve
   the bracket make the next one a bisection. The search stops only when ``hi == lo + 1``,
   both estimated: batch ``lo`` fits and ``lo + 1`` does not. A curve that is not affine
   costs more estimates, never a wrong answer (where fits is not monotone in the batch —
   fragmentation can do that — ``lo`` is *a* boundary, not necessarily the last).

With the shortcut, a fit on the zoo's models and the catalogue's GPUs costs 4 real estimates
(batch 2, one jump, B and B + 1) plus a few synthetic replays; without it (non-affine steps,
multi-GPU strategies) 4 to 7 (batch 1, one jump, an overshoot that measures the
fragmentation, the batch and its successor); ``benchmarks/speed_fit.py`` measures both.

Budgets
-------
Exactly one of ``budget``, ``gpu`` or ``device`` says how many bytes the caching allocator
may reserve (:func:`resolve_budget`):

* ``budget`` (``"24GiB"``, ``"80GB"``, an int): used as is — it is the memory the step may
  use; nothing is subtracted.
* ``gpu`` (a catalogue name): the card's CUDA-reported memory minus its assumed CUDA
  context (:attr:`memcalc.cuda.gpus.catalogue.GpuProfile.usable_memory`).
* ``device`` (``"cuda:1"``, ``"auto"``): that local GPU's free memory, minus the context a
  new process will create on it (the catalogue's estimate for the card, else the generic
  512 MiB) — unless this process had already initialised CUDA before the question, in which
  case the step is taken to run here and its context is already out of the free memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from memcalc import api
from memcalc.search.affine import AffineFamily
from memcalc.cuda.gpus import catalogue as gpu_catalogue
from memcalc.core.categories import Category, Mode
from memcalc.core.errors import InvalidInputError, MemcalcError
from memcalc.engine.optimizers import Optimizer
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport
from memcalc.core.units import BYTES_FORMS, format_bytes, parse_bytes

__all__ = (
    "MAX_BATCH",
    "BatchLimitError",
    "Budget",
    "DoesNotFitError",
    "FitResult",
    "Probe",
    "SweepPoint",
    "iter_sweep",
    "max_batch_size",
    "resolve_budget",
    "sweep",
    "sweep_configurations",
)

#: Largest batch the search tries: beyond it a model is "too small to bound".
MAX_BATCH = 2**20
#: While expanding, one jump multiplies the largest fitting batch by at most this.
_MAX_GROWTH = 256
#: While expanding on a curve that does not grow (or a per-sample guess of 0), multiply by this.
_FLAT_GROWTH = 16
#: Narrowing steps in a row that may fail to halve the bracket before a bisection step.
_SLOW_STEPS = 2

_MODEL_STATES = (Category.PARAMETERS, Category.BUFFERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


# --------------------------------------------------------------------------------------------
# Results and errors
# --------------------------------------------------------------------------------------------


class Probe(NamedTuple):
    """One probe of the search: ``(batch_size, fits, peak_allocated, synthetic)``.
    ``synthetic``: answered by replaying two real traces' batch-affine sizes through the
    allocator model (:mod:`memcalc.affine`), not by an estimate of its own."""

    batch_size: int
    fits: bool
    peak_allocated: int
    synthetic: bool = False


@dataclass(frozen=True)
class Budget:
    """Bytes the caching allocator may reserve, and where the number comes from.

    ``gpu``: the catalogue entry of the card, when one is known (given, or recognised from
    a local device's name); estimates then model that card's kernels and workspaces.
    """

    capacity: int
    source: str
    gpu: gpu_catalogue.GpuProfile | None = None


@dataclass(frozen=True)
class FitResult:
    """The largest batch that fits, its report, and how the search got there.

    ``headroom``: budget minus the peak allocated at ``batch_size``. ``bytes_per_sample``:
    the slope of the peak near ``batch_size`` (the secant over the widest span of probes
    between half and twice that batch). ``probes``: the search's estimates, in the order
    made (``num_estimates`` of them). ``neighbours``: batches around ``batch_size`` when
    asked for, sorted, reusing the probes (their extra estimates are not in ``probes``).
    """

    batch_size: int
    report: MemoryReport
    budget: Budget
    headroom: int
    bytes_per_sample: float
    probes: tuple[Probe, ...]
    neighbours: tuple[Probe, ...] = ()

    @property
    def budget_bytes(self) -> int:
        return self.budget.capacity

    @property
    def num_estimates(self) -> int:
        """Real estimates (symbolic runs of the step) the search made."""
        return sum(1 for p in self.probes if not p.synthetic)

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc fit --format json`` contract: batch, budget and the estimate JSON."""
        return {"batch_size": self.batch_size, "budget_bytes": self.budget_bytes, "report": self.report.to_dict()}


class DoesNotFitError(MemcalcError):
    """Even batch 1 does not fit; ``report`` is batch 1's estimate under the budget."""

    exit_code = 1

    def __init__(self, report: MemoryReport, budget: Budget):
        needed = report.bytes.peak_allocated
        states = _model_state_bytes(report)
        per_sample = _batch_bytes(report)
        dominant = "model states" if states >= per_sample else "activations"
        over = (f"{format_bytes(needed - budget.capacity)} over"
                if needed > budget.capacity else "under the budget, but the allocator's cache fragments it")
        message = (
            f"even batch 1 does not fit in {format_bytes(budget.capacity)} ({budget.source}): "
            f"one step of {report.model} needs {format_bytes(needed)} at batch 1 ({over}). "
            f"Model states (parameters, gradients, optimizer state) take {format_bytes(states)}"
            f"{_share(states, needed)}, activations and temporaries {format_bytes(per_sample)}"
            f"{_share(per_sample, needed)}: {dominant} dominate."
        )
        super().__init__(message, hint=_suggestions(dominant, report))
        self.report = report
        self.budget = budget
        self.dominant = dominant


class BatchLimitError(MemcalcError):
    """Even the largest batch the search tries fits: the budget does not bound the batch."""

    exit_code = 1

    def __init__(self, max_batch: int, report: MemoryReport, budget: Budget):
        super().__init__(
            f"batch {max_batch:,} still fits in {format_bytes(budget.capacity)} ({budget.source}), "
            f"peaking at {format_bytes(report.bytes.peak_allocated)}: the model is too small for "
            f"this budget to bound its batch size",
            hint="Use a smaller budget, or estimate the batch you mean to run (memcalc MODEL --batch N).",
        )
        self.max_batch = max_batch
        self.report = report


def _share(part: int, whole: int) -> str:
    return f" ({100.0 * part / whole:.0f}%)" if whole else ""


_LIGHTER_OPTIMIZER = {"adam": "sgd-momentum or sgd", "adamw": "sgd-momentum or sgd", "rmsprop": "sgd",
                      "adagrad": "sgd", "sgd-momentum": "sgd"}


def _suggestions(dominant: str, report: MemoryReport) -> str:
    """What would shrink the step, the dominant part's remedies first; only the remedies
    that apply to this step (no optimizer advice for eval, no precision the step has)."""
    training = report.mode is Mode.TRAIN
    precision = report.precision
    lighter = _LIGHTER_OPTIMIZER.get(report.optimizer) if training else None
    state_help = [
        f"a lighter optimizer (--optim {lighter}: less optimizer state per parameter)" if lighter else None,
        "lower precision (--precision bf16 or fp16 halves parameters and gradients)"
        if precision in (Precision.FP32, Precision.AMP_BF16, Precision.AMP_FP16) else None,
        "sharding the model states across GPUs (FSDP, DeepSpeed ZeRO)",
    ]
    activation_help = [
        "activation checkpointing (--checkpoint: keeps block inputs, recomputes the rest in backward)"
        if training else None,
        "mixed precision (--precision amp-bf16 or amp-fp16 halves most activations)"
        if precision is Precision.FP32 else None,
        "a shorter sequence or a smaller input (--seq-len, --input-shape)",
    ]
    ordered = state_help + activation_help if dominant == "model states" else activation_help + state_help
    return "What would help: " + "; ".join(s for s in ordered if s) + "."


# --------------------------------------------------------------------------------------------
# Budgets
# --------------------------------------------------------------------------------------------


def resolve_budget(
    budget: str | int | Budget | None = None,
    gpu: str | gpu_catalogue.GpuProfile | None = None,
    device: str | None = None,
    *,
    local_gpus: Callable[[], Sequence[gpu_catalogue.LocalGpu]] | None = None,
) -> Budget:
    """Bytes the caching allocator may reserve, from exactly one of the three sources (see
    the module docstring); a :class:`Budget` is returned as is. ``local_gpus`` replaces GPU
    discovery (tests)."""
    given = [name for name, value in (("budget", budget), ("gpu", gpu), ("device", device)) if value is not None]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise InvalidInputError(f"give exactly one of budget, gpu or device (got {what})")
    if isinstance(budget, Budget):
        return budget
    if budget is not None:
        return _from_budget(budget)
    if gpu is not None:
        return _from_gpu(gpu)
    assert device is not None
    return _from_device(device, local_gpus)


def _from_budget(budget: str | int) -> Budget:
    try:
        capacity = parse_bytes(budget)
    except ValueError as exc:
        raise InvalidInputError(str(exc), hint=f"A budget is {BYTES_FORMS}.") from None
    return Budget(capacity, "as given")


def _from_gpu(gpu: str | gpu_catalogue.GpuProfile) -> Budget:
    profile = gpu if isinstance(gpu, gpu_catalogue.GpuProfile) else gpu_catalogue.get_gpu(gpu)
    usable = profile.usable_memory
    if usable is None or profile.total_memory is None:
        raise InvalidInputError(
            f"GPU {profile.key!r} has no known capacity",
            hint="Name a GPU model (e.g. a100-40gb) or give a budget (e.g. 24GiB).")
    source = (f"{profile.key}: {format_bytes(profile.total_memory)} "
              f"− {format_bytes(profile.cuda_context)} CUDA context (assumed)")
    return Budget(usable, source, profile)


def _from_device(spec: str, local_gpus: Callable[[], Sequence[gpu_catalogue.LocalGpu]] | None) -> Budget:
    context_exists = _cuda_initialised()  # read before discovery, which may initialise CUDA
    found = local_gpus() if local_gpus is not None else gpu_catalogue.list_local_gpus()
    chosen = gpu_catalogue.resolve_device(spec, found)
    profile = chosen.profile
    context = 0 if context_exists else (profile or gpu_catalogue.GENERIC).cuda_context
    capacity = chosen.free_memory - context
    label = f"{chosen.device} ({chosen.name}): {format_bytes(chosen.free_memory)} free"
    if context:
        label += f" − {format_bytes(context)} CUDA context (assumed)"
    if capacity <= 0:
        raise InvalidInputError(f"{label}: nothing is left for a training step",
                                hint="Free memory on that GPU, or pick another (memcalc gpus lists them).")
    return Budget(capacity, label, profile)


def _cuda_initialised() -> bool:
    """Whether this process already holds a CUDA context (never creates one)."""
    import torch

    return bool(torch.cuda.is_initialized())


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------


def max_batch_size(
    model: Any,
    *,
    budget: str | int | Budget | None = None,
    gpu: str | gpu_catalogue.GpuProfile | None = None,
    device: str | None = None,
    optimizer: Optimizer | str = Optimizer.ADAM,
    precision: Precision | str | None = None,
    neighbours: int = 0,
    max_batch: int = MAX_BATCH,
    **estimate_options: Any,
) -> FitResult:
    """The largest batch whose step fits ``budget``, ``gpu`` or ``device`` (give exactly
    one; see :func:`resolve_budget`).

    ``estimate_options`` go to :func:`memcalc.estimate` unchanged (``input_shape``,
    ``seq_len``, ``mode``, ``loss``, ...); ``precision`` is passed only when given.
    ``neighbours=k`` also estimates the batches within ``k`` of the answer. Raises
    :class:`DoesNotFitError` when batch 1 does not fit and :class:`BatchLimitError` when
    ``max_batch`` still does.
    """
    if max_batch < 1 or neighbours < 0:
        raise InvalidInputError(f"max_batch must be ≥ 1 and neighbours ≥ 0 (got {max_batch}, {neighbours})")
    resolved = resolve_budget(budget, gpu, device)
    options = _estimate_options(estimate_options, optimizer=optimizer, precision=precision, budget=resolved)
    reports: dict[int, MemoryReport] = {}
    traces: dict[int, Any] = {}
    order: list[_Point] = []
    single_gpu = options.get("strategy", "single") == "single"

    def measure(batch: int) -> _Point:
        """A real estimate (each batch at most once)."""
        if batch not in reports:
            keep = (lambda traced: traces.__setitem__(batch, traced)) if single_gpu else None
            reports[batch] = api.estimate(model, batch_size=batch, capacity=resolved.capacity, on_trace=keep,
                                          **options)
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


def _affine_search(measure: Callable[[int], "_Point"], traces: dict[int, Any], order: list["_Point"],
                   capacity: int, first: "_Point", slope_hint: float | None, max_batch: int) -> int | None:
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


def _family(traces: dict[int, Any], b1: int, b2: int) -> AffineFamily | None:
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
    return _batch_bytes(report) / report.batch_size


def _model_state_bytes(report: MemoryReport) -> int:
    return sum(report.bytes.category(c) for c in _MODEL_STATES)


def _batch_bytes(report: MemoryReport) -> int:
    """Bytes at the peak in the categories that are not model states (inputs, activations,
    temporaries, ...): the part that grows with the batch."""
    return sum(report.bytes.category(c) for c in Category if c not in _MODEL_STATES)


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


def _estimate_options(options: dict[str, Any], *, optimizer: Optimizer | str, precision: Precision | str | None,
                      budget: Budget | None) -> dict[str, Any]:
    """Options for :func:`memcalc.estimate`: the user's, the optimizer, ``precision`` when
    given, and ``gpu`` when the budget names a card (its kernels and workspaces)."""
    for fixed in ("batch_size", "capacity", "inputs"):
        if fixed in options:
            raise InvalidInputError(
                f"{fixed} cannot be given here: the search sets the batch size and capacity",
                hint="Give input_shape or seq_len for the shape of one sample.")
    merged = {k: v for k, v in options.items() if v is not None}
    merged["optimizer"] = optimizer
    if precision is not None:
        merged["precision"] = precision
    if budget is not None and budget.gpu is not None and "gpu" not in merged:
        merged["gpu"] = budget.gpu.key
    return merged


# --------------------------------------------------------------------------------------------
# Sweeps
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    """One configuration of a sweep and its estimate (``fits`` is None without a budget)."""

    batch_size: int
    optimizer: str
    precision: str | None
    report: MemoryReport

    @property
    def fits(self) -> bool | None:
        return self.report.fits

    @property
    def series(self) -> str:
        """The configuration without the batch: one line of a plot."""
        return self.optimizer if self.precision is None else f"{self.optimizer}, {self.precision}"

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "optimizer": self.optimizer, "precision": self.precision,
                "fits": self.fits, "report": self.report.to_dict()}


def sweep_configurations(
    batch_sizes: Sequence[int],
    optimizers: Sequence[Optimizer | str] = (Optimizer.ADAM,),
    precisions: Sequence[Precision | str | None] = (None,),
) -> list[tuple[int, str, str | None]]:
    """Every ``(batch, optimizer, precision)`` in sweep order (by series, then batch);
    raises :class:`InvalidInputError` naming the first invalid item."""
    batches = [_check_batch(b) for b in batch_sizes]
    optims = [_check_optimizer(o) for o in optimizers]
    precs = [_check_precision(p) for p in precisions]
    if not batches or not optims or not precs:
        raise InvalidInputError("a sweep needs at least one batch size, optimizer and precision")
    return [(b, o, p) for o, p in itertools.product(optims, precs) for b in sorted(set(batches))]


def iter_sweep(
    model: Any,
    *,
    batch_sizes: Sequence[int],
    optimizers: Sequence[Optimizer | str] = (Optimizer.ADAM,),
    precisions: Sequence[Precision | str | None] = (None,),
    budget: str | int | Budget | None = None,
    gpu: str | gpu_catalogue.GpuProfile | None = None,
    device: str | None = None,
    **estimate_options: Any,
) -> Iterator[SweepPoint]:
    """Estimate every configuration, yielding each as it is done (for progress bars).

    A budget (at most one of ``budget``, ``gpu``, ``device``) adds ``fits`` to every point.
    All items are checked before the first estimate.
    """
    configs = sweep_configurations(batch_sizes, optimizers, precisions)
    resolved = resolve_budget(budget, gpu, device) if any(x is not None for x in (budget, gpu, device)) else None
    capacity = resolved.capacity if resolved is not None else None
    for batch, optimizer, precision in configs:
        options = _estimate_options(estimate_options, optimizer=optimizer, precision=precision, budget=resolved)
        report = api.estimate(model, batch_size=batch, capacity=capacity, **options)
        yield SweepPoint(batch, optimizer, precision, report)


def sweep(
    model: Any,
    *,
    batch_sizes: Sequence[int],
    optimizers: Sequence[Optimizer | str] = (Optimizer.ADAM,),
    precisions: Sequence[Precision | str | None] = (None,),
    budget: str | int | Budget | None = None,
    gpu: str | gpu_catalogue.GpuProfile | None = None,
    device: str | None = None,
    **estimate_options: Any,
) -> list[SweepPoint]:
    """:func:`iter_sweep`, collected: ``sweep("resnet50", batch_sizes=[1, 16, 64],
    optimizers=["sgd", "adam"], gpu="a100-40gb")``."""
    return list(iter_sweep(model, batch_sizes=batch_sizes, optimizers=optimizers, precisions=precisions,
                           budget=budget, gpu=gpu, device=device, **estimate_options))


def _check_batch(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"batch size {value!r} is not a positive integer")
    return value


def _check_optimizer(value: Optimizer | str) -> str:
    try:
        return Optimizer(str(getattr(value, "value", value)).lower()).value
    except ValueError:
        raise InvalidInputError(
            f"unknown optimizer {value!r}; choose from: {', '.join(o.value for o in Optimizer)}") from None


def _check_precision(value: Precision | str | None) -> str | None:
    if value is None:
        return None
    try:
        return Precision(str(getattr(value, "value", value)).lower()).value
    except ValueError:
        raise InvalidInputError(
            f"unknown precision {value!r}; choose from: {', '.join(p.value for p in Precision)}") from None

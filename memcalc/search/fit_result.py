"""The errors and the answer of a search that meets a memory budget: the margin held back, the
largest batch that fits (:class:`FitResult`), and why none does (:class:`DoesNotFitError`,
:class:`BatchLimitError`). The budget itself — how many bytes the caching allocator may
reserve, from a number, a catalogue GPU or a local device — is resolved below the table of
fields, in :mod:`memcalc.targets.budget`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from memcalc.core.categories import Category, Mode
from memcalc.core.errors import InvalidInputError, MemcalcError
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport
from memcalc.core.units import format_bytes
from memcalc.engine.optimizers import OPTIMIZERS
from memcalc.targets.budget import Budget

__all__ = (
    "DEFAULT_MARGIN",
    "MODEL_STATES",
    "BatchLimitError",
    "DoesNotFitError",
    "FitResult",
    "Probe",
    "batch_bytes",
    "check_margin",
    "format_margin",
    "margin_capacity",
    "model_state_bytes",
)

#: The flat margin ``memcalc fit`` / ``max_batch_size`` held back by default before the one
#: measured per class of step (:mod:`memcalc.search.margins`, now the default); still what the
#: error hints quote as an example of a fraction. Its basis: two over-promises on a 24 GiB GPU:
#: resnet152, answered 265, ran out of memory at 256 (the answer ≥ 3.4% too large), and
#: efficientnet_b0, answered 542, ran out at 512 (≥ 5.5%). Both are lower bounds (the real
#: boundary was not searched). Holding back a fraction m of the budget lowers the answer by
#: about m or more (the model states do not shrink with the batch); 6% is 5.5% rounded up to a
#: whole percent, and on the closest configurations memcalc reproduces (resnet152, SGD with
#: momentum, amp-bf16, RTX 4090: 265; efficientnet_b0, SGD, amp-bf16: 541) it answers 249 and
#: 507, under the batches that failed. The CPU accuracy
#: table (README, "Accuracy": median 0.00%, worst 0.96%) measures the step's own tensors, not
#: the CUDA context or the kernels' workspaces, and adds nothing to this figure.
DEFAULT_MARGIN = 0.06

#: The categories that do not grow with the batch: the model's states.
MODEL_STATES = (Category.PARAMETERS, Category.BUFFERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


class Probe(NamedTuple):
    """One probe of the search: ``(batch_size, fits, peak_allocated, synthetic)``.
    ``synthetic``: answered by replaying two real traces' batch-affine sizes through the
    allocator model (:mod:`memcalc.search.affine`), not by an estimate of its own."""

    batch_size: int
    fits: bool
    peak_allocated: int
    synthetic: bool = False


def check_margin(margin: object) -> float:
    """``margin`` as a float in [0, 1), or :class:`InvalidInputError` naming it."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise InvalidInputError(
            f"margin must be a fraction of the budget, at least 0 and under 1, got {margin!r}",
            hint=f"margin={DEFAULT_MARGIN} holds back {DEFAULT_MARGIN:.0%} of the budget; 0 gives the raw boundary.")
    return float(margin)


def margin_capacity(capacity: int, margin: float) -> int:
    """The bytes a step may reserve once ``margin`` (a fraction) of ``capacity`` is held back."""
    return capacity - math.ceil(capacity * margin)


@dataclass(frozen=True)
class FitResult:
    """The largest batch that fits, its report, and how the search got there.

    ``batch_size`` fits the budget less the ``margin`` (``margin_budget_bytes``); ``report`` is
    its estimate against the whole budget. ``headroom``: the whole budget minus the peak
    allocated at ``batch_size`` (the margin included). ``bytes_per_sample``: the slope of the
    peak near ``batch_size`` (the secant over the widest span of probes between half and twice
    that batch). ``probes``: the search's estimates and batch-affine replays under the margin
    budget, in the order made (``num_estimates`` estimates). ``neighbours``: batches around
    ``batch_size`` when asked for, sorted, each an estimate (their extra estimates are not in
    ``probes``), ``fits`` judged under the margin budget.

    ``raw_batch_size``: a batch that fits the whole budget while the next does not — the answer
    with no margin, as the search meets it coming from above (None where it is not searched:
    a multi-GPU strategy with a margin). ``checked_from``: every batch from it to
    ``batch_size`` was replayed (or estimated) and fits the margin budget (docs/architecture.md,
    "The batch search", says how far down the check goes). ``failing_above``: batches above
    ``batch_size`` found not to fit the margin budget although a larger one does (the
    allocator's fragmentation is not monotone in the batch). ``check_capped``: the check met its
    cost bound before its rule let it stop (the allocator fragments far under the boundary):
    batches under ``checked_from`` were not replayed. ``replays``: batch-affine replays made,
    the check's included. ``batch_size_with_expandable_segments``: on segments that do not expand,
    the largest batch that fits the margin budget with ``expandable_segments:True`` when that is
    larger (replays of the batch-affine family; None otherwise, or without a family).
    """

    batch_size: int
    report: MemoryReport
    budget: Budget
    headroom: int
    bytes_per_sample: float
    probes: tuple[Probe, ...]
    neighbours: tuple[Probe, ...] = ()
    margin: float = 0.0
    raw_batch_size: int | None = None
    checked_from: int | None = None
    failing_above: tuple[int, ...] = ()
    check_capped: bool = False
    replays: int = 0
    margin_basis: str = ""  # how the margin was derived (memcalc.search.margins); "" when the caller gave it
    batch_size_with_expandable_segments: int | None = None

    @property
    def budget_bytes(self) -> int:
        """The budget's capacity in bytes (``budget.capacity``)."""
        return self.budget.capacity

    @property
    def margin_budget_bytes(self) -> int:
        """The bytes the step was fitted under: the budget less the margin."""
        return margin_capacity(self.budget.capacity, self.margin)

    @property
    def num_estimates(self) -> int:
        """Real estimates (symbolic runs of the step) the search made."""
        return sum(1 for p in self.probes if not p.synthetic)

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc fit --format json`` contract: batch, budget, margin, the raw boundary,
        where the check below the batch started, and the estimate JSON."""
        return {"batch_size": self.batch_size, "budget_bytes": self.budget_bytes, "margin": self.margin,
                "margin_basis": self.margin_basis, "margin_budget_bytes": self.margin_budget_bytes,
                "raw_batch_size": self.raw_batch_size,
                "checked_from": self.checked_from, "report": self.report.to_dict()} | (
                    {} if self.batch_size_with_expandable_segments is None
                    else {"batch_size_with_expandable_segments": self.batch_size_with_expandable_segments})


class DoesNotFitError(MemcalcError):
    """Even batch 1 does not fit the budget less the margin; ``report`` is batch 1's estimate
    under the whole budget."""

    exit_code = 1

    def __init__(self, report: MemoryReport, budget: Budget, margin: float = 0.0):
        needed = report.bytes.peak_allocated
        limit = margin_capacity(budget.capacity, margin)
        states = model_state_bytes(report)
        per_sample = batch_bytes(report)
        dominant = "model states" if states >= per_sample else "activations"
        over = (f"{format_bytes(needed - limit)} over"
                if needed > limit else "under the budget, but the allocator's cache fragments it")
        where = f"{format_bytes(budget.capacity)} ({budget.source})"
        if margin:
            where += f" less the {format_margin(margin)} margin ({format_bytes(limit)})"
        message = (
            f"even batch 1 does not fit in {where}: "
            f"one step of {report.model} needs {format_bytes(needed)} at batch 1 ({over}). "
            f"Model states (parameters, gradients, optimizer state) take {format_bytes(states)}"
            f"{_share(states, needed)}, activations and temporaries {format_bytes(per_sample)}"
            f"{_share(per_sample, needed)}: {dominant} dominate."
        )
        hint = _suggestions(dominant, report)
        if margin and report.fits:
            hint += (f" Batch 1 fits the whole budget: --margin 0 (margin=0) answers without the "
                     f"{format_margin(margin)} held back for the estimate's error, at that risk.")
        super().__init__(message, hint=hint)
        self.report = report
        self.budget = budget
        self.margin = margin
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


def format_margin(fraction: float) -> str:
    """A margin as a percentage: ``0.06`` → ``"6%"``, ``0.065`` → ``"6.5%"``."""
    return f"{100 * fraction:.4g}%"


def _share(part: int, whole: int) -> str:
    return f" ({100.0 * part / whole:.0f}%)" if whole else ""


def _suggestions(dominant: str, report: MemoryReport) -> str:
    """What would shrink the step, the dominant part's remedies first; only the remedies
    that apply to this step (no optimizer advice for eval, no precision the step has)."""
    training = report.mode is Mode.TRAIN
    precision = report.precision
    spec = OPTIMIZERS.get(report.optimizer) if training else None
    lighter = spec.lighter if spec is not None else None  # the optimizer's own advice (OptimizerSpec.lighter)
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


def model_state_bytes(report: MemoryReport) -> int:
    """Bytes at the peak in the model states: parameters, buffers, gradients, optimizer state."""
    return sum(report.bytes.category(c) for c in MODEL_STATES)


def batch_bytes(report: MemoryReport) -> int:
    """Bytes at the peak in the categories that are not model states (inputs, activations,
    temporaries, ...): the part that grows with the batch."""
    return sum(report.bytes.category(c) for c in Category if c not in MODEL_STATES)

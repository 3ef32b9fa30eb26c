"""Memory budgets: how many bytes the caching allocator may reserve, from a number, a
catalogue GPU or a local device; and the errors of a search that meets one.

Exactly one of ``budget``, ``gpu`` or ``device`` says how many bytes the caching allocator
may reserve (:func:`resolve_budget`):

* ``budget`` (``"24GiB"``, ``"80GB"``, an int): used as is — it is the memory the step may
  use; nothing is subtracted.
* ``gpu`` (a catalogue name): the card's CUDA-reported memory minus its assumed CUDA
  context (:attr:`memcalc.core.gpu.GpuProfile.usable_memory`).
* ``device`` (``"cuda:1"``, ``"auto"``): that local GPU's free memory, minus the context a
  new process will create on it (the catalogue's estimate for the card, else the generic
  512 MiB) — unless this process had already initialised CUDA before the question, in which
  case the step is taken to run here and its context is already out of the free memory.
  ``gpu="auto"``, ``"cuda"`` or ``"cuda:N"`` names such a device too (as
  :func:`memcalc.estimate` reads it): one spelling for "this machine's GPU" across the API.
* ``gpu="cpu"``: the CPU target (what this machine's CPU allocates, unrounded), under
  ``budget`` when one is given too, else under this machine's available RAM (``MemAvailable``
  of ``/proc/meminfo``: what the kernel says a new allocation can have without swapping).

The context is the one of the software stack asked for (``stack``: its CUDA version and
module loading, or ``context_mib``; :mod:`memcalc.targets.stack`), as the estimate's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from memcalc.core.categories import Category, Mode
from memcalc.core.errors import InvalidInputError, MemcalcError
from memcalc.core.gpu import CPU_PROFILE, GENERIC, GpuProfile
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport
from memcalc.core.stack import Stack
from memcalc.core.units import BYTES_FORMS, format_bytes, parse_bytes
from memcalc.engine.optimizers import OPTIMIZERS
from memcalc.targets.cuda.gpus import catalogue as gpu_catalogue
from memcalc.targets.cuda.gpus import local as gpu_local
from memcalc.targets.stack import ResolvedStack, resolve_stack

__all__ = (
    "DEFAULT_MARGIN",
    "BatchLimitError",
    "Budget",
    "DoesNotFitError",
    "FitResult",
    "Probe",
    "available_ram",
    "batch_bytes",
    "check_margin",
    "format_margin",
    "margin_capacity",
    "model_state_bytes",
    "resolve_budget",
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

_MODEL_STATES = (Category.PARAMETERS, Category.BUFFERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


class Probe(NamedTuple):
    """One probe of the search: ``(batch_size, fits, peak_allocated, synthetic)``.
    ``synthetic``: answered by replaying two real traces' batch-affine sizes through the
    allocator model (:mod:`memcalc.search.affine`), not by an estimate of its own."""

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
    gpu: GpuProfile | None = None


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
    return sum(report.bytes.category(c) for c in _MODEL_STATES)


def batch_bytes(report: MemoryReport) -> int:
    """Bytes at the peak in the categories that are not model states (inputs, activations,
    temporaries, ...): the part that grows with the batch."""
    return sum(report.bytes.category(c) for c in Category if c not in _MODEL_STATES)


def resolve_budget(
    budget: str | int | Budget | None = None,
    gpu: str | GpuProfile | None = None,
    device: str | None = None,
    *,
    stack: Stack | None = None,
    local_gpus: Callable[[], Sequence[gpu_local.LocalGpu]] | None = None,
) -> Budget:
    """Bytes the caching allocator may reserve, from exactly one of the three sources (see
    the module docstring); a :class:`Budget` is returned as is. ``stack``: the software stack
    whose CUDA context is subtracted (None: the defaults). ``local_gpus`` replaces GPU
    discovery (tests)."""
    if _names_cpu(gpu) and not isinstance(budget, Budget):
        return _from_cpu(budget, device)
    given = [name for name, value in (("budget", budget), ("gpu", gpu), ("device", device)) if value is not None]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise InvalidInputError(f"give exactly one of budget, gpu or device (got {what})")
    if isinstance(budget, Budget):
        return budget
    if gpu_local.names_local_gpu(gpu):  # "auto", "cuda:N": this machine's GPU
        gpu, device = None, gpu
    if budget is not None:
        return _from_budget(budget)
    if stack is not None and not isinstance(stack, Stack):
        raise InvalidInputError(f"stack must be a memcalc.Stack(...), got {type(stack).__name__}",
                                hint='e.g. stack=memcalc.Stack(torch="2.4", cuda="12.1")')
    versions = resolve_stack(stack)
    if gpu is not None:
        return _from_gpu(gpu, versions)
    assert device is not None
    return _from_device(device, local_gpus, versions)


def _names_cpu(gpu: object) -> bool:
    """Whether ``gpu`` is the CPU target: ``"cpu"`` or its profile."""
    if isinstance(gpu, GpuProfile):
        return gpu.is_cpu
    return isinstance(gpu, str) and gpu.strip().lower() == CPU_PROFILE.key


def _from_cpu(budget: str | int | None, device: str | None) -> Budget:
    """The CPU target's budget: ``budget`` as given, else this machine's available RAM."""
    if device is not None:
        raise InvalidInputError(f"gpu='cpu' is this machine's CPU; device={device!r} names a GPU: give one of them")
    if budget is not None:
        return replace(_from_budget(budget), source="as given, on the CPU", gpu=CPU_PROFILE)
    return Budget(available_ram(), "the CPU: this machine's available RAM (MemAvailable)", CPU_PROFILE)


def available_ram(meminfo: str = "/proc/meminfo") -> int:
    """Bytes the kernel says new allocations can have without swapping (``MemAvailable``)."""
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    raise InvalidInputError("this machine's available RAM cannot be read (no MemAvailable in /proc/meminfo)",
                            hint="Give the CPU step's budget: --gpu cpu --budget 16GiB (gpu='cpu', budget=...).")


def _from_budget(budget: str | int) -> Budget:
    try:
        capacity = parse_bytes(budget)
    except ValueError as exc:
        raise InvalidInputError(f"budget: {exc}", hint=f"A budget is {BYTES_FORMS}.") from None
    return Budget(capacity, "as given")


def _from_gpu(gpu: str | GpuProfile, versions: ResolvedStack) -> Budget:
    if not isinstance(gpu, (str, GpuProfile)):
        raise InvalidInputError(f"gpu must be a GPU name or a GpuProfile, got {type(gpu).__name__} {gpu!r}",
                                hint="Known GPUs: " + ", ".join(g.key for g in gpu_catalogue.catalogue()) + ".")
    profile = versions.apply(gpu if isinstance(gpu, GpuProfile) else gpu_catalogue.get_gpu(gpu))
    usable = profile.usable_memory
    if usable is None or profile.total_memory is None:
        raise InvalidInputError(
            f"GPU {profile.key!r} has no known capacity",
            hint="Name a GPU model (e.g. a100-40gb) or give a budget (e.g. 24GiB).")
    source = (f"{profile.key}: {format_bytes(profile.total_memory)} "
              f"− {format_bytes(profile.cuda_context)} CUDA context "
              f"({'measured' if profile.context_measured else 'assumed'})")
    return Budget(usable, source, profile)


def _from_device(spec: str, local_gpus: Callable[[], Sequence[gpu_local.LocalGpu]] | None,
                 versions: ResolvedStack) -> Budget:
    gpu_local.check_device_spec(spec)  # a typo is refused before GPUs are looked for
    context_exists = _cuda_initialised()  # read before discovery, which may initialise CUDA
    found = local_gpus() if local_gpus is not None else gpu_local.list_local_gpus()
    chosen = gpu_local.resolve_device(spec, found)
    profile = None if chosen.profile is None else versions.apply(chosen.profile)
    context = 0 if context_exists else versions.context_bytes(profile or GENERIC)
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

    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]  # unannotated in torch



"""``--checkpoint auto``: the activation checkpointing that fits the memory budget with the least
recomputation, chosen among the settings torchtitan offers by tracing each.

The candidates are torchtitan's per-layer rule ``every:N`` from no block to every block (off,
every:L, every:L/2, …, full: each count of checkpointed blocks once) and its op-level
``selective-op``. Each is estimated as the step really runs it (torch's own checkpoint, the
policy in ``create_selective_checkpoint_contexts``), with every kernel's FLOPs recorded: its peak
decides whether it fits — the replay under the capacity on a GPU, the requested bytes on the CPU
target, whose real peak is those bytes — and its recomputed FLOPs (the ``recompute`` phase) what
it costs. The ladder stops at its first setting that fits: checkpointing one more block never
recomputes less. Of those that fit, the least recomputation wins (the lower peak on a tie).

torch's own tools were read as the anchor: ``torch.distributed._tools.sac_estimator`` ranks a
module's ops by memory saved per recompute time, timed by benchmarking on CUDA or by its
roofline (CUDA device properties), and ``sac_ilp.sac_milp`` solves the per-module choice as an
integer program with ``pulp`` (not installed here) over a ``MemTracker`` graph. Neither runs on
this CPU-only stack; memcalc's candidates are whole settings, each one's peak traced rather than
predicted, and its cost counted in FLOPs (and in seconds by the roofline where the GPU has figures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memcalc.core.checkpointing import FULL, OFF, Checkpointing, CheckpointKind
from memcalc.core.errors import InapplicableOptionError, InvalidInputError, MemcalcError
from memcalc.core.report import MemoryReport
from memcalc.engine.step_spec import Step
from memcalc.timing.performance import check_timeable, step_time

__all__ = ("Candidate", "block_count", "candidates", "choose_checkpointing")

#: Estimates one step (``run_estimate`` with the caller's multi-GPU setting).
Estimator = Callable[[Step], MemoryReport]


@dataclass(frozen=True)
class Candidate:
    """One setting, as estimated: its peak (requested on the CPU target, allocated on a GPU),
    whether it fits the budget, and the FLOPs its recomputation adds."""

    checkpointing: Checkpointing
    peak: int
    fits: bool
    recompute_flops: int

    def describe(self) -> str:
        """``every:2: peak 812.3 MB, recomputes 1.2 GFLOP, fits`` (the report's note)."""
        verdict = "fits" if self.fits else "over"
        return (f"{self.checkpointing.label}: peak {self.peak / 1e6:,.1f} MB, recomputes "
                f"{self.recompute_flops / 1e9:,.2f} GFLOP, {verdict}")


def candidates(blocks: int) -> list[Checkpointing]:
    """torchtitan's per-layer ladder for ``blocks`` blocks, fewest checkpointed first: off, then
    ``every:N`` for each count ``blocks // N`` once (the largest N giving it), then full."""
    ladder = [OFF]
    seen: set[int] = set()
    for every in range(blocks, 1, -1):
        count = blocks // every
        if count not in seen and count < blocks:
            seen.add(count)
            ladder.append(Checkpointing(CheckpointKind.EVERY, every))
    ladder.append(FULL)
    return ladder


def block_count(step: Step) -> int:
    """The blocks ``--checkpoint`` wraps in ``step``'s model (its block containers' children)."""
    resolved = step.resolved()
    blocks = sum(len(list(resolved.module.get_submodule(path).children())) for path in resolved.block_containers)
    if blocks == 0:
        raise InvalidInputError(f"checkpoint auto chooses which blocks to checkpoint; {resolved.name} has no repeated "
                                f"blocks memcalc knows how to checkpoint",
                                hint="--checkpoint applies to zoo models with blocks and Hugging Face layers.")
    return blocks


def _judged(step: Step, report: MemoryReport, capacity: int) -> Candidate:
    if step.emulate_cuda:
        peak, fits = report.bytes.peak_allocated, bool(report.fits)
    else:  # the CPU has no caching allocator: its real peak is the bytes requested
        peak = report.peak_requested
        fits = peak <= capacity
    return Candidate(step.checkpoint, peak, fits, report.flops().phase("recompute"))


def choose_checkpointing(step: Step, estimate: Estimator) -> MemoryReport:
    """The report of the setting that fits ``step.capacity`` with the least recomputation, with
    notes naming it, its recomputation cost and every setting tried.

    Raises:
        InvalidInputError: no budget (neither a GPU's memory nor a capacity), or no blocks.
    """
    capacity = step.capacity
    if capacity is None:
        raise InvalidInputError("checkpoint auto chooses under a memory budget, and this step has none",
                                hint="Name a GPU (--gpu h100-80gb: its memory) or give --capacity BYTES "
                                     "(capacity= in Python).")
    if step.mode.value != "train":
        raise InapplicableOptionError(f"checkpoint auto applies to training (mode train); the mode is "
                                      f"{step.mode.value}")
    tried: dict[Checkpointing, tuple[Candidate, MemoryReport]] = {}

    def run(setting: Checkpointing) -> Candidate:
        trial = replace(step, checkpoint=setting, record_costs=True)
        report = estimate(trial)
        tried[setting] = (_judged(trial, report, capacity), report)
        return tried[setting][0]

    for setting in candidates(block_count(step)):
        if run(setting).fits:
            break
    if not tried[OFF][0].fits:  # selective-op lies between no checkpointing and full
        run(Checkpointing(CheckpointKind.SELECTIVE_OP))
    fitting = [c for c, _ in tried.values() if c.fits]
    chosen = (min(fitting, key=lambda c: (c.recompute_flops, c.peak)) if fitting
              else min((c for c, _ in tried.values()), key=lambda c: c.peak))
    report = tried[chosen.checkpointing][1]
    return replace(report, notes=(*_notes(step, chosen, [c for c, _ in tried.values()], capacity, report),
                                  *report.notes))


def _notes(step: Step, chosen: Candidate, tried: list[Candidate], capacity: int, report: MemoryReport) -> list[str]:
    cost = f"recomputing {chosen.recompute_flops / 1e9:,.2f} GFLOP per step"
    seconds = _recompute_seconds(step, report)
    if seconds is not None:
        cost += f" ({seconds * 1e3:,.2f} ms on {step.gpu.name} by the roofline)"
    if chosen.fits:
        head = (f"checkpoint auto chose {chosen.checkpointing.label}: the least recomputation whose peak fits "
                f"{capacity / 1e6:,.1f} MB; {cost}")
    else:
        head = (f"checkpoint auto: no setting fits {capacity / 1e6:,.1f} MB; the lowest peak is "
                f"{chosen.checkpointing.label}'s ({cost})")
    return [head, "checkpoint auto tried: " + "; ".join(c.describe() for c in tried)]


def _recompute_seconds(step: Step, report: MemoryReport) -> float | None:
    """The recompute phase's seconds by memcalc's roofline, where the GPU has figures."""
    try:
        check_timeable(step.gpu)
        timed = step_time(report)
    except MemcalcError:
        return None
    return next((p.seconds for p in timed.phases if p.phase == "recompute"), 0.0)

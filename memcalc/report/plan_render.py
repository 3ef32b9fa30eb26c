"""Text of ``memcalc plan`` (:func:`memcalc.api.plan`): the fastest configurations that fit, one
row each (accum/mb: accumulation steps, or a pipeline's microbatches; the peak names the busiest
rank where ranks differ), then the network, the search's extent, what it pruned and what it assumed.
Formatting only."""

from __future__ import annotations

from tabulate import tabulate

from memcalc.core.units import Unit, format_bytes
from memcalc.search.plan import PlanCandidate, PlanResult
from memcalc.timing.time_render import format_seconds

__all__ = ("render_plan",)


def _row(rank: int, c: PlanCandidate, unit: Unit) -> list[str]:
    report = c.report
    tokens = c.tokens_per_second
    headroom = report.headroom
    busiest = report.busiest_role
    peak = format_bytes(report.bytes.peak_allocated, unit)
    if busiest is not None and len(report.roles) > 1:
        peak += f" ({busiest.name})"
    return [str(rank), c.mesh.describe(), "" if c.schedule is None else c.schedule.value, str(c.micro_batch),
            str(c.accum_steps), c.label, peak, "" if headroom is None else format_bytes(headroom, unit),
            format_seconds(c.compute_seconds), format_seconds(c.bubble_seconds) if c.schedule is not None else "",
            format_seconds(c.comm_seconds), format_seconds(c.exposed_seconds), format_seconds(c.seconds),
            "" if tokens is None else f"{tokens:,.0f}"]


def _unsearched(result: PlanResult) -> str:
    """The dimensions plan left out, each with its reason: the request's own shape (no experts, a
    short sequence) or an option, not only what memcalc cannot model."""
    reasons = zip(result.not_searched, result.not_searched_why, strict=True)
    return ", ".join(f"{n} ({why})" for n, why in reasons) or "none"


def render_plan(result: PlanResult, *, unit: Unit = Unit.AUTO, fmt: str = "simple") -> str:
    """The plan as text: the table of the best, then what was searched, pruned and assumed."""
    lines = [f"Plan: {result.gpus} GPUs, global batch {result.global_batch} per optimizer step"]
    if result.best:
        headers = ["#", "mesh", "schedule", "micro-batch", "accum/mb", "checkpointing", "peak/GPU (busiest)",
                   "headroom", "compute", "bubble", "comm", "exposed", "step", "tokens/s"]
        lines += ["", tabulate([_row(i, c, unit) for i, c in enumerate(result.best, 1)], headers=headers,
                               tablefmt=fmt, disable_numparse=True)]
    else:
        lines += ["", "Nothing fits: see what was pruned below."]
    lines += ["", f"Network: {result.network.describe()}.",
              f"Searched: {', '.join(result.searched)} ({len(result.meshes)} meshes: "
              f"{'; '.join(m.describe() for m in result.meshes)}); not searched: {_unsearched(result)}.",
              *([f"{result.unsupported} meshes skipped as not modelled together yet (named below)."]
                if result.unsupported else []),
              f"{result.configurations} configurations (mesh × schedule × micro-batch × checkpointing); "
              f"{result.estimates} traced ({result.reused} more reused a trace of the same per-rank program), "
              f"{result.bounded} pruned by their time bound, the rest by memory's monotonicity."]
    if result.pruned:
        lines += ["Pruned:", *(f"  - {p}" for p in result.pruned)]
    lines += ["Assumed:", *(f"  - {a}" for a in result.assumptions)]
    return "\n".join(lines)

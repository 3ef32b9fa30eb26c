"""Text of ``memcalc fit --objective throughput`` (:func:`memcalc.api.fastest_setting`): the
fastest setting that fits, why it wins, and every setting timed. It shows a search's result, so
it lives beside the other reports rather than with the step time's own text
(:mod:`memcalc.timing.time_render`), whose units and figures it uses. Formatting only."""

from __future__ import annotations

from tabulate import tabulate

from memcalc.core.units import Unit, format_bytes
from memcalc.search.fit_result import format_margin
from memcalc.search.throughput import Candidate, ThroughputChoice
from memcalc.timing.time_render import format_flops, format_seconds

__all__ = ("render_choice",)


def _setting(c: Candidate) -> str:
    accumulation = f" × {c.accum_steps} accumulation steps" if c.accum_steps > 1 else ""
    return f"micro-batch {c.micro_batch}{accumulation}, {'with' if c.checkpoint else 'no'} checkpointing"


def _faster(best: Candidate, other: Candidate) -> str:
    return f"{100.0 * (best.samples_per_second / other.samples_per_second - 1):.1f}%" \
        if other.samples_per_second else "infinitely"


def _why(choice: ThroughputChoice) -> str:
    """One paragraph: the winner against the runner-up of its own kind and against the best of
    the other checkpointing choice."""
    best = choice.best
    reasons: list[str] = []
    same = [c for c in choice.candidates if c.checkpoint == best.checkpoint and c is not best]
    if same:
        runner = max(same, key=lambda c: c.samples_per_second)
        reasons.append(f"it is {_faster(best, runner)} faster than {_setting(runner)}: larger kernels keep the "
                       f"GPU busier, and the optimizer step and kernel launches are shared by more samples")
    other = [c for c in choice.candidates if c.checkpoint != best.checkpoint]
    if other:
        rival = max(other, key=lambda c: c.samples_per_second)
        checkpointed = rival if rival.checkpoint else best
        time = checkpointed.report.time
        traced = checkpointed.report.accum_steps  # micro-batches the estimate traced (one or two)
        extra = format_flops(time.flops.phase("recompute") / traced) if time is not None else "?"
        if best.checkpoint:
            reasons.append(f"checkpointing pays for itself here: the larger micro-batch it lets fit is "
                           f"{_faster(best, rival)} faster than the best without it ({_setting(rival)}), despite "
                           f"recomputing {extra} per micro-batch in backward")
        else:
            reasons.append(f"checkpointing would let larger micro-batches fit, but recomputing each block's forward "
                           f"in backward ({extra} per micro-batch) costs more than it gains: the best with it, "
                           f"{_setting(rival)}, is {_faster(best, rival)} slower")
    reasons.extend(choice.left_out)
    return "why: " + "; ".join(reasons) + "." if reasons else "why: it is the only setting that fits."


def render_choice(choice: ThroughputChoice, *, fmt: str = "simple", unit: Unit | str = Unit.AUTO) -> str:
    """``memcalc fit --objective throughput``: the fastest setting, why, and every setting timed.

    Args:
        choice: what :func:`memcalc.api.fastest_setting` returned.
        fmt: a tabulate table format.
        unit: the byte unit of the memory column.

    Returns:
        The text, without a trailing newline.
    """
    best = choice.best
    budget = format_bytes(choice.budget.capacity, unit)
    margin = f" less a {format_margin(choice.margin)} margin" if choice.margin else ""
    target = f", {choice.target_batch} samples per optimizer step" if choice.target_batch else ""
    tokens = best.tokens_per_second
    head = [f"objective: throughput — the fitting setting with the most samples/s in {budget} "
            f"({choice.budget.source}){margin}{target}",
            f"fastest: {_setting(best)}: {best.samples_per_second:,.1f} samples/s"
            + (f", {tokens:,.0f} tokens/s" if tokens is not None else "")
            + f" ({format_seconds(best.seconds)} per optimizer step; peak allocated "
              f"{format_bytes(best.report.bytes.peak_allocated, unit)})",
            _why(choice)]
    with_tokens = any(c.tokens_per_second is not None for c in choice.candidates)
    rows = [["yes" if c.checkpoint else "no", str(c.micro_batch), str(c.accum_steps), str(c.samples_per_step),
             format_bytes(c.report.bytes.peak_allocated, unit), format_seconds(c.seconds),
             f"{c.samples_per_second:,.1f}",
             *([f"{c.tokens_per_second:,.0f}" if c.tokens_per_second is not None else "-"] if with_tokens else []),
             "<- fastest" if c is best else ""]
            for c in sorted(choice.candidates, key=lambda c: -c.samples_per_second)]
    headers = ["checkpointing", "micro-batch", "accumulation", "samples per step", "peak allocated", "step time",
               "samples/s", *(["tokens/s"] if with_tokens else []), ""]
    table = tabulate(rows, headers=headers,
                     tablefmt=fmt, disable_numparse=True,
                     colalign=("left", *["right"] * (7 if with_tokens else 6), "left"))
    spread = best.report.time.spread if best.report.time is not None else 0.0
    note = (f"step times: a roofline per kernel with efficiencies fitted to real kernels, ±{spread:.0%} on the steps "
            "it was fitted to (the fastest setting's breakdown follows); "
            "an accumulating setting is estimated with two micro-batches (gradients alive across them) and timed as "
            "its micro-batches plus one optimizer step")
    return "\n\n".join(["\n".join(head), table, note])

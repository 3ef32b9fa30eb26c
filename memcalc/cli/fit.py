"""``memcalc fit``: the largest batch that fits a GPU, a budget or a local GPU. Options, one
call to :func:`memcalc.max_batch_size`, rendering; errors are mapped by
:func:`memcalc.cli.options.handle_errors` (2: bad input, 1: does not fit)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click
from tabulate import tabulate

from memcalc import api
from memcalc.cli.hf import attn_model, attn_option
from memcalc.cli.options import field_option, given, handle_errors, output_options, quiet, step_arguments, step_options
from memcalc.cli.params import UnitCommand, budget_arguments
from memcalc.cli.setup import setup_arguments, setup_options
from memcalc.cli.strategy import strategy_arguments, strategy_options
from memcalc.core.units import format_bytes
from memcalc.report.render import render_json, render_report, render_roles
from memcalc.report.throughput_render import render_choice
from memcalc.search.fit_result import FitResult, format_margin
from memcalc.timing.performance import check_timeable, with_time

__all__ = ("fit_command",)

#: ``memcalc fit`` shows the batches within this distance of the answer by default.
DEFAULT_NEIGHBOURS = 2


class MarginType(click.ParamType[float]):
    """A fraction of the budget in [0, 1): ``0.06`` or ``6%``."""

    name = "fraction"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        """The fraction ``value`` says; a usage error for anything else."""
        if isinstance(value, float):
            return value
        text = str(value).strip()
        try:
            margin = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            margin = -1.0
        if not 0 <= margin < 1:
            self.fail(f"{value!r} is not a fraction of the budget, at least 0 and under 1 (0.06 or 6%)", param, ctx)
        return margin


@click.command("fit", cls=UnitCommand)
@click.argument("model")
@field_option("capacity")
@field_option("optimizer", param="optim")
@field_option("precision", default=None, also="Default: the step's own (fp32 unless --training-args set one).")
@step_options
@setup_options
@attn_option
@strategy_options
@click.option("--margin", type=MarginType(), default=None, show_default="measured for the class of step",
              help="Fraction of the budget held back for the estimate's error (0.06 or 6%); 0: the raw boundary. "
                   "Default: the estimate's error measured on real GPU runs for this class of step (family, "
                   "precision, checkpointing), at least 3%.")
@click.option("--neighbours", type=click.IntRange(min=0, max=16), default=DEFAULT_NEIGHBOURS, show_default=True,
              help="Also show the batches this close to the answer.")
@click.option("--time", "timed", is_flag=True,
              help="Also estimate the step time of the answer on --gpu: samples/s and tokens/s beside the memory.")
@click.option("--objective", type=click.Choice(["memory", "throughput"]), default="memory", show_default=True,
              help="memory: the largest batch that fits. throughput: among the settings that fit (checkpointing on "
                   "or off, micro-batch, accumulation to --target-batch), the one with the most samples/s on --gpu.")
@click.option("--target-batch", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --objective throughput: samples per optimizer step to reach exactly, accumulating "
                   "micro-batches when they do not fit at once.")
@output_options
@handle_errors
def fit_command(model: str, gpu: str | None, budget: int | None, device: str | None, optim: str,
                precision: str | None, margin: float | None, neighbours: int, timed: bool, objective: str,
                target_batch: int | None, fmt: str, units: str, debug: bool, **options: Any) -> None:
    """The largest batch of MODEL whose step fits a GPU, a budget or a local GPU (per GPU, with
    a multi-GPU --strategy).

    \b
    memcalc fit resnet50 --gpu a100-40gb --optim adam
    memcalc fit gpt2 --seq-len 512 --budget 16GiB
    memcalc fit resnet50 --device auto
    memcalc fit vgg16 --budget 24GiB --margin 0
    memcalc fit gpt2 --seq-len 1024 --gpu a100-80gb --objective throughput --target-batch 64
    """
    source = attn_model(model, options)  # an hf: model with --attn becomes a HuggingFace source
    where = budget_arguments(gpu, budget, device, required=True)
    step = step_arguments(options) | setup_arguments(options)
    distributed = strategy_arguments(**options)  # what is left: the multi-GPU options
    if "launch" in distributed:  # read (and checked) once here; the search lays it under the step's options
        if objective == "throughput":
            raise click.UsageError("--objective throughput does not read launch configurations yet: give the "
                                   "strategy as --strategy/--world-size")
        distributed = {name: options.get(name) for name in ("accelerate_config", "deepspeed", "world_size")}
    if objective == "throughput":
        _fit_throughput(source, where, optim, precision, margin, target_batch, step | distributed, fmt, units)
        return
    if target_batch is not None:
        raise click.UsageError("--target-batch goes with --objective throughput")
    if timed and device is None:
        check_timeable(gpu)  # before the search (a local --device is known after it)
    with quiet():
        result = api.max_batch_size(source, **where, optimizer=optim if given("optim") else None, precision=precision,
                                    margin=margin, neighbours=0 if fmt == "json" else neighbours, **step,
                                    **distributed)
    if timed:
        result = replace(result, report=with_time(result.report))
    if fmt == "json":
        click.echo(render_json(result.to_dict()))
        return
    click.echo(_render_fit(result, fmt, units), nl=False)


def _fit_throughput(source: Any, where: dict[str, Any], optim: str, precision: str | None, margin: float | None,
                    target_batch: int | None, options: dict[str, Any], fmt: str, unit: str) -> None:
    """``--objective throughput``: the fastest setting that fits, and why."""
    for name, flag in (("checkpoint", "--checkpoint"), ("accum_steps", "--accum-steps")):
        if given(name):
            raise click.UsageError(f"--objective throughput chooses {flag} itself; leave it out")
        options.pop(name, None)
    if where.get("device") is None:
        check_timeable(where.get("gpu"))  # before the search
    with quiet():
        choice = api.fastest_setting(source, **where, optimizer=optim if given("optim") else None,
                                     precision=precision, margin=margin, target_batch=target_batch, **options)
    if fmt == "json":
        click.echo(render_json(choice.to_dict()))
        return
    click.echo(render_choice(choice, fmt=fmt, unit=unit))
    click.echo()
    click.echo(render_report(choice.best.report, fmt=fmt, unit=unit, modules=False), nl=False)


def _render_fit(result: FitResult, fmt: str, unit: str) -> str:
    report = result.report
    margin, limit = result.margin, result.margin_budget_bytes
    lines = [f"budget: {format_bytes(result.budget_bytes, unit)} ({result.budget.source})", _margin_line(result, unit)]
    raw = result.raw_batch_size
    lines.append(
        f"largest batch that fits{f' with a {format_margin(margin)} margin' if margin else ''}: {result.batch_size} "
        f"(batch {result.batch_size + 1} does not"
        + (f"; every batch from {result.checked_from} to it replayed and fits" if result.checked_from is not None
           and result.checked_from < result.batch_size else "")
        + (" — the check stopped at its cost bound, the fragmentation reaching further down" if result.check_capped
           else "")
        + (f"; the raw boundary, with no margin, is {raw}" if margin and raw is not None
           else "; the raw boundary was not searched" if margin else "")
        + f"); headroom {format_bytes(result.headroom, unit)} above its peak allocated; "
        f"about {format_bytes(result.bytes_per_sample, unit)} per sample near it; "
        f"found with {result.num_estimates} estimates" + (f" and {result.replays} replays" if result.replays else ""))
    if result.batch_size_with_expandable_segments is not None:
        lines.append(f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: batch "
                     f"{result.batch_size_with_expandable_segments} fits (replayed: the next batch fails for "
                     f"fragmentation, which expandable segments remove; torchtitan launches with them)")
    if result.failing_above:
        shown = ", ".join(str(b) for b in result.failing_above[:_FAILING_SHOWN])
        more = len(result.failing_above) - _FAILING_SHOWN
        several = len(result.failing_above) > 1
        larger = f"{raw} (the boundary the search met)" if not margin and raw is not None else "a larger one"
        lines.append(f"not monotone: batch{'es' if several else ''} {shown}{f' and {more} more' if more > 0 else ''}"
                     f" above it do{'' if several else 'es'} not fit although {larger} does (the caching "
                     f"allocator's fragmentation depends on the exact sizes)")
    sections = ["\n".join(lines)]
    if report.roles:
        sections.append(render_roles(report, fmt=fmt, unit=unit).rstrip("\n"))
    sections.append(render_report(report, fmt=fmt, unit=unit, modules=False).rstrip("\n"))
    if result.neighbours:
        room = "margin budget − peak" if margin else "budget − peak"
        rows = [[p.batch_size, format_bytes(p.peak_allocated, unit), format_bytes(limit - p.peak_allocated, unit),
                 "yes" if p.fits else "no", "<- largest" if p.batch_size == result.batch_size else ""]
                for p in result.neighbours]
        sections.append(tabulate(rows, headers=["batch", "peak allocated", room,
                                                f"fits ({format_margin(margin)} margin)" if margin else "fits", ""],
                                 tablefmt=fmt, colalign=("right", "right", "right", "left", "left"),
                                 disable_numparse=True))
        if any(not p.fits and p.peak_allocated <= limit for p in result.neighbours):
            # without this, the table's own arithmetic would seem to contradict its "no"
            sections.append("a batch with room left under the budget can still fail: the caching allocator's "
                            "segments fragment, so it must reserve more than the budget (it frees its cache "
                            "and retries first)")
    return "\n\n".join(sections) + "\n"


#: ``memcalc fit`` lists at most this many of the batches above the answer that do not fit.
_FAILING_SHOWN = 8


def _margin_line(result: FitResult, unit: str) -> str:
    """What the margin holds back and what it covers (docs/architecture.md, "The batch search")."""
    if not result.margin:
        return "margin: none (--margin 0): nothing held back for the estimate's error against a real run"
    held = result.budget_bytes - result.margin_budget_bytes
    why = (f"({result.margin_basis})" if result.margin_basis else
           "(given: --margin)")
    runs = "CPU steps" if result.report.gpu.is_cpu else "CUDA runs"
    return (f"margin: {format_margin(result.margin)} held back ({format_bytes(held, unit)}; the step must fit "
            f"{format_bytes(result.margin_budget_bytes, unit)}) for the estimate's error against real {runs} "
            f"{why}; --margin 0 gives the raw boundary")

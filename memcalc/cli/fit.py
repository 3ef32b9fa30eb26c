"""``memcalc fit``: the largest batch that fits a GPU, a budget or a local GPU. Options, one
call to :func:`memcalc.max_batch_size`, rendering; errors are mapped by
:func:`memcalc.cli.options.handle_errors` (2: bad input, 1: does not fit)."""

from __future__ import annotations

from typing import Any

import click
from tabulate import tabulate

from memcalc import api
from memcalc.cli.options import given, handle_errors, output_options, quiet, step_arguments, step_options
from memcalc.cli.params import OPTIMIZERS, PRECISIONS, UnitCommand, budget_arguments, budget_options
from memcalc.cli.strategy import strategy_arguments, strategy_options
from memcalc.core.units import format_bytes
from memcalc.engine.optimizers import Optimizer
from memcalc.report.render import render_json, render_report, render_roles
from memcalc.search.budget import FitResult

__all__ = ("fit_command",)

#: ``memcalc fit`` shows the batches within this distance of the answer by default.
DEFAULT_NEIGHBOURS = 2


@click.command("fit", cls=UnitCommand)
@click.argument("model")
@budget_options
@click.option("--optim", type=click.Choice(OPTIMIZERS, case_sensitive=False), default=Optimizer.ADAM.value,
              show_default=True, help="Optimizer.")
@click.option("--precision", type=click.Choice(PRECISIONS, case_sensitive=False), default=None,
              help="Numeric precision (default: the estimate's, fp32).")
@step_options
@strategy_options
@click.option("--neighbours", type=click.IntRange(min=0, max=16), default=DEFAULT_NEIGHBOURS, show_default=True,
              help="Also show the batches this close to the answer.")
@output_options
@handle_errors
def fit_command(model: str, gpu: str | None, budget: int | None, device: str | None, optim: str,
                precision: str | None, input_shape: tuple[int, ...] | None, seq_len: int | None, mode: str,
                checkpoint: bool, accum_steps: int, kv_cache: int | None, loss: str | None, neighbours: int,
                fmt: str, units: str, debug: bool, **multi_gpu: Any) -> None:
    """The largest batch of MODEL whose step fits a GPU, a budget or a local GPU (per GPU, with
    a multi-GPU --strategy).

    \b
    memcalc fit resnet50 --gpu a100-40gb --optim adam
    memcalc fit gpt2 --seq-len 512 --budget 16GiB
    memcalc fit resnet50 --device auto
    """
    where = budget_arguments(gpu, budget, device, required=True)
    step = step_arguments(input_shape=input_shape, seq_len=seq_len, mode=mode, checkpoint=checkpoint,
                         accum_steps=accum_steps, kv_cache=kv_cache, loss=loss)
    distributed = strategy_arguments(**multi_gpu)
    with quiet():
        result = api.max_batch_size(model, **where, optimizer=optim if given("optim") else None, precision=precision,
                                       neighbours=0 if fmt == "json" else neighbours, **step, **distributed)
    if fmt == "json":
        click.echo(render_json(result.to_dict()))
        return
    click.echo(_render_fit(result, fmt, units), nl=False)


def _render_fit(result: FitResult, fmt: str, unit: str) -> str:
    report = result.report
    lines = [
        f"budget: {format_bytes(result.budget_bytes, unit)} ({result.budget.source})",
        (f"largest batch that fits: {result.batch_size} (batch {result.batch_size + 1} does not); "
         f"headroom {format_bytes(result.headroom, unit)} above its peak allocated; "
         f"about {format_bytes(result.bytes_per_sample, unit)} per sample near it; "
         f"found with {result.num_estimates} estimates"),
    ]
    sections = ["\n".join(lines)]
    if report.roles:
        sections.append(render_roles(report, fmt=fmt, unit=unit).rstrip("\n"))
    sections.append(render_report(report, fmt=fmt, unit=unit, modules=False).rstrip("\n"))
    if result.neighbours:
        rows = [[p.batch_size, format_bytes(p.peak_allocated, unit),
                 format_bytes(result.budget_bytes - p.peak_allocated, unit), "yes" if p.fits else "no",
                 "<- largest" if p.batch_size == result.batch_size else ""] for p in result.neighbours]
        sections.append(tabulate(rows, headers=["batch", "peak allocated", "budget − peak", "fits", ""],
                                 tablefmt=fmt, colalign=("right", "right", "right", "left", "left"),
                                 disable_numparse=True))
        if any(not p.fits and p.peak_allocated <= result.budget_bytes for p in result.neighbours):
            # without this, the table's own arithmetic would seem to contradict its "no"
            sections.append("a batch with room left under the budget can still fail: the caching allocator's "
                            "segments fragment, so it must reserve more than the budget (it frees its cache "
                            "and retries first)")
    return "\n\n".join(sections) + "\n"



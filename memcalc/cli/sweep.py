"""``memcalc sweep``: estimates over batch sizes, optimizers and precisions, as a table, JSON
or a plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
from tabulate import tabulate

from memcalc import api
from memcalc.cli.hf import attn_model, attn_option
from memcalc.cli.options import (
    field_option,
    force_option,
    given,
    handle_errors,
    output_options,
    quiet,
    step_arguments,
    step_options,
)
from memcalc.cli.params import UnitCommand, budget_arguments
from memcalc.cli.setup import setup_arguments, setup_options
from memcalc.core.categories import Category
from memcalc.core.units import format_bytes
from memcalc.report.render import render_json
from memcalc.search.sweep import SweepPoint
from memcalc.targets.budget import Budget, resolve_budget
from memcalc.timing.time_render import format_seconds

__all__ = ("sweep_command",)


@click.command("sweep", cls=UnitCommand)
@click.argument("model")
@field_option("batch_size", param="batches", many=True, default=None, required=True)
@field_option("optimizer", param="optims", many=True)
@field_option("precision", param="precisions", many=True, default=None)
@field_option("capacity")
@step_options
@setup_options
@attn_option
@click.option("--time", "timed", is_flag=True,
              help="Also estimate each step's time on --gpu: step time, samples/s and tokens/s columns (and a "
                   "samples/s panel in --plot).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Draw memory against batch size to this file (.png, .pdf, .svg, ...: the extension picks the "
                   "format; needs matplotlib).")
@force_option
@output_options
@handle_errors
def sweep_command(model: str, batches: list[int], optims: list[str], precisions: list[str] | None,
                  gpu: str | None, budget: int | None, device: str | None, timed: bool, plot_path: str | None,
                  force: bool, fmt: str, units: str, debug: bool, **options: Any) -> None:
    """Estimate MODEL for every batch size × optimizer × precision: one row each.

    \b
    memcalc sweep resnet50 --batch 1,16,64,256 --optim sgd,adam --precision fp32,amp-bf16
    memcalc sweep resnet50 --batch 16,64,256 --gpu a100-40gb --plot memory.png
    """
    source = attn_model(model, options)  # an hf: model with --attn becomes a HuggingFace source
    where = budget_arguments(gpu, budget, device, required=False)
    if plot_path is not None:
        from memcalc.report.plot import check_plot_path

        check_plot_path(plot_path, force=force)  # before the sweep, not after minutes of it
    step = step_arguments(options) | setup_arguments(options)
    resolved = resolve_budget(**where, stack=step.get("stack")) if where else None
    points_iter = api.iter_sweep(source, batch_sizes=batches, optimizers=optims if given("optims") else None,
                                 precisions=precisions or [None], budget=resolved, time=timed, **step)
    with quiet():  # a bar on a terminal: the sweep tells its progress (cli.progress)
        points = list(points_iter)
    if plot_path is not None:
        from memcalc.report.plot import plot_sweep

        written = plot_sweep(points, plot_path, capacity=resolved.capacity if resolved else None,
                             capacity_label=_capacity_label(resolved) if resolved else None, force=force)
        click.echo(f"wrote {written}", err=True)
    if fmt == "json":
        click.echo(render_json([p.to_dict() for p in points]))
        return
    click.echo(_render_sweep(points, resolved, fmt, units, with_precision=precisions is not None), nl=False)


def _capacity_label(budget: Budget) -> str:
    name = budget.gpu.key if budget.gpu is not None else "budget"
    return f"{name}: {format_bytes(budget.capacity, 'GiB')} usable"


_SWEEP_CATEGORIES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.ACTIVATIONS)


def _render_sweep(points: Sequence[SweepPoint], budget: Budget | None, fmt: str, unit: str,
                  *, with_precision: bool) -> str:
    headers = ["batch", "optimizer", *(["precision"] if with_precision else []), "peak allocated",
               *[c.value.replace("_", " ") for c in _SWEEP_CATEGORIES], "other"]
    if budget is not None:
        headers.append("fits")
    timed = bool(points) and all(p.report.time is not None for p in points)
    tokens = timed and any(p.report.time is not None and p.report.time.tokens is not None for p in points)
    if timed:
        headers.extend(["step time", "samples/s", *(["tokens/s"] if tokens else [])])
    rows = []
    for point in points:
        b = point.report.bytes
        shown = [b.category(c) for c in _SWEEP_CATEGORIES]
        row = [str(point.batch_size), point.optimizer, *([point.precision or "-"] if with_precision else []),
               format_bytes(b.peak_allocated, unit), *[format_bytes(v, unit) for v in shown],
               format_bytes(b.peak_allocated - sum(shown), unit)]
        if budget is not None:
            row.append("yes" if point.fits else "no")
        if timed:
            row.extend(_time_cells(point, tokens))
        rows.append(row)
    model = points[0].report.model if points else "?"
    title = f"memcalc sweep: {model}, {points[0].report.mode.value if points else ''} (binary units; bytes at the peak)"
    if budget is not None:
        title += f"\nbudget: {format_bytes(budget.capacity, unit)} ({budget.source})"
    colalign = ["right", "left", *(["left"] if with_precision else []), *["right"] * (len(_SWEEP_CATEGORIES) + 2)]
    if budget is not None:
        colalign.append("left")
    if timed:
        colalign.extend(["right"] * (3 if tokens else 2))
    table = tabulate(rows, headers=headers, tablefmt=fmt, colalign=colalign, disable_numparse=True)
    if timed:
        table += ("\n\nstep time: a roofline per kernel fitted to an H200's kernels (memcalc MODEL --time shows them); "
                  "one GPU, no data loading")
    return f"{title}\n\n{table}\n"


def _time_cells(point: SweepPoint, tokens: bool) -> list[str]:
    time = point.report.time
    assert time is not None
    cells = [format_seconds(time.seconds), f"{time.samples_per_second:,.1f}"]
    if tokens:
        cells.append("-" if time.tokens_per_second is None else f"{time.tokens_per_second:,.0f}")
    return cells



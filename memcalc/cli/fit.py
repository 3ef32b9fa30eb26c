"""``memcalc fit``, ``memcalc sweep`` and ``memcalc gpus``: options, a call into
:mod:`memcalc.search` / :mod:`memcalc.gpus`, rendering. Errors are mapped by
:func:`memcalc.cli.options.handle_errors` (2: bad input, 1: does not fit or cannot be estimated).

:mod:`memcalc.cli` registers these commands at its end and this module takes the shared
decorators from :mod:`memcalc.cli_options` (shared with ``memcalc MODEL``).
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
from tabulate import tabulate

from memcalc.cuda.gpus import catalogue as gpu_catalogue
from memcalc.search import fit as search
from memcalc.core.categories import Category
from memcalc.cli.options import handle_errors, output_options, quiet, step_arguments, step_options
from memcalc.cli.strategy import strategy_arguments, strategy_options
from memcalc.engine.optimizers import Optimizer
from memcalc.core.precision import Precision
from memcalc.report.render import render_json, render_report, render_roles
from memcalc.core.units import BYTES_FORMS, format_bytes, parse_bytes

__all__ = ("fit_command", "gpus_command", "sweep_command")

#: Sweeps with more configurations than this show a progress bar (on a terminal).
PROGRESS_MIN_CONFIGURATIONS = 4
#: ``memcalc fit`` shows the batches within this distance of the answer by default.
DEFAULT_NEIGHBOURS = 2


# --------------------------------------------------------------------------------------------
# Parameter types
# --------------------------------------------------------------------------------------------


class BytesType(click.ParamType):
    """``24GiB``, ``16 GiB``, ``80GB``, ``12884901888`` → bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class ListType(click.ParamType):
    """A comma-separated list, each item converted by ``item``; a bad item is a usage error
    that names it."""

    def __init__(self, item: Callable[[str], Any], what: str):
        self.item = item
        self.what = what
        self.name = f"{what}[,{what}...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[Any]:
        if isinstance(value, list):
            return value
        items = [part.strip() for part in str(value).split(",")]
        converted = []
        for item in items:
            try:
                converted.append(self.item(item))
            except ValueError as exc:
                self.fail(f"item {item!r} of {value!r}: {exc}", param, ctx)
        return converted


def _positive_int(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise ValueError("not a positive integer batch size")
    return int(text)


def _choice(values: Iterable[str]) -> Callable[[str], str]:
    allowed = list(values)

    def convert(text: str) -> str:
        if text.lower() not in allowed:
            raise ValueError(f"choose from {', '.join(allowed)}")
        return text.lower()

    return convert


class _UnitCommand(click.Command):
    """Reads ``--budget 16 GiB`` (unquoted) as one size: a number followed by a word that
    would otherwise be a second positional argument is that number's unit."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        flags = {name for p in self.get_params(ctx) if isinstance(p, click.Option) and p.is_flag
                 for name in (*p.opts, *p.secondary_opts)}
        return super().parse_args(ctx, _join_budget_unit(args, flags))


_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_WORD = re.compile(r"[A-Za-z]+")


def _join_budget_unit(args: list[str], flags: set[str]) -> list[str]:
    """``[..., "--budget", "16", "GiB", ...]`` → ``[..., "--budget", "16 GiB", ...]`` when
    "GiB" would be an extra positional argument (the model came first)."""
    positionals = _positional_indices(args, flags)
    for i in range(len(args) - 2):
        number, word = args[i + 1], args[i + 2]
        if (args[i] == "--budget" and _NUMBER.fullmatch(number) and _WORD.fullmatch(word)
                and i + 2 in positionals and len(positionals) > 1):
            return [*args[:i + 1], f"{number} {word}", *args[i + 3:]]
    return list(args)


def _positional_indices(args: list[str], flags: set[str]) -> set[int]:
    """Positions of the arguments that are not options or option values."""
    found: set[int] = set()
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":
            found.update(range(i + 1, len(args)))
            break
        if token.startswith("-") and token != "-":
            i += 1 if token in flags or "=" in token else 2
            continue
        found.add(i)
        i += 1
    return found


# --------------------------------------------------------------------------------------------
# Shared options
# --------------------------------------------------------------------------------------------


def _budget_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--device", default=None, metavar="auto|cuda:N",
                        help="A GPU of this machine: its free memory minus a new process's CUDA "
                             "context (auto: the one with the most free memory).")(func)
    func = click.option("--budget", type=BytesType(), default=None,
                        help=f"Bytes the step may use, nothing subtracted: {BYTES_FORMS}.")(func)
    func = click.option("--gpu", default=None, metavar="NAME",
                        help="A GPU model (a100-40gb, h100-80gb, ...): its memory minus the CUDA context.")(func)
    return func


def _budget_arguments(gpu: str | None, budget: int | None, device: str | None, *, required: bool) -> dict[str, Any]:
    given = {name: value for name, value in (("gpu", gpu), ("budget", budget), ("device", device))
             if value is not None}
    if len(given) > 1:
        raise click.UsageError(f"give only one of --gpu, --budget or --device (got {', '.join('--' + n for n in given)})")
    if required and not given:
        raise click.UsageError("give a GPU model (--gpu a100-40gb), a budget (--budget 16GiB) or a local "
                               "GPU (--device auto)")
    return given


_PRECISIONS = [p.value for p in Precision]
_OPTIMIZERS = [o.value for o in Optimizer]


# --------------------------------------------------------------------------------------------
# memcalc fit
# --------------------------------------------------------------------------------------------


@click.command("fit", cls=_UnitCommand)
@click.argument("model")
@_budget_options
@click.option("--optim", type=click.Choice(_OPTIMIZERS, case_sensitive=False), default=Optimizer.ADAM.value,
              show_default=True, help="Optimizer.")
@click.option("--precision", type=click.Choice(_PRECISIONS, case_sensitive=False), default=None,
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
    where = _budget_arguments(gpu, budget, device, required=True)
    step = step_arguments(input_shape=input_shape, seq_len=seq_len, mode=mode, checkpoint=checkpoint,
                         accum_steps=accum_steps, kv_cache=kv_cache, loss=loss)
    distributed = strategy_arguments(**multi_gpu)
    with quiet():
        result = search.max_batch_size(model, **where, optimizer=optim, precision=precision,
                                       neighbours=0 if fmt == "json" else neighbours, **step, **distributed)
    if fmt == "json":
        click.echo(render_json(result.to_dict()))
        return
    click.echo(_render_fit(result, fmt, units), nl=False)


def _render_fit(result: search.FitResult, fmt: str, unit: str) -> str:
    report = result.report
    lines = [
        f"budget: {format_bytes(result.budget_bytes, unit)} ({result.budget.source})",
        (f"largest batch that fits: {result.batch_size} (batch {result.batch_size + 1} does not); "
         f"headroom {format_bytes(result.headroom, unit)}; "
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
    return "\n\n".join(sections) + "\n"


# --------------------------------------------------------------------------------------------
# memcalc sweep
# --------------------------------------------------------------------------------------------


@click.command("sweep", cls=_UnitCommand)
@click.argument("model")
@click.option("--batch", "-b", "batches", type=ListType(_positive_int, "N"), required=True,
              help="Batch sizes, comma-separated: 1,16,64,256.")
@click.option("--optim", "optims", type=ListType(_choice(_OPTIMIZERS), "OPTIM"), default=Optimizer.ADAM.value,
              show_default=True, help=f"Optimizers, comma-separated ({', '.join(_OPTIMIZERS)}).")
@click.option("--precision", "precisions", type=ListType(_choice(_PRECISIONS), "PRECISION"), default=None,
              help=f"Precisions, comma-separated ({', '.join(_PRECISIONS)}).")
@_budget_options
@step_options
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Draw memory against batch size to this file (PNG; needs matplotlib).")
@output_options
@handle_errors
def sweep_command(model: str, batches: list[int], optims: list[str], precisions: list[str] | None,
                  gpu: str | None, budget: int | None, device: str | None,
                  input_shape: tuple[int, ...] | None, seq_len: int | None, mode: str, checkpoint: bool,
                  accum_steps: int, kv_cache: int | None, loss: str | None,
                  plot_path: str | None, fmt: str, units: str, debug: bool) -> None:
    """Estimate MODEL for every batch size × optimizer × precision: one row each.

    \b
    memcalc sweep resnet50 --batch 1,16,64,256 --optim sgd,adam --precision fp32,amp-bf16
    memcalc sweep resnet50 --batch 16,64,256 --gpu a100-40gb --plot memory.png
    """
    where = _budget_arguments(gpu, budget, device, required=False)
    resolved = search.resolve_budget(**where) if where else None
    if plot_path is not None:
        from memcalc.report.plot import check_available

        check_available()  # before the sweep, not after minutes of it
    configs = search.sweep_configurations(batches, optims, precisions or [None])
    step = step_arguments(input_shape=input_shape, seq_len=seq_len, mode=mode, checkpoint=checkpoint,
                         accum_steps=accum_steps, kv_cache=kv_cache, loss=loss)
    points_iter = search.iter_sweep(model, batch_sizes=batches, optimizers=optims,
                                    precisions=precisions or [None], budget=resolved, **step)
    show = fmt != "json" and len(configs) > PROGRESS_MIN_CONFIGURATIONS and _is_terminal(sys.stderr)
    with quiet(), _progress(points_iter, len(configs), show) as progress:
        points = list(progress)
    if plot_path is not None:
        from memcalc.report.plot import plot_sweep

        written = plot_sweep(points, plot_path, capacity=resolved.capacity if resolved else None,
                             capacity_label=_capacity_label(resolved) if resolved else None)
        click.echo(f"wrote {written}", err=True)
    if fmt == "json":
        click.echo(render_json([p.to_dict() for p in points]))
        return
    click.echo(_render_sweep(points, resolved, fmt, units, with_precision=precisions is not None), nl=False)


@contextmanager
def _progress(points: Iterator[search.SweepPoint], total: int, show: bool) -> Iterator[Iterable[search.SweepPoint]]:
    if not show:
        yield points
        return
    with click.progressbar(points, length=total, label="estimating", file=sys.stderr,
                           show_pos=True) as bar:
        yield bar


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _capacity_label(budget: search.Budget) -> str:
    name = budget.gpu.key if budget.gpu is not None else "budget"
    return f"{name}: {format_bytes(budget.capacity, 'GiB')} usable"


_SWEEP_CATEGORIES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.ACTIVATIONS)


def _render_sweep(points: Sequence[search.SweepPoint], budget: search.Budget | None, fmt: str, unit: str,
                  *, with_precision: bool) -> str:
    headers = ["batch", "optimizer", *(["precision"] if with_precision else []), "peak allocated",
               *[c.value.replace("_", " ") for c in _SWEEP_CATEGORIES], "other"]
    if budget is not None:
        headers.append("fits")
    rows = []
    for point in points:
        b = point.report.bytes
        shown = [b.category(c) for c in _SWEEP_CATEGORIES]
        row = [str(point.batch_size), point.optimizer, *([point.precision or "-"] if with_precision else []),
               format_bytes(b.peak_allocated, unit), *[format_bytes(v, unit) for v in shown],
               format_bytes(b.peak_allocated - sum(shown), unit)]
        if budget is not None:
            row.append("yes" if point.fits else "no")
        rows.append(row)
    model = points[0].report.model if points else "?"
    title = f"memcalc sweep: {model}, {points[0].report.mode.value if points else ''} (binary units; bytes at the peak)"
    if budget is not None:
        title += f"\nbudget: {format_bytes(budget.capacity, unit)} ({budget.source})"
    colalign = ["right", "left", *(["left"] if with_precision else []), *["right"] * (len(_SWEEP_CATEGORIES) + 2)]
    if budget is not None:
        colalign.append("left")
    table = tabulate(rows, headers=headers, tablefmt=fmt, colalign=colalign, disable_numparse=True)
    return f"{title}\n\n{table}\n"


# --------------------------------------------------------------------------------------------
# memcalc gpus
# --------------------------------------------------------------------------------------------


@click.command("gpus")
@output_options
@handle_errors
def gpus_command(fmt: str, units: str, debug: bool) -> None:
    """List the GPUs this process can see (after CUDA_VISIBLE_DEVICES), in torch's order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gpu_catalogue.GpuDiscoveryWarning)
        found = gpu_catalogue.list_local_gpus()
    for warning in caught:
        click.echo(f"warning: {warning.message}", err=True)
    best = gpu_catalogue.best_gpu(found)
    if fmt == "json":
        click.echo(render_json([_gpu_dict(g, g is best) for g in found]))
        return
    if not found:
        click.echo("No GPU is visible to this process (NVML, nvidia-smi and torch.cuda found none). "
                   "Fit questions can still name a GPU model: memcalc fit MODEL --gpu a100-40gb.")
        return
    rows = [[g.device, "-" if g.physical_index is None else str(g.physical_index), g.name,
             format_bytes(g.total_memory, units), format_bytes(g.free_memory, units),
             g.profile.key if g.profile else "-", "*" if g is best else ""] for g in found]
    click.echo(tabulate(rows, headers=["device", "physical", "name", "total", "free", "catalogue", ""],
                        tablefmt=fmt, colalign=("left", "right", "left", "right", "right", "left", "left"),
                        disable_numparse=True))
    assert best is not None
    click.echo(f"\n* most free memory: --device auto picks {best.device}. Memory in binary units; "
               f"physical = nvidia-smi's index.")


def _gpu_dict(gpu: gpu_catalogue.LocalGpu, best: bool) -> dict[str, Any]:
    return {"device": gpu.device, "logical_index": gpu.logical_index, "physical_index": gpu.physical_index,
            "name": gpu.name, "uuid": gpu.uuid, "total_memory": gpu.total_memory,
            "free_memory": gpu.free_memory, "catalogue": gpu.profile.key if gpu.profile else None,
            "most_free": best}

"""``memcalc compare``: a real ``torch.cuda.memory._snapshot()`` beside memcalc's step."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import click

from memcalc import api
from memcalc.cli.hf import attn_model, attn_option
from memcalc.cli.options import field_option, given, handle_errors, output_options, quiet, step_arguments, step_options
from memcalc.cli.setup import setup_arguments, setup_options
from memcalc.core.errors import InvalidInputError
from memcalc.measure.snapshot import load_snapshot
from memcalc.measure.snapshot_compare import CodeSpan, compare_snapshot, is_memcalc_snapshot
from memcalc.report.compare_render import render_comparison
from memcalc.report.render import render_json
from memcalc.sources.resolve import resolve

__all__ = ("compare_command",)


@click.command("compare")
@click.argument("snapshot", type=click.Path(exists=True, dir_okay=False))
@click.argument("model")
@field_option("batch_size", param="batch", also="That of the run the snapshot recorded.")
@field_option("optimizer", param="optim")
@step_options
@field_option("precision")
@field_option("gpu", also="The one the snapshot was taken on.")
@setup_options
@attn_option
@output_options
@handle_errors
def compare_command(snapshot: str, model: str, batch: int, optim: str, precision: str, gpu: str | None,
                    fmt: str, units: str, debug: bool, **options: Any) -> None:
    """Compare SNAPSHOT, a torch.cuda.memory._snapshot() pickle of a real run, with memcalc's
    estimate of MODEL's step in the same configuration (the options of memcalc estimate):
    peaks, the reserved difference, allocations by phase, and the blocks each side lacks.

    Record the snapshot with memcalc MODEL [options] --measure-snapshot run.pickle (memcalc's
    step, run on this machine's GPU), or around your own step:
    torch.cuda.memory._record_memory_history(), the step, torch.cuda.memory._dump_snapshot("run.pickle").
    """
    try:
        real = load_snapshot(snapshot)
    except (pickle.UnpicklingError, EOFError, ValueError, OverflowError, MemoryError, KeyError, IndexError, TypeError,
            AttributeError) as exc:  # what pickle and the reading of its dict raise on other bytes
        reason = str(exc) or type(exc).__name__  # a MemoryError says nothing of itself
        raise InvalidInputError(f"{snapshot} is not a torch.cuda.memory._snapshot() pickle ({reason})",
                                hint="Write one with torch.cuda.memory._dump_snapshot(path) while "
                                     "torch.cuda.memory._record_memory_history() is on.") from None
    source = attn_model(model, options)
    step = dict(optimizer=optim if given("optim") else None, precision=precision, gpu=gpu,
                **step_arguments(options), **setup_arguments(options))
    with quiet():
        report = api.estimate(source, batch_size=batch if given("batch") or "trainer_args" not in step else None,
                              **step)
    code = () if is_memcalc_snapshot(real) else _model_code(source, batch, step)
    comparison = compare_snapshot(real, report, code)
    if fmt == "json":
        click.echo(render_json(comparison.to_dict()))
    else:
        click.echo(render_comparison(comparison, fmt=fmt, unit=units), nl=False)


def _model_code(source: Any, batch: int, step: dict[str, Any]) -> tuple[CodeSpan, ...]:
    """Where the ``forward`` of each of the model's classes lies, torch's own left out: what a
    real snapshot's ``forward`` frames run when it is a snapshot of this model (the model built
    once more, on meta)."""
    module = resolve(source, batch_size=batch, input_shape=step.get("input_shape"), seq_len=step.get("seq_len")).module
    spans = set()
    for cls in {type(m) for m in module.modules()}:
        path = inspect.getsourcefile(cls.forward)
        if path is None or "/torch/" in path.replace("\\", "/"):
            continue
        lines, first = inspect.getsourcelines(cls.forward)
        spans.add((path, first, first + len(lines) - 1))
    return tuple(sorted(spans))

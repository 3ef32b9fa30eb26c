"""The ``memcalc`` command: options, a call into the library, rendering, and error mapping.

``memcalc MODEL [options]`` estimates (the first positional argument is a model);
subcommands (``memcalc zoo``, ...) sit beside it. Errors become a one-paragraph message and
an exit code (2: bad input, 1: the model can't be estimated); ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

import click

from . import api
from .categories import Mode
from .errors import MemcalcError
from .losses import LossChoice
from .optimizers import Optimizer
from .precision import Precision
from .cli_strategy import strategy_arguments, strategy_options
from .render import TABLE_FORMATS, render_json, render_report, render_roles
from .units import Unit

__all__ = ("main",)

_FORMATS = (*TABLE_FORMATS, "json")


class ShapeType(click.ParamType):
    """``3,224,224`` (also ``3x224x224``) → ``(3, 224, 224)``."""

    name = "shape"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        text = str(value).strip().lower().replace("x", ",").strip("()[] ")
        try:
            dims = tuple(int(part) for part in text.split(",") if part.strip() != "")
        except ValueError:
            dims = ()
        if not dims or any(d < 1 for d in dims):
            self.fail(f"{value!r} is not a shape; give positive integers separated by commas, "
                      f"e.g. 3,224,224 (one sample, without the batch dimension)", param, ctx)
        return dims


class ModelFirstGroup(click.Group):
    """A group whose first positional argument may be a model instead of a subcommand:
    ``memcalc resnet50 ...`` runs ``memcalc estimate resnet50 ...``."""

    default_command = "estimate"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        first = next((a for a in args if not a.startswith("-")), None)
        wants_group_help = not args or args[0] in ("--help", "-h", "--version")
        if not wants_group_help and first is not None and first not in self.commands:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


def _handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Map library errors to a message and an exit code; tracebacks only with --debug."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = kwargs.get("debug", False)
        try:
            return func(*args, **kwargs)
        except MemcalcError as exc:
            if debug:
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug in memcalc or an unexpected failure: say so plainly
            if debug:
                raise
            click.echo(f"error: {type(exc).__name__}: {exc}\n(run again with --debug for the traceback)", err=True)
            sys.exit(1)

    return wrapper


def _common_output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")(func)
    func = click.option("--units", type=click.Choice([u.value for u in Unit], case_sensitive=False),
                        default=Unit.AUTO.value, show_default=True,
                        help="Binary units for byte figures (auto picks per figure).")(func)
    func = click.option("--format", "fmt", type=click.Choice(_FORMATS), default="simple", show_default=True,
                        help="A tabulate table format, or json (the stable JSON contract).")(func)
    return func


@click.group(cls=ModelFirstGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memcalc")
def main() -> None:
    """GPU memory of a PyTorch training step, estimated on a CPU.

    \b
    memcalc MODEL [options]      estimate one step (MODEL: a zoo name, file.py:factory, ...)
    memcalc zoo                  list the model zoo
    memcalc fit MODEL --gpu G    the largest batch that fits a GPU (or --budget, --device)
    memcalc sweep MODEL -b 1,64  memory over batch sizes, optimizers, precisions (--plot)
    memcalc gpus                 list this machine's GPUs

    Example: memcalc resnet50 --batch 64 --optim adam
    """


@main.command("estimate")
@click.argument("model")
@click.option("--batch", "-b", "batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size (samples per step).")
@click.option("--optim", "optim", type=click.Choice([o.value for o in Optimizer], case_sensitive=False),
              default=Optimizer.ADAM.value, show_default=True,
              help="Optimizer; its state is created by the real torch.optim class.")
@click.option("--input-shape", type=ShapeType(), default=None,
              help="Shape of one sample, without the batch dimension, e.g. 3,224,224.")
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Sequence length for token models.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=Mode.TRAIN.value, show_default=True,
              help="train: forward, loss, backward, optimizer step; eval: forward under no_grad; "
                   "inference: forward under inference_mode.")
@click.option("--precision", type=click.Choice([p.value for p in Precision]), default=Precision.FP32.value,
              show_default=True,
              help="fp32; amp-fp16/amp-bf16: CUDA autocast (fp32 master weights and optimizer state); "
                   "fp16/bf16: the whole model in that dtype.")
@click.option("--gpu", default=None, metavar="NAME",
              help="A GPU from the catalogue (h100-80gb, a100-40gb, t4, ...): kernel choices, workspaces, "
                   "its CUDA context, and whether the step fits. Default: a generic sm80-class profile.")
@click.option("--checkpoint", is_flag=True, help="Activation checkpointing per block (zoo models with blocks).")
@click.option("--accum-steps", type=click.IntRange(min=1), default=1, show_default=True,
              help="Gradient accumulation: micro-batches of --batch per optimizer step.")
@click.option("--kv-cache", type=click.IntRange(min=0), default=None, metavar="TOKENS",
              help="With --mode inference: a KV cache for the prompt plus TOKENS generated tokens "
                   "(decoder language models).")
@click.option("--loss", type=click.Choice([c.value for c in LossChoice]), default=None,
              help="Loss to train with (default: the zoo entry's, else auto: cross-entropy for (B, C) "
                   "outputs, the output's mean otherwise).")
@click.option("--depth", type=click.IntRange(min=0), default=1, show_default=True,
              help="Module depth of the per-module table (0 hides it).")
@click.option("--measure", is_flag=True,
              help="Also run the step for real (CUDA if available, else the CPU profiler) and compare.")
@strategy_options
@_common_output_options
@_handle_errors
def estimate_command(model: str, batch: int, optim: str, input_shape: tuple[int, ...] | None,
                     seq_len: int | None, mode: str, precision: str, gpu: str | None, checkpoint: bool,
                     accum_steps: int, kv_cache: int | None, loss: str | None, depth: int, measure: bool,
                     fmt: str, units: str, debug: bool, **multi_gpu: Any) -> None:
    """Estimate the GPU memory of one step of MODEL.

    MODEL is a zoo name (memcalc zoo lists them), path/to/file.py:factory,
    package.module:factory, torchvision:NAME, timm:NAME, hf:NAME or hf:config.json.
    """
    step = dict(optimizer=optim, mode=mode, precision=precision, gpu=gpu, checkpoint=checkpoint,
                accum_steps=accum_steps, kv_cache=kv_cache, loss=loss)
    distributed = strategy_arguments(measure=measure, **multi_gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warnings reach the user as the report's notes
        report = api.estimate(model, batch_size=batch, input_shape=input_shape, seq_len=seq_len,
                              module_depth=max(depth, 1), **step, **distributed)
    if measure:
        from .measure import attach_measurement

        report = attach_measurement(report, model, batch_size=batch, input_shape=input_shape, seq_len=seq_len,
                                    **step)
    if fmt == "json":
        data = report.to_dict()
        if report.measurement is not None:
            data["measured"] = _measurement_dict(report)
        click.echo(render_json(data))
    else:
        if report.roles:
            click.echo(render_roles(report, fmt=fmt, unit=units))
        click.echo(render_report(report, fmt=fmt, unit=units, modules=depth > 0), nl=False)


def _measurement_dict(report) -> dict[str, Any]:
    m = report.measurement
    return {"device": m.device, "peak_allocated": m.peak_allocated, "peak_reserved": m.peak_reserved,
            "oom": m.oom, "compared_with": m.compared_with, "relative_error": m.relative_error()}


@main.command("zoo")
@_common_output_options
@_handle_errors
def zoo_command(fmt: str, units: str, debug: bool) -> None:
    """List the model zoo: name, family, parameters, default input."""
    import models_zoo
    from tabulate import tabulate

    rows = [{"name": e.name, "family": e.family, "parameters": e.reference_parameters,
             "default_input": e.default_input_text} for e in models_zoo.entries()]
    if fmt == "json":
        click.echo(render_json(rows))
        return
    table = [[r["name"], r["family"], f"{r['parameters']:,}" if r["parameters"] else "-", r["default_input"]]
             for r in rows]
    click.echo(tabulate(table, headers=["name", "family", "parameters", "default input"], tablefmt=fmt,
                        colalign=("left", "left", "right", "left"), disable_numparse=True))


from .cli_fit import fit_command, gpus_command, sweep_command  # noqa: E402  (subcommands)

main.add_command(fit_command)
main.add_command(sweep_command)
main.add_command(gpus_command)


if __name__ == "__main__":  # pragma: no cover
    main()

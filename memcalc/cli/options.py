"""What every ``memcalc`` command shares: error mapping, output options, the options that
shape one step, and parameter types. The commands live in :mod:`memcalc.cli.app` (estimate),
:mod:`memcalc.cli.zoo`, :mod:`memcalc.cli.fit`, :mod:`memcalc.cli.sweep`, :mod:`memcalc.cli.gpus` and
:mod:`memcalc.cli.compare`; all import from here, so none depends on another's import order. This
module imports no torch (``--help``, ``zoo`` and ``gpus`` load it): the step's fields are deferred."""

from __future__ import annotations

import enum
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from memcalc.cli.progress import progress_on_terminal
from memcalc.core.errors import InternalError, MemcalcError
from memcalc.core.units import Unit
from memcalc.report.formats import TABLE_FORMATS

if TYPE_CHECKING:  # the step's fields import torch: loaded by the commands that estimate, not by --help
    from memcalc.fields import Field

__all__ = ("FORMATS", "ShapeType", "field_option", "given", "handle_errors", "output_options", "quiet",
           "step_arguments", "step_options")

FORMATS = (*TABLE_FORMATS, "json")


class ShapeType(click.ParamType[tuple[int, ...]]):
    """``3,224,224`` (also ``3x224x224``) → ``(3, 224, 224)``."""

    name = "shape"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        """Parse ``value``; a tuple is already a shape; a usage error otherwise."""
        if isinstance(value, tuple):
            return value
        text = str(value).strip().lower().strip("()[] ")
        parts = text.split("," if "," in text else "x")  # 3,224,224 or 3x224x224: each part one dimension
        bad = next((part for part in parts if not _is_dimension(part.strip())), None)
        if bad is not None:
            what = "an empty dimension" if not bad.strip() else f"the dimension {bad.strip()!r}"
            self.fail(f"{value!r} is not a shape ({what}); give positive integers separated by commas, "
                      f"e.g. 3,224,224 (one sample, without the batch dimension)", param, ctx)
        return tuple(int(part) for part in parts)


def _is_dimension(text: str) -> bool:
    """Whether ``text`` is a dimension: ASCII digits, at least 1 (``"x"``, ``""``, ``"-1"`` are not)."""
    return text.isascii() and text.isdigit() and int(text) >= 1


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Map library errors to a message and an exit code; tracebacks only with --debug. Long work
    inside shows a progress bar on a terminal (:func:`memcalc.cli.progress.progress_on_terminal`),
    its line ended before an error is printed."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = kwargs.get("debug", False)
        try:
            with progress_on_terminal(kwargs.get("fmt", "")):
                return func(*args, **kwargs)
        except MemcalcError as exc:
            if debug:
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug in memcalc's own code outside the library's entry points: say so plainly
            if debug:
                raise
            click.echo(f"error: {InternalError(exc, stage=f'in memcalc {func.__name__}')}", err=True)
            sys.exit(InternalError.exit_code)

    return wrapper


def force_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--force``: the files a command writes may replace existing ones (else they are refused,
    before any work)."""
    return click.option("--force", is_flag=True,
                        help="Overwrite the files named by --timeline, --snapshot, --measure-snapshot or --plot "
                             "if they exist (without it an existing file is refused, before any estimate).")(func)


def output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--format``, ``--units``, ``--debug``."""
    func = click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")(func)
    func = click.option("--units", type=click.Choice([u.value for u in Unit], case_sensitive=False),
                        default=Unit.AUTO.value, show_default=True,
                        help="Binary units for byte figures (auto picks per figure).")(func)
    func = click.option("--format", "fmt", type=click.Choice(FORMATS), default="simple", show_default=True,
                        help="A tabulate table format, or json (the stable JSON contract).")(func)
    return func


def _shared(field: Field) -> bool:
    return field.cli is not None and not field.cli.per_command


def step_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options that shape one step the same way in every command: each field of
    :data:`memcalc.fields.FIELDS` with a :class:`~memcalc.fields.Flag` that is not ``per_command``
    (batch, optimizer, precision and GPU each command adds with :func:`field_option`)."""
    from memcalc.fields import FIELDS  # deferred: it imports torch, which --help, zoo and gpus never need

    for field in reversed([f for f in FIELDS.values() if _shared(f)]):
        func = _option(field)(func)
    return func


#: :func:`field_option`'s default: the field's (or its flag's) own.
_FIELD_DEFAULT: Any = object()


def field_option(name: str, *, param: str | None = None, many: bool = False, default: Any = _FIELD_DEFAULT,
                 also: str = "", required: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The option of the field ``name`` (:data:`memcalc.fields.FIELDS`) in one command's form.

    Args:
        name: the field.
        param: the command's parameter name (default: the field's).
        many: a comma-separated list (``sweep``): each item converted as the single value is.
        default: the command's default, where it differs from the field's (None: the step's own,
            as a search takes it).
        also: what the command adds to the field's help.
        required: the command needs a value (``sweep --batch``).
    """
    from memcalc.fields import FIELDS  # deferred: it imports torch, which --help, zoo and gpus never need

    field = FIELDS[name]
    flag = field.cli
    if flag is not None and flag.kind == "budget":
        return _budget_options
    assert flag is not None and field.flag is not None
    if default is _FIELD_DEFAULT:
        default = field.default if field.default is not None else flag.default
    default = default.value if isinstance(default, enum.Enum) else default
    spelled = [field.flag, *([flag.short] if flag.short else []), param or field.name]
    help_text = " ".join(part for part in (field.help, also) if part)
    # a required option has no default at all: click (8.3) takes an explicit None for a value given
    needed: dict[str, Any] = {"required": True} if required else {"default": default}
    if many:
        from memcalc.cli.params import ListType, choice_of  # deferred: they import torch

        item: Callable[[str], Any]
        if flag.kind == "int":
            item, example = _count_item(field), flag.example
        else:
            names = _choices(field)
            item, example = choice_of(names), ", ".join(names())
        metavar = flag.metavar or field.name.upper()
        return click.option(*spelled, type=ListType(item, metavar), show_default=default is not None, **needed,
                            help=f"{help_text} Comma-separated, one estimate each: {example}.")
    return click.option(*spelled, type=_kind(field), show_default=flag.show_default and default is not None, **needed,
                        metavar=flag.metavar if flag.kind == "text" else None, help=help_text)


def _budget_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """A ``budget`` field's flags (:data:`memcalc.fields.BUDGET_FORMS`: ``--gpu``, ``--budget``,
    ``--device``; keyword arguments ``gpu``, ``budget``, ``device``), in that order in ``--help``;
    :func:`memcalc.cli.params.budget_arguments` takes the one given."""
    from memcalc.cli.params import CLI_BYTES_FORMS, BytesType  # deferred: they import torch
    from memcalc.fields import BUDGET_FORMS

    for name, (spelled, metavar, help_text) in reversed(list(BUDGET_FORMS.items())):
        func = click.option(spelled, name, type=BytesType() if name == "budget" else click.STRING, default=None,
                            metavar=metavar, help=help_text.format(bytes_forms=CLI_BYTES_FORMS))(func)
    return func


def _count_item(field: Field) -> Callable[[str], int]:
    """One item of a list of counts, judged as the API judges the field
    (:func:`memcalc.fields.positive_int`: its error, a ``ValueError``, names the option)."""
    from memcalc.fields import positive_int  # deferred: it imports torch

    def convert(text: str) -> int:
        number: object = int(text) if text.isascii() and text.isdigit() else text
        return int(positive_int(number, field.name, field.flag))

    return convert


def _choices(field: Field) -> Callable[[], list[str]]:
    """The values a choice or optimizer field takes, read when asked (a registry may grow)."""
    if field.cli is not None and field.cli.kind == "optimizer":
        from memcalc.engine.optimizers import optimizer_names  # deferred: it imports torch

        return lambda: list(optimizer_names())
    assert field.choices is not None
    values = [str(c.value) for c in field.choices]
    return lambda: values


def _kind(field: Field) -> click.ParamType[Any]:
    """The click parameter type of one value of ``field``."""
    flag = field.cli
    assert flag is not None
    if flag.kind == "choice":
        assert field.choices is not None
        return click.Choice([c.value for c in field.choices], case_sensitive=False)  # as the API reads them
    if flag.kind == "optimizer":
        from memcalc.cli.params import OptimizerChoice  # deferred: it imports torch

        return OptimizerChoice()
    if flag.kind == "shape":
        return ShapeType()
    if flag.kind == "text":
        return click.STRING
    return click.IntRange(min=flag.minimum)


def _option(field: Field) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The click option of ``field``: its flag, a parameter type for its kind, its default and help."""
    flag = field.cli
    assert flag is not None and field.flag is not None
    if flag.kind == "switch":
        return click.option(field.flag, field.name, is_flag=True, help=field.help)
    kind = _kind(field)
    if flag.bare is not None:  # the value may be left out: the flag alone means ``bare``
        return click.option(field.flag, field.name, type=kind, is_flag=False, flag_value=flag.bare, default=None,
                            metavar=flag.metavar, help=field.help)
    default = field.default.value if isinstance(field.default, enum.Enum) else field.default
    return click.option(field.flag, field.name, type=kind, default=default, show_default=flag.show_default,
                        metavar=flag.metavar, help=field.help)


def given(name: str) -> bool:
    """Whether the current command's parameter ``name`` was set by the user (on the command
    line or through the environment), not left at its default: an option the step would
    ignore is refused only when the user asked for it."""
    ctx = click.get_current_context()
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def step_arguments(params: dict[str, Any]) -> dict[str, Any]:
    """Pop :func:`step_options`' values from a command's ``params`` and return them as
    :func:`memcalc.estimate` keywords (None: its default). Their combinations (a loss for an eval
    step) are judged once, by :func:`memcalc.fields.build_step`."""
    from memcalc.fields import FIELDS  # deferred: it imports torch, which --help, zoo and gpus never need

    values = {field.name: params.pop(field.name, None) for field in FIELDS.values() if _shared(field)}
    return {name: value for name, value in values.items() if value is not None}


@contextmanager
def quiet() -> Iterator[None]:
    """Estimates warn about approximations; the CLI shows them as the report's notes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield

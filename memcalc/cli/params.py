"""Parameter types and options shared by ``memcalc fit`` and ``memcalc sweep``: byte counts,
comma-separated lists, and the budget (``--gpu``, ``--budget``, ``--device``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

from memcalc.core.gpu import CPU_PROFILE
from memcalc.core.precision import Precision
from memcalc.core.units import BYTES_FORMS, parse_bytes
from memcalc.engine.optimizers import optimizer_names
from memcalc.stacks import bitsandbytes as _bitsandbytes  # noqa: F401  # registers its optimizers: --optim lists them

__all__ = (
    "OPTIMIZERS",
    "PRECISIONS",
    "BytesType",
    "ListType",
    "OptimizerChoice",
    "UnitCommand",
    "budget_arguments",
    "choice_of",
)

_T = TypeVar("_T")


class BytesType(click.ParamType[int]):
    """``24GiB``, ``16 GiB``, ``80GB``, ``12884901888B`` → bytes. A number needs its unit: a bare
    ``10`` is refused rather than read as 10 bytes (the unit forgotten, not a budget of 10 B)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """Bytes from ``value`` (an int is already bytes); a usage error for an unreadable size."""
        if isinstance(value, int):
            return value
        try:
            nbytes = parse_bytes(value)
        except ValueError as exc:  # named in the command line's forms: a number with its unit
            self.fail(str(exc).replace(BYTES_FORMS, CLI_BYTES_FORMS), param, ctx)
        number = str(value).strip()
        if _NUMBER.fullmatch(number):  # "10" is rarely 10 bytes: the unit was forgotten
            self.fail(f"{number} has no unit; give a unit: {number}GiB, {number}GB, {number}MiB "
                      f"({number}B for bytes)", param, ctx)
        return nbytes


class ListType(click.ParamType[list[_T]]):
    """A comma-separated list, each item converted by ``item``; a bad item is a usage error
    that names it."""

    def __init__(self, item: Callable[[str], _T], what: str) -> None:
        self.item = item
        self.what = what
        self.name = f"{what}[,{what}...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[_T]:
        """Split ``value`` at commas and convert each item (a list is already converted)."""
        if isinstance(value, list):
            return value
        items = [part.strip() for part in str(value).split(",")]
        converted: list[_T] = []
        for item in items:
            try:
                converted.append(self.item(item))
            except ValueError as exc:
                self.fail(f"item {item!r} of {value!r}: {exc}", param, ctx)
        return converted


def choice_of(values: Iterable[str] | Callable[[], Iterable[str]]) -> Callable[[str], str]:
    """A converter to one of ``values`` (case-insensitive, lower-cased; a callable: read at each
    conversion, as a registry is); ``ValueError`` otherwise."""

    def convert(text: str) -> str:
        allowed = list(values() if callable(values) else values)
        if text.lower() not in allowed:
            raise ValueError(f"choose from {', '.join(allowed)}")
        return text.lower()

    return convert


class OptimizerChoice(click.Choice[str]):
    """``--optim``'s values: every optimizer registered when the command line is read
    (:func:`memcalc.engine.optimizers.register_optimizer`), a package's included, whenever it
    registered."""

    def __init__(self) -> None:
        super().__init__((), case_sensitive=False)

    @property  # click.Choice stores a tuple; the registry is read instead
    def choices(self) -> tuple[str, ...]:
        """The registered optimizers' names."""
        return optimizer_names()

    @choices.setter
    def choices(self, _value: Any) -> None:
        """click.Choice's constructor sets its list; the registry is the list here."""


class UnitCommand(click.Command):
    """Reads ``--budget 16 GiB`` (unquoted) as one size: a number followed by a word that
    would otherwise be a second positional argument is that number's unit."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Join a ``--budget`` number and its unit, then parse as click does."""
        flags = {name for p in self.get_params(ctx) if isinstance(p, click.Option) and p.is_flag
                 for name in (*p.opts, *p.secondary_opts)}
        return super().parse_args(ctx, _join_budget_unit(args, flags))


_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
#: The sizes ``--budget`` takes: a number with its unit (a bare number is refused, not read as bytes).
CLI_BYTES_FORMS = "a number with a unit: 24GiB, 16 GiB, 80GB, 512MiB, 1.5TiB, 12884901888B"
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


def budget_arguments(gpu: str | None, budget: int | None, device: str | None, *, required: bool) -> dict[str, Any]:
    """The one budget option given, as :func:`memcalc.targets.budget.resolve_budget` keywords; a
    usage error for more than one (or none, when ``required``)."""
    given = {name: value for name, value in (("gpu", gpu), ("budget", budget), ("device", device))
             if value is not None}
    if gpu is not None and gpu.strip().lower() == CPU_PROFILE.key and device is None:
        return given  # the CPU target, under --budget when given, else this machine's available RAM
    if len(given) > 1:
        raise click.UsageError(
            f"give only one of --gpu, --budget or --device (got {', '.join('--' + n for n in given)})")
    if required and not given:
        raise click.UsageError("give a GPU model (--gpu a100-40gb), a budget (--budget 16GiB) or a local "
                               "GPU (--device auto)")
    return given


PRECISIONS = [p.value for p in Precision]
#: The optimizers registered when the CLI was imported (``plan``'s list); :class:`OptimizerChoice`
#: reads the registry each time.
OPTIMIZERS = list(optimizer_names())



"""Byte units: binary for display (KiB … EiB — said so in every header) and a forgiving
parser for budgets (``"24GiB"``, ``"80GB"``, ``"16 gib"``, ``12884901888``).

Decimal suffixes (kB, MB, GB, TB) mean powers of 1000 as the SI says; binary ones (KiB, MiB,
GiB, TiB) powers of 1024. GPU vendors sell "80 GB" cards that hold 80 GiB-ish; we do not
guess: ``"80GB"`` is 80·10⁹ bytes.
"""

from __future__ import annotations

import enum
import re

__all__ = ("BYTES_FORMS", "Unit", "auto_unit", "format_bytes", "parse_bytes", "unit_bytes")


class Unit(str, enum.Enum):
    """Display units; ``AUTO`` picks the largest unit that keeps the number ≥ 1. The units
    above GiB exist so that an absurd request (a batch of a billion) reads as the absurdity it
    is — "77.01 PiB" — rather than as a 14-digit GiB figure."""

    AUTO = "auto"
    B = "B"
    KIB = "KiB"
    MIB = "MiB"
    GIB = "GiB"
    TIB = "TiB"
    PIB = "PiB"
    EIB = "EiB"


_BINARY = {Unit.B: 1, Unit.KIB: 1024, Unit.MIB: 1024**2, Unit.GIB: 1024**3, Unit.TIB: 1024**4,
           Unit.PIB: 1024**5, Unit.EIB: 1024**6}

_SUFFIXES = {
    "": 1,
    "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
    "p": 1024**5, "pib": 1024**5, "pb": 1000**5,
    "e": 1024**6, "eib": 1024**6, "eb": 1000**6,
}

BYTES_FORMS = "an integer number of bytes or a number with a unit: 24GiB, 16 GiB, 80GB, 512MiB, 1.5TiB"

_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """Parse a byte count. Raises ``ValueError`` naming the accepted forms on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte count: {value!r}; expected {BYTES_FORMS}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"a byte count must be positive, got {value!r}")
        return int(value)
    match = _PATTERN.match(str(value))
    suffix = match.group(2).lower() if match else None
    if match is None or suffix not in _SUFFIXES:
        raise ValueError(f"cannot read {value!r} as a size; expected {BYTES_FORMS}")
    number = float(match.group(1)) * _SUFFIXES[suffix]
    if number <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return int(number)


def auto_unit(nbytes: int | float) -> Unit:
    """The largest binary unit that keeps ``nbytes`` at 1 or more (``Unit.B`` below 1 KiB)."""
    for unit in (Unit.EIB, Unit.PIB, Unit.TIB, Unit.GIB, Unit.MIB, Unit.KIB):
        if abs(nbytes) >= _BINARY[unit]:
            return unit
    return Unit.B


def unit_bytes(unit: Unit | str) -> int:
    """Bytes in one ``unit`` (``"GiB"`` → 1,073,741,824); ``Unit.AUTO`` has no size."""
    unit = Unit(unit)
    if unit is Unit.AUTO:
        raise ValueError("Unit.AUTO has no size: pick one with auto_unit()")
    return _BINARY[unit]


def format_bytes(nbytes: int | float, unit: Unit | str = Unit.AUTO, *, with_unit: bool = True) -> str:
    """``format_bytes(21248)`` → ``'20.75 KiB'``; ``format_bytes(5, "MiB")`` → ``'0.00 MiB'``."""
    unit = Unit(unit)
    if unit is Unit.AUTO:
        unit = auto_unit(int(nbytes))
    text = f"{int(nbytes):,}" if unit is Unit.B else f"{nbytes / _BINARY[unit]:,.2f}"
    return f"{text} {unit.value}" if with_unit else text

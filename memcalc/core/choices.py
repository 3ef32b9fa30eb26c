"""User strings to memcalc's enums, in one place, with one error message."""

from __future__ import annotations

import enum
from typing import TypeVar

from memcalc.core.errors import InvalidInputError

__all__ = ("parse_choice",)

E = TypeVar("E", bound=enum.Enum)


def parse_choice(kind: type[E], value: object, what: str) -> E:
    """``value`` as a member of ``kind``: a member as is, a string case- and space-insensitively.

    Args:
        kind: the enum (its values are strings).
        value: what the user gave.
        what: the argument's name for the error message (``"optimizer"``).

    Returns:
        The member.

    Raises:
        InvalidInputError: naming the argument, the value and every choice.
    """
    if isinstance(value, kind):
        return value
    raw = value.value if isinstance(value, enum.Enum) else value
    try:
        return kind(str(raw).strip().lower())
    except ValueError:
        choices = ", ".join(str(member.value) for member in kind)
        raise InvalidInputError(f"unknown {what} {value!r}; choose one of: {choices}") from None

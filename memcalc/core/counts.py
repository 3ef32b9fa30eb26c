"""Counts a user gives (batch sizes, sequence lengths, world sizes, dimensions): what an integer
is, and the largest one a step can hold.

PyTorch holds every size, element count and byte count as a signed 64-bit integer
(``int64_t`` in c10's ``IntArrayRef`` and ``TensorImpl::numel``): a larger count cannot reach
a tensor, and a batch whose input would hold more bytes than that cannot exist. Converters
check these bounds up front, so that such a value is refused naming the option instead of
failing deep inside torch with its C++ frames.
"""

from __future__ import annotations

import math
import numbers
import operator

__all__ = ("INT64_MAX", "as_integer", "fits_int64", "tensor_bytes_problem")

#: The largest size, element count or byte count a tensor can have: ``2**63 - 1`` (int64).
INT64_MAX = 2**63 - 1


def as_integer(value: object) -> int | None:
    """``value`` as an ``int`` when it is an integer — a Python ``int`` or any other
    ``numbers.Integral`` (NumPy's ``int64``, ...) — else None. ``True`` is not a count, nor
    is ``64.0``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def fits_int64(value: int) -> bool:
    """Whether ``value`` fits a tensor's sizes (at most :data:`INT64_MAX`)."""
    return value <= INT64_MAX


def tensor_bytes_problem(shape: tuple[int, ...], element_bytes: int) -> str | None:
    """Why a tensor of ``shape`` and ``element_bytes`` per element cannot exist (its byte size
    beyond :data:`INT64_MAX`), in words; None when it can."""
    elements = math.prod(shape)
    if elements * element_bytes <= INT64_MAX:
        return None
    return (f"{' × '.join(f'{d:,}' for d in shape)} = {elements:,} elements of {element_bytes} B, more than a "
            f"tensor can hold (2**63 - 1 B)")

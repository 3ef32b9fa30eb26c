"""Python numbers in tensor arithmetic, on the CPU target.

``x / 2.0``, ``x * 2`` or ``1 - x`` pass a Python number where the op's schema takes a tensor (or,
``rsub.Scalar``, wraps it inside): PyTorch makes it a 0-dim CPU tensor, a "wrapped number" of its
Python type (``scalar_to_tensor``: float64 for a float, int64 for an int, 8 B), and the CPU's
``TensorIterator`` casts it to the op's common dtype (``promote_inputs_to_common_dtype``, a copy of
that dtype's size) before the output is allocated; both are freed when the op returns. A real
float32 ``x / 2.0`` under the profiler: +8, +4, the output, -4, -8. Meta tensors never show these
host scalars, so the CPU target adds them as one transient block after the op
(:func:`wrapped_number`), alive beside the output as on the CPU.

They matter where such an op is a step's peak: the for-loop Adam's ``exp_avg_sq.sqrt() /
bias_correction2_sqrt`` on the largest parameter (the tiny Mixtral's expert-parallel runs over
gloo: 12 B under before), the foreach Adam's ``_foreach_div_`` by the same list of floats (DDP's
gloo runs: 12 B under before). On a GPU the number stays a CPU scalar that the kernel reads by value:
the CUDA target has no such rule. Checked op by op against the real CPU kernels
(tests/test_cpu_scalars.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch._ops import OpOverload

__all__ = ("WRAPPED_NUMBER", "WRAPPING_OPS", "wrapped_number", "wrapped_number_bytes")

aten = torch.ops.aten

#: How the trace labels the block.
WRAPPED_NUMBER = "synthetic: a Python number wrapped as a CPU tensor in"

#: The ops that wrap a Python number in their second argument (``other``), each checked on the CPU.
#: The CPU runs a foreach op with a scalar (or a list of them) tensor by tensor (its slow path:
#: ``t.div_(scalar)``), each wrapping its number while it runs: one wrapped number at a time.
WRAPPING_OPS: tuple[OpOverload, ...] = (
    aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.mul.Tensor, aten.mul_.Tensor,
    aten.div.Tensor, aten.div_.Tensor, aten.rsub.Scalar,
    *(getattr(getattr(aten, f"_foreach_{name}{suffix}"), overload)
      for name in ("add", "sub", "mul", "div") for suffix in ("", "_") for overload in ("Scalar", "ScalarList")),
)

#: The dtype a Python number is wrapped as (``scalar_to_tensor``: double for a float, long for an int).
_WRAPPED_DTYPES: dict[type, torch.dtype] = {float: torch.float64, int: torch.int64}


class _Kernels(Protocol):
    """What the rule needs of :class:`~memcalc.targets.cpu.kernels.CpuKernels`."""

    def add_temporary(self, nbytes: int, label: str | None = None) -> None: ...


def wrapped_number_bytes(number: object, common: torch.dtype) -> int:
    """The bytes a Python ``number`` takes on the CPU in an op computing in ``common``: its wrapped
    tensor, and the cast to ``common`` where the dtypes differ (0 for anything but an int or a float)."""
    wrapped = _WRAPPED_DTYPES.get(type(number))  # exactly int or float: bool is an int subclass
    if wrapped is None:
        return 0
    return wrapped.itemsize + (common.itemsize if common != wrapped else 0)


def wrapped_number(kernels: _Kernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                   out: Any) -> None:
    """The wrapped number and its cast, alive beside the output (module docstring)."""
    number = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("scalar", kwargs.get("scalars")))
    tensor = out if isinstance(out, torch.Tensor) else args[0]
    if isinstance(tensor, (list, tuple)):  # a foreach op: the last tensor's number, the one alive at its end
        tensor = tensor[-1] if tensor else None
        number = number[-1] if isinstance(number, (list, tuple)) and number else number
    if isinstance(tensor, torch.Tensor):
        nbytes = wrapped_number_bytes(number, tensor.dtype)
        if nbytes:
            kernels.add_temporary(nbytes, f"{WRAPPED_NUMBER} {op}")

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

Autograd keeps some: ``mul`` and ``div`` save ``other`` for ``self``'s gradient (derivatives.yaml),
so ``y * scaling`` on a ``y`` that requires grad keeps its wrapped 8 B in ``MulBackward0`` until that
node's backward has run (``release_variables``); its ``grad * other`` then casts the saved number
again (4 B). PEFT's LoRA layer (``lora_B(lora_A(x)) * scaling``) holds one per adapted layer: DDP's
LoRA gloo run was 40 B over the estimate at its backward peak before (:class:`SavedNumbers`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch._ops import OpOverload

__all__ = ("SAVED_NUMBER", "SAVING_OPS", "WRAPPED_NUMBER", "WRAPPING_OPS", "SavedNumbers", "wrapped_number",
           "wrapped_number_bytes")

aten = torch.ops.aten

#: How the trace labels the block.
WRAPPED_NUMBER = "synthetic: a Python number wrapped as a CPU tensor in"
#: How the trace labels a wrapped number that autograd saves for backward.
SAVED_NUMBER = "synthetic: a Python number wrapped as a CPU tensor, saved for backward by"

#: The ops that wrap a Python number in their second argument (``other``), each checked on the CPU.
#: The CPU runs a foreach op with a scalar (or a list of them) tensor by tensor (its slow path:
#: ``t.div_(scalar)``), each wrapping its number while it runs: one wrapped number at a time.
WRAPPING_OPS: tuple[OpOverload, ...] = (
    aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.mul.Tensor, aten.mul_.Tensor,
    aten.div.Tensor, aten.div_.Tensor, aten.rsub.Scalar,
    *(getattr(getattr(aten, f"_foreach_{name}{suffix}"), overload)
      for name in ("add", "sub", "mul", "div") for suffix in ("", "_") for overload in ("Scalar", "ScalarList")),
)

#: The ops whose derivative saves ``other`` for ``self``'s gradient (derivatives.yaml: ``self:
#: mul_tensor_backward(grad, other, ...)`` and ``div_tensor_self_backward(grad, other, ...)``; add and
#: sub save nothing, rsub.Scalar takes its number as a Scalar).
SAVING_OPS: frozenset[OpOverload] = frozenset({aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor})

#: The dtype a Python number is wrapped as (``scalar_to_tensor``: double for a float, long for an int).
_WRAPPED_DTYPES: dict[type, torch.dtype] = {float: torch.float64, int: torch.int64}


class _Kernels(Protocol):
    """What the rule needs of :class:`~memcalc.targets.cpu.kernels.CpuKernels`."""

    saved_numbers: SavedNumbers

    def add_temporary(self, nbytes: int, label: str | None = None) -> None: ...

    def hold(self, nbytes: int, label: str) -> int: ...

    def release(self, uid: int) -> None: ...


class SavedNumbers:
    """The wrapped numbers autograd holds, by the sequence number of the node that saved them
    (``Node._sequence_nr()``: unique on the tracing thread, read in backward from
    ``torch._C._current_autograd_node()`` without unpacking the saved variable)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # node sequence number → the held block's uid

    @staticmethod
    def saves(op: OpOverload, args: tuple[Any, ...]) -> bool:
        """Whether autograd saves ``op``'s wrapped ``other`` now: ``self`` requires grad under grad
        mode, outside a backward and without saved-tensor hooks. A checkpointed region's pack hook drops
        the number at once; a recomputation in backward keeps it until its use (the non-reentrant
        checkpoint's holder, the reentrant one's graph) and is followed as before: transient."""
        tensor = args[0] if args else None
        return (op in SAVING_OPS and isinstance(tensor, torch.Tensor) and tensor.requires_grad
                and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)

    def save(self, uid: int) -> None:
        """``uid`` is held by the node autograd made for the op now dispatched: the last one numbered
        on this thread (``_get_sequence_nr() - 1``, as torch.fx's proxy reads it)."""
        self.held[torch._C._autograd._get_sequence_nr() - 1] = uid

    def released_now(self) -> int | None:
        """The uid the node whose backward runs now saved, taken off (None: not one of these)."""
        node = torch._C._current_autograd_node()
        return None if node is None else self.held.pop(node._sequence_nr(), None)


def wrapped_number_bytes(number: object, common: torch.dtype) -> int:
    """The bytes a Python ``number`` takes on the CPU in an op computing in ``common``: its wrapped
    tensor, and the cast to ``common`` where the dtypes differ (0 for anything but an int or a float)."""
    wrapped = _WRAPPED_DTYPES.get(type(number))  # exactly int or float: bool is an int subclass
    if wrapped is None:
        return 0
    return wrapped.itemsize + (common.itemsize if common != wrapped else 0)


def wrapped_number(kernels: _Kernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                   out: Any) -> None:
    """The wrapped number and its cast, alive beside the output; a number autograd saves is held
    until its node's backward (module docstring)."""
    number = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("scalar", kwargs.get("scalars")))
    tensor = out if isinstance(out, torch.Tensor) else args[0]
    if isinstance(tensor, (list, tuple)):  # a foreach op: the last tensor's number, the one alive at its end
        tensor = tensor[-1] if tensor else None
        number = number[-1] if isinstance(number, (list, tuple)) and number else number
    if not isinstance(tensor, torch.Tensor):
        return
    nbytes = wrapped_number_bytes(number, tensor.dtype)
    if not nbytes:
        return
    if op in SAVING_OPS:
        wrapped = _WRAPPED_DTYPES[type(number)].itemsize
        saved = kernels.saved_numbers.released_now()
        if saved is not None:  # the node's own ``grad * other``: the saved number cast, then released
            kernels.add_temporary(nbytes - wrapped, f"{WRAPPED_NUMBER} {op}")
            kernels.release(saved)
            return
        if SavedNumbers.saves(op, args):
            kernels.saved_numbers.save(kernels.hold(wrapped, f"{SAVED_NUMBER} {op}"))
            kernels.add_temporary(nbytes - wrapped, f"{WRAPPED_NUMBER} {op}")
            return
    kernels.add_temporary(nbytes, f"{WRAPPED_NUMBER} {op}")

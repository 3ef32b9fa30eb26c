"""Other libraries' kernels as ``memcalc::`` operators, each with what one launch costs.

memcalc emulates some libraries' CUDA kernels on meta tensors without importing the library:
bitsandbytes' dequantization and int8 matmul (:mod:`memcalc.stacks.bitsandbytes.quantized_base`) and its
optimizer updates (:mod:`memcalc.stacks.bitsandbytes.adamw`). :func:`define_kernels` gives each such kernel an
operator of its own, so that the tracer sees one launch where the library launches one, as it
sees an aten op. Their schemas say too little for a step time — which arguments a kernel reads,
which it writes through a pre-allocated ``out``, what arithmetic it does — so the module that
defines an operator registers beside it, by op object, the rule that works out one call's
:class:`KernelCost` (:data:`KERNEL_COSTS`); the FLOP recorder of a timed step reads it there
(:class:`memcalc.timing.flops.OpCostRecorder`). The registry lives in the engine, with the
operators, so that the emulations never import the timing code that reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

import torch

from memcalc.core.throughput import OpClass
from memcalc.engine.rules import RuleRegistry

__all__ = ("KERNEL_COSTS", "KernelCost", "KernelCostRule", "define_kernels", "device_bytes")


class KernelCost(NamedTuple):
    """What one emulated kernel costs, as its :data:`KERNEL_COSTS` rule works it out."""

    op_class: OpClass
    bytes_read: int
    bytes_written: int
    flops: int = 0
    dtype: torch.dtype | None = None  # the dtype a compute kernel computes in (its math mode's peak)
    uncounted: bool = False  # does a matrix product's arithmetic without a FLOP figure (an int8 GEMM)


#: ``(args, kwargs, out) → KernelCost``: the cost of one call of an emulated kernel, from the
#: arguments the tracer dispatched (positional, as the op's schema orders them).
KernelCostRule: TypeAlias = Callable[[tuple[Any, ...], dict[str, Any], Any], KernelCost]
#: Rules for the kernels memcalc emulates with operators of its own, keyed by
#: ``OpOverload`` (``torch.ops.memcalc.dequantize_4bit.out``); registering one twice is refused.
KERNEL_COSTS: RuleRegistry[KernelCostRule] = RuleRegistry("kernel cost")

#: The ``memcalc::`` operators standing for those kernels, one library for every module that
#: defines some (:func:`define_kernels`). It must live as long as the process: destroying it
#: would unregister them.
_KERNEL_LIBRARY = torch.library.Library("memcalc", "FRAGMENT")  # type: ignore[no-untyped-call]  # untyped in torch


def _nothing_on_meta(*_args: object) -> None:
    """The meta kernel of every :func:`define_kernels` op: the kernel writes buffers its caller
    allocated, or updates tensors in place, so on meta tensors (no values) there is nothing to do."""


def define_kernels(schemas: Sequence[str], real: dict[str, Callable[..., None]] | None = None) -> Any:
    """Define ``memcalc::`` operators with ``schemas`` for a library's kernels that memcalc
    emulates, so that the tracer sees each launch as it sees an aten op (their costs are
    :data:`KERNEL_COSTS` rules). Each gets a meta kernel that does nothing; those named in
    ``real`` (the name before the schema's ``(``) also run that function on real tensors (a
    ``--measure`` run on the CPU).

    Returns:
        ``torch.ops.memcalc``, the namespace the operators are called through.
    """
    for schema in schemas:
        name = schema.split("(", 1)[0]
        _KERNEL_LIBRARY.define(schema)  # type: ignore[no-untyped-call]  # untyped in torch
        _KERNEL_LIBRARY.impl(name, _nothing_on_meta, "Meta")  # type: ignore[no-untyped-call]  # untyped in torch
        if real is not None and name in real:
            _KERNEL_LIBRARY.impl(name, real[name], "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    return torch.ops.memcalc


def device_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the traced device's tensors among ``tensors`` (None and host tensors skipped, as
    the generic rules skip them): what a kernel reads or writes of them, each once."""
    return sum(t.nbytes for t in tensors if t is not None and t.is_meta)

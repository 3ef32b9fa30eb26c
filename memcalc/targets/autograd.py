"""What autograd's engine does on a real device that it does not do under memcalc's tracer:
gradient accumulation in place. A fact of the engine, the same on CUDA and on the CPU.

When a tensor receives gradients along two paths (a residual stream, a weight used twice, an
activation read by several ops), the engine sums them in the input buffer of the node that
takes them (``torch/csrc/autograd/input_buffer.cpp``, ``accumulate``): outside grad mode it
writes ``old_var.add_(var)`` into the first gradient when ``can_accumulate_inplace(old_var)`` —
a "vanilla" tensor, non-overlapping and dense, whose storage only this buffer holds — else
``old_var + var`` into new memory (``var.add_(old_var)`` is taken only for a sparse first
gradient). While a dispatch mode is active, as memcalc's tracer is, ``at::isTensorSubclassLike``
is true for every tensor (``ATen/TensorSubclassLikeUtils.h``), so the engine always takes the
out-of-place branch: the trace shows an ``add`` with a new output where the device reuses the
first gradient's memory.

:func:`accumulate_in_place` puts that back: an ``add.Tensor`` in backward, outside grad mode, of
two gradients of the output's shape and dtype whose first is the sole, dense user of its storage,
is booked as the first gradient's memory freed just before the sum takes the same amount (the
caching allocator hands the same block back). Only the engine's own sum is: one that a backward
function's Python code computes (DTensor's ``loss_parallel`` handler of ``nll_loss_backward``,
``(grad_input + torch.exp(x)) * grad_output``, which keeps ``grad_input`` until it returns) is a
plain ``add`` with new memory, as on the device (:func:`called_by_the_engine`).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
from torch._ops import OpOverload

from memcalc.engine.trace import StorageTracer

__all__ = ("GRADIENT_SUM", "accumulate_in_place", "called_by_the_engine", "reuse_memory", "sole_dense")

#: ``_storage_Use_Count`` of a storage held by one tensor, read through the Python storage
#: object the check itself creates (the tensor's reference and that object's).
_SOLE_STORAGE_USES = 2
#: The op autograd's engine sums two gradients with (a backend asks about it after every traced op).
GRADIENT_SUM = torch.ops.aten.add.Tensor
#: The tracer's dispatch of an op: the frame below it is the op's caller.
_DISPATCH_CODE = StorageTracer.__torch_dispatch__.__code__
#: Modules whose frames are the dispatch itself: the tracer's, and Dynamo's wrapper that turns its
#: frame callback off around a dispatch (``_dispatch_without_dynamo``).
_DISPATCH_MODULES = ("memcalc.engine.trace", "torch._dynamo")
#: Where the engine's run starts in Python (``_engine_run_backward``, under ``backward`` and ``grad``).
_ENGINE_MODULE = "torch.autograd"


def sole_dense(tensor: torch.Tensor) -> bool:
    """``can_accumulate_inplace`` (input_buffer.cpp): dense, covering its whole storage, and the
    last reference to that storage."""
    storage = tensor.untyped_storage()
    return (tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()
            and torch._C._storage_Use_Count(storage._cdata) == _SOLE_STORAGE_USES)


def reuse_memory(tracer: StorageTracer, old: torch.Tensor, out: torch.Tensor) -> bool:
    """``out`` was computed into ``old``'s memory (an in-place op the tracer saw as out of place):
    ``old``'s memory is returned just before ``out`` takes the same amount. False where ``out``
    was not the last storage born (nothing is changed then)."""
    events = tracer.trace.events
    out_uid, old_uid = tracer.uid_of(out), tracer.uid_of(old)
    if out_uid is None or old_uid is None or not events or events[-1] != out_uid:
        return False
    tracer.free_storage(old)  # its later death is no event
    events[-2], events[-1] = events[-1], events[-2]
    return True


def called_by_the_engine() -> bool:
    """Whether the op being dispatched was called by autograd's engine (its C++ accumulation of two
    gradients) rather than by Python code: the op's caller, the first frame below the tracer's
    dispatch, is where the engine's run starts (or no Python frame at all: an engine thread).
    DTensor dispatches in C++, so a backward handler of its own (``loss_parallel``'s) is the
    caller of the ops it runs. Where no tracer's dispatch is on the stack (a direct call), True."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not _DISPATCH_CODE:
        frame = frame.f_back
    while frame is not None and (frame.f_code is _DISPATCH_CODE or _module_of(frame).startswith(_DISPATCH_MODULES)):
        frame = frame.f_back
    return frame is None or _module_of(frame).startswith(_ENGINE_MODULE)


def _module_of(frame: FrameType) -> str:
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) else ""


def accumulate_in_place(tracer: StorageTracer, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                        out: Any) -> bool:
    """Book autograd's in-place gradient accumulation after ``func`` (see the module docstring);
    True where it did."""
    if func is not GRADIENT_SUM or not tracer.modules.in_backward or torch.is_grad_enabled():
        return False
    if len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return False
    old, new = args
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    if old.shape != out.shape or new.shape != out.shape or old.dtype != out.dtype or not sole_dense(old):
        return False
    if not called_by_the_engine():  # a backward function's own sum (its Python code holds ``old``)
        return False
    return reuse_memory(tracer, old, out)

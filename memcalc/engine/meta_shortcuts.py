"""Outputs of aten ops whose meta kernel is a slow Python reference, made directly where they are
known exactly (batch norm forward and backward, in training).

``native_batch_norm``'s meta kernel is torch's decomposition (``torch._decomp``'s
``native_batch_norm_helper``: ``var_mean``, a rsqrt and four elementwise ops through
``torch._refs``), about 1.8 ms a call: with its backward, a quarter of a resnet50 estimate. In
training, on a dense input of a floating type the decomposition computes in float32, its outputs
are the normalised input (the input's shape, strides and dtype: elementwise ops keep a dense
operand's layout, then ``.to(input.dtype)``) and the batch mean and inverse standard deviation
(``(C,)``, float32, each its own storage of C elements); the running statistics it updates in
place make no storage. Those are made here with ``torch.empty_strided``; any other call (eval, a
non-dense input, float64, keyword arguments) runs the kernel. The backward's gradients, asked
all three with a weight, are the input's layout and two ``(C,)`` in the weight's float32, except
where a channels-last input's strides also describe the standard layout (size-1 spatial
dimensions): the kernel then answers standard strides, and runs. tests/test_meta_shortcuts.py
compares both, storage for storage, over the dimensions, layouts, dtypes and affine settings.

The commonest ops a trace cannot cache (views, ``detach``, ``lift_fresh``, the ``.item()`` of a
host tensor) are called through their ``Tensor`` method instead (:data:`BY_METHOD`): the same aten
op from the same place in the dispatcher, without the schema-matching binding of ``OpOverload``
(view 6 → 2.6 µs); ``_unsafe_view``'s meta kernel is the decomposition ``aten.view(x, shape)``.
A call the method refuses runs the kernel, which raises as it would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
from torch._prims_common import make_channels_last_strides_for, make_contiguous_strides_for

from memcalc.engine.meta_outputs import OUTPUT_RULES

__all__ = ("BY_METHOD", "SHORTCUTS", "batch_norm_backward_outputs", "batch_norm_outputs")

_BATCH_NORM_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def batch_norm_outputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...] | None:
    """``aten.native_batch_norm.default``'s outputs for ``args``, or None where the kernel must run."""
    if kwargs or len(args) != 8:
        return None
    x, weight, bias, running_mean, running_var, training = args[:6]
    if training is not True or not isinstance(x, torch.Tensor) or not x.is_meta or not 2 <= x.dim() <= 5:
        return None
    if x.dtype not in _BATCH_NORM_DTYPES or x.numel() == 0 or not _dense(x):
        return None
    channels = x.shape[1]
    for extra in (weight, bias, running_mean, running_var):
        if extra is not None and (not isinstance(extra, torch.Tensor) or not extra.is_meta or extra.dim() != 1
                                  or extra.shape[0] != channels or extra.dtype not in _BATCH_NORM_DTYPES):
            return None
    output = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    mean = torch.empty((channels,), dtype=torch.float32, device=x.device)
    invstd = torch.empty((channels,), dtype=torch.float32, device=x.device)
    return output, mean, invstd


def batch_norm_backward_outputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...] | None:
    """``aten.native_batch_norm_backward.default``'s outputs for ``args`` (training, all three
    gradients asked, a weight, a gradient laid out as the input, an unambiguous layout: the
    input's gradient takes the input's strides, the weight's and bias's are ``(C,)`` in the
    weight's dtype), or None where the kernel must run."""
    if kwargs or len(args) != 10:
        return None
    grad, x, weight, _mean, _var, save_mean, save_invstd, training, _eps, mask = args
    if training is not True or list(mask) != [True, True, True] or not isinstance(weight, torch.Tensor):
        return None
    if not isinstance(x, torch.Tensor) or not isinstance(grad, torch.Tensor) or not x.is_meta or not grad.is_meta:
        return None
    if not 2 <= x.dim() <= 5 or x.dtype not in _BATCH_NORM_DTYPES or grad.dtype != x.dtype or x.numel() == 0:
        return None
    shape, strides = tuple(x.shape), x.stride()
    if tuple(grad.shape) != shape or grad.stride() != strides:
        return None
    contiguous = make_contiguous_strides_for(shape)
    # a channels-last input whose strides also describe the standard layout (size-1 spatial
    # dimensions) gets standard strides from the kernel: left to it
    if strides != contiguous and not (x.dim() in (4, 5) and strides == make_channels_last_strides_for(shape)
                                      and not x.is_contiguous()):
        return None
    channels = shape[1]
    for extra in (weight, save_mean, save_invstd):
        if not isinstance(extra, torch.Tensor) or not extra.is_meta or extra.dim() != 1 or extra.shape[0] != channels:
            return None
    if weight.dtype is not torch.float32 or save_mean.dtype is not torch.float32:
        return None
    grad_input = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
    return (grad_input, torch.empty((channels,), dtype=weight.dtype, device=x.device),
            torch.empty((channels,), dtype=weight.dtype, device=x.device))


def _dense(x: torch.Tensor) -> bool:
    """Strided exactly as a fresh tensor of the standard layout or a channels-last one (the layouts
    the outputs keep; a size-1 dimension's stride, free in ``is_contiguous``, is checked too)."""
    shape, strides = tuple(x.shape), x.stride()
    if strides == make_contiguous_strides_for(shape):
        return True
    return x.dim() in (4, 5) and strides == make_channels_last_strides_for(shape)


#: ``(args, kwargs) → outputs``, or None where the op's kernel must run.
Shortcut = Callable[[tuple[Any, ...], dict[str, Any]], Any]
_aten = torch.ops.aten
#: Tensor types whose methods are the ops' bindings and nothing more (a parameter's
#: ``__torch_function__`` only disables itself).
_PLAIN: Final = frozenset({torch.Tensor, torch.nn.Parameter})
#: Ops called through their ``Tensor`` method, with the number of positional arguments taken (all
#: of them; no keywords): each method is the op's own binding (``Tensor.view`` is ``aten::view``).
BY_METHOD: Final[Mapping[object, tuple[Callable[..., Any], int]]] = {
    _aten.view.default: (torch.Tensor.view, 2),
    _aten._unsafe_view.default: (torch.Tensor.view, 2),  # its meta kernel: aten.view(x, shape)
    _aten.detach.default: (torch.Tensor.detach, 1),
    _aten.t.default: (torch.Tensor.t, 1),
    _aten.transpose.int: (torch.Tensor.transpose, 3),
    _aten.unsqueeze.default: (torch.Tensor.unsqueeze, 2),
    _aten.expand.default: (torch.Tensor.expand, 2),
    _aten.permute.default: (torch.Tensor.permute, 2),
}


def _by_method(method: Callable[..., Any], arity: int) -> Shortcut:
    def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs or len(args) != arity or type(args[0]) not in _PLAIN:
            return None  # keywords, defaults, a subclass with behaviour of its own: the kernel
        try:
            return method(*args)
        except (RuntimeError, TypeError, IndexError):
            return None  # the kernel raises it, as it would
    return call


def _lift_fresh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``lift_fresh(Tensor(a) self) -> Tensor(a)``: its kernel returns ``self``."""
    return args[0] if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor) else None


def _local_scalar_dense(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The value of a one-element host tensor (``Tensor.item`` calls this op); a meta tensor's
    read is the tracer's to answer."""
    if kwargs or len(args) != 1 or type(args[0]) not in _PLAIN or args[0].is_meta:
        return None
    try:
        return args[0].item()
    except RuntimeError:
        return None  # not one element: the kernel raises it


def _every_shortcut() -> dict[object, Shortcut]:
    shortcuts: dict[object, Shortcut] = {
        _aten.native_batch_norm.default: batch_norm_outputs,
        _aten.native_batch_norm_backward.default: batch_norm_backward_outputs,
        _aten.lift_fresh.default: _lift_fresh,
        _aten._local_scalar_dense.default: _local_scalar_dense,
        **{op: _by_method(method, arity) for op, (method, arity) in BY_METHOD.items()},
    }
    twice = shortcuts.keys() & OUTPUT_RULES.keys()
    assert not twice, f"ops with two shortcuts: {twice}"
    return {**shortcuts, **OUTPUT_RULES}


#: Every op with a shortcut: those here and the dense calls' output rules
#: (:mod:`memcalc.engine.meta_outputs`).
SHORTCUTS: Final[Mapping[object, Shortcut]] = _every_shortcut()

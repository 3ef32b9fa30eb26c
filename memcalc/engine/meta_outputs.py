"""Outputs of the commonest ops whose meta kernel is a Python decomposition, made directly where
the call is a plain one: every tensor argument a meta tensor of the standard layout (strides
exactly those ``torch.empty`` gives, size-1 dimensions included) and of one floating dtype.

torch 2.13 registers its Python references as the Meta kernel even of ops with a C++ structured
meta kernel (``activate_meta`` in ``torch/_meta_registrations.py``: ``_dispatch_dump`` lists the
C++ one as "Meta (inactive)", which Python cannot call), so a cache miss of ``add`` costs about
100 µs, ``addmm`` 350, layer norm 900 and its backward 1,600: a first estimate's trace (or one
with the meta-kernel cache emptied) spends a fifth of its time in them. On a dense call these
kernels answer fresh tensors of the standard layout whose shapes and dtypes follow from the
arguments' by the rules below (elementwise: the operands' shape and dtype; a matrix product
``(m, n)``; a reduction its kept dimensions; layer norm's statistics in float32 for a half
input, as the decomposition computes them), made here with ``torch.empty``. Any other call (a
strided or channels-last operand, broadcasting, mixed dtypes, a complex or integer tensor, an
unknown keyword) runs the kernel, which also raises what it would. Rules for broadcasting and
promoting operands and for convolutions were tried and dropped: they re-implemented torch's
stride rules, which drift between releases, and gained nothing measurable (docs/speed.md).

tests/test_meta_outputs.py compares every rule with the kernel, storage for storage, over shapes
(empty, 0-dim, size-1 dimensions), dtypes, layouts, scalars and keywords, and checks that the
calls refused here are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import torch

__all__ = ("OUTPUT_RULES", "contiguous_strides")

#: ``(args, kwargs) → outputs``, or None where the op's kernel must run.
Rule = Callable[[tuple[Any, ...], dict[str, Any]], Any]
_aten = torch.ops.aten
#: The dtypes the rules answer for (integer and bool tensors promote differently; complex ones
#: carry conjugate and negative bits).
_FLOATING: Final = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
#: Plain tensor types (a subclass's own dispatch may answer otherwise).
_PLAIN: Final = frozenset({torch.Tensor, torch.nn.Parameter})
#: Scalar types that leave a floating tensor's dtype as it is (type promotion: a Python number of
#: the same or a lower category never raises a tensor's dtype).
_REAL_SCALARS: Final = frozenset({int, float, bool})
#: The device of every output (a device object: a string is parsed at every ``torch.empty``).
_META: Final = torch.device("meta")
#: GELU's approximations (any other string: the kernel raises).
_APPROXIMATIONS: Final = ("none", "tanh")
#: Half dtypes whose layer-norm statistics the decomposition keeps in float32.
_HALF: Final = frozenset({torch.float16, torch.bfloat16})


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` gives: a size-0 or size-1 dimension counts as 1 in the
    product (``make_contiguous_strides_for``, whose symbolic-shape checks cost 50 µs a call, 27
    times this, and it runs on every operand of every rule)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dense(value: Any) -> bool:
    """A plain meta tensor of a floating dtype laid out as ``torch.empty`` lays it out."""
    return (type(value) in _PLAIN and value.is_meta and value.dtype in _FLOATING
            and value.stride() == contiguous_strides(value.shape))


def _fresh(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=_META)


def _elementwise(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """One output of the tensor operands' shape and dtype: every operand dense, of one shape and
    dtype; the other arguments real scalars or None (``alpha``, ``threshold``, an exponent), or
    GELU's ``approximate``. Operands that broadcast or promote run the kernel."""
    first: torch.Tensor | None = None
    for value in (*args, *(v for name, v in kwargs.items() if name != "approximate")):
        if isinstance(value, torch.Tensor):
            if not _dense(value):
                return None
            if first is None:
                first = value
            elif value.shape != first.shape or value.dtype != first.dtype:
                return None
        elif value is not None and type(value) not in _REAL_SCALARS:
            return None
    if kwargs.get("approximate", "none") not in _APPROXIMATIONS:
        return None
    return None if first is None else _fresh(first.shape, first.dtype)


def _like(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``zeros_like``, ``ones_like``: the input's shape, its dtype or the one asked, the standard
    layout (what ``preserve_format`` keeps of a dense input)."""
    if len(args) != 1 or not _dense(args[0]):
        return None
    dtype = args[0].dtype
    for name, value in kwargs.items():
        if name == "dtype" and value in _FLOATING:
            dtype = value
        elif not (value is None or (name == "layout" and value is torch.strided)
                  or (name == "device" and isinstance(value, torch.device) and value.type == "meta")
                  or (name == "pin_memory" and value is False)
                  or (name == "memory_format" and value in (torch.preserve_format, torch.contiguous_format))):
            return None
    return _fresh(args[0].shape, dtype)


def _matmul(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``mm(a, b)`` and ``addmm(bias, a, b, beta=, alpha=)``: ``(m, n)`` of the standard layout,
    for 2-D factors of one floating dtype (any strides: the product is fresh) and a dense bias
    of shape ``(n,)`` or ``(m, n)``."""
    bias: Any = None
    if len(args) == 3:
        bias, a, b = args
    elif len(args) == 2:
        a, b = args
    else:
        return None
    if any(name not in ("beta", "alpha") or type(value) not in _REAL_SCALARS for name, value in kwargs.items()):
        return None
    for factor in (a, b):
        if type(factor) not in _PLAIN or not factor.is_meta or factor.dim() != 2 or factor.dtype not in _FLOATING:
            return None
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or b.dtype != a.dtype or 0 in (m, k, n):
        return None
    if bias is not None and (not _dense(bias) or bias.dtype != a.dtype or tuple(bias.shape) not in ((n,), (m, n))):
        return None
    return _fresh((m, n), a.dtype)


def _layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...] | None:
    """``native_layer_norm(x, normalized_shape, weight, bias, eps)``: the output as ``x``, and the
    mean and reciprocal deviation of shape ``x.shape[:axis] + (1,) * len(normalized_shape)``, in
    float32 for a half input (the decomposition's computation dtype), else in ``x``'s."""
    if kwargs or len(args) != 5:
        return None
    x, normalized, weight, bias, _eps = args
    if not _dense(x) or not isinstance(normalized, (list, tuple)) or not normalized or x.numel() == 0:
        return None
    axis = x.dim() - len(normalized)
    if axis < 0 or tuple(x.shape[axis:]) != tuple(normalized):
        return None
    for extra in (weight, bias):
        if extra is not None and (not _dense(extra) or extra.dtype != x.dtype or extra.shape != x.shape[axis:]):
            return None
    stats = (*x.shape[:axis], *(1,) * len(normalized))
    statistic = torch.float32 if x.dtype in _HALF else x.dtype
    return _fresh(x.shape, x.dtype), _fresh(stats, statistic), _fresh(stats, statistic)


def _layer_norm_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, ...] | None:
    """``native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, mask)``:
    the gradients asked (``mask``), each as its tensor (``x``, ``weight``, ``bias``); a gradient
    asked of a missing weight or bias runs the kernel."""
    if kwargs or len(args) != 8:
        return None
    grad, x, normalized, mean, rstd, weight, bias, mask = args
    if not _dense(x) or not _dense(grad) or grad.shape != x.shape or grad.dtype != x.dtype or x.numel() == 0:
        return None
    axis = x.dim() - len(normalized) if isinstance(normalized, (list, tuple)) and normalized else -1
    if axis < 0 or tuple(x.shape[axis:]) != tuple(normalized):
        return None
    if not isinstance(mask, (list, tuple)) or len(mask) != 3 or any(type(m) is not bool for m in mask):
        return None
    for stat in (mean, rstd):
        if type(stat) not in _PLAIN or not stat.is_meta:
            return None
    outputs: list[torch.Tensor | None] = [_fresh(x.shape, x.dtype) if mask[0] else None]
    for asked, extra in ((mask[1], weight), (mask[2], bias)):
        if not asked:
            outputs.append(None)
        elif extra is None or not _dense(extra) or extra.shape != x.shape[axis:]:
            return None
        else:
            outputs.append(_fresh(extra.shape, extra.dtype))
    return tuple(outputs)


def _softmax(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``_log_softmax(x, dim, half_to_float=False)`` (and ``_softmax``): as ``x``."""
    if kwargs or len(args) != 3 or args[2] is not False or type(args[1]) is not int:
        return None
    x = args[0]
    if not _dense(x) or not -max(x.dim(), 1) <= args[1] < max(x.dim(), 1):
        return None
    return _fresh(x.shape, x.dtype)


def _softmax_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``_log_softmax_backward_data(grad, output, dim, input_dtype)`` (and ``_softmax``'s): as
    ``grad``, where ``input_dtype`` is ``grad``'s."""
    if kwargs or len(args) != 4 or type(args[2]) is not int:
        return None
    grad, output, dim, dtype = args
    if not _dense(grad) or not _dense(output) or output.shape != grad.shape or output.dtype != grad.dtype:
        return None
    if dtype is not grad.dtype or not -max(grad.dim(), 1) <= dim < max(grad.dim(), 1):
        return None
    return _fresh(grad.shape, grad.dtype)


def _nll_loss_target(x: Any, target: Any, weight: Any, reduction: Any, ignore_index: Any) -> bool:
    """A dense ``(N, C)`` input, an int64 target of shape ``(N,)`` (meta, standard layout), no
    class weights, a known reduction."""
    return (_dense(x) and x.dim() == 2 and 0 not in x.shape and type(target) in _PLAIN and target.is_meta
            and target.dtype is torch.int64 and tuple(target.shape) == (x.shape[0],) and target.stride() == (1,)
            and weight is None and reduction in (0, 1, 2) and type(reduction) is int and type(ignore_index) is int)


def _nll_loss(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...] | None:
    """``nll_loss_forward(x, target, None, reduction, ignore_index)``: the loss (``(N,)`` without
    reduction, else 0-dim) and the total weight (0-dim), both in ``x``'s dtype."""
    if kwargs or len(args) != 5 or not _nll_loss_target(*args):
        return None
    x, _target, _weight, reduction, _ignore = args
    return _fresh((x.shape[0],) if reduction == 0 else (), x.dtype), _fresh((), x.dtype)


def _nll_loss_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``nll_loss_backward(grad, x, target, None, reduction, ignore_index, total_weight)``: as ``x``,
    for a gradient of the loss's shape and a 0-dim total weight, both of ``x``'s dtype."""
    if kwargs or len(args) != 7:
        return None
    grad, x, target, weight, reduction, ignore_index, total = args
    if not _nll_loss_target(x, target, weight, reduction, ignore_index):
        return None
    if not _dense(grad) or grad.dtype != x.dtype or tuple(grad.shape) != ((x.shape[0],) if reduction == 0 else ()):
        return None
    if not _dense(total) or total.dim() != 0 or total.dtype != x.dtype:
        return None
    return _fresh(x.shape, x.dtype)


def _dropout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``native_dropout(x, p, train)``, training with ``p`` not 0: the output as ``x`` and a bool
    mask of its shape (otherwise the kernel hands back ``x`` itself: it runs)."""
    if kwargs or len(args) != 3 or not _dense(args[0]) or type(args[1]) is not float or args[1] == 0 \
            or args[2] is not True:
        return None
    x = args[0]
    return _fresh(x.shape, x.dtype), _fresh(x.shape, torch.bool)


def _dropout_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``native_dropout_backward(grad, mask, scale)``: as ``grad``, for a bool mask of its shape."""
    if kwargs or len(args) != 3 or not _dense(args[0]) or type(args[2]) not in _REAL_SCALARS:
        return None
    grad, mask = args[0], args[1]
    if type(mask) not in _PLAIN or not mask.is_meta or mask.dtype is not torch.bool or mask.shape != grad.shape \
            or mask.stride() != grad.stride():
        return None
    return _fresh(grad.shape, grad.dtype)


def _reduction(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``sum.dim_IntList(x, dims, keepdim=False, *, dtype=None)`` and ``mean.dim``: the kept
    dimensions (size 1 where ``keepdim``), in ``x``'s dtype; an empty or repeated ``dims``
    (``[]`` reduces every dimension), an asked dtype and an empty input run the kernel."""
    if not 2 <= len(args) <= 3 or any(name != "dtype" or value is not None for name, value in kwargs.items()):
        return None
    x, dims = args[0], args[1]
    keepdim = args[2] if len(args) == 3 else False
    if not _dense(x) or type(keepdim) is not bool or not isinstance(dims, (list, tuple)) or not dims or x.numel() == 0:
        return None  # an empty input's kept dimensions get other strides from the kernel
    rank = x.dim()
    if rank == 0 or any(type(d) is not int or not -rank <= d < rank for d in dims):
        return None
    reduced = {d % rank for d in dims}
    if len(reduced) != len(dims):
        return None
    shape = [1 if i in reduced else size for i, size in enumerate(x.shape) if keepdim or i not in reduced]
    return _fresh(shape, x.dtype)


def _cat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``cat(tensors, dim=0)``: dense tensors of one dtype and rank (no legacy empty 1-D ones),
    equal but along ``dim``: their sizes there summed."""
    if kwargs or not 1 <= len(args) <= 2 or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    tensors = args[0]
    dim = args[1] if len(args) == 2 else 0
    first = tensors[0]
    if not _dense(first) or type(dim) is not int or first.dim() == 0 or not -first.dim() <= dim < first.dim():
        return None
    dim %= first.dim()
    total = 0
    for t in tensors:
        if not _dense(t) or t.dtype != first.dtype or t.dim() != first.dim() or 0 in t.shape:
            return None
        if any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape, strict=True)) if i != dim):
            return None
        total += t.shape[dim]
    shape = list(first.shape)
    shape[dim] = total
    return _fresh(shape, first.dtype)


#: Elementwise ops whose output takes its operands' shape and dtype (when they share them).
_ELEMENTWISE: Final = (
    _aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor, _aten.mul.Scalar, _aten.div.Scalar,
    _aten.add.Scalar, _aten.pow.Tensor_Scalar, _aten.neg.default, _aten.rsqrt.default, _aten.sqrt.default,
    _aten.exp.default, _aten.tanh.default, _aten.sigmoid.default, _aten.relu.default, _aten.gelu.default,
    _aten.silu.default, _aten.sin.default, _aten.cos.default, _aten.threshold_backward.default,
    _aten.gelu_backward.default, _aten.silu_backward.default, _aten.tanh_backward.default,
    _aten.sigmoid_backward.default,
)

#: Every op with a rule.
OUTPUT_RULES: Final[Mapping[object, Rule]] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    _aten.zeros_like.default: _like,
    _aten.ones_like.default: _like,
    _aten.mm.default: _matmul,
    _aten.addmm.default: _matmul,
    _aten.native_layer_norm.default: _layer_norm,
    _aten.native_layer_norm_backward.default: _layer_norm_backward,
    _aten._log_softmax.default: _softmax,
    _aten._softmax.default: _softmax,
    _aten._log_softmax_backward_data.default: _softmax_backward,
    _aten._softmax_backward_data.default: _softmax_backward,
    _aten.nll_loss_forward.default: _nll_loss,
    _aten.nll_loss_backward.default: _nll_loss_backward,
    _aten.native_dropout.default: _dropout,
    _aten.native_dropout_backward.default: _dropout_backward,
    _aten.sum.dim_IntList: _reduction,
    _aten.mean.dim: _reduction,
    _aten.cat.default: _cat,
}

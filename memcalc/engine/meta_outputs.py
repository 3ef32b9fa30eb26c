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
input, as the decomposition computes them), made here with ``torch.empty``. Elementwise operands
of other shapes broadcast, and ``add``/``sub``/``mul``/``div``'s floating ones of other dtypes
promote: the output's strides are those ``compute_elementwise_output_strides`` (the reference's
copy of TensorIterator's rules) gives, computed on shape and stride tuples
(:func:`broadcast_output_strides`). A plain convolution's output is fresh and standard
(``meta_conv`` leaves the format to the backend), its gradients too where input and weight
suggest the contiguous format. Any other call (a strided or channels-last operand, an empty
output, a complex or integer tensor, an unknown keyword) runs the kernel, which also raises
what it would.

tests/test_meta_outputs.py compares every rule with the kernel, storage for storage, over shapes
(empty, 0-dim, size-1 dimensions), dtypes, layouts, scalars and keywords, and checks that the
calls refused here are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import torch
from torch._prims_common import suggest_memory_format

__all__ = ("OUTPUT_RULES", "broadcast_output_strides", "contiguous_strides")

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
#: Half dtypes whose layer-norm statistics the decomposition keeps in float32.
_HALF: Final = frozenset({torch.float16, torch.bfloat16})


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` gives (``make_contiguous_strides_for``, without its
    checks): a size-0 or size-1 dimension counts as 1 in the product."""
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


def _broadcast_strides(shape: tuple[int, ...], out: tuple[int, ...]) -> tuple[int, ...]:
    """A standard-layout operand of ``shape`` broadcast to ``out`` as the reference broadcasts it
    (``prims.broadcast_in_dim``): a broadcast or new dimension of size past 1 strides 0, a new one
    of size 1 strides as the next dimension's extent, a kept one as before."""
    own = contiguous_strides(shape)
    lead = len(out) - len(shape)
    strides = []
    for idx, size in enumerate(out):
        orig = idx - lead
        if orig >= 0:
            strides.append(own[orig] if shape[orig] == size else 0)
        elif size != 1:
            strides.append(0)
        else:
            strides.append(own[0] * shape[0] if shape else 1)
    return tuple(strides)


def _nested(shape: tuple[int, ...], strides: tuple[int, ...], order: Sequence[int]) -> bool:
    """Strides nested in ``order`` (innermost first), size-1 dimensions skipped
    (``is_contiguous`` and ``is_channels_last_contiguous``)."""
    expected = 1
    for idx in order:
        if shape[idx] != 1:
            if strides[idx] != expected:
                return False
            expected *= shape[idx]
    return True


def _swap(shape: tuple[int, ...], operands: list[tuple[int, ...]], a: int, b: int) -> int:
    """``should_swap`` of ``compute_elementwise_output_logical_to_physical_perm`` for positive
    sizes: the first operand whose strides in ``a`` and ``b`` are both set decides."""
    for strides in operands:
        stride_a, stride_b = strides[a], strides[b]
        if stride_a == 0 or stride_b == 0:
            continue
        if stride_a == stride_b:
            if shape[b] >= shape[a]:
                continue
            return 1
        return -1 if stride_b > stride_a else 1
    return 0


def broadcast_output_strides(shape: tuple[int, ...], operands: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The strides the elementwise reference gives its output of ``shape`` (no size 0) from its
    broadcast operands' strides (``compute_elementwise_output_strides``): contiguous where every
    operand is and not every one channels-last, the reverse, else the dimensions ordered by the
    operands' strides (an insertion sort, innermost first)."""
    ndim = len(shape)
    if ndim < 2:
        return () if ndim == 0 else (1,)
    if len(operands) == 1:
        return operands[0]
    inner = tuple(reversed(range(ndim)))
    contiguous = all(_nested(shape, strides, inner) for strides in operands) or math.prod(shape) < 2
    last = ndim == 4 and all(_nested(shape, strides, (1, 3, 2, 0)) for strides in operands)
    if contiguous and not last:
        return contiguous_strides(shape)
    if last and not contiguous:
        perm = [0, 2, 3, 1]
    else:
        order = list(inner)
        for i in range(1, ndim):
            right = i
            for left in reversed(range(i)):
                comparison = _swap(shape, operands, order[left], order[right])
                if comparison > 0:
                    order[left], order[right] = order[right], order[left]
                    right = left
                elif comparison < 0:
                    break
        perm = order[::-1]
    physical = contiguous_strides([shape[p] for p in perm])
    strides = [0] * ndim
    for i, p in enumerate(perm):
        strides[p] = physical[i]
    return tuple(strides)


def _broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape broadcasting gives, or None where the shapes do not broadcast."""
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        for i, size in enumerate(s, ndim - len(s)):
            if size != out[i]:
                if out[i] == 1:
                    out[i] = size
                elif size != 1:
                    return None
    return tuple(out)


def _elementwise(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """One output of the tensor operands' shape and dtype: every operand dense, of one shape and
    dtype; the other arguments real scalars, strings or None (``alpha``, ``approximate``,
    ``threshold``, an exponent). Operands of other shapes go to :func:`_broadcasting`."""
    tensors: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if not _dense(value):
                return None
            tensors.append(value)
        elif value is not None and type(value) not in _REAL_SCALARS and type(value) is not str:
            return None
    if not tensors:
        return None
    first = tensors[0]
    if all(t.shape == first.shape and t.dtype == first.dtype for t in tensors):
        return _fresh(first.shape, first.dtype)
    return _broadcasting(tensors, promote=False)


def _arithmetic(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``add``, ``sub``, ``mul``, ``div`` of two tensors: as :func:`_elementwise`, and floating
    operands of different dtypes promoted (``torch.result_type``: a dimensioned operand's dtype
    outranks a 0-dim one's of the same category)."""
    if len(args) != 2 or any(name != "alpha" or type(v) not in _REAL_SCALARS for name, v in kwargs.items()):
        return None
    a, b = args
    if not isinstance(b, torch.Tensor):
        return _elementwise(args, kwargs)
    if not (isinstance(a, torch.Tensor) and _dense(a) and _dense(b)):
        return None
    if a.shape == b.shape and a.dtype == b.dtype:
        return _fresh(a.shape, a.dtype)
    return _broadcasting([a, b], promote=True)


def _broadcasting(tensors: list[torch.Tensor], promote: bool) -> torch.Tensor | None:
    """The output of dense operands of different shapes (or, ``promote``, dtypes): the broadcast
    shape, the strides :func:`broadcast_output_strides` picks; an empty output runs the kernel."""
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        if not promote:
            return None
        ranked = [t for t in tensors if t.dim() > 0] or tensors
        dtype = ranked[0].dtype
        for t in ranked[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
    shapes = [tuple(t.shape) for t in tensors]
    shape = _broadcast_shape(shapes)
    if shape is None or 0 in shape:
        return None
    strides = broadcast_output_strides(shape, [_broadcast_strides(s, shape) for s in shapes])
    return torch.empty_strided(shape, strides, dtype=dtype, device=_META)


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


def _ints(value: Any, count: int, least: int) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == count
            and all(type(v) is int and v >= least for v in value))


def _conv_operands(x: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: Any,
                   groups: Any) -> list[int] | None:
    """The output shape of a plain (not transposed) batched convolution: plain meta operands of one
    floating dtype and no empty dimension, ``stride``/``padding``/``dilation`` one int a spatial
    dimension, channels that ``groups`` divide, every output size at least 1
    (``calc_conv_nd_return_shape``: ``(size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1``)."""
    if transposed is not False or type(groups) is not int or groups < 1:
        return None
    for t in (x, weight):
        if type(t) not in _PLAIN or not t.is_meta or t.dtype not in _FLOATING or 0 in t.shape:
            return None
    spatial = x.dim() - 2
    if not 1 <= spatial <= 3 or weight.dim() != x.dim() or weight.dtype != x.dtype:
        return None
    if not (_ints(stride, spatial, 1) and _ints(padding, spatial, 0) and _ints(dilation, spatial, 1)):
        return None
    if x.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups:
        return None
    shape = [x.shape[0], weight.shape[0]]
    for i in range(spatial):
        size = (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (weight.shape[2 + i] - 1) - 1) // stride[i] + 1
        if size < 1:
            return None
        shape.append(size)
    return shape


def _convolution(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding,
    groups)``: a fresh standard-layout output in ``x``'s dtype, whatever the operands' layouts
    (``meta_conv`` leaves the memory format to the backend), for a bias of ``(C_out,)`` or none."""
    if kwargs or len(args) != 9:
        return None
    x, weight, bias, stride, padding, dilation, transposed, _output_padding, groups = args
    shape = _conv_operands(x, weight, stride, padding, dilation, transposed, groups)
    if shape is None:
        return None
    if bias is not None and (type(bias) not in _PLAIN or not bias.is_meta or bias.dtype != x.dtype
                             or tuple(bias.shape) != (weight.shape[0],)):
        return None
    return _fresh(shape, x.dtype)


def _convolution_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, ...] | None:
    """``convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, mask)``: the gradients asked, fresh in ``grad``'s dtype, shaped as
    ``x``, ``weight`` and ``bias_sizes``, where ``grad``, ``x`` and ``weight`` all suggest the
    contiguous format (the kernel's format for all; a channels-last one runs it)."""
    if kwargs or len(args) != 11:
        return None
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed, _output_padding, groups, mask = args
    shape = _conv_operands(x, weight, stride, padding, dilation, transposed, groups)
    if shape is None or type(grad) not in _PLAIN or not grad.is_meta or grad.dtype != x.dtype \
            or list(grad.shape) != shape:
        return None
    if not isinstance(mask, (list, tuple)) or len(mask) != 3 or any(type(m) is not bool for m in mask):
        return None
    if mask[2] and not _ints(bias_sizes, 1, 0):
        return None
    # all three: torch 2.11's kernel also follows a channels-last grad (2.13's does not)
    if any(suggest_memory_format(t) is not torch.contiguous_format for t in (grad, x, weight)):
        return None
    return (_fresh(x.shape, grad.dtype) if mask[0] else None, _fresh(weight.shape, grad.dtype) if mask[1] else None,
            _fresh(bias_sizes, grad.dtype) if mask[2] else None)


#: Elementwise ops whose output takes its operands' shape and dtype (when they share them).
_ELEMENTWISE: Final = (
    _aten.mul.Scalar, _aten.div.Scalar,
    _aten.add.Scalar, _aten.pow.Tensor_Scalar, _aten.neg.default, _aten.rsqrt.default, _aten.sqrt.default,
    _aten.exp.default, _aten.tanh.default, _aten.sigmoid.default, _aten.relu.default, _aten.gelu.default,
    _aten.silu.default, _aten.sin.default, _aten.cos.default, _aten.threshold_backward.default,
    _aten.gelu_backward.default, _aten.silu_backward.default, _aten.tanh_backward.default,
    _aten.sigmoid_backward.default,
)

#: Binary arithmetic, whose operands also broadcast and promote.
_ARITHMETIC: Final = (_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor)

#: Every op with a rule.
OUTPUT_RULES: Final[Mapping[object, Rule]] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(_ARITHMETIC, _arithmetic),
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
    _aten.convolution.default: _convolution,
    _aten.convolution_backward.default: _convolution_backward,
}

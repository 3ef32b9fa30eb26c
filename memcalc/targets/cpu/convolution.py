"""bfloat16 and float16 convolutions on a CPU without oneDNN's native support: ATen's ``Slow2d``.

``ConvParams::use_mkldnn`` (native/Convolution.cpp, torch 2.13) sends a bfloat16 convolution to oneDNN
only where ``mkldnn_bf16_device_check()`` holds (AVX512-BF16 or AMX; a float16 one where
``mkldnn_fp16_device_check()`` holds); ``use_nnpack`` takes float32 only. On any other CPU (the AVX2
machines) ``_select_conv_backend`` picks ``Slow2d`` for a 4-D (or 1-D, viewed as 2-D), non-transposed,
non-dilated convolution: ``thnn_conv2d`` → ``_slow_conv2d_forward`` and ``_slow_conv2d_backward``
(native/ConvolutionMM2d.cpp), which unfold the input into columns through the CPU allocator:

- forward: ``compute_columns2d`` makes ``finput``, (N, C·kh·kw, oH·oW) in the input's dtype (transposed
  for channels-last: the same size), freed when the op returns; a 1×1 kernel of stride 1 and no
  padding takes a view of the input instead (nothing allocated);
- backward, when the weight's gradient is asked for (``output_mask[1]``): the same columns again,
  after ``grad_input`` and ``grad_weight`` (the op's outputs), freed when it returns. The input
  gradient's per-thread columns (``fgrad_input``) are ``std::make_unique`` arrays, outside the CPU
  allocator: neither the profiler nor memcalc counts them.

Measured (tests/test_cpu_convolution.py, test_compile.py's SmallCNN under autocast bf16 on a 2-core AMD
EPYC, AVX2): the events are ``_slow_conv2d_forward``'s ``empty`` of exactly these bytes, and the
compiled step's peak is the columns of its second 32-channel convolution's backward. On a CPU with
oneDNN's bf16 the rule adds nothing: oneDNN's convolution takes its scratchpad inside ideep, as the
float32 one does; such calls (and every float32 one, whichever backend runs it) are the report's
approximated ops (``MemoryReport.unsupported_ops``), and the Slow2d calls followed here are not.

A grouped convolution (``groups > 1``: ``_convolution`` runs one ``Slow2d`` per group on contiguous
slices, then ``cat``), a transposed, dilated or 3-D one run other slow backends: named as not followed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch._ops import OpOverload

from memcalc.targets.convolution_args import ConvolutionBackwardArgs, convolution_call

__all__ = ("CONVOLUTION_OPS", "columns_nbytes", "runs_slow2d", "slow2d_columns")

aten = torch.ops.aten

#: The ops whose CPU kernels :func:`slow2d_columns` follows.
CONVOLUTION_OPS: tuple[OpOverload, ...] = (aten.convolution.default, aten.convolution_backward.default)


class _Capabilities(Protocol):
    """What the rule reads of :class:`~memcalc.targets.cpu.kernels.CpuCapabilities`."""

    @property
    def onednn(self) -> bool: ...

    @property
    def onednn_bf16(self) -> bool: ...

    @property
    def onednn_fp16(self) -> bool: ...


class _Kernels(Protocol):
    """What the rule needs of :class:`~memcalc.targets.cpu.kernels.CpuKernels`."""

    @property
    def capabilities(self) -> _Capabilities: ...

    def add_temporary(self, nbytes: int, label: str | None = None) -> None: ...

    def follow(self, op: OpOverload) -> None: ...

    def cannot_follow(self, op: object, why: str) -> None: ...

    def approximate(self, op: OpOverload) -> None: ...


def _onednn_takes(dtype: torch.dtype, caps: _Capabilities) -> bool:
    """``use_mkldnn``'s reduced-precision branch: oneDNN enabled and the device check of ``dtype``."""
    if dtype is torch.bfloat16:
        return caps.onednn and caps.onednn_bf16
    return caps.onednn and caps.onednn_fp16


def runs_slow2d(x: torch.Tensor, caps: _Capabilities) -> bool:
    """Whether a convolution of a bfloat16 or float16 input ``x`` leaves oneDNN (and NNPACK, float32
    only) for ATen's slow backends on this CPU (module docstring); float32 is not judged here."""
    return x.dtype in (torch.bfloat16, torch.float16) and not _onednn_takes(x.dtype, caps)


def columns_nbytes(x_shape: Sequence[int], weight_shape: Sequence[int], stride: Sequence[int],
                   padding: Sequence[int], itemsize: int) -> int:
    """``compute_columns2d``'s ``finput`` for a (N, C, H, W) input and a (O, C, kh, kw) weight:
    N · C·kh·kw · oH·oW elements, none for a 1×1 kernel of stride 1 and no padding (a view)."""
    n, c, h, w = (int(s) for s in x_shape)
    kh, kw = int(weight_shape[2]), int(weight_shape[3])
    if (kh, kw) == (1, 1) and tuple(stride) == (1, 1) and tuple(padding) == (0, 0):
        return 0
    out_h = (h + 2 * int(padding[0]) - kh) // int(stride[0]) + 1
    out_w = (w + 2 * int(padding[1]) - kw) // int(stride[1]) + 1
    return n * c * kh * kw * out_h * out_w * itemsize


def _as_2d(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], list[int], list[int], list[int]]:
    """``_convolution``'s ``view1d_as_2d``: a 1-D convolution runs as a 2-D one of height 1."""
    if x.dim() == 3:
        return ((*x.shape[:2], 1, x.shape[2]), (*weight.shape[:2], 1, weight.shape[2]), [1, *stride],
                [0, *padding], [1, *dilation])
    return tuple(x.shape), tuple(weight.shape), list(stride), list(padding), list(dilation)


def slow2d_columns(kernels: _Kernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                   out: Any) -> None:
    """The after-op rule of ``convolution`` and ``convolution_backward``: the columns ``Slow2d``
    unfolds, as a temporary (module docstring); a call another backend runs (oneDNN's, or any
    float32 one: oneDNN, NNPACK or Slow2d, whose memory inside is not modelled) is counted as
    approximated, for the report's list."""
    conv = convolution_call(op, args, kwargs)
    x = conv.input
    if not runs_slow2d(x, kernels.capabilities):  # oneDNN's convolution, or float32's backends: not modelled
        kernels.approximate(op)
        return
    if isinstance(conv, ConvolutionBackwardArgs) and not conv.output_mask[1]:
        return  # no weight gradient: no columns through the allocator
    if x.numel() == 0:
        return
    x_shape, w_shape, stride, padding, dilation = _as_2d(x, conv.weight, conv.stride, conv.padding, conv.dilation)
    if conv.transposed or len(x_shape) != 4 or any(d != 1 for d in dilation) or conv.groups != 1:
        kernels.cannot_follow(op, f"{str(x.dtype).removeprefix('torch.')} without oneDNN's: ATen's slow "
                                  "transposed, dilated, 3-D or grouped convolution")
        return
    kernels.follow(op)
    kernels.add_temporary(columns_nbytes(x_shape, w_shape, stride, padding, x.element_size()))

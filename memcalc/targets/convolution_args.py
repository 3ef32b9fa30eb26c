"""The arguments of ``aten.convolution`` and ``aten.convolution_backward``, read by name once.

Both device targets' after-op rules read them: the CPU's ``Slow2d`` columns
(:mod:`memcalc.targets.cpu.convolution`) and CUDA's cuDNN workspaces
(:mod:`memcalc.targets.cuda.workspaces`). The schemas (``native_functions.yaml``, torch 2.13) are
positional, and the backward's puts ``grad_output`` first and ``bias_sizes`` where the forward has
``bias``, so the same field sits one place further on: one reader, not two sets of slices.

    convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

__all__ = ("ConvolutionArgs", "ConvolutionBackwardArgs", "convolution_args", "convolution_backward_args",
           "convolution_call")

aten = torch.ops.aten

#: The schemas' argument names, in order.
_FORWARD = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
_BACKWARD = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
             "output_padding", "groups", "output_mask")


@dataclass(frozen=True)
class ConvolutionArgs:
    """What a convolution's kernels are chosen and sized by (the bias plays no part)."""

    input: torch.Tensor
    weight: torch.Tensor
    stride: Sequence[int]
    padding: Sequence[int]
    dilation: Sequence[int]
    transposed: bool
    output_padding: Sequence[int]
    groups: int


@dataclass(frozen=True)
class ConvolutionBackwardArgs(ConvolutionArgs):
    """The backward's: the forward's, the output's gradient and which gradients it computes
    (input, weight, bias)."""

    grad_output: torch.Tensor
    output_mask: Sequence[bool]


def _bound(names: tuple[str, ...], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def convolution_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> ConvolutionArgs:
    """``aten.convolution``'s arguments."""
    a = _bound(_FORWARD, args, kwargs)
    return ConvolutionArgs(a["input"], a["weight"], a["stride"], a["padding"], a["dilation"], a["transposed"],
                           a["output_padding"], a["groups"])


def convolution_backward_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> ConvolutionBackwardArgs:
    """``aten.convolution_backward``'s arguments."""
    a = _bound(_BACKWARD, args, kwargs)
    return ConvolutionBackwardArgs(a["input"], a["weight"], a["stride"], a["padding"], a["dilation"],
                                   a["transposed"], a["output_padding"], a["groups"], a["grad_output"],
                                   a["output_mask"])


def convolution_call(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> ConvolutionArgs:
    """Either op's arguments (a :class:`ConvolutionBackwardArgs` for the backward), for a rule
    registered on both."""
    if op is aten.convolution_backward.default:
        return convolution_backward_args(args, kwargs)
    return convolution_args(args, kwargs)

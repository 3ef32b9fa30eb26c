"""The statistics PyTorch's CPU normalization kernels save for backward, for the CPU target
(:mod:`memcalc.targets.cpu.kernels` registers :func:`follow_statistics` as an after-op rule).

A meta kernel sizes the mean and inverse deviation a norm returns as CUDA does: float32 for a
bfloat16 or float16 input (``acc_type``) in ``native_layer_norm`` and every batch norm, one
value per channel even in evaluation, and the input's dtype in ``native_group_norm``. The CPU's
kernels choose otherwise (torch 2.13): ``layer_norm_cpu`` (native/layer_norm.cpp),
``native_group_norm`` (native/group_norm.cpp) and ``batch_norm_cpu`` (native/Normalization.cpp)
allocate them in ``param_scalar_type(input, mixed_type)`` — float32 when the parameters are
float32 and the input is not ("mixed", :func:`_mixed`), else the input's own dtype — and
``batch_norm_cpu`` allocates none (zero elements) out of training. torch's own references say
the same for ``device.type == "cpu"`` (``torch._refs.native_layer_norm``,
``torch._decomp``'s ``native_batch_norm_helper``), a branch meta tensors never take.

So in pure bfloat16 a CPU LayerNorm keeps 2 bytes per row and statistic where meta keeps 4,
and under ``torch.autocast("cpu")`` (group_norm is in none of its lists) a GroupNorm fed
bfloat16 with float32 weights keeps 4 where meta keeps 2. ``rms_norm`` needs no rule: its
composite computes in float32 on both devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch._ops import OpOverload

__all__ = ("NORM_STATISTICS_OPS", "follow_statistics", "statistics_nbytes")

aten = torch.ops.aten


class _Kernels(Protocol):
    """What the rule needs of :class:`memcalc.targets.cpu.kernels.CpuKernels`."""

    def resize_output(self, tensor: torch.Tensor, nbytes: int) -> None: ...

    def follow(self, op: OpOverload) -> None: ...


@dataclass(frozen=True)
class _Norm:
    """One norm op: the arguments ``is_mixed_type`` reads, in its order, and whether the
    kernel computes statistics (None: the op's ``training`` argument says; a layer or group
    norm always does)."""

    parameters: tuple[str, ...]
    training: bool | None = True


_AFFINE = ("weight", "bias")
_BATCH = ("weight", "bias", "running_mean", "running_var")  # batch_norm_cpu's is_mixed_type
#: Each op's CPU kernel, all of them ``batch_norm_cpu`` but the first two; the statistics are
#: outputs 1 and 2 of every one.
_NORMS: Mapping[OpOverload, _Norm] = {
    aten.native_layer_norm.default: _Norm(_AFFINE),
    aten.native_group_norm.default: _Norm(_AFFINE),
    aten.native_batch_norm.default: _Norm(_BATCH, training=None),
    aten._native_batch_norm_legit.default: _Norm(_BATCH, training=None),
    aten._native_batch_norm_legit.no_stats: _Norm(_AFFINE, training=None),
    aten._native_batch_norm_legit_no_training.default: _Norm(_BATCH, training=False),
    aten._batch_norm_with_update.default: _Norm(_BATCH, training=True),
    aten._batch_norm_no_update.default: _Norm(_BATCH, training=False),
}
#: The ops whose saved statistics the CPU target resizes.
NORM_STATISTICS_OPS: tuple[OpOverload, ...] = tuple(_NORMS)
#: The outputs that hold the mean and the inverse deviation (rstd, invstd).
_STATISTICS = (1, 2)


def _bind(op: OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    names = [argument.name for argument in op._schema.arguments]
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def _mixed(x: torch.Tensor, parameters: list[Any]) -> bool:
    """``is_mixed_type`` (native/cpu/mixed_data_type.h): the first defined parameter's dtype
    is not the input's."""
    first = next((p for p in parameters if isinstance(p, torch.Tensor)), None)
    return first is not None and first.dtype != x.dtype


def statistics_nbytes(op: OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                      out: Any) -> list[tuple[torch.Tensor, int]]:
    """Each statistic ``op`` returned (``out``, from its meta kernel) with the bytes the CPU's
    kernel gives it; empty for an op of no rule."""
    norm = _NORMS.get(op)
    if norm is None:
        return []
    bound = _bind(op, args, kwargs)
    x = bound["input"]
    # param_scalar_type: the input's opmath type (float32) when mixed, else the input's dtype
    dtype = torch.float32 if _mixed(x, [bound.get(name) for name in norm.parameters]) else x.dtype
    training = bool(bound["training"]) if norm.training is None else norm.training
    # batch_norm_cpu out of training: at::empty({0}, ...) (meta keeps one value per channel)
    return [(out[i], out[i].numel() * dtype.itemsize if training else 0) for i in _STATISTICS]


def follow_statistics(kernels: _Kernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                      out: Any) -> None:
    """The after-op rule: each statistic holds what the CPU's kernel allocates for it (the
    op is named among those followed only where that differs from meta)."""
    changed = False
    for tensor, nbytes in statistics_nbytes(op, args, kwargs, out):
        if nbytes != tensor.untyped_storage().nbytes():
            kernels.resize_output(tensor, nbytes)
            changed = True
    if changed:
        kernels.follow(op)

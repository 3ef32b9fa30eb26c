"""Numeric precision of the simulated step.

- ``fp32``: everything in float32.
- ``amp-fp16`` / ``amp-bf16``: CUDA automatic mixed precision — parameters, gradients and
  optimizer state stay float32 (the "master weights"); inside the forward and the loss, ops
  on CUDA's lower-precision list run in fp16/bf16 on cast copies (weights cast once per
  forward and cached), ops on its fp32 list run in float32. ``amp-fp16`` adds GradScaler's
  work (scaled loss, unscale with inf checks).
- ``fp16`` / ``bf16``: the whole model in that dtype; gradients and optimizer state too.

:class:`WeightDtype` stores the parameters in another dtype than the precision implies: bf16
weights under ``amp-bf16`` autocast are a model loaded in bf16 and trained under autocast.
"""

from __future__ import annotations

import enum

import torch

__all__ = ("Precision", "WeightDtype")


class Precision(str, enum.Enum):
    """How the step computes: fp32, autocast mixed precision (``amp-*``) or pure half precision."""

    FP32 = "fp32"
    AMP_FP16 = "amp-fp16"
    AMP_BF16 = "amp-bf16"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def is_amp(self) -> bool:
        """Mixed precision under autocast (fp32 master weights)."""
        return self in (Precision.AMP_FP16, Precision.AMP_BF16)

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the lower-precision compute (autocast's target, or the model's dtype)."""
        return {
            Precision.FP32: torch.float32,
            Precision.AMP_FP16: torch.float16,
            Precision.AMP_BF16: torch.bfloat16,
            Precision.FP16: torch.float16,
            Precision.BF16: torch.bfloat16,
        }[self]

    @property
    def parameter_dtype(self) -> torch.dtype:
        """dtype the parameters are stored in (float32 master weights under AMP)."""
        return torch.float32 if self in (Precision.FP32, Precision.AMP_FP16, Precision.AMP_BF16) else self.compute_dtype

    @property
    def uses_bf16(self) -> bool:
        """The compute dtype is bfloat16."""
        return self.compute_dtype is torch.bfloat16

    @property
    def uses_grad_scaler(self) -> bool:
        """torch.amp.GradScaler is the standard companion of fp16 autocast (bf16 needs none)."""
        return self is Precision.AMP_FP16


class WeightDtype(str, enum.Enum):
    """The dtype the parameters are stored in, apart from the precision's autocast: what a
    model loaded with ``dtype=torch.bfloat16`` has (its gradients and optimizer state follow,
    as torch makes them like the parameters)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype."""
        return {WeightDtype.FP32: torch.float32, WeightDtype.BF16: torch.bfloat16,
                WeightDtype.FP16: torch.float16}[self]

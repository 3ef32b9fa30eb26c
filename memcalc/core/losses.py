"""The losses a step can train with, as names: :class:`LossKind` (what the zoo declares and
the engine computes) and :class:`LossChoice` (what a user may ask for: ``auto`` or a kind).
The computations live in :mod:`memcalc.engine.losses`."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

__all__ = ("LossChoice", "LossFn", "LossKind")

#: A user's own loss: the model's output in, a scalar tensor out.
LossFn = Callable[[Any], torch.Tensor]


class LossKind(str, enum.Enum):
    """The loss a model trains with; memcalc builds the targets to match."""

    CROSS_ENTROPY = "cross-entropy"  # logits (B, C[, d1, ...]) → class targets (B[, d1, ...])
    LM_CROSS_ENTROPY = "lm-cross-entropy"  # logits (B, T, V) → next-token targets (B, T)
    MEAN = "mean"  # mean of every floating output (models without a head)
    MSE = "mse"  # mean squared error against a target shaped like the output


class LossChoice(str, enum.Enum):
    """User-facing loss names: ``auto`` plus every :class:`LossKind`."""

    AUTO = "auto"
    CROSS_ENTROPY = LossKind.CROSS_ENTROPY.value
    LM_CROSS_ENTROPY = LossKind.LM_CROSS_ENTROPY.value
    MEAN = LossKind.MEAN.value
    MSE = LossKind.MSE.value

"""Losses for the symbolic step, and the targets they need.

The default (``auto``) is documented in the README: a 2-D floating output ``(B, C)`` with
``C > 1`` is a classifier and trains with cross-entropy against class targets ``(B,)``;
anything else trains with the mean of its output. Tuple, list and dict outputs: the
"primary" tensor (key ``logits`` if there is one, else the first tensor) feeds
cross-entropy; ``mean`` sums the means of every floating tensor that requires grad, so that
backward reaches every output (e.g. ``BertModel``'s hidden states and pooler output).

Language-model cross-entropy follows current Hugging Face practice: logits ``(B, T, V)`` are
flattened (a view), the *labels* are shifted — the logits are not sliced, so no copy of the
logits is made. It serves the zoo's plain-torch LLMs and a loss chosen by name: an ``hf:`` model
whose loss is not chosen computes its own from labels (:mod:`memcalc.stacks.transformers.heads`), with
transformers' dtype casts.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.nn.functional as F

from memcalc.core.losses import LossChoice, LossKind
from memcalc.engine.trace import tensors_of

__all__ = ("compute_loss", "make_targets", "primary_tensor", "resolve_loss")



def _tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor of the output (transformers' ModelOutput is a dict: its values)."""
    return list(tensors_of(output))


def primary_tensor(output: Any) -> torch.Tensor:
    """The tensor a classification/LM loss reads: ``output["logits"]`` or the first tensor."""
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        logits: torch.Tensor = output["logits"]
        return logits
    if hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        attribute: torch.Tensor = output.logits
        return attribute
    tensors = _tensors(output)
    if not tensors:
        raise TypeError(f"the model returned no tensor (got {type(output).__name__})")
    return tensors[0]


def resolve_loss(choice: LossKind | LossChoice | str, output: Any) -> LossKind:
    """The concrete loss for ``auto`` given the model's output."""
    choice = LossChoice(choice.value if isinstance(choice, enum.Enum) else choice)
    if choice is not LossChoice.AUTO:
        return LossKind(choice.value)
    first = primary_tensor(output)
    if first.dim() == 2 and first.shape[1] > 1 and first.is_floating_point():
        return LossKind.CROSS_ENTROPY
    return LossKind.MEAN


def make_targets(kind: LossKind, output: Any) -> tuple[torch.Tensor, ...]:
    """Targets shaped for ``kind``, on the output's device (random, so a real run works)."""
    logits = primary_tensor(output)
    device = logits.device
    if kind is LossKind.CROSS_ENTROPY:
        shape = (logits.shape[0], *logits.shape[2:])
        return (torch.randint(0, logits.shape[1], shape, device=device),)
    if kind is LossKind.LM_CROSS_ENTROPY:
        return (torch.randint(0, logits.shape[-1], logits.shape[:-1], device=device),)
    if kind is LossKind.MSE:
        return (torch.randn(logits.shape, dtype=logits.dtype, device=device),)
    return ()


def compute_loss(kind: LossKind, output: Any, targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The scalar loss of ``kind`` on ``output`` against ``targets`` (:func:`make_targets`)."""
    logits = primary_tensor(output)
    if kind is LossKind.CROSS_ENTROPY:
        return F.cross_entropy(logits, targets[0])
    if kind is LossKind.LM_CROSS_ENTROPY:
        return F.cross_entropy(logits.flatten(0, -2), targets[0].flatten())
    if kind is LossKind.MSE:
        return F.mse_loss(logits, targets[0])
    terms = [t.mean() for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms:  # nothing requires grad (frozen model): still a scalar, backward is skipped
        terms = [t.float().mean() for t in _tensors(output) if t.is_floating_point()][:1]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total

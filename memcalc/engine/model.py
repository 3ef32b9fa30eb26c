"""A model ready to trace: the engine's input, whatever the user named (the resolution of
names, files, hubs and the zoo is :mod:`memcalc.sources`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memcalc.core.losses import LossChoice, LossKind

__all__ = ("ResolvedModel",)


@dataclass
class ResolvedModel:
    """A model ready to estimate: a module and its inputs on meta, and how to build the
    same thing for real (``build_real``) when the step is measured."""

    name: str
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss: LossKind | LossChoice
    build_real: Callable[[torch.device], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    #: Paths of the containers of repeated blocks (checkpointing, FSDP units): a zoo entry's, or ().
    block_containers: tuple[str, ...] = ()

    @property
    def batch_size(self) -> int:
        """Samples per step: the first input's leading dimension (1 for a scalar input)."""
        return int(self.inputs[0].shape[0]) if self.inputs and self.inputs[0].dim() else 1

    @property
    def input_description(self) -> str:
        """The inputs' shapes and dtypes, e.g. ``(8, 3, 224, 224) float32``."""
        return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in self.inputs)

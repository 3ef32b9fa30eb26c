"""A Python number that autograd saves (:class:`memcalc.targets.cpu.scalars.SavedNumbers`): ``y * 0.5``
and ``y / 4.0`` on a ``y`` that requires grad keep the number's wrapped CPU tensor (float64, 8 B) in
``MulBackward0`` / ``DivBackward0`` until that node's backward has run, as PEFT's LoRA layers do with
their ``scaling``. Compared with the real CPU step under the profiler, to the byte.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import memcalc
from memcalc.core.categories import Phase
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu


class Scaled(nn.Module):
    """Four frozen Linear layers, each output times a trainable gain (256 elements) and then scaled by a
    Python float (three multiplications, one division), and a trainable head (256 → 2,048). Four
    wrapped numbers are saved in the forward; the step peaks in the head's backward (its 2 MiB weight
    gradient), before any of them is freed."""

    def __init__(self, trained: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4)).requires_grad_(False)
        self.gains = nn.ParameterList(nn.Parameter(torch.ones(256), requires_grad=trained) for _ in range(4))
        self.head = nn.Linear(256, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (layer, gain) in enumerate(zip(self.layers, self.gains, strict=True)):
            x = layer(x) * gain
            x = x / 4.0 if i == 2 else x * 0.5
        return self.head(x)


class Frozen(Scaled):
    """The same with the gains frozen: no output before the head requires grad, so autograd saves none
    of the numbers (the rule must hold nothing)."""

    def __init__(self) -> None:
        super().__init__(trained=False)


@pytest.mark.parametrize("model", [Scaled, Frozen], ids=["saved", "not-saved"])
def test_saved_numbers_against_the_real_cpu_step(model: type[nn.Module]) -> None:
    # before the rule, the saved case was 4 x 8 B under the real peak (the numbers wrapped as float64)
    options: dict[str, Any] = {"batch_size": 8, "input_shape": (256,), "optimizer": "sgd"}
    estimate = memcalc.estimate(model, gpu="cpu", **options)
    real = measure_cpu(build_step(model, gpu="cpu", **options)).peak_allocated
    assert real is not None and estimate.peak_requested == real, f"{estimate.peak_requested:,} B vs real {real:,} B"
    assert estimate.peak_phase is Phase.BACKWARD and estimate.peak_module == "head"

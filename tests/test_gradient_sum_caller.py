"""Autograd's in-place gradient sum (:mod:`memcalc.targets.autograd`) is the engine's alone: a sum
that a backward function's Python code computes takes new memory while its operands live, as on a
real device. The CPU target's estimate of two small steps against the same steps run for real on the
CPU, each peak read from the profiler (:func:`memcalc.measure.step.measure_cpu`), to the byte.

``ZerosPlusExp``'s backward is the shape of DTensor's ``loss_parallel`` handler of
``nll_loss_backward`` (``(grad_input + torch.exp(x)) * grad_output``, ``grad_input`` a zeros held to
the end): the peak is its sum beside the zeros. Booked as the engine's in-place sum (before), the
zeros were freed first and the estimate was one sum (4 × 256 × 256 B) under. The engine's own sums
stay in place (tests/test_cuda_faithful.py, and every real-run comparison with a residual stream).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

import memcalc
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu
from memcalc.targets import autograd

WIDTH, BATCH = 256, 256


class ZerosPlusExp(torch.autograd.Function):
    """``exp`` with loss_parallel's backward: zeros, plus the ``exp`` of the input, times the grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        grad_input = torch.zeros_like(x)
        return (grad_input + torch.exp(x)) * grad


class HandlerSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ZerosPlusExp.apply(self.fc(x))


def _estimate_and_real(model: type[nn.Module]) -> tuple[int, int]:
    """The CPU target's peak of an SGD step of ``model`` and the real step's."""
    options: dict[str, Any] = {"batch_size": BATCH, "input_shape": (WIDTH,), "optimizer": "sgd"}
    estimate = memcalc.estimate(model, gpu="cpu", **options).peak_requested
    torch.manual_seed(0)
    real = measure_cpu(build_step(model, gpu="cpu", **options)).peak_allocated
    assert real
    return estimate, real


def test_a_backward_functions_own_sum_takes_new_memory() -> None:
    estimate, real = _estimate_and_real(HandlerSum)  # 2,100,232 B both (before: 1,838,088 B estimated)
    assert estimate == real, f"{estimate:,} B vs real {real:,} B"


def test_a_direct_call_counts_as_the_engines() -> None:
    # no tracer's dispatch on the stack: the rule keeps the engine's booking
    assert autograd.called_by_the_engine()
    assert sys._getframe().f_code is not autograd._DISPATCH_CODE

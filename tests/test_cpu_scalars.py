"""Python numbers wrapped as CPU tensors in arithmetic (:mod:`memcalc.targets.cpu.scalars`): the CPU
target's rule against the real CPU kernels, op by op, and on a step whose peak is such an op.

Each op of :data:`~memcalc.targets.cpu.scalars.WRAPPING_OPS`, for float32, bfloat16, float64 and int64
tensors and an int or a float (float ops only for a float tensor's dtype), is run for real under the
profiler: what it takes beyond its output (the running sum's peak less the output's bytes) is the
rule's bytes. Measured on torch 2.13 (2026-12-07): a float32 op with a float, 8 + 4 B; with an int on
an int64 tensor, 8 B. The step: the for-loop Adam of a Linear, whose peak is ``exp_avg_sq.sqrt() /
bias_correction2_sqrt`` on its weight, 12 B under the real peak (less the step counters) before.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import memcalc
from memcalc.fields import build_step
from memcalc.measure.step import _profiler_peak, measure_cpu
from memcalc.targets.cpu import scalars
from memcalc.targets.cpu.kernels import CPU_KERNEL_RULES

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64)
NUMBERS = (3, 0.5)
#: How each op is called from Python, as a model's code calls it.
CALLS: dict[Any, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    aten.add.Tensor: lambda x, n: x + n, aten.add_.Tensor: lambda x, n: x.add_(n),
    aten.sub.Tensor: lambda x, n: x - n, aten.sub_.Tensor: lambda x, n: x.sub_(n),
    aten.mul.Tensor: lambda x, n: x * n, aten.mul_.Tensor: lambda x, n: x.mul_(n),
    aten.div.Tensor: lambda x, n: x / n, aten.div_.Tensor: lambda x, n: x.div_(n),
    aten.rsub.Scalar: lambda x, n: n - x,
}
def _foreach(name: str, overload: str) -> Callable[[torch.Tensor, Any], Any]:
    """``torch._foreach_<name>(list, number)`` (or ``[number, number]``) on the tensor listed twice;
    returns the outputs, or the list itself in place."""
    function = getattr(torch, f"_foreach_{name}")

    def call(x: torch.Tensor, number: Any) -> Any:
        tensors = [x, x]
        out = function(tensors, [number, number] if overload == "ScalarList" else number)
        return tensors if out is None else list(out)
    return call


for _name in ("add", "sub", "mul", "div"):
    for _suffix in ("", "_"):
        for _overload in ("Scalar", "ScalarList"):
            _op = getattr(getattr(aten, f"_foreach_{_name}{_suffix}"), _overload)
            CALLS[_op] = _foreach(f"{_name}{_suffix}", _overload)
_IN_PLACE_DIVISIONS = (aten.div_.Tensor, aten._foreach_div_.Scalar, aten._foreach_div_.ScalarList)
CASES = [(op, dtype, number) for op, dtype, number in itertools.product(scalars.WRAPPING_OPS, DTYPES, NUMBERS)
         if not (dtype == torch.int64 and (isinstance(number, float) or op in _IN_PLACE_DIVISIONS))]


def _real_beyond_output(call: Callable[[torch.Tensor, Any], torch.Tensor], x: torch.Tensor, number: Any) -> int:
    """What the real call takes on the CPU beyond its output (an in-place call: beyond nothing)."""
    call(x.clone(), number)  # the warm-up
    source = x.clone()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = call(source, number)
    outputs = out if isinstance(out, list) else [out]
    made = [t for t in outputs if t.untyped_storage() is not source.untyped_storage()]
    return _profiler_peak(prof) - sum(t.numel() * t.element_size() for t in made)


def _rule_bytes(op: Any, x: torch.Tensor, number: Any) -> int:
    out = CALLS[op](x.to("meta"), number)
    return scalars.wrapped_number_bytes(number, (out[-1] if isinstance(out, list) else out).dtype)


def _case_id(op: Any, dtype: torch.dtype, number: Any) -> str:
    return f"{op}-{dtype}-{type(number).__name__}"


#: The quick loop's cases (issue 36 item 7): every dtype and number on ``add``, and every op on a
#: float32 tensor with a float. The rule's bytes depend on the number and the output's dtype, not
#: on the op; the op decides whether a number is wrapped at all. The full suite runs every case.
QUICK_CASES = tuple(_case_id(op, d, n) for op, d, n in CASES
                    if op == aten.add.Tensor or (d == torch.float32 and isinstance(n, float)))


@pytest.mark.quick_cases(*QUICK_CASES)
@pytest.mark.parametrize("op, dtype, number", CASES, ids=[_case_id(op, d, n) for op, d, n in CASES])
def test_the_rule_takes_what_the_cpu_kernel_takes(op: Any, dtype: torch.dtype, number: Any) -> None:
    x = torch.ones(1000, dtype=dtype)
    if op in (aten.div.Tensor, aten._foreach_div.Scalar, aten._foreach_div.ScalarList) and dtype == torch.int64:
        pytest.skip("true division of an int64 tensor also casts the tensor itself: not a wrapped number")
    real = _real_beyond_output(CALLS[op], x, number)
    assert real == _rule_bytes(op, x, number) > 0
    assert CPU_KERNEL_RULES.get(op) is scalars.wrapped_number


def test_a_float32_op_with_a_float_takes_twelve_bytes() -> None:
    # the wrapped double (8 B) and its float32 cast (4 B); an int64 tensor's int needs no cast
    assert scalars.wrapped_number_bytes(0.5, torch.float32) == 8 + 4
    assert scalars.wrapped_number_bytes(3, torch.int64) == 8
    assert scalars.wrapped_number_bytes(True, torch.float32) == 0  # not measured: left out


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_for_loop_adam_step_peaking_at_a_scalar_division() -> None:
    loop = memcalc.Loop(optimizer_impl="for-loop")
    options: dict[str, Any] = {"batch_size": 4, "input_shape": (512,), "optimizer": "adam", "loop": loop}
    estimate = memcalc.estimate(Affine, gpu="cpu", **options).peak_requested
    real = measure_cpu(build_step(Affine, gpu="cpu", **options)).peak_allocated
    counters = 4 * 2  # Adam's CPU step counters (weight and bias), which the estimate leaves out
    assert real is not None and estimate == real - counters, f"{estimate:,} B vs real {real - counters:,} B"

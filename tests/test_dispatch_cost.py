"""The tracer's own work below autograd reaches no function mode above it (issue 36 item 3): the
CUDA emulation, which stays on through the backward pass and inside ``torch.nn.functional``
composites, once answered every ``.shape``, ``.stride()`` and ``untyped_storage()`` of the
tracer's bookkeeping and of the meta kernels, about five calls per aten op. Counted, not timed."""

from __future__ import annotations

from typing import Any

import pytest

from memcalc.fields import build_step
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import trace_step
from memcalc.targets.cuda.emulation import CudaEmulation


def test_the_emulation_sees_about_one_call_per_aten_op(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    seen = CudaEmulation.__torch_function__

    def counted(self: CudaEmulation, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        calls.append(func)
        return seen(self, func, types, args, kwargs)

    monkeypatch.setattr(CudaEmulation, "__torch_function__", counted)
    traced = trace_step(resolve("mlp", batch_size=4), build_step(optimizer="adam", gpu="a100-40gb"))
    aten_ops = sum(traced.trace.op_counts.values())
    # the model's, autograd's and the optimizer's own Python calls remain (parameters, .grad, state):
    # 193 calls for 93 aten ops here, 600 when the bookkeeping went through the mode
    assert 0 < len(calls) < 3 * aten_ops, (len(calls), aten_ops)


def test_the_after_op_hook_runs_only_for_ops_with_a_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's hook is asked about each op once and called only where a rule can apply
    (the gradient sum, a workspace rule); the ops it declines would have found no rule."""
    from memcalc.targets.autograd import GRADIENT_SUM
    from memcalc.targets.backend import CudaBackend
    from memcalc.targets.cuda.workspaces import WORKSPACE_RULES

    called: list[Any] = []
    hook = CudaBackend.after_op

    def counted(self: CudaBackend, func: Any, *rest: Any) -> None:
        called.append(func)
        hook(self, func, *rest)

    monkeypatch.setattr(CudaBackend, "after_op", counted)
    traced = trace_step(resolve("mlp", batch_size=4), build_step(optimizer="adam", gpu="a100-40gb"))
    assert called, "the matmuls' workspace rule runs"
    assert all(func is GRADIENT_SUM or WORKSPACE_RULES.get(func) is not None for func in called)
    assert len(called) < sum(traced.trace.op_counts.values())

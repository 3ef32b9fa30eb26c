"""The tracer's own work below autograd reaches no function mode above it (issue 36 item 3): the
CUDA emulation, which stays on through the backward pass and inside ``torch.nn.functional``
composites, once answered every ``.shape``, ``.stride()`` and ``untyped_storage()`` of the
tracer's bookkeeping and of the meta kernels, about five calls per aten op. Counted, not timed.
The shortcuts on that path (the optimizer state's uids read in one go, the foreach ops' outputs made
without their kernels) are checked against what they stand for."""

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
    # the model's own Python calls remain: 30 calls for 93 aten ops here; 193 while the optimizer, zero_grad
    # and the module tracker's reads of each output went through the mode, 600 when the bookkeeping did too
    assert 0 < len(calls) < aten_ops / 2, (len(calls), aten_ops)


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


def test_torch_optimizers_call_nothing_the_emulation_rewrites() -> None:
    """What lets the step take the emulation off around torch's optimizers and ``zero_grad``
    (``memcalc.engine.step_backend.idle_modes_off``): every function their construction and steps
    call, for each registered torch optimizer in its loop implementations, passes through the mode
    as it came outside autocast (no rule, no ``torch.nn.functional`` composite)."""
    import torch

    from memcalc.core.loop import OptimizerImpl
    from memcalc.core.precision import Precision
    from memcalc.engine.optimizers import OPTIMIZERS, TorchOptim
    from memcalc.engine.step import _torch_optimizer
    from memcalc.targets.cuda.emulation import _Handling

    checked = 0
    for spec in OPTIMIZERS.values():
        if not isinstance(spec.factory, TorchOptim):
            continue
        for impl in sorted(spec.impls & {OptimizerImpl.FOREACH, OptimizerImpl.FOR_LOOP}, key=str):
            params = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in ((8, 4), (4,))]
            emulation = CudaEmulation(Precision("fp32"), (8, 0))
            with emulation:
                optimizer = spec.build(params, impl)
                assert optimizer is not None and _torch_optimizer(optimizer)
                for p in params:
                    p.grad = torch.empty_like(p)
                optimizer.step()
                optimizer.zero_grad()
            seen = dict(emulation._handling)
            assert seen, spec.name  # the step's calls reached the mode
            assert all(h is not _Handling.EMULATED for h in seen.values()), (spec.name, impl, seen)
            checked += 1
    assert checked >= 10


def _traces(monkeypatch: pytest.MonkeyPatch, modes_off: bool, model: str, **options: Any) -> tuple[Any, ...]:
    """The report and every trace of one estimate, with the idle modes taken off around the
    optimizer (as the step does) or left on."""
    from contextlib import nullcontext

    import memcalc
    from memcalc.engine import step, trace

    traces: list[tuple[Any, ...]] = []
    stop = trace.StorageTracer.stop

    def kept(self: trace.StorageTracer) -> trace.StepTrace:
        out = stop(self)
        t = self.trace
        traces.append((list(t.nbytes), list(t.events), list(t.op), list(t.module), list(t.phase), list(t.category),
                       dict(t.op_counts), list(t.phase_log), dict(t.stream)))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(trace.StorageTracer, "stop", kept)
        if not modes_off:
            patch.setattr(step, "idle_modes_off", nullcontext)
        report = memcalc.estimate(model, **options)
    return report.to_dict(), traces


@pytest.mark.parametrize(("model", "options"), [
    ("resnet50", {"batch_size": 2, "optimizer": "adam"}),
    ("mlp", {"batch_size": 4, "optimizer": "adamw", "gpu": "cpu", "precision": "amp-bf16"}),
    pytest.param("gpt2", {"batch_size": 1, "seq_len": 32, "optimizer": "sgd-momentum", "precision": "amp-fp16",
                          "checkpoint": True}, marks=pytest.mark.slow),
], ids=["resnet50", "mlp-cpu-amp-bf16", "gpt2-amp-fp16-checkpoint"])
def test_a_step_traces_the_same_with_the_idle_modes_off(monkeypatch: pytest.MonkeyPatch, model: str,
                                                         options: dict[str, Any]) -> None:
    """The same storages, sizes, ops, modules, phases, categories and op counts, event for event,
    and the same report, with the emulation taken off around the optimizer or left on."""
    assert _traces(monkeypatch, True, model, **options) == _traces(monkeypatch, False, model, **options)


def test_the_optimizer_and_zero_grad_reach_no_function_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted by phase: after backward (the gradients' bookkeeping, the optimizer, zero_grad) no
    call reaches the emulation, which would pass each on unchanged."""
    import torch

    calls: list[str] = []
    seen = CudaEmulation.__torch_function__
    tracers: list[Any] = []
    from memcalc.engine import trace

    enter = trace.StorageTracer.__enter__

    def entered(self: trace.StorageTracer) -> Any:
        tracers.append(self)
        return enter(self)

    def counted(self: CudaEmulation, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is not torch._C._set_grad_enabled:  # the step's grad mode, put back as it ends
            calls.append(tracers[-1].phase.value)
        return seen(self, func, types, args, kwargs)

    monkeypatch.setattr(CudaEmulation, "__torch_function__", counted)
    monkeypatch.setattr(trace.StorageTracer, "__enter__", entered)
    trace_step(resolve("mlp", batch_size=4), build_step(optimizer="adam", gpu="a100-40gb"))
    assert calls.count("forward") > 0
    assert calls.count("optimizer") == calls.count("zero_grad") == 0, calls


def test_idle_modes_off_takes_off_only_modes_that_pass_through() -> None:
    """A mode that does not say it passes calls through (a ``torch.device`` context, which moves
    factory calls) stays, with every mode below it; an emulation inside an autocast region stays;
    the stack is as it was afterwards, an exception included."""
    import torch

    from memcalc.core.precision import Precision
    from memcalc.engine.step_backend import idle_modes_off

    def stack() -> list[Any]:
        return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]

    emulation = CudaEmulation(Precision("amp-bf16"), (8, 0))
    with emulation:
        before = stack()
        with idle_modes_off():
            assert stack() == before[:-1]
            assert torch.empty(1).device.type == "cpu"
        assert stack() == before
        with emulation.autocast(), idle_modes_off():
            assert stack() == before  # autocasting: it rewrites calls
        with torch.device("meta"), idle_modes_off():
            assert torch.empty(1).device.type == "meta"  # the device context stays, and the emulation below it
            assert len(stack()) == len(before) + 1
        with pytest.raises(RuntimeError), idle_modes_off():
            raise RuntimeError
        assert stack() == before


def test_uids_of_and_gradient_uids_are_uid_of_with_no_function_mode_call() -> None:
    """The optimizer state's and the gradients' uids, read in one go with the function modes off,
    are ``uid_of``'s for each tensor (a parameter, a plain tensor, a view sharing its storage, one
    the tracer never saw); the counting mode above sees none of the reads."""
    import torch
    from torch.overrides import TorchFunctionMode

    from memcalc.core.categories import Category
    from memcalc.engine.trace import StorageTracer

    class Counting(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[object] = []

        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            self.calls.append(func)
            return func(*args, **(kwargs or {}))

    tracer = StorageTracer()
    weight = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    bare = torch.nn.Parameter(torch.empty(2, device="meta"))  # no gradient
    with tracer:
        tracer.preexisting(weight, Category.PARAMETERS)
        weight.grad = torch.empty(4, 3, device="meta") * 2
        state = torch.zeros(4, 3, device="meta") + 1
    unseen = torch.empty(5, device="meta")
    tensors = [weight, state, state.view(12), weight.grad, unseen]
    counting = Counting()
    with counting:
        uids = tracer.uids_of(tensors)
        gradients = tracer.gradient_uids([weight, bare])
    assert counting.calls == []
    assert uids == [tracer.uid_of(t) for t in tensors]
    assert uids[1] == uids[2] is not None and uids[4] is None  # a view is its storage's; unseen: None
    assert gradients == [tracer.uid_of(weight.grad)] and gradients[0] is not None


@pytest.mark.parametrize("case", ["add", "add_", "mul_scalar", "mixed_dtypes", "lengths", "shapes", "cpu_scalars",
                                  "cpu_scalar", "sqrt", "copy_", "empty"])
def test_the_foreach_shortcut_answers_as_the_kernel_or_not_at_all(case: str) -> None:
    """An elementwise foreach op's outputs, made without its kernel (a Python loop of per-tensor meta
    kernels on meta), have the kernel's shapes, strides and dtypes; in-place ones return nothing; a
    call it cannot answer exactly (type promotion, lists of other lengths or shapes) is the
    kernel's, which raises what it raises."""
    import torch

    from memcalc.engine import trace

    aten = torch.ops.aten
    meta = torch.device("meta")

    def tensors(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return [torch.empty_strided(s, torch.empty(s).stride(), dtype=dtype, device=meta) for s in shapes]

    first = tensors((4, 3), (7,), (2, 5, 1))
    calls: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any], bool]] = {  # op, args, kwargs, answered
        "add": (aten._foreach_add.List, (first, tensors((4, 3), (7,), (2, 5, 1))), {"alpha": 2}, True),
        "add_": (aten._foreach_add_.List, (first, tensors((4, 3), (7,), (2, 5, 1))), {}, True),
        "mul_scalar": (aten._foreach_mul.Scalar, (first, 0.5), {}, True),
        "mixed_dtypes": (aten._foreach_add.List, (first, tensors((4, 3), (7,), (2, 5, 1), dtype=torch.bfloat16)), {},
                         False),
        "lengths": (aten._foreach_add.List, (first, tensors((4, 3), (7,))), {}, False),
        "shapes": (aten._foreach_mul.List, (first, tensors((4, 3), (7,), (2, 5, 5))), {}, False),
        "cpu_scalars": (aten._foreach_mul.List, (first, [torch.tensor(2.0)] * 3), {}, False),  # shapes differ
        "cpu_scalar": (aten._foreach_mul.Tensor, (first, torch.tensor(2.0, dtype=torch.float64)), {}, True),
        "sqrt": (aten._foreach_sqrt.default, (tensors((3, 2), (1,), dtype=torch.float16),), {}, True),
        "copy_": (aten._foreach_copy_.default, (first, tensors((4, 3), (7,), (2, 5, 1))), {}, True),
        "empty": (aten._foreach_neg.default, ([],), {}, False),
    }
    func, args, kwargs, answered = calls[case]
    shortcut = trace._foreach_shortcut(func, args, kwargs, meta)
    assert (shortcut is not trace._NO_SHORTCUT) == answered
    if not answered:
        return
    out = func(*args, **kwargs)
    if shortcut is None:
        assert out is None and func.__name__.split(".")[0].endswith("_")
        return
    assert [(t.shape, t.stride(), t.dtype, t.device) for t in shortcut] == [
        (t.shape, t.stride(), t.dtype, t.device) for t in out]

"""``memcalc.estimate``: resolve the model, run the step symbolically, replay, report."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Sequence

import torch
from torch import nn

from .categories import Category, Mode, Phase
from .errors import InvalidInputError, MemcalcError, SymbolicExecutionError
from .losses import LossChoice, LossFn
from .models import ResolvedModel, resolve
from .optimizers import Optimizer, spec_for
from .report import ByteBreakdown, MemoryReport, ModuleRow, Textbook
from .step import run_step
from . import allocator
from .timeline import Program, allocator_events, build_program, category_totals_at, final_categories
from .trace import StepTrace, StorageTracer

__all__ = ("estimate", "trace_model", "TracedStep")

# Ops whose CUDA kernels allocate memory the meta kernels don't show (cuDNN convolution
# workspace, cuDNN RNN reserve space, fused attention kernels): reported as approximated.
_APPROXIMATED_OPS = {
    "convolution.default": "cuDNN convolution workspace not modelled",
    "convolution_backward.default": "cuDNN convolution workspace not modelled",
    "_cudnn_rnn.default": "cuDNN RNN workspace not modelled",
    "_scaled_dot_product_flash_attention_for_cpu.default": "attention kernel choice not modelled (CPU kernel)",
    "_scaled_dot_product_efficient_attention.default": "attention kernel choice not modelled",
}


class _TracerObserver:
    """Adapts :class:`StorageTracer` to the step program's observer protocol."""

    def __init__(self, tracer: StorageTracer):
        self.tracer = tracer
        self.gradient_uids: set[int] = set()
        self.state_uids: set[int] = set()

    def set_phase(self, phase: Phase) -> None:
        self.tracer.set_phase(phase)

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        self.tracer.preexisting(tensor, category)

    def backward_context(self) -> ContextManager[Any]:
        return self.tracer.modules.backward()

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            if p.grad is not None and (uid := self.tracer.uid_of(p.grad)) is not None:
                self.gradient_uids.add(uid)

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and (uid := self.tracer.uid_of(value)) is not None:
                    self.state_uids.add(uid)

    def finished(self) -> None:
        self.tracer.stop()


class TracedStep:
    """The raw result of tracing one step: the trace, final categories, module data."""

    def __init__(self, trace: StepTrace, categories: list[Category], tracer: StorageTracer,
                 loss: str, mode: Mode):
        self.trace = trace
        self.categories = categories
        self.output_shapes = dict(tracer.modules.output_shapes)
        self.module_order = list(tracer.modules.order)
        self.loss = loss
        self.mode = mode

    def program(self) -> Program:
        return build_program(self.trace, 2 if self.mode is Mode.TRAIN else 1)


def trace_model(resolved: ResolvedModel, *, optimizer: Optimizer | str = Optimizer.ADAM,
                mode: Mode | str = Mode.TRAIN, loss_fn: LossFn | None = None,
                loss: LossChoice | str | None = None) -> TracedStep:
    """Run one step of ``resolved`` under the tracer (the estimator's engine, without the report)."""
    mode = Mode(mode)
    spec = spec_for(optimizer)
    module = resolved.module
    tracer = StorageTracer("meta")
    observer = _TracerObserver(tracer)
    _register_preexisting(tracer, module, resolved.inputs)
    tracer.modules.install(module)
    loss_choice = loss if loss is not None else resolved.loss
    try:
        with tracer:
            outcome = run_step(module, resolved.inputs, mode=mode, optimizer=spec, loss=loss_choice,
                               loss_fn=loss_fn, iterations=1, observer=observer)
    except MemcalcError:
        raise
    except Exception as exc:
        raise InvalidInputError(
            f"the forward of {resolved.name} failed on input {resolved.input_description}: "
            f"{type(exc).__name__}: {exc}",
            hint="Check the input: --input-shape C,H,W for vision models, --seq-len N for sequence models.",
        ) from exc
    finally:
        tracer.modules.remove()
        trace = tracer.stop()
    categories = final_categories(trace, observer.gradient_uids, observer.state_uids)
    loss_name = "custom loss_fn" if loss_fn is not None else (
        outcome.loss_kind.value if outcome.loss_kind is not None else "none (eval)")
    return TracedStep(trace, categories, tracer, loss_name, mode)


def _register_preexisting(tracer: StorageTracer, module: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
    for p in module.parameters():
        tracer.preexisting(p, Category.PARAMETERS)
    for b in module.buffers():
        tracer.preexisting(b, Category.BUFFERS)
    for t in inputs:
        tracer.preexisting(t, Category.INPUTS)


def estimate(
    model: Any,
    *,
    batch_size: int | None = None,
    input_shape: Sequence[int] | None = None,
    inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
    optimizer: Optimizer | str = Optimizer.ADAM,
    mode: Mode | str = Mode.TRAIN,
    loss_fn: LossFn | None = None,
    loss: LossChoice | str | None = None,
    seq_len: int | None = None,
    module_depth: int = 1,
    capacity: int | None = None,
) -> MemoryReport:
    """Estimate the GPU memory of one training (or eval) step of ``model``.

    ``model``: a zoo name (``"resnet50"``), a source string (``"my.py:make_model"``,
    ``"hf:gpt2"``), an ``nn.Module`` (never modified, never copied to memory: memcalc works on
    a meta twin) or a factory returning one. Inputs come from the zoo entry, ``input_shape``
    (one sample's shape; the batch dimension is added), ``seq_len`` for token models, or
    ``inputs`` (tensors whose shapes are used, batch included).

    ``loss_fn(output) -> scalar`` replaces the default loss (see :mod:`memcalc.losses`).
    ``module_depth`` chooses which modules the per-module table lists (1 = top-level children).
    ``capacity``: bytes the caching allocator may reserve (device memory minus the CUDA
    context); the report then says whether the step ``fits`` — replayed under that limit, with
    the allocator's own recovery (freeing cached segments and retrying) before an OOM.

    The peak covers two training iterations, so optimizer state created at the first
    ``step()`` is counted with the activations of the next forward/backward.
    """
    try:
        mode = Mode(mode)
    except ValueError:
        raise InvalidInputError(f"unknown mode {mode!r}; choose one of: {', '.join(m.value for m in Mode)}") from None
    try:
        spec = spec_for(optimizer)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    resolved = resolve(model, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len, inputs=inputs)
    traced = trace_model(resolved, optimizer=spec.key, mode=mode, loss_fn=loss_fn, loss=loss)
    if capacity is not None and capacity <= 0:
        raise InvalidInputError(f"capacity must be a positive number of bytes, got {capacity}")
    return _report(resolved, traced, spec.key, mode, module_depth, capacity)


def _report(resolved: ResolvedModel, traced: TracedStep, optimizer: Optimizer, mode: Mode,
            module_depth: int, capacity: int | None = None) -> MemoryReport:
    trace = traced.trace
    program = traced.program()
    stats = allocator.replay(allocator_events(program, trace.nbytes))
    peak_index = max(stats.peak_index, 0)
    raw = category_totals_at(program, trace.nbytes, traced.categories, peak_index)
    breakdown = ByteBreakdown(
        parameters=raw[Category.PARAMETERS], buffers=raw[Category.BUFFERS], inputs=raw[Category.INPUTS],
        gradients=raw[Category.GRADIENTS], optimizer_state=raw[Category.OPTIMIZER_STATE],
        activations=raw[Category.ACTIVATIONS], workspace=raw[Category.WORKSPACE],
        peak_allocated=stats.peak_allocated,
    )
    first = allocator.replay(allocator_events(program, trace.nbytes, until=program.iteration_starts[-1])) \
        if program.iterations > 1 else stats
    spec = spec_for(optimizer)
    module = resolved.module
    param_bytes = sum(trace.nbytes[u] for u in trace.preexisting if traced.categories[u] is Category.PARAMETERS)
    textbook = Textbook(
        parameter_bytes=param_bytes,
        multiplier=spec.textbook_multiplier if mode is Mode.TRAIN else 1,
        terms=spec.textbook_terms if mode is Mode.TRAIN else "weights",
        activation_bytes=_saved_for_backward(trace, traced.categories) if mode is Mode.TRAIN
        else raw[Category.ACTIVATIONS],
    )
    fits, reserved_within = _fit_under(program, trace.nbytes, capacity, stats)
    key = program.events[peak_index] if program.events else 0
    uid = program.storage(key) if key >= 0 else 0
    has_peak = stats.peak_allocated > 0
    return MemoryReport(
        model=resolved.name,
        batch_size=resolved.batch_size,
        optimizer=spec.key.value,
        mode=mode,
        parameters=sum(p.numel() for p in module.parameters()),
        peak_phase=trace.phase[uid] if has_peak else Phase.SETUP,
        peak_module=trace.module[uid] if has_peak else "",
        bytes=breakdown,
        peak_iteration=program.iteration_of(peak_index),
        input_description=resolved.input_description,
        loss=traced.loss,
        textbook=textbook,
        modules=_module_rows(module, traced, module_depth),
        first_iteration_peak=first.peak_allocated,
        peak_requested=stats.peak_requested,
        peak_reserved=stats.peak_reserved,
        unsupported_ops=_approximated(trace),
        capacity=capacity,
        fits=fits,
        reserved_within_capacity=reserved_within,
    )


def _fit_under(program: Program, nbytes: list[int], capacity: int | None,
               stats: allocator.AllocatorStats) -> tuple[bool | None, int | None]:
    """Whether the step runs within ``capacity`` reserved bytes, and the peak reserved when it
    does so under that limit (the allocator frees cached segments under pressure)."""
    if capacity is None:
        return None, None
    if stats.peak_reserved <= capacity:
        return True, stats.peak_reserved  # never under pressure: the same replay
    limited = allocator.replay(allocator_events(program, nbytes), capacity=capacity)
    return limited.oom_at is None, limited.peak_reserved


def _saved_for_backward(trace: StepTrace, categories: list[Category]) -> int:
    """Activation bytes alive when backward starts (what autograd saved, plus the output)."""
    start = trace.phase_starts.get(Phase.BACKWARD, len(trace.events))
    alive: set[int] = set()
    for event in trace.events[:start]:
        if event >= 0:
            alive.add(event)
        else:
            alive.discard(~event)
    return sum(trace.nbytes[u] for u in alive if categories[u] is Category.ACTIVATIONS)


def _module_rows(module: nn.Module, traced: TracedStep, depth: int) -> tuple[ModuleRow, ...]:
    trace = traced.trace
    end_of_forward = trace.phase_starts.get(Phase.LOSS, len(trace.events))
    kept = alive_after(trace, end_of_forward) if traced.mode is Mode.TRAIN else None
    per_module: dict[str, int] = {}
    for uid, name in enumerate(trace.module):
        if trace.phase[uid] is not Phase.FORWARD or (kept is not None and uid not in kept):
            continue
        per_module[name] = per_module.get(name, 0) + trace.nbytes[uid]
    rows: list[ModuleRow] = []
    named = dict(module.named_modules())
    for name in traced.module_order:
        level = name.count(".") + 1
        if level > depth or name not in named:
            continue
        prefix = name + "."
        act = sum(b for m, b in per_module.items() if m == name or m.startswith(prefix))
        sub = named[name]
        rows.append(ModuleRow(
            name=name, type=type(sub).__name__, depth=level,
            parameters=sum(p.numel() for p in sub.parameters()),
            output_shape=traced.output_shapes.get(name, ()), activation_bytes=act,
        ))
    return tuple(rows)


def alive_after(trace: StepTrace, index: int) -> set[int]:
    alive: set[int] = set()
    for event in trace.events[:index]:
        if event >= 0:
            alive.add(event)
        else:
            alive.discard(~event)
    return alive


def _approximated(trace: StepTrace) -> tuple[tuple[str, int], ...]:
    return tuple((op, count) for op, count in sorted(trace.op_counts.items()) if op in _APPROXIMATED_OPS)

"""``memcalc.estimate``: resolve the model, run the step symbolically, replay, report."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from memcalc.engine import allocator
from memcalc.core.categories import Category, Mode, Phase
from memcalc.cuda.emulation import CudaEmulation
from memcalc.core.errors import InvalidInputError, MemcalcError
from memcalc.engine.losses import LossChoice, LossFn
from memcalc.sources.resolve import ResolvedModel, resolve
from memcalc.engine.optimizers import Optimizer
from memcalc.engine.options import EstimateOptions, Target
from memcalc.core.precision import Precision
from memcalc.core.report import ByteBreakdown, MemoryReport, ModuleRow, Textbook
from memcalc.engine.step import StepConfig, run_step
from memcalc.engine.timeline import Program, alive_before, allocator_events, build_program, category_totals_at, final_categories
from memcalc.engine.trace import StepTrace, StorageTracer
from memcalc.engine.prepare import kv_cache_bytes, kv_elements_per_token, prepare_step
from memcalc.cuda.workspaces import WorkspaceModel

__all__ = ("estimate", "trace_model", "TracedStep")


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


class EmulatedGradScaler:
    """``torch.amp.GradScaler``'s device work without its host syncs: a 1-element scale, the
    scaled loss, ``_amp_foreach_non_finite_check_and_unscale_`` on the gradients (in place)
    and ``_amp_update_scale_``. The real ``step`` reads ``found_inf.item()``, which has no value
    on meta; a finite step is assumed."""

    def __init__(self, device: torch.device):
        self._scale = torch.full((1,), 65536.0, device=device)
        self._growth = torch.zeros((1,), dtype=torch.int32, device=device)
        self._found_inf = torch.zeros((1,), device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        inv_scale = self._scale.double().reciprocal().float()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, self._found_inf, inv_scale)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        torch._amp_update_scale_(self._scale, self._growth, self._found_inf, 2.0, 0.5, 2000)


class TracedStep:
    """The raw result of tracing one step: the trace, final categories, module data."""

    def __init__(self, trace: StepTrace, categories: list[Category], tracer: StorageTracer, loss: str,
                 options: EstimateOptions, attention: dict[str, int], notes: list[str]):
        self.trace = trace
        self.categories = categories
        self.output_shapes = dict(tracer.modules.output_shapes)
        self.module_order = list(tracer.modules.order)
        self.loss = loss
        self.options = options
        self.mode = options.mode
        self.attention = attention
        self.notes = notes

    def program(self) -> Program:
        return build_program(self.trace, 2 if self.mode is Mode.TRAIN else 1)


def trace_model(resolved: ResolvedModel, options: EstimateOptions | None = None, *, hooks: Any = None,
                **option_values: Any) -> TracedStep:
    """Run one step of ``resolved`` under the tracer (the engine, without the report).

    ``hooks``: a per-rank program of a multi-GPU strategy (:mod:`memcalc.rank_programs`),
    installed on the model before its storages are registered and removed afterwards."""
    options = options or EstimateOptions.create(**option_values)
    module = resolved.module
    notes: list[str] = []
    inputs, blocks = prepare_step(module, resolved.inputs, precision=options.precision, checkpoint=options.checkpoint,
                                  containers=resolved.block_containers, model_name=resolved.name)
    if blocks:
        notes.append(f"activation checkpointing on {blocks} blocks ({', '.join(resolved.block_containers)})")
    emulation = CudaEmulation(options.precision, options.gpu.compute_capability,
                              emulate_kernels=options.emulate_cuda)
    workspaces = WorkspaceModel(options.gpu, training=options.mode is Mode.TRAIN) if options.emulate_cuda else None
    tracer = StorageTracer("meta", after_op=workspaces.after_op if workspaces else None)
    emulation.recomputing = lambda: tracer.modules.recomputing
    if workspaces is not None:
        workspaces.attach(tracer)
    observer = _TracerObserver(tracer)
    if hooks is not None:
        hooks.install(tracer, module)
    _register_preexisting(tracer, module, inputs)
    if options.kv_cache is not None:
        notes.append(_register_kv_cache(tracer, module, inputs, options))
    tracer.modules.install(module)
    config = StepConfig(
        mode=options.mode, optimizer=options.optimizer,
        loss=options.loss if options.loss is not None else resolved.loss, loss_fn=options.loss_fn,
        accum_steps=options.accum_steps, autocast=emulation.autocast if options.precision.is_amp else nullcontext,
        scaler_factory=(lambda: EmulatedGradScaler(torch.device("meta"))) if options.precision.uses_grad_scaler
        and options.mode is Mode.TRAIN else None,
    )
    try:
        with tracer, emulation:
            outcome = run_step(module, inputs, config, observer)
    except MemcalcError:
        raise
    except Exception as exc:
        raise InvalidInputError(
            f"the forward of {resolved.name} failed on input {resolved.input_description}: "
            f"{type(exc).__name__}: {exc}",
            hint="Check the input: --input-shape C,H,W for vision models, --seq-len N for sequence models.",
        ) from exc
    finally:
        if hooks is not None:
            hooks.remove()
        tracer.modules.remove()
        trace = tracer.stop()
    categories = final_categories(trace, observer.gradient_uids, observer.state_uids)
    loss_name = "custom loss_fn" if options.loss_fn is not None else (
        outcome.loss_kind.value if outcome.loss_kind is not None else f"none ({options.mode.value})")
    if workspaces is not None:
        notes.extend(workspaces.notes())
    if options.emulate_cuda and any(isinstance(m, nn.RNNBase) for m in module.modules()):
        notes.append("recurrent layers: on CUDA nn.LSTM/GRU/RNN run cuDNN's fused kernel with a reserve buffer "
                     "that memcalc does not model; the estimate follows the step-by-step decomposition")
    return TracedStep(trace, categories, tracer, loss_name, options, dict(emulation.attention_backends), notes)


def _register_preexisting(tracer: StorageTracer, module: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
    for p in module.parameters():
        tracer.preexisting(p, Category.PARAMETERS)
    for b in module.buffers():
        tracer.preexisting(b, Category.BUFFERS)
    for t in inputs:
        tracer.preexisting(t, Category.INPUTS)


def _register_kv_cache(tracer: StorageTracer, module: nn.Module, inputs: Sequence[torch.Tensor],
                       options: EstimateOptions) -> str:
    """A static KV cache sized for prompt + generated tokens, allocated before the prefill
    (as Hugging Face's StaticCache is): 2 (K, V) are counted in ``kv_elements_per_token``."""
    generated = int(options.kv_cache or 0)
    nbytes = kv_cache_bytes(module, inputs, options.precision, generated)
    tracer.synthetic(nbytes, Category.KV_CACHE, persistent=True, preexisting=True)
    per_token = kv_elements_per_token(module)
    batch, prompt = int(inputs[0].shape[0]), int(inputs[0].shape[1])
    tokens = prompt + generated
    return (f"KV cache for {tokens} tokens ({prompt} prompt + {options.kv_cache} generated) × batch {batch}: "
            f"{per_token:,} elements per token across layers; the prefill forward is simulated")


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
    precision: Precision | str = Precision.FP32,
    gpu: Any = None,
    checkpoint: bool = False,
    accum_steps: int = 1,
    kv_cache: int | None = None,
    module_depth: int = 1,
    capacity: int | None = None,
    target: str = Target.CUDA,
    on_trace: Callable[[TracedStep], None] | None = None,
    strategy: str = "single",
    world_size: int | None = None,
    device_ids: Sequence[int] | None = None,
    batch_is_global: bool = False,
    bucket_cap_mb: float | None = None,
    gradient_as_bucket_view: bool = False,
    sharding: str = "full_shard",
    reduce_bucket_size: int | None = None,
) -> MemoryReport:
    """Estimate the GPU memory of one training (or eval / inference) step of ``model``.

    ``model``: a zoo name (``"resnet50"``), a source string (``"my.py:make_model"``,
    ``"hf:gpt2"``), an ``nn.Module`` (never modified, never copied to memory: memcalc works on
    a meta twin) or a factory returning one. Inputs come from the zoo entry, ``input_shape``
    (one sample's shape; the batch dimension is added), ``seq_len`` for token models, or
    ``inputs`` (tensors whose shapes are used, batch included).

    ``precision``: ``fp32``, ``amp-fp16``, ``amp-bf16`` (CUDA autocast emulated op by op),
    ``fp16``, ``bf16`` (the whole model in that dtype). ``gpu``: a catalogue name
    (``"h100-80gb"``) or a :class:`~memcalc.cuda.gpus.catalogue.GpuProfile`; it drives attention-kernel choice
    and workspaces, adds its CUDA context, and makes ``fits``/``headroom`` answer for its memory
    (default: a generic sm80-class profile without a capacity). ``checkpoint``: activation
    checkpointing per block of a zoo model. ``accum_steps``: micro-batches of ``batch_size``
    per optimizer step. ``kv_cache``: tokens to generate (``mode="inference"``, decoder LLMs).
    ``loss_fn(output) -> scalar`` replaces the default loss (see :mod:`memcalc.losses`).
    ``capacity``: bytes the caching allocator may reserve, overriding the GPU's.
    ``target="cpu"`` turns the CUDA emulation off, to compare with a real CPU run.

    The peak covers two training iterations, so optimizer state created at the first
    ``step()`` is counted with the activations of the next forward/backward.

    ``on_trace`` (single GPU): called with the raw traced step before the report is made —
    :mod:`memcalc.search` uses it to replay the same step at other batch sizes.

    Multi-GPU (:mod:`memcalc.strategies`): ``strategy`` is ``single``, ``dp``, ``ddp``,
    ``fsdp``, ``zero1``, ``zero2`` or ``zero3`` over ``world_size`` GPUs (``dp``: or
    ``device_ids``); ``batch_size`` is per GPU unless ``batch_is_global``. DDP:
    ``bucket_cap_mb`` (25), ``gradient_as_bucket_view``; FSDP: ``sharding`` (``full_shard``,
    ``shard_grad_op``); ZeRO: ``reduce_bucket_size`` (elements, DeepSpeed's 5e8). The report
    then describes the busiest GPU and lists every role in ``report.roles``.
    """
    options = EstimateOptions.create(optimizer=optimizer, mode=mode, precision=precision, gpu=gpu, loss=loss,
                                     loss_fn=loss_fn, accum_steps=accum_steps, checkpoint=checkpoint,
                                     kv_cache=kv_cache, target=target)
    if capacity is not None and capacity <= 0:
        raise InvalidInputError(f"capacity must be a positive number of bytes, got {capacity}")
    from memcalc.distributed import strategies

    distributed = strategies.DistributedOptions.create(
        strategy=strategy, world_size=world_size, device_ids=device_ids, batch_is_global=batch_is_global,
        bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view, sharding=sharding,
        reduce_bucket_size=reduce_bucket_size)
    if capacity is None and options.gpu_named:
        capacity = options.gpu.usable_memory
    if not distributed.is_single:
        return strategies.estimate_per_rank(model, distributed=distributed, options=options, batch_size=batch_size,
                                            input_shape=input_shape, seq_len=seq_len, inputs=inputs,
                                            module_depth=module_depth, capacity=capacity)
    resolved = resolve(model, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len, inputs=inputs)
    traced = trace_model(resolved, options)
    if on_trace is not None:
        on_trace(traced)
    return _report(resolved, traced, options, module_depth, capacity)


def _report(resolved: ResolvedModel, traced: TracedStep, options: EstimateOptions, module_depth: int,
            capacity: int | None) -> MemoryReport:
    trace = traced.trace
    mode = options.mode
    program = traced.program()
    stats = allocator.replay(allocator_events(program, trace.nbytes))
    peak_index = max(stats.peak_index, 0)
    raw = category_totals_at(program, trace.nbytes, traced.categories, peak_index)
    breakdown = ByteBreakdown(
        parameters=raw[Category.PARAMETERS], buffers=raw[Category.BUFFERS], inputs=raw[Category.INPUTS],
        gradients=raw[Category.GRADIENTS], optimizer_state=raw[Category.OPTIMIZER_STATE],
        activations=raw[Category.ACTIVATIONS], workspace=raw[Category.WORKSPACE], kv_cache=raw[Category.KV_CACHE],
        peak_allocated=stats.peak_allocated,
    )
    first = allocator.replay(allocator_events(program, trace.nbytes, until=program.iteration_starts[-1])) \
        if program.iterations > 1 else stats
    spec = options.optimizer
    module = resolved.module
    param_bytes = sum(trace.nbytes[u] for u in trace.preexisting if traced.categories[u] is Category.PARAMETERS)
    training = mode is Mode.TRAIN
    textbook = Textbook(
        parameter_bytes=param_bytes,
        multiplier=spec.textbook_multiplier if training else 1,
        terms=spec.textbook_terms if training else "weights",
        activation_bytes=_saved_for_backward(trace, traced.categories) if training else raw[Category.ACTIVATIONS],
    )
    fits, reserved_within = _fit_under(program, trace.nbytes, capacity, stats)
    key = program.events[peak_index] if program.events else 0
    uid = program.storage(key) if key >= 0 else 0
    has_peak = stats.peak_allocated > 0
    notes = list(traced.notes)
    if (warning := options.precision_warning()) is not None:
        notes.append(warning)
        warnings.warn(warning, stacklevel=3)
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
        unsupported_ops=_approximated(trace, options),
        capacity=capacity,
        fits=fits,
        reserved_within_capacity=reserved_within,
        precision=options.precision,
        gpu=options.gpu,
        gpu_named=options.gpu_named,
        attention_backend=_main_backend(traced.attention),
        attention_calls=tuple(sorted(traced.attention.items())),
        accum_steps=options.accum_steps,
        checkpoint=options.checkpoint,
        notes=tuple(notes),
    )


def _main_backend(attention: dict[str, int]) -> str | None:
    if not attention:
        return None
    return max(attention.items(), key=lambda item: item[1])[0]


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
    alive = alive_before(trace, start)
    return sum(trace.nbytes[u] for u in alive if categories[u] is Category.ACTIVATIONS)


def _module_rows(module: nn.Module, traced: TracedStep, depth: int) -> tuple[ModuleRow, ...]:
    trace = traced.trace
    end_of_forward = trace.phase_starts.get(Phase.LOSS, len(trace.events))
    kept = alive_before(trace, end_of_forward) if traced.mode is Mode.TRAIN else None
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


# Ops whose CUDA memory memcalc approximates (the report lists them with their counts).
_APPROXIMATED_CUDA = {"convolution.default", "convolution_backward.default"}  # cuDNN workspace: a model
_APPROXIMATED_CPU = {"convolution.default", "convolution_backward.default"}


def _approximated(trace: StepTrace, options: EstimateOptions) -> tuple[tuple[str, int], ...]:
    names = _APPROXIMATED_CUDA if options.emulate_cuda else _APPROXIMATED_CPU
    return tuple((op, count) for op, count in sorted(trace.op_counts.items()) if op in names)

"""Trace one step and assemble its report: the engine's two entry points.

:func:`trace_model` runs forward, loss, backward, optimizer step and zero_grad of a resolved
model on meta tensors under the storage tracer, with a device backend plugged in;
:func:`build_report` replays the trace through the caching-allocator model and assembles the
:class:`~memcalc.core.report.MemoryReport`. The data flow is drawn in docs/architecture.md.

Two seams take what the engine does not know: the device's rules (a step backend,
:mod:`memcalc.engine.step_backend`) and, when a step time is wanted, a recorder of every kernel's
FLOPs and bytes (:class:`CostRecorder`, made by the layer that decides to time the step).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import (
    DataDependentError,
    InapplicableOptionError,
    InternalError,
    InvalidInputError,
    MemcalcError,
    SymbolicExecutionError,
)
from memcalc.core.progress import report_progress, reported
from memcalc.core.report import (
    ByteBreakdown,
    Generation,
    MemoryReport,
    ModuleRow,
    OnRequest,
    StepDescription,
    Textbook,
)
from memcalc.core.streams import Stream
from memcalc.core.throughput import CostSource
from memcalc.core.timeline import Timeline
from memcalc.core.units import format_bytes
from memcalc.engine import allocator, steady_sums
from memcalc.engine.collector import collector_paused
from memcalc.engine.compiled import (
    CompiledForwards,
    CompiledStepTracer,
    MetaInductor,
    budget_note,
    compile_forward,
    fresh_forward,
    warm_up,
)
from memcalc.engine.dynamo_deferred import dynamo_deferred
from memcalc.engine.generation import GENERATING, decode_step_at, run_generation
from memcalc.engine.loop_trace import LoopTracing, check_loop
from memcalc.engine.loops import ITERATIONS, run_loop
from memcalc.engine.model import GenerateFn, ModelInputs, ResolvedModel
from memcalc.engine.optimizers import resolve_impl
from memcalc.engine.prepare import (
    cast_inputs,
    checkpointing_note,
    kv_cache_bytes,
    kv_elements_per_token,
    kv_prompt,
    prepare_step,
)
from memcalc.engine.steady import RunCounts, extend, traced_tokens
from memcalc.engine.steady_replay import REPLAYING, replay_generation
from memcalc.engine.step import Scaler, StepConfig, run_step
from memcalc.engine.step_backend import AutocastRegion, CompiledAutocast, PlainBackend, StepBackend
from memcalc.engine.step_spec import Step
from memcalc.engine.timeline import (
    CategoryColumn,
    Program,
    alive_at_end,
    alive_before,
    allocator_events,
    build_program,
    build_timeline,
    category_codes,
    category_totals_at,
    final_categories,
    freed_preexisting,
    generation_peaks,
)
from memcalc.engine.trace import AfterOpHook, Op, ReadOracle, SteadyRun, StepTrace, StorageTracer

__all__ = ("LOGICAL_NUMEL", "MODEL_LOSS", "CostRecorder", "CostRecorderFactory", "RankHooks", "Replayed", "TracedStep",
           "build_report", "is_paged", "parameter_count", "replay_step", "step_config", "trace_model")

#: The report's loss when the step trained with the loss the model returned (``output.loss``).
MODEL_LOSS = "the model's own (output.loss)"
#: Attribute of a parameter that stores others' elements (a quantized weight, packed; its
#: statistics: :mod:`memcalc.stacks.bitsandbytes.quantized_base`): the parameters it stands for, as PEFT and
#: transformers count them. Without it a parameter counts its ``numel()``.
LOGICAL_NUMEL = "memcalc_logical_numel"
#: A dict batch's ``attention_mask`` is read by Hugging Face models (``masking_utils``: no causal
#: mask is built when nothing is padded), which a run without data cannot do.
_MASK_VALUES = ("Hugging Face models read the values of attention_mask (to skip building a causal mask when "
                "nothing is padded): leave attention_mask out of the inputs to estimate a batch without padding.")


class RankHooks(Protocol):
    """A multi-GPU program's hooks on one rank's model (:mod:`memcalc.distributed`)."""

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        """Hook the rank's model before its storages are registered."""

    def remove(self) -> None:
        """Undo :meth:`install` (called in a ``finally``).

        A program whose second step differs from its first (ZeRO-3's, which prefetches only once
        its first step has recorded the module order) says so with ``iterations_differ = True``:
        the second step is then traced, not repeated from the first."""


class CostRecorder(Protocol):
    """What each kernel of the traced step costs, recorded while it runs
    (:class:`memcalc.timing.flops.OpCostRecorder`): an after-op hook of the tracer that runs the
    backend's own hook first. The engine times nothing itself; the layer that wants a step time
    hands :func:`trace_model` a :data:`CostRecorderFactory`, and the report keeps what the
    recorder made of the step (:meth:`step_costs`)."""

    def __call__(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Run the backend's hook, then record the op."""

    def attach(self, tracer: StorageTracer) -> None:
        """Read the phase, module and recomputation of each op from ``tracer``."""

    def step_costs(self, inputs: ModelInputs, *, batch_size: int, micro_batches: int, module_order: Sequence[str],
                   until: int | None) -> CostSource:
        """The recorded step as the report's source of FLOPs and step times.

        Args:
            inputs: the step's inputs (its token ids give the tokens per step).
            batch_size: samples per micro-batch.
            micro_batches: micro-batches per optimizer step (gradient accumulation).
            module_order: the modules in the order the forward first ran them.
            until: a loop traced for several iterations counts the ops up to this trace event
                (its first iteration); None: every op.
        """


#: Makes the recorder of one traced step around the backend's after-op hook.
CostRecorderFactory = Callable[[AfterOpHook], CostRecorder]


def is_paged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` stands for a buffer in CUDA unified memory: bitsandbytes' ``F.get_paged``
    marks its tensors with ``is_paged = True``, and so does its emulation
    (:mod:`memcalc.stacks.bitsandbytes.adamw`)."""
    return bool(getattr(tensor, "is_paged", False))


class _TracerObserver:
    """Adapts :class:`StorageTracer` to the step program's observer protocol. ``unified_memory``:
    the target is CUDA, where a paged optimizer's large states live in unified memory
    (:func:`is_paged`), outside the caching allocator."""

    def __init__(self, tracer: StorageTracer, *, unified_memory: bool = False, model: nn.Module | None = None,
                 iterations_differ: bool = False):
        self.tracer = tracer
        self.iterations_differ = iterations_differ  # a program whose second step is not its first
        self.model = model  # its buffers at the end of an iteration are buffers, wherever they were born
        self.unified_memory = unified_memory
        self.gradient_uids: set[int] = set()
        self.state_uids: set[int] = set()
        self.paged_uids: set[int] = set()
        self.second_iteration: int | None = None  # where in trace.events a traced second iteration begins
        #: freed pre-existing storage -> the step's storage in its place, None: none (the second
        #: iteration synthesised)
        self.successors: dict[int, int | None] = {}

    def set_phase(self, phase: Phase) -> None:
        self.tracer.set_phase(phase)

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        self.tracer.preexisting(tensor, category)

    def batch_tensor(self, tensor: torch.Tensor) -> None:
        self.tracer.track(tensor, Category.INPUTS)

    def backward_context(self) -> AbstractContextManager[Any]:
        return self.tracer.modules.backward()

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        self.gradient_uids.update(self.tracer.gradient_uids(params))

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        values = [value for state in optimizer.state.values() for value in state.values()
                  if isinstance(value, torch.Tensor)]
        for value, uid in zip(values, self.tracer.uids_of(values), strict=True):
            if uid is not None:
                self.state_uids.add(uid)
                if self.unified_memory and is_paged(value):
                    self.paged_uids.add(uid)

    def run_again(self) -> bool:
        """Once, when the step freed a pre-existing storage (a rebound buffer): the second
        iteration is then traced (from ``second_iteration``) rather than synthesised."""
        if self.second_iteration is not None:
            return False
        freed = freed_preexisting(self.tracer.trace)
        if not (self.iterations_differ or freed):
            return False
        if not self.iterations_differ and self._successors(freed):
            return False
        self.second_iteration = len(self.tracer.trace.events)
        self._buffers_bound()
        return True

    def _successors(self, freed: Sequence[int]) -> bool:
        """Whether every freed pre-existing storage has a successor the step left in its place
        (:meth:`StorageTracer.replaced_by`), born in the step and alive at its end, or is known to
        have none (the place empty: the next step frees nothing there): then the
        second iteration is synthesised, and ``successors`` says which replaces which. Only when
        nothing else the step made is alive at its end but the optimizer's state, persistent
        workspaces (a cuBLAS handle's) and empty storages: a storage that outlives the step otherwise (a schedule's
        stash of its last sends) is freed by the next step, which a copy of the first would keep
        alive instead."""
        alive = alive_at_end(self.tracer.trace)
        found: dict[int, int | None] = {}
        for uid in freed:
            later = self.tracer.successors.get(uid)
            if later is None:
                return False
            tensor = later()
            successor = self.tracer.uid_of(tensor) if tensor is not None else None
            if tensor is not None and successor not in alive:
                return False
            found[uid] = successor  # None: nothing in its place, for the next step to free
        nbytes = self.tracer.trace.nbytes
        if any(nbytes[uid] for uid in alive - self.state_uids - self.tracer.held - set(found.values())):
            return False
        self.successors = found
        return True

    def _buffers_bound(self) -> None:
        """The storages the model's buffers hold now count as buffers, though born in the step
        (a buffer rebound by the forward) rather than before it."""
        if self.model is None:
            return
        for buffer in self.model.buffers():
            if (uid := self.tracer.uid_of(buffer)) is not None and self.tracer.trace.category[uid] is None:
                self.tracer.trace.category[uid] = Category.BUFFERS

    def kv_cache(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.device.type == self.tracer.device_type:
                self.tracer.track(tensor, Category.KV_CACHE)

    def finished(self) -> None:
        self._buffers_bound()
        self.tracer.stop()


class TracedStep:
    """The raw result of tracing one step: the trace, final categories, module data."""

    def __init__(self, trace: StepTrace, categories: list[Category], tracer: StorageTracer, loss: str,
                 step: Step, attention: dict[str, int], notes: list[str], optimizer_impl: str = "", *,
                 codes: np.ndarray | None = None):
        self.trace = trace
        self.categories = categories
        self._codes = codes  # after the categories' setter, which forgets them
        self.output_shapes = dict(tracer.modules.output_shapes)
        self.module_order = list(tracer.modules.order)
        self.loss = loss
        self.step = step
        self.mode = step.mode
        self.attention = attention
        self.notes = notes
        self.optimizer_impl = optimizer_impl  # as resolved for the target ("" without an optimizer step)
        #: every kernel's FLOPs and bytes (trace_model's ``costs``); None: not recorded (no time was asked for)
        self.costs: CostRecorder | None = None
        self.paged_optimizer_state = 0  # bytes in unified memory, set apart from the trace (_set_apart)
        #: A loop traced for all its iterations: where in ``trace.events`` the second, third, ... begin.
        self.iteration_starts: list[int] | None = None
        #: pre-existing storages the step freed, and which of its own it left in their place (:func:`build_program`)
        self.successors: dict[int, int | None] = {}
        #: the calls whose memory inside the kernel the backend's rules found approximated (StepBackend.
        #: approximated_ops); None: the engine's list by op name (:func:`_approximated`)
        self.approximated: Mapping[str, int] | None = None

    @property
    def categories(self) -> list[Category]:
        """Each storage's final category (:func:`~memcalc.engine.timeline.final_categories`)."""
        return self._categories

    @categories.setter
    def categories(self, categories: list[Category]) -> None:
        self._categories = categories
        self._codes = None  # a composed step's new categories: their codes made when asked for

    def category_codes(self) -> np.ndarray:
        """The categories' :func:`~memcalc.engine.timeline.category_codes`: made with them by
        :func:`trace_model`, else once when first asked for."""
        if self._codes is None:
            self._codes = category_codes(self._categories)
        return self._codes

    def program(self) -> Program:
        """The replayable program of this step (two iterations when training)."""
        return build_program(self.trace, 2 if self.mode is Mode.TRAIN else 1, traced_starts=self.iteration_starts,
                             successors=self.successors)


def step_config(resolved: ResolvedModel, step: Step, *, autocast: AutocastRegion | None,
                scaler: Callable[[], Scaler | None] | None, cuda: bool, iterations: int = 1) -> StepConfig:
    """How the step program runs ``step`` — one configuration for the trace and for a real
    run of the same step (``--measure``), which differ only in what they run under.

    Args:
        resolved: the model (its own loss, when none was chosen).
        step: the step.
        autocast: opens the autocast region of a mixed-precision step (the backend's emulated
            one, or ``torch.autocast``); None: none.
        scaler: makes the gradient scaler of an amp-fp16 step (emulated, or torch's); None: none.
        cuda: the parameters are on a CUDA device (the optimizer's ``auto`` implementation
            depends on it).
        iterations: optimizer steps to run (the trace runs one and synthesises the second).

    Returns:
        The step program's configuration.
    """
    return StepConfig(
        mode=step.mode, optimizer=step.optimizer, iterations=iterations,
        optimizer_impl=resolve_impl(step.optimizer, step.loop.optimizer_impl, cuda=cuda),
        loss=step.loss if step.loss is not None else resolved.loss, loss_fn=step.loss_fn,
        accum_steps=step.accum_steps, autocast=(autocast if autocast is not None and not resolved.opens_autocast
                                                   else nullcontext),
        scaler_factory=scaler if step.mode is Mode.TRAIN else None,
        model_loss=step.trains_own_loss, amp=step.precision.is_amp,
        # accelerate's prepare_model under amp (DDP, one GPU); under FSDP2 the traced precision is not amp
        fp32_outputs=step.accelerate_prepared and step.precision.is_amp,
        accelerator_backward=accelerator_backward(step),
    )


def accelerator_backward(step: Step) -> bool:
    """Whether the step's backward is ``Accelerator.backward``'s (its loss divided first): the Trainer's
    loop and TRL's (``training_step`` calls it, its accelerator at one accumulation step), and memcalc's
    own loops under ``accelerate launch`` (``--accelerate-config``) at ``accum_steps`` 1, as accelerate's
    loops are written. Accumulating, an own loop's ``loss / accum_steps`` stands for accelerate's (one
    division each); a user's loop function makes its own backward."""
    preset = step.loop.preset
    if preset is not None and preset.is_trainer:
        return True
    return step.accelerate_prepared and step.accum_steps == 1 and preset is not None


@torch.inference_mode(False)  # a caller's inference mode would make every tensor of the step an inference tensor
@collector_paused()
@dynamo_deferred()
def trace_model(resolved: ResolvedModel, step: Step, backend: StepBackend | None = None, *,
                hooks: RankHooks | None = None, traced_loop: bool | None = None,
                costs: CostRecorderFactory | None = None,
                retrace: Callable[[], StepBackend] | None = None, steady_attempt: int = 0) -> TracedStep:
    """Run one step of ``resolved`` under the tracer (the engine, without the report).

    Args:
        resolved: the model and its inputs, on meta.
        step: the step (optimizer, mode, precision, loss, accumulation, ...).
        backend: what the device adds (:mod:`memcalc.engine.step_backend`); None: plain meta.
        hooks: a per-rank program of a multi-GPU strategy (:mod:`memcalc.distributed`),
            installed on the model before its storages are registered and removed afterwards.
        traced_loop: run ``step.loop`` as written (:mod:`memcalc.engine.loops`), every
            iteration traced; None: unless it is the default loop, whose second iteration is
            synthesised from one traced step (the same peak, faster).
        costs: makes the recorder of every kernel's FLOPs and bytes, when a step time is wanted
            (the layer that decides so passes :class:`memcalc.timing.flops.OpCostRecorder`);
            None: nothing is recorded, and an estimate that asks for no time pays nothing for it.
        retrace: makes a fresh backend, for a generation whose steady decode steps are
            extrapolated (:mod:`memcalc.engine.steady`) when the pattern is not confirmed and
            the generation is traced again, with more decode steps (the next of
            :data:`~memcalc.engine.steady.TRACED_TOKENS`), then token by token; None: every
            decode step is traced.
        steady_attempt: which of those tries this trace is.

    Returns:
        The trace with final categories, module data and the backend's notes.
    """
    backend = backend if backend is not None else PlainBackend()
    module = resolved.module
    notes = list(resolved.notes)  # what resolving decided (where the inputs came from, a grown model)
    if traced_loop is None:
        traced_loop = not step.loop.is_default
    if traced_loop:
        check_loop(step, multi_gpu=hooks is not None)
    inputs, blocks = prepare_step(module, resolved.step_inputs(resolved.inputs, own_loss=step.trains_own_loss),
                                  step, containers=resolved.block_containers, model_name=resolved.name,
                                  own_checkpointing=resolved.checkpointing)
    if blocks:
        notes.append(checkpointing_note(step.checkpoint, blocks, resolved.block_containers))
    if step.parameter_dtype is not step.precision.parameter_dtype:
        dtype = str(step.parameter_dtype).removeprefix("torch.")
        notes.append(f"parameters stored in {dtype} (weight_dtype) under {step.precision.value}: their "
                     f"gradients and optimizer state in {dtype} too")
    if (built := _dtypes_as_built(module, step)) is not None:
        notes.append(built)
    # FLOPs and bytes per kernel, after the backend's rules: only for a step time
    recorder = costs(backend.after_op) if costs is not None else None
    generate = _generation_of(resolved, step)
    steady, unsteady = _steady_tokens(resolved, step, inputs, generate is not None and retrace is not None
                                      and recorder is None and hooks is None, steady_attempt)
    reads = (resolved.reads(step.mode, steady or step.new_tokens) if resolved.reads is not None else None)
    compiled = _compiled(module, inputs, step, resolved, notes, hooks=hooks, autocast=backend.compiled_autocast(),
                         reads=reads)
    tracer = (StorageTracer if compiled is None else CompiledStepTracer)(
        "meta", after_op=recorder if recorder is not None else backend.after_op, read_values=reads,
        after_op_applies=None if recorder is not None else backend.after_op_applies)
    tracer.defer_to = resolved.defer_to
    if recorder is not None:
        recorder.attach(tracer)
    backend.attach(tracer)
    observer = _TracerObserver(tracer, unified_memory=step.emulate_cuda, model=module,
                               iterations_differ=bool(getattr(hooks, "iterations_differ", False)))
    tracing = LoopTracing(tracer, module, observer) if traced_loop else None
    if hooks is not None:
        hooks.install(tracer, module)
    buffers = _register_preexisting(tracer, module, inputs if tracing is None else ())  # a loop's batches: when drawn
    own_cache: Callable[[], Iterable[torch.Tensor]] | None = None
    if step.kv_cache is not None:
        note, inputs, own_cache = _register_kv_cache(tracer, resolved, inputs, step)
        notes.append(note)
    if compiled is None:  # a compiled forward runs fused kernels: no module of the model's own runs them
        tracer.modules.install(module)
    runs_before = compiled.backend.runs if compiled is not None else 0
    config = step_config(resolved, step, autocast=backend.autocast(), scaler=backend.grad_scaler,
                         cuda=step.emulate_cuda)
    decoded: list[RunCounts] = []  # the run's counts as each decode step began (when extrapolating)

    def counted() -> RunCounts:
        return RunCounts(Counter(tracer.trace.op_counts), dict(backend.attention_backends()),
                         tuple(backend.notes(module)), dict(tracer.modules.output_shapes),
                         tuple(tracer.modules.order), _copied(backend.approximated_ops()))

    try:
        with tracer, backend.mode():
            if generate is not None:
                assert step.new_tokens is not None  # fields.build_step checked it
                outcome = run_generation(module, inputs, config, generate, step.new_tokens, observer,
                                         on_decode=(lambda _k: decoded.append(counted())) if steady else None)
            elif tracing is None:
                outcome = run_step(module, inputs, config, observer)
                if own_cache is not None:  # filled by the forward, as the model's own cache is
                    observer.kv_cache(own_cache())
            else:
                outcome = run_loop(module, inputs, config, step.loop, tracing)
    except DataDependentError as exc:
        if tracing is not None:
            tracing.explain(exc, step.loop.name)
        if isinstance(inputs.kwargs.get("attention_mask"), torch.Tensor):
            exc.hint = f"{_MASK_VALUES} {exc.hint or ''}".strip()
        raise
    except SymbolicExecutionError as exc:
        if exc.rejected_shapes and resolved.inputs_from is not None:
            # a file's example_inputs serves every factory of the file: it may be another one's
            exc.hint = (f"The inputs, {resolved.input_description}, came from {resolved.inputs_from}; if they are "
                        f"not this model's, give its input with --input-shape or --seq-len, which win over "
                        f"example_inputs.")
        elif exc.rejected_shapes:  # say what the input was: the shapes in the message are the op's
            exc.hint = f"The input was {resolved.input_description}. {exc.hint}"
        raise
    except MemcalcError:
        raise
    except Exception as exc:
        # the model's own code (or memcalc's tracing of it) raised: the input is one suspect, not the only one
        where = "forward" if tracer.phase in (Phase.SETUP, Phase.FORWARD) else tracer.phase.value
        raise InvalidInputError(
            f"the {where} of {resolved.name} failed on input {resolved.input_description}: "
            f"{type(exc).__name__}: {exc}",
            hint="If that input is not what the model takes, give its input: --input-shape C,H,W for vision models, "
                 "--seq-len N for sequence models. If it is, the error comes from the model's code or from memcalc's "
                 "tracing of it on meta tensors: --debug shows the traceback (please report it if the model runs on "
                 "real tensors).",
        ) from exc
    finally:
        if hooks is not None:
            hooks.remove()
        tracer.modules.remove()
        trace = tracer.stop()
        if compiled is not None:
            compiled.restore()
    if compiled is not None:
        compiled.backend.check_ran(runs_before)
    attention = dict(backend.attention_backends())
    backend_notes, approximated = backend.notes(module), backend.approximated_ops()
    if steady is not None:
        assert step.new_tokens is not None and retrace is not None
        extension = extend(trace, decoded, counted(), step.new_tokens)
        if isinstance(extension, str):  # not confirmed: more decode steps traced, then every one
            if traced_tokens(step.new_tokens, steady_attempt + 1) is not None:
                return trace_model(resolved, step, retrace(), costs=costs, retrace=retrace,
                                   steady_attempt=steady_attempt + 1)
            traced = trace_model(resolved, step, retrace(), costs=costs)
            traced.notes.append(f"generation traced token by token: its decode steps were not extrapolated "
                                f"({extension})")
            return traced
        trace.op_counts = extension.op_counts
        attention, backend_notes, approximated = extension.attention, extension.notes, extension.approximated
        report_progress(GENERATING, step.new_tokens, step.new_tokens)
    elif unsteady is not None:
        notes.append(f"generation traced token by token: {unsteady}")
    categories, codes = final_categories(trace, observer.gradient_uids, observer.state_uids)
    loss_name = "custom loss_fn" if step.loss_fn is not None else MODEL_LOSS if outcome.model_loss else (
        outcome.loss_kind.value if outcome.loss_kind is not None else f"none ({step.mode.value})")
    notes.extend(backend_notes)
    has_step = step.mode is Mode.TRAIN and step.optimizer.factory is not None
    traced = TracedStep(trace, categories, tracer, loss_name, step, attention, notes,
                        config.optimizer_impl.value if has_step else "", codes=codes)
    traced.approximated = approximated
    traced.costs = recorder
    traced.paged_optimizer_state = _set_apart(trace, observer.paged_uids)
    if observer.second_iteration is not None:
        traced.iteration_starts = [observer.second_iteration]
        if freed_preexisting(trace):
            traced.notes.append(_rebound_note(trace, buffers))
    elif observer.successors:
        traced.successors = observer.successors
        count = len(observer.successors)
        traced.notes.append(f"the step frees {count} pre-existing tensor{'s' if count > 1 else ''} and leaves what "
                            f"the next step frees in their place: its second iteration repeats the first, not traced")
    if tracing is not None:
        traced.iteration_starts = tracing.iteration_starts()
        traced.notes.extend(tracing.notes(step, ITERATIONS * step.accum_steps, has_step))
        if step.loop.preset is None:
            traced.loss = f"computed by the loop ({step.loop.name})"
    return traced


def _compiled(module: nn.Module, inputs: ModelInputs, step: Step, resolved: ResolvedModel, notes: list[str], *,
              hooks: RankHooks | None, autocast: CompiledAutocast | None,
              reads: ReadOracle | None) -> CompiledForwards | None:
    """``module``'s forward compiled by torch's own stack on meta (:mod:`memcalc.engine.compiled`)
    and warmed up outside the tracer, when the step is compiled (``compile=True`` or a module the
    user compiled); the report's notes say how. None: an eager step.

    Under a rank program (DDP, FSDP2) each block is compiled on its own, as torchtitan's
    ``apply_compile`` does before ``fully_shard``/``replicate``: the program's hooks on a block
    (all-gather, reshard, reduce-scatter, gradient buckets) run eagerly around its compiled
    forward, and the blocks of one class share one compiled graph. The warm-up runs with the
    parameters in the dtype the program hands the blocks (FSDP2's ``param_dtype``), so that
    Dynamo's guards hold in the traced step."""
    if not (step.compile or resolved.compiled):
        return None
    backend = MetaInductor(autocast)
    if hooks is None:
        targets = [module]
    else:
        targets = _blocks(module, resolved)
        if not targets:
            raise InapplicableOptionError(
                f"a compiled step under a multi-GPU strategy compiles each block on its own (torchtitan's "
                f"apply_compile); {resolved.name} names no blocks", hint="Leave out --compile, or give a zoo model.")
    functions: dict[type[nn.Module], Any] = {}
    compiled = CompiledForwards(backend, [compile_forward(
        block, backend, function=functions.setdefault(type(block), fresh_forward(type(block)))) for block in targets])
    # the dtype a rank program gives the blocks' parameters in forward (FSDP2's MixedPrecisionPolicy)
    dtype: torch.dtype | None = getattr(hooks, "forward_parameter_dtype", None)
    try:
        with _parameters_in(module, dtype):
            warm_up(module, inputs, train=step.mode is Mode.TRAIN, reads=None if hooks is None else reads)
    except MemcalcError:
        compiled.restore()
        raise
    except Exception as exc:
        compiled.restore()
        raise InvalidInputError(f"torch.compile of {resolved.name} failed: {type(exc).__name__}: {exc}",
                                hint="memcalc runs torch's own Dynamo, AOTAutograd and Inductor on meta tensors; "
                                     "if the model compiles on real tensors, please report it (--debug shows the "
                                     "traceback). Leave out --compile to estimate it eager.") from exc
    given = "the model was compiled by torch.compile" if resolved.compiled else "compiled (torch.compile, Inductor)"
    per_block = "" if hooks is None else f", each of its {len(targets)} blocks on its own (torchtitan's apply_compile)"
    notes.append(f"{given}{per_block}: saved activations from AOTAutograd's min-cut partitioner, buffers from "
                 f"Inductor's fused kernels and memory planning ({backend.graphs} graph"
                 f"{'s' if backend.graphs != 1 else ''}); Inductor's CPU code generation"
                 + ("" if not step.emulate_cuda else ", standing for CUDA's (Triton's kernels not modelled)"))
    if autocast is not None and step.precision.is_amp:
        notes.append("compiled under autocast: AOTAutograd traced the joint graph under "
                     + ("the real torch.autocast('cpu')" if autocast.call is not None
                        else "CUDA autocast's op lists (memcalc's emulation, aten/src/ATen/autocast_mode.cpp)")
                     + ", so its casts are in the graph the partitioner and Inductor see")
    if (budget := budget_note()) is not None:
        notes.append(budget)
    return compiled


def _blocks(module: nn.Module, resolved: ResolvedModel) -> list[nn.Module]:
    """The blocks of ``resolved``'s block containers (a zoo model's transformer layers), else
    the items of the model's outermost ``nn.ModuleList``s (how blocks are held; FSDP2's units)."""
    paths = list(resolved.block_containers)
    if not paths:
        for name, child in module.named_modules():
            if isinstance(child, nn.ModuleList) and not any(name.startswith(f"{p}.") for p in paths):
                paths.append(name)
    blocks: list[nn.Module] = []
    for path in paths:
        blocks.extend(module.get_submodule(path).children())
    return blocks


@contextmanager
def _parameters_in(module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``module``'s floating parameters in ``dtype`` while the block runs (meta: no bytes), then
    as they were. None: as they are."""
    if dtype is None:
        yield
        return
    saved = [(p, p.data) for p in module.parameters() if p.is_floating_point() and p.dtype != dtype]
    for p, data in saved:
        p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def _dtypes_as_built(module: nn.Module, step: Step) -> str | None:
    """What the report says when the parameters keep a dtype the precision does not name: an
    fp32 step casts nothing (:func:`~memcalc.engine.prepare.cast_parameters`), so a module the
    user built in float64 or bf16 is estimated in its own dtype — what it would run in."""
    if step.parameter_dtype is not torch.float32:
        return None  # the step cast the parameters to its dtype
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()
                     if p.is_floating_point() and p.dtype is not torch.float32})
    if not dtypes:
        return None
    return (f"parameters stored in {', '.join(dtypes)}, as the model was built: precision "
            f"{step.precision.value} casts no parameter, so the step (its gradients and optimizer state too) is "
            f"estimated in the model's own dtype")


def _generation_of(resolved: ResolvedModel, step: Step) -> GenerateFn | None:
    """The model's own generation in mode generate (None in the other modes).

    Raises:
        InapplicableOptionError: mode generate for a model without a generate() memcalc runs.
    """
    if step.mode is not Mode.GENERATE:
        return None
    if resolved.generate is None:
        raise InapplicableOptionError(
            f"mode generate runs the model's own generate(); memcalc runs that of a Hugging Face causal language "
            f"model, and {resolved.name} is not one",
            hint="Give its Hugging Face config (hf:ORG/NAME or hf:path/to/config.json), or estimate one forward with "
                 "a static KV cache: --mode inference --kv-cache TOKENS.")
    return resolved.generate


def _steady_tokens(resolved: ResolvedModel, step: Step, inputs: ModelInputs, possible: bool,
                   attempt: int) -> tuple[int | None, str | None]:
    """The tokens to trace before extrapolating a generation's steady decode steps at the
    ``attempt``-th try (:func:`~memcalc.engine.steady.traced_tokens`), or None; and, when the
    model's source says its decode steps do not repeat, why (the report says so)."""
    if not possible or step.new_tokens is None:
        return None, None
    tokens = traced_tokens(step.new_tokens, attempt)
    if tokens is None or resolved.steady_decoding is None:
        return None, None
    why = resolved.steady_decoding(resolved.module, inputs, step.new_tokens)
    if why is not None:
        return None, f"its decode steps are not extrapolated, as {why}"
    return tokens, None


def _set_apart(trace: StepTrace, uids: set[int]) -> int:
    """Take storages out of the caching allocator's view (a paged optimizer's states, in CUDA
    unified memory): their size becomes 0 — a zero-byte request allocates nothing — so they
    count in no category and no peak. Returns their bytes, reported apart."""
    total = 0
    for uid in uids:
        total += trace.nbytes[uid]
        trace.nbytes[uid] = 0
    return total


def parameter_count(params: Iterable[nn.Parameter]) -> int:
    """How many parameters ``params`` hold, as PEFT's ``get_nb_trainable_parameters`` counts
    them: ``numel()``, or :data:`LOGICAL_NUMEL` where a parameter stores others' elements."""
    return sum(int(getattr(p, LOGICAL_NUMEL, p.numel())) for p in params)


def _register_preexisting(tracer: StorageTracer, module: nn.Module, inputs: Sequence[torch.Tensor]) -> dict[int, str]:
    """Register the parameters, buffers and inputs as there before the step; returns each
    buffer's name by uid, to name a buffer the step rebinds."""
    for p in module.parameters():
        tracer.preexisting(p, Category.PARAMETERS)
    buffers = {tracer.preexisting(b, Category.BUFFERS): name for name, b in module.named_buffers()}
    for t in inputs:
        tracer.preexisting(t, Category.INPUTS)
    return buffers


def _rebound_note(trace: StepTrace, buffers: dict[int, str]) -> str:
    """What the report says when the step rebound pre-existing storages (its second iteration
    traced rather than synthesised)."""
    freed = freed_preexisting(trace)
    names = [f"'{buffers[uid]}'" for uid in freed if uid in buffers] or [f"{len(freed)} pre-existing tensors"]
    return (f"the step rebinds buffer{'s' if len(names) > 1 else ''} {', '.join(names)} (a new tensor replaces the "
            f"one there before the step): its second iteration was traced, not repeated from the first")


def _register_kv_cache(tracer: StorageTracer, resolved: ResolvedModel, inputs: ModelInputs, step: Step
                       ) -> tuple[str, ModelInputs, Callable[[], Iterable[torch.Tensor]] | None]:
    """One KV cache for prompt + generated tokens, never two: the model's own where it keeps one
    (a Hugging Face causal LM: its ``StaticCache`` of that length, passed as ``past_key_values``
    and filled by the prefill, so no ``DynamicCache`` is made beside it), else a static one
    allocated before the prefill (2 (K, V) are counted in ``kv_elements_per_token``). A model its
    source knows to be no decoder (an encoder such as BERT) is refused.

    Returns:
        The report's note, the forward's inputs, and where the model keeps its own cache the
        tensors it holds after the forward (to be marked as the KV cache), else None.
    """
    generated = int(step.kv_cache or 0)
    module = resolved.module
    nbytes = kv_cache_bytes(module, inputs, step.precision, generated, model_name=resolved.name,
                            decoder=resolved.decoder)
    per_token = kv_elements_per_token(module)
    batch, prompt = kv_prompt(inputs) or (0, 0)  # kv_cache_bytes refused inputs that are not token ids
    tokens = prompt + generated
    sized = f"KV cache for {tokens} tokens ({prompt} prompt + {step.kv_cache} generated) × batch {batch}"
    if resolved.static_cache is not None:
        keywords, tensors = resolved.static_cache(module, tokens)
        inputs = ModelInputs(inputs.args, {**inputs.kwargs, **keywords})
        return (f"{sized}: the model's own StaticCache (max_cache_len {tokens}), passed to the forward and "
                f"filled by the prefill, which is simulated; no other cache beside it", inputs, tensors)
    tracer.synthetic(nbytes, Category.KV_CACHE, persistent=True, preexisting=True, label="synthetic: KV cache")
    return (f"{sized}: {per_token:,} elements per token across layers; the prefill forward is simulated",
            inputs, None)


class _TimelineBuilder:
    """``MemoryReport.timeline()`` behind the report (its ``on_request.timeline``, a
    :class:`~memcalc.core.report.TimelineSource`): what the replay needs, kept so that the
    timeline costs nothing until it is asked for (then it is built once and kept)."""

    def __init__(self, trace: StepTrace, program: Program, categories: Sequence[Category], capacity: int | None,
                 role: str, settings: AllocConf | None = None, host: bool = False) -> None:
        self._args = (trace, program, categories)
        self._settings = settings
        self._capacity = capacity
        self._role = role
        self._host = host
        self._timeline: Timeline | None = None

    def timeline(self) -> Timeline:
        """The step's timeline: built on the first call (one more replay), then kept."""
        if self._timeline is None:
            self._timeline = build_timeline(*self._args, capacity=self._capacity, role=self._role,
                                            settings=self._settings, host=self._host)
        return self._timeline


def _program_of(traced: TracedStep) -> Program:
    """The traced step's program; a step it cannot be built for is memcalc's bug, named."""
    try:
        return traced.program()
    except ValueError as exc:
        raise InternalError(exc, stage="building the program of the traced step") from exc


#: Events from which the replay tells its progress: about a second of replay.
REPLAY_PROGRESS_FROM = 1 << 17


def _replayed(program: Program, trace: StepTrace, settings: AllocConf | None, host: bool, *,
              nbytes: np.ndarray | None = None,
              steady: SteadyRun | None = None) -> tuple[allocator.AllocatorStats, allocator.AllocatorStats]:
    """The program replayed through the allocator model: the stats of its first iteration and of
    the whole (the same object for a program of one iteration), from one replay. An impossible
    event (a free of a storage that is not live) is memcalc's bug, named by the op and module
    that made the storage."""
    try:
        if (fast := replay_generation(program, trace, settings, host, nbytes=nbytes, steady=steady)) is not None:
            # a long generation: its small pool's repeated decode steps skipped, exactly
            return (fast, fast) if program.iterations <= 1 else (allocator.replay(
                allocator_events(program, trace.nbytes, until=program.iteration_starts[1]), settings=settings,
                host=host, streams=program.streams), fast)
        if not program.streams and len(program.events) < REPLAY_PROGRESS_FROM:  # most steps: one stream, no bar
            return allocator.replay_keys(program.events, _sizes_by_key(program, trace.nbytes),
                                         program.iteration_starts[1] if program.iterations > 1 else None,
                                         settings=settings, host=host)
        events: Iterable[tuple[int, int, int]] = allocator_events(program, trace.nbytes)
        if len(program.events) >= REPLAY_PROGRESS_FROM:  # seconds of replay: a bar (stderr, a terminal)
            events = reported(REPLAYING, events, len(program.events))
        if program.iterations > 1:  # the first iteration's stats read off the same replay
            return allocator.replay_with_prefix(events, program.iteration_starts[1], settings=settings, host=host,
                                                streams=program.streams)
        stats = allocator.replay(events, settings=settings, host=host, streams=program.streams)
        return stats, stats
    except allocator.KeyStateError as exc:
        uid = program.storage(exc.key) if isinstance(exc.key, int) else -1
        if not 0 <= uid < trace.num_storages:
            raise InternalError(exc, stage="replaying the step") from exc
        if uid in trace.preexisting:
            category = trace.category[uid]
            kind = category.value.replace("_", " ") if category is not None else "tensors"
            raise InternalError(exc, stage=f"replaying pre-existing storage {uid} ({kind})") from exc
        raise InternalError(exc, op=trace.op[uid], module=trace.module[uid], phase=trace.phase[uid].value,
                            stage=f"replaying storage {uid}, made by") from exc


def _sizes_by_key(program: Program, nbytes: Sequence[int]) -> list[int]:
    """Each event key's bytes as a list indexed by the key (:func:`allocator.replay_keys`): the
    storages' bytes once per copy of the step the keys number (``key % num_storages``)."""
    n = program.num_storages
    copies = max(program.events, default=-1) // n + 1 if n else 0
    return list(nbytes[:n]) * copies


@dataclass(frozen=True)
class _Columns:
    """The trace as int64 arrays, made once per report: a long generation has millions of
    events and storages, read by several passes (the replay, the categories at the peak, the
    module rows, the peak's decode step)."""

    events: np.ndarray  # trace.events
    nbytes: np.ndarray  # trace.nbytes
    categories: list[Category]  # traced.categories
    trace: StepTrace
    traced: TracedStep

    @cached_property
    def steady(self) -> SteadyRun | None:
        """A long generation's written decode steps, checked (:func:`~memcalc.engine.steady_sums.applies`)
        once for the report's passes that may read a few of them instead of every event."""
        return steady_sums.applies(self.trace, self.categories, self.events, self.nbytes)

    @cached_property
    def codes(self) -> np.ndarray:
        """The categories' :func:`~memcalc.engine.timeline.category_codes`: made where a pass reads
        every event (a long generation's steady sums read a few steps' storages instead)."""
        return self.traced.category_codes()

    @classmethod
    def of(cls, traced: TracedStep, program: Program) -> _Columns:
        trace = traced.trace
        offset = program.iteration_starts[0]  # build_program: the pre-existing births, then trace.events as is
        events = program.keys[offset:offset + trace.num_events]
        # unwritten decode steps: not written
        return cls(events, trace.nbytes_array(), traced.categories, trace, traced)


@dataclass(frozen=True)
class Replayed:
    """A traced step's program and its replay through the allocator model: the stats of its first
    iteration and of the whole (:func:`replay_step`). A multi-GPU role's report and its
    communication buffers at the peak read the same replay (the allocator is deterministic)."""

    program: Program
    columns: _Columns
    first: allocator.AllocatorStats
    whole: allocator.AllocatorStats


def replay_step(traced: TracedStep, step: Step) -> Replayed:
    """``traced``'s program replayed under ``step``'s allocator settings and target, once."""
    program = _program_of(traced)
    columns = _Columns.of(traced, program)
    first, whole = _replayed(program, traced.trace, step.allocator_settings, not step.emulate_cuda,
                             nbytes=columns.nbytes, steady=columns.steady if program.iterations == 1 else None)
    return Replayed(program, columns, first, whole)


@collector_paused()
def build_report(resolved: ResolvedModel, traced: TracedStep, step: Step, *, role: str = "",
                 replayed: Replayed | None = None) -> MemoryReport:
    """The report of a traced step: replay through the allocator model, breakdown at the peak,
    textbook comparison, per-module rows and, under ``capacity``, whether it fits.

    Args:
        resolved: the model and its inputs.
        traced: the traced step (:func:`trace_model`).
        step: the step; under its ``capacity`` (the bytes the allocator may reserve; None:
            no limit, ``fits`` is None) it says whether the step fits.
        role: the GPU role this step is (multi-GPU strategies), carried into its timeline.
        replayed: the step's replay (:func:`replay_step`) where the caller made it already;
            None: replayed here.

    Returns:
        The report; ``report.timeline()`` replays the step again when it is first called.
    """
    trace = traced.trace
    mode = step.mode
    capacity = step.capacity
    settings = step.allocator_settings
    host = not step.emulate_cuda  # the CPU target: what the CPU allocator counts, unrounded
    if replayed is None:
        replayed = replay_step(traced, step)
    program, columns, first, stats = replayed.program, replayed.columns, replayed.first, replayed.whole
    peak_index = max(stats.peak_index, 0)
    raw = _totals_at_peak(traced, program, columns, peak_index)
    breakdown = ByteBreakdown(
        parameters=raw[Category.PARAMETERS], buffers=raw[Category.BUFFERS], inputs=raw[Category.INPUTS],
        gradients=raw[Category.GRADIENTS], optimizer_state=raw[Category.OPTIMIZER_STATE],
        activations=raw[Category.ACTIVATIONS], workspace=raw[Category.WORKSPACE], kv_cache=raw[Category.KV_CACHE],
        peak_allocated=stats.peak_allocated,
    )
    spec = step.optimizer
    module = resolved.module
    training = mode is Mode.TRAIN
    textbook = Textbook(
        parameter_bytes=_preexisting_bytes(trace, traced.categories, Category.PARAMETERS),
        multiplier=spec.textbook_multiplier if training else 1,
        terms=spec.textbook_terms if training else "weights",
        state_bytes=spec.textbook_state_bytes(module.parameters()) if training else 0,
        activation_bytes=_saved_for_backward(trace, traced.categories) if training else raw[Category.ACTIVATIONS],
        input_bytes=_preexisting_bytes(trace, traced.categories, Category.INPUTS),
        frozen_parameter_bytes=_frozen_parameter_bytes(module) if training else 0,
    )
    fits, reserved_within = _fit_under(program, trace, capacity, stats, settings, host=host, columns=columns)
    expandable = (_reserved_if_expandable(program, trace.nbytes, capacity, settings)
                  if fits is False and not host and capacity is not None and stats.peak_allocated <= capacity
                  else None)
    key = int(program.keys[peak_index]) if program.num_events else 0
    uid = program.storage(key) if key >= 0 else 0
    has_peak = stats.peak_allocated > 0
    generating = mode is Mode.GENERATE
    born = np.flatnonzero(columns.events == uid)[:1].tolist() if generating else []  # its first event: its birth
    peak_step = decode_step_at(trace, born[0]) if born else None
    notes = [*step.notes, *traced.notes]
    if stats.peak_reserved_by_stream:
        notes.append(_streams_note(stats))
    split = generation_peaks(trace, program, settings=settings, host=host) if training else None
    if (warning := step.precision_warning()) is not None:
        notes.append(warning)
        warnings.warn(warning, stacklevel=3)
    return MemoryReport(
        step=StepDescription(
            model=resolved.name,
            batch_size=resolved.batch_size,
            optimizer=spec.name,
            mode=mode,
            precision=step.precision,
            gpu=step.gpu,
            gpu_named=step.gpu_named,
            capacity=capacity,
            input_description=_cast_input_description(resolved, step),
            loss=traced.loss,
            accum_steps=step.accum_steps,
            checkpoint=bool(step.checkpoint),
            checkpointing=step.checkpoint.label,
            loop=step.loop.name,
            keep_grads=step.loop.keep_grads,
            optimizer_impl=traced.optimizer_impl,
            # the stack resolved at the API boundary (memcalc.targets.resolved_stack); no CUDA version on the CPU target
            torch_version=step.stack.torch or "",
            cuda_version=(step.stack.cuda or "") if step.emulate_cuda else "",
            alloc_conf=settings.describe() if settings is not None else "",
            alloc_conf_source=settings.source if settings is not None else "",
        ),
        parameters=parameter_count(module.parameters()),
        peak_phase=trace.column_at("phase", uid) if has_peak else Phase.SETUP,
        peak_module=trace.column_at("module", uid) if has_peak else "",
        bytes=breakdown,
        peak_iteration=program.iteration_of(peak_index),
        textbook=textbook,
        modules=_module_rows(module, traced, columns),
        first_iteration_peak=first.peak_allocated,
        peak_requested=stats.peak_requested,
        # under a capacity, the figure the allocator reaches within it (the one ``fits`` is
        # judged by), so that the reserved bytes shown never contradict ``fits``
        peak_reserved=stats.peak_reserved if reserved_within is None else reserved_within,
        peak_reserved_unconstrained=stats.peak_reserved,
        unsupported_ops=_approximated(traced),
        fits=fits,
        reserved_within_capacity=reserved_within,
        reserved_if_expandable=expandable,
        attention_backend=_main_backend(traced.attention),
        attention_calls=tuple(sorted(traced.attention.items())),
        paged_optimizer_state=traced.paged_optimizer_state,
        trainable_parameters=parameter_count(p for p in module.parameters() if p.requires_grad) if training else None,
        generation=Generation(
            new_tokens=step.new_tokens,
            peak_step=peak_step if has_peak else None,
            generation_peak=split[0] if split is not None else None,
            training_peak=split[1] if split is not None else None,
        ),
        notes=tuple(notes),
        on_request=OnRequest(
            # the codes, not the list: a list of a generation's millions of categories is walked
            # by Python's collector for as long as the report is kept (benchmarks/gc_walk.py)
            timeline=_TimelineBuilder(trace, program, CategoryColumn(traced.category_codes()), capacity, role,
                                      settings, host),
            costs=None if traced.costs is None else traced.costs.step_costs(
                resolved.inputs, batch_size=resolved.batch_size, micro_batches=step.accum_steps,
                module_order=traced.module_order,  # a loop traced whole: its first iteration
                until=traced.iteration_starts[0] if traced.iteration_starts else None),
        ),
    )


def _totals_at_peak(traced: TracedStep, program: Program, columns: _Columns, peak_index: int) -> dict[Category, int]:
    """Requested bytes per category alive just after the peak's event; in a long generation's
    written decode steps, read off a few steps' events (:mod:`memcalc.engine.steady_sums`)."""
    offset = program.iteration_starts[0]
    run = (columns.steady if program.iterations == 1 and program.num_events == offset + columns.events.size else None)
    if run is not None and peak_index >= offset + run.start + 3 * run.length:
        return steady_sums.totals_at(run, program.keys, offset, columns.nbytes, traced.categories, peak_index)
    return category_totals_at(program, columns.nbytes, traced.categories, peak_index, codes=columns.codes)


def _streams_note(stats: allocator.AllocatorStats) -> str:
    """What each stream's pools hold at the peak reserved of a step that allocates on several
    streams (FSDP2's collectives): the compute stream cannot reuse the others' cached blocks."""
    parts = ", ".join(f"{Stream(stream).label} {format_bytes(nbytes)}"
                      for stream, nbytes in stats.peak_reserved_by_stream)
    return (f"streams: the peak reserved with no limit, {format_bytes(stats.peak_reserved)}, is held in the pools of "
            f"{parts}; a block freed on one stream is cached for that stream's requests alone")


def _main_backend(attention: dict[str, int]) -> str | None:
    if not attention:
        return None
    return max(attention.items(), key=lambda item: item[1])[0]


def _fit_under(program: Program, trace: StepTrace, capacity: int | None, stats: allocator.AllocatorStats,
               settings: AllocConf | None = None, *, host: bool = False,
               columns: _Columns | None = None) -> tuple[bool | None, int | None]:
    """Whether the step runs within ``capacity`` reserved bytes, and the peak reserved when it
    does so under that limit (the allocator frees cached segments under pressure). A long
    generation's replay under the capacity skips its small pool's repeated decode steps, as the
    unlimited one does (:func:`~memcalc.engine.steady_replay.replay_generation`; ``columns``: the
    trace's arrays, where the caller has them)."""
    if capacity is None:
        return None, None
    gc = settings is not None and settings.garbage_collection_threshold > 0.0  # collects below the capacity
    if stats.peak_reserved <= capacity and not gc:
        return True, stats.peak_reserved  # never under pressure: the same replay
    limited = replay_generation(program, trace, settings, host, capacity=capacity,
                                nbytes=None if columns is None else columns.nbytes,
                                steady=None if columns is None or program.iterations != 1 else columns.steady)
    if limited is None:
        limited = allocator.replay(allocator_events(program, trace.nbytes), capacity=capacity, settings=settings,
                                   host=host, streams=program.streams)
    return limited.oom_at is None, limited.peak_reserved


def _reserved_if_expandable(program: Program, nbytes: list[int], capacity: int,
                            settings: AllocConf | None) -> int | None:
    """A step that does not fit for fragmentation alone (its peak allocated is under the capacity),
    replayed again with ``expandable_segments:True``: the peak reserved under the capacity when it
    then fits, -1 when it does not fit either; None when the settings already expand their segments.
    Expandable segments map pages into one growing segment, so the free space left between
    partly used segments, the cause of this OOM, mostly disappears; torchtitan launches with them."""
    if settings is not None and settings.expandable_segments:
        return None
    expanding = replace(settings or AllocConf(), expandable_segments=True)
    limited = allocator.replay(allocator_events(program, nbytes), capacity=capacity, settings=expanding,
                               streams=program.streams)
    return limited.peak_reserved if limited.oom_at is None else -1


def _preexisting_bytes(trace: StepTrace, categories: list[Category], category: Category) -> int:
    """Bytes of the storages that exist before the step in ``category`` (parameters, the
    input batch and its targets)."""
    return sum(trace.column_at("nbytes", u) for u in trace.preexisting if categories[u] is category)


def _frozen_parameter_bytes(module: nn.Module) -> int:
    """Bytes of the parameters that do not train (``requires_grad=False``), each storage once:
    the textbook counts them without gradient or optimizer state."""
    frozen = [p.untyped_storage() for p in module.parameters() if not p.requires_grad]  # alive: ids stay distinct
    return sum({id(storage): storage.nbytes() for storage in frozen}.values())


def _cast_input_description(resolved: ResolvedModel, step: Step) -> str:
    """The inputs as the step sees them: under pure fp16/bf16 the floating inputs are cast
    (:func:`~memcalc.engine.prepare.cast_inputs`, on meta: free), and the breakdown counts
    them in that dtype, so the header must name it too."""
    return replace(resolved, inputs=cast_inputs(resolved.inputs, step.precision)).input_description


def _saved_for_backward(trace: StepTrace, categories: list[Category]) -> int:
    """Activation bytes alive when backward starts (what autograd saved, plus the output)."""
    start = trace.phase_starts.get(Phase.BACKWARD, len(trace.events))
    alive = alive_before(trace, start)
    return sum(trace.nbytes[u] for u in alive if categories[u] is Category.ACTIVATIONS)


def _module_rows(module: nn.Module, traced: TracedStep, columns: _Columns) -> tuple[ModuleRow, ...]:
    """One row per submodule, at every depth (the table's depth is chosen when it is shown)."""
    subtree = (_kept_for_backward(traced) if traced.mode is Mode.TRAIN else _forward_high_water(traced, columns))
    rows: list[ModuleRow] = []
    named = dict(module.named_modules())
    for name in traced.module_order:
        if name not in named:
            continue
        sub = named[name]
        rows.append(ModuleRow(
            name=name, type=type(sub).__name__, depth=name.count(".") + 1,
            parameters=parameter_count(sub.parameters()),  # tied weights once per subtree
            output_shape=traced.output_shapes.get(name, ()), activation_bytes=subtree.get(name, 0),
        ))
    return tuple(rows)


def _forward_activations(traced: TracedStep) -> list[int]:
    """The storages a module row may count: activations born in the forward. Workspaces (the
    cuBLAS handle's, a conv's) are born there too but are not what a module keeps."""
    uids: list[int] = np.flatnonzero(_forward_activation_mask(traced)).tolist()  # Python ints, at C speed
    return uids


def _forward_activation_mask(traced: TracedStep, codes: np.ndarray | None = None) -> np.ndarray:
    """:func:`_forward_activations` as a mask over the storages (a long generation: millions);
    ``codes``: the categories' :func:`~memcalc.engine.timeline.category_codes`, when made."""
    trace = traced.trace
    counted = {p: p.runs_forward and p is not Phase.LOSS for p in Phase}
    # map with C-level look-ups: a long generation has millions of storages
    born = np.fromiter(map(counted.__getitem__, trace.phase), dtype=bool, count=len(trace.phase))
    codes = category_codes(traced.categories) if codes is None else codes
    mask: np.ndarray = born & (codes == list(Category).index(Category.ACTIVATIONS))
    return mask


def _kept_for_backward(traced: TracedStep) -> dict[str, int]:
    """Module → activation bytes born in its forward (its submodules included) still alive when
    the forward ended: what its backward keeps."""
    trace = traced.trace
    kept = alive_before(trace, trace.phase_starts.get(Phase.LOSS, len(trace.events)))
    subtree: dict[str, int] = {}
    for uid in _forward_activations(traced):
        if uid in kept:
            for ancestor in _self_and_ancestors(trace.module[uid]):
                subtree[ancestor] = subtree.get(ancestor, 0) + trace.nbytes[uid]
    return subtree


def _forward_high_water(traced: TracedStep, columns: _Columns) -> dict[str, int]:
    """Module → the most activation bytes born in its forward (its submodules included) alive at
    one moment. Without autograd each activation dies soon after its consumer runs, so the sum
    of everything a module allocated (mistral-7b, inference, 4,096 tokens: 44.48 GiB beside a
    13.93 GiB peak) is not memory that was ever resident; this is, and no row can exceed the peak.

    Per module, the running sum of its subtree's births and deaths in event order, highest just
    after a birth (a generation of thousands of tokens has millions of events: numpy, exact in int64).
    """
    trace = traced.trace
    run = columns.steady
    events = columns.events
    if run is None:  # every event read
        counted = _forward_activation_mask(traced, columns.codes)
        uids = np.where(events >= 0, events, ~events)
        keep = counted[uids]
        events, uids = events[keep], uids[keep]
        births = events >= 0
        delta = columns.nbytes[uids]
        ids: dict[str, int] = {name: i for i, name in enumerate(dict.fromkeys(trace.module))}
        # int16 where the modules fit: numpy's stable sort of 16-bit keys is a radix sort (2.9M events: 5x faster)
        narrow = np.int16 if len(ids) < np.iinfo(np.int16).max else np.int64
        module_of = np.fromiter(map(ids.__getitem__, trace.module), dtype=narrow, count=trace.num_storages)[uids]
    else:  # a long generation: the prefix, its first and last written steps, their net bytes between
        at, weights, read = steady_sums.stream(run, events.size)
        events = events[at]
        uids = np.where(events >= 0, events, ~events)
        unique, inverse = np.unique(uids, return_inverse=True)
        listed = unique.tolist()
        activation = Category.ACTIVATIONS
        phases = [trace.column_at("phase", u) for u in listed]  # a few steps' storages: none written out
        counted = np.fromiter((phase.runs_forward and phase is not Phase.LOSS and traced.categories[u] is activation
                               for phase, u in zip(phases, listed, strict=True)), dtype=bool, count=len(listed))
        keep = counted[inverse]
        events, uids, weights, read, inverse = events[keep], uids[keep], weights[keep], read[keep], inverse[keep]
        births = (events >= 0) & read
        delta = columns.nbytes[uids] * weights
        modules = [trace.column_at("module", u) for u in listed]
        ids = {name: i for i, name in enumerate(dict.fromkeys(modules))}
        narrow = np.int16 if len(ids) < np.iinfo(np.int16).max else np.int64
        module_of = np.fromiter((ids[module] for module in modules), dtype=narrow, count=len(listed))[inverse]
    delta[events < 0] *= -1
    # each module's events, in event order: a subtree's are its members' merged (events x depth in all)
    order = np.argsort(module_of, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(module_of, minlength=len(ids)))])
    names = list(ids)
    subtrees: dict[str, list[int]] = {}
    for index in np.flatnonzero(np.diff(bounds)).tolist():
        for ancestor in _self_and_ancestors(names[index]):
            subtrees.setdefault(ancestor, []).append(index)
    high: dict[str, int] = {}
    for ancestor, members in subtrees.items():
        if len(members) > 1 and 8 * sum(int(bounds[m + 1] - bounds[m]) for m in members) > len(module_of):
            # most events (the root, the layers' list): picked in order, not merged and sorted
            table = np.zeros(len(ids), dtype=bool)
            table[members] = True
            at = np.flatnonzero(table[module_of])
        else:
            at = np.concatenate([order[bounds[m]:bounds[m + 1]] for m in members])
            if len(members) > 1:
                at.sort()
        sums = np.cumsum(delta[at])[births[at]]
        if sums.size and (most := int(sums.max())) > 0:
            high[ancestor] = most
    return high


def _self_and_ancestors(name: str) -> list[str]:
    """``"a.b.c"`` → ``["a.b.c", "a.b", "a"]`` (a name with no dot: itself)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


#: Ops whose memory inside the kernel memcalc approximates, counted by name where the backend's
#: rules do not decide per call (StepBackend.approximated_ops): CUDA's cuDNN workspace is a model;
#: a step traced with no device's rules follows no convolution.
_APPROXIMATED = {"convolution.default", "convolution_backward.default"}


def _copied(counts: Mapping[str, int] | None) -> dict[str, int] | None:
    """A backend's running count as it is now (RunCounts keeps one per decode step)."""
    return None if counts is None else dict(counts)


def _approximated(traced: TracedStep) -> tuple[tuple[str, int], ...]:
    """The report's approximated ops with their calls: the backend's own count where it keeps one
    (the CPU target: the convolutions oneDNN or float32's backends run, not the Slow2d ones it
    follows nor those its notes name), else every call of :data:`_APPROXIMATED`."""
    counts = traced.approximated
    if counts is None:
        counts = {op: n for op, n in traced.trace.op_counts.items() if op in _APPROXIMATED}
    return tuple((op, n) for op, n in sorted(counts.items()) if n)

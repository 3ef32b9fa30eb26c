"""Pipeline parallelism: every pipeline rank's peak under a schedule of
``torch.distributed.pipelining``, estimated by running torch's own ``PipelineStage`` and
schedule class on the meta model.

For each pipeline rank, memcalc

1. splits the model into stages (:mod:`memcalc.distributed.pipeline_split`: even blocks per
   stage, or the user's split points; the first stage holds the embedding, the last the final
   norm, the head and the loss), and gives the rank its stages (one; two or more for the
   interleaved and V schedules, placed as torch places them);
2. wraps them in torch's real ``PipelineStage`` and the real schedule class, over a fake
   process group of ``stages`` ranks in which this process is the rank (sends and receives
   do nothing; every buffer torch allocates for them is real);
3. traces one optimizer step of that rank through memcalc's engine: ``schedule.step()``
   forwards and backwards every microbatch in the schedule's order (gradients accumulate
   across microbatches), ``scale_grads`` divides them, then the optimizer steps.

What the trace holds, because torch's code allocates it: per microbatch the received
activation buffers (non-first stages) and gradient buffers (non-last stages), kept by the
stage for its life; the stage's output and inputs cached from each forward to its backward;
the gradient of each received activation, which stays on the buffer's ``.grad`` until the next
``step()`` clears it; the last stage's per-microbatch losses. The step starts as a steady-state
step does: the previous step's input gradients are there and are released by ``step()``.

Assumptions, stated in every report: balanced microbatches (the batch divides by
``microbatches``); the schedule's compute order with sends and receives completing at once (no
buffer waits for a slow peer); ``return_outputs=False`` (torchtitan's call: the last stage keeps
no outputs for the caller); torch's metadata inference of the first step (a dry forward and
backward) is not part of the steady-state step estimated.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from memcalc.core.categories import Category, Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.losses import LossChoice
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport, RoleReport, busiest_role
from memcalc.distributed.pipeline_compose import CallRecorder, composed_step
from memcalc.distributed.pipeline_schedules import (
    Action,
    Call,
    PipelineSchedule,
    in_flight,
    rank_actions,
    schedule_calls,
    stage_of_rank,
)
from memcalc.distributed.pipeline_share import renamed_step, share_key
from memcalc.distributed.pipeline_split import ModelLayout, StageModule, block_containers_of, layout_of, stage_blocks
from memcalc.distributed.program import RankProgram, model_states_at_step
from memcalc.engine.losses import compute_loss, make_targets, resolve_loss
from memcalc.engine.model import Checkpointer, CheckpointFn, ModelInputs, ResolvedModel
from memcalc.engine.run import CostRecorderFactory, TracedStep, build_report
from memcalc.engine.step_spec import Step
from memcalc.engine.trace import StorageTracer
from memcalc.stacks.peft import apply_finetune, step_precision
from memcalc.targets.backend import trace_step
from memcalc.targets.grouped_mm import grouped_mm_on_meta

__all__ = ("InnerParallel", "Pipeline", "PipelineEstimate", "PipelineOverCapacity", "RankEstimate", "estimate_pipeline",
           "stage_mesh", "stop_at_unfit_rank", "trace_order")


class InnerParallel(Protocol):
    """A dimension inside every stage that changes the stage's module and shapes (tensor
    parallelism, :class:`memcalc.distributed.tp_stages.StageTensorParallel`): ``degree`` ranks per
    pipeline rank, innermost of the fake group's ``(pp, tp)`` mesh (:func:`stage_mesh`)."""

    @property
    def degree(self) -> int: ...

    def resolve(self, model: nn.Module, inputs: ModelInputs, name: str) -> None:
        """Learn its plan on the whole model, at one microbatch."""

    def applied(self, module: nn.Module, prefix: str) -> AbstractContextManager[None]:
        """``module`` (modules named as the model's under ``prefix``) as a rank runs it, for a dry run."""

    def program(self, stage: ResolvedModel) -> RankProgram:
        """The program of one stage's module."""


@dataclass(frozen=True)
class Pipeline:
    """The pipeline dimension of a mesh: ``Pipeline(stages=4, schedule="1f1b", microbatches=8)``.

    Attributes:
        stages: pipeline ranks (torchtitan's ``pp`` degree).
        schedule: a :class:`PipelineSchedule` or its name (torchtitan's, or torch's class name).
        microbatches: microbatches per step (None: as many as ``stages``); the rank's batch is
            split into this many along dimension 0.
        split_points: the block each stage after the first begins with (``("layers.4",
            "layers.8")``), torch's ``SplitPoint.BEGINNING`` convention; None: even blocks.
        stages_per_rank: stages a rank holds (None: 1 for GPipe and 1F1B, 2 for the
            interleaved and V schedules).
    """

    stages: int
    schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B
    microbatches: int | None = None
    split_points: tuple[str, ...] | None = None
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 2:
            raise InvalidInputError(f"pipeline stages (pp) must be an integer >= 2, got {self.stages!r}",
                                    hint="pp=1 is no pipeline: leave it out.")
        schedule = PipelineSchedule.parse(self.schedule)
        object.__setattr__(self, "schedule", schedule)
        microbatches = self.stages if self.microbatches is None else self.microbatches
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise InvalidInputError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        object.__setattr__(self, "microbatches", microbatches)
        per_rank = (1 if schedule.single_stage else 2) if self.stages_per_rank is None else self.stages_per_rank
        if not isinstance(per_rank, int) or per_rank < 1:
            raise InvalidInputError(f"stages_per_rank must be a positive integer, got {self.stages_per_rank!r}")
        if schedule.single_stage and per_rank != 1:
            raise InvalidInputError(f"the {schedule.value} schedule runs one stage per rank, not {per_rank}",
                                    hint="Use interleaved-1f1b, looped-bfs or a zero-bubble schedule for more.")
        if not schedule.single_stage and per_rank < 2:
            raise InvalidInputError(f"the {schedule.value} schedule runs two or more stages per rank")
        if schedule.v_shaped and per_rank != 2:
            raise InvalidInputError(f"the {schedule.value} schedule runs exactly two stages per rank (a V)")
        object.__setattr__(self, "stages_per_rank", per_rank)
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))

    @property
    def schedule_kind(self) -> PipelineSchedule:
        """The schedule, as the enum (``schedule`` after validation)."""
        assert isinstance(self.schedule, PipelineSchedule)
        return self.schedule

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step (``microbatches`` after validation)."""
        assert self.microbatches is not None
        return self.microbatches

    @property
    def per_rank(self) -> int:
        """Stages per rank (``stages_per_rank`` after validation)."""
        assert self.stages_per_rank is not None
        return self.stages_per_rank

    @property
    def total_stages(self) -> int:
        """Stages the model is split into."""
        return self.stages * self.per_rank

    def actions(self) -> dict[int, list[Action]]:
        """Each rank's compute actions in the installed torch's order."""
        return rank_actions(self.schedule_kind, self.stages, self.num_microbatches, self.per_rank)

    def describe(self) -> str:
        """``1f1b, 2 stages, 4 microbatches`` (and the stages per rank when more than one)."""
        per = f", {self.per_rank} stages per rank" if self.per_rank > 1 else ""
        return f"{self.schedule_kind.value}, {self.stages} pipeline ranks{per}, {self.num_microbatches} microbatches"


@dataclass(frozen=True)
class RankEstimate:
    """One pipeline rank: its stages, their blocks, the microbatches each keeps in flight at
    most, and its full report (the busiest moment of its step)."""

    rank: int
    stages: tuple[int, ...]
    blocks: tuple[tuple[str, ...], ...]
    in_flight: tuple[int, ...]
    report: MemoryReport
    #: parameters + gradients + optimizer state alive during the optimizer step.
    model_states: int = 0
    #: the stage's receive buffers (activations and gradients, one per microbatch), held for its life.
    communication: int = 0

    @property
    def name(self) -> str:
        """``pipeline rank 0: stage 0 (blocks.0..blocks.1)``."""
        held = ", ".join(f"stage {s} ({b[0]}..{b[-1]})" for s, b in zip(self.stages, self.blocks, strict=True))
        return f"pipeline rank {self.rank}: {held}"

    def role(self) -> RoleReport:
        """This rank as a GPU role of a multi-GPU report."""
        return RoleReport(name=self.name, ranks=(self.rank,), batch_size=self.report.batch_size,
                          model_states=self.model_states, communication=self.communication, report=self.report)

    @property
    def peak(self) -> int:
        """Peak allocated bytes (the allocator model's; on the CPU target, unrounded)."""
        return self.report.bytes.peak_allocated

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"rank": self.rank, "stages": list(self.stages), "blocks": [list(b) for b in self.blocks],
                "in_flight": list(self.in_flight), "peak_allocated": self.peak,
                "peak_requested": self.report.peak_requested, "report": self.report.to_dict()}


@dataclass(frozen=True)
class PipelineEstimate:
    """Every pipeline rank's estimate, and which is the busiest."""

    pipeline: Pipeline
    ranks: tuple[RankEstimate, ...]
    assumptions: tuple[str, ...] = field(default=())

    @property
    def busiest(self) -> RankEstimate:
        """The rank with the highest peak (the first of equals)."""
        return max(self.ranks, key=lambda r: (r.peak, -r.rank))

    def as_report(self) -> MemoryReport:
        """The multi-GPU report, as the other strategies make it: the busiest rank's report,
        every pipeline rank a role."""
        roles = tuple(r.role() for r in self.ranks)
        busiest = busiest_role(roles)
        assert busiest is not None
        return replace(busiest.report, distribution=replace(
            busiest.report.distribution, strategy="pp", world_size=self.pipeline.stages,
            global_batch_size=self.ranks[0].report.batch_size, roles=roles))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"schedule": self.pipeline.schedule_kind.value, "stages": self.pipeline.stages,
                "stages_per_rank": self.pipeline.per_rank, "microbatches": self.pipeline.num_microbatches,
                "busiest_rank": self.busiest.rank, "ranks": [r.to_dict() for r in self.ranks],
                "assumptions": list(self.assumptions)}


ASSUMPTIONS = (
    "pipeline: torch.distributed.pipelining's PipelineStage and schedule run on meta over a fake process group",
    "pipeline: microbatches of equal size; sends and receives complete at once (no buffer waits on a peer)",
    "pipeline: step(..., return_outputs=False), as torchtitan calls it; gradients scaled by the microbatch count",
    "pipeline: the steady-state step (the first step's metadata inference is not estimated)",
)


#: The first torch whose pipelining internals memcalc drives (torch 2.11's differ: no shape vote,
#: another ``_initialize_stage`` signature).
_PIPELINING_FROM = (2, 13)


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


class PipelineOverCapacity(Exception):  # a search's answer, not an error (no MemcalcError)
    """A pipeline rank that does not fit its GPU, found before the other ranks were traced
    (:func:`stop_at_unfit_rank`): the whole pipeline does not fit, as its report would say."""

    def __init__(self, rank: int, peak_allocated: int) -> None:
        super().__init__(f"pipeline rank {rank} does not fit ({peak_allocated} bytes allocated at its peak)")
        self.rank = rank
        self.peak_allocated = peak_allocated  # that rank's: a lower bound of the pipeline's busiest


_STOP_UNFIT: ContextVar[bool] = ContextVar("memcalc_pipeline_stop_unfit", default=False)


@contextlib.contextmanager
def stop_at_unfit_rank() -> Iterator[None]:
    """Inside it, :func:`estimate_pipeline` stops at the first rank that does not fit its GPU
    (its report's ``fits`` is False, the criterion by which the whole pipeline's report does not
    fit: its busiest role is one that does not fit) and raises :class:`PipelineOverCapacity`.
    ``memcalc plan`` enters it: it needs only "does not fit" of such a configuration, and a
    pipeline's ranks are its costliest traces (the run it sits in passes no option down to a
    strategy, hence a context, not an argument)."""
    token = _STOP_UNFIT.set(True)
    try:
        yield
    finally:
        _STOP_UNFIT.reset(token)


def trace_order(stages: int, stop_unfit: bool) -> list[int]:
    """The order the ranks are traced in: in rank order, or, to stop at an unfit rank early,
    the likely busiest first: rank 0 (the most microbatches in flight, the embedding), the last
    rank (the head and the loss), then the rest in rank order. The reports do not depend on it
    (a rank sharing a trace gets its source's renamed: :mod:`pipeline_share`)."""
    if not stop_unfit or stages < 2:
        return list(range(stages))
    return [0, stages - 1, *range(1, stages - 1)]


def estimate_pipeline(step: Step, pipeline: Pipeline, *, costs: CostRecorderFactory | None = None,
                      stage_program: Callable[[ResolvedModel], RankProgram] | None = None,
                      trace_precision: Precision | None = None, inner: InnerParallel | None = None,
                      stop_unfit: bool | None = None) -> PipelineEstimate:
    """Estimate every pipeline rank of ``step`` under ``pipeline``.

    ``step`` is one pipeline replica's step: its batch is what the first stage is fed per
    optimizer step, split into ``pipeline.microbatches``. ``stage_program``: the program that
    wraps each stage's module (given as a model whose ``module`` is the stage and whose
    ``block_containers`` are its blocks'), as torchtitan ``fully_shard``-s every stage over the
    dp_shard sub-mesh; its ``reduce_accumulated()`` runs where torch's
    ``PipelineStage.perform_reduce_grad`` syncs an FSDP stage. ``trace_precision``: the precision the
    stages trace at under that program (FSDP2's mixed precision runs without autocast).
    ``inner``: tensor parallelism inside each stage (its plan resolved on the whole model, the
    layout's shapes from a dry run of the parallelized model, so that a stage sends what a real
    rank sends); ``stage_program`` then includes its program. ``stop_unfit``: trace the likely
    busiest ranks first (:func:`trace_order`) and stop at the first that does not fit (None: as
    :func:`stop_at_unfit_rank` says).

    Raises:
        PipelineOverCapacity: under ``stop_unfit``, a rank that does not fit.
        InvalidInputError: a batch that does not divide into the microbatches; a split the
            model cannot take; a schedule torch refuses for these numbers.
        InapplicableOptionError: not a training step, or a process group is already
            initialised in this process (memcalc needs its own fake one).
    """
    if _torch_release() < _PIPELINING_FROM:
        raise InapplicableOptionError(
            f"pipeline parallelism is estimated with torch.distributed.pipelining as torch "
            f"{_PIPELINING_FROM[0]}.{_PIPELINING_FROM[1]} runs it (its stages' shape vote and schedule "
            f"set-up); the installed torch {torch.__version__} has an older PipelineStage",
            hint="Install torch>=2.13 to estimate --mesh pp=N.")
    if not step.mode.value == "train":
        raise InapplicableOptionError(f"pipeline parallelism is estimated for training steps; the mode is "
                                      f"{step.mode.value}")
    if step.accum_steps != 1:
        raise InapplicableOptionError("a pipeline step accumulates over its microbatches; accum_steps would be "
                                      "a second accumulation", hint="Give the microbatches to the pipeline instead.")
    split_backward = (PipelineSchedule.INTERLEAVED_ZERO_BUBBLE, PipelineSchedule.ZBV_ZERO_BUBBLE,
                      PipelineSchedule.DUAL_PIPE_V)
    if step.checkpoint and pipeline.schedule_kind in split_backward:
        # torch's split backward (inputs' gradients first, weights' later) unpacks a checkpointed
        # block's saved tensors twice; memcalc's trace of it fails in torch's checkpoint
        raise InapplicableOptionError(
            f"activation checkpointing under the {pipeline.schedule_kind.value} schedule (a backward split into "
            f"input and weight gradients) is not modelled",
            hint="Use gpipe, 1f1b or interleaved-1f1b with --checkpoint, or leave checkpointing out.")
    m = pipeline.num_microbatches
    actions = pipeline.actions()
    probe = step.resolved()
    if probe.batch_size % m:
        raise InvalidInputError(f"the batch of {probe.batch_size} does not split into {m} equal microbatches",
                                hint="Make the batch a multiple of the microbatches.")
    micro = step.resolved(batch_size=probe.batch_size // m)
    if trace_precision is not None and step.precision.is_amp and not trace_precision.is_amp:
        # FSDP2's mixed precision: the stages compute in param_dtype without autocast, so what a
        # stage sends (and a later stage's stand-ins of the model's inputs) is in that dtype; its
        # buffers stay as they are (fully_shard casts parameters only)
        low = step.precision.compute_dtype
        for param in micro.module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(low)
    containers = block_containers_of(micro.module, micro.block_containers)
    if inner is None:
        layout = layout_of(micro.module, micro.inputs, containers, micro.name)
    else:
        inner.resolve(micro.module, micro.inputs, micro.name)
        with _fake_group(0, pipeline.stages, inner.degree), inner.applied(micro.module, ""):
            layout = layout_of(micro.module, micro.inputs, containers, micro.name)
    blocks = stage_blocks(layout.blocks, pipeline.total_stages, pipeline.split_points)
    placement = stage_of_rank(pipeline.schedule_kind, pipeline.stages, pipeline.per_rank)
    # one model for every rank: each cuts a deep copy of the blocks it holds (StageModule)
    whole = apply_finetune(probe, step.finetune, precision=step.precision, mode=step.mode,
                           checkpoint=bool(step.checkpoint))
    ranks = []
    sources: dict[Hashable, _TracedRank] = {}  # the first rank traced of each key (pipeline_share)
    stopping = _STOP_UNFIT.get() if stop_unfit is None else stop_unfit
    composing = pipeline.schedule_kind in _COMPOSED
    for rank in trace_order(pipeline.stages, stopping):
        stages = placement[rank]
        held = tuple(blocks[s] for s in stages)
        # composing: the same calls in any order (pipeline_compose); else the same order (pipeline_share)
        mine = sorted(actions[rank], key=lambda a: (a.stage, a.kind, a.microbatch)) if composing else actions[rank]
        key = share_key(whole.module, layout.blocks, stages, blocks, pipeline.total_stages, mine, step.checkpoint)
        source = sources.get(key) if key is not None else None
        if composing and key is not None and source is None:
            _, source = _estimate_rank(step, whole, pipeline, rank, stages, blocks, layout, micro.inputs, costs,
                                       stage_program, trace_precision, inner, compose=True)
            sources[key] = source
        shared = None
        if source is not None and source.recorder is not None:
            calls = _schedule_calls(pipeline, rank)
            composed = None if calls is None else composed_step(source.traced, source.recorder, calls, stages)
            shared = None if composed is None else renamed_step(composed, source.blocks, held, layout.blocks)
            whose = "its own stages'" if source.rank == rank else f"pipeline rank {source.rank}'s stages'"
            how = (f"pipeline rank {rank}: its step composed from {whose} calls (traced once, the schedule holding "
                   f"nothing), in the order its schedule makes them")
        elif source is not None:
            shared = renamed_step(source.traced, source.blocks, held, layout.blocks)
            how = (f"pipeline rank {rank}: the step of pipeline rank {source.rank} (the same actions on stages of "
                   f"identical blocks), its trace shared with the modules renamed")
        if source is not None and shared is not None:
            rank_model, _ = _rank_model(step, whole, pipeline, rank, stages, blocks, layout, micro.inputs)
            # the notes the model gave the trace: this rank's, not the source's
            shared.notes[:] = [rank_model.notes[-1] if n == source.note else n for n in shared.notes]
            shared.notes.append(how)
            report = build_report(rank_model, shared, source.rank_step, role=f"pipeline rank {rank}")
            states, buffers = source.states, source.buffers
        else:
            report_or_none, traced_rank = _estimate_rank(step, whole, pipeline, rank, stages, blocks, layout,
                                                         micro.inputs, costs, stage_program, trace_precision, inner)
            assert report_or_none is not None
            report = report_or_none
            states, buffers = traced_rank.states, traced_rank.buffers
            if key is not None and not composing:
                sources.setdefault(key, traced_rank)
        flight = in_flight(actions[rank])
        ranks.append(RankEstimate(rank, stages, held, tuple(flight.get(s, 0) for s in stages), report, states,
                                  buffers))
        if stopping and report.fits is False:
            raise PipelineOverCapacity(rank, report.bytes.peak_allocated)
    return PipelineEstimate(pipeline, tuple(sorted(ranks, key=lambda r: r.rank)), ASSUMPTIONS)


#: The schedules whose middle ranks are composed from one's calls (:mod:`pipeline_compose`); the
#: others' share a trace where they run the same actions in the same order (:mod:`pipeline_share`).
_COMPOSED = frozenset({PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B})


def _schedule_calls(pipeline: Pipeline, rank: int) -> tuple[Call, ...] | None:
    """:func:`schedule_calls` of ``rank``; None where the installed torch's schedule code asks its
    logging stages for something they lack (the rank is then traced)."""
    try:
        return schedule_calls(pipeline.schedule_kind, rank, pipeline.stages, pipeline.num_microbatches,
                              pipeline.per_rank)
    except (AttributeError, TypeError, KeyError, ValueError, AssertionError):
        return None


@dataclass(frozen=True)
class _TracedRank:
    """A traced pipeline rank, kept for the ranks that share its trace (:mod:`pipeline_share`)."""

    rank: int
    blocks: tuple[tuple[str, ...], ...]  # of each stage it holds
    note: str  # what its model said of it (its rank and stages), which the trace's notes carry
    traced: TracedStep
    rank_step: Step
    states: int
    buffers: int
    #: traced to be composed (pipeline_compose): its calls, the schedule holding nothing
    recorder: CallRecorder | None = None


def _rank_model(step: Step, resolved: ResolvedModel, pipeline: Pipeline, rank: int, stages: Sequence[int],
                blocks: Sequence[tuple[str, ...]], layout: ModelLayout,
                micro_inputs: ModelInputs) -> tuple[ResolvedModel, list[StageModule]]:
    """The model one pipeline rank traces: its runner (its stages' modules cut from ``resolved``)."""
    total = pipeline.total_stages
    modules = [StageModule(resolved.module, layout, blocks[s], first=s == 0, last=s == total - 1,
                           inputs=micro_inputs) for s in stages]
    loss = step.loss if step.loss is not None else resolved.loss
    runner = _RankRunner(modules, stages, pipeline, loss)
    first = 0 in stages
    containers = tuple(f"stages.{i}.model.{c}" for i in range(len(modules)) for c in layout.containers)
    held = " + ".join(f"stage {s} ({blocks[s][0]}..{blocks[s][-1]})" for s in stages)
    rank_model = ResolvedModel(
        name=f"{resolved.name} pipeline rank {rank}", module=runner,
        inputs=resolved.inputs if first else ModelInputs(()), loss=LossChoice.AUTO,
        build_real=resolved.build_real, block_containers=containers,
        checkpointing=(None if resolved.checkpointing is None
                       else _stages_checkpointing(resolved.checkpointing, layout.blocks)),
        reads=resolved.reads,
        notes=(*resolved.notes, f"pipeline rank {rank} of {pipeline.stages}: {held}; {pipeline.describe()}"))
    return rank_model, modules


def _estimate_rank(step: Step, resolved: ResolvedModel, pipeline: Pipeline, rank: int, stages: Sequence[int],
                   blocks: Sequence[tuple[str, ...]], layout: ModelLayout, micro_inputs: ModelInputs,
                   costs: CostRecorderFactory | None,
                   stage_program: Callable[[ResolvedModel], RankProgram] | None = None,
                   trace_precision: Precision | None = None,
                   inner: InnerParallel | None = None, *,
                   compose: bool = False) -> tuple[MemoryReport | None, _TracedRank]:
    """Trace one rank; its report (None under ``compose``: its step, traced with its calls
    recorded and the schedule holding nothing, is only the source of composed ones)."""
    rank_model, modules = _rank_model(step, resolved, pipeline, rank, stages, blocks, layout, micro_inputs)
    runner = rank_model.module
    assert isinstance(runner, _RankRunner)
    precision = step.precision if trace_precision is None else trace_precision
    rank_step = replace(step, loss=None, loss_fn=_RankRunner.done, accum_steps=1,
                        precision=step_precision(resolved, step.finetune, precision, step.mode))
    wrapped = [] if stage_program is None else [
        stage_program(replace(rank_model, module=m, block_containers=tuple(f"model.{c}" for c in layout.containers)))
        for m in modules]
    if wrapped:  # tensor parallelism's optimizer steps the local shards of every stage's DTensors
        rank_step = replace(rank_step, optimizer=wrapped[0].optimizer_spec(rank_step.optimizer))
    program = _PipelineProgram(runner, rank, layout, micro_inputs, wrapped, inner, compose=compose)
    with _fake_group(rank, pipeline.stages, 1 if inner is None else inner.degree):
        traced = trace_step(rank_model, rank_step, hooks=program, costs=costs)
    traced.notes.extend(ASSUMPTIONS)
    for stage_wrap in wrapped:
        traced.notes.extend(stage_wrap.notes)
    report = None if compose else build_report(rank_model, traced, rank_step, role=f"pipeline rank {rank}")
    buffers = sum(traced.trace.nbytes[uid] for uid in program.buffers)
    collective = set().union(*(w.communication for w in wrapped))
    states = model_states_at_step(traced, collective)
    held = tuple(blocks[s] for s in stages)
    return report, _TracedRank(rank, held, rank_model.notes[-1], traced, rank_step, states, buffers,
                               program.recorder)


def _stages_checkpointing(own: Checkpointer, blocks: Sequence[str]) -> Checkpointer:
    """The model's own checkpointing (a Hugging Face model's: its layers drop the ``DynamicCache``
    the model makes in training, ``config.use_cache`` off) applied to every stage's cut model, as
    a real run turns it on before the model is split. Wrapping the stage's blocks from outside
    instead lets each checkpointed layer write its keys and values into that cache, and write them
    again when backward recomputes it: the recomputed attention then sees twice the keys and
    slices them (``key[:, :, :q_length]``), an op the forward never ran, which torch's selective
    checkpointing refuses (its cache has no entry for it). A block's index (every Nth) is its
    index in the whole model (``blocks``), as on one GPU."""

    def apply(runner: nn.Module, function: CheckpointFn, chosen: Callable[[int], bool]) -> int:
        assert isinstance(runner, _RankRunner)
        total = 0
        for stage in runner.stages:
            assert isinstance(stage, StageModule)
            offset = list(blocks).index(stage.block_names[0])

            def shifted(index: int, offset: int = offset) -> bool:
                return chosen(offset + index)

            total += own(stage.model, function, shifted)
        return total

    return apply


class _RankRunner(nn.Module):
    """What one pipeline rank runs in a step, as a module the engine can trace: its forward is
    torch's ``schedule.step()`` (every microbatch's forward and backward, in the schedule's
    order), and returns a scalar standing for the finished step, which the engine's loss
    passes through (:meth:`done`) and whose backward computes nothing."""

    def __init__(self, stage_modules: Sequence[StageModule], stage_ids: Sequence[int], pipeline: Pipeline,
                 loss: Any) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stage_modules)
        self.stage_ids = tuple(stage_ids)
        self.pipeline = pipeline
        self.loss_choice = loss
        self.schedule: Any = None
        self.target: torch.Tensor | None = None
        self.first = 0 in stage_ids

    def loss_fn(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one microbatch, as memcalc computes the chosen loss."""
        kind = resolve_loss(self.loss_choice, output)
        targets = make_targets(kind, output) if target.numel() == 0 else (target,)
        return compute_loss(kind, output, targets)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.schedule is not None, "_PipelineProgram.install() builds the schedule"
        device = next(self.parameters()).device
        self.schedule.step(*args, target=self.target, return_outputs=False, **kwargs)
        return torch.zeros((), device=device, requires_grad=True)

    @staticmethod
    def done(output: torch.Tensor) -> torch.Tensor:
        """The engine's loss of the step: the scalar :meth:`forward` returned."""
        return output


class _PipelineProgram:
    """The rank's hooks on the engine's trace (:class:`memcalc.engine.run.RankHooks`): builds
    torch's ``PipelineStage`` objects and schedule before the step (their shapes given, torch's
    static mode: no vote, no metadata inference), runs the schedule's initialisation (it
    allocates the receive buffers) and registers what a steady-state step finds: those buffers,
    the previous step's gradients of the received activations, the last stage's targets."""

    def __init__(self, runner: _RankRunner, rank: int, layout: ModelLayout, micro_inputs: ModelInputs,
                 wrapped: Sequence[RankProgram] = (), inner: InnerParallel | None = None, *,
                 compose: bool = False) -> None:
        self.runner = runner
        self.compose = compose
        self.recorder: CallRecorder | None = None  # under compose: the stages' calls (pipeline_compose)
        self.inner = inner
        self.wrapped = tuple(wrapped)  # each stage's data-parallel program (FSDP2), by stage
        self.rank = rank
        self.layout = layout
        self.micro_inputs = micro_inputs
        self._undo: Callable[[], None] | None = None
        self.buffers: list[int] = []  # uids of the stage's receive buffers

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import stage as stage_source

        # torch 2.13's stages vote on static or dynamic shapes in a warm-up exchange; an older
        # torch (2.11) has no vote: its stages take the example shapes given them as they are
        inference_mode = getattr(stage_source, "InferenceMode", None)

        runner = self.runner
        pipeline = runner.pipeline
        m = pipeline.num_microbatches
        device = next(runner.parameters()).device
        stages = []
        outputs: dict[int, Any] = {}
        inner = self.inner
        # under tensor parallelism the stages talk over the pp sub-mesh's group (torchtitan's)
        group = None if inner is None else stage_mesh("pp").get_group()
        for index, stage_module in zip(runner.stage_ids, runner.stages, strict=True):
            example = self._example_input(index, device)
            if index == pipeline.total_stages - 1:  # on meta, before the trace: the output's shapes
                # the model's reads of tensor values answered as in the step (a Hugging Face model
                # checkpointed from its own mechanism makes no cache, and checks its positions for
                # packed sequences), by a throwaway tracer
                answering: AbstractContextManager[Any] = contextlib.nullcontext()
                if tracer.read_values is not None:
                    from torch.distributed.tensor import DTensor

                    answering = StorageTracer("meta", read_values=tracer.read_values)
                    answering.defer_to = (DTensor,)  # DTensor's own dispatch first, as in the step
                # with the real kernels' meta rules that the step's backend puts in place (a mixture of
                # experts' ``_grouped_mm`` on float32 weights: torch's own meta kernel takes bf16 only)
                with (answering, grouped_mm_on_meta(),
                      contextlib.nullcontext() if inner is None else inner.applied(stage_module, "model.")):
                    output = example.call(stage_module)
            else:  # the activation the next stage receives
                shape, dtype = self.layout.activation
                output = torch.empty(shape, dtype=dtype, device=device, requires_grad=True)
            outputs[index] = output
            stages.append(PipelineStage(stage_module, index, pipeline.total_stages, device,
                                        input_args=tuple(example), output_args=_as_tuple(output), group=group))
        last = pipeline.total_stages - 1
        target = self._target(outputs.get(last), device, m)
        runner.target = target
        schedule_cls = pipeline.schedule_kind.torch_class
        if pipeline.schedule_kind.single_stage:
            schedule = schedule_cls(stages[0], m, loss_fn=runner.loss_fn)
        else:
            schedule = schedule_cls(stages, m, loss_fn=runner.loss_fn)

        def static_vote(voting: Sequence[Any], _has_backward: bool, _p2p_done: bool) -> None:
            assert inference_mode is not None
            for stage in voting:
                stage._inference_mode = inference_mode.STATIC

        if inference_mode is not None:
            schedule._warmup_p2p = static_vote
        for stage in stages:  # the report's phases: the schedule's forwards and backwards
            _phase_around(stage, "forward_one_chunk", tracer, Phase.FORWARD)
            _phase_around(stage, "backward_one_chunk", tracer, Phase.BACKWARD)
            _phase_around(stage, "backward_weight_one_chunk", tracer, Phase.BACKWARD)
        first = self._example_input(0, device) if 0 in runner.stage_ids else ModelInputs(())
        one_target = target[: target.shape[0] // m]
        if pipeline.schedule_kind.single_stage:
            schedule._initialize_stage(first.args, first.kwargs, one_target)
        else:
            schedule._initialize_stages(first.args, first.kwargs, one_target)
        runner.schedule = schedule
        for stage in stages:
            for infos in stage.args_recv_info.values():
                for info in infos:
                    if info.buffer is not None and not info.is_root_arg:
                        self.buffers.append(tracer.preexisting(info.buffer, Category.ACTIVATIONS))
                        if info.tensor_meta is not None and info.tensor_meta.requires_grad:
                            # the gradient sent back last step: step() drops it (clear_runtime_states)
                            info.buffer.grad = torch.empty_like(info.buffer)
                            tracer.preexisting(info.buffer.grad, Category.WORKSPACE)
                            if stage.stage_index - 1 not in runner.stage_ids:
                                # ... and backward sets this step's, which the next step finds there
                                # (not so where the previous stage is this rank's: a V schedule
                                # hands its output over locally, in place of the buffer)
                                tracer.replaced_by(info.buffer.grad, functools.partial(_grad_of, info))
            for infos in stage.grad_recv_info.values():
                for info in infos:
                    if info.buffer is not None:
                        self.buffers.append(tracer.preexisting(info.buffer, Category.WORKSPACE))
        if target.numel():
            tracer.preexisting(target, Category.INPUTS)
        if self.compose:
            self.recorder = CallRecorder(tracer, _issue)
        self._undo = _works_keep_tensors(self.recorder)
        installed: list[RankProgram] = []
        try:
            for stage, stage_module, wrap in zip(stages, runner.stages, self.wrapped, strict=False):
                wrap.install(tracer, stage_module)
                installed.append(wrap)
                _reduce_at_end(stage, wrap)
        except BaseException:
            for wrap in reversed(installed):
                wrap.remove()
            self.remove(wrapped=False)
            raise
        if self.recorder is not None:
            for local, stage in enumerate(stages):
                self.recorder.wrap(stage, local)

    def remove(self, *, wrapped: bool = True) -> None:
        if wrapped:
            for wrap in reversed(self.wrapped):
                wrap.remove()
        self.runner.schedule = None
        self.runner.target = None
        if self._undo is not None:
            self._undo()
            self._undo = None

    def _example_input(self, index: int, device: torch.device) -> ModelInputs:
        """One microbatch's call of stage ``index``: the model's inputs, or the activation."""
        if index == 0:
            return self.micro_inputs
        shape, dtype = self.layout.activation
        return ModelInputs((torch.empty(shape, dtype=dtype, device=device, requires_grad=True),))

    def _target(self, output: Any, device: torch.device, m: int) -> torch.Tensor:
        """The whole batch's target of the last stage's loss (the schedule splits it): memcalc's
        targets for the chosen loss, or an empty one for a loss that takes none (the schedule
        always passes one). Not the last stage: an empty one."""
        made = make_targets(resolve_loss(self.runner.loss_choice, output), output) if output is not None else ()
        if not made:
            return torch.empty(m, 0, device=device)
        if len(made) > 1:
            raise InapplicableOptionError(f"the loss takes {len(made)} targets; a pipeline's last stage is given one")
        one = made[0]
        return one.new_zeros((one.shape[0] * m, *one.shape[1:]))


def _grad_of(info: Any) -> torch.Tensor | None:
    """The gradient on a received activation's buffer now (torch 2.13's ``stage_backward``
    drops it as soon as it is sent: None at the end of a step)."""
    buffer = info.buffer
    return None if buffer is None else buffer.grad


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    """A stage's output as torch's static metadata takes it: detached tensors that keep whether
    they need a gradient (a received activation's gradient buffer exists only then)."""
    tensors = (value,) if isinstance(value, torch.Tensor) else tuple(t for t in value if isinstance(t, torch.Tensor))
    return tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)


def _reduce_at_end(stage: Any, program: RankProgram) -> None:
    """Run ``program.reduce_accumulated()`` where torch's ``perform_reduce_grad`` syncs an FSDP
    stage's gradients (after the last microbatch's backward, before the gradients are scaled):
    the stage's module is memcalc's meta model, not an ``FSDPModule``, so torch's own branch
    does not run."""
    original = stage.perform_reduce_grad
    def perform_reduce_grad(grad_scale_factor: int) -> None:
        program.reduce_accumulated()
        original(grad_scale_factor)

    stage.perform_reduce_grad = perform_reduce_grad


def _phase_around(stage: Any, method: str, tracer: StorageTracer, phase: Phase) -> None:
    """Set the tracer's phase whenever ``stage.method`` runs (on this stage object only)."""
    original = getattr(stage, method)

    def run(*args: Any, **kwargs: Any) -> Any:
        tracer.set_phase(phase)
        return original(*args, **kwargs)

    setattr(stage, method, run)


class _KeptWork:
    """A fake process group's work that keeps its tensors, as a real one does: gloo's and
    NCCL's ``Work`` hold the tensors of their send or receive until the work object dies, and
    a schedule keeps its last send works in a variable (1F1B's ``send_work``) well after
    waiting on them — on gloo, measured: the first rank's first forward output lived until the
    1F1B steady state ended, 128 KiB above the peak the fake group's works gave."""

    def __init__(self, work: Any, tensors: Sequence[torch.Tensor]) -> None:
        self.work = work
        self.tensors = tuple(tensors)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)


def _issue(op: Any) -> Any:
    """Issue one send or receive on the fake group: its work."""
    import torch.distributed as dist

    peer = {"group_dst": op.group_peer} if op.op is dist.isend else {"group_src": op.group_peer}
    return op.op(op.tensor, group=op.group, tag=op.tag, **peer)


def _works_keep_tensors(recorder: CallRecorder | None = None) -> Callable[[], None]:
    """Replace the schedules' ``_batch_p2p`` for the trace: each send or receive is issued on its
    own (a fake group has no order to keep, and coalescing would need a backend for the meta
    device), and its work keeps its tensor (:class:`_KeptWork`); ``recorder`` cuts out each one's
    kernels (:mod:`pipeline_compose`). Returns the undo."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = []
        for op in p2p_ops:
            with contextlib.nullcontext() if recorder is None else recorder.issuing(op):
                works.append(_KeptWork(_issue(op), (op.tensor,)))
        return works

    schedules._batch_p2p = batch_p2p

    def undo() -> None:
        schedules._batch_p2p = original

    return undo


#: The ``(pp, tp)`` device mesh of the fake group in use (:func:`stage_mesh`), while there is one.
_MESHES: list[Any] = []


def stage_mesh(dimension: str) -> Any:
    """The ``dimension`` (``"pp"``, ``"tp"``) sub-mesh of the current pipeline rank's fake group."""
    assert _MESHES, "only inside a pipeline rank's fake group with tensor parallelism"
    return _MESHES[-1][dimension]


@contextlib.contextmanager
def _fake_group(rank: int, world: int, inner: int = 1) -> Iterator[None]:
    """torch's fake process group as this process's default group, as rank ``rank`` of
    ``world``, for the time of one rank's trace (its sends and receives do nothing). ``inner`` >
    1: each pipeline rank has that many tensor-parallel ranks, innermost (torchtitan's mesh
    order); this process is pipeline rank ``rank``'s tp rank 0, on a ``(pp, tp)`` mesh."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise InapplicableOptionError(
            "a torch.distributed process group is already initialised in this process; memcalc estimates a pipeline "
            "over a fake process group of its own", hint="Estimate from a process without a process group.")
    dist.init_process_group("fake", store=FakeStore(), rank=rank * inner, world_size=world * inner)
    try:
        if inner > 1:
            from torch.distributed.device_mesh import DeviceMesh

            _MESHES.append(DeviceMesh("cpu", torch.arange(world * inner).view(world, inner),
                                      mesh_dim_names=("pp", "tp")))
        yield
    finally:
        if inner > 1 and _MESHES:
            _MESHES.pop()
        dist.destroy_process_group()

"""The pipeline schedules of the installed torch (``torch.distributed.pipelining.schedules``), by
name, and the order of forward and backward actions each runs on each pipeline rank.

memcalc never writes a schedule down itself. The order comes from torch:

* the single-stage schedules (``GPipe``, ``1F1B``) run their own ``_step_microbatches`` against
  a stage that only records what it is asked to do (no tensors, no communication). Their
  ``_get_pipeline_order`` is not used: on torch 2.13 ``Schedule1F1B``'s names microbatches
  1..m on the last rank instead of 0..m-1 (its warm-up counter starts at 0 with no warm-up
  forward), while ``_step_microbatches`` — what a real run executes — is right;
* the multi-stage schedules (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
  ``ZBVZeroBubble``, ``DualPipeV``) are built by ``_schedule_visualizer.get_schedule_ops``,
  torch's own construction with mock stages; their runtime executes that ``pipeline_order``.

The estimate (:mod:`memcalc.distributed.pipeline`) runs the real schedule classes on meta; the
actions here serve the report (microbatches in flight per stage) and the tests.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from memcalc.core.choices import parse_choice
from memcalc.core.errors import InapplicableOptionError, InvalidInputError

__all__ = ("Action", "Call", "PipelineSchedule", "in_flight", "rank_actions", "schedule_calls", "stage_of_rank")


class PipelineSchedule(str, enum.Enum):
    """A schedule of ``torch.distributed.pipelining``, by torchtitan's names (``--pp-schedule``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    INTERLEAVED_ZERO_BUBBLE = "interleaved-zero-bubble"
    ZBV_ZERO_BUBBLE = "zbv-zero-bubble"
    DUAL_PIPE_V = "dualpipev"

    @property
    def torch_name(self) -> str:
        """The name ``torch.distributed.pipelining.schedules.get_schedule_class`` takes."""
        return _TORCH_NAMES[self]

    @property
    def torch_class(self) -> Any:
        """The installed torch's class for this schedule.

        Raises:
            InapplicableOptionError: the installed torch has no such schedule.
        """
        from torch.distributed.pipelining.schedules import get_schedule_class

        try:
            return get_schedule_class(self.torch_name)
        except ValueError:
            raise InapplicableOptionError(
                f"the installed torch has no pipeline schedule {self.torch_name}",
                hint="Choose one of the schedules of torch.distributed.pipelining.schedules.") from None

    @property
    def single_stage(self) -> bool:
        """One stage per rank (``PipelineScheduleSingle``), else several (``PipelineScheduleMulti``)."""
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        return issubclass(self.torch_class, PipelineScheduleSingle)

    @property
    def v_shaped(self) -> bool:
        """Stages placed in a V (rank r holds stages r and 2p-1-r), not looped (r, r+p, ...)."""
        return self in (PipelineSchedule.ZBV_ZERO_BUBBLE, PipelineSchedule.DUAL_PIPE_V)

    @classmethod
    def parse(cls, value: PipelineSchedule | str) -> PipelineSchedule:
        """A user's name (torchtitan's, or torch's class name) as the enum."""
        if isinstance(value, str):
            by_torch = {s.torch_name.lower(): s for s in cls}
            if value.lower() in by_torch:
                return by_torch[value.lower()]
        return parse_choice(cls, value, "pp_schedule")


_TORCH_NAMES = {
    PipelineSchedule.GPIPE: "GPipe",
    PipelineSchedule.ONE_F_ONE_B: "1F1B",
    PipelineSchedule.INTERLEAVED_1F1B: "Interleaved1F1B",
    PipelineSchedule.LOOPED_BFS: "LoopedBFS",
    PipelineSchedule.INTERLEAVED_ZERO_BUBBLE: "InterleavedZeroBubble",
    PipelineSchedule.ZBV_ZERO_BUBBLE: "ZBVZeroBubble",
    PipelineSchedule.DUAL_PIPE_V: "DualPipeV",
}


@dataclass(frozen=True)
class Action:
    """One compute action of a rank: ``kind`` is torch's ``_ComputationType`` value (``F``
    forward, ``B`` full backward, ``I`` backward for inputs, ``W`` backward for weights)."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def stage_of_rank(schedule: PipelineSchedule, ranks: int, stages_per_rank: int) -> dict[int, tuple[int, ...]]:
    """The stages each rank holds: torch's ``generate_stage_to_rank_mapping`` (looped, or V)."""
    from torch.distributed.pipelining.schedules import (  # type: ignore[attr-defined]
        generate_stage_to_rank_mapping,
    )

    style = "v" if schedule.v_shaped else "loop"
    mapping = generate_stage_to_rank_mapping(ranks, ranks * stages_per_rank, style=style)
    held: dict[int, list[int]] = {r: [] for r in range(ranks)}
    for stage, rank in sorted(mapping.items()):
        held[rank].append(stage)
    return {r: tuple(s) for r, s in held.items()}


def rank_actions(schedule: PipelineSchedule, ranks: int, microbatches: int,
                 stages_per_rank: int = 1) -> dict[int, list[Action]]:
    """The compute actions each rank runs, in order, as the installed torch runs them.

    Raises:
        InvalidInputError: torch refuses the combination (1F1B with fewer microbatches than
            stages; a multi-stage schedule's own constraints), with torch's reason.
    """
    try:
        if schedule.single_stage:
            return {r: _recorded_single(schedule, r, ranks, microbatches) for r in range(ranks)}
        return _multi(schedule, ranks, microbatches, stages_per_rank)
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise InvalidInputError(f"torch's {schedule.torch_name} schedule refuses {ranks} pipeline ranks with "
                                f"{microbatches} microbatches ({stages_per_rank} stage(s) per rank): {exc}",
                                hint="Change the number of microbatches or of pipeline stages.") from None


def in_flight(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage, the most microbatches forwarded and not yet backwarded at once: what the stage
    keeps activations for. A microbatch leaves at its full backward (``B``) or at its backward
    for inputs (``I``): the weight backward (``W``) keeps only what the weight gradients need."""
    alive: dict[int, set[int]] = {}
    most: dict[int, int] = {}
    for action in actions:
        live = alive.setdefault(action.stage, set())
        if action.kind == "F":
            live.add(action.microbatch)
            most[action.stage] = max(most.get(action.stage, 0), len(live))
        elif action.kind in ("B", "I"):
            live.discard(action.microbatch)
    return most


class _RecordingStage:
    """Stands for a ``PipelineStage`` in a single-stage schedule's ``_step_microbatches``: it
    records each forward and backward and communicates nothing."""

    def __init__(self, index: int, stages: int) -> None:
        self.stage_index = index
        self.num_stages = stages
        self.is_first = index == 0
        self.is_last = index == stages - 1
        self.has_backward = True
        self.device = "cpu"
        self.output_chunks: list[Any] = []
        self.actions: list[Action] = []

    def forward_one_chunk(self, chunk: int, *_args: Any, **_kwargs: Any) -> None:
        self.actions.append(Action(self.stage_index, "F", chunk))

    def backward_one_chunk(self, chunk: int, *_args: Any, **_kwargs: Any) -> None:
        self.actions.append(Action(self.stage_index, "B", chunk))

    def _no_ops(self, *_args: Any, **_kwargs: Any) -> list[Any]:
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops
    _get_init_p2p_neighbors_ops = _no_ops

    def _prepare_forward_infra(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def _prepare_backward_infra(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def clear_runtime_states(self) -> None:
        pass

    def perform_reduce_grad(self, *_args: Any) -> None:
        pass


def _recorded_single(schedule: PipelineSchedule, rank: int, ranks: int, microbatches: int) -> list[Action]:
    stage = _RecordingStage(rank, ranks)
    runner = schedule.torch_class(stage, microbatches)  # no loss_fn: the last stage computes none
    runner._has_backward = True  # as with a loss_fn, without computing one
    runner._step_microbatches(return_outputs=False)
    return stage.actions


def _multi(schedule: PipelineSchedule, ranks: int, microbatches: int, stages_per_rank: int) -> dict[int, list[Action]]:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(schedule.torch_name, ranks, microbatches, num_stages_per_rank=stages_per_rank)
    return {rank: [a for op in ops[rank] if op is not None for a in _flatten(op)] for rank in range(ranks)}


def _flatten(op: Any) -> list[Action]:
    """An action of torch's IR as memcalc's; an overlapped forward-backward (DualPipeV's
    ``OVERLAP_F_B``) as its forward, then its backward."""
    if op.sub_actions is not None:
        return [a for sub in op.sub_actions for a in _flatten(sub)]
    if not op.is_compute_op:
        return []
    assert op.microbatch_index is not None
    return [Action(op.stage_index, str(op.computation_type.value), op.microbatch_index)]


@dataclass(frozen=True)
class Call:
    """One step of a rank's ``_step_microbatches`` as its stages see it: a call of a stage's
    method (``release`` False), or the moment the schedule's code drops the last reference it
    holds to what a call gave it (``release`` True: the output of forward ``F``, the input
    gradients sent by ``send_B``, the activations sent by ``send_F``, counted as ``F``'s).

    ``method``: ``F``, ``B``, ``W`` (``forward_one_chunk``, ``backward_one_chunk``,
    ``backward_weight_one_chunk``), ``send_F``, ``send_B`` (``get_fwd_send_ops``,
    ``get_bwd_send_ops``), ``reduce`` (``perform_reduce_grad``); ``microbatch`` -1 for ``reduce``;
    ``p2p_send_F``, ``p2p_send_B``, ``p2p_recv_F``, ``p2p_recv_B``: the schedule issues the op of
    that send, or of the receive ``get_fwd_recv_ops`` or ``get_bwd_recv_ops`` gave it.
    """

    stage: int
    method: str
    microbatch: int
    release: bool = False


class _Held:
    """What a logging stage hands the schedule in place of a tensor: its death is logged."""

    __slots__ = ("__weakref__", "key")

    def __init__(self, key: tuple[int, str, int]) -> None:
        self.key = key


class _Op:
    """A send or receive op of a logging stage (torch's ``P2POp`` holds its tensor: a send's holds
    a :class:`_Held`), and the call that made it."""

    def __init__(self, tensor: _Held | None, origin: Call) -> None:
        self.tensor = tensor
        self.origin = origin


class _Work:
    """A fake group's work keeps its tensors, as memcalc's trace's do (``pipeline._KeptWork``)."""

    def __init__(self, tensors: tuple[_Held, ...]) -> None:
        self.tensors = tensors

    def wait(self, *_args: Any, **_kwargs: Any) -> None:
        return None


class _LoggingStage(_RecordingStage):
    """A recording stage that also logs what the schedule holds: each forward returns, and each
    send op holds, a :class:`_Held` whose death is logged as a release."""

    def __init__(self, index: int, stages: int, log: list[Call]) -> None:
        super().__init__(index, stages)
        self.log = log
        self.outputs: dict[int, _Held] = {}
        self.group_rank = 0  # a multi-stage schedule's rank and group size, set by its caller
        self.group_size = stages
        self.submod = None  # no FSDPModule: the runtime's unshard and reshard do nothing

    def _held(self, method: str, chunk: int) -> _Held:
        held = _Held((self.stage_index, method, chunk))
        weakref.finalize(held, self.log.append, Call(self.stage_index, method, chunk, True))
        return held

    def forward_one_chunk(self, chunk: int, *_args: Any, **_kwargs: Any) -> Any:
        super().forward_one_chunk(chunk)
        self.log.append(Call(self.stage_index, "F", chunk))
        output = self._held("F", chunk)
        self.outputs[chunk] = output
        return output

    def backward_one_chunk(self, chunk: int, *_args: Any, **_kwargs: Any) -> None:
        super().backward_one_chunk(chunk)
        self.log.append(Call(self.stage_index, "B", chunk))

    def _call(self, method: str, chunk: int) -> Call:
        call = Call(self.stage_index, method, chunk)
        self.log.append(call)
        return call

    def get_fwd_send_ops(self, chunk: int, *_args: Any, **_kwargs: Any) -> list[Any]:
        call = self._call("send_F", chunk)
        return [] if self.is_last else [_Op(self.outputs.pop(chunk), call)]

    def get_bwd_send_ops(self, chunk: int, *_args: Any, **_kwargs: Any) -> list[Any]:
        call = self._call("send_B", chunk)
        return [] if self.is_first else [_Op(self._held("send_B", chunk), call)]

    def get_fwd_recv_ops(self, chunk: int, *_args: Any, **_kwargs: Any) -> list[Any]:
        call = self._call("recv_F", chunk)
        return [] if self.is_first else [_Op(None, call)]

    def get_bwd_recv_ops(self, chunk: int, *_args: Any, **_kwargs: Any) -> list[Any]:
        call = self._call("recv_B", chunk)
        return [] if self.is_last else [_Op(None, call)]

    def perform_reduce_grad(self, *_args: Any) -> None:
        self.log.append(Call(self.stage_index, "reduce", -1))


@contextlib.contextmanager
def _works_keep_held(log: list[Call]) -> Iterator[None]:
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = []
        for op in p2p_ops:
            log.append(Call(op.origin.stage, "p2p_" + op.origin.method, op.origin.microbatch))
            works.append(_Work((op.tensor,)))
        return works

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


def schedule_calls(schedule: PipelineSchedule, rank: int, ranks: int, microbatches: int,
                   stages_per_rank: int = 1) -> tuple[Call, ...]:
    """What rank ``rank``'s stages see of one ``_step_microbatches`` of the installed torch's
    ``schedule``: their calls and the schedule's releases, in order — torch's own code run
    against stages that log (a send op holds its tensor, as torch's ``P2POp`` does, and a send's
    work keeps it, as the trace's fake group's do)."""
    log: list[Call] = []
    held = stage_of_rank(schedule, ranks, stages_per_rank)[rank]
    stages = [_LoggingStage(index, ranks * stages_per_rank, log) for index in held]
    for stage in stages:
        stage.group_rank, stage.group_size, stage.submod = rank, ranks, None
    runner = schedule.torch_class(stages[0] if schedule.single_stage else stages, microbatches)
    runner._has_backward = True
    runner._initialize_stages = lambda *_args, **_kwargs: None
    with _works_keep_held(log):
        runner._step_microbatches(return_outputs=False)
        for stage in stages:
            del stage.outputs
    return tuple(log)

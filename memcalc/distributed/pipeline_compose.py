"""A middle pipeline rank's step composed from another's calls, in its own schedule's order.

Under 1F1B a middle rank's warm-up depth depends on its stage, so no two run their actions in
the same order (:mod:`pipeline_share` renames a trace only between ranks that do). What each of
a stage's calls allocates and frees (a forward, a backward, the send ops of either) is the same
on every middle rank holding stages of identical blocks: the stage's own state (its caches of
inputs, outputs and input gradients) is microbatch by microbatch the same. What differs is how
long torch's schedule code keeps what a call gave it (a forward's output in ``output``, send
ops in ``fwd_sends``, their works in ``send_work``), which decides where some storages die.

So one such rank is traced with its schedule holding nothing (:class:`CallRecorder`: its forward
returns None to the schedule and its send ops are dropped; every send is a no-op on the fake
group anyway), each call's events and kernels cut out; and each rank's step is those calls in the
order torch's schedule code calls them on that rank (:func:`schedule_calls`, run against a stage
that logs what the schedule drops and when), a storage the schedule still holds dying where it
lets it go (:func:`composed_step`). Storages are numbered in birth order, as a trace numbers them.
Anything the composition cannot account for (events between calls, a storage born outside a
forward or backward, a call missing or repeated, a held storage never let go) makes it decline,
and the rank is traced. tests/test_pipeline.py compares every byte of every composed rank's
report with its own full trace.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memcalc.core.categories import Phase
from memcalc.distributed.pipeline_schedules import Call
from memcalc.engine.run import TracedStep
from memcalc.engine.trace import StorageTracer

__all__ = ("CallRecorder", "composed_step")

#: A call of one of the rank's stages: (its index among the rank's stages, method, microbatch).
Key = tuple[int, str, int]

#: The calls whose births the composition moves (their phase is set at their start).
_COMPUTE = frozenset({"F", "B", "W"})
_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W",
            "get_fwd_send_ops": "send_F", "get_bwd_send_ops": "send_B", "perform_reduce_grad": "reduce",
            "get_fwd_recv_ops": "recv_F", "get_bwd_recv_ops": "recv_B"}


@dataclass
class _Segment:
    key: Key
    start: int  # index into the trace's events
    end: int
    log_start: int  # index into its phase log
    log_end: int
    record_start: int  # index into its cost records (0 without)
    record_end: int
    phase_start: Phase  # the tracer's phase as it began, and as it ended
    phase_end: Phase


@dataclass
class CallRecorder:
    """Installed on a rank's stages for its trace: each call's events, phase-log entries and cost
    records (and each send's or receive's, as the fake group issues it: ``issue``), and what the
    schedule would hold of each (the storages of a forward's output and of the tensors its sends
    send, under the forward's key; of the input gradients a backward's sends send, under
    ``send_B``'s). The schedule is given nothing to hold: the sends are issued at once."""

    tracer: StorageTracer
    issue: Callable[[Any], Any]
    segments: list[_Segment] = field(default_factory=list)
    held: dict[Key, set[int]] = field(default_factory=dict)
    unknown: bool = False  # a held tensor whose storage the tracer does not know, an op of no call
    _origin: dict[int, tuple[Key, Any]] = field(default_factory=dict)  # a receive op's call, by id

    def wrap(self, stage: Any, local: int) -> None:
        """Wrap ``stage``'s methods (the stage is the rank's ``local``-th)."""
        for method, short in _METHODS.items():
            setattr(stage, method, self._wrapped(getattr(stage, method), local, short, stage.is_last))

    @contextlib.contextmanager
    def issuing(self, op: Any) -> Iterator[None]:
        """Around the schedule's issue of ``op``: its own segment (a receive's, ``p2p_recv_…``)."""
        origin = self._origin.pop(id(op), None)
        if origin is None or origin[1] is not op:
            self.unknown = True
            yield
            return
        with self._segment(origin[0]):
            yield

    @contextlib.contextmanager
    def _segment(self, key: Key) -> Iterator[None]:
        trace = self.tracer.trace
        start, log_start, record_start, phase = len(trace.events), len(trace.phase_log), self._records(), \
            self.tracer.phase
        yield
        self.segments.append(_Segment(key, start, len(trace.events), log_start, len(trace.phase_log), record_start,
                                      self._records(), phase, self.tracer.phase))

    def _records(self) -> int:
        records = getattr(self.tracer.after_op, "records", None)
        return len(records) if isinstance(records, list) else 0

    def _hold(self, key: Key, value: Any) -> None:
        tensors = [value] if isinstance(value, torch.Tensor) else [
            getattr(v, "tensor", v) for v in (value if isinstance(value, (list, tuple)) else ())]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                uid = self.tracer.uid_of(tensor)
                if uid is None:
                    self.unknown = True
                else:
                    self.held.setdefault(key, set()).add(uid)
            elif tensor is not None:
                self.unknown = True

    def _wrapped(self, original: Callable[..., Any], local: int, short: str, last: bool) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            chunk = int(args[0]) if short != "reduce" else -1
            ops: list[Any] = []
            with self._segment((local, short, chunk)):
                out = original(*args, **kwargs)
                if short == "F" and not last:
                    self._hold((local, "F", chunk), out)
                    out = None
                elif short in ("send_F", "send_B"):
                    self._hold((local, "F" if short == "send_F" else short, chunk), out)
                    ops, out = list(out), []
            while ops:  # a send is issued at once, in its own segment, and dropped there
                op = ops.pop(0)
                with self._segment((local, "p2p_" + short, chunk)):
                    self.issue(op)
                    op = None
            if short in ("recv_F", "recv_B"):
                for op in out:
                    self._origin[id(op)] = ((local, "p2p_" + short, chunk), op)
            return out

        return run


def composed_step(traced: TracedStep, recorder: CallRecorder, calls: Sequence[Call],
                  stages: Sequence[int]) -> TracedStep | None:
    """``traced`` (a middle rank's step traced under ``recorder``) as the rank holding ``stages``
    runs it: its calls in the order of ``calls`` (:func:`schedule_calls` of that rank), a storage
    the schedule holds freed where ``calls`` says the schedule lets it go, if its stage freed it
    earlier. None: the trace holds something the composition cannot place."""
    segments = recorder.segments
    trace = traced.trace
    if recorder.unknown or not segments or traced.iteration_starts is not None:
        return None
    for a, b in itertools.pairwise(segments):
        if (a.end, a.log_end, a.record_end) != (b.start, b.log_start, b.record_start):
            return None  # something happened between two calls
    by_key = {s.key: s for s in segments}
    local = {stage: i for i, stage in enumerate(stages)}
    order = [(local[c.stage], c.method, c.microbatch) for c in calls if not c.release]
    if len(by_key) != len(segments) or sorted(order) != sorted(by_key):
        return None
    events = trace.events
    births = [e for s in segments for e in events[s.start:s.end] if e >= 0]
    if births != sorted(births) or any(s.log_start != s.log_end for s in segments if s.key[1] not in _COMPUTE):
        return None  # a forward's or backward's is the only phase set in a call
    holders: dict[int, set[Key]] = {}
    for key, uids in recorder.held.items():
        for held in uids:
            holders.setdefault(held, set()).add(key)
    releases = {(local[c.stage], c.method, c.microbatch) for c in calls if c.release}
    if any(not keys <= releases for keys in holders.values()):
        return None
    # the births in the new order take the uids in the old one's
    renumber = dict(zip((e for k in order for e in events[by_key[k].start:by_key[k].end] if e >= 0), births,
                        strict=True))

    def new_uid(old: int) -> int:
        return renumber.get(old, old)

    first, last = segments[0], segments[-1]
    out = list(events[:first.start])
    log = list(trace.phase_log[:first.log_start])
    records = _records(traced)
    new_records = [] if records is None else list(records[:first.record_start])
    released: set[Key] = set()
    pending: set[int] = set()
    phase = first.phase_start  # the phase a call runs in: the last forward's or backward's
    for call in calls:
        key = (local[call.stage], call.method, call.microbatch)
        if call.release:
            released.add(key)
            for held in sorted(recorder.held.get(key, set()), key=new_uid):
                if held in pending and holders[held] <= released:
                    pending.discard(held)
                    out.append(~held)
            continue
        segment = by_key[key]
        compute = key[1] in _COMPUTE
        if not compute and segment.phase_start != phase and any(
                e >= 0 for e in events[segment.start:segment.end]):
            return None  # its storages would be of another phase
        at = {}
        for index in range(segment.start, segment.end):
            at[index] = len(out)
            event = events[index]
            if event < 0 and not holders.get(~event, set()) <= released:
                pending.add(~event)
            else:
                out.append(event)
        at[segment.end] = len(out)
        log.extend((entered, at[index]) for entered, index in trace.phase_log[segment.log_start:segment.log_end])
        if records is not None:
            new_records.extend(r._replace(event=at[r.event], phase=r.phase if compute else phase)
                               for r in records[segment.record_start:segment.record_end])
        if compute:
            phase = segment.phase_end
    if pending or len(out) != last.end or phase != last.phase_end:
        return None
    out.extend(events[last.end:])
    log.extend(trace.phase_log[last.log_end:])
    if records is not None:
        new_records.extend(records[last.record_end:])
    return _renumbered(traced, out, log, new_records if records is not None else None, new_uid)


def _records(traced: TracedStep) -> list[Any] | None:
    records = None if traced.costs is None else getattr(traced.costs, "records", None)
    return records if isinstance(records, list) else None


def _renumbered(traced: TracedStep, events: list[int], log: list[Any], records: list[Any] | None,
                uid: Callable[[int], int]) -> TracedStep:
    """``traced`` with ``events`` (old uids), its phase log and cost records, every storage ``uid``'d."""
    trace = traced.trace
    n = trace.num_storages
    moved = [0] * n
    for old in range(n):
        moved[uid(old)] = old
    starts: dict[Any, int] = {}
    for phase, index in log:
        starts.setdefault(phase, index)
    new_trace = trace.rebuilt(moved, [uid(e) if e >= 0 else ~uid(~e) for e in events],
                              [uid(u) for u in trace.preexisting], log, starts)
    composed = copy.copy(traced)
    composed.trace = new_trace
    composed.categories = [traced.categories[old] for old in moved]
    composed.successors = {uid(k): None if v is None else uid(v) for k, v in traced.successors.items()}
    composed.notes = list(traced.notes)
    if records is not None:
        costs = copy.copy(traced.costs)
        costs.records = records  # type: ignore[union-attr]
        composed.costs = costs
    return composed

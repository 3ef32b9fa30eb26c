"""Depth extrapolation, second part: the trace of a step at depth ``L`` composed
from the same step traced at depths ``c - 1`` and ``c`` (:mod:`depth_chunks` finds the blocks of
events one more layer adds; :mod:`depth_step` checks and uses it).

Every event of the composed stream is an event of the depth-``c`` trace with a *shift*: the amount
added to the block index of its module name. An aligned run keeps its events once, shifted by
``shift × (L - c)``; an added block is emitted ``L - c + 1`` times with shifts ``0 .. L - c``, in
ascending order (the forward, the optimizer) or descending where the block indices fall across it
(the backward). A composed storage is a depth-``c`` storage with a shift; a death names the storage
whose module names are those of the traced one moved by the death's own shift: the same storage,
or its analog one period before or after the added block next to its birth (a layer's output freed
by the next layer, a checkpointed layer's input freed in its backward). Anything that does not fit
(a death whose storage has no such analog, a phase boundary inside an added block, a pre-existing
storage freed) gives None, and the caller traces the whole model. A kernel's cost record (a step
time's) moves with the event before it; one whose sums run over every block (a foreach optimizer
kernel's bytes and launches) grows with the depth (:func:`_trailing`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memcalc.core.categories import Category
from memcalc.distributed.depth_chunks import DepthChunks, Run, depth_chunks, index_of, pattern_of, tokens_of
from memcalc.engine.trace import StepTrace

if TYPE_CHECKING:  # the FLOP recorder is imported only where --time asks for it (tests/test_startup.py)
    from memcalc.timing.flops import OpCost

__all__ = ("Composed", "compose_depth")


@dataclass(frozen=True)
class Composed:
    """A composed trace, its storages' final categories and the uids of its communication buffers."""

    trace: StepTrace
    categories: list[Category]
    communication: set[int]
    #: the kernels' cost records, moved as their events are (:func:`_trailing`); None: none were given
    records: list[OpCost] | None = None


def compose_depth(shallow: StepTrace, shallow_categories: Sequence[Category], deep: StepTrace,
                  deep_categories: Sequence[Category], deep_communication: set[int], deep_depth: int,
                  depth: int, containers: Sequence[str],
                  records: tuple[Sequence[OpCost], Sequence[OpCost]] | None = None) -> Composed | None:
    """The trace at ``depth`` blocks per container from the traces at ``deep_depth - 1`` (``shallow``)
    and ``deep_depth`` (``deep``), with their kernels' cost ``records`` (shallow's, deep's) where
    given; None where the two do not differ by added blocks that compose."""
    if depth < deep_depth:
        return None
    chunks = depth_chunks(shallow, shallow_categories, deep, deep_categories, containers)
    if chunks is None or not any(run.added for run in chunks.runs):
        return None
    extra = depth - deep_depth
    pattern = pattern_of(containers)
    trailing = _trailing(chunks, records, (len(shallow.events), len(deep.events)), extra, pattern)
    chunks = _slid(chunks, deep, tokens_of(deep, deep_categories, pattern), pattern)
    events = deep.events
    birth_at = {event: p for p, event in enumerate(events) if event >= 0}
    named = [index_of(pattern, deep.module[e if e >= 0 else ~e]) is not None for e in events]
    plan = _emission(chunks.runs, extra, events, birth_at, named)
    if plan is None:
        return None
    run_of = [0] * len(events)
    for k, run in enumerate(chunks.runs):
        run_of[run.start:run.stop] = [k] * (run.stop - run.start)
    preexisting = set(deep.preexisting)
    if any(~event in preexisting for event in events if event < 0):
        return None  # a pre-existing storage freed: the second iteration is traced, not composed

    def valid(uid: int, shift: int) -> bool:
        run = chunks.runs[run_of[birth_at[uid]]]
        return 0 <= shift <= extra if run.added else shift == run.shift_at(birth_at[uid]) * extra

    neighbours = _neighbours(chunks.runs, plan.descending, tokens_of(deep, deep_categories, pattern))
    by_name: dict[tuple[object, ...], list[int]] = {}
    for uid in birth_at:
        by_name.setdefault(_signature(deep, deep_categories, uid, deep.module[uid]), []).append(uid)

    def named_twin(uid: int, step: int) -> int | None:
        """The storage of the block ``step`` on that ``uid``'s module and op make in the same turn."""
        if index_of(pattern, deep.module[uid]) is None:
            return None
        mine = by_name[_signature(deep, deep_categories, uid, deep.module[uid])]
        theirs = by_name.get(_signature(deep, deep_categories, uid, _shifted(pattern, deep.module[uid], step)), [])
        return theirs[mine.index(uid)] if len(theirs) == len(mine) else None

    def analog(uid: int, shift: int, copied: bool) -> tuple[int, int] | None:
        """The storage a death with ``shift`` of ``uid`` frees: ``uid`` itself, or its analog one
        block away (by name where the module has a block index, else one period away in the added
        block next to its birth)."""
        if valid(uid, shift):
            return uid, shift
        if index_of(pattern, deep.module[uid]) is not None:  # the storage named as the death's shift asks
            for step in (1, -1, 2, -2):
                twin = named_twin(uid, step)
                if twin is not None and valid(twin, shift - step):
                    return twin, shift - step
            return None
        home = chunks.runs[run_of[birth_at[uid]]]
        if not home.added and not copied:  # no block index to follow: born once, freed once
            return uid, home.shift_at(birth_at[uid]) * extra
        found = neighbours.get(birth_at[uid])
        if found is None:
            return None
        other, step = found
        twin = events[other]
        if twin < 0 or not _same(deep, deep_categories, pattern, uid, twin, step) or not valid(twin, shift - step):
            return None
        return twin, shift - step

    # the composed storages: pre-existing ones first, then births in order
    # the composed storages in the order the tracer numbers them: the pre-existing ones registered
    # before the step first, then births, each followed by a pre-existing storage registered just
    # after it (a persistent synthetic one made mid-step)
    pre_keys = _preexisting(chunks, deep, extra)
    first_birth = min(birth_at, default=len(deep.nbytes))
    later: dict[int, list[tuple[int, int]]] = {}
    for key in pre_keys:
        if key[0] > first_birth:
            anchor = key[0] - 1
            if anchor not in birth_at or chunks.runs[run_of[birth_at[anchor]]].added:
                return None
            later.setdefault(anchor, []).append(key)
    keys: list[tuple[int, int]] = [key for key in pre_keys if key[0] < first_birth]
    front = [u for u in deep.preexisting if u < first_birth]
    if front != sorted(front):
        return None  # numbered otherwise than listed: not followed
    key_uid: dict[tuple[int, int], int] = {key: n for n, key in enumerate(keys)}
    out_events: list[int] = []
    start_of: dict[int, int] = {}
    out_records = trailing.emit(-1, 0, 0)
    for p, shift in plan.order:
        out_records.extend(trailing.emit(p, shift, len(out_events) + 1))
        start_of.setdefault(p, len(out_events))
        event = events[p]
        if event >= 0:
            key = (event, shift)
            if key in key_uid:
                return None
            key_uid[key] = len(keys)
            keys.append(key)
            out_events.append(key_uid[key])
            for pre in later.get(event, ()):
                key_uid[pre] = len(keys)
                keys.append(pre)
            continue
        uid = ~event
        if uid in preexisting:
            return None
        found = analog(uid, shift, chunks.runs[run_of[p]].added)
        if found is None or found not in key_uid:
            return None
        out_events.append(~key_uid[found])
    start_of[len(events)] = len(out_events)
    boundaries = [p for _, p in deep.phase_log] + list(deep.phase_starts.values())
    if any(p not in start_of for p in boundaries):
        return None  # a phase boundary inside an added block
    composed = _build(deep, deep_categories, deep_communication, shallow, extra, pattern, keys, out_events, start_of,
                      [key_uid[key] for key in pre_keys])
    return composed if records is None else dataclasses.replace(composed, records=out_records)


@dataclass(frozen=True)
class _Trailing:
    """The cost records by the event each follows (-1: before the first), to be emitted with it."""

    after: dict[int, list[OpCost]]
    pattern: re.Pattern[str]
    names: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict)

    def emit(self, position: int, shift: int, event: int) -> list[OpCost]:
        """The records after the event at ``position``, their block indices moved by ``shift``,
        each numbered as following the composed stream's first ``event`` events."""
        return [r._replace(module=self._name(r.module, shift), event=event) for r in self.after.get(position, ())]

    def _name(self, module: str, shift: int) -> str:
        found = self.names.get((module, shift))
        if found is None:
            found = self.names[(module, shift)] = _shifted(self.pattern, module, shift)
        return found


def _following(records: Sequence[OpCost], events: int) -> dict[int, list[OpCost]]:
    after: dict[int, list[OpCost]] = {}
    for record in records:
        after.setdefault(min(record.event, events) - 1, []).append(record)
    return after


def _trailing(chunks: DepthChunks, records: tuple[Sequence[OpCost], Sequence[OpCost]] | None,
              events: tuple[int, int], extra: int, pattern: re.Pattern[str]) -> _Trailing:
    """A kernel's record follows the last event before it (``event``: how many came before it): the
    birth of its output, which the tracer records before the cost hook runs, or, for a kernel that
    allocates nothing (an in-place one), the event of the kernel before it in the same block. Where
    an aligned event's records differ from the shallower trace's only in their sums over the blocks
    (a foreach optimizer kernel's bytes), they are extended to the composed depth
    (:meth:`OpCost.extended`). A record at an added block's edge may belong to the block or to its
    neighbour: a wrong guess composes a stream the check against the traced one refuses."""
    if records is None:
        return _Trailing({}, pattern)
    shallow, deep = _following(records[0], events[0]), _following(records[1], events[1])
    pairs = [(-1, -1)] + [(p, run.other + p - run.start) for run in chunks.runs if not run.added
                          for p in range(run.start, run.stop)]
    for p, q in pairs:
        mine, theirs = deep.get(p, []), shallow.get(q, [])
        if len(mine) != len(theirs) or mine == theirs:
            continue
        grown = [d.extended(s, extra) if d != s else d for d, s in zip(mine, theirs, strict=True)]
        if all(g is not None for g in grown):
            deep[p] = [g for g in grown if g is not None]
    return _Trailing(deep, pattern)


@dataclass(frozen=True)
class _Plan:
    order: list[tuple[int, int]]  # (position in the deeper trace's events, shift), in composed order
    descending: dict[int, bool]  # by run index: the added block's copies run from the last shift down


def _emission(runs: Sequence[Run], extra: int, events: Sequence[int], birth_at: dict[int, int],
              named: Sequence[bool]) -> _Plan | None:
    order: list[tuple[int, int]] = []
    descending: dict[int, bool] = {}
    for k, run in enumerate(runs):
        if not run.added:
            order.extend((p, run.shift_at(p) * extra) for p in range(run.start, run.stop))
            continue
        before = next((r.shift_at(r.stop - 1) for r in reversed(runs[:k]) if not r.added), 0)
        after = next((r.shift_at(r.start) for r in runs[k + 1:] if not r.added), 0)
        descending[k] = before == 1 and after == 0
        frees = run.start > 0 and events[run.start] < 0 and events[run.start - 1] < 0
        if before == after and frees and not any(named[run.start:run.stop]):
            # no block index to read: frees run down the layers where the one before the block
            # frees a storage born after the block's first's (a foreach optimizer's temporaries)
            earlier, first = birth_at.get(~events[run.start - 1]), birth_at.get(~events[run.start])
            descending[k] = earlier is not None and first is not None and earlier > first
        shifts = range(extra, -1, -1) if descending[k] else range(extra + 1)
        middle = _nested(events, run)
        if middle is not None:  # made, then freed in reverse: every copy's made before any is freed
            order.extend((p, s) for s in range(extra + 1) for p in range(run.start, middle))
            order.extend((p, s) for s in range(extra, -1, -1) for p in range(middle, run.stop))
            continue
        order.extend((p, s) for s in shifts for p in range(run.start, run.stop))
    return _Plan(order, descending)


def _slid(chunks: DepthChunks, deep: StepTrace, tokens: Sequence[Hashable], pattern: re.Pattern[str]) -> DepthChunks:
    """``chunks`` with an added block of births moved back by whole periods where the tokens
    allow it and an added block of frees frees what was made there: a run of per-parameter
    temporaries (a foreach optimizer's) is the same token for every layer, so the alignment may
    take any layer's for the added one, but the frees name which one it is."""
    events = deep.events
    birth_at = {event: p for p, event in enumerate(events) if event >= 0}
    runs = list(chunks.runs)
    for frees in [r for r in runs if r.added]:
        first = events[frees.start]
        if first >= 0 or ~first not in birth_at:
            continue
        made_at = birth_at[~first]
        for k, makes in enumerate(runs):
            period = makes.stop - makes.start
            if not makes.added or period != frees.stop - frees.start or made_at >= makes.start:
                continue
            start = makes.start - -(-(makes.start - made_at) // period) * period
            if start < 0 or not start <= made_at < start + period:
                continue
            span = range(start, makes.stop)
            if any(events[p] < 0 or index_of(pattern, deep.module[events[p]]) is not None for p in span) or any(
                    tokens[p] != tokens[makes.start + (p - start) % period] for p in span):
                continue
            before = next(j for j, r in enumerate(runs) if r.start <= start < r.stop)
            if runs[before].added or before != k - 1:
                continue
            left = runs[before]
            runs[before:k + 1] = [r for r in (
                dataclasses.replace(left, stop=start),
                Run(start, start + period, added=True),
                dataclasses.replace(left, start=start + period, stop=makes.stop)) if r.stop > r.start]
            break
    return dataclasses.replace(chunks, runs=tuple(runs))


def _nested(events: Sequence[int], run: Run) -> int | None:
    """Where an added block that makes storages and then frees them in reverse order (a stack:
    tensor parallelism's all-reduces of the replicated parameters' gradients) turns from making
    to freeing; None: the block is not such."""
    block = events[run.start:run.stop]
    half = len(block) // 2
    if len(block) % 2 or not half:
        return None
    made, freed = block[:half], block[half:]
    if all(e >= 0 for e in made) and [~e for e in freed] == made[::-1]:
        return run.start + half
    return None


def _preexisting(chunks: DepthChunks, deep: StepTrace, extra: int) -> list[tuple[int, int]]:
    """The composed pre-existing storages, in order: an added layer's parameters ``extra + 1``
    times (shifts ascending, as parameters are listed), the others once."""
    keys: list[tuple[int, int]] = []
    for run in chunks.preexisting_runs:
        uids = deep.preexisting[run.start:run.stop]
        if run.added:
            keys.extend((u, s) for s in range(extra + 1) for u in uids)
        else:
            keys.extend((u, run.shift_at(n) * extra) for n, u in zip(range(run.start, run.stop), uids, strict=True))
    return keys


def _neighbours(runs: Sequence[Run], descending: dict[int, bool],
                tokens: Sequence[Hashable]) -> dict[int, tuple[int, int]]:
    """For an event in the period before or after an added block, the event of the block that
    plays its part one block on: (its position, the blocks between them), read from an alignment
    of the block with its neighbourhood (the first layer's one-off events, a handle's workspace
    made once, keep the periods from being equally long)."""
    found: dict[int, tuple[int, int]] = {}
    for k, run in enumerate(runs):
        if not run.added:
            continue
        period = run.stop - run.start
        reach = period + period // 4 + 8
        block = tokens[run.start:run.stop]
        for start, stop, step in ((max(0, run.start - reach), run.start, -1 if descending[k] else 1),
                                  (run.stop, min(len(tokens), run.stop + reach), 1 if descending[k] else -1)):
            matcher = difflib.SequenceMatcher(None, tokens[start:stop], block, autojunk=False)
            for a, b, size in matcher.get_matching_blocks():
                for n in range(size):
                    found.setdefault(start + a + n, (run.start + b + n, step))
    return found


def _signature(trace: StepTrace, categories: Sequence[Category], uid: int, module: str) -> tuple[object, ...]:
    return (module, trace.nbytes[uid], trace.op[uid], categories[uid], trace.phase[uid], trace.stream.get(uid, 0))


def _same(trace: StepTrace, categories: Sequence[Category], pattern: re.Pattern[str], a: int, b: int,
          step: int) -> bool:
    """``b`` is ``a``'s analog ``step`` blocks on: the same bytes, op, category and phase, and module names
    equal but for the block index, which is ``step`` more."""
    if (trace.nbytes[a], trace.op[a], categories[a], trace.phase[a], trace.stream.get(a, 0)) != \
            (trace.nbytes[b], trace.op[b], categories[b], trace.phase[b], trace.stream.get(b, 0)):
        return False
    return _shifted(pattern, trace.module[a], step) == trace.module[b]


def _shifted(pattern: re.Pattern[str], name: str, shift: int) -> str:
    if not shift:
        return name
    return pattern.sub(lambda m: f"{m.group(1)}.{int(m.group(2)) + shift}", name)


def _build(deep: StepTrace, deep_categories: Sequence[Category], communication: set[int], shallow: StepTrace,
           extra: int, pattern: re.Pattern[str], keys: list[tuple[int, int]], events: list[int],
           start_of: dict[int, int], preexisting: list[int]) -> Composed:
    names: dict[tuple[str, int], str] = {}

    def name(uid: int, shift: int) -> str:
        key = (deep.module[uid], shift)
        found = names.get(key)
        if found is None:
            found = names[key] = _shifted(pattern, deep.module[uid], shift)
        return found

    trace = deep.rebuilt(
        [u for u, _ in keys], events, preexisting, [(phase, start_of[p]) for phase, p in deep.phase_log],
        {phase: start_of[p] for phase, p in deep.phase_starts.items()}, module=[name(u, s) for u, s in keys],
        op_counts=Counter({op: n + extra * (n - shallow.op_counts.get(op, 0)) for op, n in deep.op_counts.items()}))
    return Composed(trace, [deep_categories[u] for u, _ in keys],
                    {n for n, (u, _) in enumerate(keys) if u in communication})

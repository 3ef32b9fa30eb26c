"""From a :class:`~memcalc.engine.trace.StepTrace` to the memory curve of a training loop.

A training loop's first step is not its worst: ``torch.optim`` creates its state lazily at the
first ``step()``, after backward has freed the activations, so the first iteration never holds
optimizer state and activations together — every later iteration does. For memcalc's own loop
we trace one step and build the second iteration from it (the same alloc/free order, with the
storages still alive after the first iteration — optimizer state — already there), then replay
both. Any other loop (:mod:`memcalc.engine.loops`) is traced for all its iterations, which
are replayed as they ran; so is memcalc's own loop when its first step frees a pre-existing
storage (:func:`freed_preexisting`: a buffer the forward rebinds).

The replay itself is :mod:`memcalc.engine.allocator` (the CUDA caching allocator model); this
module builds the sequence it replays and reads the categories alive at the peak it finds, and,
on request, the whole curve (:func:`build_timeline`, behind ``MemoryReport.timeline()``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast, overload

import numpy as np

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Category, Phase
from memcalc.core.timeline import Allocation, AllocatorEvent, PhaseSpan, Timeline
from memcalc.engine import allocator
from memcalc.engine.trace import StepTrace

__all__ = (
    "CategoryColumn",
    "Program",
    "alive_at_end",
    "alive_before",
    "allocator_events",
    "build_program",
    "build_timeline",
    "category_codes",
    "category_totals_at",
    "final_categories",
    "freed_preexisting",
    "generation_peaks",
)

def final_categories(trace: StepTrace, gradients: Iterable[int],
                     optimizer_state: Iterable[int]) -> tuple[list[Category], np.ndarray]:
    """One category per storage: explicit (parameters, buffers, inputs) first, then what the
    storage turned out to be (a ``.grad``, optimizer state), else by the phase of its birth; as a
    list (the passes of the estimate) and as their :func:`category_codes` (what a report keeps:
    :class:`CategoryColumn`), both made piece by piece."""
    by_phase = {p: Category.ACTIVATIONS if p.runs_forward else Category.WORKSPACE for p in Phase}
    code = {c: i for i, c in enumerate(Category)}
    categories: list[Category] = []
    codes: list[np.ndarray] = []
    # piece by piece: a generation's unwritten decode steps are one step's columns many times (trace.parts)
    for (given, times), (phases, _) in zip(trace.parts("category"), trace.parts("phase"), strict=True):
        piece = [explicit if explicit is not None else by_phase[phase]
                 for explicit, phase in zip(given, phases, strict=True)]
        piece_codes = np.fromiter(map(code.__getitem__, piece), dtype=np.int64, count=len(piece))
        codes.append(piece_codes if times == 1 else np.tile(piece_codes, times))
        for _ in range(times):
            categories.extend(piece)
    column = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
    for uids, category in ((gradients, Category.GRADIENTS), (optimizer_state, Category.OPTIMIZER_STATE)):
        for uid in uids:
            if trace.column_at("category", uid) is None:
                categories[uid] = category
                column[uid] = code[category]
    return categories, column


class CategoryColumn(Sequence[Category]):
    """The storages' final categories as :func:`category_codes` (an int64 array), read as a
    sequence of :class:`Category`: what a report keeps for its timeline. A list of millions of
    enum members (a long generation's) is a container Python's cyclic collector walks entry by
    entry at every collection that reaches it; an array is not tracked at all
    (``benchmarks/gc_walk.py``)."""

    __slots__ = ("codes",)

    def __init__(self, codes: np.ndarray) -> None:
        self.codes = codes

    def __len__(self) -> int:
        return int(self.codes.size)

    @overload
    def __getitem__(self, index: int) -> Category: ...

    @overload
    def __getitem__(self, index: slice) -> list[Category]: ...

    def __getitem__(self, index: int | slice) -> Category | list[Category]:
        if isinstance(index, slice):
            return [_BY_CODE[c] for c in self.codes[index].tolist()]
        return _BY_CODE[int(self.codes[index])]

    def __iter__(self) -> Iterator[Category]:
        return map(_BY_CODE.__getitem__, self.codes.tolist())


#: ``list(Category)``: a code's category (:func:`category_codes`)
_BY_CODE: tuple[Category, ...] = tuple(Category)


def alive_before(trace: StepTrace, index: int) -> set[int]:
    """Storages born during the step and alive just before ``trace.events[index]``."""
    alive: set[int] = set()
    for event in trace.events[:index]:
        if event >= 0:
            alive.add(event)
        else:
            alive.discard(~event)
    return alive


def alive_at_end(trace: StepTrace) -> set[int]:
    """Storages born during the step and still alive when it ended."""
    return alive_before(trace, len(trace.events))


def freed_preexisting(trace: StepTrace) -> list[int]:
    """Pre-existing storages the step freed: a buffer the forward rebinds (``self.ema = 0.9 *
    self.ema + ...``, a RoPE cache rebuilt for a longer sequence, a buffer grown with
    ``torch.cat``) lets its old storage die. The second iteration then frees the storage the
    first one bound, not the pre-existing one, and may bind another size or none (a cache
    rebuilt once): it cannot be synthesised from the first, and is traced instead."""
    preexisting = set(trace.preexisting)
    freed: list[int] = []
    seen: set[int] = set()
    for event in trace.events:
        uid = event if event >= 0 else ~event
        if uid in preexisting and uid not in seen:
            seen.add(uid)
            if event < 0:  # its first event is a death: the storage that was there before the step
                freed.append(uid)
    return freed


@dataclass(frozen=True)
class Program:
    """The replayable sequence: ``events`` over keys ``0 .. 2N-1`` (``uid`` for the first
    iteration, ``uid + N`` for the synthesised second), every key's storage being ``key % N``.
    A loop traced for all its iterations (``traced``) uses the keys ``0 .. N-1`` only."""

    events: list[int]
    num_storages: int
    iterations: int
    iteration_starts: tuple[int, ...]  # index in events where each iteration begins
    traced: bool = False  # every iteration is in the trace (none synthesised)
    #: the stream each key is allocated on, where it is not the compute stream (0): what
    #: :func:`memcalc.engine.allocator.replay` takes as ``streams``
    streams: Mapping[int, int] = field(default_factory=dict)

    @cached_property
    def keys(self) -> np.ndarray:
        """``events`` as an int64 array, made once: a long generation's millions of events are
        read by several of the report's passes (the replay, the categories at the peak)."""
        keys = np.asarray(self.events, dtype=np.int64)
        keys.flags.writeable = False  # shared by its readers
        return keys

    @property
    def num_events(self) -> int:
        """``len(events)``, without making the list of a program made from its keys."""
        events: list[int] | None = self.__dict__["events"]
        return len(events) if events is not None else int(self.keys.size)

    @classmethod
    def of_keys(cls, keys: np.ndarray, num_storages: int, iteration_starts: tuple[int, ...],
                streams: Mapping[int, int]) -> Program:
        """A program of one iteration made from its events as int64 ``keys`` (a generation whose
        decode steps the trace holds unwritten: millions of events): its ``events`` list is made
        only if something reads it."""
        program = cls(cast("list[int]", None), num_storages, 1, iteration_starts, streams=streams)
        keys.flags.writeable = False
        program.__dict__["keys"] = keys  # the cached property, given
        return program

    def storage(self, key: int) -> int:
        """The storage uid behind an event key."""
        return key % self.num_storages

    def iteration_of(self, index: int) -> int:
        """The iteration (1-based) that ``events[index]`` belongs to."""
        iteration = 1
        for i, start in enumerate(self.iteration_starts):
            if index >= start:
                iteration = i + 1
        return iteration


def _program_events(program: Program) -> list[int]:
    events: list[int] | None = program.__dict__["events"]
    if events is None:  # a program made from its keys: the list made once, by its first reader
        events = program.__dict__["events"] = program.keys.tolist()
    return events


def _set_program_events(program: Program, events: list[int] | None) -> None:
    program.__dict__["events"] = events


Program.events = property(_program_events, _set_program_events,  # type: ignore[assignment]
                          doc="The events, made from the keys on first read where the program was made from them.")


def build_program(trace: StepTrace, iterations: int = 1, *, traced_starts: Sequence[int] | None = None,
                  successors: Mapping[int, int | None] | None = None) -> Program:
    """Pre-existing storages, then ``iterations`` copies of the step (at most 2 are needed:
    the third iteration's events are the second's). A step that frees a pre-existing storage
    (:func:`freed_preexisting`) is not copied: its second iteration must be in the trace —
    unless ``successors`` names, for each such storage, the storage the step left in its place
    (born in the step, alive at its end), or None where it left none: the second iteration then
    frees that one where the first freed the pre-existing one (or frees nothing there), and makes
    its own.

    With ``traced_starts`` (indices into ``trace.events`` where the iterations after the first
    begin) the trace already holds every iteration: it is replayed as it ran, and
    ``iterations`` is ignored."""
    n = trace.num_storages
    if trace.unwritten is not None and iterations == 1 and traced_starts is None:
        # a generation's unwritten decode steps: its keys straight from their arrays, no list of every event
        keys = np.concatenate([np.asarray(trace.preexisting, dtype=np.int64), trace.events_array()])
        return Program.of_keys(keys, n, (len(trace.preexisting),), dict(trace.stream))
    events: list[int] = list(trace.preexisting)
    starts = [len(events)]
    events.extend(trace.events)
    if traced_starts is not None:
        starts.extend(starts[0] + start for start in traced_starts)
        return Program(events=events, num_storages=n, iterations=len(starts), iteration_starts=tuple(starts),
                       traced=True, streams=dict(trace.stream))
    if iterations >= 2:
        replaced = dict(successors or {})
        persistent = alive_at_end(trace)
        if freed := [uid for uid in freed_preexisting(trace)
                     if uid not in replaced or (replaced[uid] is not None and replaced[uid] not in persistent)]:
            raise ValueError(f"the step freed pre-existing storages {freed}: its second iteration must be traced, "
                             f"not synthesised")
        persistent -= {uid for uid in replaced.values() if uid is not None}  # made again by the second iteration
        starts.append(len(events))
        for event in trace.events:
            uid = event if event >= 0 else ~event
            if uid in persistent:
                continue  # already alive from the first iteration (optimizer state)
            if uid in replaced:  # the pre-existing storage's death: now its successor's, of the first iteration
                if (successor := replaced[uid]) is not None:
                    events.append(~successor)
                continue
            events.append(event + n if event >= 0 else ~(uid + n))
    # the second iteration's key of a storage is uid + n, on the same stream
    streams = {**trace.stream, **{uid + n: stream for uid, stream in trace.stream.items()}} if len(starts) > 1 \
        else dict(trace.stream)
    return Program(events=events, num_storages=n, iterations=min(iterations, 2), iteration_starts=tuple(starts),
                   streams=streams)


#: Integers up to 2**53 are exact in float64: a sum whose terms' magnitudes add up to less is exact.
_EXACT_IN_FLOAT64 = 1 << 53


def category_codes(categories: Sequence[Category]) -> np.ndarray:
    """Each storage's category as its index in ``list(Category)`` (int64; a long generation has
    millions of storages: one pass, shared by the report's readers)."""
    if isinstance(categories, CategoryColumn):
        return categories.codes
    code = {c: i for i, c in enumerate(Category)}
    return np.fromiter(map(code.__getitem__, categories), dtype=np.int64, count=len(categories))  # map: C speed


def category_totals_at(program: Program, nbytes: Sequence[int] | np.ndarray, categories: Sequence[Category],
                       index: int, *, codes: np.ndarray | None = None) -> dict[Category, int]:
    """Requested bytes per category alive just after ``program.events[index]`` (``codes``: the
    categories' :func:`category_codes`, when the caller has them)."""
    totals = {c: 0 for c in Category}
    events = program.keys[: index + 1]
    if not events.size:
        return totals
    uids = np.where(events >= 0, events, ~events) % program.num_storages
    signed = np.asarray(nbytes, dtype=np.int64)[uids]
    signed[events < 0] *= -1  # int64: exact
    of = (codes if codes is not None else category_codes(categories))[uids]
    # every partial sum an integer float64 holds exactly (the bound summed in float64, with room for its rounding)
    if np.abs(signed).sum(dtype=np.float64) < _EXACT_IN_FLOAT64 / 2:
        sums = np.bincount(of, weights=signed, minlength=len(totals)).tolist()
        return {category: int(sums[i]) for i, category in enumerate(Category)}
    for i, category in enumerate(Category):
        totals[category] = int(signed[of == i].sum())
    return totals


def generation_peaks(trace: StepTrace, program: Program, *, settings: AllocConf | None = None,
                     host: bool = False) -> tuple[int, int] | None:
    """The peaks of a training loop that generates (TRL's GRPO step): the highest allocated bytes
    after an event of a generating phase (:attr:`Phase.generates`: ``generate()`` and the scoring
    of its completions), and after any other event (the training: forward, loss, backward,
    optimizer). None when no phase generates, or the loop was not traced whole."""
    if not program.traced or not any(phase.generates for phase, _ in trace.phase_log):
        return None
    allocated = allocator.replay_recorded(allocator_events(program, trace.nbytes), settings=settings,
                                          host=host).allocated
    generating = np.zeros(len(program.events), dtype=bool)
    offset = program.iteration_starts[0]  # the pre-existing storages come first
    log = trace.phase_log
    for k, (phase, start) in enumerate(log):
        end = log[k + 1][1] if k + 1 < len(log) else len(trace.events)
        if phase.generates:
            generating[offset + start:offset + end] = True
    curve = np.asarray(allocated, dtype=np.int64)
    generation = int(curve[generating].max()) if generating.any() else 0
    training = int(curve[~generating].max()) if (~generating).any() else 0
    return generation, training


def allocator_events(program: Program, nbytes: Sequence[int],
                     until: int | None = None) -> Iterator[tuple[int, int, int]]:
    """The program as ``(+1, key, nbytes)`` / ``(-1, key, 0)`` events for
    :func:`memcalc.engine.allocator.replay`."""
    n = program.num_storages
    events = program.events if until is None else program.events[:until]
    for event in events:
        if event >= 0:
            yield (1, event, nbytes[event % n])
        else:
            yield (-1, ~event, 0)


#: How many of the storages alive at the peak a timeline lists (``Timeline.largest_at_peak``).
LARGEST_AT_PEAK = 10


def build_timeline(trace: StepTrace, program: Program, categories: Sequence[Category], *,
                   capacity: int | None = None, role: str = "", settings: AllocConf | None = None,
                   host: bool = False) -> Timeline:
    """The memory after every event of ``program``, replayed once more with the recording
    allocator model (:func:`memcalc.engine.allocator.replay_recorded`).

    ``allocated`` and the allocator's actions come from the replay without a limit, the one the
    report's ``peak_allocated`` comes from; ``reserved`` from the replay the report's
    ``peak_reserved`` comes from: under ``capacity`` when the allocator meets it (it frees its
    cache there), else the same replay.

    Args:
        trace: the traced step (sizes, birth phase, module and op of every storage).
        program: its replayable program (:func:`build_program`).
        categories: the final category of every storage (:func:`final_categories`).
        capacity: the bytes the allocator may reserve, when the report has a limit.
        role: the GPU role under a multi-GPU strategy ("" for one GPU).
        host: the CPU target: replayed through the host allocator (no rounding, nothing cached).

    Returns:
        The :class:`~memcalc.core.timeline.Timeline`, one row per event of ``program``.
    """
    nbytes = trace.nbytes
    recorded = allocator.replay_recorded(allocator_events(program, nbytes), settings=settings, host=host,
                                         streams=program.streams)
    reserved = recorded.reserved
    collects = settings is not None and settings.garbage_collection_threshold > 0.0  # below the capacity too
    if capacity is not None and (recorded.stats.peak_reserved > capacity or collects):
        reserved = allocator.replay_recorded(allocator_events(program, nbytes), capacity=capacity,
                                             settings=settings, host=host, streams=program.streams).reserved
    n = max(program.num_storages, 1)
    keys = np.asarray(program.events, dtype=np.int64)
    is_alloc = keys >= 0
    uids = np.where(is_alloc, keys, ~keys) % n
    sizes = np.asarray(nbytes, dtype=np.int64)[uids] if len(keys) else np.zeros(0, dtype=np.int64)
    order = tuple(Category)
    column = {c: i for i, c in enumerate(order)}
    columns = np.asarray([column[c] for c in categories], dtype=np.intp)[uids] if len(keys) else uids
    delta = np.zeros((len(keys), len(order)), dtype=np.int64)
    delta[np.arange(len(keys)), columns] = np.where(is_alloc, sizes, -sizes)
    storage = uids.tolist()
    peak_index = max(recorded.stats.peak_index, 0)
    return Timeline(
        categories=order,
        by_category=np.cumsum(delta, axis=0),
        allocated=np.asarray(recorded.allocated, dtype=np.int64),
        reserved=np.asarray(reserved, dtype=np.int64),
        phase=tuple(trace.phase[u] for u in storage),
        module=tuple(trace.module[u] for u in storage),
        op=tuple(trace.op[u] for u in storage),
        is_alloc=is_alloc,
        spans=_phase_spans(trace, program),
        peak_index=peak_index,
        capacity=capacity,
        largest_at_peak=_largest_alive(trace, program, categories, peak_index)
        if recorded.stats.peak_allocated > 0 else (),
        allocator_events=tuple(
            AllocatorEvent(action, address, size, event, key % n if isinstance(key, int) else -1, requested, stream)
            for action, address, size, event, key, requested, stream in recorded.actions),
        role=role,
        category=tuple(categories[u] for u in storage),
    )


def _phase_spans(trace: StepTrace, program: Program) -> tuple[PhaseSpan, ...]:
    """The phases of each iteration as contiguous spans of program events, in order: the
    pre-existing storages (setup), then every phase the step entered (micro-batches repeat
    forward, loss and backward), with the second iteration's indices shifted past the storages
    it does not allocate again."""
    starts = program.iteration_starts
    bounds: list[tuple[Phase, int, int]] = [(Phase.SETUP, 1, 0), (Phase.SETUP, 1, starts[0])]
    if program.traced:  # every iteration's phases are in the log; an iteration starts with a batch
        bounds += [(phase, program.iteration_of(starts[0] + index), starts[0] + index)
                   for phase, index in trace.phase_log]
    else:
        bounds += [(phase, 1, starts[0] + index) for phase, index in trace.phase_log]
    if program.iterations > 1 and not program.traced:
        persistent = alive_at_end(trace)
        kept = [0]  # kept[i]: events of trace.events[:i] the second iteration replays
        for event in trace.events:
            kept.append(kept[-1] + ((event if event >= 0 else ~event) not in persistent))
        bounds.append((Phase.SETUP, 2, starts[1]))
        bounds += [(phase, 2, starts[1] + kept[index]) for phase, index in trace.phase_log]
    spans: list[PhaseSpan] = []
    for i, (phase, iteration, start) in enumerate(bounds):
        end = bounds[i + 1][2] if i + 1 < len(bounds) else len(program.events)
        if end <= start:
            continue
        last = spans[-1] if spans else None
        if last is not None and last.phase is phase and last.iteration == iteration:
            spans[-1] = PhaseSpan(phase, iteration, last.start, end)
        else:
            spans.append(PhaseSpan(phase, iteration, start, end))
    return tuple(spans)


def _largest_alive(trace: StepTrace, program: Program, categories: Sequence[Category],
                   index: int) -> tuple[Allocation, ...]:
    """The largest storages alive just after ``program.events[index]``, largest first (the
    earlier born first among equals)."""
    alive: dict[int, None] = {}  # keys in birth order
    for event in program.events[: index + 1]:
        if event >= 0:
            alive[event] = None
        else:
            alive.pop(~event, None)
    n = program.num_storages
    nbytes = trace.nbytes
    largest = sorted((key % n for key in alive if nbytes[key % n] > 0), key=lambda uid: -nbytes[uid])
    return tuple(Allocation(nbytes=nbytes[u], category=categories[u], phase=trace.phase[u], module=trace.module[u],
                            op=trace.op[u]) for u in largest[:LARGEST_AT_PEAK])

"""The allocator's replay of a long generation, its small pool's steady decode steps skipped.

A generation of thousands of tokens is millions of events (:mod:`memcalc.engine.steady` writes
them out). Most (95% for llama-2-7b) are small-pool requests (≤ 1 MiB: one token's activations)
whose rounded sizes do not change from one decode step to the next; only the caches grow.

The small pool is a machine of its own: a small request never touches a large-pool block, and
it reaches the driver only for a new segment. So where the small pool's state before a stretch
of events (every block's address, size and owner — a recent owner named from the stretch's first
storage, an older one by uid) is the state before the stretch *p* before it, and the stretch's
small requests and frees are those of that one (the same relative owners, the same rounded
sizes), the stretch does to the small pool what that one did: nothing but renaming, no new
segment. :func:`replay_generation` finds such repetitions at two scales: whole decode steps
(their owners named from the decode steps' first storage), and, within a step that changes (a
sequence crossing a 512-B rounding step), its units — the events from one numbered module's
first storage (``model.layers.3``) to the next one's, owners within a layer's storages named
from the unit — whose layers repeat each other. It feeds a skipped stretch's large-pool events
alone and renames the small pool's owners once the repetition ends. Reserved memory changes
only at a new segment, so the peak reserved is exact; allocated and requested are sums over
every event in numpy (exact, int64), as is the index of their peak. The events fed go through
:meth:`~memcalc.engine.allocator.CachingAllocatorModel.feed`, the allocator's loop inlined.

It applies to the report's unlimited replay on one stream with PyTorch's 512-B rounding and
cudaMalloc'ed segments; anything else (a capacity, expandable segments, the CPU allocator,
``roundup_power2_divisions``, another stream) is replayed event by event by the caller.
tests/test_steady_replay.py compares the two replays' stats on generations of several models.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Hashable, Sequence
from typing import cast

import numpy as np

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Phase
from memcalc.core.progress import report_progress
from memcalc.engine import allocator, steady_sums
from memcalc.engine.timeline import Program
from memcalc.engine.trace import SteadyRun, StepTrace

__all__ = ("REPLAYING", "SKIP_FROM", "replay_generation")

#: The progress task of the allocator's replay of a long step (here: its decode steps).
REPLAYING = "replaying allocations"

#: Decode steps from which skipping is tried (fewer replay in a moment).
SKIP_FROM = 32
#: The longest cycle of decode steps looked for (llama-2-7b: 3 or 12 steps).
MAX_PERIOD = 32
#: The longest cycle of a decode step's units (its layers) looked for.
MAX_UNIT_PERIOD = 4
_NUMBERED = re.compile(r"(.*?\.\d+)(?:\.|$)")

#: A small pool's state (:func:`_small_state`): its blocks' and owners' numbers, flat.
_Signature = tuple[int, ...]
#: The int64 mask that moves a free's key (``~uid``, negative) above every birth's (a uid), to at
#: least :data:`_FREES_FROM`: the search for a step's first birth.
_NO_BIRTH = np.iinfo(np.int64).max
_FREES_FROM = 1 << 62


def replay_generation(program: Program, trace: StepTrace, settings: AllocConf | None,
                      host: bool, *, nbytes: np.ndarray | None = None,
                      steady: SteadyRun | None = None) -> allocator.AllocatorStats | None:
    """The unlimited replay's stats of a generation's ``program``, its small pool's repeated
    decode steps skipped (module docstring); None where that does not apply. ``nbytes``:
    ``trace.nbytes`` as int64, when the caller has it; ``steady``: its written decode steps, checked
    (:func:`memcalc.engine.steady_sums.applies`): the peak requested is read off a few of them."""
    offset = program.iteration_starts[0]  # the pre-existing storages' births come first
    starts = [offset + start for phase, start in trace.phase_log if phase is Phase.DECODE]
    settings = settings or AllocConf()
    if (host or program.streams or program.iterations != 1 or len(starts) < SKIP_FROM
            or settings.expandable_segments or any(settings.roundup_power2_divisions)
            or program.num_events != offset + trace.num_events):
        return None
    events = program.keys
    nbytes = trace.nbytes_array() if nbytes is None else nbytes
    # round_size: up to a multiple of 512 B (a power of two: shifts, not a division's pass), 0 stays 0
    bits = allocator.K_MIN_BLOCK_SIZE.bit_length() - 1
    rounded = ((nbytes + (allocator.K_MIN_BLOCK_SIZE - 1)) >> bits) << bits
    small = _by_event(rounded <= allocator.K_SMALL_SIZE, events)
    model = allocator.CachingAllocatorModel(settings=settings)
    bounds = [*starts, len(events)]
    bases = _bases(events, bounds)
    if bases is None:
        return None
    first = bases[0]  # storages from here on are named relative to their step's first
    held: dict[int, int] = {}
    _feed(model, events[:starts[0]], rounded, held)
    widths = [y - x for x, y in itertools.pairwise(bases)]
    layers = _Layers(model, events, small, rounded, trace, held)
    requests: dict[int, bytes] = {}

    def request(j: int) -> bytes:  # step j's small requests and frees, named from its first storage
        if j not in requests:
            lo, hi = bounds[j], bounds[j + 1]
            mask, step = small[lo:hi], _uids(events[lo:hi][small[lo:hi]])
            relative = np.where(step >= first, step - bases[j], step + (1 << 40))
            requests[j] = (np.int64(widths[j]).tobytes() + relative.tobytes()
                           + (events[lo:hi][mask] >= 0).tobytes() + rounded[step].tobytes())
        return requests[j]

    states: dict[int, _Signature] = {}
    j, count = 0, len(starts)
    while j < count:
        report_progress(REPLAYING, j, count)
        state = states[j] = _small_state(model, first, bases[j])
        period = next((p for p in range(1, MAX_PERIOD + 1) if j + p <= count and states.get(j - p) == state
                       and all(request(j - p + i) == request(j + i) for i in range(p))), 0)
        if not period:
            try:
                if not layers.feed(bounds[j], bounds[j + 1], bases[j + 1]):
                    _feed(model, events[bounds[j]:bounds[j + 1]], rounded, held)
            except _Unsteady:
                return None
            j += 1
            continue
        # steps j .. j + period - 1 repeat the period before them: their small pool, renamed; the
        # periods that repeat in turn found first (their requests), then their large-pool events fed at once
        end = j
        while end + period <= count and all(request(end + i) == request(end - period + i) for i in range(period)):
            end += period
        lo, hi = bounds[j], bounds[end]
        _feed(model, events[lo:hi][~small[lo:hi]], rounded, held)
        shift, j = bases[end] - bases[j], end  # the storages of steps j .. end - 1
        if not _rename(model, first, shift):
            return None
    report_progress(REPLAYING, count, count)
    sizes = rounded.copy()  # a small block is its request rounded (the small pool splits off any rest)
    sizes[np.fromiter(held, dtype=np.int64, count=len(held))] = np.fromiter(held.values(), dtype=np.int64,
                                                                           count=len(held))
    peak_requested = None if steady is None else _peak_requested(steady, events, offset, nbytes)
    return _stats(model.stats(), events, sizes, nbytes, peak_requested)


class _Unsteady(Exception):
    """A renamed owner is live already: not a repetition after all (the replay starts over)."""


class _Layers:
    """A decode step fed a unit at a time (a unit: the events from the birth of a storage of one
    numbered module, ``model.layers.3``, to the next such module's), the units that repeat the
    ones before them skipped as the decode steps are (module docstring): the same small requests
    and the same small pool, renamed. Owners born within :attr:`horizon` storages before a unit
    are named from its first storage, older ones by uid (the rotary tables, the sequences), so
    that one layer's residual stream is the next layer's."""

    def __init__(self, model: allocator.CachingAllocatorModel, events: np.ndarray, small: np.ndarray,
                 rounded: np.ndarray, trace: StepTrace, held: dict[int, int]) -> None:
        self.model, self.events, self.small = model, events, small
        self.rounded, self.trace, self.held = rounded, trace, held
        self.keys: dict[str, str] = {}
        self.last: tuple[list[str], list[int], list[bool]] | None = None  # the step before's modules, units

    def _key(self, module: str) -> str:
        """A module's unit: its path up to its first number (``model.layers.3``), else "" (not a layer)."""
        key = self.keys.get(module)
        if key is None:
            match = _NUMBERED.match(module)
            key = self.keys[module] = match.group(1) if match else ""
        return key

    def _split(self, born: np.ndarray) -> tuple[list[int], list[bool]]:
        """Where the units of a step begin (indices of ``born``, the storages it makes in order) and
        which are layers; the step before's when its storages' modules are the same objects."""
        first, last = int(born[0]), int(born[-1])
        modules = self.trace.column_range("module", first, last + 1) if last - first + 1 == born.size else None
        if modules is not None and self.last is not None and self.last[0] == modules:
            return self.last[1], self.last[2]
        keys = [self._key(self.trace.column_at("module", uid)) for uid in born.tolist()]
        split = [0] + [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
        layer = [bool(keys[i]) for i in split]
        self.last = (modules, split, layer) if modules is not None else None
        return split, layer

    def feed(self, lo: int, hi: int, end: int) -> bool:
        """Feed the events ``lo .. hi`` (a decode step; ``end``: the first storage of the step after);
        False, having fed nothing, where its storages are not born in order."""
        births = np.flatnonzero(self.events[lo:hi] >= 0) + lo
        born = self.events[births]
        if not births.size or (np.diff(born) <= 0).any() or born[-1] >= end:
            return False
        split, layer = self._split(born)
        starts = [lo, *births[split[1:]].tolist()]
        bases = born[split].tolist()
        bounds, count = [*starts, hi], len(starts)
        widths = [y - x for x, y in itertools.pairwise([*bases, end])]
        horizon = sorted(widths)[count // 2]  # a layer's storages
        # every small event named: from its unit's first storage, or by uid when older than the horizon
        unit = np.repeat(np.arange(count), np.diff(bounds))
        base = np.asarray(bases, dtype=np.int64)[unit]
        step = _uids(self.events[lo:hi])
        named = np.where(step >= base - horizon, step - base, step + (1 << 40))
        mask = self.small[lo:hi]
        # the step's small events once, each unit's a slice of them (where they start: the small events before)
        small_named, small_born = named[mask], self.events[lo:hi][mask] >= 0
        small_rounded = self.rounded[step[mask]]
        at = np.concatenate([[0], np.cumsum(mask)])[np.asarray(bounds, dtype=np.int64) - lo].tolist()
        requests: dict[int, bytes] = {}

        def request(k: int) -> bytes:
            if k not in requests:
                a, b = at[k], at[k + 1]
                requests[k] = (np.int64(widths[k]).tobytes() + small_named[a:b].tobytes()
                               + small_born[a:b].tobytes() + small_rounded[a:b].tobytes())
            return requests[k]

        model, events, rounded, held = self.model, self.events, self.rounded, self.held
        states: dict[int, _Signature] = {}
        near = range(-MAX_UNIT_PERIOD, MAX_UNIT_PERIOD + 1)
        k = 0
        while k < count:
            if layer[k] and any(d and 0 <= k + d < count and request(k + d) == request(k) for d in near):
                states[k] = _small_state(model, bases[k] - horizon, bases[k])  # a unit that may repeat
            period = next((p for p in range(1, min(MAX_UNIT_PERIOD, k) + 1)
                           if k + p <= count and k in states and states.get(k - p) == states[k]
                           and all(request(k - p + i) == request(k + i) for i in range(p))), 0)
            if not period:
                _feed(model, events[bounds[k]:bounds[k + 1]], rounded, held)
                k += 1
                continue
            end = k  # the units that repeat in turn, then their large-pool events fed at once
            while end + period <= count and all(request(end + i) == request(end - period + i) for i in range(period)):
                end += period
            a, b = bounds[k], bounds[end]
            _feed(model, self.events[a:b][~self.small[a:b]], rounded, held)
            threshold, shift = bases[k] - horizon, sum(widths[k:end])
            k = end
            if not _rename(model, threshold, shift):
                raise _Unsteady
        return True


def _bases(events: np.ndarray, bounds: Sequence[int]) -> list[int] | None:
    """The first storage born in each decode step, and the one after the last; None when a
    step is born nothing or its storages are not numbered after the step before's. (Each step's
    least birth in one reduction over the decode events, a free counted as the largest key.)"""
    starts = np.asarray(bounds[:-1], dtype=np.int64)
    if (np.diff(np.asarray(bounds, dtype=np.int64)) <= 0).any():
        return None  # a step with no events
    # a free's key ~uid, negative, masked to 2**63 + ~uid: above every uid (< 2**62) in one pass
    firsts = np.minimum.reduceat(events[starts[0]:] & _NO_BIRTH, starts - starts[0])
    if (firsts >= _FREES_FROM).any():
        return None
    out = [*firsts.tolist(), int(events.max()) + 1]
    return out if all(x < y for x, y in itertools.pairwise(out)) else None


def _feed(model: allocator.CachingAllocatorModel, events: np.ndarray, rounded: np.ndarray,
          held: dict[int, int]) -> None:
    """Replay ``events`` (int64 keys), noting each block handed out larger than its request rounded
    (``held``: uid -> bytes; a large-pool block not worth splitting). The allocator's loop reads the
    rounded bytes of the storages born here by uid: a dict of those, not a list of every storage's
    (millions in a long generation, where the events fed are a tenth of them). It reads them as the
    requested bytes too: the allocator's choices never depend on those, and :func:`_stats` sums the
    requested bytes over every event itself, so the model's own count is never read."""
    births = events[events >= 0]
    sized = dict(zip(births.tolist(), rounded[births].tolist(), strict=True))
    model.feed(events.tolist(), sized, sized, held)


def _small_state(model: allocator.CachingAllocatorModel, first: int, base: int) -> _Signature:
    """The small pool as a value to compare: its cached blocks (size, address: the pool's own
    ordered list), its blocks handed out by address with their size and owner (from ``base`` for
    a storage of the decode steps, else by uid, flagged), and the keys of its 0-byte requests
    (named alike), each part's count first. Two states are equal exactly when every block and
    owner is the same. One flat tuple, not a tuple per block: kept for every step, those tuples
    set off Python's collector, its older generations too, several times a replay."""
    small = model._small
    live = cast("dict[int, allocator._Block]", model._live)  # this replay's keys are uids (:func:`_feed`)
    held = sorted([(block.addr, block.size, key - base, 0) if key >= first else (block.addr, block.size, key, 1)
                   for key, block in live.items() if block.pool is small])
    zero = sorted([(key - base, 0) if key >= first else (key, 1) for key in cast("set[int]", model._zero)])
    chain = itertools.chain.from_iterable
    return (len(small.entries), len(held), len(zero), *chain(small.entries), *chain(held), *chain(zero))


def _rename(model: allocator.CachingAllocatorModel, first: int, shift: int) -> bool:
    """The small pool's owners of the decode steps renamed ``shift`` uids on (the steps skipped
    made the same storages, later); False where a new name is held already (not steady)."""
    live = model._live
    moved: dict[Hashable, allocator._Block] = {}
    for key in [k for k, block in live.items() if block.pool is model._small and isinstance(k, int) and k >= first]:
        moved[key + shift] = live.pop(key)
    zero = model._zero  # the keys of 0-byte requests, which hold no block
    renamed = {key for key in zero if isinstance(key, int) and key >= first}
    zero -= renamed
    shifted = {key + shift for key in renamed}
    if any(key in live or key in zero for key in moved) or any(key in live or key in zero for key in shifted):
        return False
    zero |= shifted
    live.update(moved)
    return True


def _peak_requested(steady: SteadyRun, events: np.ndarray, offset: int, nbytes: np.ndarray) -> int:
    """The most requested bytes alive after any event, read off the pre-existing births and a few of
    the written decode steps (:func:`memcalc.engine.steady_sums.stream`: requested bytes are affine
    in the step, so their maximum lies in the steps read)."""
    index, weights, read = steady_sums.stream(steady, events.size - offset)
    keys = np.concatenate([events[:offset], events[offset:][index]])
    signed = np.concatenate([np.ones(offset, dtype=np.int64), weights])
    signed *= nbytes[np.where(keys >= 0, keys, ~keys)]  # int64: exact
    signed[keys < 0] *= -1
    sums = np.cumsum(signed)[np.concatenate([np.ones(offset, dtype=bool), read])]
    return int(sums.max()) if sums.size else 0


def _stats(stats: allocator.AllocatorStats, events: np.ndarray, sizes: np.ndarray,
           nbytes: np.ndarray, peak_requested: int | None = None) -> allocator.AllocatorStats:
    """``stats`` with allocated (the blocks' ``sizes``) and requested, which the skipped events
    changed on the way, summed over every event (the peak requested: ``peak_requested`` where the
    caller read it off a few steps); each event's signed bytes one gather (:func:`_by_event`)."""
    allocated = _by_event(sizes, events, signed=True)
    np.cumsum(allocated, out=allocated)  # int64: exact
    if peak_requested is None:
        requested = _by_event(nbytes, events, signed=True)
        np.cumsum(requested, out=requested)
        peak_requested = int(requested.max()) if requested.size else 0
    at = int(np.argmax(allocated)) if allocated.size else -1  # the first maximum: one pass, not a max and an argmax
    peak = int(allocated[at]) if allocated.size else 0
    return allocator.AllocatorStats(
        peak_allocated=max(peak, 0), peak_reserved=stats.peak_reserved,
        final_allocated=int(allocated[-1]) if allocated.size else 0, final_reserved=stats.final_reserved,
        num_segments=stats.num_segments, num_mallocs=stats.num_mallocs, oom_at=None,
        peak_index=at if peak > 0 else -1,
        peak_requested=max(peak_requested, 0),
        final_segments=stats.final_segments, num_device_frees=stats.num_device_frees,
        num_alloc_retries=stats.num_alloc_retries, num_ooms=stats.num_ooms)


def _by_event(values: np.ndarray, events: np.ndarray, *, signed: bool = False) -> np.ndarray:
    """``values[uid]`` at each event (a birth ``uid``, a free ``~uid``), negated at a free when
    ``signed``: one gather from ``values`` and its reverse after it, where a free's key ``~uid ==
    -uid - 1`` indexes from the end to ``uid``'s mirror — no array of uids or signs made first."""
    table = np.concatenate([values, -values[::-1] if signed else values[::-1]])
    gathered: np.ndarray = table[events]  # (indexing, not ``take``: 1.5x faster on 2.9M events)
    return gathered


def _uids(events: np.ndarray) -> np.ndarray:
    """The storage of each event: ``uid`` for a birth, ``~key`` for a free (``key >> 63``: -1 or 0)."""
    uids: np.ndarray = events ^ (events >> 63)
    return uids

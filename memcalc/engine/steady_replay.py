"""The allocator's replay of a long generation, its small pool's steady decode steps skipped.

A generation of thousands of tokens is millions of events (:mod:`memcalc.engine.steady` writes
them out), and replaying each through the allocator model costs seconds. Yet most of them (95%
for llama-2-7b) are small-pool requests (≤ 1 MiB: one token's activations) whose rounded sizes
do not change from one decode step to the next; only the cache's ``torch.cat`` outputs grow.

The small pool is a machine of its own: a small request never touches a large-pool block, and
it reaches the driver only for a new segment. So where the small pool's state before step *j*
(every block's address, size, and owner — counted from the step's first storage for a storage
of the decode steps, by uid for an older one) is the state before step *j − 1*, and step *j*'s
small requests and frees are step *j − 1*'s (the same relative owners, the same rounded sizes),
step *j* does to the small pool what step *j − 1* did: nothing but renaming, no new segment. So
:func:`replay_generation` feeds such a step's large-pool events alone, renames the small pool's
owners once the run of such steps ends, and replays in full every step that differs. Reserved
memory changes only at a new segment, so the peak reserved is exact; allocated and requested
are sums, taken over every event in numpy (exact, int64), as is the index of their peak.

It applies to the report's unlimited replay on one stream with PyTorch's 512-B rounding and
cudaMalloc'ed segments; anything else (a capacity, expandable segments, the CPU allocator,
``roundup_power2_divisions``, another stream) is replayed event by event by the caller.
tests/test_steady_replay.py compares the two replays' stats on generations of several models.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Phase
from memcalc.core.progress import report_progress
from memcalc.engine import allocator
from memcalc.engine.timeline import Program
from memcalc.engine.trace import StepTrace

__all__ = ("REPLAYING", "SKIP_FROM", "replay_generation")

#: The progress task of the allocator's replay of a long step (here: its decode steps).
REPLAYING = "replaying allocations"

#: Decode steps from which skipping is tried (fewer replay in a moment).
SKIP_FROM = 32
#: The longest cycle of decode steps looked for (llama-2-7b: 3 or 12 steps).
MAX_PERIOD = 32

_Signature = tuple[tuple[int, int, bool, int, bool], ...]


def replay_generation(program: Program, trace: StepTrace, settings: AllocConf | None,
                      host: bool) -> allocator.AllocatorStats | None:
    """The unlimited replay's stats of a generation's ``program``, its small pool's repeated
    decode steps skipped (module docstring); None where that does not apply."""
    offset = program.iteration_starts[0]  # the pre-existing storages' births come first
    starts = [offset + start for phase, start in trace.phase_log if phase is Phase.DECODE]
    settings = settings or AllocConf()
    if (host or program.streams or program.iterations != 1 or len(starts) < SKIP_FROM
            or settings.expandable_segments or any(settings.roundup_power2_divisions)
            or len(program.events) != offset + len(trace.events)):
        return None
    events = np.asarray(program.events, dtype=np.int64)
    uids = np.where(events >= 0, events, ~events)
    nbytes = np.asarray(trace.nbytes, dtype=np.int64)
    rounded = np.where(nbytes == 0, 0, np.maximum(-(-nbytes // allocator.K_MIN_BLOCK_SIZE), 1)
                       * allocator.K_MIN_BLOCK_SIZE)
    small = (rounded <= allocator.K_SMALL_SIZE)[uids]
    model = allocator.CachingAllocatorModel(settings=settings)
    bounds = [*starts, len(events)]
    bases = _bases(events, bounds)
    if bases is None:
        return None
    first = bases[0]  # storages from here on are named relative to their step's first
    held: dict[int, int] = {}
    _feed(model, program.events[:starts[0]], trace.nbytes, held)
    widths = [y - x for x, y in itertools.pairwise(bases)]
    requests: dict[int, bytes] = {}

    def request(j: int) -> bytes:  # step j's small requests and frees, named from its first storage
        if j not in requests:
            lo, hi = bounds[j], bounds[j + 1]
            mask, step = small[lo:hi], uids[lo:hi][small[lo:hi]]
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
            _feed(model, program.events[bounds[j]:bounds[j + 1]], trace.nbytes, held)
            j += 1
            continue
        # steps j .. j + period - 1 repeat the period before them: their small pool, renamed
        shift = 0
        while j + period <= count and all(request(j + i) == request(j - period + i) for i in range(period)):
            for k in range(j, j + period):
                lo, hi = bounds[k], bounds[k + 1]
                _feed(model, events[lo:hi][~small[lo:hi]].tolist(), trace.nbytes, held)
                shift += widths[k]
            j += period
        if not _rename(model, first, shift):
            return None
    report_progress(REPLAYING, count, count)
    sizes = rounded.copy()  # a small block is its request rounded (the small pool splits off any rest)
    sizes[np.fromiter(held, dtype=np.int64, count=len(held))] = np.fromiter(held.values(), dtype=np.int64,
                                                                           count=len(held))
    return _stats(model.stats(), events, uids, sizes, nbytes)


def _bases(events: np.ndarray, bounds: Sequence[int]) -> list[int] | None:
    """The first storage born in each decode step, and the one after the last; None when a
    step is born nothing or its storages are not numbered after the step before's."""
    out = []
    for a, b in itertools.pairwise(bounds):
        births = events[a:b][events[a:b] >= 0]
        if not births.size:
            return None
        out.append(int(births.min()))
    out.append(int(events.max()) + 1)
    return out if all(x < y for x, y in itertools.pairwise(out)) else None


def _feed(model: allocator.CachingAllocatorModel, events: Sequence[int], nbytes: Sequence[int],
          held: dict[int, int]) -> None:
    """Replay ``events``, noting the block each birth was handed (``held``: uid -> bytes; a
    large-pool block may be larger than the request rounded, when not worth splitting)."""
    malloc, free, live = model.malloc, model.free, model._live
    for event in events:
        if event >= 0:
            malloc(event, nbytes[event])
            block = live.get(event)
            if block is not None:
                held[event] = block.size
        else:
            free(~event)


def _small_state(model: allocator.CachingAllocatorModel, first: int, base: int) -> _Signature:
    """Every block of the small pool by address: its size, whether handed out, its owner (from
    ``base`` for a storage of the decode steps, else by uid, flagged)."""
    blocks = [(block.addr, block.size, True, key) for key, block in model._live.items() if block.pool is model._small]
    blocks += [(block.addr, block.size, False, -1) for block in model._small.blocks.values()]
    out: list[tuple[int, int, bool, int, bool]] = []
    for addr, size, held, key in sorted(blocks, key=lambda block: block[0]):
        owner = key if isinstance(key, int) else -2  # the decode steps' keys are uids
        old = held and owner < first
        out.append((addr, size, held, owner if old or not held else owner - base, old))
    for key in sorted(k for k in model._zero if isinstance(k, int)):  # 0-byte requests: no block, a key
        out.append((-1, 0, True, key if key < first else key - base, key < first))
    return tuple(out)


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


def _stats(stats: allocator.AllocatorStats, events: np.ndarray, uids: np.ndarray, sizes: np.ndarray,
           nbytes: np.ndarray) -> allocator.AllocatorStats:
    """``stats`` with allocated (the blocks' ``sizes``) and requested, which the skipped events
    changed on the way, summed over every event."""
    births = events >= 0
    allocated = np.cumsum(np.where(births, sizes[uids], -sizes[uids]))
    requested = np.cumsum(np.where(births, nbytes[uids], -nbytes[uids]))
    peak = int(allocated.max()) if allocated.size else 0
    return allocator.AllocatorStats(
        peak_allocated=max(peak, 0), peak_reserved=stats.peak_reserved,
        final_allocated=int(allocated[-1]) if allocated.size else 0, final_reserved=stats.final_reserved,
        num_segments=stats.num_segments, num_mallocs=stats.num_mallocs, oom_at=None,
        peak_index=int(np.argmax(allocated)) if peak > 0 else -1,
        peak_requested=max(int(requested.max()) if requested.size else 0, 0),
        final_segments=stats.final_segments, num_device_frees=stats.num_device_frees,
        num_alloc_retries=stats.num_alloc_retries, num_ooms=stats.num_ooms)

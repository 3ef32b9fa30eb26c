"""A replayable model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

memcalc runs a training step on meta tensors and records when storages are allocated and
freed. Summing live tensor bytes gives a lower bound on GPU memory; what ``nvidia-smi`` and
``torch.cuda.max_memory_reserved()`` show depends on how the caching allocator rounds,
packs, splits and caches those requests. This module replays the recorded sequence through
a faithful model of the native allocator (PyTorch 2.4–2.11), under its default settings or
those of ``PYTORCH_CUDA_ALLOC_CONF`` (:class:`~memcalc.core.alloc_conf.AllocConf`), and
reports the two numbers ``torch.cuda.memory_stats()`` would: peak ``allocated_bytes`` and
peak ``reserved_bytes``.

Modelled (``DeviceCachingAllocator``'s rules): 512 B rounding, small and large pools split by
stream, segment sizes, best-fit reuse with the ``max_split_size`` rules,
``roundup_power2_divisions``, splitting and coalescing, a capacity with the free-and-retry
before an OOM, ``garbage_collection_threshold``, expandable segments and ``empty_cache``.
Left out: ``recordStream`` and cross-stream events, CUDA graph pools, ``cudaMallocAsync``.
Segments are placed as the CUDA driver placed them; the model makes every cudaMalloc of the
fourteen real H100 snapshots in ``tests/data/gpu/`` (``tests/test_real_snapshots.py``).

With ``host=True`` the same class is c10's CPU allocator: one exact ``malloc`` per request,
nothing cached — what ``torch.profiler``'s ``[memory]`` events add up to on a CPU step.

After an OOM the real allocator raises. The model records the first failing event in
``oom_at`` and carries on as if the cudaMalloc had succeeded (it *over-commits*), so the
peaks reported for a run past its OOM are what the run would have needed without a limit.

Each rule with its C++ function, and the placement: docs/notes/caching-allocator.md.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memcalc.core.alloc_conf import AllocConf
from memcalc.engine.collector import collector_paused

__all__ = (
    "ALLOC",
    "EMPTY_CACHE",
    "FREE",
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "MAX_SPLIT_SIZE",
    "VA_GRANULARITY",
    "AllocatorStats",
    "AlreadyLiveError",
    "CachingAllocatorModel",
    "KeyStateError",
    "NotLiveError",
    "RecordedReplay",
    "RecordingAllocatorModel",
    "replay",
    "replay_keys",
    "replay_recorded",
    "replay_with_prefix",
    "round_size",
    "segment_size",
)


class KeyStateError(Exception):
    """An event the program's order makes impossible: a free of a key that is not live
    (:class:`NotLiveError`), or an allocation under a key that is (:class:`AlreadyLiveError`).
    The replayed program is wrong (a bug of its builder), and ``key`` lets the builder name the
    storage."""

    def __init__(self, key: Hashable, message: str) -> None:
        super().__init__(message)
        self.key = key


class NotLiveError(KeyStateError, KeyError):
    """A free of a key that is not a live allocation."""


class AlreadyLiveError(KeyStateError, ValueError):
    """An allocation under a key that is live already."""


# --- Constants, each named after its C++ counterpart -------------------------------------

K_MIN_BLOCK_SIZE = 512  # CUDACachingAllocator.cpp `kMinBlockSize`: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # CUDACachingAllocator.cpp `kSmallSize`: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # CUDACachingAllocator.cpp `kSmallBuffer`: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20971520  # CUDACachingAllocator.cpp `kLargeBuffer`: "large" allocations may be packed in 20 MiB blocks
# CUDACachingAllocator.cpp `kMinLargeAlloc`: allocations between 1 and 10 MiB may use kLargeBuffer
K_MIN_LARGE_ALLOC = 10485760
K_ROUND_LARGE = 2097152  # CUDACachingAllocator.cpp `kRoundLarge`: round up large allocations to 2 MiB
# CUDAAllocatorConfig::parseArgs default `m_max_split_size = std::numeric_limits<size_t>::max()`
MAX_SPLIT_SIZE = 2**64 - 1

# Event kinds understood by `replay`.
ALLOC = 1  # (ALLOC, key, nbytes): a storage of nbytes is allocated under `key`
FREE = -1  # (FREE, key, 0): the storage allocated under `key` is freed
EMPTY_CACHE = 0  # (EMPTY_CACHE, None, 0): torch.cuda.empty_cache()

# Expandable segments reserve address space for 1 1/8 of the GPU's memory (``find_expandable_block``);
# here a fixed 1 TiB per segment, more than any GPU's 1 1/8: only its being larger than any block matters.
EXPANDABLE_ADDRESS_SPACE = 1 << 40
# Where the expandable segments' address ranges begin (below the cudaMalloc'ed ones; each pool's
# segment has its own range, so only the order within one pool matters, as for segments).
_FIRST_EXPANDABLE_ADDRESS = 0x100000000000

# Where the fake cudaMalloc's address space ends: its first segment lies just below (a typical
# device address; only the order of addresses matters, for the best-fit tie-break).
_FIRST_SEGMENT_ADDRESS = 0x7F0000000000
# The granularity of the virtual address ranges the CUDA driver reserves for a cudaMalloc, read off
# the H100 snapshots (driver 580, CUDA 13.0): a segment that fits in no free range is placed at the
# top of a new range of its size rounded up to 32 MiB, each new range just below the last (74 and
# 78 MiB segments 96 MiB apart, 196 MiB ones 224 apart, 1,572 MiB ones 1,600 apart); a later
# segment takes the lowest free range it fits, such as the tail of a 36 MiB segment's 64 MiB.
VA_GRANULARITY = 33554432


def round_size(nbytes: int, settings: AllocConf | None = None) -> int:
    """Bytes the allocator sets aside for a request of ``nbytes`` (``round_size`` in the C++).

    Requests under 512 B take 512 B; larger ones round up to a multiple of 512 B, or, under
    ``roundup_power2_divisions``, to the next of that many equal divisions of their power-of-two
    interval (:func:`roundup_power2_next_division`) when that is coarser than 512 B. A 0-byte
    request never reaches the allocator, so it costs 0 here rather than 512.
    """
    if nbytes < 0:
        raise ValueError(f"a request size cannot be negative, got {nbytes}")
    if nbytes == 0:
        return 0
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = settings.divisions_for(nbytes) if settings is not None else 0
    if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(nbytes, divisions)
    return K_MIN_BLOCK_SIZE * ((nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` rounded up to the next of ``divisions`` equal
    steps between the powers of two around it (1200 with 4 divisions: 1024, 1280, 1536, 1792 →
    1280); a power of two stays as it is."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)  # power2_floor >> log2(divisions)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def segment_size(rounded: int) -> int:
    """Size of the segment cudaMalloc'ed when no cached block fits (``get_allocation_size``).

    Small requests get a 2 MiB segment to pack into; mid-sized ones (1–10 MiB) a 20 MiB one
    so later requests of that class can share it; large ones only round up to 2 MiB.
    """
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclass(frozen=True)
class AllocatorStats:
    """What a replay reports; byte counts match ``torch.cuda.memory_stats()`` "all" entries."""

    peak_allocated: int  # max over time of the sizes of live blocks ("allocated_bytes.all.peak")
    peak_reserved: int  # max over time of the sizes of live segments ("reserved_bytes.all.peak")
    final_allocated: int  # allocated bytes after the last event
    final_reserved: int  # reserved bytes after the last event
    num_segments: int  # segments ever cudaMalloc'ed, released ones included
    num_mallocs: int  # successful cudaMalloc calls ("num_device_alloc"); equals num_segments here
    oom_at: int | None  # index of the first event that could not be satisfied under the capacity
    peak_index: int  # index of the event at which peak_allocated was first reached (-1: never)
    peak_requested: int = 0  # max over time of the unrounded bytes requested ("requested_bytes.all.peak")
    final_segments: int = 0  # segments still held after the last event
    num_device_frees: int = 0  # segments cudaFree'd, by OOM recovery or empty_cache ("num_device_free")
    num_alloc_retries: int = 0  # cudaMallocs retried after releasing the cache ("num_alloc_retries")
    num_ooms: int = 0  # events that could not be satisfied under the capacity ("num_ooms")
    #: ``(stream, bytes)`` of each stream's pools at peak_reserved, when more than one stream
    #: allocated (empty: the compute stream's alone); they add up to peak_reserved
    peak_reserved_by_stream: tuple[tuple[int, int], ...] = ()


class _Block:
    """A contiguous range of one segment, either handed out or cached (C++ ``Block``).

    In an expandable segment (``segment`` set) a block may also be a range of address space no
    physical page backs (``mapped`` False), kept in its pool's ``unmapped`` set."""

    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "pool", "prev", "requested", "segment", "size")

    def __init__(self, addr: int, size: int, pool: _Pool, segment: _Expandable | None = None) -> None:
        self.addr = addr
        self.size = size
        self.pool = pool
        self.prev: _Block | None = None  # the block just before this one in its segment
        self.next: _Block | None = None  # the block just after this one in its segment
        self.allocated = False
        self.requested = 0
        self.mapped = True
        self.segment = segment  # the expandable segment it lies in (None: a cudaMalloc'ed one)
        self.gc_base = 0  # the pool's get_free_block calls when it was cached (``gc_count_base``)

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        """Put this block between ``before`` and ``after`` (``Block::splice``)."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class _Expandable:
    """One expandable segment (``ExpandableSegment``): a range of address space reserved once,
    into which physical pages of ``page`` bytes are mapped as the pool needs them."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int) -> None:
        self.base = base
        self.page = page
        self.size = size

    def pages_covering(self, addr: int, size: int) -> tuple[int, int]:
        """Addresses of the pages touching ``[addr, addr + size)`` (``map``: ``segmentLeft``, ``segmentRight``)."""
        begin = (addr - self.base) // self.page
        end = -(-(addr + size - self.base) // self.page)
        return self.base + begin * self.page, self.base + end * self.page

    def pages_within(self, addr: int, size: int) -> tuple[int, int]:
        """Addresses of the pages wholly inside ``[addr, addr + size)`` (``unmap``: ``segmentRight``,
        ``segmentLeft``); an empty range when none is."""
        begin = -(-(addr - self.base) // self.page)
        end = (addr + size - self.base) // self.page
        return self.base + begin * self.page, self.base + max(begin, end) * self.page


class _Clock:
    """``get_free_blocks_call_count`` of one C++ ``BlockPool``, which the streams' blocks of that
    pool share: the clock garbage collection ages cached blocks by."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0


class _Pool:
    """Cached free blocks of one pool (C++ ``BlockPool``) on one stream, ordered as
    ``BlockComparatorSize``.

    The C++ set holds every stream's blocks ordered by (stream, size, address), and
    ``get_free_block`` takes the lower bound of (the request's stream, its size) and gives up when
    that block is another stream's: a search never leaves its stream. So each stream's part of the
    set is a pool here, and ``entries``, a sorted list of ``(size, address)``, is exactly that
    part's order: ``bisect`` finds the block ``std::set::lower_bound`` would. The unmapped ranges
    of expandable segments are kept apart, by address (``unmapped``, ``BlockComparatorAddress``,
    which compares the stream first too); ``clock`` counts ``get_free_block`` calls on the C++
    pool, all streams, while garbage collection is on (``get_free_blocks_call_count``).
    """

    __slots__ = ("blocks", "clock", "entries", "is_small", "stream", "unmapped")

    def __init__(self, is_small: bool, stream: int = 0, clock: _Clock | None = None) -> None:
        self.is_small = is_small
        self.stream = stream
        self.entries: list[tuple[int, int]] = []
        self.blocks: dict[int, _Block] = {}  # address -> cached block
        self.unmapped: dict[int, _Block] = {}  # address -> unmapped range of an expandable segment
        self.clock = clock if clock is not None else _Clock()

    def insert(self, block: _Block) -> None:
        """``insert_into_blocks``: cache ``block``, stamping its age for garbage collection."""
        block.gc_base = self.clock.calls
        bisect.insort(self.entries, (block.size, block.addr))
        self.blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        entries = self.entries
        i = bisect.bisect_left(entries, (block.size, block.addr))
        if i == len(entries) or entries[i] != (block.size, block.addr):
            raise AssertionError(f"block at {block.addr:#x} is not cached in this pool")
        del entries[i]
        del self.blocks[block.addr]


class CachingAllocatorModel:
    """The allocator's state, driven one request at a time.

    Every call to :meth:`malloc`, :meth:`free` and :meth:`empty_cache` is one *event*; events
    are numbered from 0 in call order, and ``oom_at``/``peak_index`` refer to those numbers
    (so :func:`replay` reports the index of the event in its input).
    """

    def __init__(self, capacity: int | None = None, segment_addresses: Iterable[int] | None = None,
                 settings: AllocConf | None = None, *, host: bool = False) -> None:
        """``capacity``: bytes cudaMalloc may hand out in all (None: unlimited).

        ``host``: the CPU allocator instead (module docstring): every request its own segment
        of exactly its bytes, given back at its free; ``settings`` do not apply to it.

        ``settings``: ``PYTORCH_CUDA_ALLOC_CONF`` (None: PyTorch's defaults).

        ``segment_addresses``: the addresses cudaMalloc returns, in order — a real run's, read
        from its snapshot, so that the best-fit tie-break between equal-sized cached blocks
        (``BlockComparatorSize`` orders them by address) falls as it fell there. Where they run
        out, or one would overlap a segment held, the model's own addresses go on: the driver's
        placement (:data:`VA_GRANULARITY`), below every segment held.
        """
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity cannot be negative, got {capacity}")
        self.capacity = capacity
        self.host = host
        self.settings = settings or AllocConf()
        self._max_split = self.settings.max_split_size or MAX_SPLIT_SIZE
        self._expandable = self.settings.expandable_segments
        # round_size's settings: None without roundup_power2_divisions (no look-up per request then)
        self._rounding = self.settings if any(self.settings.roundup_power2_divisions) else None
        # garbage_collect_cached_blocks runs only under set_per_process_memory_fraction, which the
        # capacity stands for (``set_fraction && garbage_collection_threshold() > 0``)
        self._gc_threshold = self.settings.garbage_collection_threshold if capacity is not None else 0.0
        self._next_expandable = _FIRST_EXPANDABLE_ADDRESS
        self._mapped = 0  # bytes of physical pages mapped in expandable segments
        self._given_addresses = iter(segment_addresses) if segment_addresses is not None else None
        self._small = _Pool(is_small=True)
        self._large = _Pool(is_small=False)
        # stream -> its (small, large) pools; the compute stream, 0, is the one a single GPU uses
        self._pools: dict[int, tuple[_Pool, _Pool]] = {0: (self._small, self._large)}
        self._stream_reserved: dict[int, int] = {}  # stream -> bytes of its segments and mapped pages
        self._peak_stream_reserved: dict[int, int] = {}  # the same at the peak of reserved
        self._live: dict[Hashable, _Block] = {}
        self._zero: set[Hashable] = set()  # keys of 0-byte allocations: nothing to free
        self._segments: dict[int, int] = {}  # base address -> size of every segment held
        self._next_address = _FIRST_SEGMENT_ADDRESS  # the bottom of the address ranges reserved so far
        self._free_ranges: list[tuple[int, int]] = []  # (base, size) of reserved address ranges no segment holds
        self._own: set[int] = set()  # the bases of the segments placed by the model's own placement
        self._events = 0
        self._allocated = 0
        self._reserved = 0
        self._requested = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._peak_requested = 0
        self._peak_index = -1
        self._num_segments = 0
        self._num_device_frees = 0
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._oom_at: int | None = None

    # --- public state -------------------------------------------------------------------

    @property
    def allocated(self) -> int:
        """Bytes in blocks handed out now (``memory_allocated()``)."""
        return self._allocated

    @property
    def reserved(self) -> int:
        """Bytes in segments held now (``memory_reserved()``)."""
        return self._reserved

    @property
    def num_segments(self) -> int:
        """Segments cudaMalloc'ed so far (``num_segments`` of :meth:`stats`)."""
        return self._num_segments

    @property
    def num_device_frees(self) -> int:
        """Segments released so far: an empty cache or a capacity's release (``num_device_frees``)."""
        return self._num_device_frees

    @property
    def peak_allocated(self) -> int:
        """The highest :attr:`allocated` so far (``max_memory_allocated()``)."""
        return self._peak_allocated

    @property
    def peak_reserved(self) -> int:
        """The highest :attr:`reserved` so far (``max_memory_reserved()``)."""
        return self._peak_reserved

    @property
    def oom_at(self) -> int | None:
        """Index of the first allocation that did not fit under the capacity, or None."""
        return self._oom_at

    def stats(self) -> AllocatorStats:
        """A snapshot of the counters so far."""
        return AllocatorStats(
            peak_allocated=self._peak_allocated,
            peak_reserved=self._peak_reserved,
            final_allocated=self._allocated,
            final_reserved=self._reserved,
            num_segments=self._num_segments,
            num_mallocs=self._num_segments,
            oom_at=self._oom_at,
            peak_index=self._peak_index,
            peak_requested=self._peak_requested,
            final_segments=len(self._segments),
            num_device_frees=self._num_device_frees,
            num_alloc_retries=self._num_alloc_retries,
            num_ooms=self._num_ooms,
            peak_reserved_by_stream=self._reserved_by_stream_at_peak(),
        )

    def _reserved_by_stream_at_peak(self) -> tuple[tuple[int, int], ...]:
        if len(self._pools) == 1:
            return ()
        # no snapshot: the peak came before any other stream allocated, so it was the compute stream's
        at_peak = self._peak_stream_reserved or {0: self._peak_reserved}
        return tuple(sorted((stream, nbytes) for stream, nbytes in at_peak.items() if nbytes))

    def address_of(self, key: Hashable) -> int:
        """Fake device address of a live allocation (for tests and debugging)."""
        return self._live[key].addr

    def block_size_of(self, key: Hashable) -> int:
        """Size of the block backing a live allocation: its share of ``allocated``."""
        return self._live[key].size

    def segments(self) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
        """Held segments as ``(base, size, [(address, size, allocated), ...])``, by address.

        O(number of blocks); meant for tests and debugging, like ``torch.cuda.memory_snapshot()``.
        """
        every = list(self._live.values()) + [b for pool in self._every_pool() for b in pool.blocks.values()]
        blocks = sorted((b for b in every if b.segment is None), key=lambda b: b.addr)
        result = []
        i = 0
        for base in sorted(self._segments):
            size = self._segments[base]
            parts = []
            while i < len(blocks) and blocks[i].addr < base + size:
                parts.append((blocks[i].addr, blocks[i].size, blocks[i].allocated))
                i += 1
            result.append((base, size, parts))
        return sorted(result + self._mapped_runs(b for b in every if b.segment is not None))

    @staticmethod
    def _mapped_runs(blocks: Iterable[_Block]) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
        """Each contiguous mapped range of the expandable segments as one segment, as
        ``DeviceCachingAllocator::snapshot`` reports them."""
        runs: list[tuple[int, int, list[tuple[int, int, bool]]]] = []
        for block in sorted(blocks, key=lambda b: b.addr):
            if runs and runs[-1][0] + runs[-1][1] == block.addr:
                base, size, parts = runs[-1]
                runs[-1] = (base, size + block.size, [*parts, (block.addr, block.size, block.allocated)])
            else:
                runs.append((block.addr, block.size, [(block.addr, block.size, block.allocated)]))
        return runs

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the state is inconsistent. O(blocks); for tests."""
        live_total = sum(b.size for b in self._live.values())
        assert live_total == self._allocated, (live_total, self._allocated)
        assert sum(self._segments.values()) + self._mapped == self._reserved
        assert sum(self._stream_reserved.values()) == self._reserved
        for pool in self._every_pool():
            assert pool.entries == sorted(pool.entries)
            assert len(pool.entries) == len(pool.blocks)
            for size, addr in pool.entries:
                block = pool.blocks[addr]
                assert block.size == size and not block.allocated and block.pool is pool
                # free_block always merges free neighbours, so two never sit side by side
                assert block.prev is None or block.prev.allocated or not block.prev.mapped
                assert block.next is None or block.next.allocated or not block.next.mapped
        for base, size, parts in self.segments():
            assert parts and parts[0][0] == base, f"segment {base:#x} does not start with a block"
            end = base
            for addr, bsize, _ in parts:
                assert addr == end, f"gap or overlap at {addr:#x}"
                end += bsize
            assert end == base + size, f"segment {base:#x} blocks do not add up"

    # --- events -------------------------------------------------------------------------

    def malloc(self, key: Hashable, nbytes: int, stream: int = 0) -> None:
        """Allocate ``nbytes`` under ``key`` on ``stream`` (``DeviceCachingAllocator::malloc``):
        from that stream's pools only, and freed back into them (the host allocator has none)."""
        index = self._events
        self._events += 1
        if key in self._live or key in self._zero:
            raise AlreadyLiveError(key, f"allocation key {key!r} is already live")
        size = nbytes if self.host else round_size(nbytes, self._rounding)
        if size == 0:
            self._zero.add(key)
            return
        small, large = self._pools_of(stream) if stream and not self.host else (self._small, self._large)
        pool = small if size <= K_SMALL_SIZE else large
        block = None if self.host else self._get_free_block(pool, size)
        if block is None:
            block = self._new_block(pool, size, index)
        if not self.host and self._should_split(block, size):
            block = self._split(block, size)
        block.allocated = True
        block.requested = nbytes
        self._live[key] = block
        self._allocated += block.size
        self._requested += nbytes
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
            self._peak_index = index
        if self._requested > self._peak_requested:
            self._peak_requested = self._requested

    def feed(self, events: Sequence[int], nbytes: Sequence[int] | Mapping[int, int],
             rounded: Sequence[int] | Mapping[int, int], held: dict[int, int]) -> None:
        """Replay ``events`` (a uid: its storage of ``nbytes[uid]`` is allocated; ``~uid``: freed) on
        the compute stream, noting in ``held`` each block handed out larger than ``rounded[uid]``
        (a large-pool block not worth splitting). ``rounded[uid]`` must be
        ``round_size(nbytes[uid])``; both are read for the uids born only (a list by uid, or a dict).

        The same decisions as :meth:`malloc` and :meth:`free`, inlined for the case of most
        replays — no garbage collection, cudaMalloc'ed segments, 512-B rounding, ``max_split_size``
        unlimited — where best fit, split and merge are all there is; a request no cached block
        fits (a new segment: the only place a capacity is met, freeing the cache and retrying), and
        any other setting, goes through :meth:`malloc`. A generation's replay feeds millions of
        events (:mod:`memcalc.engine.steady_replay`); the batch search's replays under a capacity
        thousands (:func:`memcalc.search.affine.replay_under`)."""
        live, zero = self._live, self._zero
        if (self.host or self._expandable or self._rounding is not None
                or self._max_split != MAX_SPLIT_SIZE or self._gc_threshold > 0.0):
            for event in events:
                if event >= 0:
                    self.malloc(event, nbytes[event])
                    block = live.get(event)
                    if block is not None and block.size != rounded[event]:
                        held[event] = block.size
                else:
                    self.free(~event)
            return
        small, large = self._small, self._large
        bisect_left, insort = bisect.bisect_left, bisect.insort
        for event in events:
            if event >= 0:
                size = rounded[event]
                pool = small if size <= K_SMALL_SIZE else large
                entries = pool.entries
                i = bisect_left(entries, (size,))
                if size == 0 or i == len(entries) or event in live or event in zero:
                    self.malloc(event, nbytes[event])  # a 0-byte request, a new segment, an error
                    block = live.get(event)
                    if block is not None and block.size != size:
                        held[event] = block.size
                    continue
                self._events += 1
                addr = entries[i][1]
                del entries[i]
                block = pool.blocks.pop(addr)
                remaining = block.size - size
                if remaining >= K_MIN_BLOCK_SIZE if pool is small else remaining > K_SMALL_SIZE:  # _should_split
                    front = _Block(addr, size, pool)  # _split
                    before = block.prev
                    front.prev = before
                    if before is not None:
                        before.next = front
                    front.next = block
                    block.prev = front
                    block.addr = addr + size
                    block.size = remaining
                    block.gc_base = pool.clock.calls
                    insort(entries, (remaining, addr + size))
                    pool.blocks[addr + size] = block
                    block = front
                elif remaining:
                    held[event] = block.size
                requested = nbytes[event]
                block.allocated = True
                block.requested = requested
                live[event] = block
                self._allocated += block.size
                self._requested += requested
                if self._allocated > self._peak_allocated:
                    self._peak_allocated = self._allocated
                    self._peak_index = self._events - 1
                if self._requested > self._peak_requested:
                    self._peak_requested = self._requested
                continue
            key = ~event
            block = live.pop(key, None)
            if block is None:
                self.free(key)  # a 0-byte request's key, or an error
                continue
            self._events += 1
            self._allocated -= block.size
            self._requested -= block.requested
            block.allocated = False
            block.requested = 0
            pool = block.pool
            entries, blocks = pool.entries, pool.blocks
            for side in (block.prev, block.next):  # _free_block: _try_merge with each free neighbour
                if side is None or side.allocated:
                    continue
                del entries[bisect_left(entries, (side.size, side.addr))]
                del blocks[side.addr]
                if side is block.prev:
                    block.addr = side.addr
                    block.prev = side.prev
                    if side.prev is not None:
                        side.prev.next = block
                else:
                    block.next = side.next
                    if side.next is not None:
                        side.next.prev = block
                block.size += side.size
            block.gc_base = pool.clock.calls
            insort(entries, (block.size, block.addr))
            blocks[block.addr] = block

    def _new_block(self, pool: _Pool, size: int, index: int) -> _Block:
        """A block from new memory when no cached block fits (``malloc``'s resorts, in order):
        collect garbage, cudaMalloc (or map pages), free enough oversize cached blocks and
        retry, free every unsplit cached block and retry; else an OOM, and the model goes on."""
        alloc_size = size if self.host else segment_size(size)
        if self._gc_threshold > 0.0:
            self._garbage_collect()
        block = self._alloc_block(pool, alloc_size, size=size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, alloc_size, size=size)
        if block is None:
            self._release_cached_blocks()
            self._num_alloc_retries += 1
            block = self._alloc_block(pool, alloc_size, size=size)
        if block is None:
            self._num_ooms += 1
            if self._oom_at is None:
                self._oom_at = index
            block = self._alloc_block(pool, alloc_size, force=True, size=size)
            assert block is not None
        return block

    def free(self, key: Hashable) -> None:
        """Free the allocation made under ``key`` (``DeviceCachingAllocator::free``)."""
        self._events += 1
        if key in self._zero:
            self._zero.discard(key)
            return
        try:
            block = self._live.pop(key)
        except KeyError:
            raise NotLiveError(key, f"free of {key!r}, which is not a live allocation") from None
        self._allocated -= block.size
        self._requested -= block.requested
        block.allocated = False
        block.requested = 0
        if self.host:
            self._return_to_host(block)
        else:
            self._free_block(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: cudaFree every cached segment with no live block."""
        self._events += 1
        self._release_cached_blocks()

    # --- the allocator's internals ------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """Best fit: the smallest cached block ≥ size, lowest address first (``get_free_block``),
        with the ``max_split_size`` rules for oversize blocks. In an expandable segment a block
        counts as the size it can grow to (itself and the unmapped range after it)."""
        if self._gc_threshold > 0.0:
            pool.clock.calls += 1  # tracked only while garbage collection is on
        entries = pool.entries
        # (size,) sorts before every (size, address): the C++ search key has ptr == nullptr.
        i = bisect.bisect_left(entries, (size,))
        if i == len(entries):
            return None
        block = pool.blocks[entries[i][1]]
        if block.segment is not None:
            while i + 1 < len(entries) and block.segment is not None:
                following = pool.blocks[entries[i + 1][1]]
                if _expandable_size(following) >= _expandable_size(block):
                    break
                i, block = i + 1, following
        max_split = self._max_split
        # Do not return an oversized block for a large request
        if size < max_split and block.size >= max_split:
            return None
        # Allow oversized block size to be rounded up but within a limit
        if size >= max_split and block.size >= size + K_LARGE_BUFFER:
            return None
        del entries[i]
        return pool.blocks.pop(block.addr)

    def _should_split(self, block: _Block, size: int) -> bool:
        """Whether the remainder is worth keeping as its own block (``should_split``).

        Small pool, and every pool under expandable segments: any remainder of at least 512 B.
        Large pool: only a remainder of more than 1 MiB (a smaller one could only ever serve
        small requests, which never come to the large pool), and never for requests of
        ``max_split_size`` or more.
        """
        remaining = block.size - size
        if block.pool.is_small or self._expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    @staticmethod
    def _split(block: _Block, size: int) -> _Block:
        """Carve ``size`` bytes off the front of ``block``; cache the rest (``alloc_found_block``)."""
        front = _Block(block.addr, size, block.pool, block.segment)
        front.prev = block.prev
        if front.prev is not None:
            front.prev.next = front
        front.next = block
        block.prev = front
        block.addr += size
        block.size -= size
        block.pool.insert(block)
        return front

    def _free_block(self, block: _Block) -> None:
        """Return a block to its pool, merging free neighbours (``free_block``/``try_merge_blocks``)."""
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        block.pool.insert(block)

    @staticmethod
    def _try_merge(dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: ``src``, a free neighbour of ``dst`` mapped as it is, joins it."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        pool = dst.pool
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[src.addr]
        if dst.prev is src:  # [src dst] -> one block at src's address
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _alloc_block(self, pool: _Pool, alloc_size: int, force: bool = False, size: int = 0) -> _Block | None:
        """cudaMalloc a new segment, or None if it would exceed the capacity (``alloc_block``);
        under expandable segments, map pages for ``size`` bytes instead. The capacity test is
        on ``alloc_size`` in both cases, as in the C++.

        ``force`` ignores the capacity: the model's way of going on past an OOM.
        """
        if not force and self.capacity is not None and self._reserved + alloc_size > self.capacity:
            return None
        if self._expandable:
            return self._allocate_expandable(pool, size)
        base = self._segment_address(alloc_size)
        self._segments[base] = alloc_size
        self._num_segments += 1
        self._grow(pool.stream, alloc_size)
        return _Block(base, alloc_size, pool)

    def _grow(self, stream: int, nbytes: int) -> None:
        """Reserved grows by ``nbytes`` on ``stream`` (a segment, or pages mapped)."""
        self._reserved += nbytes
        self._stream_reserved[stream] = self._stream_reserved.get(stream, 0) + nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
            if len(self._pools) > 1:
                self._peak_stream_reserved = dict(self._stream_reserved)

    def _shrink(self, stream: int, nbytes: int) -> None:
        """Reserved shrinks by ``nbytes`` on ``stream`` (a segment freed, or pages unmapped)."""
        self._reserved -= nbytes
        self._stream_reserved[stream] -= nbytes

    def _pools_of(self, stream: int) -> tuple[_Pool, _Pool]:
        """The (small, large) pools of ``stream``, made at its first allocation; a stream's pools
        share the C++ pool's garbage-collection clock."""
        pools = self._pools.get(stream)
        if pools is None:
            pools = self._pools[stream] = (_Pool(True, stream, self._small.clock),
                                           _Pool(False, stream, self._large.clock))
        return pools

    def _every_pool(self) -> list[_Pool]:
        """Every pool, in the order ``release_cached_blocks`` walks them: the large blocks of every
        stream, then the small ones, each stream in ``BlockComparatorSize``'s order."""
        streams = sorted(self._pools.items())
        return [large for _, (_, large) in streams] + [small for _, (small, _) in streams]

    def _segment_address(self, size: int) -> int:
        """Where the next segment of ``size`` bytes lies: the next given address when it
        overlaps no segment held, else where the driver would put it (:data:`VA_GRANULARITY`):
        the lowest free address range it fits, else the top of a new range of ``size`` rounded
        up to the granularity, below all the others (its tail left free)."""
        given = next(self._given_addresses, None) if self._given_addresses is not None else None
        if given is not None and not self._overlaps(given, size):
            return given
        for i, (base, length) in enumerate(self._free_ranges):
            if length >= size:
                if length > size:
                    self._free_ranges[i] = (base + size, length - size)
                else:
                    del self._free_ranges[i]
                self._own.add(base)
                return base
        reserved = -(-size // VA_GRANULARITY) * VA_GRANULARITY
        self._next_address -= reserved
        base = self._next_address
        if reserved > size:
            bisect.insort(self._free_ranges, (base + size, reserved - size))
        self._own.add(base)
        return base

    def _release_address(self, base: int, size: int) -> None:
        """A cudaFree'd segment's addresses go back to the free ranges, merged with free
        neighbours: the next cudaMalloc may take them (the model's own placement only)."""
        i = bisect.bisect_left(self._free_ranges, (base, size))
        if i < len(self._free_ranges) and self._free_ranges[i][0] == base + size:  # [base, size)[next]
            size += self._free_ranges.pop(i)[1]
        if i > 0 and sum(self._free_ranges[i - 1]) == base:  # [previous][base, size)
            previous, length = self._free_ranges.pop(i - 1)
            base, size, i = previous, length + size, i - 1
        self._free_ranges.insert(i, (base, size))

    def _overlaps(self, base: int, size: int) -> bool:
        return any(start < base + size and base < start + length for start, length in self._segments.items())

    def seed_segment(self, base: int, size: int, small: bool, live: Iterable[tuple[int, Hashable, int, int]],
                     stream: int = 0) -> None:
        """Put a segment that was already held before the events begin, with its live blocks
        ``(offset, key, block size, requested bytes)``, on ``stream``; the gaps between them are
        cached free blocks. For replaying a real snapshot whose trace starts mid-run (the cuBLAS
        workspaces and whatever else was allocated before recording began)."""
        if self._overlaps(base, size):
            raise ValueError(f"seeded segment at {base:#x} overlaps one already held")
        small_pool, large_pool = self._pools_of(stream)
        pool = small_pool if small else large_pool
        self._segments[base] = size
        self._num_segments += 1
        self._grow(stream, size)
        self._next_address = min(self._next_address, base)
        previous: _Block | None = None
        cursor = base
        for offset, key, block_size, requested in sorted(live, key=lambda part: part[0]):
            if base + offset < cursor or offset + block_size > size:
                raise ValueError(f"seeded block at offset {offset} does not fit in its segment")
            if base + offset > cursor:
                previous = self._seed_block(pool, cursor, base + offset - cursor, previous, None, 0)
            previous = self._seed_block(pool, base + offset, block_size, previous, key, requested)
            cursor = base + offset + block_size
        if cursor < base + size:
            self._seed_block(pool, cursor, base + size - cursor, previous, None, 0)

    def _seed_block(self, pool: _Pool, addr: int, size: int, previous: _Block | None, key: Hashable,
                    requested: int) -> _Block:
        block = _Block(addr, size, pool)
        block.prev = previous
        if previous is not None:
            previous.next = block
        if key is None:
            pool.insert(block)
            return block
        if key in self._live:
            raise AlreadyLiveError(key, f"allocation key {key!r} is already live")
        block.allocated = True
        block.requested = requested
        self._live[key] = block
        self._allocated += size
        self._requested += requested
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        self._peak_requested = max(self._peak_requested, self._requested)
        return block

    def _release_cached_blocks(self) -> None:
        """cudaFree every cached block that is a whole segment, and unmap the free pages of the
        expandable segments (``release_cached_blocks`` → ``release_blocks``).

        Split segments with some block still live stay: their free parts cannot be returned; of
        an expandable segment every page no live block touches is unmapped, and a segment left
        with no page is released. Linear in the number of cached blocks, but it runs only on
        empty_cache or when a cudaMalloc would not fit.
        """
        for pool in self._every_pool():  # release_blocks(large_blocks) first, as in C++
            blocks = list(pool.blocks.values())
            for block in blocks:
                if block.segment is None and block.prev is None and block.next is None:
                    self._release_block(block)
            for block in blocks:
                if block.segment is not None:
                    self._unmap_block(block)

    def _release_block(self, block: _Block) -> None:
        """cudaFree the cached block ``block``, a whole segment (``release_block``)."""
        block.pool.remove(block)
        self._free_segment(block)

    def _return_to_host(self, block: _Block) -> None:
        """The host allocator's free: the block is its whole segment, given back at once."""
        self._free_segment(block)

    def _free_segment(self, block: _Block) -> None:
        """The segment ``block`` spans, handed back (cudaFree, or the host's free)."""
        del self._segments[block.addr]
        if block.addr in self._own:
            self._own.discard(block.addr)
            self._release_address(block.addr, block.size)
        self._shrink(block.pool.stream, block.size)
        self._num_device_frees += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Free oversize cached blocks, only as many as the request needs: the smallest one of at
        least ``max(size, max_split_size)``, else the largest ones down to ``max_split_size``
        until they add up to that (``release_available_cached_blocks``). False at once while
        ``max_split_size`` is unlimited; blocks of expandable segments are never freed here."""
        if self._max_split == MAX_SPLIT_SIZE or self._expandable:
            return False
        key = max(size, self._max_split)
        entries = pool.entries
        i = bisect.bisect_left(entries, (key,))
        if i < len(entries):
            self._release_block(pool.blocks[entries[i][1]])
            return True
        released = 0
        for found_size, addr in reversed(list(entries)):  # the largest first
            if released >= key or found_size < self._max_split:
                break
            released += found_size
            self._release_block(pool.blocks[addr])
        return released >= key

    def _garbage_collect(self) -> None:
        """Free cached whole segments of the large pool, the oldest first, until reserved is back
        under ``garbage_collection_threshold`` × capacity (``garbage_collect_cached_blocks``).

        A block's age is the number of ``get_free_block`` calls on its pool since it was cached;
        each pass frees every unsplit block at least as old as the pass's average age, and does
        not stop at the target within a pass ("we don't want this GC to be triggered frequently").
        """
        assert self.capacity is not None
        threshold = int(self._gc_threshold * self.capacity)
        if self._reserved <= threshold:
            return
        target = self._reserved - threshold
        pools = [large for _, (_, large) in sorted(self._pools.items())]  # large_blocks: every stream's
        clock = self._large.clock
        whole = [b for pool in pools for b in pool.blocks.values()
                 if b.prev is None and b.next is None and b.segment is None]
        total_age = sum(clock.calls - b.gc_base for b in whole)
        count = len(whole)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for pool in pools:
                for _, addr in list(pool.entries):
                    block = pool.blocks[addr]
                    age = clock.calls - block.gc_base
                    if block.prev is None and block.next is None and block.segment is None and age >= age_threshold:
                        freed = True
                        reclaimed += block.size
                        total_age -= age
                        count -= 1
                        self._release_block(block)

    # --- expandable segments (``ExpandableSegment``) -------------------------------------

    def _allocate_expandable(self, pool: _Pool, size: int) -> _Block:
        """``try_allocate_expandable_block``: map pages until a free block of ``size`` bytes
        stands at the lowest address where free and unmapped space adds up to it, in the pool's
        segment (a new segment when none has room)."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped:
            self._map_block(candidate, min(candidate.size, size))
        while candidate.size < size:  # free -> unmapped: map some of it, which merges with the free part
            following = candidate.next
            assert following is not None and not following.mapped
            self._map_block(following, min(size - candidate.size, following.size))
            candidate = following
        candidate.pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest unmapped range (with the free block just before
        it) followed by enough free or unmapped space; else a new segment, all unmapped."""
        for addr in sorted(pool.unmapped):
            candidate = pool.unmapped[addr]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room = 0
            walk: _Block | None = candidate
            while room < size and walk is not None and not walk.allocated:  # has_available_address_space
                room += walk.size
                walk = walk.next
            if room >= size:
                return candidate
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER  # 2 MiB pages small, 20 MiB large
        segment = _Expandable(self._next_expandable, page, EXPANDABLE_ADDRESS_SPACE)
        self._next_expandable += EXPANDABLE_ADDRESS_SPACE
        block = _Block(segment.base, segment.size, pool, segment)
        block.mapped = False
        pool.unmapped[block.addr] = block
        return block

    def _map_block(self, block: _Block, size: int) -> None:
        """``map_block``: back the start of the unmapped ``block`` with the pages covering
        ``size`` bytes; the rest stays an unmapped block after it, and the mapped part merges
        with free neighbours. Reserved grows by the pages mapped."""
        segment = block.segment
        assert segment is not None and not block.mapped
        begin, end = segment.pages_covering(block.addr, size)
        mapped = end - begin
        pool = block.pool
        del pool.unmapped[block.addr]
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, pool, segment)
            rest.mapped = False
            rest.splice(block, block.next)
            pool.unmapped[rest.addr] = rest
            block.size = mapped
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert(block)
        self._mapped += mapped
        self._num_segments += 1  # one cuMemMap, counted as a device allocation ("num_device_alloc")
        self._grow(pool.stream, mapped)
        self._on_map(begin, mapped, pool.stream)

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: unmap the pages wholly inside the free ``block``; the free bytes on
        either side stay mapped blocks of their own. A segment left all unmapped is released
        (``release_expandable_segment``)."""
        segment = block.segment
        assert segment is not None and block.mapped and not block.allocated
        begin, end = segment.pages_within(block.addr, block.size)
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        if begin > block.addr:  # prev? -> before -> block
            before = _Block(block.addr, begin - block.addr, pool, segment)
            before.splice(block.prev, block)
            pool.insert(before)
        if block.addr + block.size > end:  # block -> after -> next?
            after = _Block(end, block.addr + block.size - end, pool, segment)
            after.splice(block, block.next)
            pool.insert(after)
        block.addr, block.size, block.mapped = begin, end - begin, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.unmapped[block.addr] = block
        self._mapped -= end - begin
        self._shrink(pool.stream, end - begin)
        self._num_device_frees += 1
        self._on_unmap(begin, end - begin, pool.stream)
        if block.prev is None and block.next is None:
            del pool.unmapped[block.addr]

    def _on_map(self, addr: int, size: int, stream: int) -> None:
        """Hook for :class:`RecordingAllocatorModel`: pages were mapped."""

    def _on_unmap(self, addr: int, size: int, stream: int) -> None:
        """Hook for :class:`RecordingAllocatorModel`: pages were unmapped."""


def _expandable_size(block: _Block) -> int:
    """``get_free_block``'s ``expandable_size``: a block and the unmapped range right after it."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


@collector_paused()
def replay(events: Iterable[tuple[int, Hashable, int]], capacity: int | None = None,
           settings: AllocConf | None = None, *, host: bool = False,
           streams: Mapping[Any, int] | None = None) -> AllocatorStats:
    """Run a recorded sequence through a fresh allocator (``host``: the CPU's) and return its stats.

    Each event is ``(ALLOC, key, nbytes)`` (``ALLOC == +1``), ``(FREE, key, 0)``
    (``FREE == -1``) or ``(EMPTY_CACHE, None, 0)`` (``EMPTY_CACHE == 0``); indices in the
    result (``oom_at``, ``peak_index``) are positions in ``events``. ``streams``: the stream each
    key is allocated on, where it is not the compute stream (0).
    """
    model = CachingAllocatorModel(capacity, settings=settings, host=host)
    _drive(model, events, streams)
    return model.stats()


@collector_paused()
def replay_with_prefix(events: Iterable[tuple[int, Hashable, int]], prefix: int,
                       settings: AllocConf | None = None, *, host: bool = False,
                       streams: Mapping[Any, int] | None = None) -> tuple[AllocatorStats, AllocatorStats]:
    """:func:`replay` with no capacity, and the stats after its first ``prefix`` events too: one
    replay where two were made (a step's first iteration and the whole step). The allocator is
    deterministic, so the stats after a prefix are those of a replay of the prefix alone."""
    model = CachingAllocatorModel(None, settings=settings, host=host)
    stream = iter(events)
    _drive(model, itertools.islice(stream, prefix), streams)
    first = model.stats()
    _drive(model, stream, streams)
    return first, model.stats()


@collector_paused()
def replay_keys(events: Sequence[int], nbytes: Sequence[int], prefix: int | None = None,
                settings: AllocConf | None = None, *, host: bool = False) -> tuple[AllocatorStats, AllocatorStats]:
    """:func:`replay_with_prefix` (no capacity, the compute stream only) of a program written as
    keys: ``key`` allocates ``nbytes[key]`` bytes, ``~key`` frees it. Returns the stats after the
    first ``prefix`` events and after all of them (the same object where ``prefix`` is None).

    Driven through :meth:`CachingAllocatorModel.feed`, the same decisions with the common case
    inlined, where :func:`replay` takes an ``(kind, key, nbytes)`` tuple per event and makes three
    calls or more for each: an estimate's replay of a few thousand events, 8.3 → 5.9 ms (GPT-2,
    5,052 events), the same stats (issue 36 item 7: every estimate replays its step once)."""
    model = CachingAllocatorModel(None, settings=settings, host=host)
    rounded = [round_size(size) for size in nbytes]
    held: dict[int, int] = {}  # feed's note of blocks handed out larger than asked: not read here
    if prefix is None:
        model.feed(events, nbytes, rounded, held)
        stats = model.stats()
        return stats, stats
    model.feed(events[:prefix], nbytes, rounded, held)
    first = model.stats()
    model.feed(events[prefix:], nbytes, rounded, held)
    return first, model.stats()


def _drive(model: CachingAllocatorModel, events: Iterable[tuple[int, Hashable, int]],
           streams: Mapping[Any, int] | None = None) -> None:
    malloc, free, empty_cache = model.malloc, model.free, model.empty_cache
    if streams:
        stream_of = streams.get
        for kind, key, nbytes in events:
            if kind == ALLOC:
                malloc(key, nbytes, stream_of(key, 0))
            elif kind == FREE:
                free(key)
            elif kind == EMPTY_CACHE:
                empty_cache()
            else:
                raise ValueError(f"unknown event kind {kind!r}; expected +1 (alloc), -1 (free) or 0 (empty_cache)")
        return
    for kind, key, nbytes in events:
        if kind == ALLOC:
            malloc(key, nbytes)
        elif kind == FREE:
            free(key)
        elif kind == EMPTY_CACHE:
            empty_cache()
        else:
            raise ValueError(f"unknown event kind {kind!r}; expected +1 (alloc), -1 (free) or 0 (empty_cache)")


# --- Recording: what each event did, for the timeline and the snapshot export ------------------

#: One action of the allocator: ``(action, address, size, event index, key, requested bytes,
#: stream)``; ``action`` is a ``TraceEntry`` name of ``CUDACachingAllocator.h`` (``alloc``,
#: ``free_completed``, ``segment_alloc``, ``segment_free``); key None for segments.
Action = tuple[str, int, int, int, Hashable, int, int]


class RecordingAllocatorModel(CachingAllocatorModel):
    """The same allocator, also recording ``allocated``/``reserved`` after every event and every
    block and segment it hands out or takes back (what ``torch.cuda.memory._record_memory_history``
    records). A separate class so that the replays of an estimate pay nothing for it."""

    def __init__(self, capacity: int | None = None, settings: AllocConf | None = None, *,
                 host: bool = False) -> None:
        super().__init__(capacity, settings=settings, host=host)
        self.allocated_after: list[int] = []  # per event
        self.reserved_after: list[int] = []  # per event
        self.actions: list[Action] = []

    def malloc(self, key: Hashable, nbytes: int, stream: int = 0) -> None:
        index = self._events
        super().malloc(key, nbytes, stream)
        block = self._live.get(key)
        if block is not None:
            self.actions.append(("alloc", block.addr, block.size, index, key, nbytes, block.pool.stream))
        self.allocated_after.append(self._allocated)
        self.reserved_after.append(self._reserved)

    def free(self, key: Hashable) -> None:
        index = self._events
        block = self._live.get(key)
        if block is not None:  # before free_block merges it with its neighbours (its address moves)
            self.actions.append(("free_completed", block.addr, block.size, index, key, block.requested,
                                 block.pool.stream))
        super().free(key)
        self.allocated_after.append(self._allocated)
        self.reserved_after.append(self._reserved)

    def empty_cache(self) -> None:
        super().empty_cache()
        self.allocated_after.append(self._allocated)
        self.reserved_after.append(self._reserved)

    def _alloc_block(self, pool: _Pool, alloc_size: int, force: bool = False, size: int = 0) -> _Block | None:
        block = super()._alloc_block(pool, alloc_size, force, size)
        if block is not None and block.segment is None:
            self.actions.append(("segment_alloc", block.addr, alloc_size, self._events - 1, None, 0, pool.stream))
        return block

    def _release_block(self, block: _Block) -> None:
        self.actions.append(("segment_free", block.addr, block.size, self._events - 1, None, 0, block.pool.stream))
        super()._release_block(block)

    def _return_to_host(self, block: _Block) -> None:
        self.actions.append(("segment_free", block.addr, block.size, self._events - 1, None, 0, block.pool.stream))
        super()._return_to_host(block)

    def _on_map(self, addr: int, size: int, stream: int) -> None:
        self.actions.append(("segment_map", addr, size, self._events - 1, None, 0, stream))

    def _on_unmap(self, addr: int, size: int, stream: int) -> None:
        self.actions.append(("segment_unmap", addr, size, self._events - 1, None, 0, stream))


@dataclass(frozen=True)
class RecordedReplay:
    """A replay with its history: the stats, ``allocated``/``reserved`` after each event, the
    allocator's actions in order, and the segments held at the end (:meth:`CachingAllocatorModel.segments`)."""

    stats: AllocatorStats
    allocated: list[int]
    reserved: list[int]
    actions: list[Action]
    segments: list[tuple[int, int, list[tuple[int, int, bool]]]]


@collector_paused()
def replay_recorded(events: Iterable[tuple[int, Hashable, int]], capacity: int | None = None,
                    settings: AllocConf | None = None, *, host: bool = False,
                    streams: Mapping[Any, int] | None = None) -> RecordedReplay:
    """:func:`replay` with a :class:`RecordingAllocatorModel`: the same stats, and the history."""
    model = RecordingAllocatorModel(capacity, settings, host=host)
    _drive(model, events, streams)
    return RecordedReplay(model.stats(), model.allocated_after, model.reserved_after, model.actions,
                          model.segments())

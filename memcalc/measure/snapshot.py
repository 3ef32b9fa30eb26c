"""A real ``torch.cuda.memory._snapshot()`` read as an allocation stream the allocator model replays.

A snapshot taken with ``torch.cuda.memory._record_memory_history()`` on holds, per device, the
trace of every ``alloc`` / ``free_requested`` / ``free_completed`` (sizes as *requested*, before
``round_size``) and ``segment_alloc`` / ``segment_free`` (the cudaMalloc / cudaFree calls), and
the segments held when it was taken (``segments``, each with its blocks). Those two together
say what the allocator held when the trace *began* (recording starts mid-run: the cuBLAS
workspaces are older, and a long run overflows ``max_entries`` so its first events are gone):

    segments at the start = segments now + those the trace frees − those it allocates.

This module turns a snapshot into exactly that: the starting segments with their live blocks
(:class:`SeedSegment`), the trace's allocations and frees as :mod:`memcalc.engine.allocator`
events, the real cudaMalloc addresses in order, and the real ``reserved`` after every event.
:func:`replay_snapshot` replays it; with the real addresses the model follows the real
allocator's best-fit tie-breaks too, so any difference left is a difference of algorithm — the
golden tests (``tests/test_real_snapshots.py``) hold it to none on the shared H100 snapshots.

Only the trace's facts are used; nothing here imports torch (``pickle.load`` of a snapshot
needs none). A run of ``segment_free`` events is one ``torch.cuda.empty_cache()`` (what the
snapshots here hold: ``measure_cuda`` calls it); a cudaFree made by the allocator's own OOM
recovery would read the same, which is right, since the model releases the same segments.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memcalc.engine import allocator
from memcalc.engine.allocator import ALLOC, EMPTY_CACHE, FREE, AllocatorStats, CachingAllocatorModel

__all__ = ("RealAllocation", "RealSnapshot", "SeedSegment", "SnapshotReplay", "load_snapshot", "read_snapshot",
           "replay_snapshot")


@dataclass(frozen=True)
class SeedSegment:
    """A segment held when the trace begins: base address, size, pool, and its live blocks as
    ``(offset, key, block size, requested bytes)``; the stream whose pool it belongs to."""

    base: int
    size: int
    small: bool
    live: tuple[tuple[int, int, int, int], ...]
    stream: int = 0


@dataclass(frozen=True)
class RealAllocation:
    """One allocation of the trace: its key in :attr:`RealSnapshot.events`, requested bytes,
    the trace index of its ``alloc`` and of its ``free_completed`` (None: alive at the end), and
    its Python frames, innermost first, as ``"file:line function"``."""

    key: int
    nbytes: int
    alloc_index: int
    free_index: int | None
    frames: tuple[str, ...]


@dataclass(frozen=True)
class RealSnapshot:
    """A real snapshot's device-0 trace, ready to replay (see the module docstring)."""

    seed: tuple[SeedSegment, ...]
    events: tuple[tuple[int, Hashable, int], ...]  # ALLOC / FREE / EMPTY_CACHE, as allocator.replay takes
    trace_index: tuple[int, ...]  # per event: its index in the snapshot's trace
    reserved: tuple[int, ...]  # per event: the real reserved bytes just after it
    segment_addresses: tuple[int, ...]  # the real cudaMalloc addresses, in order
    allocations: tuple[RealAllocation, ...] = field(repr=False)
    start_reserved: int = 0  # reserved when the trace begins (the seed's segments)
    #: the stream each allocation was made on, where it is not the default stream: the real
    #: ``cudaStream_t`` values, which order the pools as the C++ comparator does
    streams: Mapping[Hashable, int] = field(default_factory=dict, repr=False)

    @property
    def peak_reserved(self) -> int:
        """The highest reserved of the trace (``max_memory_reserved`` over its span)."""
        return max((self.start_reserved, *self.reserved))

    def first_event_in(self, filename: str, function: str) -> int | None:
        """Index in :attr:`events` of the first allocation made under ``function`` of a file
        ending in ``filename`` (e.g. ``memcalc/measure/step.py``, ``_run``: the step of a
        ``measure_cuda`` run), or None."""
        wanted = f" {function}"
        for allocation in self.allocations:
            if any(frame.split(":")[0].endswith(filename) and frame.endswith(wanted) for frame in allocation.frames):
                return self.trace_index.index(allocation.alloc_index)
        return None


@dataclass(frozen=True)
class SnapshotReplay:
    """The model's replay of a real snapshot beside the real figures."""

    stats: AllocatorStats  # the model's peaks over the replayed span (the seed included)
    reserved: tuple[int, ...]  # the model's reserved after each event
    real_peak_reserved: int
    first_divergence: int | None  # first event after which model and real reserved differ

    @property
    def reserved_error(self) -> float:
        """(model − real) / real peak reserved."""
        return (self.stats.peak_reserved - self.real_peak_reserved) / self.real_peak_reserved


def load_snapshot(path: str | Path, device: int = 0) -> RealSnapshot:
    """Read a ``torch.cuda.memory._snapshot()`` pickle (as ``torch.cuda.memory._dump_snapshot``
    writes it) and return its trace for ``device``."""
    # Bytes that are no pickle can make CPython's unpickler print to stderr on its way to the
    # exception (a BYTEARRAY8 of exabytes: "SystemError: deallocated bytearray object has exported
    # buffers", PyErr_Print in bytearray_dealloc); the exception alone is the answer.
    with open(path, "rb") as handle, contextlib.redirect_stderr(io.StringIO()):
        data = pickle.load(handle)
    return read_snapshot(data, device)


def _frames(event: Mapping[str, Any]) -> tuple[str, ...]:
    """The Python frames (``file.py``, or a synthetic ``<name>`` such as memcalc's own), not C++'s."""
    return tuple(f"{f['filename']}:{f['line']} {f['name']}" for f in event.get("frames", ())
                 if str(f.get("filename", "")).endswith(".py") or str(f.get("filename", "")).startswith("<"))


def read_snapshot(data: Mapping[str, Any], device: int = 0) -> RealSnapshot:
    """:func:`load_snapshot` of an already loaded snapshot dict."""
    traces = data.get("device_traces") or [[]]
    trace: Sequence[Mapping[str, Any]] = traces[device] if device < len(traces) else []
    segments = [s for s in data.get("segments", ()) if s.get("device", 0) == device]
    seed = _seed(trace, segments)
    addr_key: dict[int, int] = {}
    for segment in seed:
        for offset, key, _size, _requested in segment.live:
            addr_key[segment.base + offset] = key
    next_key = max(addr_key.values(), default=-1) + 1
    start = sum(s.size for s in seed)
    events: list[tuple[int, Hashable, int]] = []
    index: list[int] = []
    streams: dict[Hashable, int] = {}
    allocations: dict[int, dict[str, Any]] = {}
    in_release = False
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "segment_free":
            if not in_release:  # one empty_cache() frees a run of segments
                events.append((EMPTY_CACHE, None, 0))
                index.append(i)
            in_release = True
            continue
        if action == "segment_alloc":
            continue  # the model makes its own cudaMallocs
        in_release = False
        if action == "alloc":
            key = next_key
            next_key += 1
            addr_key[event["addr"]] = key
            # a real trace's size is the request; memcalc's gives the block's and the request beside it
            nbytes = int(event.get("requested_size", event["size"]))
            events.append((ALLOC, key, nbytes))
            if event.get("stream", 0):  # FSDP2's collectives, any side stream: a pool of its own
                streams[key] = int(event["stream"])
            allocations[key] = {"nbytes": nbytes, "alloc": i, "free": None, "frames": _frames(event)}
        elif action == "free_completed" and event["addr"] in addr_key:
            key = addr_key.pop(event["addr"])
            events.append((FREE, key, 0))
            if key in allocations:
                allocations[key]["free"] = i
        else:
            continue
        index.append(i)
    # a segment_alloc is recorded before its alloc: move each event's reserved to after the alloc
    after = _reserved_after(trace, index, start)
    return RealSnapshot(
        seed=seed, events=tuple(events), trace_index=tuple(index), reserved=tuple(after),
        segment_addresses=tuple(e["addr"] for e in trace if e["action"] == "segment_alloc"),
        allocations=tuple(RealAllocation(key, a["nbytes"], a["alloc"], a["free"], a["frames"])
                          for key, a in sorted(allocations.items())),
        start_reserved=start, streams=streams)


def _reserved_after(trace: Sequence[Mapping[str, Any]], index: Sequence[int], start: int) -> list[int]:
    """Real reserved bytes just after each replayed event: the trace's segment events up to the
    next replayed event's trace index (a cudaMalloc is recorded just before the alloc it serves,
    so it is counted with that alloc, as the model counts it)."""
    result: list[int] = []
    reserved = start
    position = 0
    for n, i in enumerate(index):
        while position <= i:
            action = trace[position]["action"]
            if action == "segment_alloc":
                reserved += trace[position]["size"]
            elif action == "segment_free":
                reserved -= trace[position]["size"]
            position += 1
        if trace[i]["action"] == "segment_free":  # the whole run of cudaFrees of one empty_cache
            limit = index[n + 1] if n + 1 < len(index) else len(trace)
            while position < limit and trace[position]["action"] == "segment_free":
                reserved -= trace[position]["size"]
                position += 1
        result.append(reserved)
    return result


def _seed(trace: Sequence[Mapping[str, Any]], segments: Sequence[Mapping[str, Any]]) -> tuple[SeedSegment, ...]:
    """The segments held when the trace begins, with the blocks live then.

    A segment is older than the trace when the trace frees it before allocating one there, or
    when it is held at the end and the trace never allocates one there. A block is older when
    the trace frees it before allocating it, or when it is live at the end and never allocated.
    """
    old_segments: dict[int, tuple[int, bool, int]] = {}
    allocated_segments: set[int] = set()
    old_blocks: dict[int, tuple[int, int]] = {}  # address -> (block size, requested)
    seen_blocks: set[int] = set()
    for event in trace:
        action, addr = event["action"], event["addr"]
        if action == "segment_alloc":
            allocated_segments.add(addr)
        elif action == "segment_free" and addr not in allocated_segments:
            old_segments.setdefault(addr, (event["size"], event["size"] == allocator.K_SMALL_BUFFER,
                                           int(event.get("stream", 0))))
        elif action == "alloc":
            seen_blocks.add(addr)
        elif action == "free_completed" and addr not in seen_blocks:
            old_blocks.setdefault(addr, (allocator.round_size(event["size"]), event["size"]))
            seen_blocks.add(addr)
    for segment in segments:
        base = segment["address"]
        if base in allocated_segments:
            continue
        old_segments.setdefault(base, (segment["total_size"], segment.get("segment_type") == "small",
                                       int(segment.get("stream", 0))))
        cursor = base
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated" and cursor not in seen_blocks:
                old_blocks.setdefault(cursor, (block["size"], block.get("requested_size", block["size"])))
            cursor += block["size"]
    seeded: list[SeedSegment] = []
    key = 0
    for base, (size, small, stream) in sorted(old_segments.items()):
        live = []
        for addr, (block_size, requested) in sorted(old_blocks.items()):
            if base <= addr < base + size:
                live.append((addr - base, key, min(block_size, base + size - addr), requested))
                key += 1
        seeded.append(SeedSegment(base, size, small, tuple(live), stream))
    return tuple(seeded)


def replay_snapshot(snapshot: RealSnapshot, *, real_addresses: bool = True,
                    model: CachingAllocatorModel | None = None) -> SnapshotReplay:
    """Replay a real snapshot's stream through the allocator model, from its starting segments.

    ``real_addresses``: give the model the real cudaMalloc addresses (False: its own, as an
    estimate has no others). ``model``: a fresh model to drive instead (one that records what it
    does; ``real_addresses`` is then its own business).
    """
    if model is None:
        model = CachingAllocatorModel(segment_addresses=snapshot.segment_addresses if real_addresses else None)
    for segment in snapshot.seed:
        model.seed_segment(segment.base, segment.size, segment.small, segment.live, segment.stream)
    reserved: list[int] = []
    first: int | None = None
    stream_of = snapshot.streams.get
    for n, (kind, key, nbytes) in enumerate(snapshot.events):
        if kind == ALLOC:
            model.malloc(key, nbytes, stream_of(key, 0))
        elif kind == FREE:
            model.free(key)
        else:
            model.empty_cache()
        reserved.append(model.reserved)
        if first is None and model.reserved != snapshot.reserved[n]:
            first = n
    return SnapshotReplay(model.stats(), tuple(reserved), snapshot.peak_reserved, first)

"""The simulated step as a ``torch.cuda.memory._snapshot()``: a pickle that PyTorch's own
viewers open (https://pytorch.org/memory_viz, ``python -m torch.cuda._memory_viz trace_plot``).

A real snapshot is what the CUDA caching allocator recorded with
``torch.cuda.memory._record_memory_history()``; this one is what memcalc's model of it
(:mod:`memcalc.engine.allocator`) did while replaying the step, both iterations of a training
step, on device 0 and the streams the model allocated on (0: the compute stream; FSDP2's
collective streams, :class:`~memcalc.core.streams.Stream`, under a strategy):

* ``device_traces[0]``: every ``segment_alloc`` (cudaMalloc), ``alloc``, ``free_requested``
  then ``free_completed`` (no ``record_stream``: a block is free as soon as it is released) and
  ``segment_free`` (cudaFree, when the allocator releases its cache under a limit), in order,
  each with the model's fake address, its size and one frame naming where it happened:
  ``{"filename": "<memcalc>", "line": 0, "name": "forward layer4.2.conv3 aten.convolution.default"}``
  (phase, module, the op that created the storage). An entry's ``size`` is the *block's* size
  (the request rounded as the allocator rounds it), so the viewer's curve peaks exactly at the
  report's ``peak_allocated`` (``torch.cuda.max_memory_allocated()``); a real trace records
  the requested size, here in each ``alloc``'s and each block's ``requested_size``. ``category`` (parameters,
  activations, ...) colours the viewer's timeline, as in the snapshots PyTorch makes from a
  profile.
* ``segments``: the segments held at the end of the step, each with its blocks (allocated
  ones with their request and frame, free ones ``inactive``), as ``_snapshot()`` lists them.

Addresses are the model's: increasing, never reused by a new segment (see the allocator).
"""

from __future__ import annotations

import bisect
import os
import pickle
from pathlib import Path
from typing import Any

from memcalc.core.categories import Category
from memcalc.core.output import check_writable, write_atomically
from memcalc.core.report import MemoryReport
from memcalc.core.timeline import AllocatorEvent, Timeline
from memcalc.engine.allocator import K_SMALL_BUFFER

__all__ = ("FRAME_FILENAME", "PICKLE_PROTOCOL", "snapshot_dict", "write_snapshot")

#: The ``filename`` of every frame: the viewers print ``filename:line:name``.
FRAME_FILENAME = "<memcalc>"
#: The pickle protocol: the highest MemoryViz.js's own unpickler reads (``unpickle`` throws
#: "Unhandled version" above 4; Python 3.14 pickles at 5 by default).
PICKLE_PROTOCOL = 4
#: The category of entries that belong to no storage (segments). MemoryViz.js colours
#: allocations by ``category`` and appends "unknown" when it is missing from those it saw
#: (through a misspelt ``snapshot.categores``, which throws): naming it once avoids that.
_NO_CATEGORY = "unknown"


def snapshot_dict(report: MemoryReport) -> dict[str, Any]:
    """The report's step in the format of ``torch.cuda.memory._snapshot()`` (see the module
    docstring); under a multi-GPU strategy, the busiest GPU role's step.

    Args:
        report: a report made by an estimate (it replays its step: ``report.timeline()``).

    Returns:
        ``{"segments": [...], "device_traces": [[...]]}``: plain dicts, lists, ints and
        strings, ready for :func:`pickle.dump`.
    """
    timeline = report.timeline()
    frames = _Frames(timeline)
    trace: list[dict[str, Any]] = []
    for event in timeline.allocator_events:
        entry = {"action": event.action, "addr": event.address, "size": event.size, "stream": event.stream,
                 "frames": frames.of(event.event),
                 "category": frames.category(event.event) if event.storage >= 0 else _NO_CATEGORY}
        if event.action == "alloc":  # the request, as a real trace's ``size`` is (read_snapshot prefers it)
            entry["requested_size"] = event.requested
        if event.action == "free_completed":  # no record_stream: the free is requested and completed at once
            trace.append(entry | {"action": "free_requested"})
        trace.append(entry)
    return {"segments": _segments_at_end(timeline.allocator_events, frames), "device_traces": [trace]}


def write_snapshot(report: MemoryReport, path: str | os.PathLike[str], *, force: bool = False) -> None:
    """Pickle :func:`snapshot_dict` of ``report`` to ``path`` (``.pickle``, as
    ``torch.cuda.memory._dump_snapshot`` writes it), whole or not at all.

    Args:
        report: a report made by an estimate.
        path: the file to write.
        force: replace ``path`` if it exists (else an existing file is refused, left as it was).

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is False.
        PlotPathError: the file cannot be written (a missing or read-only folder).
    """
    target = Path(path)
    check_writable(target, "snapshot", force=force)  # before the replay the snapshot is made from
    data = pickle.dumps(snapshot_dict(report), protocol=PICKLE_PROTOCOL)
    write_atomically(target, "snapshot", lambda temporary: temporary.write_bytes(data), force=force)


class _Frames:
    """The one-frame stack of each program event, made once per event."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline
        self._made: dict[int, list[dict[str, Any]]] = {}

    def of(self, index: int) -> list[dict[str, Any]]:
        made = self._made.get(index)
        if made is None:
            t = self._timeline
            # an allocation no op made (a parameter, an input) says what it is instead
            what = t.op[index] or f"({self._category(index).value})"
            name = " ".join(part for part in (t.phase[index].value, t.module[index], what) if part)
            made = self._made[index] = [{"filename": FRAME_FILENAME, "line": 0, "name": name}]
        return made

    def category(self, index: int) -> str:
        return self._category(index).value

    def _category(self, index: int) -> Category:
        return self._timeline.category[index]


def _unmap(ranges: dict[int, int], address: int, size: int) -> None:
    """Take ``[address, address + size)`` out of the mapped ``ranges`` of expandable segments
    (``segment_unmap``: whole pages inside a free block, perhaps the middle of a mapped range)."""
    for base, length in list(ranges.items()):
        end = base + length
        if end <= address or base >= address + size:
            continue
        del ranges[base]
        if base < address:
            ranges[base] = address - base
        if end > address + size:
            ranges[address + size] = end - address - size


def _contiguous(ranges: dict[int, int]) -> dict[int, int]:
    """Mapped ranges that touch as one segment each, as ``torch.cuda.memory_snapshot()`` reports an
    expandable segment's contiguous mapped memory."""
    merged: dict[int, int] = {}
    last = None
    for base in sorted(ranges):
        if last is not None and last + merged[last] == base:
            merged[last] += ranges[base]
        else:
            merged[base], last = ranges[base], base
    return merged


def _segments_at_end(events: tuple[AllocatorEvent, ...], frames: _Frames) -> list[dict[str, Any]]:
    """The segments held after the last event, with their blocks, replayed from ``events``:
    the allocator merges free neighbours, so every gap between allocated blocks is one free
    (``inactive``) block."""
    segments: dict[int, int] = {}
    mapped: dict[int, int] = {}  # the pages of expandable segments
    streams: dict[int, int] = {}  # the stream of each segment
    mapped_on: dict[int, int] = {}  # the stream of each range of pages mapped, by its address
    live: dict[int, AllocatorEvent] = {}
    for event in events:
        if event.action == "segment_alloc":
            segments[event.address] = event.size
            streams[event.address] = event.stream
        elif event.action == "segment_free":
            del segments[event.address]
        elif event.action == "segment_map":
            mapped[event.address] = event.size
            mapped_on[event.address] = event.stream
        elif event.action == "segment_unmap":
            _unmap(mapped, event.address, event.size)
        elif event.action == "alloc":
            live[event.address] = event
        elif event.action == "free_completed":
            del live[event.address]
    runs = _contiguous(mapped)
    segments |= runs
    # a run lies in one expandable segment, whose first pages were mapped at its base: the
    # nearest mapping at or below the run is its segment's, and so is the stream
    mapped_at = sorted(mapped_on)
    for base in runs:
        streams[base] = mapped_on[mapped_at[bisect.bisect_right(mapped_at, base) - 1]]
    blocks = sorted(live.values(), key=lambda e: e.address)
    result: list[dict[str, Any]] = []
    i = 0
    for base in sorted(segments):
        size = segments[base]
        parts: list[dict[str, Any]] = []
        cursor = base
        while i < len(blocks) and blocks[i].address < base + size:
            block = blocks[i]
            if block.address > cursor:
                parts.append(_free_block(cursor, block.address - cursor))
            parts.append({"address": block.address, "size": block.size, "requested_size": block.requested,
                          "state": "active_allocated", "frames": frames.of(block.event)})
            cursor = block.address + block.size
            i += 1
        if cursor < base + size:
            parts.append(_free_block(cursor, base + size - cursor))
        allocated = sum(p["size"] for p in parts if p["state"] == "active_allocated")
        result.append({
            "device": 0, "address": base, "total_size": size, "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(p["requested_size"] for p in parts), "stream": streams.get(base, 0),
            # a 2 MiB segment is the small pool's (kSmallBuffer); the large pool's are 20 MiB
            # or at least 10 MiB rounded up to 2 MiB (memcalc.engine.allocator.segment_size)
            "segment_type": "small" if size <= K_SMALL_BUFFER else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": parts,
        })
    return result


def _free_block(address: int, size: int) -> dict[str, Any]:
    return {"address": address, "size": size, "requested_size": 0, "state": "inactive", "frames": []}

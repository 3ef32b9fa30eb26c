"""The memory timeline of a simulated step, as data: what :meth:`MemoryReport.timeline`
returns, what ``--timeline`` draws and what ``--snapshot`` exports.

One row per allocator event of the replayed program (both iterations of a training step):
the bytes alive per category after the event, what the caching allocator has allocated and
reserved then, and which phase, module and op the event belongs to. The engine builds it
(:mod:`memcalc.engine.timeline`); the report layer draws it (:mod:`memcalc.report`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memcalc.core.categories import Category, Phase

__all__ = ("Allocation", "AllocatorEvent", "PhaseSpan", "Timeline")

#: Bytes as int64 arrays: one value per event (or per event and category).
Bytes = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PhaseSpan:
    """Events ``start`` (inclusive) to ``end`` (exclusive) belong to ``phase`` of ``iteration``."""

    phase: Phase
    iteration: int  # 1-based
    start: int
    end: int


@dataclass(frozen=True)
class Allocation:
    """One storage alive at the peak: its size and where it was born."""

    nbytes: int  # bytes requested (unrounded)
    category: Category
    phase: Phase
    module: str  # "" outside any submodule
    op: str  # aten op that created it ("" for pre-existing storages, "synthetic: ..." for workspaces)


@dataclass(frozen=True)
class AllocatorEvent:
    """One event as the caching allocator model saw it, for ``torch.cuda.memory._snapshot()``
    export: ``action`` is ``alloc``, ``free_completed``, ``segment_alloc`` or ``segment_free``
    (the names of PyTorch's ``TraceEntry``), ``address`` the model's (fake, increasing) device
    address, ``size`` the block or segment size in bytes, ``event`` the index of the program
    event that caused it (into :attr:`Timeline.allocated`)."""

    action: str
    address: int
    size: int
    event: int
    storage: int  # the storage id of the program (-1 for segment events)
    requested: int = 0  # bytes the storage asked for (alloc and free events; ``size`` is its rounded block)
    stream: int = 0  # the stream whose pool the block or segment belongs to (:class:`~memcalc.core.streams.Stream`)


@dataclass(frozen=True)
class Timeline:
    """The memory of every event of the replayed step.

    ``by_category[i, j]``: bytes requested by the storages of category ``categories[j]``
    alive after event ``i``; ``allocated[i]`` and ``reserved[i]``: what the caching
    allocator model counts after event ``i`` (block rounding included; the maximum of
    ``allocated`` is the report's ``bytes.peak_allocated``). ``phase``, ``module``, ``op``
    and ``category``: per event, of the storage the event allocates or frees (its birth phase
    and module). ``reserved`` comes from the replay the report's ``peak_reserved`` comes from:
    under ``capacity`` when the allocator had to free its cache to stay within it.
    """

    categories: tuple[Category, ...]
    by_category: Bytes  # shape (events, categories)
    allocated: Bytes  # shape (events,)
    reserved: Bytes  # shape (events,)
    phase: tuple[Phase, ...]
    module: tuple[str, ...]
    op: tuple[str, ...]
    is_alloc: npt.NDArray[np.bool_]  # True where the event allocates, False where it frees
    spans: tuple[PhaseSpan, ...]
    peak_index: int
    capacity: int | None = None
    largest_at_peak: tuple[Allocation, ...] = ()  # the ten largest storages alive at the peak
    allocator_events: tuple[AllocatorEvent, ...] = field(default=(), repr=False)
    role: str = ""  # the GPU role under a multi-GPU strategy ("" for one GPU)
    category: tuple[Category, ...] = field(default=(), repr=False)  # per event, of its storage

    @property
    def num_events(self) -> int:
        return int(self.allocated.shape[0])

    @property
    def peak_allocated(self) -> int:
        return int(self.allocated.max()) if self.num_events else 0

    def series(self, category: Category) -> Bytes:
        """Bytes of ``category`` alive after each event."""
        return self.by_category[:, self.categories.index(category)]

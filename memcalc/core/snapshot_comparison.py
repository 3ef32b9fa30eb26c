"""What ``memcalc compare`` found: a real snapshot beside the simulated step, as plain records.

The comparison itself (:func:`memcalc.measure.snapshot_compare.compare_snapshot`) reads and replays
snapshots; these records are its result, so that the presentation package
(:mod:`memcalc.report.compare_render`) renders them without knowing how they were measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ("BlockDifference", "PhaseRow", "SnapshotComparison")


@dataclass(frozen=True)
class PhaseRow:
    """Allocations made in one phase: count and bytes requested, the run's and memcalc's."""

    phase: str
    real_count: int
    real_bytes: int
    memcalc_count: int
    memcalc_bytes: int


@dataclass(frozen=True)
class BlockDifference:
    """``count`` more blocks of ``size`` bytes (rounded to 512) in ``phase`` on one side than on
    the other; ``site`` is where that side made most of them, ``category`` memcalc's (or "")."""

    phase: str
    size: int
    count: int
    site: str
    category: str = ""

    @property
    def nbytes(self) -> int:
        """The bytes those blocks allocate."""
        return self.size * self.count


@dataclass(frozen=True)
class SnapshotComparison:
    """The comparison (see the module docstring); bytes throughout."""

    real_peak_allocated: int
    real_peak_reserved: int
    memcalc_peak_allocated: int
    memcalc_peak_reserved: int
    replayed_peak_reserved: int  # the run's own stream through memcalc's allocator model
    phases: tuple[PhaseRow, ...]
    missing: tuple[BlockDifference, ...]  # the run has them, memcalc does not
    extra: tuple[BlockDifference, ...]  # memcalc has them, the run does not
    missing_total: int  # bytes of every missing block (not only those listed)
    extra_total: int
    mismatch: str | None = None  # one line when the snapshot is of another model (module docstring)

    @property
    def reserved_difference(self) -> int:
        """memcalc's peak reserved minus the run's."""
        return self.memcalc_peak_reserved - self.real_peak_reserved

    @property
    def stream_part(self) -> int:
        """The part of :attr:`reserved_difference` the streams make (memcalc's stream against the
        run's, both through memcalc's allocator model)."""
        return self.memcalc_peak_reserved - self.replayed_peak_reserved

    @property
    def allocator_part(self) -> int:
        """The part the allocator model makes (the run's stream, model against the real allocator)."""
        return self.replayed_peak_reserved - self.real_peak_reserved

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for ``--format json``."""
        data = asdict(self)
        data.update(reserved_difference=self.reserved_difference, stream_part=self.stream_part,
                    allocator_part=self.allocator_part)
        return data

"""Text for :class:`~memcalc.core.snapshot_comparison.SnapshotComparison` (``memcalc compare``)."""

from __future__ import annotations

from tabulate import tabulate

from memcalc.core.snapshot_comparison import BlockDifference, SnapshotComparison
from memcalc.core.units import Unit, format_bytes

__all__ = ("render_comparison",)


def _signed(value: int, unit: Unit | str) -> str:
    return ("+" if value > 0 else "−" if value < 0 else "±") + format_bytes(abs(value), unit)


def _blocks(rows: tuple[BlockDifference, ...], unit: Unit | str, fmt: str, with_category: bool) -> str:
    table = [[d.phase, format_bytes(d.size, unit), d.count, format_bytes(d.nbytes, unit), d.site,
              *((d.category,) if with_category else ())] for d in rows]
    headers = ["phase", "block", "count", "bytes", "where (most of them)", *(("category",) if with_category else ())]
    return tabulate(table, headers=headers, tablefmt=fmt, disable_numparse=True)


def render_comparison(comparison: SnapshotComparison, *, fmt: str = "simple", unit: Unit | str = Unit.AUTO) -> str:
    """The comparison as text: peaks, the reserved difference split, phases, and the blocks each
    side lacks (binary units)."""
    c = comparison
    peaks = tabulate(
        [["peak allocated", format_bytes(c.real_peak_allocated, unit), format_bytes(c.memcalc_peak_allocated, unit),
          _signed(c.memcalc_peak_allocated - c.real_peak_allocated, unit)],
         ["peak reserved", format_bytes(c.real_peak_reserved, unit), format_bytes(c.memcalc_peak_reserved, unit),
          _signed(c.reserved_difference, unit)]],
        headers=["", "the run (snapshot)", "memcalc", "memcalc − run"], tablefmt=fmt, disable_numparse=True)
    lines = [*([f"warning: {c.mismatch}", ""] if c.mismatch else []), peaks, "",
             f"reserved difference {_signed(c.reserved_difference, unit)}: the run's own allocations replayed "
             f"through memcalc's allocator model reserve {format_bytes(c.replayed_peak_reserved, unit)}, so "
             f"{_signed(c.stream_part, unit)} comes from memcalc's allocations (which tensors and workspaces) and "
             f"{_signed(c.allocator_part, unit)} from the allocator model (cached blocks reused in another order)",
             "",
             "allocations by phase (the run's phase read from each allocation's Python stack; no stack: backward)",
             tabulate([[p.phase, p.real_count, format_bytes(p.real_bytes, unit), p.memcalc_count,
                        format_bytes(p.memcalc_bytes, unit)] for p in c.phases],
                      headers=["phase", "run: count", "run: bytes", "memcalc: count", "memcalc: bytes"],
                      tablefmt=fmt, disable_numparse=True),
             "",
             f"blocks the run allocates that memcalc does not ({format_bytes(c.missing_total, unit)} in all; "
             f"matched by phase and size, largest first)",
             _blocks(c.missing, unit, fmt, with_category=False),
             "",
             f"blocks memcalc allocates that the run does not ({format_bytes(c.extra_total, unit)} in all)",
             _blocks(c.extra, unit, fmt, with_category=True)]
    return "\n".join(lines) + "\n"

"""Memory against batch size, one line per configuration, as a PNG (or any format matplotlib
writes). matplotlib is an optional extra (``pip install memcalc[plot]``), imported only here
and only when a plot is asked for. The figure is drawn on its own ``Figure`` with an Agg
canvas: pyplot's global state and the user's backend are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memcalc.core.errors import MissingPackageError
from memcalc.core.units import Unit
from memcalc.search.sweep import SweepPoint

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

__all__ = ("check_available", "plot_sweep")

_GIB = 1024**3
#: Batch sizes spanning more than this ratio are drawn on a log2 axis.
_LOG_AXIS_RATIO = 16


def plot_sweep(
    points: Sequence[SweepPoint],
    path: str | Path,
    *,
    capacity: int | None = None,
    capacity_label: str | None = None,
    title: str | None = None,
) -> Path:
    """Draw peak allocated memory (GiB) against batch size, one line per optimizer and
    precision, with ``capacity`` as a horizontal line when given; write it to ``path``."""
    figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(7.0, 4.5), dpi=100)
    canvas_class(figure)
    axes = figure.add_subplot(1, 1, 1)
    for label, series in _series(points).items():
        batches = [p.batch_size for p in series]
        peaks = [p.report.bytes.peak_allocated / _GIB for p in series]
        axes.plot(batches, peaks, marker="o", label=label)
    if capacity is not None:
        axes.axhline(capacity / _GIB, color="black", linestyle="--", linewidth=1,
                     label=capacity_label or f"capacity {capacity / _GIB:.2f} GiB")
    batches = sorted({p.batch_size for p in points})
    if batches and batches[-1] >= _LOG_AXIS_RATIO * batches[0]:
        axes.set_xscale("log", base=2)
    axes.set_xlabel("batch size")
    axes.set_ylabel(f"peak allocated ({Unit.GIB.value}, binary)")
    axes.set_ylim(bottom=0)
    axes.set_title(title or _default_title(points))
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    target = Path(path)
    figure.savefig(target)
    return target


def _series(points: Sequence[SweepPoint]) -> dict[str, list[SweepPoint]]:
    grouped: dict[str, list[SweepPoint]] = {}
    for point in points:
        grouped.setdefault(point.series, []).append(point)
    return {label: sorted(series, key=lambda p: p.batch_size) for label, series in grouped.items()}


def _default_title(points: Sequence[SweepPoint]) -> str:
    models = sorted({p.report.model for p in points})
    modes = sorted({p.report.mode.value for p in points})
    return f"memcalc: {', '.join(models)} ({', '.join(modes)})" if models else "memcalc"


def check_available() -> None:
    """Raise :class:`~memcalc.core.errors.MissingPackageError` now if matplotlib is missing."""
    _matplotlib()


def _matplotlib() -> tuple[type[Figure], type[FigureCanvasAgg]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingPackageError("matplotlib", "--plot") from None
    return Figure, FigureCanvasAgg

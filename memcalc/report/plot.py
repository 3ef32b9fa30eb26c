"""Memory against batch size, one line per configuration, as a PNG (or any format matplotlib
writes), in the style of the README's figure (``scripts/make_figures.py``): a linear batch
axis from 0 — peak memory is close to affine in the batch, and a linear axis shows it as the
straight line it is —, one marker and dash pattern per series, the budget as a horizontal
line and, on each series, the largest swept batch that fits it.

matplotlib is an optional extra (``pip install memcalc[plot]``), imported only here and only
when a plot is asked for. The figure is drawn on its own ``Figure`` with an Agg canvas:
pyplot's global state and the user's backend are left alone. The file is checked before the
sweep (:func:`check_plot_path`) and written whole or not at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memcalc.core.errors import MissingPackageError, PlotPathError
from memcalc.core.output import check_writable, write_atomically
from memcalc.core.units import auto_unit, unit_bytes
from memcalc.search.sweep import SweepPoint

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

__all__ = ("check_available", "check_plot_path", "plot_sweep", "sweep_figure")

#: Series that coincide stay visible: each gets its own marker and dash pattern (as the README figure).
_STYLES: tuple[dict[str, Any], ...] = (
    {"marker": "o", "linestyle": "-"}, {"marker": "s", "linestyle": "--"},
    {"marker": "^", "linestyle": "-."}, {"marker": "D", "linestyle": ":"},
)


def sweep_figure(
    points: Sequence[SweepPoint],
    *,
    capacity: int | None = None,
    capacity_label: str | None = None,
    title: str | None = None,
) -> Figure:
    """Peak allocated memory against batch size, one line per optimizer and precision; with
    ``capacity``, a horizontal line at it and, on each series, a larger dot on the largest
    batch that fits. When every point's report has a step time (``--time``), a second panel
    below shows samples/s against batch size.

    Args:
        points: the sweep's points (:func:`memcalc.sweep`).
        capacity: the budget in bytes (the points' ``fits`` answer for it); None: none drawn.
        capacity_label: the budget line's legend entry (default: its size).
        title: the figure's title (default: the model and mode).

    Returns:
        The figure, on an Agg canvas, not yet saved.
    """
    figure_class, canvas_class = _matplotlib()
    timed = bool(points) and all(p.report.time is not None for p in points)  # a sweep with --time
    figure = figure_class(figsize=(7.5, 8.0 if timed else 5.0), dpi=100, layout="constrained")
    canvas_class(figure)
    axes = figure.add_subplot(2 if timed else 1, 1, 1)
    peaks = [p.report.bytes.peak_allocated for p in points] + ([capacity] if capacity is not None else [])
    unit = auto_unit(max(peaks, default=0))
    scale = unit_bytes(unit)
    for (label, series), style in zip(_series(points).items(), itertools.cycle(_STYLES)):
        (line,) = axes.plot([p.batch_size for p in series], [p.report.bytes.peak_allocated / scale for p in series],
                            markersize=4, label=label, **style)
        fitting = [p for p in series if p.fits]
        if capacity is not None and fitting:
            best = fitting[-1]
            # a ring, so that coinciding marks of several series all stay visible
            axes.plot([best.batch_size], [best.report.bytes.peak_allocated / scale], marker="o", markersize=10,
                      markerfacecolor="none", markeredgewidth=1.8, color=line.get_color(), linestyle="none",
                      label=f"{label}: batch {best.batch_size}, the largest swept that fits")
    if capacity is not None:
        axes.axhline(capacity / scale, color="black", linestyle=(0, (4, 3)), linewidth=1,
                     label=capacity_label or f"budget: {capacity / scale:,.2f} {unit.value}")
    axes.set_xlabel("batch size")
    axes.set_ylabel(f"peak allocated ({unit.value}, binary)")
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.set_title(title or _default_title(points))
    axes.grid(True, alpha=0.3)
    if timed:
        _throughput_axes(figure.add_subplot(2, 1, 2, sharex=axes), points)
    figure.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)
    return figure


def _throughput_axes(axes: Any, points: Sequence[SweepPoint]) -> None:
    """Samples/s against batch size under the memory, one line per series in the same styles
    (and, axes by axes, the same colours)."""
    for (_label, series), style in zip(_series(points).items(), itertools.cycle(_STYLES)):
        rates = [p.report.time.samples_per_second if p.report.time is not None else 0.0 for p in series]
        axes.plot([p.batch_size for p in series], rates, markersize=4, **style)
    axes.set_xlabel("batch size")
    axes.set_ylabel("samples/s (roofline fitted to H200 kernels)")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)


def plot_sweep(
    points: Sequence[SweepPoint],
    path: str | Path,
    *,
    capacity: int | None = None,
    capacity_label: str | None = None,
    title: str | None = None,
    force: bool = False,
) -> Path:
    """Draw :func:`sweep_figure` and write it to ``path``, in the format its extension names.

    Args:
        points, capacity, capacity_label, title: as for :func:`sweep_figure`.
        path: the file; its folder must exist.
        force: replace ``path`` if it exists (else an existing file is refused, left as it was).

    Returns:
        The path written.

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is False.
        PlotPathError: the folder is missing or read-only, the extension is not a format
            matplotlib writes, or writing failed; nothing is left at ``path`` then.
        MissingPackageError: matplotlib is not installed.
    """
    target, fmt = check_plot_path(path, force=force)
    figure = sweep_figure(points, capacity=capacity, capacity_label=capacity_label, title=title)
    write_atomically(target, "plot", lambda temporary: figure.savefig(temporary, format=fmt), force=force)
    return target


def check_plot_path(path: str | Path, *, force: bool = False) -> tuple[Path, str]:
    """Check, before any work, that a plot can be written to ``path``.

    Args:
        path: the file the plot goes to.
        force: replace it if it exists (else an existing file is refused).

    Returns:
        The path and the format its extension names (``"png"``).

    Raises:
        MissingPackageError: matplotlib is not installed.
        OutputExistsError: the file exists and ``force`` is False.
        PlotPathError: its folder does not exist or cannot be written, it is a folder, or its
            extension is not a format matplotlib writes — one line naming the path (and the
            formats).
    """
    _figure_class, canvas_class = _matplotlib()
    target = Path(path)
    formats = sorted(canvas_class.get_supported_filetypes())
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in formats:
        what = f"{target.suffix!r} is not an" if target.suffix else "a name without an extension names no"
        raise PlotPathError(f"cannot write the plot to {target}: {what} image format matplotlib writes; "
                            f"end the name in one of {', '.join('.' + f for f in formats)}")
    check_writable(target, "plot", force=force)
    return target, fmt


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

"""The memory timeline of a simulated step (:meth:`MemoryReport.timeline`) as a picture:
allocated memory stacked by category over the events of both iterations, reserved as a line,
the phases as shaded bands, the peak marked, the capacity when the report has one, and the
ten largest storages alive at the peak. One panel per GPU role under a multi-GPU strategy,
on one time axis.

``--timeline FILE`` writes it: ``.png`` and ``.svg`` through matplotlib (an optional extra,
imported only here and only when such a picture is asked for; drawn on its own ``Figure``
with an Agg canvas, leaving pyplot's global state alone), ``.html`` through
:mod:`memcalc.report.timeline_html` (no matplotlib; one self-contained file). The path is
checked before the estimate (:func:`check_timeline_path`) and written whole or not at all.

The drawing and the HTML share what is drawn, the events kept of a long step, the styles and
the axes (:mod:`memcalc.report.timeline_chart`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from memcalc.core.categories import Mode
from memcalc.core.errors import MissingPackageError
from memcalc.core.output import check_output_path, write_atomically
from memcalc.core.report import MemoryReport
from memcalc.core.timeline import Timeline
from memcalc.core.units import Unit, format_bytes, unit_bytes
from memcalc.report.timeline_chart import (
    CAPACITY_COLOR,
    CATEGORY_STYLE,
    LARGEST_SHOWN,
    PEAK_COLOR,
    PHASE_STYLE,
    RESERVED_COLOR,
    ceiling,
    event_axis_label,
    event_labels,
    memory_unit,
    sample,
)
from memcalc.report.timeline_html import timeline_html

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

__all__ = (
    "TIMELINE_FORMATS",
    "check_timeline_path",
    "default_title",
    "timeline_figure",
    "timelines_of",
    "write_timeline",
)

#: The formats ``--timeline`` writes, by file extension.
TIMELINE_FORMATS = ("html", "png", "svg")

def timelines_of(report: MemoryReport) -> list[Timeline]:
    """The timelines to draw for ``report``: its own, or one per GPU role of a multi-GPU
    strategy (named after the role, with the report's capacity when the timeline has none)."""
    if not report.roles:
        return [_with_capacity(report.timeline(), report.capacity)]
    timelines = []
    for role in report.roles:
        ranks = role.ranks
        contiguous = list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))) if ranks else False
        listed = f"{ranks[0]}–{ranks[-1]}" if contiguous and len(ranks) > 2 else ", ".join(map(str, ranks))
        name = role.name if len(ranks) <= 1 else f"{role.name} (ranks {listed})"
        timeline = _with_capacity(role.report.timeline(), role.report.capacity or report.capacity)
        timelines.append(dataclasses.replace(timeline, role=name))
    return timelines


def _with_capacity(timeline: Timeline, capacity: int | None) -> Timeline:
    if timeline.capacity is None and capacity is not None:
        return dataclasses.replace(timeline, capacity=capacity)
    return timeline


def default_title(report: MemoryReport) -> str:
    """``memcalc: resnet50, batch 64, adam, fp32, A100 40GB``: the step a timeline shows."""
    parts = [report.model, f"batch {report.batch_size}", report.mode.value]
    if report.mode is Mode.TRAIN and report.optimizer and report.optimizer != "none":
        parts.append(report.optimizer)
    parts.append(report.precision.value)
    if report.checkpoint:
        parts.append("checkpointing")
    if report.gpu_named:
        parts.append(report.gpu.name)
    if report.roles:
        parts.append(f"{report.strategy} × {report.world_size}")
    return "memcalc: " + ", ".join(parts)


def check_timeline_path(path: str | Path, *, force: bool = False) -> tuple[Path, str]:
    """Check, before any work, that a timeline can be written to ``path``.

    Args:
        path: the file.
        force: replace it if it exists (else an existing file is refused).

    Returns:
        The path and its format (``"html"``, ``"png"`` or ``"svg"``).

    Raises:
        OutputExistsError: the file exists and ``force`` is False.
        PlotPathError: the extension is not one of those, the folder is missing or read-only,
            or the path is a folder — one line naming the path.
        MissingPackageError: a PNG or SVG is asked for and matplotlib is not installed.
    """
    target, fmt = check_output_path(path, "timeline", TIMELINE_FORMATS, force=force)
    if fmt != "html":
        _matplotlib()
    return target, fmt


def write_timeline(report_or_timelines: MemoryReport | Timeline | Sequence[Timeline], path: str | Path, *,
                   title: str | None = None, force: bool = False) -> Path:
    """Draw the timeline of a report (one panel per GPU role) to ``path``: ``.html``, ``.png``
    or ``.svg``, by its extension.

    Args:
        report_or_timelines: an estimate's report, or a timeline (or one per GPU role).
        path: the file; its folder must exist.
        title: the heading (default: the report's model, batch, optimizer, precision, GPU).
        force: replace ``path`` if it exists (else an existing file is refused, left as it was).

    Returns:
        The path written.

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is False.
        PlotPathError: as :func:`check_timeline_path`, or writing failed (nothing is left at
            ``path`` then).
        MissingPackageError: a PNG or SVG without matplotlib.
    """
    target, fmt = check_timeline_path(path, force=force)
    if isinstance(report_or_timelines, MemoryReport):
        timelines = timelines_of(report_or_timelines)
        title = title or default_title(report_or_timelines)
    elif isinstance(report_or_timelines, Timeline):
        timelines = [report_or_timelines]
    else:
        timelines = list(report_or_timelines)
    if fmt == "html":
        text = timeline_html(timelines, title=title)
        return write_atomically(target, "timeline", lambda p: p.write_text(text, encoding="utf-8"), force=force)
    figure = timeline_figure(timelines, title=title)
    # no version string in the metadata: a file changes only when its picture does
    metadata = {"Creator": None} if fmt == "svg" else {"Software": None}
    return write_atomically(target, "timeline", lambda p: figure.savefig(p, format=fmt, metadata=metadata),
                            force=force)


def timeline_figure(timelines: Sequence[Timeline] | Timeline, *, title: str | None = None) -> Figure:
    """The timeline as a matplotlib figure: one panel per timeline (GPU role), sharing the
    event axis, each with the ten largest storages alive at its peak listed beside it.

    Args:
        timelines: a timeline, or one per GPU role.
        title: the figure's title (default: "memcalc: memory timeline").

    Returns:
        The figure, on an Agg canvas, not yet saved.
    """
    figure_class, canvas_class = _matplotlib()
    timelines = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    rows = max(len(timelines), 1)
    figure = figure_class(figsize=(14.0, 1.2 + 4.2 * rows), dpi=100, layout="constrained")
    canvas_class(figure)
    grid = figure.add_gridspec(rows, 2, width_ratios=(3.0, 1.15))
    unit = memory_unit(timelines)
    events = max((t.num_events for t in timelines), default=0)
    shared: Axes | None = None
    handles: dict[str, Artist] = {}
    for row, timeline in enumerate(timelines):
        axes = figure.add_subplot(grid[row, 0], sharex=shared)
        shared = shared or axes
        handles |= _draw_panel(axes, timeline, unit)
        axes.set_xlim(0, max(events - 1, 1))
        axes.set_ylim(0, ceiling(timelines) / unit_bytes(unit))
        axes.set_ylabel(f"memory ({unit.value}, binary)")
        if row == rows - 1:
            axes.set_xlabel(event_axis_label(timelines))
        else:
            axes.tick_params(labelbottom=False)
        if timeline.role:
            axes.set_title(timeline.role, loc="left", fontsize="medium")
        listing = figure.add_subplot(grid[row, 1])
        _draw_largest(listing, timeline)
    figure.suptitle(title or "memcalc: memory timeline", fontsize="large")
    # the stack's categories and the lines first, the phase bands (named in the chart too) last
    labels = sorted(handles, key=lambda label: label.startswith("phase: "))
    figure.legend([handles[label] for label in labels], labels, loc="outside lower center", ncols=6,
                  fontsize="small", frameon=False)
    return figure


def _draw_panel(axes: Axes, timeline: Timeline, unit: Unit) -> dict[str, Artist]:
    """One role's chart; returns its legend entries by label."""
    scale = unit_bytes(unit)
    handles: dict[str, Artist] = {}
    _draw_phases(axes, timeline, handles)
    if not timeline.num_events:
        axes.text(0.5, 0.5, "no allocations", transform=axes.transAxes, ha="center", va="center")
        return handles
    drawn = sample(timeline)
    x = drawn.indices
    # Every event kept: memory holds from one event to the next (steps). Sampled: the samples
    # are closer than a pixel, and straight segments halve the vertices of the file.
    step: Literal["post"] | None = "post" if len(x) == timeline.num_events else None
    bottom = np.zeros(len(x), dtype=np.float64)
    for layer in drawn.layers:
        top = bottom + layer.values / scale
        handles[layer.label] = axes.fill_between(x, bottom, top, step=step, color=layer.color, linewidth=0,
                                                 label=layer.label)
        bottom = top
    (handles["reserved"],) = axes.plot(x, drawn.reserved / scale, drawstyle="steps-post" if step else "default",
                                       color=RESERVED_COLOR, linewidth=1.0, label="reserved")
    if timeline.capacity is not None:
        handles["capacity"] = axes.axhline(timeline.capacity / scale, color=CAPACITY_COLOR, linestyle=(0, (5, 3)),
                                           linewidth=1.2, label="capacity")
        axes.annotate(f"capacity {format_bytes(timeline.capacity, unit)}", (0.005, timeline.capacity / scale),
                      xycoords=("axes fraction", "data"), xytext=(0, 3), textcoords="offset points",
                      fontsize="small", va="bottom")
    peak = timeline.peak_index
    peak_bytes = int(timeline.allocated[peak])
    (handles["peak allocated"],) = axes.plot([peak], [peak_bytes / scale], marker="v", markersize=9,
                                             color=PEAK_COLOR, linestyle="none", label="peak allocated")
    phase, module, _op = event_labels(timeline, peak)
    right = peak > 0.6 * max(timeline.num_events - 1, 1)
    axes.annotate(f"peak {format_bytes(peak_bytes, unit)}\n{phase}\n{module}", (peak, peak_bytes / scale),
                  xytext=(-10 if right else 10, 6), textcoords="offset points", fontsize="small",
                  ha="right" if right else "left", va="bottom",
                  bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "alpha": 0.85, "linewidth": 0})
    axes.grid(True, axis="y", alpha=0.3)
    return handles


def _draw_phases(axes: Axes, timeline: Timeline, handles: dict[str, Artist]) -> None:
    events = max(timeline.num_events, 1)
    twice = any(span.iteration > 1 for span in timeline.spans)
    for span in timeline.spans:
        if span.phase not in PHASE_STYLE or span.end <= span.start:
            continue
        name, color = PHASE_STYLE[span.phase]
        band = axes.axvspan(span.start, span.end, color=color, linewidth=0, zorder=0, label=f"phase: {name}")
        handles.setdefault(f"phase: {name}", band)
        if (span.end - span.start) / events > 0.04:  # a name that fits in its band
            axes.text((span.start + span.end) / 2, 0.985, f"{name} {span.iteration}" if twice else name,
                      ha="center", va="top",
                      transform=axes.get_xaxis_transform(), fontsize="x-small", color="#555555")
    starts = sorted({s.start for s in timeline.spans if s.iteration > 1})
    if starts:
        axes.axvline(starts[0], color="#777777", linewidth=0.8, linestyle=":")


def _draw_largest(axes: Axes, timeline: Timeline) -> None:
    axes.axis("off")
    largest = timeline.largest_at_peak[:LARGEST_SHOWN]
    lines = [f"the {len(largest)} largest alive at the peak (event {timeline.peak_index:,})", ""]
    for rank, allocation in enumerate(largest, 1):
        category = CATEGORY_STYLE.get(allocation.category, (allocation.category.value, ""))[0]
        lines.append(f"{rank:>2}. {format_bytes(allocation.nbytes):>11}  {category}, {allocation.phase.value}")
        lines.append(f"    {_shorten(allocation.module or 'top level', 32)} · "
                     f"{_shorten(_short_op(allocation.op) or 'before the step', 30)}")
    if not largest:
        lines.append("(none recorded)")
    axes.text(0.0, 1.0, "\n".join(lines), transform=axes.transAxes, family="monospace", fontsize=7.2,
              va="top", ha="left", linespacing=1.25)


def _short_op(op: str) -> str:
    """``aten.convolution.default`` → ``convolution``: the list is narrow (the HTML shows it whole)."""
    return op.removeprefix("aten.").removesuffix(".default")


def _shorten(text: str, width: int) -> str:
    """Keep the end of a long dotted path (the leaf module is the informative part)."""
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _matplotlib() -> tuple[type[Figure], type[FigureCanvasAgg]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingPackageError("matplotlib", "a PNG or SVG timeline (--timeline)") from None
    return Figure, FigureCanvasAgg

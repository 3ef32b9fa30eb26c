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

The drawing and the HTML share what is drawn (:func:`sample`): a step has tens of thousands
of events, more than a picture has pixels, so each column of pixels keeps the events where
allocated memory is highest and lowest in it — the peak, and the troughs between layers,
survive at any width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import MissingPackageError
from memcalc.core.report import MemoryReport
from memcalc.core.timeline import Timeline
from memcalc.core.units import Unit, auto_unit, format_bytes, unit_bytes
from memcalc.report.output import check_output_path, write_atomically

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

__all__ = (
    "CATEGORY_STYLE",
    "TIMELINE_FORMATS",
    "Layer",
    "Sampled",
    "ceiling",
    "check_timeline_path",
    "event_axis_label",
    "event_labels",
    "memory_unit",
    "sample",
    "timeline_figure",
    "timelines_of",
    "write_timeline",
)

#: The formats ``--timeline`` writes, by file extension.
TIMELINE_FORMATS = ("html", "png", "svg")

#: Label and colour of each category, bottom of the stack first: what stays for the whole
#: step (the model states) below what comes and goes (activations, temporaries), so that the
#: waves of forward and backward ride on a flat floor.
CATEGORY_STYLE: dict[Category, tuple[str, str]] = {
    Category.PARAMETERS: ("parameters", "#1f77b4"),
    Category.BUFFERS: ("buffers", "#9ecae1"),
    Category.INPUTS: ("inputs", "#17becf"),
    Category.GRADIENTS: ("gradients", "#ff7f0e"),
    Category.OPTIMIZER_STATE: ("optimizer state", "#2ca02c"),
    Category.KV_CACHE: ("KV cache", "#8c564b"),
    Category.ACTIVATIONS: ("activations", "#d62728"),
    Category.WORKSPACE: ("temporaries & workspace", "#9467bd"),
}
#: The allocator's 512-byte rounding (and larger-block waste): allocated minus the requested
#: bytes of the categories, on top of the stack so that the stack's top is allocated memory.
ROUNDING_STYLE = ("allocator rounding", "#c7c7c7")
RESERVED_COLOR = "#222222"
CAPACITY_COLOR = "#000000"
PEAK_COLOR = "#000000"
#: Phase bands, light enough that the stack stays readable through them.
PHASE_STYLE: dict[Phase, tuple[str, str]] = {
    Phase.FORWARD: ("forward", "#dbe9f6"),
    Phase.LOSS: ("loss", "#f2e2f5"),
    Phase.BACKWARD: ("backward", "#fbe3cf"),
    Phase.OPTIMIZER: ("optimizer", "#dcf0dc"),
    Phase.ZERO_GRAD: ("zero_grad", "#eeeeee"),
}
#: Runs of events per panel (two samples each): about one sample per pixel column of the
#: PNG's chart, and few enough that an SVG stays near a megabyte.
PLOT_COLUMNS = 700
#: How many of ``Timeline.largest_at_peak`` are listed.
LARGEST_SHOWN = 10


@dataclass(frozen=True)
class Layer:
    """One band of the stack: ``values[k]`` bytes after event ``Sampled.indices[k]``."""

    key: str  # the category's value, or "rounding"
    label: str
    color: str
    values: npt.NDArray[np.int64]


@dataclass(frozen=True)
class Sampled:
    """What a panel draws of a timeline: the kept events and the non-empty layers at them."""

    timeline: Timeline
    indices: npt.NDArray[np.int64]
    layers: tuple[Layer, ...]

    @property
    def allocated(self) -> npt.NDArray[np.int64]:
        return self.timeline.allocated[self.indices]

    @property
    def reserved(self) -> npt.NDArray[np.int64]:
        return self.timeline.reserved[self.indices]


def sample(timeline: Timeline, columns: int = PLOT_COLUMNS) -> Sampled:
    """Keep, in each of ``columns`` equal runs of events, the event of highest and of lowest
    allocated memory (plus the first, the last and the peak), and the stack's layers there.

    Args:
        timeline: the step's timeline.
        columns: how many runs; a timeline with at most twice as many events keeps them all.

    Returns:
        The kept event indices, increasing, and one layer per category that holds bytes at
        some event (then the allocator's rounding, when there is any).
    """
    n = timeline.num_events
    allocated = timeline.allocated
    if n <= 2 * columns:
        indices = np.arange(n, dtype=np.int64)
    else:
        width = -(-n // columns)
        padded = np.full(width * columns, -1, dtype=np.int64)
        padded[:n] = allocated
        highs = padded.reshape(columns, width).argmax(axis=1)
        padded[n:] = np.iinfo(np.int64).max
        lows = padded.reshape(columns, width).argmin(axis=1)
        offsets = np.arange(columns, dtype=np.int64) * width
        kept = np.concatenate([highs + offsets, lows + offsets, [0, n - 1, timeline.peak_index]])
        indices = np.unique(kept[kept < n]).astype(np.int64)
    by_category = timeline.by_category[indices]
    layers: list[Layer] = []
    order = [c for c in CATEGORY_STYLE if c in timeline.categories]
    order += [c for c in timeline.categories if c not in CATEGORY_STYLE]
    for category in order:
        values = by_category[:, timeline.categories.index(category)]
        if n and timeline.series(category).any():
            label, color = CATEGORY_STYLE.get(category, (category.value, "#7f7f7f"))
            layers.append(Layer(category.value, label, color, values.astype(np.int64)))
    rounding = np.maximum(allocated[indices] - by_category.sum(axis=1), 0).astype(np.int64)
    if rounding.any():
        layers.append(Layer("rounding", *ROUNDING_STYLE, rounding))
    return Sampled(timeline, indices, tuple(layers))


def event_labels(timeline: Timeline, index: int) -> tuple[str, str, str]:
    """``(phase, module, op)`` of event ``index`` as shown to a reader: the phase the event
    happens in (its span, with the iteration), the module ("top level" outside any) and op."""
    phase = timeline.phase[index].value
    twice = any(span.iteration > 1 for span in timeline.spans)
    for span in timeline.spans:
        if span.start <= index < span.end:
            phase = f"{span.phase.value}, iteration {span.iteration}" if twice else span.phase.value
            break
    return phase, timeline.module[index] or "top level", timeline.op[index] or "-"


def event_axis_label(timelines: Sequence[Timeline]) -> str:
    """The time axis's name: a training step is simulated twice (the second iteration holds
    the optimizer state), a forward once."""
    twice = any(span.iteration > 1 for t in timelines for span in t.spans)
    return "allocator events of the simulated step" + (" (iteration 1, then iteration 2)" if twice else "")


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


def check_timeline_path(path: str | Path) -> tuple[Path, str]:
    """Check, before any work, that a timeline can be written to ``path``.

    Returns:
        The path and its format (``"html"``, ``"png"`` or ``"svg"``).

    Raises:
        PlotPathError: the extension is not one of those, the folder is missing or read-only,
            or the path is a folder — one line naming the path.
        MissingPackageError: a PNG or SVG is asked for and matplotlib is not installed.
    """
    target, fmt = check_output_path(path, "timeline", TIMELINE_FORMATS)
    if fmt != "html":
        _matplotlib()
    return target, fmt


def write_timeline(report_or_timelines: MemoryReport | Timeline | Sequence[Timeline], path: str | Path, *,
                   title: str | None = None) -> Path:
    """Draw the timeline of a report (one panel per GPU role) to ``path``: ``.html``, ``.png``
    or ``.svg``, by its extension.

    Args:
        report_or_timelines: an estimate's report, or a timeline (or one per GPU role).
        path: the file; its folder must exist.
        title: the heading (default: the report's model, batch, optimizer, precision, GPU).

    Returns:
        The path written.

    Raises:
        PlotPathError: as :func:`check_timeline_path`, or writing failed (nothing is left at
            ``path`` then).
        MissingPackageError: a PNG or SVG without matplotlib.
    """
    target, fmt = check_timeline_path(path)
    if isinstance(report_or_timelines, MemoryReport):
        timelines = timelines_of(report_or_timelines)
        title = title or default_title(report_or_timelines)
    elif isinstance(report_or_timelines, Timeline):
        timelines = [report_or_timelines]
    else:
        timelines = list(report_or_timelines)
    if fmt == "html":
        from memcalc.report.timeline_html import timeline_html

        text = timeline_html(timelines, title=title)
        return write_atomically(target, "timeline", lambda p: p.write_text(text, encoding="utf-8"))
    figure = timeline_figure(timelines, title=title)
    # no version string in the metadata: a file changes only when its picture does
    metadata = {"Creator": None} if fmt == "svg" else {"Software": None}
    return write_atomically(target, "timeline", lambda p: figure.savefig(p, format=fmt, metadata=metadata))


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


def memory_unit(timelines: Sequence[Timeline]) -> Unit:
    """The binary unit of the memory axis: that of the highest of reserved and capacity."""
    top = max([int(t.reserved.max()) if t.num_events else 0 for t in timelines]
              + [t.capacity or 0 for t in timelines] + [1])
    return auto_unit(top)


def ceiling(timelines: Sequence[Timeline]) -> int:
    """The bytes the charts' memory axis reaches: the same for every role, so that their
    heights compare; room above the highest of reserved, capacity and peak for the phase
    names and the peak's label."""
    top = max([int(t.reserved.max()) if t.num_events else 0 for t in timelines]
              + [t.capacity or 0 for t in timelines] + [t.peak_allocated for t in timelines] + [1])
    return int(top * 1.22)


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

"""What both drawings of a memory timeline show, shared by the picture
(:mod:`memcalc.report.timeline_plot`, matplotlib) and the HTML page
(:mod:`memcalc.report.timeline_html`): the colours and labels of the categories and phases, the
events kept of a long step (:func:`sample`), the words under the pointer and on the time axis,
and the memory axis's unit and height (the same for every GPU role, so that their charts compare).

A step has tens of thousands of events, more than a picture has pixels, so each column of
pixels keeps the events where allocated memory is highest and lowest in it: the peak, and the
troughs between layers, survive at any width. Both drawings import this module; the HTML page
imports nothing of the picture's (the picture's module, which writes either file, imports the
page), so the two form no cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memcalc.core.categories import Category, Phase
from memcalc.core.timeline import Timeline
from memcalc.core.units import Unit, auto_unit

__all__ = (
    "CAPACITY_COLOR",
    "CATEGORY_STYLE",
    "LARGEST_SHOWN",
    "PEAK_COLOR",
    "PHASE_STYLE",
    "PLOT_COLUMNS",
    "RESERVED_COLOR",
    "ROUNDING_STYLE",
    "Layer",
    "Sampled",
    "ceiling",
    "event_axis_label",
    "event_labels",
    "memory_unit",
    "sample",
)

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

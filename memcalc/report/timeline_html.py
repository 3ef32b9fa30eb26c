"""The memory timeline (:meth:`MemoryReport.timeline`) as one self-contained HTML file: an
inline SVG chart per GPU role (allocated memory stacked by category, reserved as a line,
phase bands, the peak, the capacity) and the largest storages alive at the peak, with a little
inline JavaScript that shows, under the pointer, the event's op, module, phase and bytes.

Nothing is fetched: no CDN, no font, no script from elsewhere — the file opens offline, from
an email or a CI artifact, in any browser. The chart is drawn here, in Python, so that it is
there even with scripts off; the script only adds the hover. What is drawn is what the PNG
draws (:func:`memcalc.report.timeline_chart.sample`): per pixel column, the events of highest
and lowest allocated memory; hovering names the nearest such event.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from memcalc.core.timeline import Timeline
from memcalc.core.units import Unit, format_bytes, unit_bytes
from memcalc.report.timeline_chart import (
    CAPACITY_COLOR,
    CATEGORY_STYLE,
    LARGEST_SHOWN,
    PHASE_STYLE,
    RESERVED_COLOR,
    Sampled,
    ceiling,
    event_axis_label,
    event_labels,
    memory_unit,
    sample,
)

__all__ = ("timeline_html",)

#: The chart's size in SVG units (pixels at 100 % zoom) and its margins.
WIDTH, HEIGHT = 1100, 380
LEFT, RIGHT, TOP, BOTTOM = 74, 18, 30, 42
#: Runs of events sampled per chart: about one per pixel of the plot area's width.
HTML_COLUMNS = (WIDTH - LEFT - RIGHT) // 2


def timeline_html(timelines: Sequence[Timeline] | Timeline, *, title: str | None = None) -> str:
    """The timelines as one HTML document: one chart per timeline (GPU role), sharing the
    event axis, each followed by the ten largest storages alive at its peak.

    Args:
        timelines: a timeline, or one per GPU role.
        title: the page's heading (default: "memcalc: memory timeline").

    Returns:
        The document's text (UTF-8, no external resources).
    """
    timelines = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    title = title or "memcalc: memory timeline"
    events = max((t.num_events for t in timelines), default=0)
    top = ceiling(timelines)
    unit = memory_unit(timelines)
    data: list[dict[str, Any]] = []
    sections: list[str] = []
    for k, timeline in enumerate(timelines):
        drawn = sample(timeline, HTML_COLUMNS)
        chart = _Chart(drawn, events, top, unit, event_axis_label(timelines))
        sections.append(_section(k, chart))
        data.append(chart.hover_data())
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # no "</script>" inside
    twice = any(span.iteration > 1 for t in timelines for span in t.spans)
    steps = "both iterations: the second holds the optimizer state" if twice else "one iteration"
    return _PAGE.format(title=_esc(title), sections="\n".join(sections), data=payload, style=_STYLE,
                        script=_SCRIPT, legend=_legend(timelines), events=f"{events:,}", steps=steps)


class _Chart:
    """The geometry of one role's chart: event → x, bytes → y."""

    def __init__(self, drawn: Sampled, events: int, top: int, unit: Unit, axis_label: str) -> None:
        self.drawn = drawn
        self.axis_label = axis_label
        self.timeline = drawn.timeline
        self.unit = unit
        self.scale = unit_bytes(unit)
        self.last = max(events - 1, 1)
        # the same memory axis for every role (``top``, from timeline_plot.ceiling), in units
        self.step = _nice_step(top / self.scale, 6)
        self.ceiling = math.ceil(top / self.scale / self.step) * self.step

    def x(self, event: float) -> float:
        return LEFT + event / self.last * (WIDTH - LEFT - RIGHT)

    def y(self, nbytes: float) -> float:
        return HEIGHT - BOTTOM - nbytes / self.scale / self.ceiling * (HEIGHT - TOP - BOTTOM)

    def hover_data(self) -> dict[str, Any]:
        """Per sampled event, what the tooltip shows (strings once, indexed)."""
        t, idx = self.timeline, self.drawn.indices
        if not t.num_events:
            return {"x": [], "layers": []}
        previous = np.vstack([np.zeros((1, t.by_category.shape[1]), dtype=np.int64), t.by_category[:-1]])
        change = (t.by_category - previous)[idx]
        strings: dict[str, int] = {}
        labels = [event_labels(t, int(i)) for i in idx]

        def ref(text: str) -> int:
            return strings.setdefault(text, len(strings))

        return {
            "x": [round(self.x(int(i)), 1) for i in idx],
            "y": [round(self.y(int(a)), 1) for a in t.allocated[idx]],
            "event": idx.tolist(),
            "allocated": t.allocated[idx].tolist(),
            "reserved": t.reserved[idx].tolist(),
            "bytes": np.abs(change.sum(axis=1)).tolist(),
            "alloc": t.is_alloc[idx].astype(int).tolist(),
            "category": [ref(CATEGORY_STYLE.get(t.categories[j], (t.categories[j].value, ""))[0])
                         for j in np.abs(change).argmax(axis=1)],
            "phase": [ref(phase) for phase, _, _ in labels],
            "module": [ref(module) for _, module, _ in labels],
            "op": [ref(op) for _, _, op in labels],
            "strings": list(strings),
            "layers": [{"label": layer.label, "color": layer.color, "values": layer.values.tolist()}
                       for layer in self.drawn.layers],
        }


def _section(k: int, chart: _Chart) -> str:
    t = chart.timeline
    heading = f"<h2>{_esc(t.role)}</h2>" if t.role else ""
    return (f'<section class="role" data-role="{_esc(t.role)}" data-index="{k}">{heading}'
            f'<p class="summary">{_summary(t, chart.unit)}</p>'
            f'<div class="chart">{_svg(chart)}<div class="tooltip" hidden></div></div>'
            f"{_largest(t)}</section>")


def _summary(t: Timeline, unit: Unit) -> str:
    if not t.num_events:
        return "no allocations"
    phase, module, op = event_labels(t, t.peak_index)
    text = (f"peak allocated <b>{format_bytes(t.peak_allocated, unit)}</b> at event {t.peak_index:,} "
            f"({_esc(phase)}, {_esc(module)}, {_esc(op)}); peak reserved "
            f"{format_bytes(int(t.reserved.max()), unit)}")
    if t.capacity is not None:
        text += f"; capacity {format_bytes(t.capacity, unit)}"
    return text + f"; {t.num_events:,} events"


def _svg(chart: _Chart) -> str:
    t, drawn = chart.timeline, chart.drawn
    parts = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="memory over the events of the step">']
    parts += _phase_bands(chart)
    parts += _axes(chart)
    if t.num_events:
        xs = [chart.x(int(i)) for i in drawn.indices]
        bottom = np.zeros(len(xs), dtype=np.int64)
        for layer in drawn.layers:
            top = bottom + layer.values
            upper = " ".join(f"{x:.1f},{chart.y(int(v)):.1f}" for x, v in zip(xs, top, strict=True))
            lower = " ".join(f"{x:.1f},{chart.y(int(v)):.1f}" for x, v in zip(reversed(xs), bottom[::-1], strict=True))
            parts.append(f'<path class="area" data-category="{_esc(layer.key)}" fill="{layer.color}" '
                         f'd="M{upper} L{lower} Z"><title>{_esc(layer.label)}</title></path>')
            bottom = top
        reserved = " ".join(f"{x:.1f},{chart.y(int(v)):.1f}" for x, v in zip(xs, drawn.reserved, strict=True))
        parts.append(f'<path class="reserved" fill="none" stroke="{RESERVED_COLOR}" stroke-width="1.2" '
                     f'd="M{reserved}"><title>reserved</title></path>')
        if t.capacity is not None:
            y = chart.y(t.capacity)
            parts.append(f'<g class="capacity"><line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                         f'stroke="{CAPACITY_COLOR}" stroke-dasharray="6 4" stroke-width="1.3"/>'
                         f'<text x="{LEFT + 4}" y="{y - 4:.1f}">capacity {format_bytes(t.capacity, chart.unit)}'
                         f"</text></g>")
        px, py = chart.x(t.peak_index), chart.y(t.peak_allocated)
        anchor = "end" if px > LEFT + 0.6 * (WIDTH - LEFT - RIGHT) else "start"
        dx = -9 if anchor == "end" else 9
        parts.append(f'<g class="peak" data-event="{t.peak_index}" data-bytes="{t.peak_allocated}">'
                     f'<path d="M{px - 6:.1f},{py - 11:.1f} L{px + 6:.1f},{py - 11:.1f} L{px:.1f},{py - 1:.1f} Z" '
                     f'fill="#000"/><text x="{px + dx:.1f}" y="{py - 14:.1f}" text-anchor="{anchor}">'
                     f"peak {format_bytes(t.peak_allocated, chart.unit)}</text></g>")
        parts.append(f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{HEIGHT - BOTTOM}" visibility="hidden"/>'
                     f'<circle class="dot" r="3.5" cx="0" cy="0" visibility="hidden"/>')
    else:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no allocations</text>')
    parts.append("</svg>")
    return "".join(parts)


def _phase_bands(chart: _Chart) -> list[str]:
    t = chart.timeline
    twice = any(span.iteration > 1 for span in t.spans)
    parts = []
    for span in t.spans:
        if span.phase not in PHASE_STYLE or span.end <= span.start:
            continue
        name, color = PHASE_STYLE[span.phase]
        x0, x1 = chart.x(span.start), chart.x(span.end)
        parts.append(f'<rect class="phase" data-phase="{span.phase.value}" data-iteration="{span.iteration}" '
                     f'x="{x0:.1f}" y="{TOP}" width="{x1 - x0:.1f}" height="{HEIGHT - TOP - BOTTOM}" '
                     f'fill="{color}"><title>{name}{f", iteration {span.iteration}" if twice else ""}</title></rect>')
        if x1 - x0 > 8 * len(name) + 14:  # its name fits in the band
            parts.append(f'<text class="phase-name" x="{(x0 + x1) / 2:.1f}" y="{TOP + 12}" '
                         f'text-anchor="middle">{f"{name} {span.iteration}" if twice else name}</text>')
    second = sorted(s.start for s in t.spans if s.iteration > 1)
    if second:
        x = chart.x(second[0])
        parts.append(f'<line class="iteration" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}"/>')
    return parts


def _axes(chart: _Chart) -> list[str]:
    parts = ['<g class="axes">']
    value = 0.0
    while value <= chart.ceiling + 1e-9:
        y = chart.y(value * chart.scale)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_number(value)}</text>')
        value += chart.step
    step = _nice_step(chart.last, 8)
    event = 0.0
    while event <= chart.last:
        x = chart.x(event)
        parts.append(f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{HEIGHT - BOTTOM}" '
                     f'y2="{HEIGHT - BOTTOM + 4}"/><text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" '
                     f'text-anchor="middle">{int(event):,}</text>')
        event += step
    parts.append(f'<line class="frame" x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{HEIGHT - BOTTOM}"/>'
                 f'<line class="frame" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" '
                 f'y2="{HEIGHT - BOTTOM}"/>'
                 f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle">'
                 f"{chart.axis_label}</text>"
                 f'<text transform="translate(16 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" text-anchor="middle">'
                 f"memory ({chart.unit.value}, binary)</text></g>")
    return parts


def _largest(t: Timeline) -> str:
    largest = t.largest_at_peak[:LARGEST_SHOWN]
    if not largest:
        return ""
    rows = "".join(
        f"<tr><td>{rank}</td><td class=\"num\">{format_bytes(a.nbytes)}</td>"
        f"<td>{_esc(CATEGORY_STYLE.get(a.category, (a.category.value, ''))[0])}</td>"
        f"<td><code>{_esc(a.module or 'top level')}</code></td><td><code>{_esc(a.op or 'before the step')}</code></td>"
        f"<td>{_esc(a.phase.value)}</td></tr>"
        for rank, a in enumerate(largest, 1))
    return (f'<table class="largest"><caption>the {len(largest)} largest storages alive at the peak</caption>'
            f"<thead><tr><th>#</th><th>size</th><th>category</th><th>module</th><th>op</th>"
            f"<th>born in</th></tr></thead><tbody>{rows}</tbody></table>")


def _legend(timelines: Sequence[Timeline]) -> str:
    seen: dict[str, str] = {}
    for timeline in timelines:
        for layer in sample(timeline, 1).layers:
            seen.setdefault(layer.label, layer.color)
    items = [f'<span><i style="background:{color}"></i>{_esc(label)}</span>' for label, color in seen.items()]
    items.append(f'<span><i class="line" style="border-color:{RESERVED_COLOR}"></i>reserved</span>')
    if any(t.capacity is not None for t in timelines):
        items.append('<span><i class="dashed"></i>capacity</span>')
    items.append("<span>▼ peak allocated</span>")
    items += [f'<span><i style="background:{color}"></i>{name}</span>' for name, color in PHASE_STYLE.values()]
    return '<div class="legend">' + "".join(items) + "</div>"


def _nice_step(span: float, ticks: int) -> float:
    """1, 2 or 5 times a power of ten, giving about ``ticks`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10.0 ** math.floor(math.log10(raw))
    return next(float(m * power) for m in (1, 2, 5, 10) if m * power >= raw)


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value - round(value)) < 1e-9 else f"{value:,.2f}".rstrip("0").rstrip(".")


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


_STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;max-width:1140px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 2px}
.summary,.note{margin:2px 0 6px;color:#444}
.chart{position:relative;width:1100px}
svg.timeline{display:block;font-size:11px}
svg .grid{stroke:#000;stroke-opacity:.08}svg .frame,svg .tick{stroke:#555}
svg .phase-name{fill:#555;font-size:10px}svg .iteration{stroke:#777;stroke-dasharray:2 3}
svg .capacity text,svg .peak text{font-weight:600}
svg .cursor{stroke:#000;stroke-opacity:.55}svg .dot{fill:#fff;stroke:#000;stroke-width:1.5}
.tooltip{position:absolute;pointer-events:none;background:#fff;border:1px solid #bbb;border-radius:4px;
padding:6px 8px;font-size:12px;box-shadow:0 2px 6px rgba(0,0,0,.15);min-width:240px;white-space:nowrap}
.tooltip b{font-weight:600}.tooltip .k{color:#666;display:inline-block;width:72px}
.tooltip table{border-collapse:collapse;margin-top:4px}.tooltip td{padding:0 6px 0 0}
.tooltip td.num,table.largest td.num{text-align:right;font-variant-numeric:tabular-nums}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin:8px 0;font-size:12px}
.legend i{display:inline-block;width:14px;height:10px;margin-right:5px;vertical-align:-1px}
.legend i.line{height:0;border-top:2px solid}.legend i.dashed{height:0;border-top:2px dashed #000}
table.largest{border-collapse:collapse;margin:8px 0 4px;font-size:12px}
table.largest caption{text-align:left;font-weight:600;padding-bottom:4px}
table.largest th,table.largest td{padding:2px 10px 2px 0;text-align:left;border-bottom:1px solid #eee}
"""

# The hover: the nearest sampled event to the pointer, its op, module, phase and bytes, and the
# stack's layers there. Strings are put in with textContent (module names come from user code).
_SCRIPT = """
(function () {
  "use strict";
  var charts = JSON.parse(document.getElementById("memcalc-data").textContent);
  var UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  function fmt(b) {
    var u = 0;
    while (Math.abs(b) >= 1024 && u < UNITS.length - 1) { b /= 1024; u++; }
    return (u ? b.toFixed(2) : String(b)) + " " + UNITS[u];
  }
  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  function line(key, value) {
    var p = el("div"); p.appendChild(el("span", key, "k")); p.appendChild(el("span", value)); return p;
  }
  function nearest(xs, x) {
    var lo = 0, hi = xs.length - 1;
    while (hi - lo > 1) { var mid = (lo + hi) >> 1; if (xs[mid] <= x) lo = mid; else hi = mid; }
    return Math.abs(xs[hi] - x) < Math.abs(xs[lo] - x) ? hi : lo;
  }
  document.querySelectorAll("section.role").forEach(function (section) {
    var d = charts[Number(section.getAttribute("data-index"))];
    var svg = section.querySelector("svg.timeline"), tip = section.querySelector(".tooltip");
    var cursor = svg.querySelector(".cursor"), dot = svg.querySelector(".dot");
    if (!d.x.length || !cursor) return;
    function show(j) {
      var s = d.strings;
      cursor.setAttribute("x1", d.x[j]); cursor.setAttribute("x2", d.x[j]);
      dot.setAttribute("cx", d.x[j]); dot.setAttribute("cy", d.y[j]);
      cursor.setAttribute("visibility", "visible"); dot.setAttribute("visibility", "visible");
      tip.textContent = "";
      tip.appendChild(el("div", "event " + d.event[j].toLocaleString("en") + " \\u00b7 " + s[d.phase[j]], "head"));
      tip.appendChild(line("op", s[d.op[j]]));
      tip.appendChild(line("module", s[d.module[j]]));
      tip.appendChild(line(d.alloc[j] ? "allocates" : "frees", fmt(d.bytes[j]) + " (" + s[d.category[j]] + ")"));
      tip.appendChild(line("allocated", fmt(d.allocated[j])));
      tip.appendChild(line("reserved", fmt(d.reserved[j])));
      var table = el("table");
      for (var k = d.layers.length - 1; k >= 0; k--) {
        var row = el("tr"), sw = el("td"), box = el("i");
        box.style.cssText = "display:inline-block;width:9px;height:9px;background:" + d.layers[k].color;
        sw.appendChild(box); row.appendChild(sw);
        row.appendChild(el("td", d.layers[k].label)); row.appendChild(el("td", fmt(d.layers[k].values[j]), "num"));
        table.appendChild(row);
      }
      tip.appendChild(table);
      tip.hidden = false;
      var box = svg.getBoundingClientRect(), scale = box.width / svg.viewBox.baseVal.width;
      var left = d.x[j] * scale + 14;
      if (left + tip.offsetWidth > box.width) left = d.x[j] * scale - tip.offsetWidth - 14;
      tip.style.left = Math.max(0, left) + "px";
      tip.style.top = "34px";
      section.setAttribute("data-hover-event", String(d.event[j]));
    }
    svg.addEventListener("mousemove", function (ev) {
      var pt = svg.createSVGPoint(); pt.x = ev.clientX; pt.y = ev.clientY;
      show(nearest(d.x, pt.matrixTransform(svg.getScreenCTM().inverse()).x));
    });
    svg.addEventListener("mouseleave", function () {
      tip.hidden = true; cursor.setAttribute("visibility", "hidden"); dot.setAttribute("visibility", "hidden");
    });
  });
  document.body.setAttribute("data-ready", "true");
})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{style}</style></head>
<body><h1>{title}</h1>
<p class="note">Memory over the {events} allocator events of the simulated step ({steps}).
Allocated memory stacked by category, reserved as a line; hover over a chart for an event's op, module,
phase and bytes.</p>
{legend}
{sections}
<script type="application/json" id="memcalc-data">{data}</script>
<script>{script}</script>
</body></html>
"""

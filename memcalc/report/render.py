"""Text rendering of reports: tabulate tables in binary units. Computing lives elsewhere;
this module only formats (and never changes tabulate's global settings)."""

from __future__ import annotations

import json
from typing import Any

from tabulate import tabulate

from memcalc.core.categories import Category, Mode
from memcalc.core.report import MemoryReport
from memcalc.core.units import Unit, format_bytes

__all__ = ("TABLE_FORMATS", "render_json", "render_report", "render_roles")

# tabulate's formats that read well for a breakdown; "json" is handled separately.
TABLE_FORMATS = ("simple", "plain", "github", "grid", "pipe", "rst", "orgtbl", "psql", "presto",
                 "fancy_grid", "rounded_grid", "heavy_grid", "simple_grid", "html", "latex", "tsv")

_CATEGORY_LABELS = {
    Category.PARAMETERS: "parameters",
    Category.BUFFERS: "buffers",
    Category.INPUTS: "input batch (+ targets)",
    Category.GRADIENTS: "gradients",
    Category.OPTIMIZER_STATE: "optimizer state",
    Category.ACTIVATIONS: "activations (saved for backward)",
    Category.WORKSPACE: "temporaries / workspace",
    Category.KV_CACHE: "KV cache",
}


def render_json(data: Any) -> str:
    """``data`` as indented JSON (the ``--format json`` output)."""
    return json.dumps(data, indent=2)


def render_report(report: MemoryReport, *, fmt: str = "simple", unit: Unit | str = Unit.AUTO,
                  modules: bool = True, module_depth: int = 1) -> str:
    """The breakdown table, the peak line, the textbook line, and (optionally) per-module rows.

    Args:
        report: what :func:`memcalc.estimate` returned.
        fmt: a tabulate table format (``simple``, ``github``, ...).
        unit: the byte unit of every figure (``auto`` picks per figure).
        modules: show the per-module table.
        module_depth: how deep the per-module table goes (1: the model's direct children).

    Returns:
        The text, ending with a newline.
    """
    sections = [_header(report), _breakdown(report, fmt, unit)]
    sections.append(_peak_lines(report, unit))
    if modules and module_depth > 0 and report.modules_within(module_depth):
        sections.append(_module_table(report, fmt, unit, module_depth))
    if report.measurement is not None:
        sections.append(_measurement_lines(report, unit))
    notes = list(report.notes)
    if report.unsupported_ops:
        ops = ", ".join(f"{op} ×{n}" for op, n in report.unsupported_ops)
        notes.append(f"ops whose kernel workspace is approximated: {ops}")
    if notes:
        sections.append("\n".join(f"note: {n}" for n in notes))
    return "\n\n".join(s for s in sections if s) + "\n"


_MODE_TEXT = {Mode.TRAIN: "training step", Mode.EVAL: "eval forward (no_grad)",
              Mode.INFERENCE: "inference forward (inference_mode)"}


def _header(report: MemoryReport) -> str:
    step = _MODE_TEXT[report.mode]
    if report.mode is Mode.TRAIN:
        step += f", optimizer {report.optimizer}"
        if report.accum_steps > 1:
            step += f", {report.accum_steps} accumulation steps"
        if report.checkpoint:
            step += ", checkpointing"
    gpu = report.gpu.name if report.gpu_named else f"{report.gpu.key} CUDA GPU (no --gpu given)"
    lines = [
        f"memcalc: {report.model}, batch {report.batch_size}, {step}, {report.precision.value}",
        f"on {gpu}; input {report.input_description}; loss {report.loss}; {report.parameters:,} parameters",
    ]
    return "\n".join(lines)


def _breakdown(report: MemoryReport, fmt: str, unit: Unit | str) -> str:
    b = report.bytes
    rows = []
    for category in Category:
        value = b.category(category)
        if category is Category.KV_CACHE and not value:
            continue
        detail = f"{report.parameters:,} params" if category is Category.PARAMETERS else ""
        rows.append([_CATEGORY_LABELS[category], format_bytes(value, unit), _share(value, b.peak_allocated), detail])
    rows.append(["allocator block rounding", format_bytes(b.rounding, unit), _share(b.rounding, b.peak_allocated), ""])
    rows.append(["peak allocated", format_bytes(b.peak_allocated, unit), "100.0%", report.peak_location])
    return tabulate(rows, headers=["at the peak", "memory (binary units)", "share", ""], tablefmt=fmt,
                    colalign=("left", "right", "right", "left"), disable_numparse=True)


def _share(value: int, total: int) -> str:
    return f"{100.0 * value / total:.1f}%" if total else "-"


def _peak_lines(report: MemoryReport, unit: Unit | str) -> str:
    lines = [f"peak allocated: {format_bytes(report.bytes.peak_allocated, unit)} "
             f"({report.bytes.peak_allocated:,} B) in {report.peak_location}"]
    if report.mode is Mode.TRAIN and report.peak_iteration == 2:
        lines.append(f"  reached in the second iteration (optimizer state allocated); "
                     f"the first iteration peaks at {format_bytes(report.first_iteration_peak, unit)}")
    device = (f"peak reserved by the caching allocator: {format_bytes(report.peak_reserved, unit)}; "
              f"+ CUDA context {format_bytes(report.cuda_context, unit)} (assumed for {report.gpu.key}) "
              f"= {format_bytes(report.device_total, unit)} on the device")
    lines.append(device)
    capacity, headroom = report.capacity, report.headroom
    if report.fits is not None and capacity is not None and headroom is not None:  # fits is judged under a capacity
        budget = report.gpu.name if report.gpu_named else "budget"
        if report.fits:
            lines.append(f"fits in {format_bytes(capacity, unit)} ({budget}): "
                         f"yes, {format_bytes(headroom, unit)} headroom at the peak")
        else:
            over = format_bytes(-headroom, unit) if headroom < 0 else "fragmentation"
            lines.append(f"fits in {format_bytes(capacity, unit)} ({budget}): "
                         f"NO — out of memory; {over} over at the peak")
    if report.attention_calls:
        calls = ", ".join(f"{backend} ×{count}" for backend, count in report.attention_calls)
        lines.append(f"attention kernels (as CUDA would choose): {calls}")
    tb = report.textbook
    if tb is not None:
        lines.append(
            f"textbook: parameters {format_bytes(tb.parameter_bytes, unit)} × {tb.multiplier} ({tb.terms}) "
            f"+ activations {format_bytes(tb.activation_bytes, unit)} = {format_bytes(tb.total, unit)}"
            f" vs simulated peak {format_bytes(report.bytes.peak_allocated, unit)}"
            f" ({_signed_pct(tb.total, report.bytes.peak_allocated)}); the simulation knows when each tensor "
            f"is alive: gradients appear during backward as activations are freed, optimizer state is "
            f"created at the first step, temporaries come and go.")
    return "\n".join(lines)


def _signed_pct(value: int, reference: int) -> str:
    if not reference:
        return "-"
    return f"{100.0 * (value - reference) / reference:+.1f}%"


def _module_table(report: MemoryReport, fmt: str, unit: Unit | str, depth: int) -> str:
    kept = "kept for backward" if report.mode is Mode.TRAIN else "allocated in forward"
    rows = [[("  " * (m.depth - 1)) + m.name, m.type, f"{m.parameters:,}",
             "x".join(str(d) for d in m.output_shape) if m.output_shape else "-",
             format_bytes(m.activation_bytes, unit)] for m in report.modules_within(depth)]
    return tabulate(rows, headers=["module", "type", "parameters", "output shape", f"activations {kept}"],
                    tablefmt=fmt, colalign=("left", "left", "right", "left", "right"), disable_numparse=True)


def _measurement_lines(report: MemoryReport, unit: Unit | str) -> str:
    m = report.measurement
    assert m is not None
    if m.oom:
        return f"measured on {m.device}: OOM{(' — ' + m.note) if m.note else ''}"
    if m.peak_allocated is None:
        return f"measured on {m.device}: no result{(' — ' + m.note) if m.note else ''}"
    compared = m.compared_with if m.compared_with is not None else report.bytes.peak_allocated
    error = m.relative_error(compared)
    error_text = "n/a (nothing measured)" if error is None else f"{error:+.2%}"
    line = (f"measured on {m.device}: peak {format_bytes(m.peak_allocated, unit)} ({m.peak_allocated:,} B); "
            f"estimate {format_bytes(compared, unit)}; error {error_text}")
    if m.peak_reserved is not None:
        line += f"; reserved {format_bytes(m.peak_reserved, unit)}"
    if m.note:
        line += f"\n  {m.note}"
    return line


def render_roles(report: MemoryReport, *, fmt: str = "simple", unit: Unit | str = Unit.AUTO) -> str:
    """The per-GPU table of a multi-GPU estimate: one row per kind of GPU, each with its
    breakdown at its own peak (empty for a single-GPU report)."""
    if not report.roles:
        return ""
    title = (f"memcalc: {report.model} under {report.strategy}, {report.world_size} GPUs, "
             f"global batch {report.global_batch_size} — memory per GPU at each GPU's peak (binary units)")
    shown = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.ACTIVATIONS)
    with_fit = any(r.report.fits is not None for r in report.roles)
    headers = ["GPU role", "GPUs", "batch", *[_CATEGORY_LABELS[c].split(" (")[0] for c in shown], "other",
               "peak allocated", "peak reserved", "model states", "collective buffers",
               *(["fits"] if with_fit else [])]
    rows = []
    for role in report.roles:
        b = role.bytes
        values = [b.category(c) for c in shown]
        rows.append([role.name, _ranks(role.ranks), str(role.batch_size), *[format_bytes(v, unit) for v in values],
                     format_bytes(b.peak_allocated - sum(values), unit), format_bytes(b.peak_allocated, unit),
                     format_bytes(role.report.peak_reserved, unit), format_bytes(role.model_states, unit),
                     format_bytes(role.communication, unit),
                     *([{True: "yes", False: "NO", None: "-"}[role.report.fits]] if with_fit else [])])
    table = tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True,
                     colalign=("left", "left", "right", *["right"] * 9, *(["left"] if with_fit else [])))
    busiest = report.busiest_role
    assert busiest is not None
    legend = ("other: inputs, buffers, temporaries, workspaces and allocator rounding. model states: parameters, "
              "gradients and optimizer state (fp32 master weights included) at the optimizer step. collective "
              "buffers: memory at the peak that exists only for communication (gathered parameters, "
              "all-gather / reduce-scatter / reduce buffers, DDP buckets that are not the gradients); it is "
              "counted in the columns before.")
    return f"{title}\n\n{table}\n\n{legend}\nbusiest: {busiest.name} — its breakdown follows.\n"


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"cuda:{ranks[0]}-{ranks[-1]}"
    return ", ".join(f"cuda:{r}" for r in ranks)

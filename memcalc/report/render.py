"""Text rendering of reports: tabulate tables in binary units. Computing lives elsewhere;
this module only formats (and never changes tabulate's global settings)."""

from __future__ import annotations

from tabulate import tabulate

from memcalc.core.categories import Category, Mode
from memcalc.core.report import MemoryReport, Textbook
from memcalc.core.units import Unit, format_bytes
from memcalc.report.formats import TABLE_FORMATS, render_json
from memcalc.targets.resolved_stack import installed_torch_version
from memcalc.timing.time_render import render_time

__all__ = ("TABLE_FORMATS", "render_json", "render_report", "render_roles")

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
# Without autograd nothing is saved for backward: the activations alive at the peak are
# layer outputs the next op still reads; gradients and optimizer state cannot exist.
_FORWARD_ONLY_LABELS = _CATEGORY_LABELS | {Category.ACTIVATIONS: "activations (forward outputs in use)"}
_TRAINING_ONLY = (Category.GRADIENTS, Category.OPTIMIZER_STATE)


def _category_label(category: Category, mode: Mode) -> str:
    return (_CATEGORY_LABELS if mode is Mode.TRAIN else _FORWARD_ONLY_LABELS)[category]


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
    if report.time is not None:  # asked for (--time, memcalc.step_time)
        sections.append(render_time(report.time, report.gpu.name, fmt=fmt, unit=unit))
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
              Mode.INFERENCE: "inference forward (inference_mode)", Mode.GENERATE: "generate()"}


def _header(report: MemoryReport) -> str:
    step = _MODE_TEXT[report.mode]
    if report.mode is Mode.GENERATE:
        new = report.new_tokens or 1
        step += f" of {new} new tokens (prefill + {new - 1} decode steps)"
    if report.mode is Mode.TRAIN:
        step += f", optimizer {report.optimizer}" + (f" ({report.optimizer_impl})" if report.optimizer_impl else "")
        if report.accum_steps > 1:
            step += f", {report.accum_steps} accumulation steps"
        if report.checkpoint:  # the setting that ran (under --checkpoint auto, the one chosen)
            step += f", checkpointing {report.checkpointing}"
    gpu = _device_text(report)
    lines = [
        f"memcalc: {report.model}, batch {report.batch_size}, {step}, {report.precision.value}",
        f"on {gpu}; input {report.input_description}; loss {report.loss}; {report.parameters:,} parameters",
    ]
    trainable = report.trainable_parameters
    if trainable is not None and trainable < report.parameters:  # frozen parameters: as PEFT prints it
        lines.append(f"trainable parameters: {trainable:,} of {report.parameters:,} "
                     f"({100 * trainable / report.parameters:.4f}%)")
    if report.torch_version:
        lines.append(_assumed_line(report))
    if report.alloc_conf:  # issue 38: only settings other than PyTorch's defaults are stated
        given = report.alloc_conf_source
        origin = f"from the environment's {given}" if given.isupper() else "as given"
        lines.append(f"allocator: {report.alloc_conf} ({origin}; reserved memory modelled under it)")
    return "\n".join(lines)


def _device_text(report: MemoryReport) -> str:
    """What the step was estimated for: a named GPU, the generic one, or the CPU target."""
    if report.gpu.is_cpu:
        return "the CPU (CPU target: what the CPU allocator counts, unrounded; no CUDA context)"
    return report.gpu.name if report.gpu_named else f"{report.gpu.key} CUDA GPU (no --gpu given)"


def _assumed_line(report: MemoryReport) -> str:
    """The software stack the kernel facts and the CUDA context were taken for. When the torch
    modelled (``--torch-version``) is not the installed one, both are named: the kernel rules
    (attention backends, autocast lists, optimizer defaults, workspaces) are the modelled
    release's, while the model's ops, their shapes and decompositions come from the installed
    torch that traced the step."""
    installed = installed_torch_version()
    torch_text = report.torch_version if report.torch_version == installed else (
        f"{report.torch_version}'s kernel rules (traced with the installed torch {installed})")
    if not report.cuda_version:  # the CPU target: no CUDA context
        return f"assumed: torch {torch_text} (CPU target)"
    basis = report.gpu.context_basis or "lazy module loading"  # a profile's own figure is the lazy one
    return (f"assumed: torch {torch_text}, CUDA {report.cuda_version}; CUDA context "
            f"{format_bytes(report.cuda_context, 'MiB')} ({basis})")


def _breakdown(report: MemoryReport, fmt: str, unit: Unit | str) -> str:
    b = report.bytes
    rows = []
    for category in Category:
        value = b.category(category)
        if not value and (category is Category.KV_CACHE
                          or (category in _TRAINING_ONLY and report.mode is not Mode.TRAIN)):
            continue
        detail = f"{report.parameters:,} params" if category is Category.PARAMETERS else ""
        rows.append([_category_label(category, report.mode), format_bytes(value, unit),
                     _share(value, b.peak_allocated), detail])
    if not report.gpu.is_cpu:  # the CPU allocator rounds nothing
        rows.append(["allocator block rounding", format_bytes(b.rounding, unit), _share(b.rounding, b.peak_allocated),
                     ""])
    rows.append(["peak allocated", format_bytes(b.peak_allocated, unit), "100.0%", report.peak_location])
    return tabulate(rows, headers=["at the peak", "memory (binary units)", "share", ""], tablefmt=fmt,
                    colalign=("left", "right", "right", "left"), disable_numparse=True)


def _share(value: int, total: int) -> str:
    return f"{100.0 * value / total:.1f}%" if total else "-"


def _peak_lines(report: MemoryReport, unit: Unit | str) -> str:
    lines = [f"peak allocated: {format_bytes(report.bytes.peak_allocated, unit)} "
             f"({report.bytes.peak_allocated:,} B) in {report.peak_location}"]
    if report.mode is Mode.TRAIN and report.peak_iteration == 2:
        lines.append(f"  reached in the second iteration ({_left_by_first_iteration(report)}); "
                     f"the first iteration peaks at {format_bytes(report.first_iteration_peak, unit)}")
    if report.generation_peak is not None and report.training_peak is not None:
        lines.append(f"  the step's peak is in its {report.peaks_in}: generation (generate() and the scoring of the "
                     f"completions) peaks at {format_bytes(report.generation_peak, unit)}, training (forward, "
                     f"backward, optimizer) at {format_bytes(report.training_peak, unit)}")
    lines.append(_reserved_line(report, unit))
    if report.paged_optimizer_state:
        lines.append(f"paged optimizer state: {format_bytes(report.paged_optimizer_state, unit)} in CUDA unified "
                     f"memory (bitsandbytes' page manager, outside the caching allocator): not in the peak; the "
                     f"driver moves its pages to the host when the GPU runs short")
    if report.fits is not None and report.capacity is not None:  # fits is judged under a capacity
        lines.append(_fits_line(report, report.capacity, unit))
    if report.attention_calls:
        calls = ", ".join(f"{backend} ×{count}" for backend, count in report.attention_calls)
        lines.append(f"attention kernels (as CUDA would choose): {calls}")
    if report.textbook is not None:
        lines.append(_textbook_line(report, report.textbook, unit))
    return "\n".join(lines)


def _left_by_first_iteration(report: MemoryReport) -> str:
    """What the first iteration left alive that raises the second's peak, as far as the report
    knows: optimizer state at the peak, gradients kept by ``zero_grad(set_to_none=False)``, or,
    without either, only that the first iteration left memory behind (never "optimizer state"
    beside 0 B of it)."""
    held = []
    if report.bytes.optimizer_state:
        held.append("optimizer state allocated")
    if report.keep_grads and report.bytes.gradients:
        held.append("the first iteration's gradients kept by zero_grad(set_to_none=False)")
    return "; ".join(held) if held else "with what the first iteration left allocated"


def _reserved_line(report: MemoryReport, unit: Unit | str) -> str:
    """Peak reserved and what the device holds. Under a capacity the figure is the replay
    under it (the allocator frees its cached segments and retries before an OOM), so it
    agrees with the fits line; the unlimited replay's figure is named as such."""
    if report.gpu.is_cpu:
        return ("peak reserved: the same; the CPU allocator caches nothing (each tensor is its own malloc, "
                "returned at its free) and there is no CUDA context")
    reserved = format_bytes(report.peak_reserved, unit)
    how = "measured" if report.gpu.context_measured else "assumed"
    context = (f"+ CUDA context {format_bytes(report.cuda_context, unit)} ({how} for {report.gpu.key}) "
               f"= {format_bytes(report.device_total, unit)}")
    capacity, unlimited = report.capacity, report.peak_reserved_unconstrained
    if capacity is None or (report.fits and report.peak_reserved == unlimited):
        return f"peak reserved by the caching allocator: {reserved}; {context} on the device"
    no_limit = f"{format_bytes(unlimited, unit)} with no limit"
    if report.fits:
        return (f"peak reserved by the caching allocator: {reserved} within the {format_bytes(capacity, unit)} "
                f"capacity (it frees cached segments and retries; {no_limit}); {context} on the device")
    return (f"peak reserved by the caching allocator: {reserved} needed under the {format_bytes(capacity, unit)} "
            f"capacity even after freeing cached segments ({no_limit}); {context} needed on the device")


def _fits_line(report: MemoryReport, capacity: int, unit: Unit | str) -> str:
    # a capacity given with a named GPU but not equal to its usable memory is a budget
    named = report.gpu_named and capacity == report.gpu.usable_memory
    head = f"fits in {format_bytes(capacity, unit)} ({report.gpu.name if named else 'budget'}): "
    headroom = capacity - report.bytes.peak_allocated
    if report.fits:
        return head + f"yes, {format_bytes(headroom, unit)} headroom above the peak allocated"
    if headroom < 0:
        return head + f"NO — out of memory; the peak allocated is {format_bytes(-headroom, unit)} over"
    line = head + (f"NO — out of memory; the peak allocated is {format_bytes(headroom, unit)} under it, but it "
                   f"needs {format_bytes(report.peak_reserved, unit)} reserved: segments partly in use cannot be "
                   f"freed (fragmentation)")
    expandable = report.reserved_if_expandable
    if expandable is None:
        return line
    if expandable < 0:
        return line + "; expandable_segments:True would not save it either"
    return line + (f"; it fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                   f"({format_bytes(expandable, unit)} reserved)")


# Why the simulated peak differs from the rule, by mode (the textbook line's last sentence).
_FORWARD_ONLY_WHY = ("Without autograd there are no gradients or optimizer state, and each activation is freed "
                     "once the next op has read it.")
_TEXTBOOK_WHY = {
    Mode.TRAIN: "The simulation knows when each tensor is alive: gradients appear during backward as activations "
                "are freed, optimizer state is created at the first step, temporaries come and go.",
    Mode.EVAL: _FORWARD_ONLY_WHY,
    Mode.INFERENCE: _FORWARD_ONLY_WHY,
    Mode.GENERATE: _FORWARD_ONLY_WHY + " The KV cache grows by one token per decode step.",
}
# Memory the rule of thumb never counts (it has parameters, the input batch and activations).
_NOT_IN_TEXTBOOK = (Category.WORKSPACE, Category.KV_CACHE, Category.BUFFERS)
#: From this ratio on the gap is given as a factor ("4.7× the rule"): "+370%" reads worse.
_FACTOR_FROM = 2.0


def _textbook_line(report: MemoryReport, tb: Textbook, unit: Unit | str) -> str:
    """The rule of thumb, term by term, and where the simulated peak stands against it. One
    sign convention: the simulated peak is above or below the rule (:meth:`Textbook.gap`)."""
    params = format_bytes(tb.trainable_parameter_bytes, unit)
    weights = f"{params} × {tb.multiplier}" if tb.multiplier > 1 else params
    if tb.state_bytes:
        weights += f" + {format_bytes(tb.state_bytes, unit)}"
    weights += f" ({tb.terms})"
    if tb.frozen_parameter_bytes:  # fine-tuning: the frozen ones once, weights only
        weights = f"trainable parameters {weights} + frozen parameters {format_bytes(tb.frozen_parameter_bytes, unit)}"
    else:
        weights = f"parameters {weights}"
    saved = "saved for backward" if report.mode is Mode.TRAIN else "alive at the peak"
    peak = report.bytes.peak_allocated
    line = (f"textbook: {weights} + input batch {format_bytes(tb.input_bytes, unit)} "
            f"+ activations {saved} {format_bytes(tb.activation_bytes, unit)} = {format_bytes(tb.total, unit)}; "
            f"the simulated peak, {format_bytes(peak, unit)}, is {_versus(tb.gap(peak))}.")
    left_out = [f"{_category_label(c, report.mode)} {format_bytes(report.bytes.category(c), unit)}"
                for c in _NOT_IN_TEXTBOOK if report.bytes.category(c)]
    if left_out:
        line += f" Not in the rule, at the peak: {', '.join(left_out)}."
    return f"{line} {_TEXTBOOK_WHY[report.mode]}"


def _versus(gap: float | None) -> str:
    if gap is None:
        return "not comparable (the rule counts nothing)"
    if gap + 1 >= _FACTOR_FROM:
        return f"{gap + 1:.1f}× the rule of thumb"
    return f"{abs(gap):.1%} {'above' if gap >= 0 else 'below'} the rule of thumb"


def _module_table(report: MemoryReport, fmt: str, unit: Unit | str, depth: int) -> str:
    # eval/inference: the most alive at once, never a cumulative total that could exceed the peak
    kept = "kept for backward" if report.mode is Mode.TRAIN else "alive in forward (high-water)"
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
    breakdown at its own peak, and — where the GPUs are ranks of a process group — what each
    dimension shards on it (empty for a single-GPU report)."""
    if not report.roles:
        return ""
    setting = report.strategy
    if report.strategy == "mesh" and report.mesh is not None:
        setting = "the mesh " + ",".join(f"{k}={v}" for k, v in report.mesh.items() if v > 1)
    title = (f"memcalc: {report.model} under {setting}, {report.world_size} GPUs, "
             f"global batch {report.global_batch_size} — memory per GPU at each GPU's peak (binary units)")
    shown = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.ACTIVATIONS)
    with_fit = any(r.report.fits is not None for r in report.roles)
    with_sharding = any(r.sharding is not None for r in report.roles)
    headers = ["GPU role", "GPUs", "batch", *(["sharded"] if with_sharding else []),
               *[_CATEGORY_LABELS[c].split(" (")[0] for c in shown], "other",
               "peak allocated", "peak reserved", "model states", "collective buffers",
               *(["fits"] if with_fit else [])]
    rows = []
    for role in report.roles:
        b = role.bytes
        values = [b.category(c) for c in shown]
        sharded = "; ".join(s.describe() for s in role.sharding or ()) or "nothing"
        rows.append([role.name, _ranks(role.ranks), str(role.batch_size), *([sharded] if with_sharding else []),
                     *[format_bytes(v, unit) for v in values],
                     format_bytes(b.peak_allocated - sum(values), unit), format_bytes(b.peak_allocated, unit),
                     format_bytes(role.report.peak_reserved, unit), format_bytes(role.model_states, unit),
                     format_bytes(role.communication, unit),
                     *([{True: "yes", False: "NO", None: "-"}[role.report.fits]] if with_fit else [])])
    table = tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True,
                     colalign=("left", "left", "right", *(["left"] if with_sharding else []), *["right"] * 9,
                               *(["left"] if with_fit else [])))
    busiest = report.busiest_role
    assert busiest is not None
    legend = ("other: inputs, buffers, temporaries, workspaces and allocator rounding. model states: parameters, "
              "gradients and optimizer state (fp32 master weights included) at the optimizer step. collective "
              "buffers: memory at the peak that exists only for communication (gathered parameters, "
              "all-gather / reduce-scatter / reduce buffers, DDP buckets that are not the gradients); it is "
              "counted in the columns before.")
    if with_sharding:
        legend += (" sharded: what each dimension divides on the GPU (/N: one N-th of the whole), and over "
                   "which ranks (dp_shard: FSDP2, dp_replicate: DDP, zeroK: DeepSpeed ZeRO-K); the rest is whole.")
    return f"{title}\n\n{table}\n\n{legend}\nbusiest: {busiest.name} — its breakdown follows.\n"


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"cuda:{ranks[0]}-{ranks[-1]}"
    return ", ".join(f"cuda:{r}" for r in ranks)

"""Text of a step time (``--time``): the time and throughput line, a table per phase, where the
time goes by op class, and the assumptions it rests on — labelled as such; and of the data
loader's advice (``--data-loader``). Formatting only."""

from __future__ import annotations

from tabulate import tabulate

from memcalc.core.throughput import LoaderAdvice, StepFlops, StepTime
from memcalc.core.units import Unit, format_bytes

__all__ = ("format_flops", "format_seconds", "interval_text", "render_loader", "render_time", "throughput_text")

_SI = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_flops(flops: float, suffix: str = "FLOP") -> str:
    """``3.21 TFLOP``: decimal prefixes, as FLOP counts are quoted."""
    for scale, prefix in _SI:
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {prefix}{suffix}"
    return f"{flops:.3g} {suffix}"


def format_seconds(seconds: float) -> str:
    """``12.3 ms``, ``840 µs``, ``1.52 s``."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def interval_text(time: StepTime) -> str:
    """`` (±20% on the 12 steps it was fitted to, on an NVIDIA H200 ...; a100-80gb scaled from its
    datasheet peaks, an assumption (on 8 steps of an h100-80gb, predicted / measured ...))``: the
    spread and basis of a time; empty when it has none (coefficients given by the caller)."""
    return f" ({time.basis})" if time.basis else ""


def throughput_text(time: StepTime) -> str:
    """``123 ms per step (±9% on ...), 519 samples/s, 265,523 tokens/s``."""
    text = f"{format_seconds(time.seconds)} per step{interval_text(time)}, {time.samples_per_second:,.1f} samples/s"
    tokens = time.tokens_per_second
    if tokens is not None:
        text += f", {tokens:,.0f} tokens/s"
    return text


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _flops_line(flops: StepFlops) -> str:
    parts = [f"{p.phase} {format_flops(p.flops)}" for p in flops.phases if p.flops]
    return (f"FLOPs per step: {format_flops(flops.total)}" + (f" ({', '.join(parts)})" if parts else "")
            + "; counted by torch.utils.flop_counter's formulas (matrix products, convolutions, attention; "
              "a multiply-add is 2 FLOPs, causal fused attention half the square); other ops are timed by the "
              "bytes they move")


def render_time(time: StepTime, gpu_name: str, *, fmt: str = "simple", unit: Unit | str = Unit.AUTO) -> str:
    """The step-time section of a report.

    Args:
        time: the step time (:func:`memcalc.step_time`).
        gpu_name: the GPU's name as the report shows it.
        fmt: a tabulate table format.
        unit: the byte unit of the bytes-moved column.

    Returns:
        The text, without a trailing newline.
    """
    head = (f"step time on {gpu_name} (roofline per kernel, efficiencies fitted to real kernels): "
            f"{throughput_text(time)}; {format_flops(time.flops_per_second, 'FLOP/s')} achieved")
    rows = [[p.phase, format_flops(p.flops), format_bytes(p.bytes_moved, unit), f"{p.kernels:,}",
             format_seconds(p.seconds), _share(p.seconds, time.seconds)] for p in time.phases]
    phases = tabulate(rows, headers=["phase", "FLOPs", "bytes moved", "kernels", "time", "share"], tablefmt=fmt,
                      colalign=("left", "right", "right", "right", "right", "right"), disable_numparse=True)
    by_class = "; ".join(
        f"{c.op_class.value} {_share(c.seconds, time.seconds)} ({_share(c.compute_bound_seconds, c.seconds)} of it "
        f"compute-bound)" for c in sorted(time.classes, key=lambda c: -c.seconds))
    efficiencies = ", ".join(f"{name.removeprefix('efficiency: ')} {value:.2f}" for name, value in time.assumptions
                             if name.startswith("efficiency"))
    launch = next((v for name, v in time.assumptions if name.startswith("launch")), 0.0)
    host = next((v for name, v in time.assumptions if name.startswith("host")), 0.0)
    per_class = {name.removeprefix("seconds per kernel: "): value for name, value in time.assumptions
                 if name.startswith("seconds per kernel") and value}
    fixed = (format_seconds(next(iter(per_class.values()))) if len(set(per_class.values())) == 1
             else ", ".join(f"{name} {format_seconds(value)}" for name, value in per_class.items()))
    lines = [
        f"where the time goes: {by_class}; gaps between kernels {_share(time.launch_seconds, time.seconds)}",
        _flops_line(time.flops),
        f"model (scripts/fit_step_time.py): efficiency per op class (fraction of the datasheet peak) {efficiencies}; "
        + (f"fixed time per kernel {fixed}; " if fixed else "")
        + f"gap between kernels {format_seconds(launch)}; "
        + (f"host-bound below {format_seconds(host)} per kernel (eager dispatch); " if host else "")
        + "one stream, no data loading",
        f"peaks: {time.source}",
    ]
    if time.flops.uncounted:
        ops = ", ".join(f"{op} ×{n}" for op, n in time.flops.uncounted)
        lines.insert(2, f"FLOPs not counted (no formula; timed by the bytes they move, so too fast): {ops}")
    return "\n\n".join([head, phases, "\n".join(lines)])


def render_loader(advice: LoaderAdvice, *, unit: Unit | str = Unit.AUTO) -> str:
    """The data-loading section (``--data-loader``, ``--sample-load-ms``): host memory, the pace
    the GPU sets, and — given a measured load time — whether the loader keeps up.

    Args:
        advice: :func:`memcalc.loader_advice`'s answer.
        unit: the byte unit.

    Returns:
        The text, without a trailing newline.
    """
    setup = advice.setup
    workers = setup.num_workers
    batch_bytes = advice.sample_bytes * advice.batch_size
    lines = [f"data loading (DataLoader num_workers={workers}, prefetch_factor={setup.prefetch_factor}, "
             f"pin_memory={setup.pin_memory}; {format_bytes(advice.sample_bytes, unit)} per sample"
             f"{'' if setup.sample_bytes is not None else ' (the input batch as the GPU sees it)'}, batch "
             f"{advice.batch_size} = {format_bytes(batch_bytes, unit)}):"]
    parts = []
    if advice.batches_in_flight:
        parts.append(f"{advice.batches_in_flight} batches in flight in shared memory "
                     f"({format_bytes(advice.shared_memory_bytes, unit)})")
    if setup.pin_memory:
        parts.append(f"pinned buffers {format_bytes(advice.pinned_bytes, unit)} ({advice.batches_in_flight + 1} "
                     f"batches, each rounded up to a power of two by PyTorch's CachingHostAllocator)")
    else:
        parts.append(f"the batch in use {format_bytes(batch_bytes, unit)}")
    own = "; the workers' own processes (each with a copy of the dataset object) come on top" if workers else ""
    lines.append(f"  host memory: up to {format_bytes(advice.host_bytes, unit)}: {' + '.join(parts)}{own}")
    rate = advice.gpu_samples_per_second
    if workers and advice.worker_ms_per_sample is not None:
        lines.append(f"  the GPU consumes {rate:,.1f} samples/s: each of the {workers} workers must produce a sample "
                     f"every {advice.worker_ms_per_sample:.3g} ms")
    else:
        lines.append(f"  the GPU consumes {rate:,.1f} samples/s; with num_workers=0 the main process loads each batch "
                     f"between steps, not overlapped with them")
    lines.append(_loader_verdict(advice))
    return "\n".join(lines)


def _loader_verdict(advice: LoaderAdvice) -> str:
    setup = advice.setup
    if setup.sample_load_ms is None or advice.samples_per_second is None or advice.workers_needed is None:
        return ("  give --sample-load-ms (one worker's measured time to load a sample) to know whether the loader "
                "keeps the GPU fed")
    needed = advice.workers_needed
    delivered = (f"{setup.num_workers} workers deliver {advice.loader_samples_per_second or 0:,.1f} samples/s"
                 if setup.num_workers else "the main process alone loads one batch at a time")
    head = f"  at {setup.sample_load_ms:g} ms per sample, {delivered}: "
    if advice.loader_bound:
        return (head + f"THE LOADER IS THE BOTTLENECK, not memory: {advice.samples_per_second:,.1f} samples/s, the "
                f"GPU waiting {advice.gpu_idle or 0:.0%} of the time; num_workers={needed} keeps it fed (with that "
                f"many free CPU cores; if the CPU is saturated, the loading code itself is the limit)")
    return head + f"enough: the GPU sets the pace ({needed} worker{'s' if needed > 1 else ''} would do)"

"""Regenerate the README's figures (``docs/figures/*.png``) from memcalc itself.

    python scripts/make_figures.py               # every figure, into docs/figures/
    python scripts/make_figures.py --out /tmp/f  # somewhere else
    python scripts/make_figures.py timeline_gpt2 # one of them

Needs matplotlib (``pip install -e ".[plot]"``). Every number drawn comes from
``memcalc.sweep`` / ``memcalc.estimate`` / ``memcalc.max_batch_size`` run on this checkout,
and every label that names a kernel or a GPU is read from the reports: nothing is typed in.
The figures are drawn on their own ``Figure`` with an Agg canvas (no pyplot state), and
saved without the matplotlib version in their metadata so that they only change when the
numbers do.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import memcalc
from memcalc.targets.cuda.gpus import catalogue as gpus

GIB = 1024**3
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "figures"

# Figure 1: ResNet-50 training step against batch size.
RESNET_BATCHES = (1, *range(32, 513, 32))
# (label, sweep options): one line each.
RESNET_SERIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("SGD, fp32", {"optimizers": ["sgd"], "precisions": ["fp32"]}),
    ("Adam, fp32", {"optimizers": ["adam"], "precisions": ["fp32"]}),
    ("Adam, AMP bf16", {"optimizers": ["adam"], "precisions": ["amp-bf16"]}),
    ("Adam, fp32, checkpointing", {"optimizers": ["adam"], "precisions": ["fp32"], "checkpoint": True}),
)
# GPUs whose usable memory (total − CUDA context) is drawn, with the largest Adam fp32 batch.
RESNET_GPUS = ("t4", "a100-40gb")

# Figure 2: GPT-2 (124M) training step against sequence length, per attention kernel.
GPT2_BATCH = 4
GPT2_SEQ_LENS = (256, 512, 1024, 1536, 2048, 3072, 4096)
# (gpu, precision): memcalc picks the attention kernel PyTorch would pick on that GPU.
GPT2_CONFIGS = (("a100-80gb", "amp-bf16"), ("h100-80gb", "amp-bf16"), ("t4", "amp-fp16"), ("t4", "amp-bf16"))


# Lines that coincide stay visible: each series gets its own marker and dash pattern.
STYLES: tuple[dict[str, Any], ...] = (
    {"marker": "o", "linestyle": "-"}, {"marker": "s", "linestyle": "--"},
    {"marker": "^", "linestyle": "-."}, {"marker": "D", "linestyle": ":"},
)


def _new_figure() -> tuple[Figure, Axes]:
    figure = Figure(figsize=(7.5, 5.0), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot(1, 1, 1)


def _legend_below(figure: Figure) -> None:
    figure.legend(loc="outside lower center", ncols=2, fontsize="small", frameon=False)


def _save(figure: Figure, path: Path, *, description: str | None = None) -> Path:
    metadata: dict[str, str | None] = {"Software": None}  # no version string: bytes change only with the plot
    if description is not None:
        metadata["Description"] = description
    figure.savefig(path, metadata=metadata)
    return path


# The README's caption states these answers and tests/test_readme.py checks them against
# memcalc.max_batch_size, so the options live here once.
RESNET_FIT_OPTIONS: dict[str, Any] = {"optimizer": "adam", "precision": "fp32"}


def resnet50_fits() -> list[tuple[str, memcalc.FitResult]]:
    """What ``memcalc fit resnet50 --optim adam --gpu KEY`` answers for each card of the figure."""
    return [(key, memcalc.max_batch_size("resnet50", gpu=key, **RESNET_FIT_OPTIONS)) for key in RESNET_GPUS]


def resnet50_fit_metadata(fits: Sequence[tuple[str, memcalc.FitResult]]) -> str:
    """The dots' answers, written into the PNG (``Description``) so a test can tell a stale figure
    from a current one without drawing it again."""
    return "; ".join(f"{key}: fit {fit.batch_size}, raw boundary {fit.raw_batch_size}" for key, fit in fits)


def resnet50_batch(out: Path) -> Path:
    """Peak allocated against batch size for four training set-ups, with GPU capacities; a dot
    is what ``memcalc fit`` answers (after its measured margin), a ring the raw boundary."""
    figure, axes = _new_figure()
    series: list[Any] = []
    for (label, options), style in zip(RESNET_SERIES, STYLES):
        points = memcalc.sweep("resnet50", batch_sizes=RESNET_BATCHES, **options)
        series += axes.plot([p.batch_size for p in points], [p.report.bytes.peak_allocated / GIB for p in points],
                            markersize=3, label=label, **style)
    cards: list[Any] = []
    fits = resnet50_fits()
    for (key, fit), grey in zip(fits, ("dimgrey", "black")):
        gpu = gpus.get_gpu(key)
        usable = fit.budget_bytes  # the card's memory minus its CUDA context
        raw = memcalc.estimate("resnet50", batch_size=fit.raw_batch_size, gpu=key, **RESNET_FIT_OPTIONS)
        cards.append(axes.axhline(
            usable / GIB, color=grey, linestyle=(0, (4, 3)), linewidth=1,
            label=f"{gpu.name}: {usable / GIB:.1f} GiB usable; memcalc fit, Adam fp32: {fit.batch_size} (dot), "
                  f"no margin {fit.raw_batch_size} (ring)"))
        axes.plot([fit.batch_size], [fit.report.bytes.peak_allocated / GIB], marker="o", color=grey,
                  markersize=6, linestyle="none")
        axes.plot([fit.raw_batch_size], [raw.bytes.peak_allocated / GIB], marker="o", color=grey,
                  markerfacecolor="white", markersize=6, linestyle="none")
    axes.set_xlabel("batch size")
    axes.set_ylabel("peak allocated (GiB, binary)")
    axes.set_title("memcalc: ResNet-50 training step (224×224) against batch size")
    axes.set_xlim(0, RESNET_BATCHES[-1])
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(handles=series, loc="upper left", fontsize="small", frameon=False)
    figure.legend(handles=cards, loc="outside lower center", ncols=1, fontsize="small", frameon=False)
    return _save(figure, out / "resnet50_batch.png", description=resnet50_fit_metadata(fits))


def gpt2_seq_len(out: Path) -> Path:
    """Peak allocated against sequence length; the attention kernel is the one CUDA would pick."""
    figure, axes = _new_figure()
    for (key, precision), style in zip(GPT2_CONFIGS, STYLES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 on a T4 warns: that is the point of the line
            reports = [memcalc.estimate("gpt2", batch_size=GPT2_BATCH, seq_len=seq, optimizer="adamw",
                                        precision=precision, gpu=key) for seq in GPT2_SEQ_LENS]
        backends = sorted({str(r.attention_backend) for r in reports})
        label = f"{gpus.get_gpu(key).name}, {precision}: {'/'.join(backends)} attention"
        axes.plot(GPT2_SEQ_LENS, [r.bytes.peak_allocated / GIB for r in reports], markersize=4, label=label,
                  **style)
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel("peak allocated (GiB, binary)")
    axes.set_title(f"memcalc: GPT-2 (124M) training step, batch {GPT2_BATCH}, AdamW")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    _legend_below(figure)
    return _save(figure, out / "gpt2_seq_len.png")


# Figures 3–5: the memory timeline of one step (``memcalc MODEL --timeline FILE.png``), drawn by
# memcalc.report.timeline_plot exactly as the command draws it.
TIMELINE_RESNET50 = {"batch_size": 64, "optimizer": "adam"}
TIMELINE_GPT2 = {"batch_size": 8, "seq_len": 1024, "optimizer": "adamw", "precision": "amp-bf16", "gpu": "a100-40gb"}


def _timeline(model: str, options: dict[str, Any], path: Path) -> Path:
    from memcalc.report.timeline_plot import write_timeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # approximations are notes of the report, not the figure's business
        report = memcalc.estimate(model, **options)
    return write_timeline(report, path, force=True)  # the figure replaces its previous drawing


def timeline_resnet50(out: Path) -> Path:
    """ResNet-50, batch 64, Adam: memory over both iterations of the step."""
    return _timeline("resnet50", TIMELINE_RESNET50, out / "timeline_resnet50_b64_adam.png")


def timeline_gpt2(out: Path) -> Path:
    """GPT-2 (124M), batch 8 × 1024 tokens, AdamW, AMP bf16, on an A100 40 GB."""
    return _timeline("gpt2", TIMELINE_GPT2, out / "timeline_gpt2.png")


def timeline_gpt2_checkpoint(out: Path) -> Path:
    """The same with activation checkpointing on every block."""
    return _timeline("gpt2", TIMELINE_GPT2 | {"checkpoint": True}, out / "timeline_gpt2_checkpoint.png")


# Figure 6: memory or throughput? Peak allocated and samples/s against batch size on an A100,
# with and without checkpointing (memcalc sweep ... --time): the README's "Memory or throughput?".
THROUGHPUT_GPU = "a100-80gb"
# (model, title, batches, estimate options): one column each.
THROUGHPUT_MODELS: tuple[tuple[str, str, tuple[int, ...], dict[str, Any]], ...] = (
    ("resnet50", "ResNet-50 (224×224), Adam", (8, 16, 32, 64, 128, 256, 512, 1024), {"optimizers": ["adam"]}),
    ("gpt2", "GPT-2 (124M), 1,024 tokens, AdamW", (1, 2, 4, 8, 16, 32, 64), {"optimizers": ["adamw"], "seq_len": 1024}),
)


def throughput_batch(out: Path) -> Path:
    """Peak allocated (top) and modelled samples/s (bottom) against batch size, AMP bf16 on an
    A100 80 GB, with and without activation checkpointing; a hollow marker is a batch that does
    not fit."""
    gpu = gpus.get_gpu(THROUGHPUT_GPU)
    figure = Figure(figsize=(9.0, 6.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(2, len(THROUGHPUT_MODELS), sharex="col")
    for column, (model, title, batches, options) in enumerate(THROUGHPUT_MODELS):
        memory_axes, speed_axes = grid[0][column], grid[1][column]
        for checkpoint, style in zip((False, True), STYLES):
            points = memcalc.sweep(model, batch_sizes=batches, precisions=["amp-bf16"], gpu=THROUGHPUT_GPU,
                                   checkpoint=checkpoint, **options)
            times = [memcalc.step_time(p.report) for p in points]
            label = "activation checkpointing" if checkpoint else "no checkpointing"
            xs = [p.batch_size for p in points]
            for axes, ys in ((memory_axes, [p.report.bytes.peak_allocated / GIB for p in points]),
                             (speed_axes, [t.samples_per_second for t in times])):
                line, = axes.plot(xs, ys, markersize=4, label=label if axes is memory_axes and column == 0 else None,
                                  **style)
                misses = [(x, y) for p, x, y in zip(points, xs, ys) if not p.fits]
                if misses:
                    axes.plot(*zip(*misses), marker=style["marker"], markersize=8, linestyle="none",
                              markerfacecolor="white", color=line.get_color())
        memory_axes.axhline(gpu.usable_memory / GIB, color="black", linestyle=(0, (4, 3)), linewidth=1,
                            label=f"{gpu.name}: {gpu.usable_memory / GIB:.1f} GiB usable" if column == 0 else None)
        memory_axes.set_title(title, fontsize="medium")
        memory_axes.set_ylabel("peak allocated (GiB)")
        spread = times[0].spread if times else 0.0
        speed_axes.set_ylabel(f"samples/s (fitted model, ±{spread:.0%})")
        speed_axes.set_xlabel("batch size")
        for axes in (memory_axes, speed_axes):
            axes.set_xscale("log", base=2)
            axes.set_xticks(batches, [str(b) for b in batches])
            axes.set_ylim(bottom=0)
            axes.grid(True, alpha=0.3)
    figure.suptitle(f"memcalc: memory or throughput? AMP bf16 on an {gpu.name} (hollow: does not fit)")
    _legend_below(figure)
    return _save(figure, out / "throughput_batch.png")


FIGURES: dict[str, Callable[[Path], Path]] = {
    "resnet50_batch": resnet50_batch, "gpt2_seq_len": gpt2_seq_len, "timeline_resnet50": timeline_resnet50,
    "timeline_gpt2": timeline_gpt2, "timeline_gpt2_checkpoint": timeline_gpt2_checkpoint,
    "throughput_batch": throughput_batch,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the PNGs")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"figures to draw: {', '.join(FIGURES)} (default: all)")
    args = parser.parse_args(argv)
    if unknown := [n for n in args.names if n not in FIGURES]:
        parser.error(f"unknown figure {unknown[0]!r}; choose from {', '.join(FIGURES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or FIGURES:
        start = time.perf_counter()
        path = FIGURES[name](args.out)
        print(f"{path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()

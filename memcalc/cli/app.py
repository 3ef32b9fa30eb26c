"""``memcalc estimate`` (``memcalc MODEL [options]``): options, a call into the library,
rendering, and error mapping. The group that runs it, and its other subcommands, is
:mod:`memcalc.cli.commands`. Errors become a one-paragraph message and an exit code (2: bad
input, 1: the model can't be estimated); ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import os
from typing import Any

import click

from memcalc import api
from memcalc.cli.hf import attn_model, attn_option
from memcalc.cli.options import (
    field_option,
    force_option,
    given,
    handle_errors,
    output_options,
    quiet,
    step_arguments,
    step_options,
)
from memcalc.cli.setup import setup_arguments, setup_options
from memcalc.cli.strategy import strategy_arguments, strategy_options
from memcalc.core.finetune import FineTune
from memcalc.core.output import check_output_path
from memcalc.core.report import Measurement
from memcalc.core.throughput import DataLoaderSetup
from memcalc.fields import build_step
from memcalc.measure.snapshot_export import write_snapshot
from memcalc.measure.step import attach_measurement, measured_device
from memcalc.report.render import render_json, render_report, render_roles
from memcalc.report.timeline_plot import check_timeline_path, write_timeline
from memcalc.targets.cuda.gpus.local import LocalGpu, find_local_gpu, names_local_gpu
from memcalc.timing.performance import loader_advice
from memcalc.timing.time_render import render_loader

__all__ = ("estimate_command",)

#: ``--snapshot``'s extensions: ``torch.cuda.memory._dump_snapshot`` writes a pickle.
SNAPSHOT_FORMATS = ("pickle", "pkl")


@click.command("estimate")
@click.argument("model")
@field_option("batch_size", param="batch")
@field_option("optimizer", param="optim")
@step_options
@field_option("precision")
@field_option("gpu", also="Default: a generic sm80-class profile (with --measure on a CUDA machine: that GPU's, "
                          "as --device).")
@click.option("--device", default=None, metavar="auto|cuda:N",
              help="A GPU of this machine instead of --gpu (auto: the one with the most free memory; memcalc gpus "
                   "lists them): its catalogue profile, and its free memory minus a new process's CUDA context "
                   "for whether the step fits. --measure runs the step there.")
@click.option("--depth", type=click.IntRange(min=0), default=1, show_default=True,
              help="Module depth of the per-module table (0 hides it).")
@click.option("--measure", is_flag=True,
              help="Also run the step for real (CUDA if available, else the CPU profiler) and compare.")
@click.option("--measure-snapshot", "measure_snapshot", type=click.Path(dir_okay=False), default=None,
              metavar="FILE",
              help="With --measure (implied) on a CUDA GPU: record the real step's caching-allocator history and "
                   "write it as a torch.cuda.memory._snapshot() pickle (.pickle or .pkl); memcalc compare FILE MODEL "
                   "with the same options sets it beside the estimate.")
@click.option("--timeline", "timeline_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Draw memory over the step's events to this file: .html (interactive, one self-contained file), "
                   ".png or .svg (need matplotlib). One chart per GPU role with --strategy.")
@click.option("--snapshot", "snapshot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write the simulated allocator trace as a torch.cuda.memory._snapshot() pickle (.pickle or "
                   ".pkl; the busiest GPU's with --strategy): open it at https://pytorch.org/memory_viz.")
@force_option
@click.option("--time", "timed", is_flag=True,
              help="Also estimate the step time on --gpu (a roofline per kernel, fitted to an H200's kernels): "
                   "samples/s and tokens/s beside the memory.")
@click.option("--data-loader", "data_loader", default=None, metavar="SPEC",
              help="Your DataLoader, to check it keeps the GPU fed (implies --time): workers=N,prefetch=N,pin=yes|no,"
                   "sample-bytes=SIZE (default: the input batch's bytes per sample).")
@click.option("--sample-load-ms", type=click.FloatRange(min=0, min_open=True), default=None, metavar="MS",
              help="One worker's measured time to load one sample, in ms (with --data-loader, or alone for "
                   "num_workers=0): the workers that keep the GPU fed, and whether the loader is the bottleneck.")
@setup_options
@attn_option
@strategy_options
@output_options
@handle_errors
def estimate_command(model: str, batch: int, optim: str, precision: str, gpu: str | None, device: str | None,
                     depth: int, measure: bool, measure_snapshot: str | None, timeline_path: str | None,
                     snapshot_path: str | None, force: bool, timed: bool,
                     data_loader: str | None, sample_load_ms: float | None, fmt: str, units: str, debug: bool,
                     **options: Any) -> None:
    """Estimate the GPU memory of one step of MODEL.

    MODEL is a zoo name (memcalc zoo lists them; its language models are transformers' models
    when transformers is installed, torch:NAME the zoo's plain-torch definition),
    path/to/file.py:factory, package.module:factory, torchvision:NAME, timm:NAME, hf:MODEL_TYPE,
    hf:ORG/NAME[@REVISION] (config.json only, from the Hugging Face cache or the Hub) or
    hf:config.json.
    """
    source = attn_model(model, options)  # an hf: model with --attn becomes a HuggingFace source
    measure = measure or measure_snapshot is not None
    keywords = dict(optimizer=optim if given("optim") else None, precision=precision,
                    **step_arguments(options), **setup_arguments(options))
    multi_gpu = strategy_arguments(measure=measure, **options)  # what is left: multi-GPU
    distributed, launch = multi_gpu.get("distributed"), multi_gpu.get("launch")
    if measure and "finetune" in keywords:
        _refuse_measured_quant(keywords["finetune"])
    # the output files are checked before the estimate, not after it
    _refuse_one_file_twice(snapshot_path, measure_snapshot)
    if timeline_path is not None:
        check_timeline_path(timeline_path, force=force)
    if snapshot_path is not None:
        check_output_path(snapshot_path, "snapshot", SNAPSHOT_FORMATS, force=force)
    if measure_snapshot is not None:
        check_output_path(measure_snapshot, "snapshot", SNAPSHOT_FORMATS, force=force)
        _check_real_snapshot(device)
    local = _local_gpu(gpu, device, measure)  # after the usage checks: looking may initialise CUDA
    # a local GPU is found once: the estimate and the measurement use the same one
    keywords["gpu"] = gpu if local is None else local.device
    loader = None
    if data_loader is not None or sample_load_ms is not None:
        loader = DataLoaderSetup.parse(data_loader or "", sample_load_ms=sample_load_ms)
        timed = True  # the loader is judged against the step time (api.estimate refuses an untimeable GPU first)
    with quiet():  # the step is built once: the estimate and the measurement run the same one
        if launch is None:
            step = build_step(source, batch_size=_batch(batch, keywords), time=timed, **keywords)
        else:
            step, distributed = api.launched_step(source, launch, {"batch_size": batch, "time": timed, **keywords},
                                                  given=lambda name: given(_PARAMETER.get(name, name)))
        report = api.estimate_step(step, distributed)
    if measure:
        report = attach_measurement(report, step, device=None if local is None else local.device,
                                    snapshot=measure_snapshot, force=force)
        if measure_snapshot is not None and os.path.exists(measure_snapshot):
            click.echo(f"wrote {measure_snapshot}", err=True)
    if timeline_path is not None:
        click.echo(f"wrote {write_timeline(report, timeline_path, force=force)}", err=True)
    if snapshot_path is not None:
        write_snapshot(report, snapshot_path, force=force)
        click.echo(f"wrote {snapshot_path}", err=True)
    advice = loader_advice(report, loader) if loader is not None else None
    if fmt == "json":
        data = report.to_dict()
        if report.measurement is not None:
            data["measured"] = _measurement_dict(report.measurement)
        if local is not None:
            data["local_gpu"] = {"device": local.device, "name": local.name,
                                 "catalogue": None if local.profile is None else local.profile.key}
        if advice is not None:
            data["data_loader"] = advice.to_dict()
        click.echo(render_json(data))
    else:
        if report.roles:
            click.echo(render_roles(report, fmt=fmt, unit=units))
        click.echo(render_report(report, fmt=fmt, unit=units, module_depth=depth), nl=False)
        if advice is not None:
            click.echo(f"\n{render_loader(advice, unit=units)}")


#: :func:`memcalc.estimate`'s keywords whose command-line parameter is named otherwise.
_PARAMETER = {"batch_size": "batch", "optimizer": "optim"}


def _batch(batch: int, keywords: dict[str, Any]) -> int | None:
    """``--batch``, unless it was left at its default beside ``--training-args``, whose
    ``per_device_train_batch_size`` is then the batch."""
    return batch if given("batch") or "trainer_args" not in keywords else None


def _local_gpu(gpu: str | None, device: str | None, measure: bool) -> LocalGpu | None:
    """The GPU of this machine to estimate for: ``--device`` (or a ``--gpu`` spelled as one,
    ``auto``/``cuda:N``); with ``--measure`` and neither option, the CUDA device the step will be
    measured on, so that the estimate models that GPU's kernels and not the generic profile's.
    None: a catalogue GPU, or none (and no CUDA GPU to measure on)."""
    if device is not None and gpu is not None:
        raise click.UsageError(f"give only one of --gpu (a GPU model) or --device (a GPU of this machine); "
                               f"got --gpu {gpu} and --device {device}")
    if gpu is not None and names_local_gpu(gpu):
        device = gpu
    if device is None and gpu is None and measure:
        device = measured_device()
    return None if device is None else find_local_gpu(device)


def _check_real_snapshot(device: str | None) -> None:
    """--measure-snapshot records the CUDA caching allocator: refused, before any estimate, where
    the step would be measured on the CPU."""
    if device in (None, "auto") and measured_device() is None:
        raise click.UsageError("--measure-snapshot records the real step's CUDA caching allocator, and this machine "
                               "has no CUDA GPU (the step would be measured on the CPU); leave it out, or run on a "
                               "machine with one")


def _refuse_one_file_twice(snapshot_path: str | None, measure_snapshot: str | None) -> None:
    """--snapshot and --measure-snapshot both write a pickle: one path for both would keep only
    the second written, the other lost without a word."""
    if snapshot_path is not None and measure_snapshot is not None \
            and os.path.abspath(snapshot_path) == os.path.abspath(measure_snapshot):
        raise click.UsageError(f"--snapshot and --measure-snapshot both name {snapshot_path}: give each its own file")


def _refuse_measured_quant(finetune: FineTune) -> None:
    """--measure runs the real step: a quantized base needs bitsandbytes' CUDA kernels (memcalc
    only emulates their storage). Frozen parameters and LoRA adapters are measured as estimated."""
    if finetune.quant is not None:
        raise click.UsageError(f"--measure cannot run --quant {finetune.quant.value}: a real quantized base needs "
                               f"bitsandbytes and its CUDA kernels, which memcalc emulates without running them; "
                               f"leave out --measure to estimate it")


def _measurement_dict(m: Measurement) -> dict[str, Any]:
    return {"device": m.device, "peak_allocated": m.peak_allocated, "peak_reserved": m.peak_reserved,
            "oom": m.oom, "compared_with": m.compared_with, "relative_error": m.relative_error()}

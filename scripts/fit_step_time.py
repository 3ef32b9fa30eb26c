"""Fit memcalc's step-time model to a GPU's real kernels and write its coefficients.

    python scripts/fit_step_time.py                  # writes memcalc/timing/fitted.py
    python scripts/fit_step_time.py --check          # fails if the committed module is stale

Reads :data:`DATA`, ``tests/data/gpu/2026-11-26-h200-profile/`` (one run on a healthy NVIDIA
H200, torch 2.11: ``profile.json``, the self CUDA time of every aten op of eight configs;
``times.jsonl``, the unprofiled real step of twelve configs), traces each config with memcalc on
this checkout for the H200's datasheet peaks, fits per op class an efficiency and a fixed time
per kernel, and a gap between kernels (:mod:`memcalc.timing.calibration`), and writes them as
a Python module that :mod:`memcalc.timing.performance` reads. Every coefficient comes from
these files: nothing is typed in. The other GPUs get the same fractions of their own datasheet
peaks; :data:`RECHECK` (a healthy H100's eight steps) checks that scaling, and the ratios are
written beside the coefficients. Those steps then fit the H100's own bandwidth factor
(:func:`memcalc.timing.calibration.fit_bandwidth`), written with its ratios and each step's
ratio when it is left out of that fit.

Not :data:`EXCLUDED` (``tests/data/gpu/2026-11-25-h100/``, the first fit's data): that H100 ran
its kernels at about half speed, its kernels of a step adding up to about twice the H200's and
twice another H100's whole step of 2026-11-26 (``tests/test_step_time_calibration.py`` checks
this from the files).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import warnings
from pathlib import Path

import memcalc
from memcalc.core.throughput import OpClass
from memcalc.timing.calibration import (
    BandwidthFit,
    ClassFeatures,
    FitResult,
    MeasuredConfig,
    fit,
    fit_bandwidth,
    ideal_overrides,
    leave_one_out_bandwidth,
    load_measurements,
    predict,
)
from models_zoo import plain_torch

ROOT = Path(__file__).resolve().parent.parent
#: The run the coefficients are fitted to: a healthy H200's profile and unprofiled steps (its
#: README.md says how they were measured; kernels add up to the unprofiled step within 1-4%).
DATA = ROOT / "tests" / "data" / "gpu" / "2026-11-26-h200-profile"
#: The catalogue key of the GPU :data:`DATA` was measured on: its datasheet peaks give ``ideal``.
GPU = "h200"
OUT = ROOT / "memcalc" / "timing" / "fitted.py"
#: A healthy H100's eight steps (2026-11-26), not fitted: they check the datasheet scaling.
RECHECK = ROOT / "tests" / "data" / "gpu" / "2026-11-26-steps"
RECHECK_FILE = "h100-times.jsonl"
RECHECK_GPU = "h100-80gb"
#: The first fit's data, left out: that H100 ran its kernels at about half speed.
EXCLUDED = ROOT / "tests" / "data" / "gpu" / "2026-11-25-h100"


@functools.cache
def report_on(config: MeasuredConfig, gpu: str) -> memcalc.MemoryReport:
    """memcalc's estimate of ``config``'s step on ``gpu``, its costs recorded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # approximation notes are not what is fitted
        # the zoo's plain-torch models (torch:NAME), which the GPU steps were measured with
        return memcalc.estimate(plain_torch(config.model), **config.estimate_kwargs(gpu))


def features_on(config: MeasuredConfig, gpu: str, bandwidth_scale: float = 1.0) -> ClassFeatures:
    """memcalc's per-class ideal seconds and kernels of ``config``'s traced step on ``gpu``, its
    datasheet bandwidth times ``bandwidth_scale``."""
    overrides = {**ideal_overrides(), "bandwidth_scale": bandwidth_scale}
    return ClassFeatures.of(memcalc.step_time(report_on(config, gpu), **overrides))


def features(config: MeasuredConfig) -> ClassFeatures:
    """:func:`features_on` the GPU the data was measured on (:data:`GPU`)."""
    return features_on(config, GPU)


def recheck_configs() -> list[MeasuredConfig]:
    """The healthy H100's timed steps (:data:`RECHECK`)."""
    return [c for c in load_measurements(RECHECK, RECHECK_FILE) if c.step_seconds]


def recheck_features(config: MeasuredConfig, bandwidth_scale: float) -> ClassFeatures:
    """:func:`features_on` the H100 of :data:`RECHECK`."""
    return features_on(config, RECHECK_GPU, bandwidth_scale)


def recheck(result: FitResult) -> list[float]:
    """Predicted / measured on the healthy H100's steps (:data:`RECHECK`), timed with the H100's
    datasheet peaks: how well the datasheet scaling holds."""
    return [predict(result, features_on(c, RECHECK_GPU)) / c.step_seconds
            for c in recheck_configs() if c.step_seconds]


def measured_bandwidth(result: FitResult) -> tuple[BandwidthFit, tuple[float, ...]]:
    """The H100's bandwidth factor fitted to its steps (:data:`RECHECK`), and each step's
    predicted / measured when it is left out of that fit."""
    configs = recheck_configs()
    return (fit_bandwidth(result, configs, recheck_features),
            leave_one_out_bandwidth(result, configs, recheck_features))


def render(result: FitResult, configs: tuple[MeasuredConfig, ...], rechecked: list[float],
           measured: tuple[BandwidthFit, tuple[float, ...]]) -> str:
    """The coefficients module's text."""
    import json

    bandwidth, held_out = measured
    env = (DATA / "env.txt").read_text().splitlines()
    device = env[1].split(",")[0].strip()
    torch_version = env[2].split()[0]  # the line torch.__version__, CUDA, cuDNN
    lines = [
        f'"""The step-time model\'s coefficients, measured on an {device}: WRITTEN BY',
        f"``scripts/fit_step_time.py`` from ``tests/data/gpu/{DATA.name}/`` (profile.json, times.jsonl);",
        'do not edit, run the script (``--check`` tells whether this file is current)."""',
        "",
        "from memcalc.core.throughput import OpClass",
        "",
        f'GPU = "{GPU}"',
        f"DEVICE = {json.dumps(device)}",
        f"TORCH = {json.dumps(torch_version.split('+')[0])}",
        "#: fraction of the binding datasheet peak a large kernel of each class reaches",
        "EFFICIENCY: dict[OpClass, float] = {",
        *(f"    OpClass.{c.name}: {e:.4g}," for c, e in result.efficiency),
        "}",
        "#: seconds each kernel of a class takes besides its roofline time",
        "KERNEL_SECONDS: dict[OpClass, float] = {",
        *(f"    OpClass.{c.name}: {s:.4g}," for c, s in result.kernel_seconds),
        "}",
        "#: seconds between kernels (launch and host-side dispatch), per kernel",
        f"GAP_SECONDS = {result.gap_seconds:.4g}",
        "#: the host's seconds per kernel (eager dispatch): a step is never shorter than its kernels × this",
        f"HOST_SECONDS = {result.host_seconds:.4g}",
        "#: the largest |measured / predicted - 1| on the timed steps below: predicted × (1 ± this) covers them",
        f"SPREAD = {result.spread:.4g}",
        "#: the timed steps the spread is measured on",
        "TIMED: tuple[str, ...] = (",
        *(f"    {json.dumps(c.name)}," for c in configs if c.step_seconds),
        ")",
        f"#: predicted / measured on a healthy H100's steps, not fitted ({RECHECK.name}/{RECHECK_FILE}),",
        "#: timed with the H100's datasheet peaks: the check of the datasheet scaling",
        f'RECHECK_GPU = "{RECHECK_GPU}"',
        f"RECHECK_STEPS = {len(rechecked)}",
        f"RECHECK_RATIO = {statistics.median(rechecked):.4g}" if rechecked else "RECHECK_RATIO = 1.0",
        f"RECHECK_RANGE = ({min(rechecked):.4g}, {max(rechecked):.4g})" if rechecked else "RECHECK_RANGE = (1.0, 1.0)",
        f"RECHECK_DATE = {json.dumps(RECHECK.name.split('-steps')[0])}",
        "#: per catalogue key, the factor on the datasheet bandwidth fitted to that GPU's own steps above",
        "#: (the H200's coefficients kept); its predicted / measured on them, and each left out of the fit",
        f'MEASURED_BANDWIDTH: dict[str, float] = {{"{RECHECK_GPU}": {bandwidth.scale:.4g}}}',
        f"MEASURED_STEPS = {len(bandwidth.ratios)}",
        f"MEASURED_RANGE = ({min(bandwidth.ratios):.4g}, {max(bandwidth.ratios):.4g})",
        f"MEASURED_HELD_OUT_RANGE = ({min(held_out):.4g}, {max(held_out):.4g})",
        "#: the profiled steps the kernel coefficients are fitted to",
        "PROFILED: tuple[str, ...] = (",
        *(f"    {json.dumps(c.name)}," for c in configs if c.kernel_seconds),
        ")",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed coefficients are stale")
    args = parser.parse_args()
    configs = load_measurements(DATA)
    result = fit(configs, features)
    rechecked = recheck(result)
    measured = measured_bandwidth(result)
    text = render(result, configs, rechecked, measured)
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/fit_step_time.py", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is current")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    for op_class in OpClass:
        print(f"  {op_class.value:18s} efficiency {result.efficiency_map()[op_class]:.3f}  "
              f"{result.kernel_seconds_map()[op_class] * 1e6:7.2f} µs per kernel")
    print(f"  gap {result.gap_seconds * 1e6:.2f} µs per kernel; host {result.host_seconds * 1e6:.2f} µs per kernel; "
          f"spread ±{result.spread:.1%}")
    if rechecked:
        print(f"  on a healthy H100's steps (not fitted), scaled by its datasheet: predicted / measured "
              f"{min(rechecked):.2f}-"
              f"{max(rechecked):.2f} (median {statistics.median(rechecked):.2f})")
    bandwidth, held_out = measured
    print(f"  the H100's bandwidth fitted to those steps: x{bandwidth.scale:.3f} its datasheet's; predicted / measured "
          f"{min(bandwidth.ratios):.2f}-{max(bandwidth.ratios):.2f}, each left out {min(held_out):.2f}-"
          f"{max(held_out):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

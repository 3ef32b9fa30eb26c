"""Fit memcalc's step-time model to a GPU's real kernels and write its coefficients.

    python scripts/fit_step_time.py                  # writes memcalc/timing/fitted.json
    python scripts/fit_step_time.py --check          # fails if the committed module is stale

Reads :data:`DATA`, ``tests/data/gpu/2026-11-26-h200-profile/`` (one run on a healthy NVIDIA
H200, torch 2.11: ``profile.json``, the self CUDA time of every aten op of eight configs;
``times.jsonl``, the unprofiled real step of twelve configs), traces each config with memcalc on
this checkout for the H200's datasheet peaks, fits per op class an efficiency and a fixed time
per kernel, and a gap between kernels (:mod:`memcalc.timing.calibration`), and writes them, with
their provenance, to a JSON data file that :mod:`memcalc.timing.fitted` reads. Every coefficient comes from
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
import datetime
import functools
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

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
OUT = ROOT / "memcalc" / "timing" / "fitted.json"
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


def _g(value: float) -> float:
    """Four significant figures: what the fit supports, and what the data file keeps."""
    return float(f"{value:.4g}")


def render(result: FitResult, configs: tuple[MeasuredConfig, ...], rechecked: list[float],
           measured: tuple[BandwidthFit, tuple[float, ...]]) -> dict[str, Any]:
    """The coefficients and their provenance, as :data:`OUT` holds them (without the date written)."""
    bandwidth, held_out = measured
    env = (DATA / "env.txt").read_text().splitlines()
    device = env[1].split(",")[0].strip()
    torch_version = env[2].split()[0]  # the line torch.__version__, CUDA, cuDNN
    return {
        "provenance": {
            "script": "scripts/fit_step_time.py",
            "inputs": [f"tests/data/gpu/{DATA.name}/profile.json", f"tests/data/gpu/{DATA.name}/times.jsonl",
                       f"tests/data/gpu/{RECHECK.name}/{RECHECK_FILE}"],
            "measured": DATA.name.split("-h200")[0],
            "note": "do not edit: run the script (--check tells whether this file is current)",
        },
        "gpu": GPU,
        "device": device,
        "torch": torch_version.split("+")[0],
        "efficiency": {c.name: _g(e) for c, e in result.efficiency},
        "kernel_seconds": {c.name: _g(s) for c, s in result.kernel_seconds},
        "gap_seconds": _g(result.gap_seconds),
        "host_seconds": _g(result.host_seconds),
        "spread": _g(result.spread),
        "timed": [c.name for c in configs if c.step_seconds],
        "recheck": {
            "gpu": RECHECK_GPU,
            "steps": len(rechecked),
            "ratio": _g(statistics.median(rechecked)) if rechecked else 1.0,
            "range": [_g(min(rechecked)), _g(max(rechecked))] if rechecked else [1.0, 1.0],
            "date": RECHECK.name.split("-steps")[0],
        },
        "measured_bandwidth": {
            "scale": {RECHECK_GPU: _g(bandwidth.scale)},
            "steps": len(bandwidth.ratios),
            "range": [_g(min(bandwidth.ratios)), _g(max(bandwidth.ratios))],
            "held_out_range": [_g(min(held_out)), _g(max(held_out))],
        },
        "profiled": [c.name for c in configs if c.kernel_seconds],
    }


def _without_date(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "provenance": {k: v for k, v in data["provenance"].items() if k != "written"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed coefficients are stale")
    args = parser.parse_args()
    configs = load_measurements(DATA)
    result = fit(configs, features)
    rechecked = recheck(result)
    measured = measured_bandwidth(result)
    data = render(result, configs, rechecked, measured)
    if args.check:
        current = json.loads(OUT.read_text()) if OUT.exists() else {"provenance": {}}
        if _without_date(current) != data:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/fit_step_time.py", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is current")
        return 0
    data["provenance"]["written"] = datetime.date.today().isoformat()
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
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

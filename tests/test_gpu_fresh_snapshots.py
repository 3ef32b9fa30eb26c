"""memcalc's step against six real steps measured each in a fresh process on an H200
(tests/data/gpu/2026-11-28-h200-fresh/, written by ``benchmarks/gpu_snapshots.sh``: ``memcalc
--measure-snapshot``, torch 2.11.0+cu130, cuDNN 9.19).

The 2026-11-25 H100 suite measured every config in one process, after warm-ups that left cuBLAS
workspaces allocated; several of tests/test_gpu_snapshots.py's strict xfails blame that process
and wait for "a later GPU run" in a fresh one. These are those runs: each file's ``measured`` is
the real peak of a process that ran that step alone (cuBLAS workspaces of earlier steps freed, the
build's cached segments emptied), so the estimate of a fresh process must meet it as it stands.
The configs still outside a bar are strict xfails with their measured gap and cause.
"""

from __future__ import annotations

import json
import lzma
import pickle
from pathlib import Path
from typing import Any

import pytest

import memcalc

DATA = Path(__file__).parent / "data" / "gpu" / "2026-11-28-h200-fresh"
STACK = memcalc.Stack(torch="2.11", cuda="13.0")
GPU = "h200"
TOLERANCE = 0.01
RESERVED_TOLERANCE = 0.03

#: name → estimate() keywords: the command lines of benchmarks/gpu_snapshots.sh.
CONFIGS: dict[str, dict[str, Any]] = {
    "efficientnet_b0-b32-sgd": {"model": "efficientnet_b0", "batch_size": 32, "optimizer": "sgd"},
    "resnet50-b128-adam": {"model": "resnet50", "batch_size": 128, "optimizer": "adam"},
    "gpt2-b8-s1024-adamw-amp-bf16": {"model": "torch:gpt2", "batch_size": 8, "seq_len": 1024,
                                     "optimizer": "adamw", "precision": "amp-bf16"},
    "llama-tiny-b8-s512-adamw-amp-bf16-ckpt": {"model": "torch:llama-tiny", "batch_size": 8, "seq_len": 512,
                                               "optimizer": "adamw", "precision": "amp-bf16",
                                               "checkpoint": True},
    "llama-tiny-b8-s512-inference-bf16": {"model": "torch:llama-tiny", "batch_size": 8, "seq_len": 512,
                                          "mode": "inference", "optimizer": "none", "precision": "bf16"},
    "gpt2-b8-s1024-eval": {"model": "torch:gpt2", "batch_size": 8, "seq_len": 1024, "mode": "eval",
                           "optimizer": "none"},
}

#: Peak reserved more than 3% off in a fresh process: name → (gap, cause). Strict xfails.
OUTSIDE_3PCT_RESERVED: dict[str, tuple[str, str]] = {
    "llama-tiny-b8-s512-inference-bf16": (
        "-7.5%", "not the warm-up workspaces (the fresh process's peak allocated is within 0.05%): "
                 "the model is built in fp32 on the device and cast to bf16, which leaves its parameters "
                 "scattered over the build's segments; memcalc compare: the run's own allocations replayed "
                 "through memcalc's allocator model reserve what the run did (±0 B from the allocator "
                 "model), the 38 MiB are the parameters' placement before the step"),
    "efficientnet_b0-b32-sgd": (
        "-7.0%", "cuDNN's convolution workspaces of a few shapes (depthwise and strided convolutions "
                 "whose sizes the measured rule does not yet give; "
                 "benchmarks/results/2026-11-26-cudnn-workspaces): a fresh process leaves them as they were"),
    "resnet50-b128-adam": (
        "-3.8%", "cuDNN's workspaces of the strided 1x1 weight gradients "
                 "(benchmarks/results/2026-11-26-cudnn-workspaces), as at batch 32 on the H100"),
}


def _marks(name: str, outside: dict[str, tuple[str, str]]) -> list[pytest.MarkDecorator]:
    if name not in outside:
        return []
    gap, cause = outside[name]
    return [pytest.mark.xfail(strict=True, reason=f"{gap}: {cause}")]


def _measured(name: str) -> dict[str, Any]:
    measured: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())["measured"]
    return measured


def _estimate(name: str) -> memcalc.MemoryReport:
    options = dict(CONFIGS[name])
    return memcalc.estimate(options.pop("model"), gpu=GPU, stack=STACK, **options)


def test_the_data_holds_each_config_once_measured_on_an_h200():
    assert sorted(p.name.removesuffix(".json") for p in DATA.glob("*.json")) == sorted(CONFIGS)
    for name in CONFIGS:
        measured = _measured(name)
        assert measured["device"] == "cuda: NVIDIA H200" and not measured["oom"]
        # the snapshot is the step alone: its trace holds allocations, and its segments the peak
        snapshot = pickle.loads(lzma.decompress((DATA / f"{name}.pickle.xz").read_bytes()))
        assert any(e["action"] == "alloc" for e in snapshot["device_traces"][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_peak_allocated_of_a_fresh_process_within_1pct(name: str):
    measured = int(_measured(name)["peak_allocated"])
    estimate = _estimate(name).bytes.peak_allocated
    error = (estimate - measured) / measured
    assert abs(error) < TOLERANCE, f"{name}: estimate {estimate:,} B, measured {measured:,} B ({error:+.2%})"


def test_the_inference_run_the_h100_xfail_waited_for_is_within_1pct():
    # tests/test_gpu_snapshots.py's OUTSIDE_1PCT blames the H100 run's -7.8% on the 69 MB of
    # workspaces its process held from earlier configs: in a fresh process the same step is exact
    name = "llama-tiny-b8-s512-inference-bf16"
    measured = int(_measured(name)["peak_allocated"])
    estimate = _estimate(name).bytes.peak_allocated
    assert abs(estimate - measured) / measured < TOLERANCE, f"{estimate:,} B against {measured:,} B"


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n, OUTSIDE_3PCT_RESERVED)) for n in sorted(CONFIGS)])
def test_peak_reserved_of_a_fresh_process_within_3pct(name: str):
    measured = int(_measured(name)["peak_reserved"])
    estimate = _estimate(name).peak_reserved
    error = (estimate - measured) / measured
    assert abs(error) < RESERVED_TOLERANCE, f"{name}: estimate {estimate:,} B, measured {measured:,} B ({error:+.2%})"

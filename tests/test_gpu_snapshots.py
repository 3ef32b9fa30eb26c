"""memcalc's simulated step against the real H100 snapshots of tests/data/gpu/2026-11-25-h100/
(issue 25): ``torch.cuda.memory._snapshot()`` pickles of ten configs of the gpu suite, each
with every alloc/free of the real step and its Python + C++ stack, and a ``.json`` with the
measured peaks (torch 2.11, CUDA 13.0, cuDNN 9.19).

Two layers:

- the rules, pinned event by event: the worked arithmetic of a small case, then the same
  sequence read from the real snapshot by the autograd nodes in its C++ frames;
- every shared config's peak allocated within 1% of the measured one. The configs still
  outside are listed in :data:`OUTSIDE_1PCT` with their measured gap and its cause (strict
  xfail: closing one makes its test fail until the entry is removed).
"""

from __future__ import annotations

import json
import pickle
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from support import replay_suite
from torch import nn

import memcalc
from memcalc.measure.snapshot_compare import real_phase
from memcalc.measure.snapshot_export import snapshot_dict
from memcalc.targets.cuda import workspaces
from memcalc.targets.cuda.reduce import ReductionScratch, reduction_scratch
from models_zoo import plain_torch

DATA = Path(__file__).parent / "data" / "gpu" / "2026-11-25-h100"
#: The stack the snapshots were taken with (their .json: torch 2.11.0+cu130).
STACK = memcalc.Stack(torch="2.11", cuda="13.0")
GPU = "h100-80gb"
#: The bars of issue 25's "done when": peak allocated, peak reserved.
TOLERANCE = 0.01
RESERVED_TOLERANCE = 0.03
#: The caching allocator's rounding of every request (CUDACachingAllocator.cpp kMinBlockSize).
BLOCK = 512


def _rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared archive, extracted once per run into a temporary folder (never committed)."""
    folder = tmp_path_factory.mktemp("h100-snapshots")
    with tarfile.open(DATA / "snapshots.tar.xz") as archive:
        archive.extractall(folder, filter="data")
    return folder


def _config(folder: Path, name: str) -> tuple[dict[str, Any], int]:
    """(estimate() keywords, measured peak allocated) of the shared config ``name``."""
    measured = json.loads((folder / f"{name}.json").read_text())
    config = measured["config"]
    options: dict[str, Any] = {"batch_size": config["batch_size"], "optimizer": config["optimizer"],
                               "mode": config["mode"]}
    if config.get("seq_len"):
        options["seq_len"] = config["seq_len"]
    for key in ("precision", "checkpoint", "accum_steps", "kv_cache"):
        if key in config:
            options[key] = config[key]
    return {"model": config["model"], **options}, int(measured["peak_allocated"])


def _estimate(options: dict[str, Any]) -> memcalc.MemoryReport:
    """The estimate of a measured config: of the zoo's plain-torch model (``torch:NAME``), which the
    snapshots were taken with, even where the zoo's name builds transformers' model."""
    options = dict(options)
    return memcalc.estimate(plain_torch(options.pop("model")), gpu=GPU, stack=STACK, **options)


def _events(trace: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """(action, size, memcalc's frame name) of each alloc / completed free."""
    return [(e["action"], e["size"], e["frames"][0]["name"]) for e in trace
            if e["action"] in ("alloc", "free_completed")]


# ---- the loss under autocast ----------------------------------------------------------------

def test_autocast_cross_entropy_keeps_low_precision_log_probs_and_an_fp32_copy():
    # cross_entropy_loss (LossNLL.cpp) calls log_softmax(self, dim, self.scalar_type()): under
    # amp-bf16 the log-probabilities stay bf16; nll_loss (autocast fp32 list) casts them to fp32.
    batch, classes = 128, 1000
    report = memcalc.estimate(nn.Sequential(nn.Linear(64, classes)), input_shape=(64,), batch_size=batch,
                              optimizer="sgd", precision="amp-bf16", gpu=GPU, stack=STACK)
    events = _events(snapshot_dict(report)["device_traces"][0])
    bf16, fp32 = _rounded(batch * classes * 2), _rounded(batch * classes * 4)  # 256,000 / 512,000 B
    loss = [e for e in events if e[2].startswith("loss ") and e[0] == "alloc"][:2]
    assert loss == [("alloc", bf16, "loss aten._log_softmax.default"), ("alloc", fp32, "loss aten._to_copy.default")]
    # backward of the loss, in the real order: the fp32 gradient of the copy, the copy freed,
    # ToCopyBackward's bf16 gradient, the fp32 one freed, LogSoftmaxBackward's bf16 gradient
    start = events.index(("alloc", fp32, "backward aten.nll_loss_backward.default"))
    sized = [e for e in events[start:] if e[1] in (bf16, fp32)][:7]
    assert sized == [
        ("alloc", fp32, "backward aten.nll_loss_backward.default"),
        ("free_completed", fp32, "loss aten._to_copy.default"),
        ("alloc", bf16, "backward aten._to_copy.default"),
        ("free_completed", fp32, "backward aten.nll_loss_backward.default"),
        ("alloc", bf16, "backward aten._log_softmax_backward_data.default"),
        ("free_completed", bf16, "backward aten._to_copy.default"),
        ("free_completed", bf16, "loss aten._log_softmax.default"),
    ]
    # nothing of the loss is fp32-sized but the copy and its gradient: no fp32 log_softmax
    assert not any(e[1] == fp32 and "log_softmax" in e[2] for e in events)


#: The autograd nodes of the loss's backward, as the real C++ frames name them.
_LOSS_NODES = ("NllLossBackward0", "ToCopyBackward0", "LogSoftmaxBackward0")


def _real_loss_backward(trace: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """The real trace's allocations made by the loss's autograd nodes, first iteration: (alloc,
    size, node)."""
    found: list[tuple[str, int, str]] = []
    for entry in trace:
        if entry["action"] != "alloc":
            continue
        names = " ".join(frame["name"] for frame in entry["frames"])
        node = next((n for n in _LOSS_NODES if f"generated::{n}::apply" in names), None)
        if node is not None:
            if found and node == _LOSS_NODES[0]:
                break  # the second iteration
            found.append(("alloc", entry["size"], node))
    return found


@pytest.mark.parametrize("name", ["llama-tiny-b8-s512-adamw-amp-bf16-ckpt", "gpt2-b8-s1024-adamw-amp-bf16"])
@pytest.mark.quick_cases("gpt2-b8-s1024-adamw-amp-bf16")
def test_loss_backward_under_autocast_matches_the_real_snapshot(snapshots: Path, name: str):
    real = _real_loss_backward(pickle.loads((snapshots / f"{name}.pickle").read_bytes())["device_traces"][0])
    options, _ = _config(snapshots, name)
    simulated = _events(snapshot_dict(_estimate(options))["device_traces"][0])
    ops = {"backward aten.nll_loss_backward.default": _LOSS_NODES[0], "backward aten._to_copy.default": _LOSS_NODES[1],
           "backward aten._log_softmax_backward_data.default": _LOSS_NODES[2]}
    logits = real[0][1]  # the fp32 gradient of the logits' copy
    mine = [(a, size, ops[op]) for a, size, op in simulated if a == "alloc" and op in ops and size >= logits // 2]
    assert real[:3] == [("alloc", logits, "NllLossBackward0"), ("alloc", logits // 2, "ToCopyBackward0"),
                        ("alloc", logits // 2, "LogSoftmaxBackward0")]
    assert mine[:3] == real[:3]


# ---- inference: the cuBLAS workspace of the forward handle ------------------------------------

def test_inference_mode_matmuls_allocate_the_forward_cublas_workspace():
    # under inference_mode, linear and matmul reach the tracer whole; on CUDA they still run
    # through cuBLAS, whose first call allocates the handle's workspace (32 MiB on sm90:
    # CublasHandlePool.cpp; the H100 suite's first warm-up measured 33,554,432 B)
    report = memcalc.estimate("torch:llama-tiny", batch_size=2, seq_len=64, mode="inference", precision="bf16",
                              gpu=GPU, stack=STACK)
    workspaces = [e for e in _events(snapshot_dict(report)["device_traces"][0]) if "cuBLAS workspace" in e[2]]
    assert workspaces == [("alloc", 32 * 2**20, "forward model.layers.0.self_attn.q_proj synthetic: cuBLAS workspace "
                                                 "(forward handle)")]


def _own_peak(trace: list[dict[str, Any]]) -> int:
    """The highest running sum of a real trace's allocations: blocks allocated before the
    recording (the workspaces of earlier configs in the measuring process) are not in it."""
    current = peak = 0
    for entry in trace:
        if entry["action"] == "alloc":
            current += entry["size"]
        elif entry["action"] == "free_completed":
            current -= entry["size"]
        peak = max(peak, current)
    return peak


#: The forward handle's cuBLAS workspace on an H100, as the suite's first warm-up measured it.
FORWARD_CUBLAS_WORKSPACE = 33_554_432


@pytest.mark.parametrize(("name", "workspaces"), [
    ("llama-tiny-b8-s512-inference-bf16", 1), ("llama-tiny-b8-s512-inference-bf16-kv512", 1),
    ("gpt2-b8-s1024-eval", 1),
    ("unet-b2-sgd", 0),  # convolutions only: its step never creates a cuBLAS handle
])
def test_step_matches_its_own_real_allocations(snapshots: Path, name: str, workspaces: int):
    # the step's own real allocations (the trace) plus the cuBLAS workspaces a fresh process
    # running it would allocate: what the estimate models, within 1%
    options, _ = _config(snapshots, name)
    real = _own_peak(pickle.loads((snapshots / f"{name}.pickle").read_bytes())["device_traces"][0])
    fresh = real + workspaces * FORWARD_CUBLAS_WORKSPACE
    estimate = _estimate(options).bytes.peak_allocated
    assert abs(estimate - fresh) / fresh < TOLERANCE, (estimate, fresh)


# ---- reductions: gpu_reduce_kernel's global scratch --------------------------------------------

def test_bias_gradient_sum_stages_partial_results_in_global_memory():
    # sum over the 6,304 rows of a (6304, 3072) bf16 gradient on an H100 (132 SMs, 2,048
    # threads/SM), transcribing setReduceConfig (Reduce.cuh): outputs vectorised by 4 → 768
    # columns; block 32 × 4 = 128 threads; step_output 32, step_input 4 → 1,576 values per
    # thread; grid.x = 768 / 32 = 24 ≤ 132 × 2048 / 128 = 2,112 → ctas_per_output =
    # max(min(⌈2112/24⌉ = 88, ⌈1576/16⌉ = 99), ⌈1576/256⌉ = 7) = 88; staging = 4 B (float
    # accumulator) × 3072 × 88 × 32 × 4 = 138,412,032 B; semaphores 4 B × 24 = 96 B
    assert reduction_scratch((6304, 3072), (3072, 1), [0], torch.bfloat16, (9, 0), 132) == ReductionScratch(
        staging=4 * 3072 * 88 * 32 * 4, semaphores=96)
    # reducing the contiguous dimension (one output per row): the blocks reduce on their own
    assert reduction_scratch((6304, 3072), (3072, 1), [1], torch.bfloat16, (9, 0), 132) == ReductionScratch(0, 0)


def _real_reduction_scratch(trace: list[dict[str, Any]], *, semaphores: bool = False) -> list[int]:
    """Sizes of the staging buffers gpu_reduce_kernel took in a real trace, in order; with
    ``semaphores``, its semaphore arrays too (the requests of at most one block)."""
    return [e["size"] for e in trace if e["action"] == "alloc" and (semaphores or e["size"] > BLOCK)
            and any("gpu_reduce_kernel" in f["name"] for f in e["frames"])]


def test_reduction_scratch_matches_the_real_vit_snapshot(snapshots: Path):
    name = "vit_b_16-b32-adamw-bf16"
    real = _real_reduction_scratch(pickle.loads((snapshots / f"{name}.pickle").read_bytes())["device_traces"][0])
    # the bias gradients of ViT-B/16 at batch 32 in bf16: each Linear's over 32 × 197 = 6,304
    # rows, and the patch convolution's over a channels-last (32, 768, 14, 14) gradient
    rows = 32 * 197
    linear = {c: reduction_scratch((rows, c), (c, 1), [0], torch.bfloat16, (9, 0), 132).staging
              for c in (768, 2304, 3072)}
    conv = reduction_scratch((32, 768, 14, 14), (150_528, 1, 10_752, 768), [0, 2, 3], torch.bfloat16, (9, 0), 132)
    # both iterations: per encoder block mlp.3 and out_proj (768), in_proj (2304), mlp.0 (3072),
    # then the patch convolution's bias
    per_step = [linear[768], linear[3072], linear[768], linear[2304]] * 12 + [conv.staging]
    assert real == per_step * 2


def test_the_estimate_stages_every_reduction_the_real_vit_step_staged(snapshots: Path):
    # the rule applied: the estimate requests the staging buffer and the semaphores of each of
    # the 98 real launches, of the real sizes, in the real order (both iterations)
    name = "vit_b_16-b32-adamw-bf16"
    trace = pickle.loads((snapshots / f"{name}.pickle").read_bytes())["device_traces"][0]
    real = _real_reduction_scratch(trace, semaphores=True)
    options, _ = _config(snapshots, name)
    timeline = _estimate(options).timeline()
    mine = [e.requested for e in timeline.allocator_events
            if e.action == "alloc" and timeline.op[e.event].startswith("synthetic: reduction")]
    assert len(real) == 196
    assert mine == real


# ---- every shared config within 1% ------------------------------------------------------------

#: The shared configs still outside 1% of the measured peak allocated: name → (gap measured on
#: 2026-11-26 after the fixes above, cause). Each is a strict xfail: closing one fails the test
#: until its entry goes.
OUTSIDE_1PCT: dict[str, tuple[str, str]] = {
    "llama-tiny-b8-s512-inference-bf16": (
        "-7.8%", "the measuring process held 69,206,016 B of workspaces from earlier training configs (its "
                 ".json's note): the backward thread's cuBLAS workspace (32 MiB) and two cuBLASLt ones (1 MiB "
                 "each), which an inference-only process never allocates; the step itself is within 0.4% "
                 "(test_step_matches_its_own_real_allocations). measure_cuda now frees them before it measures "
                 "(tests/test_measure_reserved.py); re-measured so on an H200 on 2026-11-28, the same step is "
                 "-0.04% (tests/test_gpu_fresh_snapshots.py). Estimated in a process holding "
                 "them (test_peak_allocated_as_measured_within_1pct): +0.14%"),
    "llama-tiny-b8-s512-inference-bf16-kv512": (
        "-7.5%", "as llama-tiny-b8-s512-inference-bf16: workspaces left by earlier configs"),
    "gpt2-b8-s1024-eval": (
        "-1.6%", "as llama-tiny-b8-s512-inference-bf16: workspaces left by earlier configs; the step itself "
                 "is within 0.1%"),
    "resnet50-b64-sgd-momentum-amp-fp16": (
        "+3.1%", "GradScaler skipped optimizer.step() in both measured iterations (inf/NaN in the fp16 "
                 "gradients at the initial scale 2**16: the real trace has no momentum-buffer allocation), "
                 "so the 105 MB of SGD momentum never existed; memcalc models the steady state, where "
                 "the step runs (amp-bf16, without a scaler: -0.3%). measure_cuda now warms the scaler up "
                 "until no step is skipped (tests/test_measure_reserved.py): a later GPU run re-measures"),
    "resnet18-b1-sgd": (
        "-1.1%", "the 2 MiB of cuBLASLt workspaces left by earlier configs (memcalc compare: memcalc -1.99 "
                 "MiB); cuDNN's workspaces at batch 1, -5.2% with the old model, follow the measured rule"),
    "unet-b2-sgd": (
        "-1.9%", "as llama-tiny-b8-s512-inference-bf16: the 69,206,016 B of workspaces left by earlier "
                 "configs; a convolution-only step creates no cuBLAS handle, and its own real allocations "
                 "peak within 0.01% of the estimate"),
}



def _shared_names() -> list[str]:
    """The configs in the archive (one .json each), without extracting it."""
    with tarfile.open(DATA / "snapshots.tar.xz") as archive:
        return sorted(Path(n).stem for n in archive.getnames() if n.endswith(".json"))


SHARED = _shared_names()


def _marks(name: str, outside: dict[str, tuple[str, str]] | None = None) -> list[pytest.MarkDecorator]:
    """A strict xfail for ``name`` where ``outside`` (default OUTSIDE_1PCT) lists it, with its gap and cause."""
    table = OUTSIDE_1PCT if outside is None else outside
    if name not in table:
        return []
    gap, cause = table[name]
    return [pytest.mark.xfail(strict=True, reason=f"{gap}: {cause}")]


def test_the_shared_data_has_its_ten_configs():
    assert len(SHARED) == 10 and set(OUTSIDE_1PCT) < set(SHARED)


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in SHARED])
@pytest.mark.quick_cases("resnet18-b1-sgd", "llama-tiny-b8-s512-inference-bf16")
def test_peak_allocated_within_1pct_of_the_h100(snapshots: Path, name: str):
    options, measured = _config(snapshots, name)
    estimate = _estimate(options).bytes.peak_allocated
    error = (estimate - measured) / measured
    assert abs(error) < TOLERANCE, f"{name}: estimate {estimate:,} B, measured {measured:,} B ({error:+.2%})"


#: The shared configs whose peak reserved is more than 3% off, with the gap and its cause (strict
#: xfail, as OUTSIDE_1PCT).
OUTSIDE_3PCT_RESERVED: dict[str, tuple[str, str]] = {
    "gpt2-b8-s1024-adamw-amp-bf16": (
        "+11.4%", "the measuring process's warm-up had put the cuBLAS workspaces in segments of their own "
                  "before the step; in a fresh process the backward handle's is born inside the step, in a "
                  "1.5 GiB segment the loss needs again in the second iteration, which then takes a segment "
                  "more, as memcalc's does. With them there before the step the estimate is within 0.1% "
                  "(test_reserved_as_measured_with_the_warm_up_workspaces); measure_cuda now frees them "
                  "before it measures; re-measured so on an H200 on 2026-11-28, the estimate is +0.01% "
                  "(tests/test_gpu_fresh_snapshots.py)"),
    "llama-tiny-b8-s512-adamw-amp-bf16-ckpt": (
        "+18.1%", "as gpt2-b8-s1024-adamw-amp-bf16: the measuring process held the warm-up's cuBLAS "
                  "workspaces in segments of their own before the step; estimated so, exact "
                  "(test_reserved_as_measured_with_the_warm_up_workspaces); in a fresh process on an H200 "
                  "(2026-11-28, tests/test_gpu_fresh_snapshots.py) exact to the byte. Before the allocator model "
                  "placed "
                  "segments as the driver does (VA_GRANULARITY), the fresh estimate came out -1.8%: the "
                  "tie-breaks of its many equal 8 MiB blocks fell otherwise"),
    "gpt2-b8-s1024-eval": (
        "-4.8%", "the workspaces earlier configs left (as measured, -3.6%), and the model's build on the "
                 "device: the step began with 676 MiB reserved around 475 MiB live "
                 "(test_the_short_runs_began_with_the_builds_cache_around_live_blocks), cache that the "
                 "step's own requests fit only in part"),
    "llama-tiny-b8-s512-inference-bf16": (
        "-18.7%", "the 69,206,016 B of workspaces left by earlier configs (OUTSIDE_1PCT; as measured -12.8%) "
                  "and the build in fp32 cast to bf16 on the device: the step began with 260 MiB reserved "
                  "around 105 MiB live, and the 2026-11-26 re-measurement, its build's cache emptied, "
                  "freed only 8 MiB of it (tests/data/gpu/2026-11-26-h100/suite-measured.jsonl)"),
    "llama-tiny-b8-s512-inference-bf16-kv512": (
        "-13.2%", "as llama-tiny-b8-s512-inference-bf16 (as measured -7.3%)"),
}


def _measured_reserved(folder: Path, name: str) -> int:
    return int(json.loads((folder / f"{name}.json").read_text())["peak_reserved"])


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n, OUTSIDE_3PCT_RESERVED)) for n in SHARED])
@pytest.mark.quick_cases("resnet18-b1-sgd", "unet-b2-sgd")
def test_peak_reserved_within_3pct_of_the_h100(snapshots: Path, name: str):
    options, _ = _config(snapshots, name)
    measured = _measured_reserved(snapshots, name)
    estimate = _estimate(options).peak_reserved
    error = (estimate - measured) / measured
    assert abs(error) < RESERVED_TOLERANCE, f"{name}: estimate {estimate:,} B, measured {measured:,} B ({error:+.2%})"


def _warm_up_bytes(folder: Path, name: str) -> int:
    """What the measuring process's warm-up left allocated, from the config's .json note (read as
    benchmarks/replay_suite.py --as-measured reads a suite record's)."""
    warm: int = replay_suite().warm_bytes(json.loads((folder / f"{name}.json").read_text()))
    assert warm > 0
    return warm


@pytest.mark.parametrize("name", ["gpt2-b8-s1024-adamw-amp-bf16", "llama-tiny-b8-s512-adamw-amp-bf16-ckpt"])
def test_reserved_as_measured_with_the_warm_up_workspaces(snapshots: Path, name: str):
    # The suite's process ran a warm-up before each config: its cuBLAS workspaces (one per handle)
    # were allocated before the step, in segments of their own. Estimated so, GPT-2's step under
    # autocast and Llama's checkpointed one reserve what the runs did: the +11.4% and +18.1% of
    # OUTSIDE_3PCT_RESERVED are that warm-up.
    options, _ = _config(snapshots, name)
    measured = _measured_reserved(snapshots, name)
    assert _estimate(options).peak_reserved > 1.1 * measured  # in a fresh process
    with workspaces.warm_process(_warm_up_bytes(snapshots, name)):
        warm = _estimate(options).peak_reserved
    assert abs(warm - measured) / measured < 0.001, f"{warm:,} B against {measured:,} B"


@pytest.mark.parametrize("name, reserved, live", [
    ("gpt2-b8-s1024-eval", 676, 474), ("llama-tiny-b8-s512-inference-bf16", 260, 104)])
def test_the_short_runs_began_with_the_builds_cache_around_live_blocks(snapshots: Path, name: str,
                                                                       reserved: int, live: int):
    # the cause OUTSIDE_3PCT_RESERVED gives: before the step's first forward allocation the process
    # reserved far more than it held (MiB), left by building the model on the device
    trace = pickle.loads((snapshots / f"{name}.pickle").read_bytes())["device_traces"][0]
    segments, blocks = 0, {}
    for event in trace:
        if event["action"] == "segment_alloc":
            segments += event["size"]
        elif event["action"] == "segment_free":
            segments -= event["size"]
        elif event["action"] == "alloc":
            if real_phase(f"{f['filename']}:{f['line']} {f['name']}" for f in event["frames"]
                          if f["filename"].endswith(".py")) == "forward":
                break
            blocks[event["addr"]] = event["size"]
        elif event["action"] == "free_completed":
            blocks.pop(event["addr"], None)
    assert (segments >> 20, sum(blocks.values()) >> 20) == (reserved, live)


#: Estimated in a process as warm as the measuring one, the one config still outside 1%.
OUTSIDE_1PCT_AS_MEASURED = {"resnet50-b64-sgd-momentum-amp-fp16": OUTSIDE_1PCT["resnet50-b64-sgd-momentum-amp-fp16"]}


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n, OUTSIDE_1PCT_AS_MEASURED)) for n in SHARED])
@pytest.mark.quick_cases("llama-tiny-b8-s512-inference-bf16", "unet-b2-sgd")
def test_peak_allocated_as_measured_within_1pct(snapshots: Path, name: str):
    # the causes OUTSIDE_1PCT gives for the inference, eval, U-Net and batch-1 runs are the
    # workspaces the measuring process held from its warm-up (each .json's note says how many
    # bytes): estimated in a process that holds them (workspaces.warm_process), every config but
    # the fp16 one whose scaler skipped its steps is within 1%
    options, measured = _config(snapshots, name)
    with workspaces.warm_process(_warm_up_bytes(snapshots, name)):
        estimate = _estimate(options).bytes.peak_allocated
    error = (estimate - measured) / measured
    assert abs(error) < TOLERANCE, f"{name}: estimate {estimate:,} B, measured {measured:,} B ({error:+.2%})"


def test_a_warm_process_holds_its_workspaces_before_the_step():
    # an MLP on an H100 (cuBLAS workspace 32 MiB per handle): 65 MiB of warm-up = both handles'
    # workspaces and a 1 MiB cuBLASLt one, allocated before the step; the step allocates none of them
    fresh = memcalc.estimate("mlp", batch_size=64, gpu=GPU)
    with workspaces.warm_process(65 * 2**20):
        warm = memcalc.estimate("mlp", batch_size=64, gpu=GPU)
    # training: both handles' workspaces are alive at the peak either way; the cuBLASLt MiB is new
    assert warm.bytes.peak_allocated == fresh.bytes.peak_allocated + 2**20
    # inference creates no backward handle: the warm process holds its 32 MiB as well
    inference = {"mode": "inference", "optimizer": "none"}
    fresh = memcalc.estimate("mlp", batch_size=64, gpu=GPU, **inference)
    with workspaces.warm_process(65 * 2**20):
        warm = memcalc.estimate("mlp", batch_size=64, gpu=GPU, **inference)
    assert warm.bytes.peak_allocated == fresh.bytes.peak_allocated + 32 * 2**20 + 2**20
    with pytest.raises(ValueError, match="≥ 0"), workspaces.warm_process(-1):
        pass


def test_the_fp16_run_skipped_its_optimizer_steps(snapshots: Path):
    # the cause listed for resnet50 amp-fp16: scaler.unscale_ ran, SGD never allocated a
    # momentum buffer (torch/optim/sgd.py clones the gradient into it at its first step)
    trace = pickle.loads((snapshots / "resnet50-b64-sgd-momentum-amp-fp16.pickle").read_bytes())["device_traces"][0]
    files = [{f["filename"].rsplit("/", 1)[-1] for f in e["frames"]} for e in trace if e["action"] == "alloc"]
    assert any("grad_scaler.py" in names for names in files)
    assert not any("sgd.py" in names for names in files)
    # the same config's estimate holds the momentum buffers (one per parameter, 161 of them)
    options, _ = _config(snapshots, "resnet50-b64-sgd-momentum-amp-fp16")
    optimizer = [e for e in _events(snapshot_dict(_estimate(options))["device_traces"][0])
                 if e[0] == "alloc" and e[2].startswith("optimizer aten.clone")]
    assert len(optimizer) == 161

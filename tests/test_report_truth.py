"""Every figure the report shows agrees with the others: reserved bytes under a capacity agree
with ``fits``, the per-module table holds only what a module keeps, each mode is described in
its own words, and the header names the dtype the inputs are counted in."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.cli.fit import _render_fit
from memcalc.core.report import Textbook
from memcalc.report.render import render_report
from memcalc.search.fit_result import FitResult, Probe
from memcalc.targets.budget import Budget
from memcalc.targets.cuda.gpus.catalogue import get_gpu

KiB, MiB = 2**10, 2**20
CUBLAS_WORKSPACE_SM90 = 32 * MiB  # memcalc.targets.cuda.cublas: 32 MiB per handle on Hopper


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# ---- 1. under a capacity, reserved bytes are those reached within it --------------------------
class TwoTemporaries(nn.Module):
    """A 30 MiB temporary, freed, then a 40 MiB one: an unpressured allocator keeps the 30 MiB
    segment cached and adds a 40 MiB one (70 MiB + the 2 MiB small-pool segment of the scalars
    = 72 MiB reserved); under a capacity it frees the cached segment and retries (40 + 2 = 42 MiB)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.new_zeros(30 * MiB // 4)
        s = a.sum()
        del a
        b = x.new_zeros(40 * MiB // 4)
        return b.sum() + s


def _two_temporaries(capacity: int | None) -> memcalc.MemoryReport:
    return memcalc.estimate(TwoTemporaries(), inputs=torch.empty(1, device="meta"), mode="eval",
                            optimizer="none", capacity=capacity)


def test_reserved_under_a_capacity_is_the_replay_within_it():
    free = _two_temporaries(None)
    assert free.fits is None and free.peak_reserved == free.peak_reserved_unconstrained == 72 * MiB

    r = _two_temporaries(60 * MiB)
    assert r.fits is True
    assert r.peak_reserved == r.reserved_within_capacity == 42 * MiB  # was 72 MiB beside fits=True
    assert r.peak_reserved_unconstrained == 72 * MiB
    assert r.device_total == 42 * MiB + r.cuda_context
    data = r.to_dict()
    assert data["fits"] is True and data["bytes"]["peak_reserved"] == 42 * MiB <= 60 * MiB
    assert data["bytes"]["peak_reserved_unconstrained"] == 72 * MiB
    text = render_report(r, modules=False)
    assert ("peak reserved by the caching allocator: 42.00 MiB within the 60.00 MiB capacity "
            "(it frees cached segments and retries; 72.00 MiB with no limit)") in text
    assert "= 554.00 MiB on the device" in text  # 42 MiB + the generic 512 MiB context
    # a capacity that overrides a named GPU's is a budget, not the GPU
    assert "fits in 60.00 MiB (budget): yes, 20.00 MiB headroom above the peak allocated" in text


def test_a_step_that_does_not_fit_says_what_it_needed():
    # 40 MiB + 2 MiB of small blocks cannot be reserved within 41 MiB although the peak
    # allocated (40 MiB + four 512 B blocks) is under it
    r = _two_temporaries(41 * MiB)
    assert r.fits is False and r.peak_reserved == 42 * MiB and r.peak_reserved_unconstrained == 72 * MiB
    text = render_report(r, modules=False)
    assert "42.00 MiB needed under the 41.00 MiB capacity even after freeing cached segments" in text
    assert "the peak allocated is 1,022.00 KiB under it, but it needs 42.00 MiB reserved" in text
    assert "fragmentation over at the peak" not in text  # the old, broken sentence


def test_resnet50_at_its_largest_batch_stays_within_the_a100():
    r = memcalc.estimate("resnet50", batch_size=475, gpu="a100-40gb")
    assert r.fits is True and r.capacity == r.gpu.usable_memory
    assert r.peak_reserved <= r.capacity < r.peak_reserved_unconstrained  # 38.93 ≤ 38.93 < 47.19 GiB
    assert r.device_total <= r.gpu.total_memory  # was 44.25 GiB on a 39.39 GiB card
    assert r.to_dict()["bytes"]["peak_reserved"] == r.peak_reserved


def test_gpu_named_capacity_is_labelled_with_the_gpu():
    text = render_report(memcalc.estimate("fc-32-16", batch_size=100, gpu="h100-80gb"), modules=False)
    # the catalogue's total_memory, 85,028,896,768 B (81,089.9 MiB, what CUDA reports), less the measured
    # lazy CUDA context of an H100 under CUDA 13.0, 693 MiB (tests/data/gpu/2026-11-25-h100/ctx.json)
    usable = (get_gpu("h100-80gb").total_memory - 693 * 2**20) / 2**30
    assert f"fits in {usable:.2f} GiB (NVIDIA H100 80GB HBM3): yes" in text and f"{usable:.2f}" == "78.51"


# ---- 2. the per-module table holds activations only, never workspaces --------------------------
def test_mlp_module_rows_exclude_the_cublas_workspace():
    r = memcalc.estimate("mlp", batch_size=256, optimizer="sgd", gpu="h100-80gb")
    rows = {m.name: m.activation_bytes for m in r.modules_within(1)}
    # Linear 1's output dies (ReLU keeps its own result); each ReLU keeps 256·1024·4 B; the last
    # Linear's logits 256·10·4 B. Before: module 1 held the 32 MiB cuBLAS workspace.
    assert rows == {"0": 0, "1": 0, "2": 256 * 1024 * 4, "3": 0, "4": 256 * 1024 * 4, "5": 256 * 10 * 4}
    # the table's sum is within the textbook's activations (those add log_softmax's result
    # 256·10·4 B and two 4 B scalars)
    assert sum(rows.values()) + 256 * 10 * 4 + 4 + 4 == r.textbook.activation_bytes
    assert r.bytes.workspace >= CUBLAS_WORKSPACE_SM90  # still counted where it belongs


def test_eval_module_rows_exclude_the_cublas_workspace():
    r = memcalc.estimate("mlp", batch_size=8, mode="eval", optimizer="none")
    rows = {m.name: m.activation_bytes for m in r.modules_within(1)}
    assert rows["1"] == 8 * 1024 * 4  # was 8·1024·4 + 8,519,680 (the forward handle's workspace)


def test_resnet50_fc_row_is_its_logits():
    r = memcalc.estimate("resnet50", batch_size=8)
    fc = next(m for m in r.modules if m.name == "fc")
    assert fc.activation_bytes == 8 * 1000 * 4  # was 32,000 + 8,519,680


def test_inference_module_rows_never_exceed_the_peak():
    # Without autograd each activation dies soon after its consumer: the sum of everything a
    # module allocated is no memory that was ever resident (gpt2, bf16, batch 4 × 1,024 tokens:
    # the transformer's was 3,495,698,720 B beside a 681,858,048 B peak, a column that read as
    # 5× the peak). The column shows each module's high-water: what was alive at one moment.
    for model, options in (("gpt2", {"seq_len": 1024, "precision": "bf16"}), ("resnet18", {}),
                           ("llama-tiny", {"seq_len": 512, "precision": "bf16"})):
        for mode in ("inference", "eval"):
            r = memcalc.estimate(model, batch_size=4, mode=mode, optimizer="none", **options)
            over = [(m.name, m.activation_bytes) for m in r.modules if m.activation_bytes > r.bytes.peak_allocated]
            assert not over, f"{model} {mode}: rows above the {r.bytes.peak_allocated:,} B peak: {over}"
            rows = {m.name: m.activation_bytes for m in r.modules}
            # a container's high-water is at least each child's: the child's bytes are its bytes
            assert all(rows[m.name] >= rows[child.name] for m in r.modules for child in r.modules
                       if child.name.startswith(m.name + ".") and child.depth == m.depth + 1)
            assert "activations alive in forward (high-water)" in render_report(r)


def test_inference_module_row_is_its_largest_moment_not_its_sum():
    # A container of Linear(64, 256), ReLU, Linear(256, 256), ReLU, Linear(256, 10), batch 8,
    # fp32, inference: each output is 8·256·4 = 8,192 B (the last 8·10·4 = 320 B) and dies once
    # the next module has run, so at most two are alive at once: 2 × 8,192 = 16,384 B. The
    # cumulative figure the column showed before was 4 × 8,192 + 320 = 33,088 B.
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                        nn.Linear(256, 10)))
    r = memcalc.estimate(model, batch_size=8, input_shape=(64,), mode="inference", optimizer="none", gpu="cpu")
    rows = {m.name: m.activation_bytes for m in r.modules}
    assert rows["0"] == 2 * 8 * 256 * 4
    assert rows["0.0"] == rows["0.1"] == rows["0.2"] == 8 * 256 * 4 and rows["0.4"] == 8 * 10 * 4


# ---- 3. each mode in its own words; the textbook states what it adds, one sign convention ----
def test_textbook_counts_the_input_batch_like_the_worked_example():
    # one fully connected layer, batch 100, 32 → 16, fp32: 4 × (100·32 + 32·16 + 100·16)
    r = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none", gpu="cpu")
    tb = r.textbook
    assert (tb.parameter_bytes, tb.input_bytes, tb.activation_bytes) == (4 * 32 * 16, 4 * 100 * 32, 4 * 100 * 16)
    assert tb.total == 21_248
    text = render_report(r, modules=False)
    assert ("textbook: parameters 2.00 KiB (weights) + input batch 12.50 KiB + activations alive at the peak "
            "6.25 KiB = 20.75 KiB") in text
    # the CPU target counts what the CPU allocator does, unrounded: the worked example to the byte
    assert r.bytes.peak_allocated == 21_248
    assert "the simulated peak, 20.75 KiB, is 0.0% above the rule of thumb" in text
    # a CUDA GPU rounds each block to 512 B: 21,504 B, (21,504 − 21,248) / 21,248 = 1.2% (its cuBLAS
    # workspace is a temporary of its own, not in the rule)
    cuda = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none")
    assert cuda.bytes.peak_allocated - cuda.bytes.workspace == 21_504


def test_textbook_gap_one_sign_convention():
    tb = Textbook(parameter_bytes=100, multiplier=4, terms="weights + grads + 2 moments", activation_bytes=100,
                  input_bytes=100)
    assert tb.total == 600
    assert tb.gap(660) == pytest.approx(0.10) and tb.gap(540) == pytest.approx(-0.10)
    assert Textbook(0, 1, "weights", 0).gap(10) is None


def test_textbook_sentence_says_above_below_or_times():
    # fc-32-16 on CUDA: 8,541,184 B against 21,248 B = 402.0× (was "-99.9%")
    cuda = render_report(memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none"))
    assert "the simulated peak, 8.15 MiB, is 402.0× the rule of thumb." in cuda
    assert "Not in the rule, at the peak: temporaries / workspace 8.12 MiB." in cuda
    assert "-99.9%" not in cuda
    # mlp, SGD, batch 256, H100: rule 2·7,454,760 + 256·784·4 + 256·8 + 2,117,640 = 17,832,024 B
    mlp = memcalc.estimate("mlp", batch_size=256, optimizer="sgd", gpu="h100-80gb")
    assert mlp.textbook.total == 2 * 7_454_760 + 256 * 784 * 4 + 256 * 8 + 2_117_640
    assert mlp.bytes.peak_allocated == 83_884_032  # 4.70× the rule
    assert "the simulated peak, 80.00 MiB, is 4.7× the rule of thumb." in render_report(mlp)


@pytest.mark.parametrize("mode", ["eval", "inference", "train"])
def test_each_mode_in_its_own_words(mode, golden):
    # forward-only modes speak of forward outputs in use and of no gradients; training of
    # activations saved for backward and gradients appearing during backward
    optimizer = "sgd" if mode == "train" else "none"
    text = render_report(memcalc.estimate("mlp", batch_size=8, mode=mode, optimizer=optimizer))
    golden(text)
    if mode != "train":  # rows and sentences that cannot exist without autograd
        assert "backward" not in text and "gradients appear" not in text
        assert "optimizer state is created" not in text
        assert "\ngradients " not in text and "\noptimizer state " not in text


# ---- 4. the header names the dtype the inputs are counted in ----------------------------------
@pytest.mark.parametrize("precision, dtype, itemsize", [
    ("bf16", "bfloat16", 2), ("fp16", "float16", 2), ("amp-bf16", "float32", 4), ("fp32", "float32", 4),
])
def test_header_input_dtype_follows_the_precision(precision, dtype, itemsize):
    r = memcalc.estimate("mlp", batch_size=8, precision=precision)
    assert r.input_description == f"(8, 784) {dtype}"
    # 8·784 inputs in that dtype + 8 int64 targets
    assert r.bytes.inputs == 8 * 784 * itemsize + 8 * 8
    text = render_report(r, modules=False)
    assert f"input (8, 784) {dtype};" in text


def test_cli_header_bf16(golden):
    result = run("mlp", "--batch", "8", "--precision", "bf16", "--depth", "0")
    assert result.exit_code == 0, result.output
    golden(result.output)  # the header's input is "(8, 784) bfloat16" (was "float32")


def test_cli_json_fits_and_reserved_agree():
    result = run("resnet50", "--batch", "475", "--gpu", "a100-40gb", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    usable = 42_298_834_944 - 472 * MiB  # a100-40gb (39.39 GiB) minus its assumed 472 MiB context
    assert data["fits"] is True and data["bytes"]["peak_reserved"] <= usable
    assert data["bytes"]["peak_reserved_unconstrained"] > usable


# ---- memcalc fit: a "no" beside room left is explained ------------------------------------------
def test_fit_table_explains_a_no_with_room_left():
    report = memcalc.estimate("fc-32-16", batch_size=4, capacity=40 * MiB)
    budget = Budget(capacity=40 * MiB, source="40.00 MiB")
    result = FitResult(batch_size=4, report=report, budget=budget, headroom=1, bytes_per_sample=1.0, probes=(),
                       neighbours=(Probe(4, True, 30 * MiB), Probe(5, False, 39 * MiB)))
    assert "a batch with room left under the budget can still fail" in _render_fit(result, "simple", "auto")
    over = FitResult(batch_size=4, report=report, budget=budget, headroom=1, bytes_per_sample=1.0, probes=(),
                     neighbours=(Probe(4, True, 30 * MiB), Probe(5, False, 41 * MiB)))
    assert "room left under the budget" not in _render_fit(over, "simple", "auto")

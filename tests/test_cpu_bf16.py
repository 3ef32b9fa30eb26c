"""bfloat16 training on the CPU target (``gpu="cpu"``) against the real CPU step.

A small Hugging Face Llama trained in ``precision="bf16"`` was estimated 3.8 % under the CPU
profiler (2,074,788 B against 2,157,048 B) while float32 agreed. The difference was oneDNN:
on a CPU with AVX512-BF16 every bfloat16 GEMM above 16³ multiply-adds runs oneDNN's matmul,
and ideep takes its scratchpad from the CPU allocator for the call — at the peak, 210,176 B
inside the LM head's weight-gradient ``mm``. :mod:`memcalc.targets.cpu.kernels` now adds that scratchpad
(:mod:`memcalc.targets.cpu.onednn`: oneDNN v3.12's ``brg_matmul:avx512_core_bf16``). Here:
the issue's model in bf16, amp-bf16 and fp16; the formula worked out by hand; each op's path
(plain, transposed, a column result, one row, K split over threads, copied operands, ``bmm``,
``mv``, ``addmm``) against the profiler to the byte; and the note a CPU with another oneDNN
ISA gets.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support import bf16_followed, hf_config_source
from torch import nn

import memcalc
from memcalc.engine.run import trace_model
from memcalc.fields import build_step
from memcalc.measure.step import _profiler_peak, attach_measurement, measure_cpu
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import CpuBackend
from memcalc.targets.cpu.kernels import (
    NOT_FOLLOWED,
    CpuCapabilities,
    flash_backward_gemm_scratch,
    flash_backward_temporaries,
)
from memcalc.targets.cpu.onednn import ONEDNN_BF16_MATMUL_ISA, onednn_bf16_matmul_isa, onednn_bf16_matmul_scratchpad

pytest.importorskip("transformers")

# The bar of tests/test_against_cpu.py (0.5 %). On torch 2.13 these agree within 84 B
# (0.004 %): the optimizers' CPU step counters, which the estimate for this CPU leaves out.
TOLERANCE = 0.005


HERE = CpuCapabilities.here()
#: This CPU runs bf16 GEMMs through a oneDNN matmul whose scratchpad is not modelled (AMX, say):
#: the estimate says so in its notes and stays under the measurement.
fp16_followed = pytest.mark.skipif(HERE.onednn_fp16, reason="oneDNN's fp16 matmul (AVX512-FP16) is not modelled")


@pytest.mark.parametrize("precision", [
    pytest.param("bf16", marks=bf16_followed),
    pytest.param("amp-bf16", marks=bf16_followed),
    pytest.param("fp16", marks=fp16_followed),
])
@pytest.mark.slow  # a real CPU step under the profiler per case
def test_small_llama_matches_the_real_cpu_step(tmp_path: Path, precision: str) -> None:
    # before the oneDNN scratchpad on torch 2.13: bf16 -3.81 %, amp-bf16 and fp16 within 0.01 %
    model = hf_config_source(tmp_path)
    kwargs = dict(batch_size=2, seq_len=32, optimizer="adamw", precision=precision)
    report = memcalc.estimate(model, gpu="cpu", **kwargs)
    torch.manual_seed(0)
    measured = attach_measurement(report, build_step(model, **kwargs), device="cpu").measurement
    assert measured is not None and measured.compared_with == report.peak_requested
    error = measured.relative_error()
    assert error is not None and abs(error) <= TOLERANCE, (
        f"{precision}: estimated {report.peak_requested:,} B vs real CPU {measured.peak_allocated:,} B")
    if precision == "bf16" and HERE.onednn_bf16:
        assert any("aten.mm.default" in note for note in report.notes if note.startswith("CPU target"))


# ---- the scratchpad formula, worked out --------------------------------------------------------

def test_scratchpad_of_the_lm_heads_gemms_by_hand() -> None:
    # 2 threads; each booking adds 128 B; the brgemm batch is 2·16·40 + 128 = 1,408 B.
    # Forward, (64×64)·(64×1000): N blocks of 64 (16 of them, enough work); M from 256 down:
    # 64 splits evenly. B copy 2·2·64·64 + 128 = 16,512; f32 accumulator 2·4·64·64 + 128 = 32,896.
    assert onednn_bf16_matmul_scratchpad(64, 1000, 64, threads=2) == 1_408 + 16_512 + 32_896 == 50_816
    # Weight gradient, (1000×64, transposed)·(64×64): one N block for 2 threads, so M blocks may
    # go down to 16; 250 is the first to split 1000 into 4 even chunks. A copy 2·2·250·64 + 128 =
    # 64,128; B 16,512; accumulator 2·4·64·250 + 128 = 128,128.
    assert (onednn_bf16_matmul_scratchpad(1000, 64, 64, threads=2, a_transposed=True)
            == 1_408 + 64_128 + 16_512 + 128_128 == 210_176)
    # Input gradient, (64×1000)·(1000×64): K blocks of 512 (B copy 2·2·64·512 + 128 = 131,200);
    # 64 rows in one block leave a thread idle, 32 split evenly: accumulator 2·4·64·32 + 128.
    assert onednn_bf16_matmul_scratchpad(64, 64, 1000, threads=2) == 1_408 + 131_200 + 16_512 == 149_120


def test_k_split_over_threads_by_hand() -> None:
    # (64×2048, transposed)·(2048×32) on 4 threads: one N block for 4 threads and a power-of-2
    # K of 2048 → K over 4 threads, each with all of C; M in one block of 64, K blocks of 512.
    # Batch 4·16·40 + 128; A copy with lda 512 + 32 (a power of 2 ≥ 512): 4·2·64·544 + 128;
    # B 4·2·64·512 + 128; accumulators 4·(4·32·64) + 128.
    assert (onednn_bf16_matmul_scratchpad(64, 32, 2048, threads=4, a_transposed=True)
            == 2_688 + 278_656 + 262_272 + 32_896 == 576_512)


def test_one_row_is_never_copied_and_keeps_short_k_blocks() -> None:
    # transA is 'T' for one row: K blocks of 512 even past 1024 (B 2·2·64·512 + 128), no A copy;
    # accumulator 2·4·64·1 + 128, with two K blocks per N chunk of one
    assert onednn_bf16_matmul_scratchpad(1, 96, 2048, threads=2) == 1_408 + 131_200 + 640 == 133_248
    assert onednn_bf16_matmul_scratchpad(1, 96, 2048, threads=2, a_transposed=True) == 133_248


def test_onednn_bf16_isa_from_cpu_flags() -> None:
    avx512_bf16 = dict.fromkeys(("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_vnni", "avx512_bf16"),
                                True)
    assert onednn_bf16_matmul_isa(avx512_bf16, {}) == ONEDNN_BF16_MATMUL_ISA
    amx = {**avx512_bf16, "amx_tile": True, "amx_int8": True, "amx_bf16": True}
    assert onednn_bf16_matmul_isa(amx, {}) == "avx512_core_amx"
    assert onednn_bf16_matmul_isa({**avx512_bf16, "avx512_bf16": False}, {}) == ""
    assert onednn_bf16_matmul_isa(avx512_bf16, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "ONEDNN_MAX_CPU_ISA=AVX2"
    # a cap at avx512_core_bf16 keeps an AMX CPU's bf16 matmul there; a cap allowing AMX changes nothing
    assert onednn_bf16_matmul_isa(amx, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == ONEDNN_BF16_MATMUL_ISA
    assert onednn_bf16_matmul_isa(amx, {"DNNL_MAX_CPU_ISA": "avx512_core_bf16"}) == ONEDNN_BF16_MATMUL_ISA
    assert onednn_bf16_matmul_isa(amx, {"ONEDNN_MAX_CPU_ISA": "ALL"}) == "avx512_core_amx"
    assert (onednn_bf16_matmul_isa({**avx512_bf16, "avx512_bf16": False}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
            == "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16")


# ---- each op's path against the profiler ------------------------------------------------------

#: The parameter's shape, the input's, and the product (the parameter is ``w``).
PRODUCTS = {
    "plain": ((512, 1000), (64, 512), lambda x, w: x @ w),
    "transposed A": ((512, 100), (512, 64), lambda x, w: x.t() @ w),
    "column result": ((256, 1), (300, 256), lambda x, w: x @ w),
    "one row": ((2048, 96), (1, 2048), lambda x, w: x @ w),
    "K over threads": ((2048, 32), (2048, 64), lambda x, w: x.t() @ w),
    "cloned A": ((128, 200), (64, 256), lambda x, w: x[:, ::2] @ w),
    "addmm": ((1000, 64), (64, 64), lambda x, w: torch.addmm(w[:, 0], x, w.t())),
    "bmm, copied A": ((4, 64, 96), (4, 64, 128), lambda x, w: torch.bmm(x[:, :, :64], w)),
    "bmm, transposed A": ((4, 64, 96), (4, 64, 64), lambda x, w: torch.bmm(x.transpose(1, 2), w)),
    "mv": ((1000, 512), (1, 512), lambda x, w: torch.mv(w, x[0])),
}


class Product(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.w = nn.Parameter(torch.randn(*PRODUCTS[name][0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return PRODUCTS[self.name][2](x, self.w)  # type: ignore[no-any-return, operator]


#: Without oneDNN's bf16 matmul (a CPU without AVX512-BF16: this workplace's AVX2 machine of
#: 2026-11-28), ATen's own bf16 GEMM copies a column-strided A to a contiguous one first: the
#: real "cloned A" step holds 16,384 B more (64 · 128 · 2 B) than the estimate, which does not
#: model that copy on this path. Strict, so that modelling it makes the test say so.
_ATEN_BF16_GEMM_GAPS = {"cloned A": "the strided A's contiguous copy (16,384 B) of ATen's bf16 GEMM without oneDNN"}


def _gemm_param(name: str) -> object:
    if name in _ATEN_BF16_GEMM_GAPS and not HERE.onednn_bf16:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=_ATEN_BF16_GEMM_GAPS[name]))
    return name


@bf16_followed
@pytest.mark.parametrize("name", [_gemm_param(n) for n in PRODUCTS])
@pytest.mark.quick_cases("plain", "addmm", "mv")
def test_each_bf16_gemm_path_matches_the_profiler_to_the_byte(name: str) -> None:
    # inference of one product: the parameter, the input, the output and the scratchpad (plus
    # any copy) are all the memory there is, so the estimate is exact; without the scratchpad
    # it was 50,816 to 288,512 B under
    def model() -> nn.Module:
        return Product(name)

    inputs = (torch.randn(*PRODUCTS[name][1]),)
    step = dict(mode="eval", optimizer="none", precision="bf16")
    estimate = memcalc.estimate(model, gpu="cpu", inputs=inputs, **step)
    measured = measure_cpu(build_step(model, inputs=inputs, **step)).peak_allocated
    assert estimate.peak_requested == measured


def test_another_onednn_isa_is_named_not_followed() -> None:
    def model() -> nn.Module:
        return Product("plain")

    resolved = resolve(model, inputs=(torch.randn(64, 512),))
    step = build_step(gpu="cpu", mode="eval", optimizer="none", precision="bf16")
    amx = dataclasses.replace(HERE, onednn=True, onednn_bf16=True, onednn_bf16_isa="avx512_core_amx")
    notes = trace_model(resolved, step, CpuBackend(step, amx)).notes
    assert (f"{NOT_FOLLOWED} aten.mm.default ×1 (bfloat16: oneDNN's matmul scratchpad is modelled for "
            f"{ONEDNN_BF16_MATMUL_ISA}, not avx512_core_amx)") in notes
    followed = dataclasses.replace(amx, onednn_bf16_isa=ONEDNN_BF16_MATMUL_ISA)
    notes = trace_model(resolved, step, CpuBackend(step, followed)).notes
    assert not any(note.startswith(NOT_FOLLOWED) for note in notes)
    assert any("aten.mm.default ×1" in note for note in notes)


# ---- the CPU flash backward's bf16 GEMMs ------------------------------------------------------

#: (B, H, query rows, keys, head size, causal, scale) of one flash backward call.
FLASH_CALLS = {
    "ring attention's": (2, 8, 128, 128, 64, True, None),
    "half the queries": (2, 8, 64, 128, 64, False, None),
    "a query tail, a key tail reached": (1, 2, 600, 600, 64, True, None),  # 64-row blocks, the last 24; keys 512 + 88
    "causal, short of the key tail": (1, 2, 200, 600, 64, True, None),  # the queries reach 200 keys of the first block
    "scale 1": (1, 2, 64, 64, 64, False, 1.0),  # no scale tensor
    "GEMMs of 16³ or less": (1, 2, 16, 16, 8, True, None),  # ATen's own GEMM
}


@pytest.mark.parametrize("onednn", [pytest.param(True, marks=bf16_followed), False], ids=["oneDNN", "ATen's GEMM"])
@pytest.mark.parametrize("call", list(FLASH_CALLS))
def test_flash_backward_gemm_scratch_is_what_the_profiler_records(call: str, onednn: bool) -> None:
    # the real bf16 backward's peak beyond its three gradients: the buffers and copy of
    # flash_backward_temporaries, and the most one of its bf16-writing GEMMs takes from oneDNN on
    # the calling thread (oneDNN off: torch's own GEMM, as on a CPU without AVX512-BF16, takes nothing)
    b, h, rows, keys, head, causal, scale = FLASH_CALLS[call]
    torch.manual_seed(0)
    q = torch.randn(b, rows, h, head, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, keys, h, head, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, 0.0, causal, scale=scale)[:2]
    grad = torch.randn_like(out)
    with torch.backends.mkldnn.flags(enabled=onednn):
        caps = CpuCapabilities.here()
        assert caps.onednn_bf16 == (onednn and HERE.onednn_bf16)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out, lse, 0.0, causal, scale=scale)
            del grads
    scratch = flash_backward_gemm_scratch(tuple(q.shape), keys, torch.bfloat16, caps, causal=causal, scale=scale)
    gradients = (q.numel() + k.numel() + v.numel()) * 2
    assert _profiler_peak(prof) == gradients + flash_backward_temporaries(grad, q, k, caps.threads) + scratch
    if not caps.onednn_bf16 or call == "GEMMs of 16³ or less":
        assert scratch == 0


def test_flash_backward_gemm_scratch_by_hand() -> None:
    # ring attention's call (B=2, H=8, 128 queries and keys, E=64) on 2 threads: one 32 × 128 block
    # pair. mkldnn_gemm hands oneDNN Cᵀ = Bᵀ·Aᵀ: grad_v += attnᵀ·dO is a 128 × 64 product over K = 32
    # with a transposed source (50,944 B, test_scratchpad_of_the_lm_heads_gemms_by_hand's formula);
    # grad_q += s·dA·k a plain 32 × 64 one over K = 128 (42,624 B) and the scale's 4 B; grad_k += s·dAᵀ·q
    # as grad_v's, with the scale: 50,948 B at most
    avx512 = CpuCapabilities(threads=2, onednn=True, onednn_bf16=True, onednn_fp16=True, flash_sdp=True,
                             onednn_bf16_isa=ONEDNN_BF16_MATMUL_ISA)
    assert onednn_bf16_matmul_scratchpad(128, 64, 32, threads=2, a_transposed=True) == 50_944
    assert onednn_bf16_matmul_scratchpad(32, 64, 128, threads=2) == 42_624
    assert flash_backward_gemm_scratch((2, 8, 128, 64), 128, torch.bfloat16, avx512) == 50_944 + 4
    # ATen's own GEMM (no AVX512-BF16), another oneDNN ISA (named by the rule instead), float32: nothing
    avx2 = dataclasses.replace(avx512, onednn_bf16=False, onednn_fp16=False, onednn_bf16_isa="")
    amx = dataclasses.replace(avx512, onednn_bf16_isa="avx512_core_amx")
    for caps, dtype in ((avx2, torch.bfloat16), (amx, torch.bfloat16), (avx512, torch.float32)):
        assert flash_backward_gemm_scratch((2, 8, 128, 64), 128, dtype, caps) == 0


class LearnedKeysAndValues(nn.Module):
    """Causal attention of the input over learned keys and values, (2, 8, 128, 64) each."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Parameter(torch.randn(2, 8, 128, 64))
        self.v = nn.Parameter(torch.randn(2, 8, 128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(x, self.k, self.v, is_causal=True)


@pytest.mark.parametrize("onednn", [pytest.param(True, marks=bf16_followed), False], ids=["oneDNN", "ATen's GEMM"])
def test_a_bf16_step_peaking_in_the_flash_backward_matches_the_profiler(onednn: bool) -> None:
    # bf16 training (sgd): the step peaks inside the flash backward, its gradients and buffers beside the
    # bf16 GEMMs' oneDNN scratch (ring attention's call: 50,948 B on 2 threads); the estimate was that much
    # under before the scratch was modelled, and named the op as not followed. oneDNN off: nothing to add
    step = dict(inputs=(torch.randn(2, 8, 128, 64),), optimizer="sgd", precision="bf16")
    with torch.backends.mkldnn.flags(enabled=onednn):
        estimate = memcalc.estimate(LearnedKeysAndValues, gpu="cpu", **step)  # type: ignore[arg-type]
        measured = measure_cpu(build_step(LearnedKeysAndValues, **step)).peak_allocated  # type: ignore[arg-type]
    assert estimate.peak_requested == measured
    assert not any(note.startswith(NOT_FOLLOWED) for note in estimate.notes)

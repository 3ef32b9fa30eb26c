"""Context parallelism (``cp``): each rank traces the step at S/cp tokens, ring attention's
buffers around every SDPA call, FSDP2 over dp_shard × cp (torchtitan's dp_shard_cp).

What runs for real: torch's own ``_templated_ring_attention`` and its backward, on the CPU with
the CPU flash op as the local attention and a fake process group (every rank of cp = 2 and 4,
float32 and bfloat16), against memcalc's ring formulas; the ``context_parallel`` context manager
itself, which shards the sequence and then fails on the CPU SDPA op (checked below, so that the
day torch adds the CPU op this test says so): whole gloo steps add it to torch's handlers
themselves (tests/test_gloo_cp.py). The rest is worked out by hand.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from support import bf16_followed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention as ring_source
from torch.testing._internal.distributed.fake_pg import FakeStore

import memcalc
import memcalc.distributed.strategies as strategies
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed import ring_attention as ring_module
from memcalc.distributed.ring_attention import (
    CUDA_RING,
    Layout,
    RingAttentionProgram,
    cpu_ring,
    ring_backward_bytes,
    ring_forward_bytes,
)
from memcalc.distributed.setting import Distributed
from memcalc.measure.step import _profiler_peak
from memcalc.targets.cpu.kernels import CpuCapabilities
from memcalc.targets.cpu.onednn import ONEDNN_BF16_MATMUL_ISA

aten = torch.ops.aten
MODEL = "torch:llama-tiny"  # hidden 512, 8 layers, 8 heads of 64 (K/V repeated to 8), vocab 32,000
#: The CPUs the by-hand sums are worked out for, on 2 threads: bf16 GEMMs in ATen's own code (no AVX512-BF16), and
#: through oneDNN's avx512_core_bf16 matmul.
AVX2 = CpuCapabilities(threads=2, onednn=True, onednn_bf16=False, onednn_fp16=False, flash_sdp=True)
AVX512_BF16 = replace(AVX2, onednn_bf16=True, onednn_fp16=True, onednn_bf16_isa=ONEDNN_BF16_MATMUL_ISA)


# ============================================================================================
# Torch's ring attention, run for real
# ============================================================================================


def _local(q, k, v, is_causal=False, **_kwargs):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)


def _local_backward(grad_out, query, key, value, out, logsumexp, is_causal=False, **_kwargs):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp,
                                                                      0.0, is_causal)


def _peak(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result
    return _profiler_peak(prof)


def test_torchs_context_parallel_shards_the_sequence_but_cannot_attend_on_the_cpu():
    # the real context manager over a fake 2-rank group: the buffers shrink to S/cp in place; the
    # CPU SDPA op then has no ring (custom_ops: the CUDA ops only), hence no gloo run of a cp step
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        q, k, v = (torch.randn(2, 8, 256, 64) for _ in range(3))
        with (pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"),
              context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])):
            assert q.shape == (2, 8, 128, 64)  # 256 tokens / cp=2
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        dist.destroy_process_group()
        undone = torch.nn.functional.scaled_dot_product_attention is sdpa
        torch.nn.functional.scaled_dot_product_attention = sdpa  # torch 2.11 leaves it patched after the error
    if torch.__version__ >= "2.13":  # torch undid its patch (2.11 does not, after an error inside the context)
        assert undone
    assert aten._scaled_dot_product_flash_attention.default in ring_source.custom_ops
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in ring_source.custom_ops
    # memcalc models torch's defaults
    assert ring_source._cp_options.rotate_method is ring_source._RotateMethod.ALL_GATHER
    assert ring_source._cp_options.convert_to_f32 and ring_source._cp_options.enable_load_balance


@pytest.mark.quick_cases("2-float32-model")
@pytest.mark.parametrize("layout", ["model", "contiguous", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=[bf16_followed])],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_match_torchs_ring_on_every_rank(cp, dtype, layout):
    # B=2, H=8, S/cp=128, D=64: the real ring's profiler peak minus one local call's, every rank;
    # "model": q, k, v and the output gradient laid out (B, S, H, D) underneath, as a transformers
    # model's projections make them (the ring's K/V .contiguous() and the gradients' flatten() copy)
    torch.manual_seed(0)
    if layout == "model":
        q, k, v = (torch.randn(2, 128, 8, 64, dtype=dtype).transpose(1, 2) for _ in range(3))
    elif layout == "expanded":  # one K/V head expanded to 8 (repeat_kv without its copy): zeros_like is contiguous
        q = torch.randn(2, 128, 8, 64, dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(2, 128, 1, 64, dtype=dtype).transpose(1, 2).expand(2, 8, 128, 64) for _ in range(2))
    else:
        q, k, v = (torch.randn(2, 8, 128, 64, dtype=dtype) for _ in range(3))
    out, lse = _local(q, k, v, is_causal=True)[:2]
    grad = torch.randn_like(out)  # out's layout, (B, S, H, D) underneath, as the model's backward gives it
    local_forward = _peak(lambda: _local(q, k, v, is_causal=True))
    local_backward = _peak(lambda: _local_backward(grad, q, k, v, out, lse, is_causal=True))
    target = replace(cpu_ring(CpuCapabilities.here()), gloo=False)  # a fake group stages nothing
    qkv = (Layout.of(q), Layout.of(k), Layout.of(v))
    for rank in range(cp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        try:
            group = dist.group.WORLD
            forward = _peak(lambda group=group: ring_source._templated_ring_attention(
                group, 2, _local, q, k, v, is_causal=True)) - local_forward
            backward = _peak(lambda group=group: ring_source._templated_ring_attention_backward(
                group, 2, _local_backward, grad, "grad_out", q, k, v, out, lse, is_causal=True)) - local_backward
        finally:
            dist.destroy_process_group()
        modelled = (ring_forward_bytes(*qkv, cp, rank=rank, target=target),
                    ring_backward_bytes(Layout.of(grad), *qkv, cp, rank=rank, target=target))
        # bfloat16: each accumulator += bf16 gradient's float32 copy, and the flash backward's GEMMs: nothing
        # from the allocator without oneDNN's bf16 (AVX2, 2026-12-07), oneDNN's scratch through its avx512_core_bf16
        # matmul (AVX512-BF16, 2026-12-07: 50,948 B a call, within 0.83 % before it was modelled); another ISA skips
        assert modelled == (forward, backward), rank


def test_ring_without_load_balancing_matches_torchs_on_every_rank():
    # 2 x cp does not divide the sequence: no half chunks; a rank skips the K/V of the ranks after it
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 16).transpose(1, 2) for _ in range(3))
    out, lse = _local(q, k, v, is_causal=True)[:2]
    grad = torch.randn_like(out)
    local_forward = _peak(lambda: _local(q, k, v, is_causal=True))
    local_backward = _peak(lambda: _local_backward(grad, q, k, v, out, lse, is_causal=True))
    target = replace(cpu_ring(CpuCapabilities.here()), gloo=False)
    qkv = (Layout.of(q), Layout.of(k), Layout.of(v))
    balance = ring_source._cp_options.enable_load_balance
    ring_source._cp_options.enable_load_balance = False
    try:
        for rank in range(4):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
            try:
                forward = _peak(lambda: ring_source._templated_ring_attention(
                    dist.group.WORLD, 2, _local, q, k, v, is_causal=True)) - local_forward
                backward = _peak(lambda: ring_source._templated_ring_attention_backward(
                    dist.group.WORLD, 2, _local_backward, grad, "grad_out", q, k, v, out, lse,
                    is_causal=True)) - local_backward
            finally:
                dist.destroy_process_group()
            assert ring_forward_bytes(*qkv, 4, rank=rank, load_balanced=False, target=target) == forward
            assert ring_backward_bytes(Layout.of(grad), *qkv, 4, rank=rank, load_balanced=False,
                                       target=target) == backward
    finally:
        ring_source._cp_options.enable_load_balance = balance


def test_ring_bytes_by_hand():
    # Nq = Nkv = 2·8·128·64 = 131,072 elements, fp32, cp = 2, rank 0 (load balanced), contiguous q, k, v,
    # the CUDA target (no per-call temporaries); in N = Nq·4 B and L = 2·8·128·4 B (a whole logsumexp)
    n = 131_072
    N, L = n * 4, 2 * 8 * 128 * 4
    contiguous = Layout.contiguous_of((2, 8, 128, 64), 4)
    # forward: step 0's K/V cat 2N and gathered 4N (6N; the cat let go), its output and logsumexp (5N + L);
    # step 1 (partial): the half call's (5.5N + 1.5L), the merge's temporaries, its two torch.cat wholes:
    # 7N + 2L at the output's, less one local call (N + L)
    assert ring_forward_bytes(contiguous, contiguous, contiguous, 2) == 6 * N + L == 3_153_920
    # backward: accumulators 3N; step 0: K/V cat 2N, gathered 4N, the call's three gradients 3N (12N), the
    # gradient ring's cat and receipt (16N); step 1 (partial): the half logsumexp made contiguous (L/2), the
    # call's gradients of q's second half, k and v: 18.5N + L/2 at its peak, less one local call (3N)
    assert ring_backward_bytes(contiguous, contiguous, contiguous, contiguous, 2) == 31 * N // 2 + L // 2 == 8_130_560
    # the CPU flash backward's temporaries at that peak: half the output gradient copied into
    # (B, L, H, E) (N/2), against the whole call's copy (N): N/2 less (buffers alike: 32-row q blocks)
    cpu = replace(cpu_ring(AVX2), gloo=False)
    assert ring_backward_bytes(contiguous, contiguous, contiguous, contiguous, 2, target=cpu) \
        == 8_130_560 - N // 2 == 7_868_416


def test_ring_backward_copies_each_bf16_gradient_to_float32_before_adding_it_on_the_cpu():
    # bf16 q, k, v laid out (B, S, H, D) underneath (a model's projections), B=2, H=8, S/cp=128, D=64, cp=2,
    # rank 0; in M = 2·8·128·64·2 B (one bf16 tensor), the float32 accumulators 2M each. On the CPU,
    # TensorIterator copies a bf16 operand to float32 before grad_x += grad_x_ (compute_types, common_device
    # kCPU), freed when the add returns. Step 0: accumulators 6M, K/V made contiguous 2M, the cat 2M and
    # gathered 4M, the call's gradients 3M (17M), grad_key's and grad_value's flatten copies 4M and their
    # cat 4M (25M, the copies let go: 21M), the gradient ring's receipt 4M (25M); then grad_query += grad_query_
    # copies grad_query_ (2M): 27M, the peak. Less one local call (its gradients 3M and the CPU flash kernel's
    # buffers: 32-row q blocks against 128 keys on 2 threads, 2·2·32·128·(4 + 2) + 32·4 = 98,432 B)
    m = 2 * 8 * 128 * 64 * 2
    q = Layout((2, 8, 128, 64), (65_536, 64, 512, 1), 2)
    call = 2 * 2 * 32 * 128 * (4 + 2) + 32 * 4
    assert call == 98_432
    cpu = replace(cpu_ring(AVX2), gloo=False)
    assert ring_backward_bytes(q, q, q, q, 2, target=cpu) == 27 * m - (3 * m + call) == 6_193_024
    # through oneDNN's bf16 matmul each call also holds its GEMMs' scratch, 50,948 B at most (test_cpu_bf16.py's
    # test_flash_backward_gemm_scratch_by_hand): one local call's more, the peak (outside any call) the same
    avx512 = replace(cpu_ring(AVX512_BF16), gloo=False)
    assert ring_backward_bytes(q, q, q, q, 2, target=avx512) == 6_193_024 - 50_948 == 6_142_076
    # measured on the CPU (the real ring: test_ring_bytes_match_torchs_ring_on_every_rank[2-bfloat16-model]);
    # without the copies the peak is step 1's half call, 158,720 B (2.6%) under, as before 2026-12-07
    assert ring_backward_bytes(q, q, q, q, 2, target=replace(cpu, promotes_inputs=False)) == 6_033_408
    # CUDA's kernels cast as they load: no copy; nor in float32, where the gradients are the accumulators' dtype
    assert not CUDA_RING.promotes_inputs
    fp32 = Layout((2, 8, 128, 64), (65_536, 64, 512, 1), 4)
    assert ring_backward_bytes(fp32, fp32, fp32, fp32, 2, target=cpu) \
        == ring_backward_bytes(fp32, fp32, fp32, fp32, 2, target=replace(cpu, promotes_inputs=False))


# ============================================================================================
# The rank's step
# ============================================================================================


def _estimate(seq_len: int, **mesh: int) -> memcalc.MemoryReport:
    return memcalc.estimate(MODEL, batch_size=2, seq_len=seq_len, distributed=Distributed(**mesh))


@pytest.mark.slow
def test_a_cp_rank_is_the_step_at_s_over_cp_with_the_ring_around_attention(monkeypatch):
    held: list[tuple[int, str]] = []
    workspace = RingAttentionProgram._workspace

    def spy(self, nbytes, label):
        held.append((nbytes, label))
        return workspace(self, nbytes, label)

    monkeypatch.setattr(RingAttentionProgram, "_workspace", spy)
    # the whole model traced, as the count below is per layer (depth extrapolation would trace 2, 3 and 4
    # layers and compose the 8: the same report, tests/test_depth_step.py's cp cases)
    monkeypatch.setattr(strategies, "traced_by_depth", lambda *args, **kwargs: None)
    cp = _estimate(256, cp=2)
    # every one of the 8 layers: forward 3,153,920 B and backward 8,130,560 B (test_ring_bytes_by_hand:
    # B=2, 8 heads (K/V repeated: contiguous; q's layout copies nothing), 128 tokens of 256, D=64, fp32; the
    # CUDA target: every local call taken to need the traced call's workspace)
    assert Counter(nbytes for nbytes, _ in held) == {3_153_920: 8, 8_130_560: 8}
    assert all("ring attention" in label for _, label in held)
    held.clear()
    # the same rank without the ring: FSDP2 over 2 ranks at 128 tokens; model states are the same, and
    # the saved activations and the peak (lm_head's backward, 2·128·32,000 logits) are those plus, on
    # cp rank 0, the copy the model makes of each layer's partially merged ring output (merged_output,
    # B·H·S/cp·D fp32; tests/test_gloo_cp.py measures it)
    half = _estimate(128, dp_shard=2)
    assert held == []
    (role,), (half_role,) = cp.roles, half.roles
    copies = 8 * 2 * 8 * 128 * 64 * 4
    assert role.model_states == half_role.model_states
    assert role.report.bytes.activations == half_role.report.bytes.activations + copies
    assert role.report.bytes.peak_allocated == half_role.report.bytes.peak_allocated + copies
    assert cp.global_batch_size == 2  # the cp ranks share their samples
    # with dp_shard=2: parameters sharded over dp_shard × cp = 4, as dp_shard=4 at 128 tokens
    both, four = _estimate(256, dp_shard=2, cp=2), _estimate(128, dp_shard=4)
    assert both.roles[0].model_states == four.roles[0].model_states < role.model_states
    assert both.global_batch_size == 4


def test_cp_refuses_what_it_cannot_shard():
    with pytest.raises(InvalidInputError, match="give its length"):
        memcalc.estimate("mlp", batch_size=2, distributed=Distributed(cp=2))
    with pytest.raises(InvalidInputError, match="does not divide the sequence of 255 tokens"):
        memcalc.estimate(MODEL, batch_size=2, seq_len=255, distributed=Distributed(cp=2))


def test_cli_mesh_cp(golden):
    result = CliRunner().invoke(main, [MODEL, "--mesh", "cp=2", "--batch", "2", "--seq-len", "256"])
    assert result.exit_code == 0, result.output
    assert "sequence /2 (cp)" in result.output
    golden(result.output)


def test_cli_mesh_cp_without_seq_len(golden):
    result = CliRunner().invoke(main, ["mlp", "--mesh", "cp=2"])
    assert result.exit_code == InvalidInputError.exit_code, result.output
    golden(result.output)  # cp=2 splits the sequence: give its length


@pytest.mark.slow
def test_non_causal_attention_under_load_balancing_is_refused_and_sdpa_restored(golden):
    # torch: "Load balancing requires `is_causal=True`." — BERT's attention is bidirectional, and
    # 2 x cp = 4 divides 128, so torch would balance the load and raise
    sdpa = torch.nn.functional.scaled_dot_product_attention
    result = CliRunner().invoke(main, ["bert-base", "--mesh", "cp=2", "--batch", "1", "--seq-len", "128"])
    assert result.exit_code == InapplicableOptionError.exit_code, result.output
    golden(result.output)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa  # the patch undone


# ============================================================================================
# cp with tp: torchtitan's order (parallelize_module over tp, the ring over cp, FSDP2 over dp_shard x cp)
# ============================================================================================


def test_tp_x_cp_by_hand_the_ring_over_each_tp_ranks_heads(monkeypatch):
    """No gloo run composes them yet (tests/gloo_cp.py runs cp with ep and dp_shard). What composes is
    checked by hand and against tp x dp_shard at S/cp, which real 4-process gloo runs check
    (tests/test_gloo_tp.py): a cp rank is that rank with the ring around its attention."""
    from gloo_tp import LLAMA_SEQ, SMALL_LLAMA, small_llama

    held: list[int] = []
    workspace = RingAttentionProgram._workspace

    def spy(self, nbytes, label):
        held.append(nbytes)
        return workspace(self, nbytes, label)

    monkeypatch.setattr(RingAttentionProgram, "_workspace", spy)
    options = dict(batch_size=4, optimizer="adam", loss="mean", gpu="cpu",
                   loop=memcalc.Loop(optimizer_impl="foreach"))
    both = memcalc.estimate(small_llama, seq_len=LLAMA_SEQ, distributed=Distributed(tp=2, cp=2), **options)
    # each tp rank's attention: 4 heads / 2 = 2 of D 32, its 1 KV head repeated to 2; 32 / 2 = 16 tokens
    # (cp), batch 4: Nq = Nkv = n = 4 · 2 · 16 · 32 elements, fp32, on cp rank 0 (the CPU target, 2 threads),
    # in N = n·4 B; K/V expanded (stride 0 over the heads), q (B, S, H, D) underneath; L = 4·2·16·4 B
    n = 4 * 2 * 16 * 32
    N, L = n * 4, 4 * 2 * 16 * 4
    # forward: K/V made contiguous 2N, step 0's cat 2N and gathered 4N, gloo's staging 4N at once: 12N, the
    # peak (step 1's merge reaches 7N + 2L); less one local call: its output N, logsumexp L and the CPU flash
    # kernel's buffers, 16-row blocks on 2 threads (2·(16·16 + 2·16 + 16·32)·4)
    forward = 12 * N - (N + L + 2 * (16 * 16 + 2 * 16 + 16 * 32) * 4)
    # backward: accumulators 3N, K/V made contiguous 2N, step 0's cat 2N, gathered 4N (staging 4N: 15N), the
    # call's gradients, the gradient ring's cat and receipt (18N); step 1 (partial): the half logsumexp copied
    # (L/2), the K/V copies let go (16N), the call's gradients of q's half, k, v (2.5N) and its temporaries:
    # half the output gradient copied (N/2) and 8-row blocks (2·2·8·16·4 + 8·4); less one whole call: 3N,
    # 2·2·16·16·4 + 16·4
    partial_call = N // 2 + 2 * 2 * 8 * 16 * 4 + 8 * 4
    backward = 37 * N // 2 + L // 2 + partial_call - (3 * N + 2 * 2 * 16 * 16 * 4 + 16 * 4)
    q = Layout.contiguous_of((4, 2, 16, 32), 4, order=(0, 2, 1, 3))
    kv = Layout((4, 2, 16, 32), (512, 0, 32, 1), 4)
    cpu = cpu_ring(AVX2)
    assert forward == ring_forward_bytes(q, kv, kv, 2, target=cpu) == 173_312
    assert backward == ring_backward_bytes(q, q, kv, kv, 2, target=cpu) == 260_320
    here = cpu_ring(CpuCapabilities.here())  # the trace's threads (2 on the machine these were worked out on)
    assert Counter(held) == {ring_forward_bytes(q, kv, kv, 2, target=here): SMALL_LLAMA.num_layers,
                             ring_backward_bytes(q, q, kv, kv, 2, target=here): SMALL_LLAMA.num_layers}
    (role,) = both.roles
    # torchtitan's Llama plan over tp (tests/test_mesh_3d.py's layer), then FSDP2 over the 2 cp ranks
    v, d = SMALL_LLAMA.vocab_size, SMALL_LLAMA.hidden_size
    kv, f = SMALL_LLAMA.num_kv_heads * SMALL_LLAMA.head_dim, SMALL_LLAMA.intermediate_size
    layer = (d * d + 2 * kv * d + d * d + 3 * d * f) // 2 + 2 * d
    assert role.report.textbook.parameter_bytes == 4 * (v * d // 2 + 2 * layer + d + v * d // 2) // 2 == 619_776
    assert role.ranks == (0, 1, 2, 3) and both.global_batch_size == 4  # the cp and tp ranks share samples
    assert [s.describe() for s in role.sharding] == [
        "params, grads, optimizer /2 (tp)", "params, grads, optimizer /2 (cp)", "sequence /2 (cp)"]
    # without the ring, the same rank is tp=2 x dp_shard=2 at 16 tokens (checked against real gloo runs)
    held.clear()
    half = memcalc.estimate(small_llama, seq_len=LLAMA_SEQ // 2, distributed=Distributed(tp=2, dp_shard=2),
                            **options)
    assert held == []
    (half_role,) = half.roles
    assert role.model_states == half_role.model_states
    # the ring's buffers and its merged output's layout (merged_output) left out, the step is that step,
    # to the byte
    monkeypatch.setattr(ring_module, "ring_forward_bytes", lambda *_args, **_kwargs: 0)
    monkeypatch.setattr(ring_module, "ring_backward_bytes", lambda *_args, **_kwargs: 0)
    monkeypatch.setattr(ring_module, "merged_output", lambda out: out)
    ringless = memcalc.estimate(small_llama, seq_len=LLAMA_SEQ, distributed=Distributed(tp=2, cp=2), **options)
    assert ringless.roles[0].report.peak_requested == half_role.report.peak_requested
    assert role.report.peak_requested > half_role.report.peak_requested
    monkeypatch.undo()
    # and dp_shard around both: FSDP2 over dp_shard x cp = 4 ranks
    three = memcalc.estimate(small_llama, seq_len=LLAMA_SEQ, distributed=Distributed(dp_shard=2, tp=2, cp=2),
                             **options)
    assert three.roles[0].report.textbook.parameter_bytes == 619_776 // 2
    assert three.roles[0].ranks == tuple(range(8)) and three.global_batch_size == 8

"""CUDA-faithful mechanisms, each with its arithmetic worked out by hand: attention backends
(what each saves for backward), activation checkpointing, gradient accumulation, the autocast
weight-cast cache, precisions, KV cache, and the GPU-dependent report fields."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memcalc
from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.precision import Precision
from memcalc.engine.trace import StorageTracer
from memcalc.fields import build_step
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import trace_step as trace_model
from memcalc.targets.cuda.emulation import CudaEmulation

MiB = 2**20


def _attention_saved_bytes(dtype, cc, *, b=2, h=4, length=128, d=64, causal=True):
    """Bytes born in one SDPA call and still alive afterwards (= saved for backward + output)."""
    tracer = StorageTracer("meta")
    emulation = CudaEmulation(Precision.FP32, cc)
    q, k, v = (torch.empty(b, h, length, d, dtype=dtype, device="meta", requires_grad=True) for _ in range(3))
    for t in (q, k, v):
        tracer.preexisting(t, Category.INPUTS)
    with tracer, emulation:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        alive = sum(tracer.trace.nbytes[u] for u in _alive(tracer.trace))
    backend = next(iter(emulation.attention_backends))
    del out
    return backend, alive


def _alive(trace):
    alive = set()
    for e in trace.events:
        alive.add(e) if e >= 0 else alive.discard(~e)
    return alive


def test_flash_saves_output_logsumexp_and_rng_state():
    # bf16 on sm80 (A100), torch 2.11: flash. Saved: output B·H·L·D·2 = 2·4·128·64·2 = 131,072 B;
    # logsumexp B·H·L fp32 = 2·4·128·4 = 4,096 B; philox seed (2 × uint64) 16 B and offset 8 B;
    # debug mask (0 elements) 0 B.  Total 135,192 B — no L×L matrix.
    backend, saved = _attention_saved_bytes(torch.bfloat16, (8, 0))
    assert backend == "flash"
    assert saved == 131_072 + 4_096 + 16 + 8


def test_efficient_saves_padded_logsumexp():
    # fp32 on sm80: flash takes no fp32 → memory-efficient. Output 2·4·128·64·4 = 262,144 B;
    # logsumexp padded to a multiple of 32 in L: 2·4·128·4 = 4,096 B; seed and offset int64 16 B.
    backend, saved = _attention_saved_bytes(torch.float32, (8, 0))
    assert backend == "efficient"
    assert saved == 262_144 + 4_096 + 16


def test_cudnn_first_on_hopper_with_torch_2_11():
    # torch 2.11 bundles cuDNN 9.19 (> 9.15): cuDNN attention is tried first on sm90.
    backend, saved = _attention_saved_bytes(torch.bfloat16, (9, 0))
    assert backend == "cudnn"
    assert saved < 2 * 4 * 128 * 128 * 2  # far less than one L×L attention matrix


def test_math_fallback_keeps_the_attention_matrix():
    # bf16 on sm75 (T4): no fused kernel takes bf16 there → math, which keeps softmax(QKᵀ):
    # at least B·H·L·L·2 = 2·4·128·128·2 = 262,144 B.
    backend, saved = _attention_saved_bytes(torch.bfloat16, (7, 5))
    assert backend == "math"
    assert saved >= 2 * 4 * 128 * 128 * 2


class AttentionOnly(nn.Module):
    def __init__(self, d=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _activations(seq_len, precision, gpu):
    traced = trace_model(resolve(AttentionOnly(), batch_size=2, input_shape=(seq_len, 256)),
                         build_step(optimizer="sgd", precision=precision, gpu=gpu, loss="mean"))
    start = traced.trace.phase_starts[Phase.BACKWARD]
    alive = set()
    for e in traced.trace.events[:start]:
        alive.add(e) if e >= 0 else alive.discard(~e)
    return sum(traced.trace.nbytes[u] for u in alive if traced.categories[u] is Category.ACTIVATIONS)


def test_flash_attention_memory_is_linear_in_sequence_length():
    # Doubling L doubles what flash keeps (everything is O(L)); math would quadruple the L×L part.
    a1 = _activations(1024, "amp-bf16", "a100-80gb")
    a2 = _activations(2048, "amp-bf16", "a100-80gb")
    assert a2 / a1 == pytest.approx(2.0, rel=0.02)
    m1 = _activations(1024, "amp-bf16", "t4")  # T4: no bf16 fused kernel → math
    m2 = _activations(2048, "amp-bf16", "t4")
    assert m2 / m1 > 3.0


class CheckpointedMLP(nn.Module):
    """Two 1024-wide blocks; the first under torch.utils.checkpoint (as a user writes it)."""

    def __init__(self, use_checkpoint: bool):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.block1 = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU())
        self.head = nn.Linear(1024, 10)

    def forward(self, x):
        h = checkpoint(self.block1, x, use_reentrant=False) if self.use_checkpoint else self.block1(x)
        return self.head(h)


def test_user_checkpoint_drops_the_block_activations_and_recomputes():
    # Without checkpointing block1 keeps, per sample of 1024 floats (4,096 B): Linear1 out (GELU
    # input), GELU1 out (Linear2 input), Linear2 out (GELU2 input), GELU2 out (head input)
    # = 4 × 4,096 B. With it, only the block output that the head saves stays (its input x is
    # an input): 1 × 4,096 B. Batch 64 → 1,048,576 B vs 262,144 B.
    plain = trace_model(resolve(CheckpointedMLP(False), batch_size=64, input_shape=(1024,)),
                        build_step(optimizer="sgd", gpu="cpu"))
    ckpt = trace_model(resolve(CheckpointedMLP(True), batch_size=64, input_shape=(1024,)),
                       build_step(optimizer="sgd", gpu="cpu"))

    def kept(traced):
        start = traced.trace.phase_starts[Phase.LOSS]
        alive = set()
        for e in traced.trace.events[:start]:
            alive.add(e) if e >= 0 else alive.discard(~e)
        return sum(traced.trace.nbytes[u] for u in alive if traced.categories[u] is Category.ACTIVATIONS)

    assert kept(plain) == 4 * 64 * 4096 + 64 * 10 * 4  # + the logits (64·10·4 = 2,560 B)
    # + the CPU generator state the checkpoint saves (preserve_rng_state: 5,056 B), which the CPU
    # target counts (memcalc.targets.cpu.generator)
    assert kept(ckpt) == 1 * 64 * 4096 + 64 * 10 * 4 + torch.get_rng_state().numel()
    # the recomputation runs block1's two matmuls again during backward
    assert ckpt.trace.op_counts["addmm.default"] == plain.trace.op_counts["addmm.default"] + 2


def test_checkpoint_flag_on_zoo_blocks_lowers_the_peak():
    plain = memcalc.estimate("gpt2", batch_size=4, seq_len=256, precision="amp-bf16", gpu="a100-80gb")
    ckpt = memcalc.estimate("gpt2", batch_size=4, seq_len=256, precision="amp-bf16", gpu="a100-80gb",
                            checkpoint=True)
    assert ckpt.checkpoint and ckpt.bytes.peak_allocated < plain.bytes.peak_allocated
    assert dict(ckpt.attention_calls)["flash"] == 2 * 12  # forward + recomputation, 12 layers


def test_checkpoint_flag_needs_blocks():
    with pytest.raises(memcalc.InvalidInputError, match="no repeated blocks"):
        memcalc.estimate("mlp", batch_size=2, checkpoint=True)


def test_gradient_accumulation_keeps_gradients_across_micro_batches():
    # accum 2: the second micro-batch's forward runs while the first's gradients exist, so the
    # gradients (= parameter bytes, fp32) are alive with the activations; gradients are
    # accumulated in place — one gradient storage per parameter, not one per micro-batch.
    one = trace_model(resolve("mlp", batch_size=64), build_step(optimizer="sgd", gpu="cpu"))
    two = trace_model(resolve("mlp", batch_size=64), build_step(optimizer="sgd", accum_steps=2, gpu="cpu"))
    n_grads = sum(1 for c in two.categories if c is Category.GRADIENTS)
    assert n_grads == sum(1 for c in one.categories if c is Category.GRADIENTS) == 6  # 3 weights + 3 biases
    r = memcalc.estimate("mlp", batch_size=64, optimizer="sgd", accum_steps=2, gpu="cpu")
    assert r.accum_steps == 2
    assert r.peak_requested >= 2 * 1_863_690 * 4  # weights + gradients together


class TwiceLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(512, 512, bias=False)

    def forward(self, x):
        return self.fc(self.fc(x))  # the same weight used twice in one forward


def test_autocast_weight_cast_cache_casts_once_per_forward():
    # amp-fp16: the weight (512·512·4 = 1 MiB fp32) is cast to fp16 (512 KiB) once and the copy
    # is reused by the second call: one weight-sized fp16 storage is born in the forward.
    traced = trace_model(resolve(TwiceLinear(), batch_size=8, input_shape=(512,)),
                         build_step(optimizer="sgd", precision="amp-fp16"))
    casts = [traced.trace.nbytes[u] for u in range(traced.trace.num_storages)
             if traced.trace.phase[u] is Phase.FORWARD and traced.trace.nbytes[u] == 512 * 512 * 2]
    assert len(casts) == 1


def test_amp_keeps_fp32_master_weights_and_state_and_halves_activations():
    fp32 = memcalc.estimate("gpt2", batch_size=4, seq_len=256, gpu="a100-80gb", optimizer="adamw")
    amp = memcalc.estimate("gpt2", batch_size=4, seq_len=256, gpu="a100-80gb", optimizer="adamw",
                           precision="amp-bf16")
    assert amp.bytes.parameters == fp32.bytes.parameters == 124_439_808 * 4
    assert amp.textbook.activation_bytes < fp32.textbook.activation_bytes
    state = trace_model(resolve("gpt2", batch_size=1, seq_len=32), build_step(optimizer="adamw", precision="amp-bf16"))
    state_bytes = sum(state.trace.nbytes[u] for u, c in enumerate(state.categories) if c is Category.OPTIMIZER_STATE)
    assert state_bytes == 2 * 124_439_808 * 4  # two fp32 moments


def test_amp_fp16_runs_the_grad_scaler():
    traced = trace_model(resolve("mlp", batch_size=4), build_step(optimizer="adam", precision="amp-fp16"))
    assert traced.trace.op_counts["_amp_foreach_non_finite_check_and_unscale_.default"] >= 1
    assert traced.trace.op_counts["_amp_update_scale_.default"] == 1
    bf16 = trace_model(resolve("mlp", batch_size=4), build_step(optimizer="adam", precision="amp-bf16"))
    assert bf16.trace.op_counts["_amp_update_scale_.default"] == 0  # bf16 needs no scaler


def test_pure_fp16_halves_weights_and_state():
    r = memcalc.estimate("mlp", batch_size=4, optimizer="adam", precision="fp16")
    assert r.bytes.parameters == 1_863_690 * 2
    traced = trace_model(resolve("mlp", batch_size=4), build_step(optimizer="adam", precision="fp16"))
    state = sum(traced.trace.nbytes[u] for u, c in enumerate(traced.categories) if c is Category.OPTIMIZER_STATE)
    assert state == 2 * 1_863_690 * 2


def test_kv_cache_arithmetic():
    # llama-tiny: 8 layers, 2 KV heads of 64 → per token 2 (K, V) · 8 · 2 · 64 = 2,048 elements;
    # batch 2, prompt 128 + 64 generated = 192 tokens, bf16: 2,048 · 2 · 192 · 2 = 1,572,864 B.
    r = memcalc.estimate("llama-tiny", batch_size=2, seq_len=128, mode="inference", kv_cache=64, precision="bf16")
    assert r.bytes.kv_cache == 2 * 8 * 2 * 64 * 2 * 192 * 2 == 1_572_864
    assert r.mode is Mode.INFERENCE and r.bytes.gradients == 0


def test_kv_cache_needs_inference_and_a_decoder():
    with pytest.raises(memcalc.InvalidInputError):
        memcalc.estimate("llama-tiny", batch_size=1, seq_len=16, kv_cache=8)  # train mode
    with pytest.raises(memcalc.InvalidInputError):
        memcalc.estimate("mlp", batch_size=1, mode="inference", kv_cache=8)


def test_cublas_workspaces_per_gpu():
    # H100 (sm90): 32 MiB per handle; elsewhere 8,519,680 B; training: forward + backward handle.
    h100 = memcalc.estimate("mlp", batch_size=4, gpu="h100-80gb", optimizer="sgd")
    assert "2 × 33,554,432 B" in " ".join(h100.notes)
    a100 = memcalc.estimate("mlp", batch_size=4, gpu="a100-80gb", mode="eval")  # eval: no optimizer
    assert "1 × 8,519,680 B" in " ".join(a100.notes)


def test_cublas_workspace_config_is_honoured(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # 16 KiB × 8 = 131,072 B
    r = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none")
    assert r.bytes.workspace == 131_072


def test_gpu_report_fields_and_fit():
    r = memcalc.estimate("resnet18", batch_size=8, input_shape=(3, 64, 64), gpu="t4")
    d = r.to_dict()
    assert d["gpu"] == "t4" and d["fits"] is True
    assert d["bytes"]["cuda_context"] == r.gpu.cuda_context > 0
    assert d["bytes"]["peak_reserved"] >= d["bytes"]["peak_allocated"]
    assert r.device_total == r.peak_reserved + r.cuda_context
    huge = memcalc.estimate("gpt2-xl", batch_size=8, seq_len=1024, gpu="t4")
    assert huge.fits is False and huge.headroom < 0


def test_bf16_on_v100_warns():
    with pytest.warns(UserWarning, match="no native bf16"):
        r = memcalc.estimate("mlp", batch_size=2, precision="bf16", gpu="v100-16gb")
    assert any("bf16" in n for n in r.notes)


def test_unknown_gpu_suggests_names():
    from memcalc.targets.cuda.gpus.catalogue import UnknownGpuError

    with pytest.raises(UnknownGpuError) as info:
        memcalc.estimate("mlp", batch_size=2, gpu="h1000")
    assert info.value.exit_code == 2


def test_dropout_keeps_a_one_byte_mask_on_cuda():
    # CUDA's fused dropout saves a bool mask (1 B/element); meta/CPU keep a float noise tensor.
    model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.1), nn.Linear(256, 10))
    cuda = trace_model(resolve(model, batch_size=64, input_shape=(256,)), build_step(optimizer="sgd"))
    cpu = trace_model(resolve(model, batch_size=64, input_shape=(256,)), build_step(optimizer="sgd", gpu="cpu"))
    assert cuda.trace.op_counts["native_dropout.default"] == 1
    masks = [n for u, n in enumerate(cuda.trace.nbytes) if cuda.trace.phase[u] is Phase.FORWARD and n == 64 * 256]
    assert masks  # a 64·256·1-byte mask
    assert cpu.trace.op_counts["native_dropout.default"] == 0


def test_nested_composites_are_seen_inside_multihead_attention():
    # nn.MultiheadAttention runs F.multi_head_attention_forward, a Python composite; the linear
    # projections inside it must be autocast too: their outputs are fp16.
    mha = nn.MultiheadAttention(64, 4, batch_first=True)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    traced = trace_model(resolve(Wrap(), batch_size=2, input_shape=(16, 64)),
                         build_step(optimizer="sgd", precision="amp-fp16", loss="mean"))
    # the in-projection weight (192·64) is cast to fp16 once: 24,576 B
    assert any(n == 192 * 64 * 2 for u, n in enumerate(traced.trace.nbytes) if traced.trace.phase[u] is Phase.FORWARD)
    assert math.isfinite(traced.trace.nbytes[0])


class UserCheckpointedBlocks(nn.Module):
    """A user's model calling torch.utils.checkpoint itself (non-reentrant)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


@pytest.mark.parametrize("precision", ["amp-fp16", "amp-bf16"])
def test_user_checkpoint_recomputes_under_autocast(precision):
    # checkpoint re-enters autocast for the recomputation: the recomputed Linear runs in 16-bit
    # again (its weight cast again), so the saved tensors match and no CheckpointError is raised.
    traced = trace_model(resolve(UserCheckpointedBlocks(), batch_size=8, input_shape=(256,)),
                         build_step(optimizer="sgd", precision=precision))
    weight_casts = [u for u, n in enumerate(traced.trace.nbytes) if n == 256 * 256 * 2]
    forward_casts = [u for u in weight_casts if traced.trace.phase[u] is Phase.FORWARD]
    backward_casts = [u for u in weight_casts if traced.trace.phase[u] is Phase.BACKWARD]
    assert len(forward_casts) == 3 and len(backward_casts) >= 3  # each block's weight, again in recompute


def test_peak_location_after_checkpointed_backward_is_not_stale():
    r = memcalc.estimate("llama-tiny", batch_size=1, seq_len=32, optimizer="adamw", checkpoint=True,
                         precision="amp-bf16")
    if r.peak_phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD):
        assert r.peak_module == ""

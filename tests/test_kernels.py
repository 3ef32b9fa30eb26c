"""CUDA kernel facts (memcalc.targets.cuda.sdpa, .attention_memory, .autocast, .cublas, .cudnn): backend
choice, fused-kernel scratch, autocast lists, cuBLAS workspace counts, the cuDNN convolution
workspace model.

Expected values are worked out by hand from the PyTorch sources the module cites; the
arithmetic is in the comments. The autocast lists are also checked against the dispatcher of
the installed torch (its AutocastCUDA registrations exist in CPU builds too).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memcalc.targets import autocast, versions
from memcalc.targets.cuda import attention_memory, cublas, cudnn, sdpa, workspaces
from memcalc.targets.cuda.attention_memory import Buffer
from memcalc.targets.cuda.gpus.catalogue import get_gpu
from memcalc.targets.cuda.sdpa import AttentionBackend as B
from memcalc.targets.cuda.sdpa import SdpaCall

H100 = (9, 0)
A100 = (8, 0)
A10 = (8, 6)
#: multiProcessorCount, as the catalogue's records give it (h100-80gb, a10g): the fused kernels read it
H100_SMS = get_gpu("h100-80gb").sm_count
A10G_SMS = get_gpu("a10g").sm_count
V100 = (7, 0)
T4 = (7, 5)
B200 = (10, 0)
GB300 = (10, 3)
RTX5090 = (12, 0)

MiB = 1024**2


def call(**changes: object) -> SdpaCall:
    """A GPT-style training call: B=2, H=16, L=2048, D=64, fp16, causal, needs grad."""
    base = SdpaCall(batch=2, heads_q=16, heads_kv=16, seq_q=2048, seq_kv=2048, head_dim=64, head_dim_v=64,
                    dtype=torch.float16, has_mask=False, dropout_p=0.0, is_causal=True, requires_grad=True)
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------------------------------------
# 1. backend choice
# ------------------------------------------------------------------------------------------
class TestBackendChoice:
    def test_fp16_causal_on_sm90_is_cudnn_in_2_11(self) -> None:
        # torch 2.11 bundles cuDNN 9.19 > 9.15.0 and sm90 is preferred → cuDNN is tried first
        assert sdpa.choose_sdpa_backend(call(), H100) is B.CUDNN

    def test_fp16_causal_on_sm90_is_flash_before_cudnn_is_preferred(self) -> None:
        assert sdpa.choose_sdpa_backend(call(), H100, torch_version="2.10") is B.FLASH
        # the threshold is "cudnn_version > 91500": 9.15.0 itself is not enough
        assert sdpa.choose_sdpa_backend(call(), H100, cudnn_version=91500) is B.FLASH
        assert sdpa.choose_sdpa_backend(call(), H100, cudnn_version=91501) is B.CUDNN

    def test_fp16_causal_on_sm80_is_flash(self) -> None:
        assert sdpa.choose_sdpa_backend(call(), A100) is B.FLASH

    @pytest.mark.parametrize("cc", [H100, A100, V100])
    def test_fp32_runs_mem_efficient(self, cc: tuple[int, int]) -> None:
        assert sdpa.choose_sdpa_backend(call(dtype=torch.float32), cc) is B.EFFICIENT

    def test_fp16_on_v100_is_mem_efficient(self) -> None:
        # flash and cuDNN need sm80; mem-efficient alignment on sm70 half is 8 and 64 % 8 == 0
        assert sdpa.choose_sdpa_backend(call(), V100) is B.EFFICIENT

    def test_bf16_on_t4_falls_back_to_math(self) -> None:
        # below sm80 mem-efficient takes {fp16, fp32} only; flash/cuDNN need sm80
        assert sdpa.choose_sdpa_backend(call(dtype=torch.bfloat16), T4) is B.MATH

    def test_float_mask(self) -> None:
        masked = call(has_mask=True, is_causal=False)
        assert sdpa.choose_sdpa_backend(masked, A100) is B.EFFICIENT  # flash takes no mask
        assert sdpa.choose_sdpa_backend(masked, H100) is B.CUDNN  # cuDNN takes an attn_bias
        grad_mask = dataclasses.replace(masked, mask_requires_grad=True)
        assert sdpa.choose_sdpa_backend(grad_mask, H100) is B.EFFICIENT  # check_attn_mask_shape

    def test_head_dim_limits(self) -> None:
        big = call(head_dim=512, head_dim_v=512)
        assert sdpa.choose_sdpa_backend(big, H100) is B.EFFICIENT  # flash ≤ 256, cuDNN ≤ 256
        d256 = call(head_dim=256, head_dim_v=256)
        assert sdpa.choose_sdpa_backend(d256, H100) is B.CUDNN  # sm90 + cuDNN ≥ 9.10 → limit 256
        assert sdpa.choose_sdpa_backend(d256, B200) is B.FLASH  # sm100: cuDNN limit 128

    def test_head_dim_not_multiple_of_8(self) -> None:
        # flash pads to a multiple of 8 instead of refusing; mem-efficient on sm70 refuses
        assert sdpa.choose_sdpa_backend(call(head_dim=60, head_dim_v=60), H100) is B.FLASH
        assert sdpa.choose_sdpa_backend(call(head_dim=60, head_dim_v=60), V100) is B.MATH

    def test_training_head_dim_200_on_sm86(self) -> None:
        # flash backward can't do head_dim in (192, 224] on sm86/89/120
        assert sdpa.choose_sdpa_backend(call(head_dim=200, head_dim_v=200), A10) is B.EFFICIENT
        inference = call(head_dim=200, head_dim_v=200, requires_grad=False)
        assert sdpa.choose_sdpa_backend(inference, A10) is B.FLASH

    def test_causal_non_square(self) -> None:
        assert sdpa.choose_sdpa_backend(call(seq_q=128), A100) is B.EFFICIENT

    def test_dropout(self) -> None:
        assert sdpa.choose_sdpa_backend(call(dropout_p=0.1), A100) is B.FLASH
        assert sdpa.choose_sdpa_backend(call(dropout_p=0.1), H100) is B.CUDNN
        # cuDNN 9.11–9.13 cannot do dropout → the next in line, flash
        assert sdpa.choose_sdpa_backend(call(dropout_p=0.1), H100, cudnn_version=91300) is B.FLASH

    def test_grouped_query_attention(self) -> None:
        gqa = call(heads_q=32, heads_kv=8, enable_gqa=True)
        assert sdpa.choose_sdpa_backend(gqa, A100) is B.FLASH
        assert sdpa.choose_sdpa_backend(gqa, H100) is B.CUDNN
        # 2.11's mem-efficient has no GQA: fp32 GQA goes to math
        assert sdpa.choose_sdpa_backend(dataclasses.replace(gqa, dtype=torch.float32), A100) is B.MATH
        # different head counts without enable_gqa: no fused backend
        assert sdpa.choose_sdpa_backend(dataclasses.replace(gqa, enable_gqa=False), A100) is B.MATH

    def test_strided_last_dim_goes_to_math(self) -> None:
        assert sdpa.choose_sdpa_backend(call(query_contiguous_last_dim=False), A100) is B.MATH

    @pytest.mark.parametrize(("cc", "preferred"), [(H100, True), (B200, True), (GB300, True),
                                                   ((10, 1), False), (A100, False), (RTX5090, False)])
    def test_cudnn_preference_by_arch_in_2_11(self, cc: tuple[int, int], preferred: bool) -> None:
        assert sdpa.prefers_cudnn_attention(cc) is preferred

    def test_cudnn_preference_by_version(self) -> None:
        assert not sdpa.prefers_cudnn_attention(H100, "2.8")
        assert not sdpa.prefers_cudnn_attention(H100, "2.9")  # wheels built with cuDNN 9.8 headers
        assert sdpa.prefers_cudnn_attention(H100, "2.9", cudnn_version=90900)
        assert not sdpa.prefers_cudnn_attention(H100, "2.10")  # bundled 9.10.2
        assert sdpa.prefers_cudnn_attention((10, 1), "2.12")  # CUDA 13 builds: any 10.x

    def test_default_order_puts_cudnn_after_math(self) -> None:
        assert sdpa.sdpa_priority_order(A100) == (B.FLASH, B.EFFICIENT, B.MATH, B.CUDNN)
        assert sdpa.sdpa_priority_order(H100)[0] is B.CUDNN

    def test_explanation_names_the_refusals(self) -> None:
        reasons = sdpa.explain_sdpa_choice(call(dtype=torch.bfloat16), T4)
        assert reasons[B.MATH] == ()
        assert reasons[B.FLASH] and reasons[B.EFFICIENT] and reasons[B.CUDNN]


# ------------------------------------------------------------------------------------------
# 2. fused-kernel memory
# ------------------------------------------------------------------------------------------
def total(buffers: list[Buffer]) -> int:
    return sum(b.nbytes for b in buffers)


class TestFlashTemporaries:
    def test_backward_worked_example(self) -> None:
        # B=2, H=16, L=2048, D=64, fp16 (mha_bwd):
        #   softmax_d (B, H, round128(L)) fp32   = 2·16·2048·4     =    262,144 B (256 KiB)
        #   dq_accum  (B, round128(L), H, 64) fp32 = 2·2048·16·64·4 = 16,777,216 B (16 MiB)
        #   head_size_rounded = round(64, 32) = 64; no GQA → no dk/dv_expanded
        buffers = attention_memory.backward_temporaries(call(), B.FLASH, H100, sm_count=H100_SMS)
        assert [(b.name, b.shape, b.dtype) for b in buffers] == [
            ("flash_softmax_d", (2, 16, 2048), torch.float32),
            ("flash_dq_accum", (2, 2048, 16, 64), torch.float32),
        ]
        assert total(buffers) == 262_144 + 16_777_216 == 17_039_360

    def test_backward_rounding(self) -> None:
        # L=1000 → seqlen_q_rounded 1024; D=80 → head_size 80, rounded to 32 → 96;
        # D=160 → 160 rounded to 64 → 192 (head_size > 128 rounds to 64)
        buffers = attention_memory.backward_temporaries(call(seq_q=1000, seq_kv=1000, head_dim=80, head_dim_v=80),
                                                        B.FLASH, H100,
                                                        sm_count=H100_SMS)
        assert buffers[0].shape == (2, 16, 1024)
        assert buffers[1].shape == (2, 1024, 16, 96)
        wide = attention_memory.backward_temporaries(call(head_dim=160, head_dim_v=160), B.FLASH, H100,
                                                     sm_count=H100_SMS)
        assert wide[1].shape == (2, 2048, 16, 192)

    def test_backward_gqa_expands_dk_dv(self) -> None:
        # heads_q=32, heads_kv=8: dk/dv computed per query head, (B, Lk, 32, 64) fp16 each
        buffers = attention_memory.backward_temporaries(call(heads_q=32, heads_kv=8, enable_gqa=True), B.FLASH, H100,
                                                        sm_count=H100_SMS)
        expanded = [b for b in buffers if "expanded" in b.name]
        assert [b.shape for b in expanded] == [(2, 2048, 32, 64)] * 2
        assert all(b.dtype == torch.float16 and b.nbytes == 2 * 2048 * 32 * 64 * 2 for b in expanded)

    def test_backward_grad_out_copy_and_determinism(self) -> None:
        buffers = attention_memory.backward_temporaries(call(), B.FLASH, H100, grad_out_needs_copy=True,
                                               deterministic=True, sm_count=132)
        assert buffers[0].shape == (2, 2048, 16, 64) and buffers[0].dtype == torch.float16
        # deterministic: nsplits = ceil(132 / (2·16)) = 5 copies of dq_accum
        assert buffers[-1].shape == (5, 2, 2048, 16, 64)

    def test_forward_training_shape_needs_no_split(self) -> None:
        # batch·heads·ceil(L/64) = 2·16·32 = 1024 ≥ 0.8·(2·132) → 1 split → no accumulators
        assert attention_memory.flash_num_splits(call(), H100, sm_count=132) == 1
        assert attention_memory.forward_temporaries(call(), B.FLASH, H100, sm_count=132) == []

    def test_forward_small_batch_splits_kv(self) -> None:
        # B=1, H=8, L=512, D=64 on 132 SMs: 1·8·ceil(512/64) = 64 < 211.2; block_n 256 →
        # 2 key blocks → max 2 splits; efficiency 64/264 = 0.24 (1 split), 128/264 = 0.48
        # (2 splits) → 2 splits. lse_accum (2,1,8,512) fp32 = 32 KiB, out_accum ×64 = 2 MiB.
        small = call(batch=1, heads_q=8, heads_kv=8, seq_q=512, seq_kv=512)
        buffers = attention_memory.forward_temporaries(small, B.FLASH, H100, sm_count=132)
        assert [b.shape for b in buffers] == [(2, 1, 8, 512), (2, 1, 8, 512, 64)]
        assert total(buffers) == 32 * 1024 + 2 * MiB
        # dropout turns split-KV off
        assert attention_memory.forward_temporaries(dataclasses.replace(small, dropout_p=0.1), B.FLASH, H100,
                                                    sm_count=H100_SMS) == []


class TestMemEfficientTemporaries:
    def test_backward_fp16_d64(self) -> None:
        # sm80+ fp16 D=64 → kernel 64x64 (kMaxK 64 ≤ kBlockSizeI 64: dK/dV stay in registers)
        #   delta (B, H, M) fp32 = 2·16·2048·4 = 262,144 B
        #   gQ per (b, h) = ceil(2048/64)·ceil(64/64)·(4 + 64·64) = 32·4100 = 131,200 floats
        #   workspace = 2·16·131,200·4 = 16,793,600 B
        buffers = attention_memory.backward_temporaries(call(), B.EFFICIENT, H100, sm_count=H100_SMS)
        assert [(b.name, b.nbytes) for b in buffers] == [("mem_eff_delta", 262_144),
                                                          ("mem_eff_workspace", 16_793_600)]

    def test_backward_fp16_d128_depends_on_shared_memory(self) -> None:
        d128 = call(head_dim=128, head_dim_v=128)
        # H100: 128x128 k128 fits → registers; gQ = 16·1·(4 + 16384) = 262,208 floats
        #   → 2·16·262,208·4 = 33,562,624 B
        h100 = attention_memory.backward_temporaries(d128, B.EFFICIENT, H100, sm_count=H100_SMS)
        assert h100[-1].nbytes == 33_562_624
        # A10 (~99 KB smem): 64x64 k128, dK/dV staged in gmem. splits = min(ceil(2048/64)=32,
        # 200 // 32 = 6) = 6; gK = gV = 6·64·128 = 49,152; gQ = 32·2·4100 = 262,400
        #   → (49,152·2 + 262,400)·4·32 = 46,170,112 B
        a10 = attention_memory.backward_temporaries(d128, B.EFFICIENT, A10, sm_count=A10G_SMS)
        assert a10[-1].nbytes == 46_170_112

    def test_backward_fp32_delta_is_computed_on_the_host(self) -> None:
        # fp32: (grad_out·out).sum(-1).transpose(-2,-1).contiguous() — product (B,M,H,Kv) and
        # sum (B,M,H) are statement temporaries alive with delta; then the workspace.
        buffers = attention_memory.backward_temporaries(call(dtype=torch.float32), B.EFFICIENT, H100, sm_count=H100_SMS)
        assert [b.name for b in buffers] == ["mem_eff_delta_product", "mem_eff_delta_sum",
                                             "mem_eff_delta", "mem_eff_workspace"]
        # peak = 16,777,216 + 262,144 + 262,144 (statement) vs 262,144 + 16,793,600 (kernel)
        assert attention_memory.peak_bytes(buffers) == 17_301_504

    def test_forward_accumulator_only_for_large_half_head_dims(self) -> None:
        assert attention_memory.forward_temporaries(call(head_dim=128, head_dim_v=128), B.EFFICIENT, H100,
                                                    sm_count=H100_SMS) == []
        big = attention_memory.forward_temporaries(call(head_dim=256, head_dim_v=256), B.EFFICIENT, H100,
                                                   sm_count=H100_SMS)
        assert [(b.shape, b.dtype) for b in big] == [((2, 2048, 16, 256), torch.float32)]
        fp32 = call(dtype=torch.float32, head_dim=256, head_dim_v=256)
        assert attention_memory.forward_temporaries(fp32, B.EFFICIENT, H100, sm_count=H100_SMS) == []


class TestCudnnTemporaries:
    def test_backward_workspace(self) -> None:
        # dQ_accum b·h·s_q·d·4 = 2·16·2048·64·4 = 16,777,216; softmax_sum b·h·s_q·4 = 262,144
        buffers = attention_memory.backward_temporaries(call(), B.CUDNN, H100, sm_count=H100_SMS)
        assert total(buffers) == 17_039_360

    def test_forward_has_no_scratch(self) -> None:
        assert attention_memory.forward_temporaries(call(), B.CUDNN, H100, sm_count=H100_SMS) == []

    def test_math_has_no_kernel_scratch(self) -> None:
        assert attention_memory.backward_temporaries(call(), B.MATH, H100, sm_count=H100_SMS) == []


class TestPrologueAndCorrections:
    def test_flash_pads_head_dim_to_8(self) -> None:
        buffers = attention_memory.sdpa_prologue_buffers(call(head_dim=60, head_dim_v=60), B.FLASH)
        assert [b.shape for b in buffers] == [(2, 16, 2048, 64)] * 3

    def test_mem_efficient_pads_unaligned_mask(self) -> None:
        masked = call(has_mask=True, is_causal=False, seq_kv=1000)
        buffers = attention_memory.sdpa_prologue_buffers(masked, B.EFFICIENT, mask_shape=(2048, 1000),
                                                         mask_is_bool=True)
        assert [(b.name, b.shape) for b in buffers] == [("sdpa_mask_float", (2048, 1000)),
                                                         ("sdpa_mask_padded", (2, 16, 2048, 1008))]

    def test_meta_outputs_match_cuda_except_eager_dropout_seeds(self) -> None:
        assert attention_memory.meta_output_corrections(call(), B.FLASH) == ()
        assert attention_memory.meta_output_corrections(call(), B.EFFICIENT) == ()
        seeds = attention_memory.meta_output_corrections(call(dropout_p=0.1), B.EFFICIENT)
        assert sum(c.delta_bytes for c in seeds) == -16

    def test_peak_bytes_frees_statement_temporaries_together(self) -> None:
        a = Buffer("a", (100,), torch.uint8, freed_early=True)
        b = Buffer("b", (50,), torch.uint8, freed_early=True)
        kept = Buffer("kept", (10,), torch.uint8)
        later = Buffer("later", (120,), torch.uint8)
        assert attention_memory.peak_bytes([a, b, kept]) == 160
        assert attention_memory.peak_bytes([a, b, kept, later]) == 160  # 10 + 120 = 130 < 160
        assert attention_memory.peak_bytes([kept, later]) == 130


# ------------------------------------------------------------------------------------------
# 3. autocast
# ------------------------------------------------------------------------------------------
class TestAutocast:
    @pytest.mark.parametrize("op", ["linear", "matmul", "conv2d", "bmm", "baddbmm", "addmm",
                                    "scaled_dot_product_attention", "__matmul__"])
    def test_lower_precision(self, op: str) -> None:
        assert autocast.autocast_policy(op) == "lower"

    @pytest.mark.parametrize("op", ["layer_norm", "group_norm", "exp", "log", "pow", "mse_loss",
                                    "nll_loss", "binary_cross_entropy_with_logits", "aten::pow.Tensor_Scalar"])
    def test_fp32(self, op: str) -> None:
        assert autocast.autocast_policy(op) == "fp32"

    @pytest.mark.parametrize("op", ["softmax", "log_softmax", "sum", "cumsum", "prod", "aten::softmax.int"])
    def test_fp32_set_opt_dtype(self, op: str) -> None:
        # softmax is NOT in the fp32 list: it gets dtype=float32 and keeps its input uncast
        assert autocast.autocast_policy(op) == "fp32_set_opt_dtype"

    def test_norm_appends_dtype(self) -> None:
        assert autocast.autocast_policy("norm") == "fp32_append_dtype"

    def test_promote(self) -> None:
        assert autocast.autocast_policy("addcmul") == "promote"
        assert autocast.autocast_policy("index_put") == "promote"

    @pytest.mark.parametrize("op", ["cat", "stack"])
    def test_cat_and_stack_are_not_autocast(self, op: str) -> None:
        # gone from AT_FORALL_PROMOTE: mixed inputs are widened by ordinary type promotion
        assert autocast.autocast_policy(op) == "none"

    def test_banned_and_untouched(self) -> None:
        assert autocast.autocast_policy("binary_cross_entropy") == "banned"
        assert autocast.autocast_policy("relu") == "none"
        assert autocast.autocast_policy("gelu") == "none"

    def test_rms_norm_joined_fp32_in_2_12(self) -> None:
        assert autocast.autocast_policy("rms_norm", "2.11") == "none"
        assert autocast.autocast_policy("rms_norm", "2.12") == "fp32"

    def test_lists_are_disjoint(self) -> None:
        lists = list(autocast.autocast_lists().values())
        for i, first in enumerate(lists):
            for second in lists[i + 1:]:
                assert not first & second

    def test_lists_match_the_installed_dispatcher(self) -> None:
        """Every aten op with an AutocastCUDA kernel in this torch is in our lists and back."""
        if versions.parse_torch_version(torch.__version__) < (2, 11):
            pytest.skip("the lists are transcribed for torch ≥ 2.11")
        has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
        if has_kernel is None:
            pytest.skip("this torch exposes no dispatcher query")
        registered = {
            name.removeprefix("aten::").split(".", 1)[0]
            for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and has_kernel(name, "AutocastCUDA")
        }
        ours = {name.split(".",
                           1)[0] for names in autocast.autocast_lists(torch.__version__).values() for name in names}
        if torch.version.cuda is None:  # a CPU build registers no cuDNN RNN (aten/src/ATen/cudnn/AutocastRNN.cpp)
            ours.discard("_cudnn_rnn")
        assert registered == ours


# ------------------------------------------------------------------------------------------
# 4. cuBLAS
# ------------------------------------------------------------------------------------------
class TestCublas:
    def test_two_workspaces_per_training_step(self) -> None:
        # one (handle, stream) pair for the forward thread, one for autograd's device thread
        assert cublas.CUBLAS_WORKSPACES_PER_TRAINING_STEP == 2
        assert cublas.cublas_workspaces_in_training_step("2.11.0+cu130") == 2

    def test_separate_cublaslt_workspaces_by_version(self) -> None:
        assert cublas.separate_cublaslt_workspaces_in_training_step("2.7") == 0  # per-call temporary
        assert cublas.separate_cublaslt_workspaces_in_training_step("2.9") == 2  # own map, persistent
        assert cublas.separate_cublaslt_workspaces_in_training_step("2.11") == 0  # unified


# ------------------------------------------------------------------------------------------
# 5. cuDNN convolution workspace model
# ------------------------------------------------------------------------------------------
class TestConvWorkspace:
    """The rule read off the H100 snapshots (benchmarks/results/2026-11-26-cudnn-workspaces/REPORT.md),
    worked by hand; "+ 16" is cuDNN's tail on a layout-copying engine's workspace."""

    @staticmethod
    def ws(x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...], direction: str,
           dtype: torch.dtype = torch.float16, cc: tuple[int, int] = H100, stride: tuple[int, int] = (1, 1),
           groups: int = 1, **kw: object) -> int:
        return cudnn.conv_workspace_bytes(x, w, y, dtype, stride, (1, 1), (1, 1), groups, direction, cc, **kw)

    # a 3x3, 128 -> 128 channels, 28x28, batch 8, fp16: x = y = 8·128·28·28·2 = 1,605,632; w 128·128·9·2 = 294,912
    X3, W3, Y3 = (8, 128, 28, 28), (128, 128, 3, 3), (8, 128, 28, 28)

    def test_3x3_forward_and_backward_data_hold_nhwc_copies_of_x_w_y(self) -> None:
        assert self.ws(self.X3, self.W3, self.Y3, "forward") == 1_605_632 + 294_912 + 1_605_632 + 16
        assert self.ws(self.X3, self.W3, self.Y3, "backward_data") == 1_605_632 + 294_912 + 1_605_632 + 16

    def test_3x3_weight_gradient_adds_split_k_partials(self) -> None:
        # one 128-tile of K and of C, 9 taps: 132 SMs // 9 = 14 fp32 copies of dW (128·128·9·4 = 589,824)
        copies = 1_605_632 + 294_912 + 1_605_632 + 16
        assert self.ws(self.X3, self.W3, self.Y3, "backward_filter") == copies + 14 * 589_824
        assert self.ws(self.X3, self.W3, self.Y3, "wgrad") == self.ws(self.X3, self.W3, self.Y3, "backward_filter")
        # an A100's 108 SMs: 108 // 9 = 12 copies
        assert self.ws(self.X3, self.W3, self.Y3, "backward_filter", sm_count=108) == copies + 12 * 589_824
        # 512 -> 512: 4·4·9 = 144 tiles, one split of 512·512·9·4 = 9,437,184 B, capped at one
        # 128×128 fp32 tile per SM: 132·128·128·4 = 8,650,752
        x, w = (2, 512, 14, 14), (512, 512, 3, 3)
        plain = 2 * (2 * 512 * 14 * 14 * 2) + 512 * 512 * 9 * 2 + 16
        assert self.ws(x, w, x, "backward_filter") == plain + 8_650_752

    def test_64_to_128_forward_copies_the_64_channel_tensor_and_w_only(self) -> None:
        # x 8·64·56·56·2 = 3,211,264; w 128·64·9·2 = 147,456; y 8·128·56·56·2 = 6,422,528
        x, w, y = (8, 64, 56, 56), (128, 64, 3, 3), (8, 128, 56, 56)
        assert self.ws(x, w, y, "forward") == 3_211_264 + 147_456 + 16
        assert self.ws(x, w, y, "backward_data") == 3_211_264 + 147_456 + 6_422_528 + 16

    def test_1x1_stride_1_is_a_gemm_per_image(self) -> None:
        # 256 -> 64 at 56x56 (3,136 pixels ≥ 196): no copies; dW: one fp32 copy per image, 8·64·256·4
        x, w, y = (8, 256, 56, 56), (64, 256, 1, 1), (8, 64, 56, 56)
        assert self.ws(x, w, y, "forward") == self.ws(x, w, y, "backward_data") == 0
        assert self.ws(x, w, y, "backward_filter") == 8 * 64 * 256 * 4 == 524_288
        # at 7x7 (49 pixels) the NHWC-copy engine: x and y (a 1x1 weight needs no copy)
        x7, y7 = (8, 256, 7, 7), (8, 64, 7, 7)
        assert self.ws(x7, w, y7, "forward") == 8 * 256 * 49 * 2 + 8 * 64 * 49 * 2 + 16 == 250_896

    def test_1x1_strided_downsample(self) -> None:
        # 256 -> 512, stride 2, 56x56 -> 28x28: copies of x (12,845,056) and y (6,422,528)
        x, w, y = (8, 256, 56, 56), (512, 256, 1, 1), (8, 512, 28, 28)
        assert self.ws(x, w, y, "forward", stride=(2, 2)) == 12_845_056 + 6_422_528 + 16
        assert self.ws(x, w, y, "backward_filter", stride=(2, 2)) == 12_845_056 + 262_144 + 6_422_528 + 16
        # 64 input channels take an engine without workspace
        assert self.ws((8, 64, 56, 56), (256, 64, 1, 1), (8, 256, 28, 28), "forward", stride=(2, 2)) == 0
        # in fp32 (TF32) this one shape's forward copies x (25,690,112) and w (524,288), not y
        fp32 = self.ws(x, w, y, "forward", torch.float32, stride=(2, 2))
        assert fp32 == 8 * 256 * 56 * 56 * 4 + 512 * 256 * 4 + 16 == 26_214_416

    def test_resnet_stem_pads_3_channels_to_4(self) -> None:
        # 7x7, 3 -> 64, stride 2, batch 64, fp32: x 38,535,168 (padded: 51,380,224), w 37,632 (50,176),
        # y 64·64·112·112·4 = 205,520,896
        x, w, y = (64, 3, 224, 224), (64, 3, 7, 7), (64, 64, 112, 112)
        fp32 = torch.float32
        assert self.ws(x, w, y, "forward", fp32, stride=(2, 2)) == 38_535_168 + 37_632 + 205_520_896 + 16
        # wgrad: min(120, 64·112·112 // 348) = 120 fp32 copies of the padded dW (50,176 B): 250.79 MiB,
        # the snapshot's conv1 weight gradient at batch 64
        wgrad = self.ws(x, w, y, "backward_filter", fp32, stride=(2, 2))
        assert wgrad == 51_380_224 + 50_176 + 205_520_896 + 120 * 50_176 + 16 == 262_972_432
        # a 3x3 RGB stem (VGG, U-Net) uses an engine without workspace
        assert self.ws((8, 3, 224, 224), (64, 3, 3, 3), (8, 64, 224, 224), "backward_filter") == 0

    def test_shape_exceptions_are_table_rows_with_sources(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # the fp32 256 -> 512 downsample and the 64 -> 128 forward are rows of ENGINE_EXCEPTIONS, each citing
        # the snapshots' report; without the rows both take their class's rule (copies of x and y; x, w and y)
        assert all("2026-11-26-cudnn-workspaces/REPORT.md" in row.source for row in cudnn.ENGINE_EXCEPTIONS)
        x, w, y = (8, 256, 56, 56), (512, 256, 1, 1), (8, 512, 28, 28)
        x64, w64, y64 = (8, 64, 56, 56), (128, 64, 3, 3), (8, 128, 56, 56)
        monkeypatch.setattr(cudnn, "ENGINE_EXCEPTIONS", ())
        assert self.ws(x, w, y, "forward", torch.float32, stride=(2, 2)) == 25_690_112 + 12_845_056 + 16
        assert self.ws(x64, w64, y64, "forward") == 3_211_264 + 147_456 + 6_422_528 + 16

    def test_channels_last_needs_no_transposes(self) -> None:
        assert self.ws(self.X3, self.W3, self.Y3, "forward", channels_last=True) == 0
        assert self.ws(self.X3, self.W3, self.Y3, "backward_filter", channels_last=True) == 14 * 589_824

    def test_no_tensor_cores_no_workspace(self) -> None:
        assert self.ws(self.X3, self.W3, self.Y3, "forward", dtype=torch.float32, cc=V100) == 0
        assert self.ws(self.X3, self.W3, self.Y3, "forward", dtype=torch.float32, allow_tf32=False) == 0
        assert self.ws(self.X3, self.W3, self.Y3, "forward", dtype=torch.float32, cc=A100) > 0  # TF32 by default

    def test_depthwise_has_no_workspace(self) -> None:
        assert self.ws((8, 64, 56, 56), (64, 1, 3, 3), (8, 64, 56, 56), "forward", groups=64) == 0

    def test_unknown_direction_is_refused(self) -> None:
        with pytest.raises(ValueError, match="unknown convolution direction"):
            self.ws(self.X3, self.W3, self.Y3, "sideways")

    def test_the_rule_of_a_call_site_is_the_function(self) -> None:
        rule = cudnn.ConvWorkspaceRule(4, torch.float16, (1, 1), 1, cudnn.ConvDirection.BACKWARD_FILTER, H100, 132)
        assert rule((*self.X3, *self.W3, *self.Y3)) == self.ws(self.X3, self.W3, self.Y3, "backward_filter")
        assert hash(rule) == hash(cudnn.ConvWorkspaceRule(4, torch.float16, (1, 1), 1,
                                                          cudnn.ConvDirection.BACKWARD_FILTER, H100, 132))


def test_a_transposed_convolutions_input_gradient_is_cudnns_forward() -> None:
    # cudnn_convolution_transpose_backward_input calls raw_cudnn_convolution_forward_out; its forward
    # is cuDNN's backward-data
    calls: list[str] = []

    class Recorder:
        def conv(self, *args: object) -> None:
            calls.append(str(args[-1].value))  # type: ignore[attr-defined]

    x, w, y = torch.empty(2, 64, 8, 8), torch.empty(64, 32, 2, 2), torch.empty(2, 32, 16, 16)
    aten = torch.ops.aten
    workspaces.conv_forward(Recorder(), aten.convolution.default,  # type: ignore[arg-type]
                            (x, w, None, [2, 2], [0, 0], [1, 1], True, [0, 0], 1), {}, y)
    workspaces.conv_backward(Recorder(), aten.convolution_backward.default,  # type: ignore[arg-type]
                             (y, x, w, None, [2, 2], [0, 0], [1, 1], True, [0, 0], 1, [True, True, False]), {}, None)
    workspaces.conv_backward(Recorder(), aten.convolution_backward.default,  # type: ignore[arg-type]
                             (y, x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1, [True, False, False]), {}, None)
    assert calls == ["backward_data", "forward", "backward_filter", "backward_data"]


def test_torch_version_parsing() -> None:
    assert versions.parse_torch_version("2.11.0+cu130") == (2, 11)
    assert versions.parse_torch_version("2.4") == (2, 4)
    with pytest.raises(ValueError):
        versions.parse_torch_version("nightly")

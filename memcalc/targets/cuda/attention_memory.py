"""What the fused attention kernels allocate that meta tensors don't show.

A meta-tensor run of a fused SDPA op makes its outputs but none of the scratch buffers the
CUDA kernels allocate and free inside the call; and a few meta outputs differ in size from
CUDA's. :func:`forward_temporaries`, :func:`backward_temporaries`,
:func:`sdpa_prologue_buffers` and :func:`meta_output_corrections` transcribe those for
PyTorch 2.11 (the backend itself is chosen by :mod:`memcalc.targets.cuda.sdpa`).

Source snapshots read (pytorch/pytorch unless said otherwise): ``attention.cpp``,
``attention_backward.cu``, ``flash_attn/flash_api.cpp``, ``mem_eff_attention/kernel_backward.h``,
``mem_eff_attention/kernels/cutlass{F,B}.h``, ``cudnn/MHA.cpp``,
``torch/_meta_registrations.py`` (installed 2.13) and NVIDIA/cudnn-frontend
``scaled_dot_product_flash_attention.h``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memcalc.targets.cuda.sdpa import AttentionBackend, SdpaCall
from memcalc.targets.versions import ceil_div, element_size, round_up

__all__ = (
    "BACKWARD_TEMPORARIES",
    "FORWARD_TEMPORARIES",
    "Buffer",
    "OutputCorrection",
    "backward_temporaries",
    "flash_num_splits",
    "forward_temporaries",
    "meta_output_corrections",
    "peak_bytes",
    "sdpa_prologue_buffers",
)

# =============================================================================================
# Memory of the fused kernels
# =============================================================================================


@dataclass(frozen=True)
class Buffer:
    """One allocation a kernel call makes through the caching allocator.

    Lists of buffers are in allocation order. ``freed_early`` marks a C++ temporary of the
    statement that produces the next buffer *not* so marked: it coexists with that buffer and
    is freed right after it (end of the full-expression), before anything later — see
    :func:`peak_bytes`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    freed_early: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


@dataclass(frozen=True)
class OutputCorrection:
    """Where a meta kernel's output differs from what CUDA allocates for it."""

    output: str
    meta_bytes: int
    cuda_bytes: int
    why: str

    @property
    def delta_bytes(self) -> int:
        """Add this to the meta count to get CUDA's (negative: CUDA allocates less on the GPU)."""
        return self.cuda_bytes - self.meta_bytes


def peak_bytes(buffers: Sequence[Buffer]) -> int:
    """Peak bytes of a temporaries list allocated in order: ``freed_early`` buffers are freed
    together right after the next kept buffer is allocated; kept ones stay until the call
    returns."""
    live = 0
    peak = 0
    pending = 0  # early-freed bytes waiting for the end of their statement
    for buffer in buffers:
        live += buffer.nbytes
        peak = max(peak, live)
        if buffer.freed_early:
            pending += buffer.nbytes
        else:
            live -= pending
            pending = 0
    return peak


# ---- flash (flash_attn/flash_api.cpp) --------------------------------------------------------
def _flash_head_sizes(head_dim: int) -> tuple[int, int]:
    """mha_fwd/mha_bwd: ``head_size = round_multiple(head_size_og, 8)`` (SDPA already padded)
    and ``head_size_rounded = round_multiple(head_size, head_size <= 128 ? 32 : 64)``."""
    head_size = round_up(head_dim, 8)
    return head_size, round_up(head_size, 32 if head_size <= 128 else 64)


#: mha_fwd/mha_bwd: ``seqlen_q_rounded = round_multiple(seqlen_q, 128)``.
FLASH_SEQ_ROUND = 128
#: set_params_splitkv: "We multiply number of SMs by 2 to hard-code the fact that we're using
#: 128 threads per block", and ``max_splits`` = 128.
FLASH_SPLITKV_SM_FACTOR = 2
FLASH_SPLITKV_MAX_SPLITS = 128


def _num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """flash_api.cpp ``num_splits_heuristic`` with its float32 arithmetic."""
    if batch_nheads_mblocks >= np.float32(0.8) * np.float32(num_sms):
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or ceil_div(num_n_blocks, n) != ceil_div(num_n_blocks, n - 1)

    efficiency: list[float] = []
    for n in range(1, max_splits + 1):
        if not eligible(n):
            efficiency.append(0.0)
            continue
        waves = np.float32(batch_nheads_mblocks * n) / np.float32(num_sms)
        efficiency.append(float(waves / np.float32(math.ceil(float(waves)))))
    best = max(efficiency, default=0.0)
    for n in range(1, max_splits + 1):
        if eligible(n) and efficiency[n - 1] >= 0.85 * best:
            return n
    return 1


def flash_num_splits(call: SdpaCall, compute_capability: tuple[int, int], sm_count: int) -> int:
    """``set_params_splitkv`` with ``num_splits = 0``: how many KV splits mha_fwd runs (1: no
    split, no accumulators). SplitKV is off with dropout."""
    if call.dropout_p > 0.0:
        return 1
    head_size, _ = _flash_head_sizes(call.head_dim)
    block_n = 256 if head_size <= 64 else (128 if head_size <= 128 else 64)
    num_n_blocks = ceil_div(call.seq_kv, block_n)
    num_m_blocks = ceil_div(call.seq_q, 64)
    sms = sm_count * FLASH_SPLITKV_SM_FACTOR
    return _num_splits_heuristic(call.batch * call.heads_q * num_m_blocks, sms, num_n_blocks, FLASH_SPLITKV_MAX_SPLITS)


def _flash_forward(call: SdpaCall, cc: tuple[int, int], sm_count: int, **_: object) -> list[Buffer]:
    """mha_fwd → set_params_splitkv: with ``num_splits > 1``,
    ``softmax_lse_accum = empty({S, B, H, Lq}, float)`` and
    ``out_accum = empty({S, B, H, Lq, head_size_rounded}, float)``; nothing else is scratch
    (out, softmax_lse, rng_state are outputs)."""
    splits = flash_num_splits(call, cc, sm_count)
    if splits <= 1:
        return []
    rounded = _flash_head_sizes(call.head_dim)[1]
    shape = (splits, call.batch, call.heads_q, call.seq_q)
    return [
        Buffer("flash_softmax_lse_accum", shape, torch.float32),
        Buffer("flash_out_accum", (*shape, rounded), torch.float32),
    ]


def _flash_backward(
    call: SdpaCall,
    cc: tuple[int, int],
    sm_count: int,
    grad_out_needs_copy: bool = False,
    deterministic: bool = False,
    **_: object,
) -> list[Buffer]:
    """_flash_attention_backward + mha_bwd scratch, in allocation order:

    * ``grad_out.contiguous()`` when the incoming grad is not (B, Lq, H, D)-contiguous;
      ``out.contiguous()`` never copies (flash wrote ``out`` in that layout).
    * ``softmax_d = empty({B, H, seqlen_q_rounded}, float)`` — returned by mha_bwd, dropped by
      _flash_attention_backward.
    * ``dq_accum = empty({B, seqlen_q_rounded, H, head_size_rounded}, float)``; deterministic:
      ``zeros({nsplits, …})`` with ``nsplits = ceil(SMs / (B*H))``.
    * GQA: ``dk_expanded``/``dv_expanded = empty({B, Lk, H, head_size})`` in the input dtype,
      summed into dk/dv afterwards.
    """
    head_size, rounded = _flash_head_sizes(call.head_dim)
    seq_q_rounded = round_up(call.seq_q, FLASH_SEQ_ROUND)
    b, h = call.batch, call.heads_q
    buffers: list[Buffer] = []
    if grad_out_needs_copy:
        buffers.append(Buffer("flash_grad_out_contiguous", (b, call.seq_q, h, head_size), call.dtype))
    buffers.append(Buffer("flash_softmax_d", (b, h, seq_q_rounded), torch.float32))
    accum: tuple[int, ...] = (b, seq_q_rounded, h, rounded)
    if deterministic:
        nsplits = ceil_div(sm_count, b * h)
        accum = (nsplits, *accum)
    buffers.append(Buffer("flash_dq_accum", accum, torch.float32))
    if call.heads_kv != call.heads_q:
        expanded = (b, call.seq_kv, h, head_size)
        buffers.append(Buffer("flash_dk_expanded", expanded, call.dtype))
        buffers.append(Buffer("flash_dv_expanded", expanded, call.dtype))
    return buffers


# ---- mem-efficient (attention.cu, attention_backward.cu, kernel_{forward,backward}.h) --------
#: kernel_forward.h: ``kAlignLSE = 32; // block size of backward`` — logsumexp's last dim.
MEM_EFF_LSE_ALIGN = 32
#: cutlassF.h: the largest head dim the register-file forward kernels take (32x128/64x128
#: "rf" kernels, kMaxK=128); above it the 32x128 "gmem" kernel (kMaxK=65536) runs and, for
#: fp16/bf16, needs a float ``output_accum`` (kNeedsOutputAccumulatorBuffer).
MEM_EFF_FWD_RF_MAX_K = 128


def _mem_eff_forward(call: SdpaCall, cc: tuple[int, int], sm_count: int, **_: object) -> list[Buffer]:
    """_efficient_attention_forward: ``output_accum = empty({B, M, H, Kv}, float)`` when the
    chosen kernel keeps the output outside registers and the output is not float."""
    if call.is_half and max(call.head_dim, call.head_dim_v) > MEM_EFF_FWD_RF_MAX_K:
        return [Buffer("mem_eff_output_accum", (call.batch, call.seq_q, call.heads_q, call.head_dim_v), torch.float32)]
    return []


@dataclass(frozen=True)
class _BwdKernel:
    """One ``AttentionBackwardKernel`` instantiation as cutlassB.h dispatches it."""

    arch_min: int  # ArchTag::kMinComputeCapability (50, 70, 75, 80)
    block_i: int  # kBlockSizeI (queries)
    block_j: int  # kBlockSizeJ (keys)
    max_k: int  # kMaxK
    needs_large_smem: bool = False  # assumed not to fit ~100 KB of opt-in shared memory


_K64 = 65536
# cutlassB.h dispatch lists (dropout lists have the same block shapes; seq-aligned variants too).
_BWD_HALF_SM80 = (
    _BwdKernel(80, 64, 64, 32),
    _BwdKernel(80, 64, 64, 64),
    _BwdKernel(80, 128, 64, 96),  # only "if (cc == 86 || cc == 89)"
    _BwdKernel(80, 128, 128, 128, needs_large_smem=True),
    _BwdKernel(80, 64, 64, 128),
    _BwdKernel(80, 128, 64, _K64),
    _BwdKernel(80, 64, 64, _K64),
)
_BWD_FLOAT_SM80 = (
    _BwdKernel(80, 64, 64, 32),
    _BwdKernel(80, 64, 64, 64),
    _BwdKernel(80, 128, 64, 128),
    _BwdKernel(80, 64, 64, 128),
    _BwdKernel(80, 128, 64, _K64),
    _BwdKernel(80, 64, 64, _K64),
)


def _bwd_list(arch: int, with_128x64: bool) -> tuple[_BwdKernel, ...]:
    kernels = [_BwdKernel(arch, 64, 64, 32), _BwdKernel(arch, 64, 64, 64)]
    if with_128x64:
        kernels.append(_BwdKernel(arch, 128, 64, 128))
    kernels.append(_BwdKernel(arch, 64, 64, 128))
    if with_128x64:
        kernels.append(_BwdKernel(arch, 128, 64, _K64))
    kernels.append(_BwdKernel(arch, 64, 64, _K64))
    return tuple(kernels)


#: Compute capabilities whose opt-in shared memory (A100 163 KB, H100/B200 227 KB) is assumed
#: to fit the 128x128 k128 preload kernel; sm86/89/120 (~99 KB) and older are not.
_LARGE_SMEM_CCS = frozenset({(8, 0), (9, 0), (10, 0), (10, 3)})
#: cc that get the extra 128x64 k96 bf16/f16 kernel (``if (cc == 86 || cc == 89)``; 121 → 120).
_K96_CCS = frozenset({(8, 6), (8, 9)})


def _mem_eff_backward_kernel(call: SdpaCall, cc: tuple[int, int]) -> _BwdKernel:
    """dispatch_cutlassB + launchKernel's filters: the first kernel with kMaxK ≥ max(K, Kv)
    whose shared memory fits (dropout and alignment filters keep the same block shapes)."""
    max_k = max(call.head_dim, call.head_dim_v)
    candidates: tuple[_BwdKernel, ...]
    if cc >= (8, 0):
        candidates = _BWD_HALF_SM80 if call.is_half else _BWD_FLOAT_SM80
    elif cc >= (7, 0):
        arch = 75 if cc >= (7, 5) else 70
        candidates = _bwd_list(arch, with_128x64=call.is_half)
    else:
        candidates = _bwd_list(50, with_128x64=False)
    for kernel in candidates:
        if kernel.max_k < max_k:
            continue
        if kernel.max_k == 96 and tuple(cc) not in _K96_CCS:
            continue
        if kernel.needs_large_smem and tuple(cc) not in _LARGE_SMEM_CCS:
            continue
        return kernel
    return candidates[-1]


def _mem_eff_workspace_bytes(call: SdpaCall, kernel: _BwdKernel) -> int:
    """``Params::workspace_size()`` (kernel_backward.h) with the split-keys heuristic of
    _efficient_attention_backward:

    * gK / gV staging: ``num_splits_key * kBlockSizeJ * align_up(head_dim[_value], kBlockSizeI)``
      floats per (batch, head) when the dK/dV accumulators can't stay in registers
      (``!kOutputInRF`` and a half output).
    * gQ: ``ceil(M / kBlockSizeI) * ceil(K / kBlockSizeJ) * sizeof(GradQTempStorage) / 4``
      floats, ``GradQTempStorage`` = 16 B lock/counter header + kBlockSizeI·kBlockSizeJ floats;
      needed on sm70+ (kEnableSplitKeys) or for half outputs.
    * ``workspace_size = B * H * align_up(gk + gv + gq, 4) * 4`` bytes.
    """
    b, h, m, n = call.batch, call.heads_q, call.seq_q, call.seq_kv
    bi, bj = kernel.block_i, kernel.block_j
    output_in_rf = call.is_half and kernel.max_k <= bi
    enable_split_keys = kernel.arch_min >= 70
    accum_q = enable_split_keys or call.is_half
    accum_kv = (not output_in_rf) and call.is_half
    num_splits_key = ceil_div(n, bj)
    if b * h >= 256 and n <= 2 * bj:  # parallelism_without_split_key = 1 * H * B
        num_splits_key = 1
    if accum_kv:
        num_splits_key = min(num_splits_key, 200 // (b * h))
    if not enable_split_keys or num_splits_key < 1:
        num_splits_key = 1
    gk = num_splits_key * bj * round_up(call.head_dim, bi) if accum_kv else 0
    gv = num_splits_key * bj * round_up(call.head_dim_v, bi) if accum_kv else 0
    gq = ceil_div(m, bi) * ceil_div(call.head_dim, bj) * (4 + bi * bj) if accum_q else 0
    return b * h * round_up(gk + gv + gq, 4) * 4


def _mem_eff_backward(
    call: SdpaCall, cc: tuple[int, int], sm_count: int, grad_out_needs_copy: bool = False, **_: object
) -> list[Buffer]:
    """_efficient_attention_backward scratch, in allocation order:

    * ``grad_out_.contiguous()`` when the grad is not (B, M, H, Kv)-contiguous.
    * ``delta``: ``empty({B, H, M}, float)`` when the kernel computes it (half, and not the
      sm70 non-register kernels); otherwise ``(grad_out.to(float) * out.to(float)).sum(-1)
      .transpose(-2, -1).contiguous()`` — casts, product and sum are statement temporaries.
    * ``workspace = empty({workspace_size}, uint8)`` (:func:`_mem_eff_workspace_bytes`).

    grad_q/k/v are outputs (three separate allocations in SDPA's path:
    ``shared_storage_dqdkdv`` is left False).
    """
    b, m, h, kv = call.batch, call.seq_q, call.heads_q, call.head_dim_v
    kernel = _mem_eff_backward_kernel(call, cc)
    output_in_rf = call.is_half and kernel.max_k <= kernel.block_i
    kernel_computes_delta = call.is_half and (output_in_rf or kernel.arch_min != 70)
    buffers: list[Buffer] = []
    if grad_out_needs_copy:
        buffers.append(Buffer("mem_eff_grad_out_contiguous", (b, m, h, kv), call.dtype))
    if kernel_computes_delta:
        buffers.append(Buffer("mem_eff_delta", (b, h, m), torch.float32))
    else:
        if call.dtype != torch.float32:
            buffers.append(Buffer("mem_eff_grad_out_float", (b, m, h, kv), torch.float32, freed_early=True))
            buffers.append(Buffer("mem_eff_out_float", (b, m, h, kv), torch.float32, freed_early=True))
        buffers.append(Buffer("mem_eff_delta_product", (b, m, h, kv), torch.float32, freed_early=True))
        buffers.append(Buffer("mem_eff_delta_sum", (b, m, h), torch.float32, freed_early=True))
        buffers.append(Buffer("mem_eff_delta", (b, h, m), torch.float32))
    workspace = _mem_eff_workspace_bytes(call, kernel)
    if workspace:
        buffers.append(Buffer("mem_eff_workspace", (workspace,), torch.uint8))
    return buffers


# ---- cuDNN (cudnn/MHA.cpp + cudnn-frontend SDPA nodes) ----------------------------------------
def _cudnn_forward(call: SdpaCall, cc: tuple[int, int], sm_count: int, **_: object) -> list[Buffer]:
    """run_cudnn_SDP_fprop allocates ``mha_graph->get_workspace_size()`` through the caching
    allocator. The frontend part is 0 without ALiBi; the engine's own part is not public and is
    taken as 0 (the fprop kernels keep everything on chip)."""
    return []


def _cudnn_backward(
    call: SdpaCall, cc: tuple[int, int], sm_count: int, grad_out_needs_copy: bool = False, **_: object
) -> list[Buffer]:
    """run_cudnn_SDP_bprop: one workspace allocation of ``get_workspace_size()``. With cuDNN ≥ 9
    and no dBias/determinism the frontend's SDPA-backward node puts in it
    ``dQ_accum = b*h_q*s_q*d_qk*4`` B (a float dQ accumulator) and
    ``softmax_sum = b*h_q*s_q*4`` B (Σ dO·O); GQA's dK/dV full-head tensors are virtual for
    dense inputs. The engine's own workspace is taken as 0. A dO whose strides differ from O's
    is first re-laid-out like O (``grad_out_needs_copy``)."""
    b, h, s_q = call.batch, call.heads_q, call.seq_q
    buffers: list[Buffer] = []
    if grad_out_needs_copy:
        buffers.append(Buffer("cudnn_grad_out_relayout", (b, h, s_q, call.head_dim_v), call.dtype))
    workspace = 4 * (b * h * s_q * call.head_dim + b * h * s_q)
    buffers.append(Buffer("cudnn_sdpa_bwd_workspace", (workspace,), torch.uint8))
    return buffers


_Temporaries = Callable[..., list[Buffer]]
#: Registry: per backend, the scratch its forward / backward aten op allocates and frees.
FORWARD_TEMPORARIES: dict[AttentionBackend, _Temporaries] = {
    AttentionBackend.FLASH: _flash_forward,
    AttentionBackend.EFFICIENT: _mem_eff_forward,
    AttentionBackend.CUDNN: _cudnn_forward,
}
BACKWARD_TEMPORARIES: dict[AttentionBackend, _Temporaries] = {
    AttentionBackend.FLASH: _flash_backward,
    AttentionBackend.EFFICIENT: _mem_eff_backward,
    AttentionBackend.CUDNN: _cudnn_backward,
}


def forward_temporaries(
    call: SdpaCall,
    backend: AttentionBackend,
    compute_capability: tuple[int, int],
    *,
    sm_count: int,
) -> list[Buffer]:
    """Buffers the fused forward op allocates and frees inside the call (outputs excluded:
    the meta kernels already make those). Math has none (its tensors are ordinary ops)."""
    rule = FORWARD_TEMPORARIES.get(AttentionBackend(backend))
    return [] if rule is None else rule(call, tuple(compute_capability), sm_count)


def backward_temporaries(
    call: SdpaCall,
    backend: AttentionBackend,
    compute_capability: tuple[int, int],
    *,
    sm_count: int,
    grad_out_needs_copy: bool = False,
    deterministic: bool = False,
) -> list[Buffer]:
    """Buffers the fused backward op allocates and frees inside the call (grad_q/k/v are
    outputs and excluded). ``grad_out_needs_copy``: the incoming grad is not laid out like the
    forward output (e.g. it came from a ``.contiguous()`` in (B, H, L, D) order)."""
    rule = BACKWARD_TEMPORARIES.get(AttentionBackend(backend))
    if rule is None:
        return []
    return rule(call, tuple(compute_capability), sm_count, grad_out_needs_copy=grad_out_needs_copy,
                deterministic=deterministic)


def sdpa_prologue_buffers(
    call: SdpaCall,
    backend: AttentionBackend,
    *,
    mask_shape: tuple[int, ...] | None = None,
    mask_is_bool: bool = False,
) -> list[Buffer]:
    """Tensors ``scaled_dot_product_attention`` (attention.cpp) makes *before* the fused op.
    They are the op's inputs, so under autograd they are saved for backward, not freed:

    * flash: ``pad_last_dim<8>`` copies of q, k, v when head_dim % 8 != 0 (the output is sliced
      back: a view).
    * a boolean mask → ``convert_boolean_attn_mask{,_cudnn}``: a new mask in q's dtype.
    * mem-efficient: ``preprocess_mask`` expands the mask to (B, H, Lq, Lk) (a view) and, when
      Lk % 16 != 0, ``pad_bias<16>`` materialises (B, H, Lq, round16(Lk)) — a full-size copy.
    """
    buffers: list[Buffer] = []
    if backend is AttentionBackend.FLASH and call.head_dim % 8:
        padded = round_up(call.head_dim, 8)
        buffers.append(Buffer("sdpa_query_padded", (call.batch, call.heads_q, call.seq_q, padded), call.dtype))
        buffers.append(Buffer("sdpa_key_padded", (call.batch, call.heads_kv, call.seq_kv, padded), call.dtype))
        buffers.append(Buffer("sdpa_value_padded", (call.batch, call.heads_kv, call.seq_kv, padded), call.dtype))
    if not call.has_mask or mask_shape is None or backend is AttentionBackend.FLASH:
        return buffers
    if mask_is_bool:
        buffers.append(Buffer("sdpa_mask_float", tuple(mask_shape), call.dtype))
    if backend is AttentionBackend.EFFICIENT and call.seq_kv % 16:
        padded_mask = (call.batch, call.heads_q, call.seq_q, round_up(call.seq_kv, 16))
        buffers.append(Buffer("sdpa_mask_padded", padded_mask, call.dtype))
    return buffers


#: Philox seed/offset of the mem-efficient op: ``at::empty({}, kLong)`` — 8 B each.
_PHILOX_SCALAR_BYTES = 8


def meta_output_corrections(call: SdpaCall, backend: AttentionBackend) -> tuple[OutputCorrection, ...]:
    """Where the meta kernels (``torch/_meta_registrations.py``) size an output differently
    from CUDA in 2.11. Everything else matches byte for byte:

    * flash: out (B, L, H, D) storage, logsumexp (B, H, Lq) float — **not** rounded in FA2 —,
      rng_state (2,) uint64 + an unused () uint64, both on CUDA even without dropout.
    * mem-efficient: logsumexp (B, H, ceil(Lq/32)*32) float when computed, (B, H, 0) otherwise —
      the meta kernel rounds the same way (``kAlignLSE``).
    * cuDNN: out like q's layout, logsumexp (B, H, Lq, 1) float, seed/offset ``zeros({1}, kLong)``
      on CUDA (meta: () long — same 8 B).

    The one difference: mem-efficient with dropout, in eager mode (not capturing a CUDA graph),
    makes seed/offset with ``at::scalar_tensor(…, kLong)`` — CPU tensors — while the meta kernel
    counts two 8 B tensors.
    """
    if AttentionBackend(backend) is AttentionBackend.EFFICIENT and call.dropout_p > 0.0:
        why = "mem-efficient dropout: philox seed/offset are CPU scalar tensors outside graph capture"
        return (
            OutputCorrection("philox_seed", _PHILOX_SCALAR_BYTES, 0, why),
            OutputCorrection("philox_offset", _PHILOX_SCALAR_BYTES, 0, why),
        )
    return ()

"""CUDA kernel facts the estimator needs but meta tensors cannot show.

A meta-tensor run knows shapes, not kernels. On a real GPU, PyTorch picks one of several
attention kernels, fused kernels allocate scratch buffers that no aten output shows, autocast
decides per op which dtype runs, cuBLAS keeps persistent workspaces and cuDNN convolutions
borrow a workspace per call. This module turns those decisions into pure-Python rules,
transcribed from the PyTorch sources (cited per rule) for the version the GPU machine runs,
**PyTorch 2.11** (``torch==2.11.0+cu130``, which pins ``nvidia-cudnn-cu13==9.19.0.56``).
Where 2.4–2.13 differ and the difference is known, the rule takes ``torch_version``.

Five parts, one per question:

1. Which SDPA backend runs? :func:`choose_sdpa_backend` (``sdp_utils.cpp``).
2. What do the fused kernels allocate that meta tensors don't show?
   :func:`forward_temporaries`, :func:`backward_temporaries`, :func:`sdpa_prologue_buffers`,
   :func:`meta_output_corrections`.
3. What does autocast do with an op? :func:`autocast_policy` (``autocast_mode.{h,cpp}``).
4. How many cuBLAS workspaces does a training step hold? :func:`cublas_workspaces_in_training_step`.
5. How big is one cuDNN convolution workspace? :func:`conv_workspace_bytes` — a documented
   *model*, not a transcription: cuDNN's heuristics are closed source.

Source snapshots read (pytorch/pytorch unless said otherwise): ``sdp_utils.cpp`` (newest
snapshot, plus a fork carrying the 2.10/2.11-era file, told apart by the PRs named below),
``sdp_utils_cpp.h`` and ``autocast_mode.h`` (installed torch 2.13 headers), ``attention.cpp``,
``attention_backward.cu``, ``flash_attn/flash_api.cpp``, ``mem_eff_attention/kernel_backward.h``,
``mem_eff_attention/kernels/cutlass{F,B}.h``, ``cudnn/MHA.cpp``, ``CublasHandlePool.cpp``,
``torch/_meta_registrations.py`` (installed 2.13) and NVIDIA/cudnn-frontend
``scaled_dot_product_flash_attention.h``.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = (
    # versions
    "TARGET_TORCH_VERSION",
    "BUNDLED_CUDNN_VERSION",
    "parse_torch_version",
    # 1. SDPA backend choice
    "AttentionBackend",
    "SdpaCall",
    "choose_sdpa_backend",
    "explain_sdpa_choice",
    "sdpa_priority_order",
    "prefers_cudnn_attention",
    "SDPA_BACKEND_CHECKS",
    # 2. fused-kernel memory
    "Buffer",
    "OutputCorrection",
    "forward_temporaries",
    "backward_temporaries",
    "sdpa_prologue_buffers",
    "meta_output_corrections",
    "peak_bytes",
    "FORWARD_TEMPORARIES",
    "BACKWARD_TEMPORARIES",
    "flash_num_splits",
    "DEFAULT_SM_COUNT",
    # 3. autocast
    "AutocastPolicy",
    "LOWER_PRECISION_OPS",
    "FP32_OPS",
    "FP32_SET_OPT_DTYPE_OPS",
    "FP32_APPEND_DTYPE_OPS",
    "PROMOTE_OPS",
    "BANNED_OPS",
    "autocast_policy",
    "autocast_lists",
    # 4. cuBLAS
    "CUBLAS_WORKSPACES_PER_TRAINING_STEP",
    "cublas_workspaces_in_training_step",
    "separate_cublaslt_workspaces_in_training_step",
    # 5. cuDNN convolution
    "ConvDirection",
    "conv_workspace_bytes",
)

# =============================================================================================
# Versions
# =============================================================================================

#: The PyTorch the GPU machine runs (``torch 2.11.0+cu130``, /work/.library/device/KINDS.md).
TARGET_TORCH_VERSION = "2.11"

#: cuDNN bundled with the default PyPI wheel (``Requires-Dist: nvidia-cudnn-cu1x==…`` in each
#: wheel's METADATA, read with ``pip install --dry-run --report``), as
#: ``cudnnGetVersion()`` reports it (major*10000 + minor*100 + patch).
BUNDLED_CUDNN_VERSION: dict[tuple[int, int], int] = {
    (2, 9): 91002,  # torch 2.9.0: nvidia-cudnn-cu12==9.10.2.21 (CUDA 12.8 wheel)
    (2, 10): 91002,  # torch 2.10.0: nvidia-cudnn-cu12==9.10.2.21 (CUDA 12.8 wheel)
    (2, 11): 91900,  # torch 2.11.0: nvidia-cudnn-cu13==9.19.0.56 (CUDA 13.0 wheel)
    (2, 12): 92000,  # torch 2.12.0: nvidia-cudnn-cu13==9.20.0.48 (CUDA 13.0 wheel)
}

_VERSION = re.compile(r"\s*(\d+)\.(\d+)")


def parse_torch_version(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` → ``(2, 11)``; only major.minor decide the rules here."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}; expected e.g. '2.11' or '2.11.0+cu130'")
    return int(match.group(1)), int(match.group(2))


def _cudnn_version(torch_version: tuple[int, int], cudnn_version: int | None) -> int:
    """The cuDNN the checks see: the caller's, else the wheel's, else the 2.11 one."""
    if cudnn_version is not None:
        return cudnn_version
    if torch_version in BUNDLED_CUDNN_VERSION:
        return BUNDLED_CUDNN_VERSION[torch_version]
    # older wheels bundled cuDNN 9.1–9.8 (below every threshold that matters); newer ones ≥ 9.20
    return 90100 if torch_version < (2, 9) else BUNDLED_CUDNN_VERSION[(2, 12)]


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# =============================================================================================
# 1. SDPA backend selection — aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
# =============================================================================================


class AttentionBackend(str, enum.Enum):
    """``at::SDPBackend`` as ``_fused_sdp_choice_cuda`` returns it (``ATen/SDPBackend.h``)."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"
    MATH = "math"


@dataclass(frozen=True)
class SdpaCall:
    """What ``select_sdp_backend`` can see of one dense (non-nested) 4-D SDPA call.

    Shapes follow SDPA's ``(batch, heads, seq, head_dim)``; key and value share ``heads_kv``
    and ``seq_kv``. ``requires_grad`` is ``input_requires_grad``: any of q/k/v requires grad
    *and* grad mode is on. ``mask_requires_grad`` matters only to cuDNN (which refuses it).
    ``query_contiguous_last_dim`` stands for "q, k, v (and the mask) have stride 1 in the last
    dimension" (``check_last_dim_stride_equals_1_dense``).
    """

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    has_mask: bool
    dropout_p: float
    is_causal: bool
    requires_grad: bool
    enable_gqa: bool = False
    query_contiguous_last_dim: bool = True
    mask_requires_grad: bool = False

    @property
    def is_half(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)


_HALF = frozenset({torch.float16})
_HALF_BF16 = frozenset({torch.float16, torch.bfloat16})
_HALF_FLOAT = frozenset({torch.float16, torch.float32})
_HALF_FLOAT_BF16 = frozenset({torch.float16, torch.float32, torch.bfloat16})

#: ``check_sm_version<sm80, sm121>`` (flash, cuDNN) and ``<sm50, sm121>`` (mem-efficient) in
#: 2.11. 2.4–2.6 stopped at sm90 for both; sm100/sm120 came with 2.7, sm121 with #152314.
_FLASH_SM_RANGE = ((8, 0), (12, 1))
_MEM_EFF_SM_RANGE = ((5, 0), (12, 1))
_CUDNN_SM_RANGE = ((8, 0), (12, 1))
#: check_head_dim_size_flash: "All head_dim sizes must be equal and less than 256".
FLASH_MAX_HEAD_DIM = 256
#: check_cudnn_tensor_shapes: ``auto head_dim_limit = 128;`` before the per-arch raises.
CUDNN_BASE_HEAD_DIM_LIMIT = 128

Reason = str | None
_Check = Callable[[SdpaCall, tuple[int, int], int], Reason]


def _in_sm_range(cc: tuple[int, int], bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    return bounds[0] <= tuple(cc) <= bounds[1]


def _minimum_gemm_alignment(call: SdpaCall, cc: tuple[int, int]) -> int:
    """``minimum_gemm_alignment``: elements q/k/v's last dim must be a multiple of for the
    CUTLASS mem-efficient kernels — 4 on sm80+, raised to one 128-bit vector (8 halves,
    4 floats) wherever tensor cores run (sm80+, or sm70+ for half)."""
    use_tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and call.is_half)
    alignment = 4 if cc[0] >= 8 else 1
    if use_tensor_cores:
        alignment = max(alignment, 128 // (16 if call.is_half else 32))
    return alignment


# ---- checks shared by the fused backends (sdp_utils_cpp.h) ----------------------------------
def _check_nonzero_seq(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_nonzero_sequence_lengths_dense."""
    if call.seq_q == 0 or call.seq_kv == 0:
        return "fused kernels do not support zero seq_len_q or seq_len_kv"
    return None


def _check_last_dim_stride(ignore_singleton: bool) -> _Check:
    """check_last_dim_stride_equals_1_dense<ignore_singleton_dim>."""

    def check(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
        if call.query_contiguous_last_dim or (ignore_singleton and call.head_dim == 1):
            return None
        return "fused kernels require the last dimension of q, k, v to have stride 1"

    return check


def _check_heads(supports_gqa: bool) -> _Check:
    """check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>: with
    ``enable_gqa`` and a GQA-capable backend, heads_q must be a multiple of heads_kv; otherwise
    all heads must match. (k and v share ``heads_kv`` here, so cuDNN's
    ``requires_same_num_heads=false`` changes nothing.)"""

    def check(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
        if call.enable_gqa and supports_gqa:
            if call.heads_kv <= 0 or call.heads_q % call.heads_kv:
                return "heads of key/value must divide heads of query"
            return None
        if call.heads_q != call.heads_kv:
            return "fused kernel needs equal heads (this backend has no GQA, or enable_gqa is False)"
        return None

    return check


def _check_dtype(allowed_sm80: frozenset[torch.dtype], allowed_below: frozenset[torch.dtype]) -> _Check:
    """check_tensor_dtype with the sm80 split every backend uses (bf16 needs sm80+)."""

    def check(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
        allowed = allowed_sm80 if cc[0] >= 8 else allowed_below
        if call.dtype not in allowed:
            return f"dtype {call.dtype} not in {sorted(str(d) for d in allowed)} on sm{cc[0]}{cc[1]}"
        return None

    return check


# ---- flash (can_use_flash_attention) ---------------------------------------------------------
def _flash_no_mask(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_for_attn_mask: "Flash Attention does not support non-null attn_mask"."""
    return "flash does not take an attn_mask" if call.has_mask else None


def _flash_head_dim(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_head_dim_size_flash: q, k, v last dims equal and ≤ 256. Not a multiple of 8 is
    fine: ``scaled_dot_product_attention`` pads q/k/v with ``pad_last_dim<8>`` (attention.cpp)."""
    if call.head_dim != call.head_dim_v or call.head_dim > FLASH_MAX_HEAD_DIM:
        return "flash needs equal q/k/v head dims ≤ 256"
    return None


def _flash_hardware(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_flash_attention_hardware_support: sm80 … sm121."""
    return None if _in_sm_range(cc, _FLASH_SM_RANGE) else "flash needs sm80–sm121"


def _flash_training_head_dim(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: on sm86–89 and
    sm120–121 (≈100 KB shared memory) flash backward cannot do head_dim ∈ (192, 224], nor
    (224, 256] with dropout."""
    small_smem = _in_sm_range(cc, ((8, 6), (8, 9))) or _in_sm_range(cc, ((12, 0), (12, 1)))
    if not (call.requires_grad and small_smem):
        return None
    supported = call.head_dim <= 192 or (call.dropout_p <= 0.0 and call.head_dim > 224)
    return None if supported else "flash backward: head_dim (192, 224], or > 224 with dropout, on sm86/89/120"


def _flash_causal_square(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_flash_causal_non_square_seqlens: FA2's causal mask is bottom-right aligned, so
    PyTorch refuses is_causal with seq_q != seq_kv."""
    if call.is_causal and call.seq_q != call.seq_kv:
        return "flash refuses is_causal with seq_q != seq_kv"
    return None


_FLASH_CHECKS: tuple[_Check, ...] = (
    _flash_no_mask,
    _flash_head_dim,
    _flash_hardware,
    _flash_training_head_dim,
    _flash_causal_square,
    _check_dtype(_HALF_BF16, _HALF),  # check_dtypes_flash_attention (FA3 opt-in ignored)
    _check_heads(supports_gqa=True),
    _check_nonzero_seq,
    _check_last_dim_stride(ignore_singleton=True),
)


# ---- mem-efficient (can_use_mem_efficient_attention) -----------------------------------------
def _mem_eff_hardware(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_mem_efficient_hardware_support: sm50 … sm121."""
    return None if _in_sm_range(cc, _MEM_EFF_SM_RANGE) else "mem-efficient needs sm50–sm121"


def _mem_eff_head_dim(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_head_dim_size_mem_efficient: q/k/v last dims > 0 and multiples of
    minimum_gemm_alignment — no upper bound on CUDA (the kMaxK=65536 kernels) and no padding."""
    alignment = _minimum_gemm_alignment(call, cc)
    for dim in (call.head_dim, call.head_dim_v):
        if dim <= 0 or dim % alignment:
            return f"mem-efficient needs head dims divisible by {alignment}"
    return None


_MEM_EFF_CHECKS: tuple[_Check, ...] = (
    _mem_eff_hardware,
    _mem_eff_head_dim,
    _check_nonzero_seq,
    _check_last_dim_stride(ignore_singleton=False),
    # 2.11 passes check_batch_size_and_num_heads_dense<false>: no GQA. GQA came with #191085
    # (2026-07), after 2.13.
    _check_heads(supports_gqa=False),
    _check_dtype(_HALF_FLOAT_BF16, _HALF_FLOAT),
)


# ---- cuDNN (can_use_cudnn_attention) ---------------------------------------------------------
def _cudnn_dropout_window(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """can_use_cudnn_attention: "cuDNN version does not support dropout in SDPA (9.11 - 9.13)"."""
    if call.dropout_p > 0.0 and 91100 < cudnn < 91400:
        return "cuDNN 9.11–9.13 cannot do SDPA dropout"
    return None


def _cudnn_hardware(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_cudnn_hardware_support: sm80 … sm121."""
    return None if _in_sm_range(cc, _CUDNN_SM_RANGE) else "cuDNN SDPA needs sm80–sm121"


def _cudnn_mask(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_attn_mask_shape: a mask that requires grad is refused (we assume the mask is 2-D
    or 4-D and broadcastable, which SDPA's input validation already demands)."""
    return "cuDNN SDPA refuses an attn_mask that requires grad" if call.has_mask and call.mask_requires_grad else None


def _cudnn_head_dim_limit(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> int:
    """check_cudnn_tensor_shapes (2.10/2.11 form): 128; 256 on sm90.0 with cuDNN ≥ 9.10;
    192 on sm10x for the DeepSeek (d_qk, d_v) = (192, 128) case with cuDNN ≥ 9.11.
    (Newer snapshots need cuDNN > 9.22 and a frontend ≥ 1.24 for 256.)"""
    if cudnn >= 91000 and tuple(cc) == (9, 0):
        return 256
    if cudnn >= 91100 and cc[0] == 10 and (call.head_dim, call.head_dim_v) == (192, 128):
        return 192
    return CUDNN_BASE_HEAD_DIM_LIMIT


def _cudnn_shapes(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
    """check_cudnn_tensor_shapes: head-dim limit and multiple of 8, no seq_kv of 1, no seq_q
    of 1 with dropout (the cuDNN < 9 rules are kept for completeness)."""
    limit = _cudnn_head_dim_limit(call, cc, cudnn)
    if call.head_dim > limit or call.head_dim_v > limit:
        return f"cuDNN SDPA head_dim limit is {limit} here"
    if call.head_dim % 8 or call.head_dim_v % 8:
        return "cuDNN SDPA needs head dims divisible by 8"
    if cudnn < 8903:
        return "cuDNN SDPA needs cuDNN ≥ 8.9.3"
    if cudnn < 90000 and (call.seq_q < 64 or (call.dropout_p > 0 and (call.seq_q % 64 or call.seq_kv % 64))):
        return "cuDNN < 9.0 sequence-length limits"
    if call.seq_kv == 1:
        return "cuDNN SDPA does not support key/value sequence length 1"
    if call.seq_q == 1 and call.dropout_p > 0.0:
        return "cuDNN SDPA does not support query sequence length 1 with dropout"
    return None


_CUDNN_CHECKS: tuple[_Check, ...] = (
    _cudnn_dropout_window,
    _check_dtype(_HALF_BF16, _HALF),  # check_dtypes_low_precision
    _cudnn_mask,
    _cudnn_hardware,
    _check_nonzero_seq,
    _check_last_dim_stride(ignore_singleton=True),
    # check_batch_size_and_num_heads_dense<true /*enable_gqa*/, false /*same heads*/>
    _check_heads(supports_gqa=True),
    _cudnn_shapes,
)

#: Registry: the constraint list each fused backend runs (``can_use_<backend>``).
SDPA_BACKEND_CHECKS: dict[AttentionBackend, tuple[_Check, ...]] = {
    AttentionBackend.FLASH: _FLASH_CHECKS,
    AttentionBackend.EFFICIENT: _MEM_EFF_CHECKS,
    AttentionBackend.CUDNN: _CUDNN_CHECKS,
    AttentionBackend.MATH: (),
}

#: ``Context::sdp_priority_order`` default (ATen/Context.h): cuDNN comes after math, so it is
#: never reached unless ``check_prefer_cudnn_attention`` reorders.
DEFAULT_PRIORITY = (AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.MATH, AttentionBackend.CUDNN)
#: The order ``priority_order`` installs when cuDNN is preferred.
CUDNN_FIRST_PRIORITY = (AttentionBackend.CUDNN, AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.MATH)
#: The cuDNN headers the torch 2.9.0 CUDA 12.8 wheels were compiled against (pytorch#165801).
CUDNN_HEADERS_OF_2_9_WHEELS = 90800
#: ``cudnn_version > 91500`` in check_prefer_cudnn_attention: 9.15.1 fixed seq_len % 128 != 0
#: (pytorch#169849, #171627).
CUDNN_PREFERRED_MIN_EXCLUSIVE = 91500


def prefers_cudnn_attention(
    compute_capability: tuple[int, int], torch_version: str = TARGET_TORCH_VERSION, cudnn_version: int | None = None
) -> bool:
    """``check_prefer_cudnn_attention`` by release (TORCH_CUDNN_SDPA_DEPRIORITIZED unset).

    * ≤ 2.4, 2.6–2.8: never (2.5.0 put cuDNN first on sm90 and 2.5.1 took it back, #138522;
      ``"2.5"`` is read as 2.5.1).
    * 2.9: build-time ``CUDNN_VERSION >= 90900`` and sm90.0/sm100.0 (#162073). The 2.9.0 wheels
      were built against 9.8 headers, so it stayed off there (#165801).
    * 2.10–2.11: runtime cuDNN > 9.15.0 and sm 9.0, 10.0 or 10.3 (#170800, #171627). torch 2.10
      wheels bundle 9.10.2 (off); **torch 2.11 bundles 9.19 → cuDNN first on H100/H200/B200**.
    * ≥ 2.12: CUDA ≥ 13 builds drop the minor check, any 9.x/10.x (#180997).
    """
    version = parse_torch_version(torch_version)
    cudnn = _cudnn_version(version, cudnn_version)
    major, minor = compute_capability
    if version < (2, 9):
        return False
    if version == (2, 9):
        # a build-time check: the caller's cudnn_version stands for CUDNN_VERSION of the build
        built_with = cudnn_version if cudnn_version is not None else CUDNN_HEADERS_OF_2_9_WHEELS
        return built_with >= 90900 and major in (9, 10) and minor == 0
    if cudnn <= CUDNN_PREFERRED_MIN_EXCLUSIVE or major not in (9, 10):
        return False
    if version <= (2, 11):
        return minor in (0, 3)
    return True


def sdpa_priority_order(
    compute_capability: tuple[int, int], torch_version: str = TARGET_TORCH_VERSION, cudnn_version: int | None = None
) -> tuple[AttentionBackend, ...]:
    """``priority_order``: the order ``select_sdp_backend`` tries backends in."""
    if prefers_cudnn_attention(compute_capability, torch_version, cudnn_version):
        return CUDNN_FIRST_PRIORITY
    return DEFAULT_PRIORITY


def explain_sdpa_choice(
    call: SdpaCall,
    compute_capability: tuple[int, int],
    *,
    torch_version: str = TARGET_TORCH_VERSION,
    cudnn_version: int | None = None,
) -> dict[AttentionBackend, tuple[str, ...]]:
    """Why each backend would be refused (an empty tuple: it would run), in priority order."""
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    cudnn = _cudnn_version(parse_torch_version(torch_version), cudnn_version)
    reasons: dict[AttentionBackend, tuple[str, ...]] = {}
    for backend in sdpa_priority_order(cc, torch_version, cudnn_version):
        found = (check(call, cc, cudnn) for check in SDPA_BACKEND_CHECKS[backend])
        reasons[backend] = tuple(reason for reason in found if reason is not None)
    return reasons


def choose_sdpa_backend(
    call: SdpaCall,
    compute_capability: tuple[int, int],
    *,
    torch_version: str = TARGET_TORCH_VERSION,
    cudnn_version: int | None = None,
) -> AttentionBackend:
    """The backend ``_fused_sdp_choice_cuda`` picks with default settings (all backends
    enabled, no ``sdpa_kernel`` context, deterministic algorithms off, dense inputs).

    ``select_sdp_backend`` walks :func:`sdpa_priority_order` and returns the first backend
    whose every constraint passes; math always passes.
    """
    for backend, reasons in explain_sdpa_choice(
        call, compute_capability, torch_version=torch_version, cudnn_version=cudnn_version
    ).items():
        if not reasons:
            return backend
    return AttentionBackend.MATH  # unreachable: math has no constraints


# =============================================================================================
# 2. Memory of the fused kernels
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
        return math.prod(self.shape) * _element_size(self.dtype)


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


#: SM counts used when the caller gives none (flash's split-KV and deterministic heuristics
#: read ``multiProcessorCount``): A100 108, A10/A40-class 84, L40S/4090-class 128 (RTX 4090;
#: L40S has 142), H100 SXM/H200 132, B200 148, RTX 5090 170. An assumption per family.
DEFAULT_SM_COUNT: dict[tuple[int, int], int] = {
    (7, 0): 80,
    (7, 5): 40,
    (8, 0): 108,
    (8, 6): 84,
    (8, 9): 128,
    (9, 0): 132,
    (10, 0): 148,
    (12, 0): 170,
}


def _sm_count(compute_capability: tuple[int, int], sm_count: int | None) -> int:
    if sm_count is not None:
        return sm_count
    return DEFAULT_SM_COUNT.get(tuple(compute_capability), 108)


# ---- flash (flash_attn/flash_api.cpp) --------------------------------------------------------
def _flash_head_sizes(head_dim: int) -> tuple[int, int]:
    """mha_fwd/mha_bwd: ``head_size = round_multiple(head_size_og, 8)`` (SDPA already padded)
    and ``head_size_rounded = round_multiple(head_size, head_size <= 128 ? 32 : 64)``."""
    head_size = _round_up(head_dim, 8)
    return head_size, _round_up(head_size, 32 if head_size <= 128 else 64)


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
        return n == 1 or _ceil_div(num_n_blocks, n) != _ceil_div(num_n_blocks, n - 1)

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


def flash_num_splits(call: SdpaCall, compute_capability: tuple[int, int], sm_count: int | None = None) -> int:
    """``set_params_splitkv`` with ``num_splits = 0``: how many KV splits mha_fwd runs (1: no
    split, no accumulators). SplitKV is off with dropout."""
    if call.dropout_p > 0.0:
        return 1
    head_size, _ = _flash_head_sizes(call.head_dim)
    block_n = 256 if head_size <= 64 else (128 if head_size <= 128 else 64)
    num_n_blocks = _ceil_div(call.seq_kv, block_n)
    num_m_blocks = _ceil_div(call.seq_q, 64)
    sms = _sm_count(compute_capability, sm_count) * FLASH_SPLITKV_SM_FACTOR
    return _num_splits_heuristic(call.batch * call.heads_q * num_m_blocks, sms, num_n_blocks, FLASH_SPLITKV_MAX_SPLITS)


def _flash_forward(call: SdpaCall, cc: tuple[int, int], sm_count: int | None, **_: object) -> list[Buffer]:
    """mha_fwd → set_params_splitkv: with ``num_splits > 1``,
    ``softmax_lse_accum = empty({S, B, H, Lq}, float)`` and
    ``out_accum = empty({S, B, H, Lq, head_size_rounded}, float)``; nothing else is scratch
    (out, softmax_lse, rng_state are outputs)."""
    splits = flash_num_splits(call, cc, sm_count)
    if splits <= 1:
        return []
    _, rounded = _flash_head_sizes(call.head_dim)
    shape = (splits, call.batch, call.heads_q, call.seq_q)
    return [
        Buffer("flash_softmax_lse_accum", shape, torch.float32),
        Buffer("flash_out_accum", (*shape, rounded), torch.float32),
    ]


def _flash_backward(
    call: SdpaCall,
    cc: tuple[int, int],
    sm_count: int | None,
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
    seq_q_rounded = _round_up(call.seq_q, FLASH_SEQ_ROUND)
    b, h = call.batch, call.heads_q
    buffers: list[Buffer] = []
    if grad_out_needs_copy:
        buffers.append(Buffer("flash_grad_out_contiguous", (b, call.seq_q, h, head_size), call.dtype))
    buffers.append(Buffer("flash_softmax_d", (b, h, seq_q_rounded), torch.float32))
    accum = (b, seq_q_rounded, h, rounded)
    if deterministic:
        nsplits = _ceil_div(_sm_count(cc, sm_count), b * h)
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


def _mem_eff_forward(call: SdpaCall, cc: tuple[int, int], sm_count: int | None, **_: object) -> list[Buffer]:
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
    num_splits_key = _ceil_div(n, bj)
    if b * h >= 256 and n <= 2 * bj:  # parallelism_without_split_key = 1 * H * B
        num_splits_key = 1
    if accum_kv:
        num_splits_key = min(num_splits_key, 200 // (b * h))
    if not enable_split_keys or num_splits_key < 1:
        num_splits_key = 1
    gk = num_splits_key * bj * _round_up(call.head_dim, bi) if accum_kv else 0
    gv = num_splits_key * bj * _round_up(call.head_dim_v, bi) if accum_kv else 0
    gq = _ceil_div(m, bi) * _ceil_div(call.head_dim, bj) * (4 + bi * bj) if accum_q else 0
    return b * h * _round_up(gk + gv + gq, 4) * 4


def _mem_eff_backward(
    call: SdpaCall, cc: tuple[int, int], sm_count: int | None, grad_out_needs_copy: bool = False, **_: object
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
def _cudnn_forward(call: SdpaCall, cc: tuple[int, int], sm_count: int | None, **_: object) -> list[Buffer]:
    """run_cudnn_SDP_fprop allocates ``mha_graph->get_workspace_size()`` through the caching
    allocator. The frontend part is 0 without ALiBi; the engine's own part is not public and is
    taken as 0 (the fprop kernels keep everything on chip)."""
    return []


def _cudnn_backward(
    call: SdpaCall, cc: tuple[int, int], sm_count: int | None, grad_out_needs_copy: bool = False, **_: object
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
    sm_count: int | None = None,
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
    sm_count: int | None = None,
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
        padded = _round_up(call.head_dim, 8)
        buffers.append(Buffer("sdpa_query_padded", (call.batch, call.heads_q, call.seq_q, padded), call.dtype))
        buffers.append(Buffer("sdpa_key_padded", (call.batch, call.heads_kv, call.seq_kv, padded), call.dtype))
        buffers.append(Buffer("sdpa_value_padded", (call.batch, call.heads_kv, call.seq_kv, padded), call.dtype))
    if not call.has_mask or mask_shape is None or backend is AttentionBackend.FLASH:
        return buffers
    if mask_is_bool:
        buffers.append(Buffer("sdpa_mask_float", tuple(mask_shape), call.dtype))
    if backend is AttentionBackend.EFFICIENT and call.seq_kv % 16:
        padded_mask = (call.batch, call.heads_q, call.seq_q, _round_up(call.seq_kv, 16))
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


# =============================================================================================
# 3. CUDA autocast — aten/src/ATen/autocast_mode.{h,cpp}
# =============================================================================================

AutocastPolicy = Literal["lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned", "none"]

#: AT_FORALL_LOWER_PRECISION_FP + the two CUDA-only registrations (cudnn_convolution,
#: cudnn_convolution_transpose) in ``TORCH_LIBRARY_IMPL(aten, Autocast, m)``: run in the
#: autocast dtype (fp16 by default on CUDA, bf16 when asked).
LOWER_PRECISION_OPS: frozenset[str] = frozenset({
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
})  # fmt: skip

#: AT_FORALL_FP32 (2.11): cast every floating input to float32. ``rms_norm`` joined in 2.12
#: (#174824), see :func:`autocast_lists`.
FP32_OPS: frozenset[str] = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
})  # fmt: skip

#: AT_FORALL_FP32_SET_OPT_DTYPE: when the first tensor is eligible and no ``dtype=`` is given,
#: pass ``dtype=float32`` (the op computes and returns fp32 without casting its input first).
FP32_SET_OPT_DTYPE_OPS: frozenset[str] = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum",
})  # fmt: skip

#: AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: ``norm.Scalar`` / ``norm.ScalarOpt_dim`` redispatch
#: with an appended ``dtype`` = float32 (or the input's dtype when it is not eligible).
FP32_APPEND_DTYPE_OPS: frozenset[str] = frozenset({"norm"})

#: AT_FORALL_PROMOTE: cast all floating inputs to the widest floating input type. ``cat`` and
#: ``stack`` are *not* here any more: native type promotion handles them.
PROMOTE_OPS: frozenset[str] = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
})  # fmt: skip

#: ``binary_cross_entropy_banned``: raises "unsafe to autocast" under CUDA autocast.
BANNED_OPS: frozenset[str] = frozenset({"binary_cross_entropy"})

#: Python-level names that reach an aten op of another name.
_AUTOCAST_ALIASES: dict[str, str] = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "multi_dot": "linalg_multi_dot",
    "grid_sample": "grid_sampler",
    "vector_norm": "linalg_vector_norm",
    "matrix_norm": "linalg_matrix_norm",
}


def autocast_lists(torch_version: str = TARGET_TORCH_VERSION) -> dict[AutocastPolicy, frozenset[str]]:
    """Op names (no overload) per CUDA autocast policy for ``torch_version``.

    The lists are 2.11's; the one known later change is ``rms_norm`` → fp32 in 2.12 (#174824,
    which also makes an fp32 output from bf16 inputs under autocast). Earlier versions are
    assumed equal to 2.11 except where noted; not verified below 2.11.
    """
    fp32 = FP32_OPS | ({"rms_norm"} if parse_torch_version(torch_version) >= (2, 12) else frozenset())
    return {
        "lower": LOWER_PRECISION_OPS,
        "fp32": fp32,
        "fp32_set_opt_dtype": FP32_SET_OPT_DTYPE_OPS,
        "fp32_append_dtype": FP32_APPEND_DTYPE_OPS,
        "promote": PROMOTE_OPS,
        "banned": BANNED_OPS,
    }


def _base_op_name(op_name: str) -> str:
    """``"aten::softmax.int"`` / ``"softmax.int"`` / ``"torch.softmax"`` → ``"softmax"``, but
    keep ``"_convolution.deprecated"`` whole (both overloads of _convolution are listed)."""
    name = op_name.removeprefix("aten::").removeprefix("torch.")
    if name == "_convolution.deprecated":
        return name
    name = name.split(".", 1)[0]
    return _AUTOCAST_ALIASES.get(name, name)


def autocast_policy(op_name: str, torch_version: str = TARGET_TORCH_VERSION) -> AutocastPolicy:
    """What CUDA autocast does with ``op_name`` ("none": the op is not registered and runs in
    whatever dtypes reach it).

    Cast inputs go through ``cached_cast``: a cast is cached — and so reused by every later op
    in the autocast region — only when it is a cast *to the lower-precision dtype* of a tensor
    that is eligible (floating, on the autocast device, not float64), float32, requires grad,
    is a leaf, is not a view, the cache is enabled (``cache_enabled=True``, default), and is
    not already a cached tensor. In practice: fp32 parameters. Other casts (activations, fp32
    casts, frozen weights with ``requires_grad=False``) are redone per op and freed unless
    autograd saves them. The cache is keyed by the source TensorImpl and holds the cast alive
    until ``clear_cache()``, which ``torch.autocast.__exit__`` calls when the *outermost*
    autocast region exits (``autocast_decrement_nesting() == 0``) — the end of the forward in
    the usual training loop; casts autograd saved live on until backward frees them.
    """
    name = _base_op_name(op_name)
    for policy, names in autocast_lists(torch_version).items():
        if name in names:
            return policy
    return "none"


# =============================================================================================
# 4. cuBLAS workspaces — aten/src/ATen/cuda/CublasHandlePool.cpp
# =============================================================================================

#: Workspaces a single-GPU training step holds in 2.11 (sizes: memcalc.gpus).
#:
#: ``getCurrentCUDABlasHandle`` → ``setWorkspaceForHandle`` keys each workspace by
#: ``(cublasHandle_t, cudaStream_t)`` in ``cublas_handle_stream_to_workspace()`` and allocates it
#: through the caching allocator (``allocateCUDABlasWorkspace`` → ``CUDACachingAllocator::get()
#: ->allocate``); it stays allocated for the process's life. Handles come from a
#: ``DeviceThreadHandlePool`` through a *thread-local* ``PoolWindow``, so each thread that runs
#: cuBLAS gets its own handle. The forward (and loss) run on the Python thread; the autograd
#: engine runs CUDA backward on its own per-device worker thread, on the same stream. Two
#: (handle, stream) pairs → two workspaces. cuBLASLt (addmm with bias, …) shares the cuBLAS
#: entry in 2.11 (``unified_cublas_and_lt_workspaces()`` is on by default outside fbcode since
#: #168175), so it adds none.
CUBLAS_WORKSPACES_PER_TRAINING_STEP = 2


def cublas_workspaces_in_training_step(torch_version: str = TARGET_TORCH_VERSION) -> int:
    """Persistent cuBLAS workspaces (caching-allocator blocks) after one forward + backward on
    one GPU and the default stream.

    2.4–2.12: two, as :data:`CUBLAS_WORKSPACES_PER_TRAINING_STEP` explains (2.3 and CUDA ≥ 12.2
    builds briefly let cuBLAS allocate its own workspace, #113994; #124250 restored the explicit
    one for 2.4). Newer snapshots make caching opt-in (``TORCH_CUBLAS_WORKSPACE_CACHE``) and fall
    back to cuBLAS's own workspace; that is not modelled (assumed two as well).
    """
    return CUBLAS_WORKSPACES_PER_TRAINING_STEP


def separate_cublaslt_workspaces_in_training_step(torch_version: str = TARGET_TORCH_VERSION) -> int:
    """Persistent cuBLASLt workspaces *besides* the cuBLAS ones (``CUBLASLT_WORKSPACE_SIZE``,
    1 MiB default, each).

    * ≤ 2.7: 0 persistent — the Lt workspace was a per-call temporary from the caching
      allocator (CUDABlas.cpp), so it shows as a transient 1 MiB block per Lt GEMM.
    * 2.8–2.10: two — #156495 made it persistent per (Lt handle, stream) in a second map.
    * ≥ 2.11: 0 — unified with the cuBLAS workspace by default (#168175).
    """
    version = parse_torch_version(torch_version)
    if (2, 8) <= version <= (2, 10):
        return CUBLAS_WORKSPACES_PER_TRAINING_STEP
    return 0


# =============================================================================================
# 5. cuDNN convolution workspace — a documented model
# =============================================================================================


class ConvDirection(str, enum.Enum):
    """The three cuDNN convolution operations (``convolution_backward`` runs one per mask bit)."""

    FORWARD = "forward"
    BACKWARD_DATA = "backward_data"
    BACKWARD_FILTER = "backward_filter"

    @classmethod
    def parse(cls, value: str | ConvDirection) -> ConvDirection:
        if isinstance(value, ConvDirection):
            return value
        aliases = {"backward_weight": cls.BACKWARD_FILTER, "backward_input": cls.BACKWARD_DATA,
                   "fprop": cls.FORWARD, "dgrad": cls.BACKWARD_DATA, "wgrad": cls.BACKWARD_FILTER}
        if value in aliases:
            return aliases[value]
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(d.value for d in cls)
            raise ValueError(f"unknown convolution direction {value!r}; expected one of {choices}") from None


def _uses_tensor_cores(dtype: torch.dtype, cc: tuple[int, int], allow_tf32: bool) -> bool:
    """fp16 on Volta+, bf16 on Ampere+, fp32 through TF32 on Ampere+ (``torch.backends.cudnn
    .allow_tf32`` defaults to True)."""
    if dtype == torch.float16:
        return cc >= (7, 0)
    if dtype == torch.bfloat16:
        return cc >= (8, 0)
    if dtype == torch.float32:
        return allow_tf32 and cc >= (8, 0)
    return False


def _is_depthwise(input_shape: Sequence[int], weight_shape: Sequence[int], groups: int) -> bool:
    return groups > 1 and groups == input_shape[1] and weight_shape[1] == 1


def conv_workspace_bytes(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    output_shape: Sequence[int],
    dtype: torch.dtype,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    direction: str | ConvDirection,
    compute_capability: tuple[int, int],
    *,
    channels_last: bool = False,
    allow_tf32: bool = True,
) -> int:
    """Estimated cuDNN workspace of one convolution call — a **model**, uncertainty high.

    What PyTorch does (Conv_v8.cpp, cuDNN v8 API, the default path): with
    ``torch.backends.cudnn.benchmark=False`` (default) it asks cuDNN's heuristics (mode A,
    falling back to mode B) for engine configs and ``try_plans`` them *in heuristic order*:
    ``run_conv_plan`` allocates ``plan.getWorkspaceSize()`` bytes from the caching allocator,
    runs, and frees them when the call returns; a plan whose workspace allocation throws
    ``OutOfMemoryError`` is skipped for the next one. ``CUDNN_CONV_WSCAP_DBG`` (MiB) is cuDNN's
    own cap on what heuristics may propose. So the workspace is a per-call temporary whose size
    is whatever the first heuristic engine wants — not published, not derivable from sources.

    The model (per call, bytes):

    * No tensor cores (fp32 without TF32, fp16 before Volta, fp64): 0 — implicit-precomputed-GEMM
      style engines need at most a small index buffer.
    * Depthwise (groups == C_in, one input channel per group): 0 — small dedicated kernels.
    * Tensor cores, NCHW (the default memory format): cuDNN "may use padding, folding, and
      NCHW-to-NHWC transformations to call the Tensor Core operations" (cuDNN developer guide,
      Legacy API › Convolution Functions › Data and Filter Formats); the transformed copies live
      in the workspace. Forward: bytes(x) + bytes(w) + bytes(y); backward-data:
      bytes(dy) + bytes(w) + bytes(dx); backward-filter: bytes(x) + bytes(dy) + the dW
      accumulator in fp32 (4·numel(w)).
    * Tensor cores, channels_last: forward and backward-data 0 (native NHWC implicit GEMM);
      backward-filter 4·numel(w) (split-K partial sums in fp32).

    Uncertainty: an upper-bound-flavoured guess for NCHW, easily 0 on some engines and a factor
    of 2 either way on others; measure with ``torch.cuda.memory_stats()["allocated_bytes.all.peak"]``
    around a single conv on the target GPU before trusting it. Stride, padding and dilation do
    not enter the model (they shape y, which does).
    """
    del stride, padding, dilation  # accepted for the call signature; the model ignores them
    which = ConvDirection.parse(direction)
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    if not _uses_tensor_cores(dtype, cc, allow_tf32) or _is_depthwise(input_shape, weight_shape, groups):
        return 0
    size = _element_size(dtype)
    x_bytes = math.prod(input_shape) * size
    w_bytes = math.prod(weight_shape) * size
    y_bytes = math.prod(output_shape) * size
    w_fp32 = math.prod(weight_shape) * 4
    if channels_last:
        return w_fp32 if which is ConvDirection.BACKWARD_FILTER else 0
    model: dict[ConvDirection, int] = {
        ConvDirection.FORWARD: x_bytes + w_bytes + y_bytes,
        ConvDirection.BACKWARD_DATA: y_bytes + w_bytes + x_bytes,
        ConvDirection.BACKWARD_FILTER: x_bytes + y_bytes + w_fp32,
    }
    return model[which]


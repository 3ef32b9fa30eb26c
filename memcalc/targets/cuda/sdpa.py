"""Which scaled-dot-product-attention backend CUDA runs: flash, memory-efficient, cuDNN or
math, as ``_fused_sdp_choice_cuda`` decides with default settings.

A meta-tensor run takes the math path; on a real GPU, PyTorch picks one of several attention
kernels. :func:`choose_sdpa_backend` transcribes that choice for PyTorch 2.11
(:data:`~memcalc.targets.versions.TARGET_TORCH_VERSION`); where 2.4–2.13 differ and the
difference is known, it takes ``torch_version``.

Source snapshots read (pytorch/pytorch): ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
(newest snapshot, plus a fork carrying the 2.10/2.11-era file, told apart by the PRs named
below), ``sdp_utils_cpp.h`` (installed torch 2.13 headers), ``attention.cpp`` and
``ATen/Context.h``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memcalc.targets.versions import (
    TARGET_TORCH_VERSION,
    cudnn_version_of,
    parse_torch_version,
)

__all__ = (
    "CUDNN_BASE_HEAD_DIM_LIMIT",
    "CUDNN_FIRST_PRIORITY",
    "DEFAULT_PRIORITY",
    "FLASH_MAX_HEAD_DIM",
    "SDPA_BACKEND_CHECKS",
    "AttentionBackend",
    "SdpaCall",
    "choose_sdpa_backend",
    "explain_sdpa_choice",
    "prefers_cudnn_attention",
    "sdpa_backend_checks",
    "sdpa_priority_order",
    "sdpa_sm_ranges",
)

# =============================================================================================
# SDPA backend selection — aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
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

_SmRange = tuple[tuple[int, int], tuple[int, int]]
#: ``check_sm_version<sm80, sm121>`` (flash, cuDNN) and ``<sm50, sm121>`` (mem-efficient) in
#: 2.11; older releases: :func:`sdpa_sm_ranges`.
_FLASH_SM_RANGE: _SmRange = ((8, 0), (12, 1))
_MEM_EFF_SM_RANGE: _SmRange = ((5, 0), (12, 1))
_CUDNN_SM_RANGE: _SmRange = ((8, 0), (12, 1))
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


def _hardware(name: str, bounds: _SmRange) -> _Check:
    """check_{flash_attention,mem_efficient,cudnn}_hardware_support: the compute capability
    within ``bounds`` (``check_sm_version<lower, upper>``, both ends included)."""
    (lo_major, lo_minor), (hi_major, hi_minor) = bounds
    reason = f"{name} needs sm{lo_major}{lo_minor}–sm{hi_major}{hi_minor}"

    def check(call: SdpaCall, cc: tuple[int, int], cudnn: int) -> Reason:
        return None if _in_sm_range(cc, bounds) else reason

    return check


_flash_hardware = _hardware("flash", _FLASH_SM_RANGE)


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
_mem_eff_hardware = _hardware("mem-efficient", _MEM_EFF_SM_RANGE)


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


_cudnn_hardware = _hardware("cuDNN SDPA", _CUDNN_SM_RANGE)


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

#: Registry: the constraint list each fused backend runs (``can_use_<backend>``) in 2.11;
#: :func:`sdpa_backend_checks` gives another release's.
SDPA_BACKEND_CHECKS: dict[AttentionBackend, tuple[_Check, ...]] = {
    AttentionBackend.FLASH: _FLASH_CHECKS,
    AttentionBackend.EFFICIENT: _MEM_EFF_CHECKS,
    AttentionBackend.CUDNN: _CUDNN_CHECKS,
    AttentionBackend.MATH: (),
}

_HARDWARE_CHECKS = {AttentionBackend.FLASH: _flash_hardware, AttentionBackend.EFFICIENT: _mem_eff_hardware,
                    AttentionBackend.CUDNN: _cudnn_hardware}
_HARDWARE_NAMES = {AttentionBackend.FLASH: "flash", AttentionBackend.EFFICIENT: "mem-efficient",
                   AttentionBackend.CUDNN: "cuDNN SDPA"}


def sdpa_sm_ranges(torch_version: str = TARGET_TORCH_VERSION) -> dict[AttentionBackend, _SmRange]:
    """The compute capabilities each fused backend accepts in ``torch_version``.

    * ≤ 2.6: flash and cuDNN ``check_sm_version<sm80, sm90>``, mem-efficient ``<sm50, sm90>``
      (sdp_utils.cpp read in a snapshot between v2.4.0 and v2.5.0 — ``enable_gqa`` support
      present, the 2.5.0 cuDNN-first ``priority_order`` not yet — and in older snapshots; the
      range only moved with the PRs below).
    * 2.7: flash and mem-efficient up to sm120 (pytorch#145602, "Add Blackwell support to SDPA":
      "adds sm_100 and sm_120 archs", merged 2025-01-24, after the 2.6 branch cut).
    * ≥ 2.8: up to sm121 (pytorch#152314, "Enable SDPA on sm_121", merged 2025-04-28).

    cuDNN's range from 2.7 on is the 2.11 one, not checked release by release: no release
    before 2.9 tries cuDNN before math (:func:`prefers_cudnn_attention`), so it decides nothing
    there. Every GPU of the catalogue (sm70–sm90) is inside every range.
    """
    version = parse_torch_version(torch_version)
    if version <= (2, 6):
        return {AttentionBackend.FLASH: ((8, 0), (9, 0)), AttentionBackend.EFFICIENT: ((5, 0), (9, 0)),
                AttentionBackend.CUDNN: ((8, 0), (9, 0))}
    if version == (2, 7):
        return {AttentionBackend.FLASH: ((8, 0), (12, 0)), AttentionBackend.EFFICIENT: ((5, 0), (12, 0)),
                AttentionBackend.CUDNN: _CUDNN_SM_RANGE}
    return {AttentionBackend.FLASH: _FLASH_SM_RANGE, AttentionBackend.EFFICIENT: _MEM_EFF_SM_RANGE,
            AttentionBackend.CUDNN: _CUDNN_SM_RANGE}


@functools.cache
def sdpa_backend_checks(torch_version: str = TARGET_TORCH_VERSION) -> dict[AttentionBackend, tuple[_Check, ...]]:
    """:data:`SDPA_BACKEND_CHECKS` as ``torch_version`` runs them: the hardware check of each
    fused backend takes that release's range (:func:`sdpa_sm_ranges`)."""
    ranges = sdpa_sm_ranges(torch_version)
    checks: dict[AttentionBackend, tuple[_Check, ...]] = {}
    for backend, constraints in SDPA_BACKEND_CHECKS.items():
        hardware = _HARDWARE_CHECKS.get(backend)
        if hardware is None:
            checks[backend] = constraints
            continue
        keyed = _hardware(_HARDWARE_NAMES[backend], ranges[backend])
        checks[backend] = tuple(keyed if check is hardware else check for check in constraints)
    return checks

#: ``Context::sdp_priority_order`` default (ATen/Context.h): cuDNN comes after math, so it is
#: never reached unless ``check_prefer_cudnn_attention`` reorders.
DEFAULT_PRIORITY = (AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.MATH, AttentionBackend.CUDNN)
#: The order ``priority_order`` installs when cuDNN is preferred.
CUDNN_FIRST_PRIORITY = (
    AttentionBackend.CUDNN, AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.MATH,
)
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
    cudnn = cudnn_version_of(version, cudnn_version)
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
    cudnn = cudnn_version_of(parse_torch_version(torch_version), cudnn_version)
    checks = sdpa_backend_checks(torch_version)
    reasons: dict[AttentionBackend, tuple[str, ...]] = {}
    for backend in sdpa_priority_order(cc, torch_version, cudnn_version):
        found = (check(call, cc, cudnn) for check in checks[backend])
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

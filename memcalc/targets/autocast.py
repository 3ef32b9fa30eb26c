"""What CUDA autocast does with an op: :func:`autocast_policy`, from the op lists of
``aten/src/ATen/autocast_mode.{h,cpp}``; and what CPU autocast does
(:func:`cpu_autocast_policy`, its own lists in the same file), for the CPU target.

Under ``torch.autocast("cuda")`` each registered op casts its floating inputs by one of a few
policies (run in fp16/bf16, run in fp32, promote to the widest input, ...); ops not listed run
in whatever dtypes reach them. Source snapshots read: ``autocast_mode.h`` (installed torch
2.13 headers) and ``autocast_mode.cpp`` (pytorch/pytorch); the lists are 2.11's.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from memcalc.targets.versions import TARGET_TORCH_VERSION, parse_torch_version

__all__ = (
    "BANNED_OPS",
    "CPU_FP32_OPS",
    "CPU_LOWER_PRECISION_OPS",
    "CPU_PROMOTE_OPS",
    "FP32_APPEND_DTYPE_OPS",
    "FP32_OPS",
    "FP32_SET_OPT_DTYPE_OPS",
    "LOWER_PRECISION_OPS",
    "PROMOTE_OPS",
    "AutocastPolicy",
    "autocast_lists",
    "autocast_policy",
    "cpu_autocast_lists",
    "cpu_autocast_policy",
)

# =============================================================================================
# CUDA autocast — aten/src/ATen/autocast_mode.{h,cpp}
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
    # aten/src/ATen/cudnn/AutocastRNN.cpp (CUDA builds with cuDNN): _cudnn_rnn casts its input,
    # weights and states to the autocast dtype (_cudnn_rnn_cast_reflatten)
    "_cudnn_rnn",
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

    The lists are 2.11's; the known later changes are ``rms_norm`` → fp32 in 2.12 (#174824,
    which also makes an fp32 output from bf16 inputs under autocast; pytorch#188955 reports "the
    rms_norm autocast fp32 policy (2.12)" against "the 2.11 baseline") and the new
    ``linalg_matrix_sqrth`` in 2.14 (:data:`_FP32_FROM_2_14`). The lists of every torch that CI's
    version matrix installs (2.11, 2.13, 2.14) are checked against that torch's dispatcher
    (tests/test_kernels.py). Earlier versions are assumed equal to 2.11: not verified below 2.11.
    """
    version = parse_torch_version(torch_version)
    fp32 = FP32_OPS | ({"rms_norm"} if version >= (2, 12) else frozenset()) | (
        _FP32_FROM_2_14 if version >= (2, 14) else frozenset())
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


@functools.cache  # asked once per call that reaches the CUDA emulation; its answer is the lists' (frozen) data
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
# CPU autocast — TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) in aten/src/ATen/autocast_mode.cpp
# =============================================================================================
# Lists of their own, not CUDA's: no fp32_set_opt_dtype policy (softmax, log_softmax, sum and
# cumsum run in the dtype that reaches them), layer_norm, group_norm, exp, log, pow, ... in no
# list (they too run as they come), fewer lower-precision ops (no addmv, mv, addr, einsum,
# chain_matmul, the RNN cells), binary_cross_entropy run in float32 (not banned), and cat,
# stack, index_copy promoted. Checked against the installed dispatcher's AutocastCPU kernels
# (torch 2.13, tests/test_cpu_autocast.py).

#: KERNEL_CPU(..., lower_precision_fp): run in the autocast dtype (bfloat16 by default on the CPU).
CPU_LOWER_PRECISION_OPS: frozenset[str] = frozenset({
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation",
    "addbmm", "linear", "_convolution.deprecated", "matmul", "conv_tbc", "mkldnn_rnn_layer",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "_native_multi_head_attention",
})  # fmt: skip

#: KERNEL_CPU(..., fp32): cast every floating input to float32.
CPU_FP32_OPS: frozenset[str] = frozenset({
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile", "nanquantile",
    "stft", "cdist", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace",
    "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr",
    "ormqr", "pinverse", "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "ctc_loss",
    "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft",
    "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2",
    "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_matrix_rank",
    "linalg_solve", "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
    "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d",
    "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig",
    "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
})  # fmt: skip

#: CPU fp32 ops that torch 2.14 no longer registers (its AutocastCPU kernels, read from the
#: 2.14.1 dispatcher: ``qr`` and ``cholesky`` are gone, their ``linalg_`` forms stay), and the
#: op it adds: ``linalg_matrix_sqrth`` (a bf16 input comes out float32 under CPU autocast).
_CPU_FP32_DROPPED_IN_2_14 = frozenset({"qr", "cholesky"})
#: Ops torch 2.14 adds to the fp32 lists. CUDA: registered with AutocastCUDA in 2.14.1, assumed
#: fp32 there as on the CPU, as every other ``linalg_`` decomposition is (not run on a GPU).
_FP32_FROM_2_14 = frozenset({"linalg_matrix_sqrth"})

#: KERNEL_CPU(..., promote): float32 when any floating input is, else the autocast dtype.
CPU_PROMOTE_OPS: frozenset[str] = frozenset({"stack", "cat", "index_copy"})


def cpu_autocast_lists(torch_version: str | None = None) -> dict[AutocastPolicy, frozenset[str]]:
    """Op names (no overload, but ``"_convolution.deprecated"``) per CPU autocast policy of
    ``torch_version`` (None: the installed torch, the one a CPU run is compared with)."""
    version = parse_torch_version(torch.__version__ if torch_version is None else torch_version)
    fp32 = CPU_FP32_OPS - _CPU_FP32_DROPPED_IN_2_14 | _FP32_FROM_2_14 if version >= (2, 14) else CPU_FP32_OPS
    return {"lower": CPU_LOWER_PRECISION_OPS, "fp32": fp32, "promote": CPU_PROMOTE_OPS}


@functools.cache  # asked once per call under CPU autocast; the lists are the installed torch's, fixed
def cpu_autocast_policy(op_name: str) -> AutocastPolicy:
    """What ``torch.autocast("cpu")`` does with ``op_name`` ("none": it runs in whatever dtypes
    reach it — softmax and layer_norm among them, unlike on CUDA).

    The casts go through the same ``cached_cast`` as CUDA's (:func:`autocast_policy`): a
    float32 leaf that requires grad is cast to the autocast dtype once per region, the cache
    cleared when the outermost ``torch.autocast`` exits, whatever the device.
    """
    name = _base_op_name(op_name)
    for policy, names in _INSTALLED_CPU_LISTS.items():
        if name in names:
            return policy
    return "none"


#: The CPU target follows the installed torch: its lists, worked out once.
_INSTALLED_CPU_LISTS = cpu_autocast_lists()

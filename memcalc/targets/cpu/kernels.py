"""The CPU target: what PyTorch's own CPU kernels run and allocate, so that an estimate can be
compared with a real step on this machine's CPU (``--measure`` without a GPU,
:mod:`memcalc.measure.step`). It models no GPU; it lives beside the CUDA rules because it is
the same kind of knowledge — which aten ops a device chooses and what they allocate inside.

Meta tensors take the paths of no real device. Where the CPU's choice differs, a rule rewrites
the call above autograd (:data:`CPU_CALL_RULES`, keyed by the function ``__torch_function__``
gets), so that autograd saves what the CPU's kernel saves; an after-op rule
(:data:`CPU_KERNEL_RULES`, keyed by ``OpOverload``) adds what the kernel allocates inside:

- ``scaled_dot_product_attention``: the CPU's flash kernel (output, logsumexp and per-thread
  buffers, not meta's attention matrix; :func:`cpu_flash_refusal`);
- ``nn.LSTM`` through oneDNN (:func:`mkldnn_rnn`), other RNNs and packed sequences through
  ``_rnn_impl`` (:func:`generic_rnn`, :func:`packed_rnn`, :func:`uniform_packed_mkldnn_rnn`);
- mixed precision by CPU autocast's own op lists (:func:`autocast_arguments`);
- ``at::linear``'s bias added in place (:func:`aten_linear`);
- bfloat16 GEMMs' oneDNN scratchpad (:mod:`memcalc.targets.cpu.onednn`), the flash backward's
  inner ones included (:func:`flash_backward_gemm_scratch`);
- bfloat16/float16 convolutions on a CPU without oneDNN's support for them: ATen's ``Slow2d``
  columns (:mod:`memcalc.targets.cpu.convolution`);
- gloo's staging in the functional all-gather and reduce-scatter (:mod:`memcalc.targets.cpu.gloo`);
- Python numbers in arithmetic, wrapped as CPU tensors (:mod:`memcalc.targets.cpu.scalars`);
- normalisation statistics in the CPU's dtypes (:func:`follow_statistics`).

Sizes follow torch 2.13 with oneDNN v3.12 on x86-64 (float32, and bfloat16 GEMMs on
AVX512-BF16 without AMX; checked against the CPU profiler). Per-thread buffers use this process's
``torch.get_num_threads()``. What a rule cannot follow is named in :meth:`CpuKernels.notes`
(each line starts with :data:`NOT_FOLLOWED`), so a CPU measurement can say which op it is.

Each rule with the ATen source it follows: docs/notes/cpu-kernels.md.
"""

from __future__ import annotations

import functools
import os
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.categories import Category
from memcalc.core.precision import Precision
from memcalc.engine.rules import RuleRegistry, op_name
from memcalc.engine.trace import StorageTracer
from memcalc.targets.autocast import AutocastPolicy, cpu_autocast_policy
from memcalc.targets.cpu import convolution, gloo, onednn, scalars
from memcalc.targets.cpu.onednn import (
    ONEDNN_BF16_MATMUL_ISA,
    onednn_bf16_matmul_isa,
    onednn_bf16_matmul_scratchpad,
)
from memcalc.targets.cuda.emulation import CudaEmulation
from memcalc.targets.versions import parse_torch_version

__all__ = (
    "CPU_CALL_RULES",
    "CPU_KERNEL_RULES",
    "LSTM_MODE",
    "NORM_STATISTICS_OPS",
    "NOT_FOLLOWED",
    "CpuCapabilities",
    "CpuEmulation",
    "CpuKernels",
    "RnnKind",
    "autocast_arguments",
    "cpu_flash_refusal",
    "flash_backward_gemm_scratch",
    "flash_backward_temporaries",
    "flash_backward_workspace",
    "flash_forward_temporaries",
    "flash_forward_workspace",
    "follow_statistics",
    "generic_rnn",
    "linear",
    "mkldnn_rnn",
    "packed_rnn",
    "statistics_nbytes",
    "uniform_packed_lstm_runs_onednn",
    "uniform_packed_mkldnn_rnn",
)

aten = torch.ops.aten

#: How a note names an op whose CPU memory the target does not follow.
NOT_FOLLOWED = "not followed on the CPU:"

#: A call rule: ``(mode, func, args, kwargs) → result`` in place of ``func(*args, **kwargs)``.
CpuCallRule = Callable[["CpuEmulation", Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
#: The calls the CPU target rewrites, keyed by the function object ``__torch_function__`` gets.
CPU_CALL_RULES: RuleRegistry[CpuCallRule] = RuleRegistry("CPU call")
#: A kernel rule: ``(kernels, op, args, kwargs, output)``, called after ``op`` ran.
CpuKernelRule = Callable[["CpuKernels", OpOverload, tuple[Any, ...], dict[str, Any], Any], None]
#: What CPU kernels allocate inside, keyed by ``OpOverload``.
CPU_KERNEL_RULES: RuleRegistry[CpuKernelRule] = RuleRegistry("CPU kernel")


@dataclass(frozen=True)
class CpuCapabilities:
    """What decides this CPU's kernel choices, read once outside the trace."""

    threads: int  # at::get_num_threads(): one buffer per thread in the flash kernels
    onednn: bool  # AT_MKLDNN_ENABLED() and at::globalContext().userEnabledMkldnn()
    onednn_bf16: bool  # mkldnn_bf16_device_check()
    onednn_fp16: bool  # mkldnn_fp16_device_check()
    flash_sdp: bool  # at::globalContext().userEnabledFlashSDP() (shared with CUDA)
    # the ISA of oneDNN's bf16 matmul (onednn_bf16_matmul_isa); its threads are ``threads``
    # (dnnl_get_max_threads() is omp_get_max_threads(), which at::set_num_threads sets)
    onednn_bf16_isa: str = ""
    # the packed at::lstm runs oneDNN on a batch whose sizes are all equal (probed:
    # :func:`uniform_packed_lstm_runs_onednn`)
    onednn_uniform_packed_lstm: bool = False

    @classmethod
    def here(cls) -> CpuCapabilities:
        """This process's CPU and settings."""
        onednn = torch.backends.mkldnn.is_available() and bool(  # type: ignore[no-untyped-call]  # untyped in torch
            torch.backends.mkldnn.enabled)
        return cls(threads=torch.get_num_threads(), onednn=onednn,
                   onednn_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                   onednn_fp16=onednn and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
                   flash_sdp=torch.backends.cuda.flash_sdp_enabled(),  # type: ignore[no-untyped-call]  # untyped
                   onednn_bf16_isa=onednn_bf16_matmul_isa(torch._C._cpu._get_cpu_capability(), os.environ),
                   onednn_uniform_packed_lstm=onednn and uniform_packed_lstm_runs_onednn())


class _OpsSeen(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """The aten ops a call runs, as a dispatch mode sees them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode.__init__ is untyped
        self.ops: set[OpOverload] = set()

    def __torch_dispatch__(self, func: OpOverload, types_: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


@functools.cache
def uniform_packed_lstm_runs_onednn() -> bool:
    """Whether this torch's packed ``at::lstm`` (native/RNN.cpp) unwraps a PackedSequence whose
    batch sizes are all equal into a (steps, batch, features) tensor and runs the unpacked
    ``at::lstm`` — oneDNN where ``use_mkldnn`` allows ("If packed sequence has uniform batch size,
    unwrap to regular tensor"). torch 2.13 does (measured); pytorch#185531 proposes the unwrap, and
    whether that PR is the one merged was not checked. Read off the ops of one real LSTM step of
    one element rather than a version number; call it with oneDNN enabled."""
    seen = _OpsSeen()
    weights = [torch.zeros(4, 1), torch.zeros(4, 1), torch.zeros(4), torch.zeros(4)]  # w_ih, w_hh, b_ih, b_hh
    state = [torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)]
    with torch.no_grad(), seen:
        torch.lstm(torch.zeros(1, 1), torch.ones(1, dtype=torch.int64), state, weights, True, 1, 0.0, False, False)
    return aten.mkldnn_rnn_layer.default in seen.ops


class CpuKernels:
    """The after-op rules of one traced step, and what they followed or could not follow."""

    def __init__(self, capabilities: CpuCapabilities) -> None:
        self.capabilities = capabilities
        self.tracer: StorageTracer | None = None
        self.followed: Counter[str] = Counter()
        self.unfollowed: dict[str, tuple[int, str]] = {}  # op name → (calls, why)
        self.approximated: Counter[str] = Counter()  # the report's ops whose memory inside is approximated
        self.saved_numbers = scalars.SavedNumbers()  # Python numbers autograd holds (scalars module)

    def attach(self, tracer: StorageTracer) -> None:
        self.tracer = tracer

    def after_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        rule = CPU_KERNEL_RULES.get(func)
        if rule is not None:
            rule(self, func, args, kwargs, out)

    def add_temporary(self, nbytes: int, label: str | None = None) -> None:
        """Memory the kernel takes through the CPU allocator and frees before it returns
        (``label``: its name in the trace; by default the category and the op)."""
        assert self.tracer is not None
        if nbytes > 0:
            self.tracer.synthetic(nbytes, Category.WORKSPACE, persistent=False, label=label)

    def hold(self, nbytes: int, label: str) -> int:
        """Memory taken now and held past the op, until :meth:`release` (a number autograd saved)."""
        assert self.tracer is not None
        return self.tracer.synthetic(nbytes, Category.ACTIVATIONS, persistent=True, label=label)

    def release(self, uid: int) -> None:
        """Return what :meth:`hold` took."""
        assert self.tracer is not None
        self.tracer.release(uid)

    def resize_output(self, tensor: torch.Tensor, nbytes: int) -> None:
        """An output meta sizes otherwise (oneDNN's empty workspace, a norm's statistics): it lives
        as long as the tensor (autograd saves it for backward) but holds ``nbytes`` on the CPU."""
        assert self.tracer is not None
        uid = self.tracer.uid_of(tensor)
        if uid is not None:
            self.tracer.trace.nbytes[uid] = nbytes

    def follow(self, op: OpOverload) -> None:
        """A call of ``op`` whose CPU memory a rule modelled."""
        self.followed[op_name(op)] += 1

    def approximate(self, op: OpOverload) -> None:
        """A call of ``op`` that takes a kernel whose memory inside no rule models, a known gap the
        report lists with its calls (``MemoryReport.unsupported_ops``: oneDNN's convolutions)."""
        self.approximated[op.__name__] += 1

    def cannot_follow(self, op: object, why: str) -> None:
        """``op`` (an op, or a name) allocates memory on the CPU that no rule models: say so."""
        name = op if isinstance(op, str) else op_name(op)
        calls, _ = self.unfollowed.get(name, (0, why))
        self.unfollowed[name] = (calls + 1, why)

    def notes(self) -> list[str]:
        """The kernels followed, then one line per op not followed (:data:`NOT_FOLLOWED`)."""
        lines = []
        if self.followed:
            ops = ", ".join(f"{name} ×{n}" for name, n in sorted(self.followed.items()))
            lines.append(f"CPU target: the CPU's own kernels followed ({self.capabilities.threads} threads): {ops}")
        for name, (calls, why) in sorted(self.unfollowed.items()):
            lines.append(f"{NOT_FOLLOWED} {name} ×{calls} ({why})")
        return lines


class CpuEmulation(CudaEmulation):
    """The CUDA emulation's function mode (autocast region and cache, composites) with the CUDA
    kernel choices off, the CPU's calls (:data:`CPU_CALL_RULES`) in their place and CPU
    autocast's op lists in place of CUDA's."""

    def __init__(self, precision: Precision, compute_capability: tuple[int, int], kernels: CpuKernels) -> None:
        super().__init__(precision, compute_capability, emulate_kernels=False)
        self.kernels = kernels

    def __torch_function__(self, func: Callable[..., Any], types_: Any, args: tuple[Any, ...] = (),
                           kwargs: Any = None) -> Any:
        try:
            rule = CPU_CALL_RULES.get(func)
        except TypeError:  # an unhashable callable: no rule
            rule = None
        if rule is not None:
            return rule(self, func, args, dict(kwargs or {}))
        return super().__torch_function__(func, types_, args, kwargs)

    def autocast_policy_of(self, func: Callable[..., Any]) -> AutocastPolicy:
        """What CPU autocast does with calls of ``func``."""
        return cpu_autocast_policy(getattr(func, "__name__", ""))

    def dispatch(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Under autocast, AutocastCPU's lists: a listed op gets its inputs cast as
        ``torch.autocast("cpu")`` casts them (:func:`autocast_arguments`);
        any other runs as it comes — a ``torch.nn.functional`` composite with this mode on
        inside, as the CUDA emulation runs an op outside CUDA's lists."""
        if not self.autocasting:
            return super().dispatch(func, args, kwargs)
        low = self.autocast_dtype
        assert low is not None
        policy = self.autocast_policy_of(func)
        if policy != "none":
            args, kwargs = autocast_arguments(policy, args, kwargs, low, self.cast)
        elif isinstance(func, types.FunctionType) and (func.__module__ == F.__name__ or func.__name__ == "backward"):
            return self._composite(func, args, kwargs)
        return func(*args, **kwargs)


# ---- scaled dot product attention ------------------------------------------------------------
#: use_flash_attention_cpp's ``cpp_supported_flash_dtypes`` (sdp_utils_cpp.cpp).
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Ranks of q, k and v the CPU flash kernel takes (``check_tensor_shapes``): 4-D up to torch
#: 2.13; 2.14 also runs it on 3-D inputs (measured: 2.14.1 dispatches 3-D q/k/v, with or without
#: a mask, to ``_scaled_dot_product_flash_attention_for_cpu``; 2.13 takes the math path). The CPU
#: target models the installed torch, the one a CPU run is compared with.
_CPU_FLASH_RANKS = (3, 4) if parse_torch_version(torch.__version__) >= (2, 14) else (4,)


def cpu_flash_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      dropout_p: float, enable_gqa: bool, flash_enabled: bool = True) -> str | None:
    """Why ``select_sdp_backend_cpp`` would not run the CPU flash kernel (None: it would), its
    checks in the order of ``use_flash_attention_cpp`` (sdp_utils_cpp.cpp / .h, torch 2.13)."""
    if not flash_enabled:
        return "flash attention disabled (torch.backends.cuda.enable_flash_sdp)"  # check_runtime_disabled_flash
    if q.is_nested or k.is_nested or v.is_nested:
        return "nested tensors"
    if dropout_p > 0.0:
        return "dropout"  # check_for_dropout
    if not (q.dim() == k.dim() == v.dim() and q.dim() in _CPU_FLASH_RANKS):
        return f"q, k, v are not {' or '.join(f'{r}-D' for r in _CPU_FLASH_RANKS)}"  # check_tensor_shapes
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return "batch sizes differ"
    if enable_gqa:  # check_grouped_query_attention<requires_same_num_heads=true>
        if k.shape[-3] != v.shape[-3] or q.shape[-3] % k.shape[-3]:
            return "key/value heads do not divide the query heads"
    elif not q.shape[-3] == k.shape[-3] == v.shape[-3]:
        return "numbers of heads differ"
    if mask is not None and not _mask_shape_ok(mask, q, k):
        return "attention mask shape"  # check_attn_mask_shape
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return "head sizes differ"  # check_head_dim_size_cpp
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return "empty sequence"  # check_nonzero_sequence_lengths_dense
    if not q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        return "last dimension not contiguous"  # check_last_dim_stride_equals_1_dense (mask free on CPU)
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _CPU_FLASH_DTYPES):
        return "dtype"  # check_tensor_dtype
    return None


def _mask_shape_ok(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """check_attn_mask_shape: a 2-D or 4-D mask broadcastable to (B, H, L, S), not requiring grad."""
    if mask.requires_grad or mask.dim() not in (2, 4):
        return False

    def fits(size: int, target: int) -> bool:
        return size in (target, 1)

    if not (fits(mask.shape[-2], q.shape[2]) and fits(mask.shape[-1], k.shape[2])):
        return False
    return mask.dim() == 2 or (fits(mask.shape[0], q.shape[0]) and fits(mask.shape[1], q.shape[1]))


@CPU_CALL_RULES.register(F.scaled_dot_product_attention, aten.scaled_dot_product_attention)
def attention(mode: CpuEmulation, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """SDPA on the CPU: the flash kernel for CPU when ``_fused_sdp_choice_cpp`` picks it (else
    the math path, which meta runs too)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if mode.autocasting:  # SDPA is in the lower-precision list of CPU autocast
        low = mode.autocast_dtype
        assert low is not None
        q, k, v = (mode.cast(t, low) for t in (q, k, v))
    mask = bound.get("attn_mask")
    dropout_p = float(bound.get("dropout_p", 0.0) or 0.0)
    refusal = cpu_flash_refusal(q, k, v, mask, dropout_p, bool(bound.get("enable_gqa", False)),
                                mode.kernels.capabilities.flash_sdp)
    if refusal is not None:
        return mode.dispatch(func, args, kwargs)
    if mask is not None and mask.dtype is torch.bool:
        # convert_boolean_attn_mask (attention.cpp): an additive mask in the query's dtype
        mask = torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=q.dtype, device=mask.device))
    return aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, bool(bound.get("is_causal", False)), attn_mask=mask, scale=bound.get("scale"))[0]


#: flash_attention_kernel_impl (cpu/FlashAttentionKernel.cpp): the query block (q_split_size)
#: by query length — 256 rows from 768, 64 from 192, else 32 — and the kv block (kv_split_size).
_FLASH_Q_SPLITS = ((768, 256), (192, 64), (0, 32))
_FLASH_KV_SPLIT = 512


def _flash_splits(q_len: int, kv_len: int) -> tuple[int, int]:
    """(qSplitSize, kvSplitSize) of the CPU flash kernels: the template sizes, capped at the
    lengths."""
    q_split = next(split for rows, split in _FLASH_Q_SPLITS if q_len >= rows)
    return min(q_split, q_len), min(_FLASH_KV_SPLIT, kv_len)


def _accumulate_itemsize(dtype: torch.dtype) -> int:
    """``toOpMathType``: float for the reduced types, else the dtype itself."""
    return 8 if dtype is torch.float64 else 4


def flash_forward_temporaries(q: torch.Tensor, k: torch.Tensor, threads: int) -> int:
    """Bytes ``cpu_flash_attention`` takes while it runs: per thread, ``buf`` (the q·kᵀ block,
    running max and sum, the output block, in the accumulate type) and for bf16/fp16
    ``buf_reduced`` (the block in the input type). q, k as SDPA gets them: (B, H, L, E)."""
    return flash_forward_workspace(tuple(q.shape), int(k.shape[2]), q.dtype, threads)


def flash_forward_workspace(q_shape: Sequence[int], kv_len: int, dtype: torch.dtype, threads: int) -> int:
    """:func:`flash_forward_temporaries` by shape: a (B, H, L, E) query of ``dtype`` against ``kv_len`` keys."""
    q_split, kv_split = _flash_splits(int(q_shape[2]), kv_len)
    head = int(q_shape[3])
    per_thread = q_split * kv_split + 2 * q_split + q_split * head
    reduced = dtype in (torch.bfloat16, torch.float16)
    buf_reduced = threads * q_split * kv_split * dtype.itemsize if reduced else 0
    return threads * per_thread * _accumulate_itemsize(dtype) + buf_reduced


def flash_backward_temporaries(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, threads: int) -> int:
    """Bytes ``cpu_flash_attention_backward`` takes: a contiguous copy of the output gradient
    in (B, L, H, E) when it is not, and :func:`flash_backward_workspace`."""
    grad_copy = 0 if grad_out.transpose(1, 2).is_contiguous() else grad_out.numel() * grad_out.element_size()
    return grad_copy + flash_backward_workspace(tuple(q.shape), int(k.shape[2]), q.dtype, threads)


def flash_backward_workspace(q_shape: Sequence[int], kv_len: int, dtype: torch.dtype, threads: int) -> int:
    """The backward's buffers for a (B, H, L, E) query of ``dtype`` against ``kv_len`` keys:
    ``buf`` (attention and its gradient blocks) and for bf16/fp16 ``buf_reduced`` per thread,
    and the ``dsum`` row of the calling thread. at::parallel_for's other threads take theirs
    too, but the CPU profiler, memcalc's reference here, records only the calling thread's
    allocations (one ``dsum`` event per call at 2 threads, any B·H)."""
    q_split, kv_split = _flash_splits(int(q_shape[2]), kv_len)
    accumulate = _accumulate_itemsize(dtype)
    buf = threads * 2 * q_split * kv_split * accumulate
    reduced = dtype in (torch.bfloat16, torch.float16)
    buf_reduced = threads * 2 * q_split * kv_split * dtype.itemsize if reduced else 0
    return buf + buf_reduced + q_split * accumulate


#: ideep hands oneDNN a matmul's scale other than 1 as a one-float tensor from the CPU allocator,
#: alive around the call's scratchpad (measured: 4 B about each scaled GEMM of the flash backward).
_ONEDNN_SCALE_BYTES = 4


def _flash_backward_blocks(q_len: int, kv_len: int, causal: bool) -> set[tuple[int, int]]:
    """The (query rows, keys) blocks that one (batch, head) of cpu_flash_attention_backward
    multiplies: each query block against the key blocks before ``num_keys`` (the causal diagonal,
    top-left aligned), blocks of the split sizes and a tail. Each thread runs whole heads, so the
    calling thread meets all of them. Of the query blocks of one size only the last matters: an
    earlier one reaches a prefix of the same key blocks."""
    q_split, kv_split = _flash_splits(q_len, kv_len)
    last_kv = (kv_len - 1) // kv_split * kv_split  # where the last key block starts
    q_tail = q_len - (q_len - 1) // q_split * q_split
    last_starts = {q_len - q_tail: q_tail}
    if q_len - q_tail >= q_split:  # a shorter tail: the last full block before it
        last_starts[q_len - q_tail - q_split] = q_split
    blocks = set()
    for start, rows in last_starts.items():
        reach = min(start + rows, kv_len) if causal else kv_len
        if last_kv > 0:  # the first key block is a full one
            blocks.add((rows, kv_split))
        if reach > last_kv:
            blocks.add((rows, kv_len - last_kv))
    return blocks


def flash_backward_gemm_scratch(q_shape: Sequence[int], kv_len: int, dtype: torch.dtype,
                                capabilities: CpuCapabilities, *, causal: bool = False,
                                scale: float | None = None) -> int:
    """The most that the CPU flash backward's oneDNN GEMMs take at once on the calling thread,
    where oneDNN's bf16 matmul runs ``brg_matmul:avx512_core_bf16`` (else 0: ATen's own GEMM takes
    nothing; another ISA is named by the rule). Three of its five ``cpublas::gemm`` calls per block
    write bfloat16 and go through mkldnn_bf16_gemm — grad_v += attnᵀ·dO, grad_q += s·dA·k and
    grad_k += s·dAᵀ·q — each with a scratchpad (:func:`onednn_bf16_matmul_scratchpad`) and, the
    scaled two, the scale's 4 B; the two writing float32 (q·kᵀ, dO·vᵀ, and the forward's) take
    nothing (measured, torch 2.13). mkldnn_gemm hands the column-major C = A·B to oneDNN as
    Cᵀ = Bᵀ·Aᵀ: rows M = n, columns N = m, source B transposed when ``transb`` is."""
    if not (dtype is torch.bfloat16 and capabilities.onednn and capabilities.onednn_bf16
            and capabilities.onednn_bf16_isa == ONEDNN_BF16_MATMUL_ISA) or not q_shape[2] or not kv_len:
        return 0
    head = int(q_shape[3])
    alpha = 1 / head ** 0.5 if scale is None else scale  # sdp::calculate_scale
    scaled = _ONEDNN_SCALE_BYTES if alpha != 1 else 0
    most = 0
    for rows, keys in _flash_backward_blocks(int(q_shape[2]), kv_len, causal):
        # (M, N, K, source transposed, alpha, scale bytes): grad_v, grad_q, grad_k
        for m, n, k, transposed, factor, extra in ((keys, head, rows, True, 1.0, 0),
                                                   (rows, head, keys, False, alpha, scaled),
                                                   (keys, head, rows, True, alpha, scaled)):
            if m * n * k <= _ONEDNN_GEMM_MIN_SIZE or factor == 0:  # mkldnn_gemm declines: ATen's GEMM
                continue
            scratchpad = onednn_bf16_matmul_scratchpad(m, n, k, threads=capabilities.threads, a_transposed=transposed)
            most = max(most, extra + scratchpad)
    return most


@CPU_KERNEL_RULES.register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def flash_forward(kernels: CpuKernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                  out: Any) -> None:
    """The forward's per-thread buffers."""
    q, k = args[0], args[1]
    if q.dtype is torch.float16:
        # flash_attention_kernel_impl packs K and V (cpublas::need_pack(kHalf), AMX-FP16 CPUs)
        # into std::make_unique buffers, outside the CPU allocator
        kernels.cannot_follow(op, "float16: its packed copies of K and V on AMX-FP16 CPUs")
    else:
        kernels.follow(op)
    kernels.add_temporary(flash_forward_temporaries(q, k, kernels.capabilities.threads))


@CPU_KERNEL_RULES.register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def flash_backward(kernels: CpuKernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                   out: Any) -> None:
    """The backward's copy of the output gradient, per-thread buffers and its bf16 GEMMs' oneDNN scratch."""
    grad_out, q, k = args[0], args[1], args[2]
    caps = kernels.capabilities
    bf16_elsewhere = caps.onednn and caps.onednn_bf16 and caps.onednn_bf16_isa != ONEDNN_BF16_MATMUL_ISA
    if q.dtype is torch.float16 or (q.dtype is torch.bfloat16 and bf16_elsewhere):
        # cpublas::gemm on reduced types goes through oneDNN: its fp16 matmul, or a bf16 ISA not modelled
        kernels.cannot_follow(op, f"{str(q.dtype).removeprefix('torch.')}: the scratch of the GEMMs inside")
    else:
        kernels.follow(op)
    is_causal = bool(args[7]) if len(args) > 7 else bool(kwargs.get("is_causal", False))
    kernels.add_temporary(flash_backward_temporaries(grad_out, q, k, caps.threads) + flash_backward_gemm_scratch(
        tuple(q.shape), int(k.shape[2]), q.dtype, caps, causal=is_causal, scale=kwargs.get("scale")))


# ---- what a dispatch mode changes ------------------------------------------------------------
# ``at::isTensorSubclassLike`` is true for every tensor while a dispatch mode is active, as
# memcalc's tracer is (c10/core/impl/TorchDispatchModeTLS, ATen/TensorSubclassLikeUtils.h), and
# "composite compliant" code then avoids in-place ops that a plain CPU run makes. Autograd's
# gradient accumulation, the same on every device, is put back by the backends
# (:func:`memcalc.targets.autograd.accumulate_in_place`); at::linear's bias add below.


@CPU_CALL_RULES.register(F.cross_entropy)
def cross_entropy(mode: CpuEmulation, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The composite as it is: under CPU autocast ``cross_entropy_loss`` itself is in the
    float32 list (not CUDA's float32 ``log_softmax`` and ``nll_loss``, its rule in
    :mod:`memcalc.targets.cuda.emulation`)."""
    return mode.dispatch(func, args, kwargs)


@CPU_CALL_RULES.register(F.linear)
def linear(mode: CpuEmulation, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::linear`` as the CPU runs it (:func:`aten_linear`: the bias added
    in place after a ``matmul``)."""
    bound = dict(zip(("input", "weight", "bias"), args, strict=False))
    bound.update(kwargs)
    x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
    if mode.autocasting:  # lower-precision list; cast last argument first (autocast_arguments)
        low = mode.autocast_dtype
        assert low is not None
        bias, weight, x = (None if t is None else mode.cast(t, low) for t in (bias, weight, x))
    return aten_linear(x, weight, bias)


# ---- bfloat16 GEMMs: oneDNN's matmul -----------------------------------------------------------
# With oneDNN enabled on a CPU that mkldnn_bf16_device_check() accepts, a bfloat16 GEMM larger
# than 16·16·16 multiply-adds runs oneDNN's matmul primitive (native/mkldnn/Matmul.cpp):
# ``mm``/``addmm`` through cpublas::gemm → mkldnn_bf16_gemm, ``bmm``/``baddbmm``/``mv``/``addmv``
# through mkldnn_matmul; ideep books its scratchpad in the CPU allocator for the call
# (sizes: :mod:`memcalc.targets.cpu.onednn`).

#: mkldnn_gemm and checksize (Matmul.cpp): oneDNN only above 16·16·16 multiply-adds.
_ONEDNN_GEMM_MIN_SIZE = 16 * 16 * 16


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gemm_ready(matrix: torch.Tensor) -> bool:
    """addmm_impl_cpu_: row- or column-major with a leading dimension at least the row or
    column (else it clones the operand)."""
    rows, cols = matrix.shape
    row_stride, col_stride = matrix.stride()
    return (col_stride == 1 and row_stride >= max(1, cols)) or (row_stride == 1 and col_stride >= max(1, rows))


def _onednn_layout(tensor: torch.Tensor) -> bool:
    """mkldnn_matmul's is_mkldnn_optimized_format: contiguous, or the last two dimensions
    transposed (else it makes a contiguous copy)."""
    if tensor.is_contiguous():
        return True
    if tensor.dim() == 2:
        return tensor.stride(0) == 1 and tensor.stride(1) == tensor.shape[0]
    return (tensor.stride(0) == tensor.shape[1] * tensor.shape[2] and tensor.stride(1) == 1
            and tensor.stride(2) == tensor.shape[1])


def _follow_reduced_gemm(kernels: CpuKernels, op: OpOverload, a: torch.Tensor, b: torch.Tensor,
                         alpha: object, multiply_adds: int) -> bool:
    """Whether the call runs oneDNN's bf16 matmul and its scratchpad is modelled here; a
    reduced-precision GEMM oneDNN runs otherwise is named."""
    caps = kernels.capabilities
    if not caps.onednn or alpha == 0 or multiply_adds <= _ONEDNN_GEMM_MIN_SIZE or a.dtype is not b.dtype:
        return False
    if a.dtype is torch.float16 and caps.onednn_fp16:  # use_mkldnn_fp16_matmul
        kernels.cannot_follow(op, "float16: oneDNN's matmul scratchpad on AVX512-FP16 / AMX-FP16 CPUs")
        return False
    if a.dtype is not torch.bfloat16 or not caps.onednn_bf16:
        return False
    if caps.onednn_bf16_isa != ONEDNN_BF16_MATMUL_ISA:
        where = caps.onednn_bf16_isa or "this CPU"
        kernels.cannot_follow(op, f"bfloat16: oneDNN's matmul scratchpad is modelled for "
                                  f"{ONEDNN_BF16_MATMUL_ISA}, not {where}")
        return False
    kernels.follow(op)
    return True


@CPU_KERNEL_RULES.register(aten.mm.default, aten.addmm.default)
def bf16_gemm(kernels: CpuKernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
              out: Any) -> None:
    """``mm`` / ``addmm`` in bfloat16: cpublas::gemm → mkldnn_bf16_gemm, C = A·B given to
    oneDNN as row-major; a column result (n = 1) stays column-major, so oneDNN computes its
    transpose (1 × k)·(k × m). Operands neither row- nor column-major are cloned first."""
    mat1, mat2 = (args[0], args[1]) if op is aten.mm.default else (args[1], args[2])
    m, k = (int(s) for s in mat1.shape)
    n = int(mat2.shape[1])
    if not _follow_reduced_gemm(kernels, op, mat1, mat2, kwargs.get("alpha", 1), m * n * k):  # alpha: keyword-only
        return
    clones = sum(_nbytes(t) for t in (mat1, mat2) if not _gemm_ready(t))
    threads = kernels.capabilities.threads
    if n == 1:
        scratchpad = onednn_bf16_matmul_scratchpad(1, m, k, threads=threads)
    else:
        row_major = mat1.stride(1) == 1 and mat1.stride(0) >= max(1, k)
        a_transposed = _gemm_ready(mat1) and not row_major
        scratchpad = onednn_bf16_matmul_scratchpad(m, n, k, threads=threads, a_transposed=a_transposed)
    kernels.add_temporary(clones + scratchpad)


@CPU_KERNEL_RULES.register(aten.bmm.default, aten.baddbmm.default, aten.mv.default, aten.addmv.default)
def bf16_matmul(kernels: CpuKernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                out: Any) -> None:
    """``bmm`` / ``baddbmm`` / ``mv`` / ``addmv`` in bfloat16: mkldnn_matmul, which copies an
    operand it cannot hand to oneDNN as it is (a vector is a one-column matrix, so a strided
    vector is copied)."""
    a, b = (args[0], args[1]) if op in (aten.bmm.default, aten.mv.default) else (args[1], args[2])
    batch = int(a.shape[0]) if a.dim() == 3 else 1
    m, k = (int(s) for s in a.shape[-2:])
    n = int(b.shape[-1]) if b.dim() > 1 else 1
    if not _follow_reduced_gemm(kernels, op, a, b, kwargs.get("alpha", 1), batch * m * n * k):
        return
    b_copied = not _onednn_layout(b) if b.dim() > 1 else (b.stride(0) != 1 and k > 1)
    copies = (0 if _onednn_layout(a) else _nbytes(a)) + (_nbytes(b) if b_copied else 0)
    a_transposed = not a.is_contiguous() and _onednn_layout(a)
    kernels.add_temporary(copies + onednn_bf16_matmul_scratchpad(
        m, n, k, threads=kernels.capabilities.threads, batch=batch, a_transposed=a_transposed))

# ---- gloo's functional collectives (memcalc.targets.cpu.gloo) ----------------------------------
CPU_KERNEL_RULES.register(gloo.ALL_GATHER)(gloo.all_gather_staging)
CPU_KERNEL_RULES.register(gloo.REDUCE_SCATTER)(gloo.reduce_scatter_staging)
CPU_KERNEL_RULES.register(*scalars.WRAPPING_OPS)(scalars.wrapped_number)
# ---- bf16/fp16 convolutions without oneDNN's: ATen's Slow2d (memcalc.targets.cpu.convolution) ----------
CPU_KERNEL_RULES.register(*convolution.CONVOLUTION_OPS)(convolution.slow2d_columns)


# ---- LSTM: oneDNN ------------------------------------------------------------------------------
def _lstm_layer_followed(kernels: CpuKernels, op: OpOverload, x: torch.Tensor, mode: int) -> bool:
    """Whether the oneDNN sizes apply (a float32 LSTM layer); if not, the op is named."""
    if mode != LSTM_MODE or x.dtype is not torch.float32:
        kernels.cannot_follow(op, "oneDNN's workspace, weight reorders and scratchpad are modelled for "
                                  "float32 LSTM only")
        return False
    return True


@CPU_KERNEL_RULES.register(aten.mkldnn_rnn_layer.default)
def onednn_lstm_forward(kernels: CpuKernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                        out: Any) -> None:
    """One oneDNN LSTM layer: the workspace its backward reads (empty on meta) and, inside, the
    summed bias, the weight reorders and the scratchpad."""
    x, w_ih, hidden, mode = args[0], args[1], int(args[10]), int(args[9])
    if not _lstm_layer_followed(kernels, op, x, mode):
        return
    steps, batch, input_size = (int(s) for s in x.shape)
    if not torch.is_grad_enabled():  # lstm_forward_inference: MKL-packed weights
        kernels.cannot_follow(op, "oneDNN LSTM inference: its packed weights and scratchpad are not modelled")
        return
    kernels.follow(op)
    kernels.resize_output(out[3], onednn.lstm_workspace_bytes(steps, batch, input_size, hidden))
    bias = onednn.LSTM_GATES * hidden * w_ih.element_size()  # _shuffle_bias: b_ih + b_hh
    kernels.add_temporary(bias + onednn.lstm_weight_reorder_bytes(input_size, hidden, forward=True)
                          + onednn.lstm_scratchpad_bytes(steps, batch, hidden, forward=True))


@CPU_KERNEL_RULES.register(aten.mkldnn_rnn_layer_backward.default)
def onednn_lstm_backward(kernels: CpuKernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                         out: Any) -> None:
    """One oneDNN LSTM layer's backward: contiguous (or zero) output gradients, the summed bias,
    then ideep's weight reorders, weight-gradient and bias-gradient buffers and scratchpad."""
    x, w_ih, hx, cx, output = args[0], args[1], args[5], args[6], args[7]
    grads, mode, hidden = args[10:13], int(args[14]), int(args[15])
    if not _lstm_layer_followed(kernels, op, x, mode):
        return
    steps, batch, input_size = (int(s) for s in x.shape)
    kernels.follow(op)
    temporaries = 0
    for grad, like in zip(grads, (output, hx, cx), strict=True):
        if grad is None:  # at::zeros_like
            temporaries += like.numel() * like.element_size()
        elif not grad.is_contiguous():  # .contiguous()
            temporaries += grad.numel() * grad.element_size()
    temporaries += onednn.LSTM_GATES * hidden * w_ih.element_size()  # _shuffle_bias
    temporaries += onednn.lstm_weight_reorder_bytes(input_size, hidden, forward=False)
    temporaries += onednn.LSTM_GATES * hidden * 4  # diff_bias, in a float32 buffer of oneDNN's
    temporaries += onednn.lstm_scratchpad_bytes(steps, batch, hidden, forward=False)
    kernels.add_temporary(temporaries)


def _onednn_lstm_applies(kernels: CpuKernels, x: torch.Tensor, hx: Sequence[torch.Tensor]) -> bool:
    """``use_mkldnn`` (native/RNN.cpp) and no projections (``at::lstm`` then warns and runs the
    generic path)."""
    caps = kernels.capabilities
    dtype_ok = (x.dtype is torch.float32 or (x.dtype is torch.bfloat16 and caps.onednn_bf16)
                or (x.dtype is torch.float16 and not torch.is_grad_enabled() and caps.onednn_fp16))
    return caps.onednn and dtype_ok and x.numel() != 0 and hx[0].shape[2] == hx[1].shape[2]


def _onednn_runs_packed_lstm(kernels: CpuKernels, data: torch.Tensor, batch_sizes: torch.Tensor,
                             hx: Sequence[torch.Tensor]) -> bool:
    """The packed ``at::lstm`` (native/RNN.cpp) on a batch whose sizes are all equal, where this
    torch unwraps it (:func:`uniform_packed_lstm_runs_onednn`): ``use_mkldnn`` and no projections."""
    sizes = batch_sizes.tolist()
    return (kernels.capabilities.onednn_uniform_packed_lstm and len(sizes) > 0 and len(set(sizes)) == 1
            and _onednn_lstm_applies(kernels, data, hx))


@CPU_CALL_RULES.register(torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)
def recurrent(mode: CpuEmulation, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``at::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` on the CPU: an LSTM through oneDNN
    when ``use_mkldnn`` allows, else ``_rnn_impl`` with the CPU's precomputed input projection,
    for a packed sequence too (:func:`mkldnn_rnn`, :func:`generic_rnn`, :func:`packed_rnn`); a
    packed LSTM whose batch sizes are all equal runs oneDNN (:func:`uniform_packed_mkldnn_rnn`)."""
    kind = RnnKind(getattr(func, "__name__", ""))
    if kwargs or len(args) != 9:
        return mode.dispatch(func, args, kwargs)
    if mode.autocasting:  # CPU autocast casts each mkldnn_rnn_layer (its lower-precision list)
        mode.kernels.cannot_follow(f"torch.{kind.name}", "under autocast the CPU runs it in the autocast dtype")
        return mode.dispatch(func, args, kwargs)
    # the PackedSequence overloads take (data, batch_sizes, hx, ...): hx is a list for an LSTM
    if isinstance(args[1], torch.Tensor) if kind.is_lstm else isinstance(args[2], torch.Tensor):
        data, batch_sizes, hx, params, *flags = args
        if batch_sizes.device.type != "cpu":
            return mode.dispatch(func, args, kwargs)
        packed_step = (bool(flags[0]), int(flags[1]), float(flags[2]), bool(flags[3]), bool(flags[4]))
        if kind.is_lstm and _onednn_runs_packed_lstm(mode.kernels, data, batch_sizes, hx):
            return uniform_packed_mkldnn_rnn(data, batch_sizes, hx, params, *packed_step)
        return packed_rnn(kind, data, batch_sizes, hx, params, *packed_step)
    x, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, batch_first = args
    step = (bool(has_biases), int(num_layers), float(dropout_p), bool(train), bool(bidirectional), bool(batch_first))
    if kind.is_lstm and _onednn_lstm_applies(mode.kernels, x, hx):
        return mkldnn_rnn(x, hx, params, *step)
    return generic_rnn(kind, x, hx, params, *step)


# ---- normalisation statistics (module docstring) -------------------------------------------
@dataclass(frozen=True)
class _Norm:
    """One norm op: the arguments ``is_mixed_type`` reads, in its order, and whether the
    kernel computes statistics (None: the op's ``training`` argument says; a layer or group
    norm always does)."""

    parameters: tuple[str, ...]
    training: bool | None = True


_AFFINE = ("weight", "bias")
_BATCH = ("weight", "bias", "running_mean", "running_var")  # batch_norm_cpu's is_mixed_type
#: Each op's CPU kernel, all of them ``batch_norm_cpu`` but the first two; the statistics are
#: outputs 1 and 2 of every one.
_NORMS: Mapping[OpOverload, _Norm] = {
    aten.native_layer_norm.default: _Norm(_AFFINE),
    aten.native_group_norm.default: _Norm(_AFFINE),
    aten.native_batch_norm.default: _Norm(_BATCH, training=None),
    aten._native_batch_norm_legit.default: _Norm(_BATCH, training=None),
    aten._native_batch_norm_legit.no_stats: _Norm(_AFFINE, training=None),
    aten._native_batch_norm_legit_no_training.default: _Norm(_BATCH, training=False),
    aten._batch_norm_with_update.default: _Norm(_BATCH, training=True),
    aten._batch_norm_no_update.default: _Norm(_BATCH, training=False),
}
#: The ops whose saved statistics the CPU target resizes.
NORM_STATISTICS_OPS: tuple[OpOverload, ...] = tuple(_NORMS)
#: The outputs that hold the mean and the inverse deviation (rstd, invstd).
_STATISTICS = (1, 2)


def _bind(op: OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    names = [argument.name for argument in op._schema.arguments]
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def _mixed(x: torch.Tensor, parameters: list[Any]) -> bool:
    """``is_mixed_type`` (native/cpu/mixed_data_type.h): the first defined parameter's dtype
    is not the input's."""
    first = next((p for p in parameters if isinstance(p, torch.Tensor)), None)
    return first is not None and first.dtype != x.dtype


def statistics_nbytes(op: OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                      out: Any) -> list[tuple[torch.Tensor, int]]:
    """Each statistic ``op`` returned (``out``, from its meta kernel) with the bytes the CPU's
    kernel gives it; empty for an op of no rule."""
    norm = _NORMS.get(op)
    if norm is None:
        return []
    bound = _bind(op, args, kwargs)
    x = bound["input"]
    # param_scalar_type: the input's opmath type (float32) when mixed, else the input's dtype
    dtype = torch.float32 if _mixed(x, [bound.get(name) for name in norm.parameters]) else x.dtype
    training = bool(bound["training"]) if norm.training is None else norm.training
    # batch_norm_cpu out of training: at::empty({0}, ...) (meta keeps one value per channel)
    return [(out[i], out[i].numel() * dtype.itemsize if training else 0) for i in _STATISTICS]


@CPU_KERNEL_RULES.register(*NORM_STATISTICS_OPS)
def follow_statistics(kernels: CpuKernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                      out: Any) -> None:
    """The after-op rule: each statistic holds what the CPU's kernel allocates for it (the
    op is named among those followed only where that differs from meta)."""
    changed = False
    for tensor, nbytes in statistics_nbytes(op, args, kwargs, out):
        if nbytes != tensor.untyped_storage().nbytes():
            kernels.resize_output(tensor, nbytes)
            changed = True
    if changed:
        kernels.follow(op)


# ---- ATen's CPU composites, op for op (module docstring) ------------------------------------
#: ``ideep::rnn_kind::LSTM``: mkldnn_rnn_layer's ``mode`` for an LSTM (RNN.cpp RNNParams).
LSTM_MODE = 2
#: parseLinearFlatten3d(): TORCH_LINEAR_FLATTEN_3D=1 makes a non-contiguous 3-D input contiguous.
_LINEAR_FLATTEN_3D = os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1"

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


Cast = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)] if isinstance(value, (list, tuple)) else []


def _cast_floating(value: Any, dtype: torch.dtype, cast: Cast) -> Any:
    """``cached_cast`` over an argument (a tensor, a TensorList or anything else): eligible
    tensors — floating, not float64 — that are not ``dtype`` yet."""
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.dtype not in (dtype, torch.float64)
        return cast(value, dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        cast_items = [_cast_floating(item, dtype, cast) for item in value]
        return tuple(cast_items) if isinstance(value, tuple) else cast_items
    return value


def autocast_arguments(policy: AutocastPolicy, args: tuple[Any, ...], kwargs: dict[str, Any], low: torch.dtype,
                       cast: Cast) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments AutocastCPU's ``WrapFunction_`` hands on for an op of ``policy``
    (autocast_mode.h): every eligible floating input in ``low`` ("lower"), in float32
    ("fp32"), or in float32 when one of them is and else in ``low`` ("promote",
    ``promote_type``); unchanged for "none". ``cast`` makes each copy (the emulation's, with
    the weight-cast cache), last argument first: the order of a real CPU step, whose wrapper
    casts the arguments of one call (``cached_cast(to_type, args, device_type)...``) in an
    order C++ leaves to the compiler — right to left in PyTorch's GCC builds.

    Raises:
        ValueError: a policy of CUDA's lists that CPU autocast has not.
    """
    if policy == "none":
        return args, kwargs
    if policy == "lower":
        dtype = low
    elif policy == "promote":
        floats = [t for t in _tensors((args, tuple(kwargs.values()))) if t.is_floating_point()]
        dtype = torch.float32 if any(t.dtype is torch.float32 for t in floats) else low
    elif policy == "fp32":
        dtype = torch.float32
    else:
        raise ValueError(f"CPU autocast has no {policy!r} policy")
    cast_kwargs = {name: _cast_floating(value, dtype, cast) for name, value in reversed(kwargs.items())}
    cast_args = [_cast_floating(value, dtype, cast) for value in reversed(args)]
    return tuple(reversed(cast_args)), dict(reversed(cast_kwargs.items()))


def aten_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``at::linear`` (native/Linear.cpp): a 2-D input runs ``addmm``, a contiguous one is
    flattened into ``addmm``, any other runs ``matmul`` and adds the bias in place."""
    flattened = x.is_contiguous() and (x.dim() == 3 or (bias is not None and bias.dim() == 1))
    if bias is None or x.dim() in (0, 2) or flattened or (_LINEAR_FLATTEN_3D and x.dim() == 3):
        return torch.nn.functional.linear(x, weight, bias)
    return torch.matmul(x, weight.t()).add_(bias)


def mkldnn_rnn(x: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], has_biases: bool,
               num_layers: int, dropout_p: float, train: bool, bidirectional: bool,
               batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mkldnn_rnn`` for an LSTM: time-major contiguous input, one ``mkldnn_rnn_layer`` per
    layer and direction, dropout between layers in training."""
    stride = 4 if has_biases else 2
    layer_input = (x.transpose(0, 1) if batch_first else x).contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden = int(h0.shape[2])
    directions = 2 if bidirectional else 1
    hy: list[torch.Tensor] = []
    cy: list[torch.Tensor] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = params[index * stride:(index + 1) * stride]
            # without biases RNN.cpp passes zeros shaped like the weights
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
            out = torch.ops.aten.mkldnn_rnn_layer(
                layer_input, w[0], w[1], b_ih, b_hh, h0[index], c0[index], direction > 0, [], LSTM_MODE, hidden,
                num_layers, has_biases, bidirectional, batch_first, train)
            outputs.append(out[0])
            hy.append(out[1])
            cy.append(out[2])
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout_p != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout_p, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hy, 0), torch.stack(cy, 0)


def uniform_packed_mkldnn_rnn(data: torch.Tensor, batch_sizes: torch.Tensor, hx: Sequence[torch.Tensor],
                              params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, dropout_p: float,
                              train: bool, bidirectional: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed ``at::lstm`` on a batch whose sizes are all equal: the packed data viewed as
    (steps, batch, features), :func:`mkldnn_rnn` time-major, its output viewed packed again."""
    steps, batch = int(batch_sizes.numel()), int(batch_sizes[0])
    x = data.reshape(steps, batch, int(data.shape[-1]))
    output, hy, cy = mkldnn_rnn(x, hx, params, has_biases, num_layers, dropout_p, train, bidirectional, False)
    return output.reshape(steps * batch, int(output.shape[-1])), hy, cy


class RnnKind(NamedTuple):
    """Which cell ``generic_rnn`` runs: "lstm", "gru", "rnn_tanh" or "rnn_relu"."""

    name: str

    @property
    def is_lstm(self) -> bool:
        return self.name == "lstm"


class _CellParams(NamedTuple):
    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None
    b_hh: torch.Tensor | None
    w_hr: torch.Tensor | None


def _gather_params(params: Sequence[torch.Tensor], has_biases: bool, has_projections: bool) -> list[_CellParams]:
    """gather_params: per layer and direction w_ih, w_hh[, b_ih, b_hh][, w_hr]."""
    stride = 2 + 2 * has_biases + has_projections
    cells = []
    for i in range(0, len(params), stride):
        p = params[i:i + stride]
        cells.append(_CellParams(p[0], p[1], p[2] if has_biases else None, p[3] if has_biases else None,
                                 p[-1] if has_projections else None))
    return cells


def _cell(kind: RnnKind, gates_ih: torch.Tensor, hidden: Hidden, p: _CellParams) -> Hidden:
    """One step of LSTMCell / GRUCell / SimpleCell with the input projection precomputed
    (``pre_compute_input``), including their in-place ops."""
    if isinstance(hidden, tuple):  # LSTMCell
        hx, cx = hidden
        gates = aten_linear(hx, p.w_hh, p.b_hh).add_(gates_ih)
        chunks = gates.unsafe_chunk(4, 1)
        ingate, forgetgate, cellgate, outgate = (chunks[0].sigmoid_(), chunks[1].sigmoid_(), chunks[2].tanh_(),
                                                 chunks[3].sigmoid_())
        cy = (forgetgate * cx).add_(ingate * cellgate)
        hy = outgate * cy.tanh()
        return (torch.matmul(hy, p.w_hr.t()) if p.w_hr is not None else hy), cy
    if kind.name == "gru":
        i_r, i_z, i_n = gates_ih.unsafe_chunk(3, 1)
        h_r, h_z, h_n = aten_linear(hidden, p.w_hh, p.b_hh).unsafe_chunk(3, 1)
        reset = h_r.add_(i_r).sigmoid_()
        update = h_z.add_(i_z).sigmoid_()
        new = i_n.add(h_n.mul_(reset)).tanh_()
        return (hidden - new).mul_(update).add_(new)
    pre = aten_linear(hidden, p.w_hh, p.b_hh).add_(gates_ih)
    return torch.tanh(pre) if kind.name == "rnn_tanh" else torch.relu(pre)


def _run(kind: RnnKind, steps: Sequence[torch.Tensor], hidden: Hidden,
         p: _CellParams) -> tuple[list[torch.Tensor], Hidden]:
    """FullLayer's step loop: the cell over the (projected) steps, each step's output kept."""
    outputs = []
    for step in steps:
        hidden = _cell(kind, step, hidden, p)
        outputs.append(hidden[0] if isinstance(hidden, tuple) else hidden)
    return outputs, hidden


def _full_layer(kind: RnnKind, x: torch.Tensor, hidden: Hidden, p: _CellParams) -> tuple[torch.Tensor, Hidden]:
    """FullLayer on a CPU tensor: project every step's input at once, run, stack (the
    projection lives until the layer returns)."""
    projected = aten_linear(x, p.w_ih, p.b_ih)
    outputs, final = _run(kind, projected.unbind(0), hidden, p)
    return torch.stack(outputs, 0), final


def _bidirectional_layer(kind: RnnKind, x: torch.Tensor, hidden: tuple[Hidden, Hidden],
                         p: tuple[_CellParams, _CellParams]) -> tuple[torch.Tensor, tuple[Hidden, Hidden]]:
    """FullBidirectionalLayer on a CPU tensor, with its locals' lifetimes: the forward
    projection lives until the backward one is made, which lives until the layer returns."""
    projected = aten_linear(x, p[0].w_ih, p[0].b_ih)
    steps = list(projected.unbind(0))
    fw_outputs, fw_final = _run(kind, steps, hidden[0], p[0])
    fw_output = torch.stack(fw_outputs, 0)
    projected = aten_linear(x, p[1].w_ih, p[1].b_ih)
    steps = list(projected.unbind(0))
    steps.reverse()
    rev_outputs, rev_final = _run(kind, steps, hidden[1], p[1])
    rev_outputs.reverse()
    rev_output = torch.stack(rev_outputs, 0)
    return torch.cat([fw_output, rev_output], fw_output.dim() - 1), (fw_final, rev_final)


def _unpack(hx: torch.Tensor | Sequence[torch.Tensor], params: Sequence[torch.Tensor],
            has_biases: bool) -> tuple[list[Hidden], list[_CellParams]]:
    """unpack_hidden and gather_params, shared by the dense and the packed ``_rnn_impl``: each
    layer and direction's initial hidden state (an LSTM's ``(h, c)``) and weights."""
    if isinstance(hx, torch.Tensor):
        return list(hx.unbind(0)), _gather_params(params, has_biases, False)
    has_projections = hx[0].shape[2] != hx[1].shape[2]  # an LSTM with proj_size: h narrower than c
    return list(zip(hx[0].unbind(0), hx[1].unbind(0), strict=True)), _gather_params(params, has_biases,
                                                                                    has_projections)


def _pack(kind: RnnKind, output: torch.Tensor, finals: list[Hidden]) -> tuple[torch.Tensor, ...]:
    """pack_hidden after the output: the final hidden states stacked over layers and directions,
    an LSTM's ``h_n`` and ``c_n`` apart (what ``at::lstm`` / ``at::gru`` / ``at::rnn_*`` return)."""
    if kind.is_lstm:
        pairs = [f for f in finals if isinstance(f, tuple)]
        return output, torch.stack([h for h, _ in pairs], 0), torch.stack([c for _, c in pairs], 0)
    return output, torch.stack([f for f in finals if isinstance(f, torch.Tensor)], 0)


def generic_rnn(kind: RnnKind, x: torch.Tensor, hx: torch.Tensor | Sequence[torch.Tensor],
                params: Sequence[torch.Tensor], has_biases: bool, num_layers: int, dropout_p: float, train: bool,
                bidirectional: bool, batch_first: bool) -> tuple[torch.Tensor, ...]:
    """``_rnn_impl`` with FullLayer / FullBidirectionalLayer as a CPU tensor runs it; returns
    what ``at::lstm`` (output, h_n, c_n) or ``at::gru`` / ``at::rnn_*`` (output, h_n) return."""
    hiddens, cells = _unpack(hx, params, has_biases)
    layer_input = x.transpose(0, 1) if batch_first else x
    directions = 2 if bidirectional else 1
    finals: list[Hidden] = []
    for layer in range(num_layers):
        i = layer * directions
        if bidirectional:
            layer_input, (fw, rev) = _bidirectional_layer(kind, layer_input, (hiddens[i], hiddens[i + 1]),
                                                          (cells[i], cells[i + 1]))
            finals += [fw, rev]
        else:
            layer_input, final = _full_layer(kind, layer_input, hiddens[i], cells[i])
            finals.append(final)
        if dropout_p != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout_p, True)
    return _pack(kind, layer_input.transpose(0, 1) if batch_first else layer_input, finals)


def _slice(hidden: Hidden, start: int, end: int) -> Hidden:
    """hidden_slice: rows ``start:end`` of the batch."""
    if isinstance(hidden, tuple):
        return hidden[0].narrow(0, start, end - start), hidden[1].narrow(0, start, end - start)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: Sequence[Hidden]) -> Hidden:
    """hidden_concat: along the batch."""
    if isinstance(hiddens[0], tuple):
        pairs = [h for h in hiddens if isinstance(h, tuple)]
        return torch.cat([h for h, _ in pairs], 0), torch.cat([c for _, c in pairs], 0)
    return torch.cat([h for h in hiddens if isinstance(h, torch.Tensor)], 0)


def _packed_layer(kind: RnnKind, data: torch.Tensor, sizes: list[int], hidden: Hidden,
                  p: _CellParams) -> tuple[torch.Tensor, Hidden]:
    """PackedLayer on a CPU tensor: project all inputs at once, then per step narrow the
    batch (setting aside the finished sequences' hidden states)."""
    projected = aten_linear(data, p.w_ih, p.b_ih)
    outputs: list[torch.Tensor] = []
    finished: list[Hidden] = []
    offset, last = 0, sizes[0]
    for size in sizes:
        step = projected.narrow(0, offset, size)
        offset += size
        if last > size:
            finished.append(_slice(hidden, size, last))
            hidden = _slice(hidden, 0, size)
        last = size
        hidden = _cell(kind, step, hidden, p)
        outputs.append(hidden[0] if isinstance(hidden, tuple) else hidden)
    finished.append(hidden)
    finished.reverse()
    return torch.cat(outputs, 0), _concat(finished)


def _reversed_packed_layer(kind: RnnKind, data: torch.Tensor, sizes: list[int], hidden: Hidden,
                           p: _CellParams) -> tuple[torch.Tensor, Hidden]:
    """ReversedPackedLayer on a CPU tensor: from the last step back, widening the batch."""
    projected = aten_linear(data, p.w_ih, p.b_ih)
    outputs: list[torch.Tensor] = []
    offset, last = int(data.shape[0]), sizes[-1]
    state = _slice(hidden, 0, last)
    for size in reversed(sizes):
        if size > last:
            state = _concat([state, _slice(hidden, last, size)])
        step = projected.narrow(0, offset - size, size)
        offset -= size
        last = size
        state = _cell(kind, step, state, p)
        outputs.append(state[0] if isinstance(state, tuple) else state)
    outputs.reverse()
    return torch.cat(outputs, 0), state


def packed_rnn(kind: RnnKind, data: torch.Tensor, batch_sizes: torch.Tensor,
               hx: torch.Tensor | Sequence[torch.Tensor], params: Sequence[torch.Tensor], has_biases: bool,
               num_layers: int, dropout_p: float, train: bool, bidirectional: bool) -> tuple[torch.Tensor, ...]:
    """``_rnn_impl`` with PackedLayer / PackedBidirectionalLayer as a CPU tensor runs it (the
    packed overloads of ``at::lstm`` / ``gru`` / ``rnn_*``, which never use oneDNN)."""
    sizes = [int(b) for b in batch_sizes.tolist()]
    hiddens, cells = _unpack(hx, params, has_biases)
    directions = 2 if bidirectional else 1
    layer_input = data
    finals: list[Hidden] = []
    for layer in range(num_layers):
        i = layer * directions
        output, final = _packed_layer(kind, layer_input, sizes, hiddens[i], cells[i])
        finals.append(final)
        if bidirectional:
            rev_output, rev_final = _reversed_packed_layer(kind, layer_input, sizes, hiddens[i + 1], cells[i + 1])
            finals.append(rev_final)
            output = torch.cat([output, rev_output], -1)
        layer_input = output
        if dropout_p != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout_p, True)
    return _pack(kind, layer_input, finals)

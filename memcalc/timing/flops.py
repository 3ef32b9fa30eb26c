"""FLOPs and bytes moved per aten op, recorded while the step is traced, and the roofline that
turns them into a step time on a GPU whose peaks are passed in (:class:`~memcalc.core.throughput.DeviceRates`).

:class:`OpCostRecorder` is an after-op hook of :class:`~memcalc.engine.trace.StorageTracer`
(chained before the device backend's): for every op that launches a kernel it records the
phase, whether a checkpointed forward is being recomputed, the module, the op's class, the
dtype it computes in, its FLOPs and the bytes it reads and writes. The engine takes it only
when a time is asked for (``Step.record_costs``), so an estimate that never asks pays nothing
for it; the roofline and the per-phase / per-module totals are computed only when asked
(:class:`StepCosts`).

A cost rule that raises on a call costs that op's FLOPs, never the estimate: the op is kept
with its bytes, its FLOPs counted as missing, and the first error per op is kept
(:attr:`OpCostRecorder.failures`, reported as notes).

FLOPs come from PyTorch's own formulas (``torch.utils.flop_counter.flop_registry``), which read
only shapes and so work on meta tensors; a causal fused attention counts half of the full
product, as flash-attention's benchmark does. Every other op is timed by the bytes it moves.
Kernels memcalc emulates (``memcalc::`` ops) declare their cost in
:data:`~memcalc.engine.kernel_ops.KERNEL_COSTS`.

The sources of each rule: docs/notes/flops.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.flop_counter import conv_flop_count, flop_registry

from memcalc.core.categories import Phase
from memcalc.core.throughput import PHASES, ClassTime, DeviceRates, OpClass, PhaseCost, StepFlops, StepTime
from memcalc.engine.kernel_ops import KERNEL_COSTS, KernelCostRule
from memcalc.engine.model import ModelInputs
from memcalc.engine.trace import AfterOpHook, Op, StorageTracer

__all__ = ("GEMM_ALIGNMENT_BYTES", "NORMALIZATION_ELEMENT_BYTES", "OpCost", "OpCostRecorder", "StepCosts",
           "multi_tensor_launches", "op_class_of", "tokens_per_step")

aten = torch.ops.aten

_MATMUL = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm})
_CONV = frozenset({aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_overrideable,
                   aten._slow_conv2d_forward, aten.convolution_backward})
_ATTENTION = frozenset({
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_forward, aten._flash_attention_backward, aten._efficient_attention_forward,
    aten._efficient_attention_backward,
})
#: Ops torch's registry has no formula for that compute what a registered op does, with the
#: same leading arguments: the CPU's flash attention (the CPU target's SDPA,
#: aten/src/ATen/native/transformers/attention.cpp) and the GEMM with a fused activation.
_SAME_FORMULA = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_fused_attention_overrideable: aten._scaled_dot_product_flash_attention,
    aten._addmm_activation: aten.addmm,
    aten._int_mm: aten.mm,
}

def _linear_flops(x: torch.Tensor, weight: torch.Tensor, *_args: Any, out_val: Any = None, **_kw: Any) -> int:
    """``linear``: every element of the input meets a column of the weight, ``out`` of them."""
    return 2 * x.numel() * (weight.shape[0] if weight.dim() == 2 else 1)


def _matmul_flops(a: torch.Tensor, _b: torch.Tensor, *_args: Any, out_val: Any = None, **_kw: Any) -> int:
    """``matmul``: each output element is a dot product of ``a``'s last dimension."""
    return 2 * (out_val.numel() if isinstance(out_val, torch.Tensor) else 0) * (a.shape[-1] if a.dim() else 1)


def _conv_flops(transposed: bool) -> Callable[..., int]:
    def count(x: torch.Tensor, weight: torch.Tensor, *_args: Any, out_val: Any = None, **_kw: Any) -> int:
        out = out_val.shape if isinstance(out_val, torch.Tensor) else x.shape
        return int(conv_flop_count(list(x.shape), list(weight.shape), list(out), transposed=transposed))
    return count


def _einsum_flops(equation: str, operands: Sequence[torch.Tensor], *_args: Any, out_val: Any = None,
                  **_kw: Any) -> int:
    """``einsum`` of two operands without ellipsis: 2 × the product of every index's size (each
    combination of indices is one multiply-add); -1 (uncounted) for anything else."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(inputs) != 2 or "." in equation or len(operands) != 2:
        return -1
    sizes: dict[str, int] = {}
    for letters, operand in zip(inputs, operands, strict=True):
        sizes.update(zip(letters, operand.shape, strict=False))
    return 2 * math.prod(sizes.values())


#: Composite ops that inference mode hands to the dispatch mode undecomposed (their
#: CompositeImplicitAutograd kernel runs below it), with the FLOPs of what they decompose into.
_COMPOSITE_FORMULAS: dict[object, tuple[Callable[..., int], OpClass]] = {
    aten.linear: (_linear_flops, OpClass.MATMUL),
    aten.matmul: (_matmul_flops, OpClass.MATMUL),
    aten.einsum: (_einsum_flops, OpClass.MATMUL),
    aten.conv1d: (_conv_flops(False), OpClass.CONV),
    aten.conv2d: (_conv_flops(False), OpClass.CONV),
    aten.conv3d: (_conv_flops(False), OpClass.CONV),
    aten.conv_transpose1d: (_conv_flops(True), OpClass.CONV),
    aten.conv_transpose2d: (_conv_flops(True), OpClass.CONV),
    aten.conv_transpose3d: (_conv_flops(True), OpClass.CONV),
}
#: Ops that do a GEMM's arithmetic with no formula here: timed by their bytes, their FLOPs
#: reported as uncounted (as are the kernels of other libraries' namespaces, bitsandbytes').
_UNCOUNTED = frozenset({
    aten._weight_int4pack_mm, aten._weight_int8pack_mm, aten._native_multi_head_attention, aten.mkldnn_rnn_layer,
    aten.mkldnn_rnn_layer_backward, aten._cudnn_rnn, aten._cudnn_rnn_backward, aten.mkldnn_convolution,
    aten.convolution_backward_overrideable, aten.cudnn_convolution_transpose, aten._grouped_mm,
    aten._scaled_grouped_mm, aten.bilinear, aten.tensordot,
})
_COMPUTE = frozenset({OpClass.MATMUL, OpClass.MATMUL_UNALIGNED, OpClass.CONV, OpClass.ATTENTION})
#: Normalisations, forward and backward: memory-bound, but with their own (low) efficiency.
_NORMALIZATION = frozenset({
    aten.native_batch_norm, aten.native_batch_norm_backward, aten.cudnn_batch_norm, aten.cudnn_batch_norm_backward,
    aten.miopen_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training, aten._batch_norm_with_update, aten._batch_norm_with_update_functional,
    aten._batch_norm_no_update, aten.batch_norm_backward, aten.batch_norm_stats, aten.batch_norm_elemt,
    aten.batch_norm_backward_reduce, aten.batch_norm_backward_elemt, aten.native_layer_norm,
    aten.native_layer_norm_backward, aten.native_group_norm, aten.native_group_norm_backward, aten._fused_rms_norm,
    aten._fused_rms_norm_backward,
})
#: Ops that record the dtype they compute in (the compute classes' math mode; the others' for display).
_DTYPED = _COMPUTE | {OpClass.NORMALIZATION}
#: cuBLAS's fast GEMM kernels need every matrix dimension's bytes to be a multiple of 16 (the
#: ``align8`` bf16 / ``align4`` fp32 kernels; the "Tensor Core requirements" of NVIDIA's Matrix
#: Multiplication Background User's Guide); otherwise it runs ``align1`` kernels (profile.json:
#: gpt2's 50,257-word head, 6% of the bf16 peak).
GEMM_ALIGNMENT_BYTES = 16
#: Normalisation kernels accumulate in float32 whatever their input (``at::acc_type``, e.g.
#: aten/src/ATen/native/cuda/Normalization.cuh), and their reductions, not the bytes, bound them:
#: a 16-bit batch norm took as long as a float32 one on the same shapes (profile.json, resnet50
#: amp-bf16 vs fp32: 30 and 24 ms). They are timed by their elements at this width.
NORMALIZATION_ELEMENT_BYTES = 4
#: Ops that launch no kernel: they allocate, reinterpret or read a value on the host.
_NO_KERNEL = frozenset({
    aten._unsafe_view, aten.lift_fresh, aten.empty, aten.empty_like, aten.empty_strided, aten.empty_permuted,
    aten.new_empty, aten.new_empty_strided, aten._local_scalar_dense, aten.set_, aten.resize_, aten.detach_,
})
#: Composite ops whose schema says "view" but that copy when they cannot view (a non-contiguous
#: input, another dtype): inference mode hands them over undecomposed. A copy when the output
#: has a storage of its own.
_VIEW_OR_COPY = frozenset({aten.contiguous, aten.reshape, aten.to, aten.type_as, aten.flatten})
#: Ops that write their output without reading a tensor's values (fills).
_FILLS = frozenset({
    aten.zeros_like, aten.ones_like, aten.full_like, aten.new_zeros, aten.new_ones, aten.new_full, aten.zeros,
    aten.ones, aten.full, aten.scalar_tensor, aten.arange, aten.fill_, aten.zero_, aten._foreach_zero_,
    aten.rand_like, aten.randn_like, aten.uniform_, aten.normal_,
})
#: Ops whose first argument is only written (``copy_(self, src)`` reads ``src`` alone).
_OVERWRITE_FIRST = frozenset({aten.copy_, aten._foreach_copy_})
#: Ops that read the rows they gather, not the whole source (an embedding reads ``B·T`` rows
#: of its table): the source counts as many bytes as the output.
_GATHER = frozenset({aten.embedding, aten.index_select, aten.gather, aten.index})
#: Optimizer-phase ops that only the first ``step()`` runs: creating the state (``torch.optim``'s
#: ``_init_group`` zero-fills ``exp_avg`` and friends with ``torch.zeros_like``).
_STATE_INIT = frozenset({aten.zeros_like, aten.zeros, aten.ones_like, aten.full_like, aten.new_zeros, aten.full})

#: ``multi_tensor_apply`` (aten/src/ATen/native/cuda/MultiTensorApply.cuh): tensors one launch
#: can take, by the number of tensor lists (``depth_to_max_tensors``), blocks per launch
#: (``depth_to_max_blocks``) and elements per block (``kChunkSize``).
_MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
_MAX_BLOCKS = 320
_CHUNK = 65536


class OpCost(NamedTuple):
    """One kernel-launching op of the traced step."""

    phase: Phase
    recompute: bool  # a checkpointed forward re-run during backward
    module: str
    op: str
    op_class: OpClass
    dtype: str  # the dtype it computes in ("" for memory-bound ops)
    flops: int
    bytes_moved: int
    launches: int
    first_step_only: bool  # creates optimizer state: not part of a steady-state step
    uncounted: bool = False  # a GEMM-like op without a FLOP formula: its FLOPs are missing
    event: int = 0  # events the trace held after the op (where it is in the alloc/free order)
    #: a multi-tensor kernel's non-empty tensors, 65,536-element chunks and tensor lists: what its
    #: launches are worked out from (:func:`multi_tensor_launches`); zeros for any other kernel
    tensors: int = 0
    chunks: int = 0
    lists: int = 0

    def extended(self, shallow: OpCost, extra: int) -> OpCost | None:
        """This record of a step of repeated blocks at ``extra`` more blocks, ``shallow`` being the
        same kernel's record with one block fewer: its sums over the blocks (FLOPs, bytes, a
        multi-tensor kernel's tensors and chunks, hence its launches) grow by their difference
        ``extra`` times (a foreach optimizer kernel's, over every parameter). None: the two differ
        otherwise (a module and an event aside, which the caller places)."""

        def grown(a: int, b: int) -> int:
            return b + extra * (b - a)

        sums = ("flops", "bytes_moved", "launches", "tensors", "chunks", "module", "event")
        if self._replace(**{f: getattr(shallow, f) for f in sums}) != shallow:
            return None
        tensors, chunks = grown(shallow.tensors, self.tensors), grown(shallow.chunks, self.chunks)
        launches = _launches(tensors, chunks, self.lists) if self.lists else self.launches
        if not self.lists and self.launches != shallow.launches:
            return None
        return self._replace(flops=grown(shallow.flops, self.flops),
                             bytes_moved=grown(shallow.bytes_moved, self.bytes_moved), launches=launches,
                             tensors=tensors, chunks=chunks)


@dataclass(frozen=True)
class _Rule:
    """What memcalc knows of one op overload, worked out once."""

    name: str
    launches_kernel: bool
    op_class: OpClass
    formula: Callable[..., int] | None
    on_shapes: bool  # the formula takes shapes (torch's shape_wrapper unwrapped), else the raw arguments
    uncounted: bool  # does arithmetic no formula here counts
    causal_at: int | None  # position of ``is_causal`` / ``custom_mask_type`` in the schema
    causal_name: str
    reads: str  # "all" arguments, "none" (a fill) or "not-first" (the first is overwritten or gathered from)
    gather: bool
    state_init: bool
    written_args: tuple[int, ...]  # arguments the op mutates and does not return
    tensor_lists: int  # tensor-list arguments and returns (multi_tensor_apply's depth)
    mutates: bool  # writes an argument in place
    view_or_copy: bool  # a view of its input, or a copy (_VIEW_OR_COPY)
    kernel_cost: KernelCostRule | None  # an emulated kernel's own rule (KERNEL_COSTS), else the generic ones


def _rule(func: Op) -> _Rule:
    packet = func.overloadpacket
    schema = func._schema
    name = func.__name__
    view = (func.is_view or torch.Tag.inplace_view in func.tags) and packet not in _VIEW_OR_COPY
    launches = not view and packet not in _NO_KERNEL and func.namespace != "profiler"
    formula_of = _SAME_FORMULA.get(packet, packet)
    composite = _COMPOSITE_FORMULAS.get(packet)
    op_class = _class_of(packet, name)
    names = [a.name for a in schema.arguments]
    causal = next((n for n in ("is_causal", "custom_mask_type") if n in names), "")
    written = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write) \
        if not schema.returns else ()
    lists = sum("Tensor[]" in str(a.type) or "Tensor?[]" in str(a.type) for a in schema.arguments) + sum(
        "Tensor[]" in str(r.type) for r in schema.returns)
    registered = composite[0] if composite is not None else flop_registry.get(formula_of)
    # torch wraps most formulas in shape_wrapper, a pytree map over every argument: taking the
    # shapes here instead costs a tenth of it, on the hot path of every estimate
    raw = getattr(registered, "__wrapped__", None)
    return _Rule(name=name, launches_kernel=launches, op_class=op_class, formula=raw or registered,
                 on_shapes=raw is not None,
                 uncounted=packet in _UNCOUNTED or (registered is None and func.namespace not in ("aten", "prims")),
                 causal_at=names.index(causal) if causal else None, causal_name=causal,
                 reads="none" if packet in _FILLS else "not-first" if packet in _OVERWRITE_FIRST | _GATHER else "all",
                 gather=packet in _GATHER, state_init=packet in _STATE_INIT,
                 written_args=written, tensor_lists=lists,
                 mutates=any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments),
                 view_or_copy=packet in _VIEW_OR_COPY, kernel_cost=KERNEL_COSTS.get(func))


def _class_of(packet: Any, name: str) -> OpClass:
    formula_of = _SAME_FORMULA.get(packet, packet)
    composite = _COMPOSITE_FORMULAS.get(packet)
    if composite is not None:
        return composite[1]
    if formula_of in _MATMUL:
        return OpClass.MATMUL
    if formula_of in _CONV:
        return OpClass.CONV
    if formula_of in _ATTENTION:
        return OpClass.ATTENTION
    if packet in _NORMALIZATION:
        return OpClass.NORMALIZATION
    if name.startswith(("_foreach_", "_fused_", "_amp_foreach_")):
        return OpClass.MULTI_TENSOR
    return OpClass.MEMORY


def op_class_of(name: str) -> OpClass:
    """The class of the aten op ``name`` as a profiler names it (``"aten::mm"``,
    ``"aten::_cudnn_attention_backward"``) or as memcalc records it (``"mm.default"``): what the
    step-time fit uses to sort measured kernel time into the classes memcalc times. An unknown
    name is memory-bound; a matrix product is :attr:`OpClass.MATMUL` (its alignment is a
    property of the call, not of the name). Kernels that only CUDA runs have names the traced
    step does not use (cuDNN's attention and convolution entry points): those are sorted by name."""
    bare = name.removeprefix("aten::").split(".")[0]
    packet = getattr(aten, bare, None)
    op_class = _class_of(packet, bare) if packet is not None else OpClass.MEMORY
    if op_class is OpClass.MEMORY and "attention" in bare:
        return OpClass.ATTENTION  # _cudnn_attention_forward/_backward: CUDA's SDPA below the dispatcher
    if op_class is OpClass.MEMORY and "conv" in bare:
        return OpClass.CONV  # _conv_depthwise2d, cudnn_convolution_relu: CUDA-only convolutions
    return op_class


def _gemm_aligned(args: tuple[Any, ...], out: Any) -> bool:
    """Whether every matrix operand's and the output's leading dimension (the larger of its last
    two strides: a transposed view keeps its storage's) spans a multiple of
    :data:`GEMM_ALIGNMENT_BYTES`, the fast cuBLAS kernels' requirement."""
    for value in (*args, out):
        if (isinstance(value, torch.Tensor) and value.dim() >= 2 and min(value.shape[-2:]) > 1
                and max(value.stride()[-2:]) * value.element_size() % GEMM_ALIGNMENT_BYTES):
            return False
    return True


def multi_tensor_launches(numels: Sequence[int], depth: int) -> int:
    """Kernels ``multi_tensor_apply`` launches for tensors of ``numels`` elements and ``depth``
    tensor lists: a launch takes at most ``depth_to_max_tensors[depth]`` tensors and 320 blocks
    of 65,536 elements (MultiTensorApply.cuh); the larger of the two bounds."""
    return _launches(*_tensors_and_chunks(numels), depth)


def _tensors_and_chunks(numels: Sequence[int]) -> tuple[int, int]:
    return sum(1 for n in numels if n), sum(-(-n // _CHUNK) for n in numels)


def _launches(tensors: int, chunks: int, depth: int) -> int:
    if not tensors:
        return 0
    return max(-(-tensors // _MAX_TENSORS.get(depth, 30)), -(-chunks // _MAX_BLOCKS))


def _shape(value: Any) -> Any:
    """``value`` with its tensors replaced by their shapes, one level into lists, which become
    tuples (the formulas' arguments are tensors, lists of ints or tensors, and scalars; the
    result is hashable)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (list, tuple)):
        return tuple(v.shape if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _kv_heads_broadcast(rule: _Rule, shapes: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``shapes`` of an attention kernel's call with the key and value heads broadcast to the
    query's, as the kernel does for grouped-query attention (the FLOPs are those of the
    broadcast product); None when the call is not grouped-query attention.

    The ``_scaled_dot_product_*`` kernels take ``(B, H, L, E)`` tensors; the varlen
    ``_flash_attention_*`` / ``_efficient_attention_*`` kernels ``(B, L, H, E)``. A backward takes
    the output's gradient first, then query, key and value.
    """
    query_at = 1 if rule.name.endswith("_backward") or "_backward." in rule.name else 0
    heads_dim = 1 if rule.name.startswith("_scaled_dot_product") else 2
    if len(shapes) < query_at + 3:
        return None
    query, key, value = shapes[query_at:query_at + 3]
    if not all(isinstance(s, torch.Size) and len(s) == 4 for s in (query, key, value)):
        return None
    heads, kv_heads = query[heads_dim], key[heads_dim]
    if kv_heads == heads or kv_heads < 1 or heads % kv_heads or value[heads_dim] != kv_heads:
        return None

    def widened(shape: torch.Size) -> torch.Size:
        return torch.Size((*shape[:heads_dim], heads, *shape[heads_dim + 1:]))

    return (*shapes[:query_at + 1], widened(key), widened(value), *shapes[query_at + 3:])


def _same_storage(out: Any, source: Any) -> bool:
    """Whether ``out`` is a view of ``source`` (the storage objects are kept alive and unique,
    memcalc.engine.trace keys storages by them too)."""
    return (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor)
            and out.untyped_storage() is source.untyped_storage())


def _nbytes(tensor: torch.Tensor) -> int:
    size: int = tensor.nbytes
    if not tensor.is_contiguous():  # an expanded view reads its storage once, not per element
        size = min(size, tensor.untyped_storage().nbytes())
    return size


class OpCostRecorder:
    """The after-op hook recording :class:`OpCost` for every kernel of the step; ``then`` (the
    device backend's hook) runs first. :meth:`attach` it to the tracer it is given to."""

    def __init__(self, then: AfterOpHook | None = None) -> None:
        self._then = then
        self._tracer: StorageTracer | None = None
        self._rules: dict[Op, _Rule] = {}
        self._dtypes: dict[torch.dtype, str] = {}
        self._flop_cache: dict[tuple[object, ...], int] = {}
        self.records: list[OpCost] = []
        #: ops whose FLOPs or bytes could not be worked out, with the first error (a formula of
        #: the installed torch that raises on this call): recorded without FLOPs, or not at all
        self.failures: dict[str, str] = {}

    def attach(self, tracer: StorageTracer) -> None:
        """Read the phase, module and recomputation from ``tracer``."""
        self._tracer = tracer

    def step_costs(self, inputs: ModelInputs, *, batch_size: int, micro_batches: int, module_order: Sequence[str],
                   until: int | None) -> StepCosts:
        """What was recorded, with what a time needs besides the GPU (the engine's
        :class:`~memcalc.engine.run.CostRecorder`): samples per step are ``batch_size ×
        micro_batches``; tokens per step are counted from ``inputs``' token ids
        (:func:`tokens_per_step`); ``until``: a loop traced whole counts its first iteration."""
        return StepCosts(self.records, samples=batch_size * micro_batches,
                         tokens=tokens_per_step(inputs, micro_batches), module_order=module_order, until=until,
                         failures=self.failures)

    def __call__(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self._then is not None:
            self._then(func, args, kwargs, out)  # the memory rules: their errors are the estimate's
        try:
            self._record(func, args, kwargs, out)
        except Exception as exc:  # a cost rule that cannot handle this call costs its FLOPs, never the estimate
            self._fail(func.__name__, exc)

    def _record(self, func: Op, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        rule = self._rules.get(func)
        if rule is None:
            rule = self._rules[func] = _rule(func)
        tracer = self._tracer
        if rule.kernel_cost is not None:  # an emulated kernel: its own rule says what it moves
            if tracer is not None:
                cost = rule.kernel_cost(args, kwargs, out)
                dtype = self._dtype_name(cost.dtype) if cost.dtype is not None else ""
                self._append(tracer, rule, cost.op_class, dtype, cost.flops, cost.bytes_read + cost.bytes_written, 1,
                             cost.uncounted)
            return
        if not rule.launches_kernel or tracer is None or (args and out is args[0] and not rule.mutates):
            return  # a view, an allocation, or a composite op returning its input (eval dropout, contiguous)
        if rule.view_or_copy and _same_storage(out, args[0] if args else None):
            return
        read, dtype, numels = self._reads(rule, args, kwargs)
        written = self._writes(rule, args, out)
        if read is None or (not written and not read):
            return  # no device tensor: host-side work (torch.optim's CPU step counters)
        op_class = rule.op_class
        flops = 0
        if rule.formula is not None:
            try:
                flops = self._flops(func, rule, args, kwargs, out)
            except Exception as exc:  # its bytes are still known: the op is timed by them
                self._fail(rule.name, exc)
                flops = -1
        uncounted = rule.uncounted or flops < 0
        tensors, chunks, lists = 0, 0, 0
        if op_class is OpClass.MULTI_TENSOR:
            (tensors, chunks), lists = _tensors_and_chunks(numels), max(rule.tensor_lists, 1)
        launches = _launches(tensors, chunks, lists) if lists else 1
        if op_class is OpClass.MATMUL and not _gemm_aligned(args, out):
            op_class = OpClass.MATMUL_UNALIGNED
        self._append(tracer, rule, op_class, dtype if op_class in _DTYPED else "", max(flops, 0), read + written,
                     launches, uncounted, (tensors, chunks, lists))

    def _fail(self, op: str, exc: Exception) -> None:
        """Remember the first error of ``op``'s cost rules (one note per op, not per call)."""
        self.failures.setdefault(op, f"{type(exc).__name__}: {exc}")

    def _append(self, tracer: StorageTracer, rule: _Rule, op_class: OpClass, dtype: str, flops: int,
                bytes_moved: int, launches: int, uncounted: bool, multi: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Record one op at the tracer's phase and module (``multi``: a multi-tensor kernel's
        :attr:`OpCost.tensors`, ``chunks`` and ``lists``)."""
        phase = tracer.phase
        modules = tracer.modules
        module = modules.current
        # Checkpoint's recomputation runs under torch.enable_grad() inside backward, where the
        # autograd engine otherwise runs with grad mode off (torch/utils/checkpoint.py, both the
        # reentrant CheckpointFunction.backward and the non-reentrant recompute_fn). But the
        # forward of an autograd Function runs with grad mode off even then (bitsandbytes'
        # MatMul4Bit, memcalc.stacks.bitsandbytes.quantized_base): there a module's forward is still on the tracker's
        # stack (ModuleTracker.recomputing). The seed gradient (ones_like) is made before any
        # module's gradient arrives (module "").
        recompute = modules.in_backward and bool(module) and (torch.is_grad_enabled() or modules.recomputing)
        self.records.append(OpCost(phase, recompute, module, rule.name, op_class, dtype, flops, bytes_moved, launches,
                                   rule.state_init and phase is Phase.OPTIMIZER, uncounted, len(tracer.trace.events),
                                   *multi))

    def _flops(self, func: Op, rule: _Rule, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
        """The op's FLOPs by torch's formula, kept by shapes: blocks repeat the same calls."""
        formula = rule.formula
        assert formula is not None
        if not rule.on_shapes:
            flops = int(formula(*args, **kwargs, out_val=out))
            return flops // 2 if _causal(rule, args, kwargs) else flops
        shapes = tuple(map(_shape, args))
        named = tuple((k, _shape(v)) for k, v in kwargs.items())
        key: tuple[object, ...] | None = (func, shapes, named)  # is_causal is among the arguments
        try:
            cached = self._flop_cache.get(key) if key is not None else None
        except TypeError:  # an unhashable argument: compute, do not keep
            key, cached = None, None
        if cached is None:
            try:
                cached = int(formula(*shapes, **dict(named), out_shape=_shape(out)))
            except Exception:
                broadcast = _kv_heads_broadcast(rule, shapes) if rule.op_class is OpClass.ATTENTION else None
                if broadcast is None:
                    raise
                # grouped-query attention: the kernel broadcasts the key/value heads to the query's;
                # torch's formula counts that only from 2.13 on (sdpa_flop_count asserts before)
                cached = int(formula(*broadcast, **dict(named), out_shape=_shape(out)))
            if _causal(rule, args, kwargs):
                cached //= 2
            if key is not None:
                self._flop_cache[key] = cached
        return cached

    def _reads(self, rule: _Rule, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[int | None, str, list[int]]:
        """Bytes read, the dtype a compute op computes in (its first floating argument's), and
        the element counts of the first tensor list (multi-tensor ops). None for the bytes when
        no argument lives on the device."""
        total, dtype, seen = 0, "", False
        numels: list[int] = []
        reads = rule.reads
        wants_dtype = rule.op_class in _DTYPED
        for position, value in enumerate(args if not kwargs else (*args, *kwargs.values())):
            if isinstance(value, torch.Tensor):
                if not value.is_meta:
                    continue
                seen = True
                if wants_dtype and not dtype and value.is_floating_point():
                    dtype = self._dtype_name(value.dtype)
                if reads == "all" or (position and reads == "not-first"):
                    total += value.nbytes if value.is_contiguous() else _nbytes(value)
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                counted = reads == "all" or (position and reads == "not-first")
                for item in value:
                    if isinstance(item, torch.Tensor) and item.is_meta:
                        seen = True
                        if wants_dtype and not dtype and item.is_floating_point():
                            dtype = self._dtype_name(item.dtype)
                        if counted:
                            total += item.nbytes if item.is_contiguous() else _nbytes(item)
                        if position == 0:
                            numels.append(item.numel())
        return (total if seen else None), dtype, numels

    def _writes(self, rule: _Rule, args: tuple[Any, ...], out: Any) -> int:
        total = 0
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for value in outputs:
            if isinstance(value, torch.Tensor):
                if value.is_meta:
                    total += value.nbytes
            elif isinstance(value, (list, tuple)):
                total += sum(t.nbytes for t in value if isinstance(t, torch.Tensor) and t.is_meta)
        for position in rule.written_args:
            if position < len(args):
                value = args[position]
                items = value if isinstance(value, (list, tuple)) else (value,)
                total += sum(t.nbytes for t in items if isinstance(t, torch.Tensor) and t.is_meta)
        if rule.gather:
            total *= 2  # the rows read from the source are as many bytes as the output
        return total

    def _dtype_name(self, dtype: torch.dtype) -> str:
        name = self._dtypes.get(dtype)
        if name is None:
            name = self._dtypes[dtype] = str(dtype).removeprefix("torch.")
        return name


def tokens_per_step(inputs: ModelInputs | Sequence[torch.Tensor], micro_batches: int = 1) -> int | None:
    """Tokens one step processes: the elements of its token ids (``input_ids``, else the first
    input, when it is a 2-D integer tensor ``(B, T)``) times the micro-batches; None for a
    model that takes no token ids."""
    call = ModelInputs.of(inputs)
    ids = call.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = call[0] if len(call) else None
    if ids is None or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype is torch.bool:
        return None
    return ids.numel() * micro_batches


def _causal(rule: _Rule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if rule.causal_at is None:
        return False
    at = rule.causal_at
    value = args[at] if at is not None and at < len(args) else kwargs.get(rule.causal_name, False)
    return bool(value)  # custom_mask_type: 0 none, 1 causal from the top left, 2 from the bottom right


@functools.cache
def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize if hasattr(torch, dtype) else NORMALIZATION_ELEMENT_BYTES


def _phase_name(cost: OpCost) -> str:
    return "recompute" if cost.recompute else cost.phase.value


def _self_and_ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


class StepCosts:
    """The recorded ops of one step, with what a time needs besides the GPU: samples and tokens
    per step and the modules' order. Implements :class:`~memcalc.core.throughput.CostSource`;
    each figure is computed on first request and kept."""

    def __init__(self, records: Sequence[OpCost], *, samples: int, tokens: int | None,
                 module_order: Sequence[str] = (), until: int | None = None,
                 failures: Mapping[str, str] | None = None) -> None:
        # ``until``: a trace of several iterations (a loop run as written) counts its first, the
        # ops up to that trace event (an op that allocates nothing there may be the next's first)
        self.records = [r for r in records if not r.first_step_only and (until is None or r.event <= until)]
        self.samples = samples
        self.tokens = tokens
        self.module_order = tuple(module_order)
        self.failures = dict(failures or {})  # OpCostRecorder.failures
        self._flops: StepFlops | None = None
        self._times: dict[DeviceRates, StepTime] = {}

    def flops(self) -> StepFlops:
        """FLOPs per phase, module and op (see :class:`~memcalc.core.throughput.StepFlops`)."""
        if self._flops is None:
            self._flops = self._count()
        return self._flops

    def _count(self) -> StepFlops:
        by_module: dict[str, int] = {}
        by_op: dict[str, int] = {}
        uncounted: dict[str, int] = {}
        for cost in self.records:
            if cost.uncounted:
                uncounted[cost.op] = uncounted.get(cost.op, 0) + 1
            if not cost.flops:
                continue
            by_op[cost.op] = by_op.get(cost.op, 0) + cost.flops
            if cost.module:
                for name in _self_and_ancestors(cost.module):
                    by_module[name] = by_module.get(name, 0) + cost.flops
        order = [m for m in self.module_order if m in by_module]
        order += sorted(m for m in by_module if m not in set(order))
        return StepFlops(total=sum(c.flops for c in self.records), phases=self._phases(None),
                         modules=tuple((m, by_module[m]) for m in order),
                         ops=tuple(sorted(by_op.items(), key=lambda item: (-item[1], item[0]))),
                         uncounted=tuple(sorted(uncounted.items())), failed=tuple(sorted(self.failures.items())))

    def _phases(self, seconds: Sequence[float] | None) -> tuple[PhaseCost, ...]:
        totals: dict[str, list[float]] = {}
        for index, cost in enumerate(self.records):
            row = totals.setdefault(_phase_name(cost), [0, 0, 0, 0.0])
            row[0] += cost.flops
            row[1] += cost.bytes_moved
            row[2] += cost.launches
            row[3] += seconds[index] if seconds is not None else 0.0
        return tuple(PhaseCost(p, int(totals[p][0]), int(totals[p][1]), int(totals[p][2]), float(totals[p][3]))
                     for p in PHASES if p in totals)

    def time(self, rates: DeviceRates) -> StepTime:
        """The step's time on the GPU of ``rates`` (see :class:`~memcalc.core.throughput.StepTime`)."""
        cached = self._times.get(rates)
        if cached is None:
            cached = self._times[rates] = self._roofline(rates)
        return cached

    def _roofline(self, rates: DeviceRates) -> StepTime:
        efficiency = dict(rates.efficiency)
        fixed = {c: rates.kernel_seconds_of(c) + rates.launch_overhead for c in OpClass}
        peaks: dict[tuple[OpClass, str], float] = {}
        seconds: list[float] = []
        classes: dict[OpClass, list[float]] = {}
        launch_total = 0.0
        for cost in self.records:
            eff = efficiency[cost.op_class]
            compute = 0.0
            if cost.flops:
                key = (cost.op_class, cost.dtype)
                peak = peaks.get(key)
                if peak is None:
                    peak = peaks[key] = rates.peak(cost.op_class, cost.dtype)[1]
                compute = cost.flops / (peak * eff) if peak else math.inf
            moved = cost.bytes_moved
            if cost.op_class is OpClass.NORMALIZATION and cost.dtype:
                moved = moved * NORMALIZATION_ELEMENT_BYTES // _itemsize(cost.dtype)
            memory = moved / (rates.bandwidth * eff)
            launch = cost.launches * rates.launch_overhead
            total = max(compute, memory) + cost.launches * fixed[cost.op_class]
            seconds.append(total)
            launch_total += launch
            row = classes.setdefault(cost.op_class, [0, 0, 0, 0.0, 0.0])
            row[0] += cost.launches
            row[1] += cost.flops
            row[2] += cost.bytes_moved
            row[3] += total
            row[4] += compute if compute >= memory else 0.0
        host = rates.host_seconds * sum(int(r[0]) for r in classes.values())
        if host > sum(seconds) > 0:  # host-bound: the GPU idles between kernels until the host catches up
            stretch = host / sum(seconds)
            launch_total += host - sum(seconds)
            seconds = [s * stretch for s in seconds]
            for row in classes.values():
                row[3] *= stretch
                row[4] *= stretch
        assumptions = (*((f"efficiency: {c.value}", e) for c, e in rates.efficiency),
                       *((f"seconds per kernel: {c.value}", t) for c, t in rates.kernel_seconds),
                       ("launch overhead per kernel (s)", rates.launch_overhead),
                       ("host seconds per kernel (s)", rates.host_seconds))
        return StepTime(
            gpu=rates.gpu, seconds=sum(seconds), samples=self.samples,
            tokens=None if self.tokens is None else self.tokens, phases=self._phases(seconds),
            classes=tuple(ClassTime(c, int(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4]), efficiency[c])
                          for c in OpClass if (r := classes.get(c)) is not None),
            flops=self.flops(), launch_seconds=launch_total, assumptions=assumptions, source=rates.source,
            spread=rates.spread, basis=rates.basis)

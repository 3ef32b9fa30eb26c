"""The rank program of context parallelism: torch's ring attention around another program.

``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13,
``_context_parallel/_attention.py``) patches ``F.scaled_dot_product_attention`` and runs each
call as ``_templated_ring_attention``: the rank's queries (``S/cp`` tokens) against every
rank's keys and values, ``cp`` local SDPA calls merged by ``_SDPAMerger`` (its handlers cover the
CUDA SDPA ops only; tests/gloo_cp.py adds the CPU flash op for real gloo steps, and the partial
merge's output layout it found is :func:`merged_output`'s). This program traces the rank's model at
``S/cp`` tokens (its local SDPA is one of the ring's calls; what autograd saves — q, k, v, the
merged output and logsumexp — is the ring's too) and holds, around each SDPA call and its
backward, the bytes the ring holds at its peak beyond one local call: :func:`ring_forward_peak`
and :func:`ring_backward_peak` run ``_templated_ring_attention`` and its backward line by line
(torch's defaults: ``rotate_method=ALL_GATHER``, ``convert_to_f32=True``) on the traced layouts
of q, k, v and the output gradient — which variable holds which buffer at each step: the
``.contiguous()`` K/V copies, the gathered K/V, the float32 merge's temporaries and
``_partial_update``'s ``torch.cat`` wholes, the float32 gradient accumulators (laid out as
``zeros_like`` keeps them, so ``flatten()`` may copy), the gradient ring's sends and receipts, the
load balancer's half chunks (the contiguous half of logsumexp) — each local call with its own
gradients and outputs at that step's shapes.

Per target (:class:`RingTarget`): on the CPU each call has the CPU flash kernels' own temporaries
(the partial step copies the second half of the output gradient into (B, L, H, E), its blocks
are smaller), gloo stages the all-gather, ``log_sigmoid_forward`` takes a buffer, logsumexp is
(B, L, H), ``accumulator += gradient`` copies a bf16 gradient to float32 first (any ISA); on CUDA
each call is taken to need the traced call's workspace (memcalc's CUDA rule for that kernel), NCCL
stages nothing, the buffer is empty, logsumexp (B, H, L). tests/test_context_parallel.py runs the
real ring and its backward on the CPU (fake process group, every rank of cp = 2 and 4, three
layouts, balanced or not): both agree to the byte, bf16 too, with or without oneDNN's bf16 matmul
(its avx512_core_bf16 scratch in the flash backward's GEMMs: docs/notes/cpu-kernels.md). A collective
completes when called; NCCL's keeps its input (the K/V cat, 2·Nkv·s) to its wait: not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memcalc.core.categories import Category
from memcalc.core.errors import InapplicableOptionError
from memcalc.distributed.program import RankProgram
from memcalc.engine.optimizers import OptimizerSpec
from memcalc.engine.trace import StorageTracer
from memcalc.targets.cpu.kernels import (
    CpuCapabilities,
    flash_backward_gemm_scratch,
    flash_backward_workspace,
    flash_forward_workspace,
)

__all__ = ("CUDA_RING", "CallTemporaries", "ForwardTemporaries", "Layout", "RingAttentionProgram", "RingTarget",
           "cpu_call_temporaries", "cpu_ring", "merged_output", "ring_backward_bytes", "ring_backward_peak",
           "ring_forward_bytes", "ring_forward_peak")

#: ``_ContextParallelOptions.convert_to_f32``: the merge and the gradient accumulators in float32.
_ACCUMULATOR_ITEMSIZE = 4
#: The attribute that marks memcalc's ring patch of ``F.scaled_dot_product_attention``: ``context_parallel``
#: patches it once per process, however many pipeline stages a rank holds.
_RING_MARK = "_memcalc_ring_attention"
#: The CPU flash kernels' dtypes by itemsize (float16 runs as bfloat16 does in their buffers).
_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


class _Held:
    """Storages by name and the variables that hold them: a storage is freed when its last
    holder lets go, as CPython frees a tensor when its last reference goes."""

    def __init__(self) -> None:
        self.nbytes: dict[str, int] = {}
        self.holders: dict[str, set[str]] = {}
        self.bound: dict[str, str] = {}  # variable -> storage
        self.live = self.peak = 0
        self._fresh = 0

    def alloc(self, nbytes: int) -> str:
        self._fresh += 1
        storage = f"#{self._fresh}"
        self.nbytes[storage], self.holders[storage] = nbytes, set()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return storage

    def transient(self, nbytes: int) -> None:
        """A block taken and given back inside one call (a kernel's temporaries)."""
        self.peak = max(self.peak, self.live + nbytes)

    def bind(self, variable: str, storage: str | None) -> None:
        """``variable = <a tensor of storage>`` (None: of a storage held elsewhere, not ours)."""
        old = self.bound.pop(variable, None)
        if storage is not None:
            self.bound[variable] = storage
            self.holders[storage].add(variable)
        if old is not None:
            self.holders[old].discard(variable)
            if not self.holders[old]:
                self.live -= self.nbytes.pop(old)
                del self.holders[old]

    def of(self, variable: str) -> str | None:
        return self.bound.get(variable)


@dataclass(frozen=True)
class Layout:
    """A tensor's shape, strides and itemsize: what the ring's step model reads of q, k, v and
    the output gradient (plain numbers, so that no tensor is made inside the trace)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Layout:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size())

    @classmethod
    def contiguous_of(cls, shape: tuple[int, ...], itemsize: int, order: tuple[int, ...] | None = None) -> Layout:
        """Contiguous in ``order`` (the dims from outermost; None: as the shape)."""
        order = order or tuple(range(len(shape)))
        stride = [0] * len(shape)
        step = 1
        for dim in reversed(order):
            stride[dim], step = step, step * shape[dim]
        return cls(shape, tuple(stride), itemsize)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        """``Tensor.is_contiguous()``: dims of size 1 are skipped."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def is_dense(self) -> bool:
        """Non-overlapping and dense (``is_non_overlapping_and_dense``): some order of the dims is
        contiguous, so ``zeros_like`` keeps these strides (an expanded K/V is not: its are fresh)."""
        expected = 1
        for stride, size in sorted((st, n) for n, st in zip(self.shape, self.stride, strict=True) if n != 1):
            if stride != expected:
                return False
            expected *= size
        return True

    def second_half(self, dim: int) -> Layout:
        """``chunk(2, dim)[1]`` (even sizes): the same strides."""
        return replace(self, shape=tuple(n // 2 if d == dim else n for d, n in enumerate(self.shape)))

    def retyped(self, itemsize: int) -> Layout:
        return replace(self, itemsize=itemsize)

    def transposed(self, a: int, b: int) -> Layout:
        shape, stride = list(self.shape), list(self.stride)
        shape[a], shape[b], stride[a], stride[b] = shape[b], shape[a], stride[b], stride[a]
        return Layout(tuple(shape), tuple(stride), self.itemsize)


#: A local backward call's temporaries: (grad_out, q, k) as the ring passes them → bytes.
CallTemporaries = Callable[[Layout, Layout, Layout], int]
#: A local forward call's temporaries: (q, k) → bytes.
ForwardTemporaries = Callable[[Layout, Layout], int]


@dataclass(frozen=True)
class RingTarget:
    """What the ring's step models take from the target: each local call's temporaries (None:
    none, every call taken to need the traced call's, memcalc's rule for it adds that), gloo's
    staging of the all-gather, log_sigmoid's input-sized buffer, the logsumexp's memory order, and
    whether an in-place add copies a lower-precision operand to the accumulator's float32 first."""

    forward: ForwardTemporaries | None = None
    backward: CallTemporaries | None = None
    gloo: bool = False
    log_sigmoid_buffer: bool = False
    lse_order: tuple[int, ...] = (0, 1, 2)
    # TensorIterator's compute_types (ATen/TensorIterator.cpp), ``common_device == kCPU`` only: "Promotes
    # inputs by creating temporaries of the correct dtype" (``op.tensor().to(common_dtype_)``), freed
    # when the op returns; CUDA's kernels cast as they load. Any CPU, whatever its ISA.
    promotes_inputs: bool = False


#: CUDA: torch's Python code only (NCCL collectives in the caller's buffers, log_sigmoid_forward's
#: buffer empty, the flash kernels' logsumexp (B, H, L)).
CUDA_RING = RingTarget()


def cpu_ring(capabilities: CpuCapabilities) -> RingTarget:
    """The CPU target's (:mod:`memcalc.targets.cpu`) on a CPU with ``capabilities``: the CPU flash
    kernels' temporaries per call, gloo's staging, the CPU ``log_sigmoid_forward``'s buffer,
    logsumexp laid out (B, L, H), and the float32 copy of a bf16/fp16 gradient that
    ``accumulator += gradient`` makes first."""
    def forward(q: Layout, k: Layout) -> int:
        return flash_forward_workspace(q.shape, k.shape[2], _DTYPES[q.itemsize], capabilities.threads)

    return RingTarget(forward, cpu_call_temporaries(capabilities), gloo=True, log_sigmoid_buffer=True,
                      lse_order=(0, 2, 1), promotes_inputs=True)


def cpu_call_temporaries(capabilities: CpuCapabilities) -> CallTemporaries:
    """The CPU flash backward's temporaries per call (:mod:`memcalc.targets.cpu.kernels`): its
    copy of an output gradient not laid out as (B, L, H, E) — the partial step's second half of
    the gradient is not, for B > 1 — its buffers, sized by that call's query length, and (bf16
    through oneDNN's avx512_core_bf16 matmul) its GEMMs' scratch. Only step 0's call is causal, with
    as many queries as keys: its blocks are a non-causal call's."""
    def temporaries(grad_out: Layout, q: Layout, k: Layout) -> int:
        copy = 0 if grad_out.transposed(1, 2).is_contiguous() else grad_out.nbytes
        dtype = _DTYPES[q.itemsize]
        return (copy + flash_backward_workspace(q.shape, k.shape[2], dtype, capabilities.threads)
                + flash_backward_gemm_scratch(q.shape, k.shape[2], dtype, capabilities))

    return temporaries


def _no_temporaries(grad_out: Layout, q: Layout, k: Layout) -> int:
    return 0


def _no_forward_temporaries(q: Layout, k: Layout) -> int:
    return 0


def ring_forward_bytes(query: Layout, key: Layout, value: Layout, cp: int, *, rank: int = 0,
                       load_balanced: bool = True, target: RingTarget = CUDA_RING) -> int:
    """Bytes the ring's forward holds at its peak beyond one local SDPA call (its output, logsumexp
    and the whole call's temporaries) on ``rank``: :func:`ring_forward_peak` less that call."""
    temporaries = target.forward or _no_forward_temporaries
    local = query.nbytes + query.numel // query.shape[3] * _ACCUMULATOR_ITEMSIZE + temporaries(query, key)
    return ring_forward_peak(query, key, value, cp, rank=rank, load_balanced=load_balanced, temporaries=temporaries,
                             gloo=target.gloo, log_sigmoid_buffer=target.log_sigmoid_buffer) - local


def ring_backward_bytes(grad_out: Layout, query: Layout, key: Layout, value: Layout, cp: int, *, rank: int = 0,
                        load_balanced: bool = True, target: RingTarget = CUDA_RING) -> int:
    """Bytes the ring's backward holds at its peak beyond one local SDPA backward (its three
    gradients and the whole call's temporaries) on ``rank``: :func:`ring_backward_peak` less that call."""
    temporaries = target.backward or _no_temporaries
    local = query.nbytes + key.nbytes + value.nbytes + temporaries(grad_out, query, key)
    return ring_backward_peak(grad_out, query, key, value, cp, rank=rank, load_balanced=load_balanced,
                              temporaries=temporaries, gloo=target.gloo, lse_order=target.lse_order,
                              promotes_inputs=target.promotes_inputs) - local


def ring_backward_peak(grad_out: Layout, query: Layout, key: Layout, value: Layout, cp: int, *, rank: int,
                       load_balanced: bool, temporaries: CallTemporaries, gloo: bool,
                       lse_order: tuple[int, ...], promotes_inputs: bool = False) -> int:
    """The peak of ``_templated_ring_attention_backward`` (torch 2.13) on ``rank`` beyond what its
    caller holds, step by step as torch runs it with its defaults (K/V all-gathered once, the K/V
    gradients rotated by all-to-all, float32 accumulators), each line of its code in order; a
    collective completes when it is called (a fake group; gloo's too, on the CPU, for what is
    alive). ``promotes_inputs``: each ``accumulator += gradient`` of a local call's bf16/fp16
    gradient first copies it to float32 (the CPU's TensorIterator; :class:`RingTarget`)."""
    acc = _ACCUMULATOR_ITEMSIZE
    h = _Held()
    promoted = promotes_inputs and query.itemsize != acc

    def add_into_accumulator(gradients: tuple[int, int, int] | None, index: int) -> None:
        """``accumulator += gradient``, ``gradients[index]`` the numel of the local call's gradient
        (None: a SKIP step's float32 zeros): the float32 copy of a lower-precision gradient, freed
        when the add returns."""
        if promoted and gradients is not None:
            h.transient(gradients[index] * acc)

    nq, nkv = query.numel, key.numel + value.numel
    # grad_query/key/value = torch.zeros_like(x, dtype=accum_dtype): x's layout, float32
    h.bind("grad_query", h.alloc(query.numel * acc))
    # the layout zeros_like keeps (a dense one's; else contiguous): flatten() copies it when not contiguous
    grad_key_flat = key.is_contiguous() or not key.is_dense()
    grad_value_flat = value.is_contiguous() or not value.is_dense()
    h.bind("grad_key", h.alloc(key.numel * acc))
    h.bind("grad_value", h.alloc(value.numel * acc))
    # key = key.contiguous(); value = value.contiguous()
    if not key.is_contiguous():
        h.bind("key", h.alloc(key.nbytes))
    if not value.is_contiguous():
        h.bind("value", h.alloc(value.nbytes))
    kv_bytes = key.nbytes + value.nbytes
    lse = Layout.contiguous_of((query.shape[0], query.shape[1], query.shape[2]), 4, lse_order)
    seq = 2
    for i in range(cp):
        if i > 0:  # key, value = views of the all-gathered buffer (kv_rotater.next_buffer())
            h.bind("key", h.of("kv_rotater"))
            h.bind("value", h.of("kv_rotater"))
        if i != cp - 1:  # next_kv = torch.cat([key.flatten(), value.flatten()]); exchange_buffers
            h.bind("next_kv", h.alloc(kv_bytes))
            if h.of("kv_rotater") is None:  # _AllGatherRotater gathers once
                h.bind("kv_rotater", h.alloc(cp * kv_bytes))
                if gloo:  # the flat staging of the gathered size, freed when the op returns
                    h.transient(cp * kv_bytes)
        behaviour = _causal_behaviour(rank, cp, i, load_balanced)
        partial = False
        gradients: tuple[int, int, int] | None = None  # the local call's gradients (numels); None: SKIP
        if behaviour is not None:  # not SKIP: the local backward
            q, k, dout = query, key, grad_out
            if i > 0 and load_balanced and i <= rank:
                k = key.second_half(seq)  # chunk(2)[0]: the first half of k, v
            elif i > 0 and load_balanced:
                q, dout, partial = query.second_half(seq), grad_out.second_half(seq), True
            # the tuple (q, k, v, out_, dout, lse): the half logsumexp made contiguous, then the old bound
            lse_copy = h.alloc(lse.second_half(seq).nbytes) if partial and not lse.second_half(seq).is_contiguous() \
                else None
            h.bind("k", h.of("key"))
            h.bind("v", h.of("value"))
            h.bind("lse", lse_copy)
            v_bytes = value.nbytes // 2 if k is not key else value.nbytes
            outputs = [h.alloc(q.nbytes), h.alloc(k.nbytes), h.alloc(v_bytes)]
            gradients = (q.numel, k.numel, v_bytes // value.itemsize)
            h.transient(temporaries(dout, q, k))
            for name, storage in zip(("grad_query_", "grad_key_", "grad_value_"), outputs, strict=True):
                h.bind(name, storage)
        else:  # SKIP: zeros_like(query / key / value, dtype=accum_dtype)
            for name, numel in (("grad_query_", nq), ("grad_key_", key.numel), ("grad_value_", value.numel)):
                h.bind(name, h.alloc(numel * acc))
        if i > 0:  # next_grad_kv = dkv_rotater.next_buffer(); grad_key, grad_value: views of it
            received = h.of("dkv_rotater")
            for name in ("next_grad_kv", "grad_key", "grad_value"):
                h.bind(name, received)
            grad_key_flat = grad_value_flat = True
        if i > 0 and i <= rank and load_balanced:  # _partial_update: chunks[0] += new, then torch.cat
            add_into_accumulator(gradients, 1)
            h.bind("grad_key", h.alloc(key.numel * acc))
            add_into_accumulator(gradients, 2)
            h.bind("grad_value", h.alloc(value.numel * acc))
        else:  # grad_key += grad_key_; grad_value += grad_value_
            add_into_accumulator(gradients, 1)
            add_into_accumulator(gradients, 2)
        # next_grad_kv = torch.cat([grad_key.flatten(), grad_value.flatten()]): flatten copies what is
        # not contiguous, freed after the cat
        copies = [h.alloc(n * acc) for n, flat in ((key.numel, grad_key_flat), (value.numel, grad_value_flat))
                  if not flat]
        for j, storage in enumerate(copies):
            h.bind(f"flatten{j}", storage)
        cat = h.alloc(nkv * acc)
        for j in range(len(copies)):
            h.bind(f"flatten{j}", None)
        h.bind("next_grad_kv", cat)
        h.bind("dkv_rotater", h.alloc(nkv * acc))  # permute_tensor's output replaces the buffer it held
        # grad_query += grad_query_, or _partial_update's chunks[1] += grad_query_ and its torch.cat
        add_into_accumulator(gradients, 0)
        if load_balanced and i > rank:
            h.bind("grad_query", h.alloc(nq * acc))
    if query.itemsize != acc:  # grad_query.to(query.dtype)
        h.bind("grad_query", h.alloc(query.nbytes))
    received = h.of("dkv_rotater")
    h.bind("next_grad_kv", h.alloc(kv_bytes) if key.itemsize != acc else received)  # .to(key.dtype)
    return h.peak


def _causal_behaviour(rank: int, cp: int, i: int, load_balanced: bool) -> bool | None:
    """``_is_causal_behavior`` for causal attention: is_causal, or None for SKIP."""
    if i == 0:
        return True
    if (rank - i) % cp < rank or load_balanced:
        return False
    return None


def merged_output(out: torch.Tensor) -> torch.Tensor:
    """The ring's output on a load-balanced rank that merges partially (every rank but the last;
    rank 0 is traced): ``_SDPAMerger._partial_update``'s ``torch.cat``, contiguous in (B, H, S/cp, D),
    where the local kernel's keeps (B, S/cp, H, D) in memory. The model's ``transpose(1, 2)`` and
    reshape then copy it, and that copy (o_proj's saved input) lives to the backward: ``Nq·s`` more
    per attention layer than the last rank holds (65,536 B on tests/test_gloo_cp.py's cp rank 0)."""
    return out if out.is_contiguous() else out.contiguous()


class RingAttentionProgram(RankProgram):
    """``inner`` (the rank's FSDP2 program, or none) with ring attention's buffers around every
    ``F.scaled_dot_product_attention`` call, patched as ``context_parallel`` patches it
    (``_distribute_function`` on ``torch.nn.functional``) and restored on :meth:`remove`."""

    def __init__(self, cp: int, inner: RankProgram, *, load_balanced: bool, cpu: bool = False) -> None:
        super().__init__()
        self.cp = cp
        self.load_balanced = load_balanced
        #: the CPU target: each local call's own temporaries (the CPU flash kernels') and gloo's
        #: staging; on CUDA every call is taken to need the traced call's workspace (memcalc's CUDA rule)
        self.target = cpu_ring(CpuCapabilities.here()) if cpu else CUDA_RING
        self.inner = inner
        self.communication = inner.communication  # one set: the report counts both programs' buffers
        self.notes = inner.notes
        self._original: Any = None
        #: SDPA calls the ring ran (forward and recomputation).
        self.calls = 0

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        self.inner.install(tracer, module)
        self.tracer = tracer
        if getattr(F.scaled_dot_product_attention, _RING_MARK, False):
            return  # a rank's later pipeline stage: the process's one patch (its first stage's) rings it already
        self._original = F.scaled_dot_product_attention
        original = self._original
        program = self

        def ring_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                      **kwargs: Any) -> torch.Tensor:
            return program._ring(original, query, key, value, *args, **kwargs)

        setattr(ring_sdpa, _RING_MARK, True)
        F.scaled_dot_product_attention = ring_sdpa

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        return self.inner.optimizer_spec(spec)

    def reduce_accumulated(self) -> None:
        """A pipeline stage's (pp × cp): its FSDP2's gradient sync after the last microbatch."""
        self.inner.reduce_accumulated()

    def remove(self) -> None:
        if self._original is not None:
            F.scaled_dot_product_attention = self._original
            self._original = None
        self.inner.remove()
        super().remove()

    # ---- the ring -------------------------------------------------------------------------
    def _workspace(self, nbytes: int, label: str) -> int:
        uid = self._tracer.synthetic(nbytes, Category.WORKSPACE, persistent=True, label=label)
        self.communication.add(uid)
        return uid

    def _ring(self, original: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
              **kwargs: Any) -> torch.Tensor:
        mask = args[0] if args else kwargs.get("attn_mask")
        if mask is not None:
            # _templated_ring_attention: load balancing requires is_causal=True (no explicit mask)
            raise InapplicableOptionError(
                "context parallelism (torch's ring attention) runs causal attention without a mask: this model "
                "passes attn_mask to scaled_dot_product_attention (a sliding window, padding or a custom mask)",
                hint="Estimate it without cp, or with a model whose attention is plain causal.")
        is_causal = args[2] if len(args) > 2 else kwargs.get("is_causal", False)
        if not is_causal and self.load_balanced:
            # _templated_ring_attention: "Load balancing requires `is_causal=True`."
            raise InapplicableOptionError(
                "context parallelism with load balancing (torch's default when 2 x cp divides the sequence) runs "
                "causal attention only: this model's attention is not causal (is_causal=False)",
                hint="Give a --seq-len that cp divides but 2 x cp does not (torch then shards without load "
                     "balancing), or estimate without cp.")
        assert self.tracer is not None
        self.calls += 1
        qkv = (Layout.of(query), Layout.of(key), Layout.of(value))
        forward = self._workspace(ring_forward_bytes(*qkv, self.cp, load_balanced=self.load_balanced,
                                                     target=self.target),
                                  "ring attention: K/V all-gather and float32 merge (cp)")
        out: torch.Tensor = original(query, key, value, *args, **kwargs)
        self.tracer.release(forward)
        if self.load_balanced:
            out = merged_output(out)  # a module-level lookup: tests leave it out with the ring's bytes
        if out.requires_grad and query.requires_grad:
            self._around_backward(out, query, qkv)
        return out

    def _around_backward(self, out: torch.Tensor, query: torch.Tensor, qkv: tuple[Layout, Layout, Layout]) -> None:
        """Hold the ring backward's bytes beyond the local call (:func:`ring_backward_bytes`, for the
        output gradient as it comes) from the output's gradient (the SDPA backward starts) to the
        query's (it has ended)."""
        held: list[int] = []

        def start(grad: torch.Tensor) -> None:
            nbytes = ring_backward_bytes(Layout.of(grad), *qkv, self.cp, load_balanced=self.load_balanced,
                                         target=self.target)
            held.append(self._workspace(nbytes, "ring attention backward: K/V and gradient rings (cp)"))

        def end(grad: torch.Tensor) -> None:
            assert self.tracer is not None
            while held:
                self.tracer.release(held.pop())

        out.register_hook(start)  # type: ignore[no-untyped-call]
        query.register_hook(end)  # type: ignore[no-untyped-call]


def ring_forward_peak(query: Layout, key: Layout, value: Layout, cp: int, *, rank: int, load_balanced: bool,
                      temporaries: Callable[[Layout, Layout], int], gloo: bool, log_sigmoid_buffer: bool) -> int:
    """The peak of ``_templated_ring_attention`` (torch 2.13) on ``rank`` beyond what its caller
    holds, step by step as :func:`ring_backward_peak`; ``log_sigmoid_buffer``: the merge's
    ``log_sigmoid_forward`` takes an input-sized buffer (the CPU kernel's ``empty_like``)."""
    acc = _ACCUMULATOR_ITEMSIZE
    h = _Held()
    if not key.is_contiguous():  # key = key.contiguous(); value = value.contiguous()
        h.bind("key", h.alloc(key.nbytes))
    if not value.is_contiguous():
        h.bind("value", h.alloc(value.nbytes))
    kv_bytes, seq = key.nbytes + value.nbytes, 2
    for i in range(cp):
        if i > 0:  # next_kv = rotater.next_buffer(); key, value: views of the gathered K/V
            for name in ("next_kv", "key", "value"):
                h.bind(name, h.of("rotater"))
        if i < cp - 1:  # next_kv = torch.cat(...); next_kv = rotater.exchange_buffers(next_kv) (None)
            h.bind("next_kv", h.alloc(kv_bytes))
            if h.of("rotater") is None:
                h.bind("rotater", h.alloc(cp * kv_bytes))
                if gloo:
                    h.transient(cp * kv_bytes)
            h.bind("next_kv", None)
        behaviour = _causal_behaviour(rank, cp, i, load_balanced)
        if behaviour is None:
            continue
        q, k, partial = query, key, False
        if i > 0 and load_balanced and i <= rank:
            k = key.second_half(seq)
        elif i > 0 and load_balanced:
            q, partial = query.second_half(seq), True
        h.bind("k", h.of("key"))
        h.bind("v", h.of("value"))
        out_bytes, lse_bytes = q.numel * query.itemsize, q.numel // q.shape[3] * acc
        block_out, block_lse = h.alloc(out_bytes), h.alloc(lse_bytes)  # the local call's out, logsumexp
        h.transient(temporaries(q, k))
        h.bind("out", block_out)
        h.bind("logsumexp", block_lse)
        # _SDPAMerger.step: the float32 copy of a 16-bit block output (the step's own)
        f32_out = h.alloc(q.numel * acc) if query.itemsize != acc else block_out
        h.bind("step_out", f32_out)
        if h.of("merged_out") is None:  # the first block: kept as it is
            h.bind("merged_out", f32_out)
            h.bind("merged_lse", block_lse)
            h.bind("step_out", None)
            continue
        # out = out - F.sigmoid(block_lse - lse) * (out - block_out)
        n_out, n_lse = q.numel * acc, lse_bytes
        t1 = h.alloc(n_lse)
        h.bind("t1", t1)
        h.bind("t2", h.alloc(n_lse))
        h.bind("t1", None)
        h.bind("t3", h.alloc(n_out))
        h.bind("t4", h.alloc(n_out))
        h.bind("t2", None)
        h.bind("t3", None)
        h.bind("new_out", h.alloc(n_out))
        h.bind("t4", None)
        # lse = lse - F.logsigmoid(lse - block_lse): log_sigmoid_forward's buffer (empty_like on the CPU)
        h.bind("u1", h.alloc(n_lse))
        h.bind("u2", h.alloc(n_lse))
        if log_sigmoid_buffer:
            h.transient(n_lse)
        h.bind("u1", None)
        h.bind("new_lse", h.alloc(n_lse))
        h.bind("u2", None)
        if partial:  # _partial_update: torch.cat of the chunks, a new whole
            h.bind("merged_lse", h.alloc(query.numel // query.shape[3] * acc))
            h.bind("merged_out", h.alloc(query.numel * acc))
        else:
            h.bind("merged_lse", h.of("new_lse"))
            h.bind("merged_out", h.of("new_out"))
        for name in ("new_out", "new_lse", "step_out"):
            h.bind(name, None)
    if query.itemsize != acc:  # results(): self._out.to(out_dtype)
        h.bind("result", h.alloc(query.nbytes))
    return h.peak

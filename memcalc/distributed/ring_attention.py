"""The rank program of context parallelism: torch's ring attention around another program.

``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13,
``_context_parallel/_attention.py``) patches ``F.scaled_dot_product_attention`` and runs each
call as ``_templated_ring_attention``: the rank's queries (``S/cp`` tokens) against every
rank's keys and values, ``cp`` local SDPA calls merged by ``_SDPAMerger`` (its handlers cover the
CUDA SDPA ops only; tests/gloo_cp.py adds the CPU flash op for real gloo steps, and the partial
merge's output layout it found is :func:`merged_output`'s). This program traces the rank's model at
``S/cp`` tokens (its local SDPA is one of the ring's calls; what autograd saves — q, k, v, the
merged output and logsumexp — is the ring's too) and holds, around each SDPA call and its
backward, the bytes the ring holds beyond one local call. With ``Nq`` = B·H·(S/cp)·D query
elements, ``Nkv`` = B·H_kv·(S/cp)·D key elements (after any ``repeat_kv``), ``s`` their itemsize,
and torch's defaults (``rotate_method=ALL_GATHER``, ``convert_to_f32=True``), on the busiest rank:

- forward: the all-gathered K/V of every rank (``_AllGatherRotater``: cp·2·Nkv·s) and the
  float32 merge (``_SDPAMerger._merge_one``: the block output, ``out - block_out`` and the
  product, 2·Nq·4 + Nq·s; for 16-bit inputs also the float32 copies, 2·Nq·4 − Nq·s);
- backward (``_templated_ring_attention_backward``): the all-gathered K/V again, the float32
  accumulators ``grad_query/key/value`` ((Nq + 2·Nkv)·4), the gradient ring's float32 send and
  receive (``dkv_rotater``: 2·2·Nkv·4), and one more step's gradients ((Nq + 3·Nkv)·s).

These figures are torch's own: tests/test_context_parallel.py runs the real
``_templated_ring_attention`` and its backward on the CPU (the CPU flash op as the local op, a
fake process group, every rank of cp = 2 and 4, float32 and bfloat16) and compares the profiler's
peak beyond one local call with them. On the fake group a collective completes at once; NCCL keeps
the K/V send buffer (2·Nkv·s) until the next step's wait, before the merge's peak.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memcalc.core.categories import Category
from memcalc.core.errors import InapplicableOptionError
from memcalc.distributed.program import RankProgram
from memcalc.engine.optimizers import OptimizerSpec
from memcalc.engine.trace import StorageTracer

__all__ = ("RingAttentionProgram", "merged_output", "ring_backward_bytes", "ring_forward_bytes")

#: ``_ContextParallelOptions.convert_to_f32``: the merge and the gradient accumulators in float32.
_ACCUMULATOR_ITEMSIZE = 4


def ring_forward_bytes(query: torch.Size, key: torch.Size, itemsize: int, cp: int) -> int:
    """Bytes the ring's forward holds beyond one local SDPA call on its busiest rank (see the
    module docstring). ``query`` and ``key`` are the local (B, H, S/cp, D) shapes."""
    nq, nkv = query.numel(), key.numel()
    f32 = _ACCUMULATOR_ITEMSIZE
    upcast = 2 * nq * f32 - nq * itemsize if itemsize != f32 else 0
    return cp * 2 * nkv * itemsize + 2 * nq * f32 + nq * itemsize + upcast


def ring_backward_bytes(query: torch.Size, key: torch.Size, itemsize: int, cp: int) -> int:
    """Bytes the ring's backward holds beyond one local SDPA backward on its busiest rank."""
    nq, nkv = query.numel(), key.numel()
    f32 = _ACCUMULATOR_ITEMSIZE
    return cp * 2 * nkv * itemsize + (nq + 2 * nkv) * f32 + 2 * 2 * nkv * f32 + (nq + 3 * nkv) * itemsize


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

    def __init__(self, cp: int, inner: RankProgram, *, load_balanced: bool) -> None:
        super().__init__()
        self.cp = cp
        self.load_balanced = load_balanced
        self.inner = inner
        self.communication = inner.communication  # one set: the report counts both programs' buffers
        self.notes = inner.notes
        self._original: Any = None
        #: SDPA calls the ring ran (forward and recomputation).
        self.calls = 0

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        self.inner.install(tracer, module)
        self.tracer = tracer
        self._original = F.scaled_dot_product_attention
        original = self._original
        program = self

        def ring_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                      **kwargs: Any) -> torch.Tensor:
            return program._ring(original, query, key, value, *args, **kwargs)

        F.scaled_dot_product_attention = ring_sdpa

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        return self.inner.optimizer_spec(spec)

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
        itemsize = key.element_size()
        forward = self._workspace(ring_forward_bytes(query.shape, key.shape, itemsize, self.cp),
                                  "ring attention: K/V all-gather and float32 merge (cp)")
        out: torch.Tensor = original(query, key, value, *args, **kwargs)
        self.tracer.release(forward)
        if self.load_balanced:
            out = merged_output(out)  # a module-level lookup: tests leave it out with the ring's bytes
        if out.requires_grad and query.requires_grad:
            self._around_backward(out, query, ring_backward_bytes(query.shape, key.shape, itemsize, self.cp))
        return out

    def _around_backward(self, out: torch.Tensor, query: torch.Tensor, nbytes: int) -> None:
        """Hold ``nbytes`` from the output's gradient (the SDPA backward starts) to the query's
        (it has ended)."""
        held: list[int] = []

        def start(grad: torch.Tensor) -> None:
            held.append(self._workspace(nbytes, "ring attention backward: K/V and gradient rings (cp)"))

        def end(grad: torch.Tensor) -> None:
            assert self.tracer is not None
            while held:
                self.tracer.release(held.pop())

        out.register_hook(start)  # type: ignore[no-untyped-call]
        query.register_hook(end)  # type: ignore[no-untyped-call]

"""Selective activation checkpointing: the policy torchtitan's Llama recipes use, and the
``context_fn`` that hands a policy to torch's own ``create_selective_checkpoint_contexts``.

torchtitan's op-level SAC (``selective_ac_option="op"``) saves the outputs of the ops in its
``_op_sac_save_list`` (torchtitan/models/llama3/infra/parallelize.py, pytorch/torchtitan
commit 018740b: ``aten.mm``, the SDPA kernels, ``_c10d_functional.reduce_scatter_tensor``,
``aten.max``) and recomputes the rest, except every second ``mm`` of a block, which it
recomputes too (torchtitan/distributed/activation_checkpoint.py before the naming rewrite,
``_get_custom_policy``: ``meta[mm_count_key] % 2 == 0``; the count is kept apart for the forward
and the recomputation, and starts afresh for each checkpointed call). What this saves and what
it recomputes is then PyTorch's: the policy runs inside ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memcalc.core.checkpointing import Checkpointing, CheckpointKind, SacPolicy

__all__ = ("SAVED_OPS", "selective_context_fn", "torchtitan_policy")

aten = torch.ops.aten

#: The ops whose outputs torchtitan's op-level SAC saves (its ``_op_sac_save_list``, aten ops
#: only), plus the CPU's flash attention kernel: the CPU target's counterpart of the CUDA
#: kernels, so that a CPU run saves attention as the CUDA step does.
SAVED_OPS: frozenset[Any] = frozenset({
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_attention_math.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # torchtitan: "the absolute maximum is used to compute the scaling factor for quantization"
    aten.max.default,
})


def torchtitan_policy() -> SacPolicy:
    """A fresh torchtitan op-level policy for one checkpointed call (its ``mm`` counts start at 0)."""
    mm_counts: Counter[bool] = Counter()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == aten.mm.default:
            mm_counts[ctx.is_recompute] += 1
        every_second_mm = op == aten.mm.default and mm_counts[ctx.is_recompute] % 2 == 0
        return (CheckpointPolicy.MUST_SAVE if op in SAVED_OPS and not every_second_mm
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return policy


def selective_context_fn(checkpointing: Checkpointing) -> Callable[[], Any] | None:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for ``checkpointing``: torch's
    selective contexts with the policy (a fresh one per call for torchtitan's, whose counts are
    per call), or None where the whole block is recomputed."""
    if checkpointing.kind is CheckpointKind.SELECTIVE_OP:
        return lambda: create_selective_checkpoint_contexts(torchtitan_policy())  # type: ignore[no-untyped-call]
    if checkpointing.kind is CheckpointKind.POLICY:
        assert checkpointing.policy is not None
        return functools.partial(create_selective_checkpoint_contexts, checkpointing.policy)
    return None

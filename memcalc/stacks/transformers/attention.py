"""The attention code a Hugging Face model runs (``--attn``), and how memcalc models each.

transformers models call attention through ``ALL_ATTENTION_FUNCTIONS`` under the name in
``config._attn_implementation`` (by default ``sdpa`` where the class supports it, else ``eager``):

- ``eager``: the model's own ``eager_attention_forward``; nothing to emulate, memcalc runs it.
- ``sdpa``: ``F.scaled_dot_product_attention``, which memcalc's CUDA emulation
  (:mod:`memcalc.targets.cuda.emulation`) replaces by the fused kernel CUDA would choose.
- ``flash_attention_2``: flash-attn is not installed (it needs a GPU), and asking transformers
  for it would import it. So :func:`flash_attention_2_forward` is registered with
  ``AttentionInterface.register`` under :data:`MEMCALC_FA2` and calls PyTorch's flash SDPA op
  (``aten._scaled_dot_product_flash_attention``), whose CUDA kernel is FlashAttention-2 itself
  and which saves the same tensors for backward as flash-attn. float32 inputs and head dims
  above 256 are refused, as flash-attn refuses them.

The name has no "flash" in it because transformers imports flash-attn for every name that
contains "flash"; it is registered with transformers' ``flash_attention_mask`` so the function
gets the mask flash-attn would. Registering adds a key to transformers' global mapping once.

The facts checked in transformers and flash-attn, and what is not modelled (unpadding, sliding
windows, softcapping): docs/notes/hf-attention.md.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from memcalc.core.errors import InvalidInputError
from memcalc.stacks.transformers.hub import HfAttention

__all__ = (
    "FLASH_ATTENTION_2_MAX_HEAD_DIM",
    "MEMCALC_FA2",
    "attention_note",
    "check_supported",
    "flash_attention_2_forward",
    "implementation_name",
)

#: memcalc's flash-attn 2 stand-in in transformers' attention and mask interfaces.
MEMCALC_FA2 = "memcalc_fa2"
#: flash_api.cpp mha_fwd: "FlashAttention forward only supports head dimension at most 256".
FLASH_ATTENTION_2_MAX_HEAD_DIM = 256
_HALF = (torch.float16, torch.bfloat16)


def implementation_name(transformers: ModuleType, attn: HfAttention | None) -> str | None:
    """The ``attn_implementation`` to build the model with (None: transformers' default)."""
    if attn is None:
        return None
    if attn is HfAttention.FLASH_ATTENTION_2:
        _register(transformers)
        return MEMCALC_FA2
    return str(attn.value)


def _register(transformers: ModuleType) -> None:
    masking: Any = getattr(transformers, "masking_utils", None)
    if not hasattr(transformers, "AttentionInterface") or not hasattr(masking, "AttentionMaskInterface"):
        raise InvalidInputError(
            f"--attn flash_attention_2 needs transformers 4.53 or later (AttentionInterface, masking_utils); "
            f"this is {transformers.__version__}", hint="Upgrade it: pip install -U transformers.")
    transformers.AttentionInterface.register(MEMCALC_FA2, flash_attention_2_forward)
    masking.AttentionMaskInterface.register(MEMCALC_FA2, masking.flash_attention_mask)


def check_supported(model: nn.Module, attn: HfAttention | None, name: str) -> None:
    """Refuse ``flash_attention_2`` for a model transformers would refuse it for
    (``_supports_flash_attn`` False: its attention does not go through flash-attn)."""
    if attn is HfAttention.FLASH_ATTENTION_2 and not getattr(model, "_supports_flash_attn", False):
        raise InvalidInputError(
            f"{name} ({type(model).__name__}) does not support flash_attention_2 in transformers",
            hint="Use --attn sdpa or --attn eager.")


def attention_note(model: nn.Module, attn: HfAttention | None) -> str:
    """The report's line saying which attention the model runs."""
    config = getattr(model, "config", None)
    used = getattr(config, "_attn_implementation", None)
    chosen = "asked with --attn" if attn is not None else "transformers' default for this model"
    if used == MEMCALC_FA2:
        return (f"attention: flash_attention_2 ({chosen}): flash-attn's kernel, modelled by PyTorch's flash SDPA op "
                f"(the same FlashAttention-2 code; saves q, k, v, the output and a float32 logsumexp)")
    if used == "eager":
        return (f"attention: eager ({chosen}): softmax(QKᵀ) computed as tensors, "
                f"batch × heads × seq² per layer, saved for backward")
    if used == "sdpa":
        return f"attention: sdpa ({chosen}): scaled_dot_product_attention, the kernel CUDA would choose"
    return f"attention: {used} ({chosen})"


def flash_attention_2_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``flash_attention_forward`` with PyTorch's flash SDPA op in place of
    flash-attn (module docstring). q/k/v arrive as (B, H, T, D); the output leaves as
    (B, T, H, D), flash-attn's layout.
    """
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if max(head_dim, v_head_dim) > FLASH_ATTENTION_2_MAX_HEAD_DIM:
        raise InvalidInputError(
            f"flash_attention_2 takes head dimensions up to {FLASH_ATTENTION_2_MAX_HEAD_DIM}; this model has "
            f"{max(head_dim, v_head_dim)} (flash-attn refuses it)", hint="Use --attn sdpa or --attn eager.")
    if v_head_dim != head_dim:  # transformers pads v to q's head dim (MLA) and crops the output
        value = nn.functional.pad(value, [0, head_dim - v_head_dim])
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, float(dropout), causal and query.shape[2] > 1, False, scale=scaling)[0]
    if out.dtype not in _HALF:
        raise InvalidInputError(
            f"flash_attention_2 runs in fp16 or bf16 only, and this step reaches it in {out.dtype} "
            f"(flash-attn: \"FlashAttention only support fp16 and bf16 data type\")",
            hint="Use --precision amp-bf16 (or amp-fp16, bf16, fp16), or --attn sdpa for float32.")
    out = out.transpose(1, 2)
    return (out[..., :v_head_dim] if v_head_dim != head_dim else out), None

"""The attention code a Hugging Face model runs (``--attn``), and how memcalc models each.

transformers models call attention through ``ALL_ATTENTION_FUNCTIONS`` under the name in
``config._attn_implementation``. Facts checked in transformers 5.23 (site-packages):

- The default. ``PreTrainedModel.__init__`` (``modeling_utils.py`` line 1258) sets the
  implementation through ``_check_and_adjust_attn_implementation`` →
  ``get_correct_attn_implementation`` (line 1845): none asked → ``"sdpa"``, kept when
  ``_sdpa_can_dispatch`` agrees (the class sets ``_supports_sdpa``), else ``"eager"``. On meta
  and CPU this is ``sdpa`` for Llama, GPT-2, BERT. ``from_config(config,
  attn_implementation=...)`` writes the request onto the config (line 1420) — the *same* config
  object, so every build says what it wants.
- ``eager``: the model's own ``eager_attention_forward`` (``models/llama/modeling_llama.py``
  line 180): ``softmax(QKᵀ·scale + mask)`` in float32, cast back, dropout, ``@ V`` — the
  B·H·T² probabilities are real tensors, saved for backward. Nothing to emulate: memcalc runs it.
- ``sdpa``: ``integrations/sdpa_attention.py`` calls ``F.scaled_dot_product_attention``
  (``enable_gqa=True`` for grouped k/v without a mask, else ``repeat_kv``). memcalc's CUDA
  emulation (:mod:`memcalc.targets.cuda.emulation`) replaces that call by the fused kernel CUDA would
  choose (:mod:`memcalc.targets.cuda.sdpa`), with its scratch (:mod:`memcalc.targets.cuda.attention_memory`).
- ``flash_attention_2``: ``integrations/flash_attention.py`` transposes q/k/v to (B, T, H, D),
  casts float32 q/k/v to the autocast dtype (``get_target_dtype``) and calls flash-attn. flash-attn
  is not installed here (and needs a GPU), and asking transformers for it would import it.

How memcalc models flash-attn 2 without it: :func:`flash_attention_2_forward` is registered with
``AttentionInterface.register`` under :data:`MEMCALC_FA2`, and the model is built with that name.
It calls ``torch.ops.aten._scaled_dot_product_flash_attention`` — PyTorch's flash SDPA op, whose
CUDA kernel is FlashAttention-2 itself (PyTorch vendors ``flash_api.cpp``) and whose meta kernel
runs on this CPU-only torch (``torch/_meta_registrations.py`` line 6106). Both save the same
tensors for backward: flash-attn's ``FlashAttnFunc.forward`` does
``ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)`` after
``_flash_attn_forward`` returned ``out_padded, softmax_lse, S_dmask, rng_state`` with
``softmax_lse`` of shape (B, H, T) in float32 (Dao-AILab/flash-attention,
``flash_attn/flash_attn_interface.py`` at 0053002, ``_flash_attn_forward`` and its fake);
PyTorch's op returns the output and a (B, H, T) float32 logsumexp and saves q, k, v, the output,
the logsumexp and the philox seed/offset. Grouped k/v go in unrepeated (flash-attn takes fewer
k/v heads; the meta kernel sizes dk/dv like k/v). memcalc's workspace rules then add the
kernel's scratch (split-KV accumulators, ``softmax_d``, ``dq_accum``, expanded dk/dv for GQA),
which is the same code in both. Under mixed precision the op is in CUDA autocast's lower-precision
list (``autocast_mode.cpp``), so the emulation casts q/k/v to fp16/bf16 as transformers'
``get_target_dtype`` would; float32 reaching the kernel is refused, as flash-attn refuses it
(``csrc/flash_attn/flash_api.cpp``, ``mha_fwd``: "FlashAttention only support fp16 and bf16
data type"), and so are head dims above 256 ("FlashAttention forward only supports head
dimension at most 256"). Not modelled: the padding-free path for a 2-D padding mask
(transformers unpads q/k/v into varlen calls; memcalc runs the padded batch, an upper bound),
sliding windows and softcapping (they change the arithmetic, not what is saved).

Why the name has no "flash" in it: transformers treats every implementation whose name contains
"flash" as flash-attn (``utils/generic.py`` line 269, ``is_flash_attention_requested``) and
imports the package for it (``modeling_utils.py`` lines 1827-1828). The name is also registered
with ``AttentionMaskInterface`` (``masking_utils.py`` line 733) with transformers' own
``flash_attention_mask`` (line 636), so the function gets what flash-attn would: no mask for a
causal batch without padding; an unregistered name would get no mask at all (line 841).
Registering adds a key to transformers' global mapping once; it changes nothing else.
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

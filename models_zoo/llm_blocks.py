"""Pieces shared by the zoo's decoder LLMs (Llama, Mistral, Qwen2, Gemma 2), written op for op
as Hugging Face transformers 5.23 runs them, so that the tensors memcalc traces are the ones HF
allocates.

* ``GatedMLP``: ``down(act(gate(x)) * up(x))`` — SwiGLU (Llama, Mistral, Qwen2), GeGLU (Gemma 2);
* rotary embeddings (``RotaryEmbedding``, ``apply_rotary_pos_emb``), HF's default rope type;
* ``repeat_kv``: grouped-query K/V heads copied out to the query heads (``expand`` + ``reshape``);
* ``sdpa_attention``: ``integrations/sdpa_attention.py::sdpa_attention_forward`` for a training
  forward without a KV cache;
* ``eager_attention``: the ``eager_attention_forward`` of ``modeling_gemma2.py`` (logit
  softcapping included), the attention Gemma 2 runs by default;
* the causal and sliding-window masks of ``masking_utils.py`` (``sdpa_mask``, ``eager_mask``)
  for an unpadded batch.

The zoo's models run as HF's do with ``use_cache=False``: HF's default ``use_cache=True`` keeps
a ``DynamicCache`` even in training (a ``cat`` copy of every layer's K and V), and its
``use_cache=False`` mask code looks for packed sequences by reading ``position_ids`` values,
which meta tensors do not have; the zoo assumes one unpadded sequence per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = (
    "SDPA_GQA_MAX_HEAD_DIM",
    "GatedMLP",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "causal_mask",
    "eager_attention",
    "eager_float_mask",
    "repeat_kv",
    "rotate_half",
    "sdpa_attention",
    "sdpa_needs_mask",
)

#: ``use_gqa_in_sdpa`` (transformers 5.23, integrations/sdpa_attention.py): on CUDA and CPU,
#: ``enable_gqa=True`` is passed only without a mask and with ``head_dim <= 256``.
SDPA_GQA_MAX_HEAD_DIM = 256


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, HF's ``LlamaMLP`` (``act_fn``: ``nn.SiLU`` by default)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn: nn.Module | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``(1, T, head_dim)`` for positions ``0..T-1`` (HF's default rope type).

    Unlike HF there is no ``inv_freq`` buffer (it is rebuilt from ``arange`` on the input's
    device, 64 floats), so nothing needs materializing after a meta build."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.base = base

    def forward(self, x: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=x.device).float() / self.head_dim
        inv_freq = 1.0 / (self.base ** exponent)
        positions = torch.arange(seq_len, device=x.device).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(0)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, kv_heads, T, hd) → (B, kv_heads * n_rep, T, hd), as HF (materializes the copy)."""
    if n_rep == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, hd).reshape(b, kv * n_rep, t, hd)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, n_rep: int, mask: Tensor | None = None, *,
                   enable_gqa: bool = True, dropout_p: float = 0.0) -> Tensor:
    """HF's ``sdpa_attention_forward`` (transformers 5.23) in a training forward: ``(B, H, T, hd)``
    in, ``(B, H, T, hd)`` out.

    Grouped-query K/V go to SDPA as they are, with ``enable_gqa=True``, when there is no mask
    and ``head_dim <= 256`` (``use_gqa_in_sdpa`` on CUDA and CPU); otherwise they are copied out
    with :func:`repeat_kv` first. ``enable_gqa=False`` always repeats, as transformers 4.x did.
    ``is_causal`` is used only without a mask and for more than one query
    (``q_length > 1 and attention_mask is None``)."""
    gqa: dict[str, bool] = {}
    if n_rep > 1:
        if enable_gqa and mask is None and k.shape[-1] == v.shape[-1] <= SDPA_GQA_MAX_HEAD_DIM:
            gqa["enable_gqa"] = True
        else:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=mask is None and q.shape[2] > 1, **gqa)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, n_rep: int, mask: Tensor, *, scaling: float,
                    softcap: float | None, dropout_p: float, training: bool) -> Tensor:
    """HF's ``eager_attention_forward`` (modeling_gemma2.py): the ``(B, H, T, T)`` scores are
    materialized, soft-capped (``tanh(s / cap) · cap``), masked by addition, softmaxed in float32.
    Returns ``(B, T, H, hd)``, contiguous (HF's ``transpose(1, 2).contiguous()``)."""
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    weights = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = weights / softcap
        weights = torch.tanh(weights)
        weights = weights * softcap
    weights = weights + mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=dropout_p, training=training)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()


# ---- masks (masking_utils.py) -----------------------------------------------------------------
def sdpa_needs_mask(seq_len: int, sliding_window: int | None) -> bool:
    """``_ignore_causal_mask_sdpa`` for an unpadded batch without a cache: SDPA gets no mask
    (``is_causal`` instead) unless a sliding window applies — from ``seq_len >= sliding_window``
    on, even at ``==`` where the window hides nothing yet."""
    return sliding_window is not None and seq_len >= sliding_window


def causal_mask(batch: int, seq_len: int, device: torch.device, sliding_window: int | None = None) -> Tensor:
    """``sdpa_mask``'s boolean mask ``(batch, 1, T, T)``, True where a query may attend: one
    ``(1, 1, T, T)`` tensor expanded over the batch, built with HF's ops
    (``causal_mask_function``, or ``and_masks(sliding_window_overlay, causal_mask_function)``).
    HF's ``batch`` and ``head`` index tensors (a few bytes, unused by these masks) are left out."""
    q_idx = (torch.arange(seq_len, device=device) + 0)[None, None, :, None]  # + q_offset
    kv_idx = (torch.arange(seq_len, device=device) + 0)[None, None, None, :]  # + kv_offset
    if sliding_window is None:
        allowed = kv_idx <= q_idx
    else:
        allowed = q_idx.new_ones((), dtype=torch.bool)
        allowed = allowed & (kv_idx > q_idx - sliding_window)
        allowed = allowed & (kv_idx <= q_idx)
    return allowed.expand(batch, -1, seq_len, seq_len)


def eager_float_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """``eager_mask``: the boolean mask made additive, 0 where allowed and the dtype's minimum
    elsewhere — a full ``(batch, 1, T, T)`` tensor of ``dtype`` (the expand is materialized)."""
    zero = torch.zeros((), device=allowed.device, dtype=dtype)
    return torch.where(allowed, zero, torch.finfo(dtype).min)

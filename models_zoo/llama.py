"""Llama 2 (7B, 13B, 70B) and a small llama-shaped model, laid out as HF ``LlamaForCausalLM``.

Names follow HF (``model.embed_tokens``, ``model.layers.9.self_attn.q_proj``,
``model.layers.9.mlp.gate_proj``, ``model.layers.9.input_layernorm``, ``model.norm``,
``lm_head``, untied) and counts match the hub checkpoints. As in HF:

* RMSNorm computes in float32 and casts back (so a bf16 run holds an fp32 copy);
* rotary embeddings are computed once per forward in ``model.rotary_emb`` and handed to
  every layer as ``(cos, sin)``; unlike HF there is no ``inv_freq`` buffer (it is rebuilt
  from ``arange`` on the input's device), so nothing needs materializing after a meta build;
* grouped-query attention repeats the K/V heads with ``expand`` + ``reshape`` (HF's
  ``repeat_kv``) before ``F.scaled_dot_product_attention(..., is_causal=True)``.

Layers are called as ``layer(hidden, cos, sin)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin tables ``(1, T, head_dim)`` for positions ``0..T-1`` (HF's default rope type)."""

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


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, kv_heads, T, hd) → (B, kv_heads * n_rep, T, hd), as HF (materializes the copy)."""
    if n_rep == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, hd).reshape(b, kv * n_rep, t, hd)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, k, cos, sin)
        n_rep = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        projected: Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return projected


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.head_dim, base=cfg.rope_theta)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(x, input_ids.shape[1])
        for layer in self.layers:
            x = layer(x, cos, sin)
        hidden: Tensor = self.norm(x)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``(B, T, vocab)``."""
        logits: Tensor = self.lm_head(self.model(input_ids))
        return logits


def parameter_count(cfg: LlamaConfig) -> int:
    """Closed form: embeddings + untied head + per-layer attention/MLP/norms + final norm."""
    d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size + 2 * d
    return 2 * cfg.vocab_size * d + cfg.num_layers * per_layer + d


def _build(cfg: LlamaConfig, shape: tuple[int, ...]) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg)  # no position table: the sequence length does not change the model


_TINY = LlamaConfig(512, 8, 8, 2, 1376, max_position_embeddings=512)

# config, reference count, default sequence length, description.
_CONFIGS = {
    "llama-2-7b": (LlamaConfig(4096, 32, 32, 32, 11008), 6_738_415_616, "meta-llama/Llama-2-7b-hf"),
    "llama-2-13b": (LlamaConfig(5120, 40, 40, 40, 13824), 13_015_864_320, "meta-llama/Llama-2-13b-hf"),
    "llama-2-70b": (LlamaConfig(8192, 80, 64, 8, 28672), 68_976_648_192, "meta-llama/Llama-2-70b-hf"),
    "llama-tiny": (_TINY, parameter_count(_TINY), "memcalc's own small config, not a released model"),
}

for _name, (_cfg, _count, _source) in _CONFIGS.items():
    gqa = f", {_cfg.num_kv_heads} KV heads" if _cfg.num_kv_heads != _cfg.num_heads else ""
    register(
        ZooEntry(
            name=_name,
            family="llama",
            builder=partial(_build, _cfg),
            input_kind=InputKind.TOKENS,
            default_shape=(_cfg.max_position_embeddings,),
            loss=LossKind.LM_CROSS_ENTROPY,
            reference_parameters=_count,
            vocab_size=_cfg.vocab_size,
            description=f"HF LlamaForCausalLM ({_source}): {_cfg.num_layers} layers, d {_cfg.hidden_size}, "
                        f"{_cfg.num_heads} heads{gqa}, SwiGLU {_cfg.intermediate_size}",
            block_containers=("model.layers",),
            context_length=_cfg.max_position_embeddings,
            decoder=True,
        )
    )

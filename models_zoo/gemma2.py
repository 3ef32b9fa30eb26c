"""Gemma 2 (2B, 9B), laid out as HF ``Gemma2ForCausalLM`` and run as HF runs it by default.

Names follow HF (``model.embed_tokens``, ``model.layers.3.self_attn.q_proj``,
``model.layers.3.pre_feedforward_layernorm``, ``model.norm``, ``lm_head``) and counts match the
hub checkpoints. ``lm_head.weight`` *is* ``model.embed_tokens.weight`` (tied, counted once).
What HF does, done the same way here:

* **eager attention**: ``Gemma2PreTrainedModel`` declares ``_supports_sdpa = False`` (SDPA has no
  logit softcapping), so HF picks ``eager``: the ``(B, H, T, T)`` scores are materialized,
  scaled by ``query_pre_attn_scalar ** -0.5``, soft-capped at 50 (``tanh(s / 50) · 50``), masked
  by adding a float mask, softmaxed in float32 (:func:`models_zoo.llm_blocks.eager_attention`);
* **masks**: eager attention always gets float masks ``(B, 1, T, T)`` in the embeddings' dtype,
  made once per forward: a causal one for the global layers and a sliding-window (4096) one for
  the others — both built even when ``T <= 4096``, where they hold the same values;
* layers alternate: even layers (0, 2, …) slide, odd ones are global (HF's ``layer_types``);
* RMSNorm scales by ``1 + weight`` in float32 before casting back (weights start at zero);
  four per layer: input, post-attention, pre-feedforward, post-feedforward;
* embeddings are multiplied by ``sqrt(hidden_size)`` (HF multiplies by a 0-dim buffer; here a
  Python float: the same ``(B, T, d)`` product, without the buffer);
* the MLP is gated with ``gelu(approximate="tanh")`` (``gelu_pytorch_tanh``);
* the logits are soft-capped at 30: ``tanh(logits / 30) · 30``, three more ``(B, T, vocab)`` tensors.

Layers are called as ``layer(hidden, cos, sin, mask)`` with the mask their attention type uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from .llm_blocks import (
    GatedMLP,
    RotaryEmbedding,
    apply_rotary_pos_emb,
    causal_mask,
    eager_attention,
    eager_float_mask,
)
from .registry import HfConfig, InputKind, LossKind, ZooEntry, register

__all__ = (
    "Gemma2Attention",
    "Gemma2Config",
    "Gemma2DecoderLayer",
    "Gemma2ForCausalLM",
    "Gemma2Model",
    "Gemma2RMSNorm",
    "parameter_count",
)


@dataclass(frozen=True)
class Gemma2Config:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 256
    vocab_size: int = 256000
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    attention_dropout: float = 0.0

    def is_sliding(self, layer: int) -> bool:
        """HF's ``layer_types``: ``"sliding_attention" if (i + 1) % 2 else "full_attention"``."""
        return (layer + 1) % 2 == 1


class Gemma2RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h * (1.0 + self.weight.float())
        return h.type_as(x)


class Gemma2Attention(nn.Module):
    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scaling = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.dropout = cfg.attention_dropout
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = eager_attention(q, k, v, self.num_heads // self.num_kv_heads, mask, scaling=self.scaling,
                              softcap=self.softcap, dropout_p=self.dropout if self.training else 0.0,
                              training=self.training)
        projected: Tensor = self.o_proj(out.reshape(b, t, -1))
        return projected


class Gemma2DecoderLayer(nn.Module):
    """Norms on both sides of each sub-block: x + post(attn(input(x))), then + post_ff(mlp(pre_ff(.)))."""

    def __init__(self, cfg: Gemma2Config, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.self_attn = Gemma2Attention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, nn.GELU(approximate="tanh"))
        self.input_layernorm = Gemma2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Gemma2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x


class Gemma2Model(nn.Module):
    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.sliding_window = cfg.sliding_window
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(cfg, cfg.is_sliding(i)) for i in range(cfg.num_layers))
        self.norm = Gemma2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        b, t = input_ids.shape
        # HF's order: create_causal_mask, then create_sliding_window_causal_mask, then the rotary tables.
        full = eager_float_mask(causal_mask(b, t, x.device), x.dtype)
        sliding = eager_float_mask(causal_mask(b, t, x.device, self.sliding_window), x.dtype)
        cos, sin = self.rotary_emb(x, t)
        for layer in self.layers:
            x = layer(x, cos, sin, sliding if layer.sliding else full)
        hidden: Tensor = self.norm(x)
        return hidden


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.config = cfg
        self.final_logit_softcapping = cfg.final_logit_softcapping
        self.model = Gemma2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as in HF

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``(B, T, vocab)``, soft-capped."""
        logits: Tensor = self.lm_head(self.model(input_ids))
        if self.final_logit_softcapping is not None:
            logits = logits / self.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.final_logit_softcapping
        return logits


def parameter_count(cfg: Gemma2Config) -> int:
    """Closed form: tied embeddings + per-layer attention/MLP/four norms + final norm."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * cfg.intermediate_size + 4 * d
    return cfg.vocab_size * d + cfg.num_layers * per_layer + d


def _build(cfg: Gemma2Config, shape: tuple[int, ...]) -> Gemma2ForCausalLM:
    return Gemma2ForCausalLM(cfg)  # rotary positions: the sequence length does not change the model


_CONFIGS = {
    "gemma-2-2b": (Gemma2Config(2304, 26, 8, 4, 9216), 2_614_341_888, "google/gemma-2-2b"),
    "gemma-2-9b": (Gemma2Config(3584, 42, 16, 8, 14336), 9_241_705_984, "google/gemma-2-9b"),
}


def _hf_config(repo: str, cfg: Gemma2Config) -> HfConfig:
    """The checkpoint's config.json: the Gemma 2 releases share every value but the sizes."""
    return HfConfig(repo, {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": cfg.hidden_size, "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size, "max_position_embeddings": 8192,
        "num_attention_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "use_cache": True, "vocab_size": 256000})


for _name, (_cfg, _count, _source) in _CONFIGS.items():
    register(
        ZooEntry(
            name=_name,
            family="gemma2",
            builder=partial(_build, _cfg),
            input_kind=InputKind.TOKENS,
            default_shape=(_cfg.max_position_embeddings,),
            loss=LossKind.LM_CROSS_ENTROPY,
            reference_parameters=_count,
            vocab_size=_cfg.vocab_size,
            description=f"HF Gemma2ForCausalLM ({_source}), eager attention: {_cfg.num_layers} layers, "
                        f"d {_cfg.hidden_size}, {_cfg.num_heads} heads, {_cfg.num_kv_heads} KV heads of "
                        f"{_cfg.head_dim}, GeGLU {_cfg.intermediate_size}, sliding window {_cfg.sliding_window} "
                        f"on alternate layers, softcaps {_cfg.attn_logit_softcapping}/{_cfg.final_logit_softcapping}, "
                        f"tied lm_head",
            block_containers=("model.layers",),
            context_length=_cfg.max_position_embeddings,
            decoder=True,
            hf=_hf_config(_source, _cfg),
        )
    )

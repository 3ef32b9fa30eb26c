"""ViT-B/16 and ViT-L/16, layer for layer as torchvision's ``VisionTransformer``.

Same names (``conv_proj``, ``class_token``, ``encoder.pos_embedding``,
``encoder.layers.encoder_layer_3.self_attention``, ``heads.head``) and counts. Two deliberate
differences from torchvision:

* attention is :class:`SelfAttention`, a fused-QKV module with ``nn.MultiheadAttention``'s
  parameters (``in_proj_weight``, ``in_proj_bias``, ``out_proj``) that calls
  ``F.scaled_dot_product_attention`` directly, so memory is traced through SDPA instead of
  MultiheadAttention's fast-path dispatch;
* the position table is sized from the actual input, ``(H/16)*(W/16) + 1`` tokens, so
  ``--input-shape 3,384,384`` builds a 577-token model instead of failing.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register

_PATCH = 16


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``nn.MultiheadAttention``'s parameter layout, via SDPA."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.in_proj_bias)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        projected: Tensor = self.out_proj(out.transpose(1, 2).reshape(b, t, d))
        return projected


class MLPBlock(nn.Sequential):
    """Linear → GELU → Dropout → Linear → Dropout (indices 0-4, as torchvision's ``MLPBlock``)."""

    def __init__(self, dim: int, mlp_dim: int, dropout: float):
        super().__init__(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim),
                         nn.Dropout(dropout))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float, attention_dropout: float):
        super().__init__()
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.ln_1 = norm(hidden_dim)
        self.self_attention = SelfAttention(hidden_dim, num_heads, dropout=attention_dropout)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = norm(hidden_dim)
        self.mlp = MLPBlock(hidden_dim, mlp_dim, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.self_attention(self.ln_1(x)))
        x = x + self.mlp(self.ln_2(x))
        return x


class Encoder(nn.Module):
    def __init__(self, seq_length: int, num_layers: int, num_heads: int, hidden_dim: int, mlp_dim: int,
                 dropout: float, attention_dropout: float):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(num_heads, hidden_dim, mlp_dim, dropout, attention_dropout))
            for i in range(num_layers)
        ))
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.ln(self.layers(self.dropout(x + self.pos_embedding)))
        return out


class VisionTransformer(nn.Module):
    def __init__(self, image_size: tuple[int, int], num_layers: int, num_heads: int, hidden_dim: int,
                 mlp_dim: int, in_channels: int = 3, num_classes: int = 1000, dropout: float = 0.0,
                 attention_dropout: float = 0.0):
        super().__init__()
        h, w = image_size
        if h % _PATCH or w % _PATCH:
            raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {_PATCH}")
        self.hidden_dim = hidden_dim
        self.conv_proj = nn.Conv2d(in_channels, hidden_dim, kernel_size=_PATCH, stride=_PATCH)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        seq_length = (h // _PATCH) * (w // _PATCH) + 1
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout, attention_dropout)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        x = self.encoder(x)
        logits: Tensor = self.heads(x[:, 0])
        return logits


# layers, heads, hidden, mlp, reference count (torchvision, 224x224: 197 tokens).
_CONFIGS = {
    "vit_b_16": (12, 12, 768, 3072, 86_567_656),
    "vit_l_16": (24, 16, 1024, 4096, 304_326_632),
}


def _build(layers: int, heads: int, dim: int, mlp: int, shape: tuple[int, ...]) -> VisionTransformer:
    return VisionTransformer((shape[1], shape[2]), layers, heads, dim, mlp, in_channels=shape[0])


for _name, (_layers, _heads, _dim, _mlp, _count) in _CONFIGS.items():
    register(
        ZooEntry(
            name=_name,
            family="vit",
            builder=partial(_build, _layers, _heads, _dim, _mlp),
            input_kind=InputKind.IMAGE,
            default_shape=(3, 224, 224),
            loss=LossKind.CROSS_ENTROPY,
            reference_parameters=_count,
            description=f"torchvision {_name}: {_layers} layers, {_heads} heads, d {_dim}, patch 16 "
                        "(count at 224x224; position table follows the input size)",
            block_containers=("encoder.layers",),
        )
    )

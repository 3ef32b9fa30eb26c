"""GPT-2 (small, medium, large, xl), laid out as Hugging Face ``GPT2LMHeadModel``.

Names follow HF (``transformer.wte``, ``transformer.h.5.attn.c_attn``,
``transformer.h.5.mlp.c_proj``, ``transformer.ln_f``, ``lm_head``) and counts match the
hub checkpoints. Differences from HF, none of which changes a parameter count:

* ``nn.Linear`` instead of HF's ``Conv1D`` (same parameters, transposed weight);
* causal attention is ``F.scaled_dot_product_attention(..., is_causal=True)``, with no
  registered ``(1, 1, 1024, 1024)`` mask buffer;
* the MLP activation is :class:`NewGELU`, written as HF's ``gelu_new`` is — a chain of
  elementwise ops, not the fused ``nn.GELU(approximate="tanh")``: the same function, but the
  chain keeps several ``B×T×4d`` intermediates for backward, and matching HF's memory is the
  point (measured: the fused op saves ~10.5 MiB less per layer at batch 2, 128 tokens).

``lm_head.weight`` *is* ``transformer.wte.weight`` (tied, counted once). The position table
has HF's 1024 rows; a longer requested sequence grows it to the sequence length (GPT-2
itself cannot attend past 1024 positions, but the memory of a longer run is still a fair
question to ask; the report says so, with the grown parameter count: ``context_length``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import HfConfig, InputKind, LossKind, ZooEntry, register


@dataclass(frozen=True)
class GPT2Config:
    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int = 50257
    n_positions: int = 1024
    dropout: float = 0.1  # HF's resid_pdrop = embd_pdrop = attn_pdrop
    layer_norm_epsilon: float = 1e-5


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(d, dim=2)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout.p if self.training else 0.0, is_causal=True)
        projected: Tensor = self.resid_dropout(self.c_proj(out.transpose(1, 2).reshape(b, t, d)))
        return projected


class NewGELU(nn.Module):
    """HF ``NewGELUActivation`` (``gelu_new``), op for op: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""

    def forward(self, x: Tensor) -> Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.act = NewGELU()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.c_proj(self.act(self.c_fc(x))))
        return out


class GPT2Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, input_ids: Tensor) -> Tensor:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            x = block(x)
        hidden: Tensor = self.ln_f(x)
        return hidden


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in HF

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``(B, T, vocab)``."""
        logits: Tensor = self.lm_head(self.transformer(input_ids))
        return logits


_CONFIGS = {
    "gpt2": (GPT2Config(768, 12, 12), 124_439_808),
    "gpt2-medium": (GPT2Config(1024, 24, 16), 354_823_168),
    "gpt2-large": (GPT2Config(1280, 36, 20), 774_030_080),
    "gpt2-xl": (GPT2Config(1600, 48, 25), 1_557_611_200),
}


def _hf_config(name: str, cfg: GPT2Config) -> HfConfig:
    """The checkpoint's config.json (``openai-community/NAME``; ``task_specific_params``, the
    text-generation defaults, left out): the releases share every value but the sizes. The
    position table (``n_positions``) grows with a longer sequence, as the plain-torch one does."""
    return HfConfig(f"openai-community/{name}", {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
        "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "n_ctx": 1024, "n_embd": cfg.n_embd,
        "n_head": cfg.n_head, "n_layer": cfg.n_layer, "n_positions": 1024, "resid_pdrop": 0.1,
        "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
        "summary_type": "cls_index", "summary_use_proj": True, "vocab_size": 50257}, position_table="n_positions")


def _build(cfg: GPT2Config, shape: tuple[int, ...]) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(replace(cfg, n_positions=max(cfg.n_positions, shape[0])))


for _name, (_cfg, _count) in _CONFIGS.items():
    register(
        ZooEntry(
            name=_name,
            family="gpt2",
            builder=partial(_build, _cfg),
            input_kind=InputKind.TOKENS,
            default_shape=(1024,),
            loss=LossKind.LM_CROSS_ENTROPY,
            reference_parameters=_count,
            vocab_size=_cfg.vocab_size,
            description=f"HF GPT2LMHeadModel ({_name}): {_cfg.n_layer} layers, d {_cfg.n_embd}, "
                        f"{_cfg.n_head} heads, tied lm_head",
            block_containers=("transformer.h",),
            context_length=_cfg.n_positions,
            decoder=True,
            hf=_hf_config(_name, _cfg),
        )
    )

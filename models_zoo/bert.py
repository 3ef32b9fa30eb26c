"""BERT-base and BERT-large encoders, laid out as Hugging Face ``BertModel`` (with pooler, no head).

Module names follow HF (``embeddings.word_embeddings``,
``encoder.layer.7.attention.self.query``, ``encoder.layer.7.output.LayerNorm``,
``pooler.dense``) and counts match ``BertModel.from_pretrained("bert-base-uncased")``.
Attention goes through ``F.scaled_dot_product_attention`` (HF's "sdpa" implementation);
dropout rates are HF's defaults (0.1 everywhere). The input is token ids only: token-type ids
are all zero and there is no padding mask, as when HF gets just ``input_ids``. A sequence
longer than 512 grows the position table to its length instead of failing (the reference
count holds at the default 512).

``forward`` returns ``(last_hidden_state, pooler_output)``; the zoo trains it with the MEAN
loss, which averages every floating output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import HfConfig, InputKind, LossKind, ZooEntry, register


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        # Positions and (all-zero) token types come from the input's device, not from buffers,
        # so nothing needs materializing after a meta build.
        t = input_ids.shape[1]
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0)
        token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        out: Tensor = self.dropout(self.LayerNorm(x))
        return out


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout.p if self.training else 0.0)
        return out.transpose(1, 2).reshape(b, t, d)


class BertSelfOutput(nn.Module):
    """Projection, dropout, then post-norm residual: LayerNorm(dense(h) + input)."""

    def __init__(self, cfg: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        out: Tensor = self.LayerNorm(self.dropout(self.dense(hidden)) + residual)
        return out


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.output(self.self(x), x)
        return out


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.intermediate_act_fn = nn.GELU()  # HF "gelu": the exact erf form

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.intermediate_act_fn(self.dense(x))
        return out


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)  # HF's BertOutput: same shape of module

    def forward(self, x: Tensor) -> Tensor:
        attn = self.attention(x)
        out: Tensor = self.output(self.intermediate(attn), attn)
        return out


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertPooler(nn.Module):
    """tanh(dense(first token)): the [CLS] summary HF's ``pooler_output`` returns."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        pooled: Tensor = self.activation(self.dense(x[:, 0]))
        return pooled


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)

    def forward(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        hidden: Tensor = self.encoder(self.embeddings(input_ids))
        pooled: Tensor = self.pooler(hidden)
        return hidden, pooled


_CONFIGS = {
    "bert-base": (BertConfig(768, 12, 12, 3072), 109_482_240, "bert-base-uncased"),
    "bert-large": (BertConfig(1024, 24, 16, 4096), 335_141_888, "bert-large-uncased"),
}


def _hf_config(repo: str, cfg: BertConfig, count: int) -> HfConfig:
    """The checkpoint's config.json (``google-bert/NAME``). It names ``BertForMaskedLM``, which
    transformers builds: no pooler (d² + d), and the masked-LM head's transform (d² + d), its
    LayerNorm (2d) and the decoder's bias (vocab), the decoder's weight tied to the embeddings."""
    d = cfg.hidden_size
    return HfConfig(f"google-bert/{repo}", {
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "attention_probs_dropout_prob": 0.1,
        "gradient_checkpointing": False, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": d,
        "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size, "layer_norm_eps": 1e-12,
        "max_position_embeddings": 512, "num_attention_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
        "pad_token_id": 0, "position_embedding_type": "absolute", "type_vocab_size": 2, "use_cache": True,
        "vocab_size": cfg.vocab_size}, parameters=count + 2 * d + cfg.vocab_size,
        position_table="max_position_embeddings")


def _build(cfg: BertConfig, shape: tuple[int, ...]) -> BertModel:
    # Longer sequences than 512 would index past HF's position table; grow it instead of failing
    # (the reference count holds at the default 512).
    positions = max(cfg.max_position_embeddings, shape[0])
    return BertModel(replace(cfg, max_position_embeddings=positions))


for _name, (_cfg, _count, _hf) in _CONFIGS.items():
    register(
        ZooEntry(
            name=_name,
            family="bert",
            builder=partial(_build, _cfg),
            input_kind=InputKind.TOKENS,
            default_shape=(512,),
            loss=LossKind.MEAN,
            reference_parameters=_count,
            vocab_size=_cfg.vocab_size,
            description=f"HF BertModel ({_hf}): {_cfg.num_layers} layers, d {_cfg.hidden_size}, "
                        f"{_cfg.num_heads} heads, with pooler, no head",
            aliases=(_hf,),
            block_containers=("encoder.layer",),
            context_length=_cfg.max_position_embeddings,
            hf=_hf_config(_hf, _cfg, _count),
        )
    )

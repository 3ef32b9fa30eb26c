"""Llama 2 and 3, Mistral 7B, Qwen2.5 7B and a small llama-shaped model, laid out as HF
``LlamaForCausalLM`` (``MistralForCausalLM`` and ``Qwen2ForCausalLM`` share that layout).

Names follow HF (``model.embed_tokens``, ``model.layers.9.self_attn.q_proj``,
``model.layers.9.mlp.gate_proj``, ``model.layers.9.input_layernorm``, ``model.norm``,
``lm_head``, untied) and counts match the hub checkpoints. As in HF:

* RMSNorm computes in float32 and casts back (so a bf16 run holds an fp32 copy);
* rotary embeddings are computed once per forward in ``model.rotary_emb`` and handed to
  every layer as ``(cos, sin)`` (:mod:`models_zoo.llm_blocks`);
* attention is ``F.scaled_dot_product_attention`` as HF's ``sdpa_attention_forward`` calls it
  (:func:`models_zoo.llm_blocks.sdpa_attention`). Grouped-query K/V: the Llama 3, Mistral and
  Qwen2.5 entries follow transformers 5.x (``enable_gqa=True`` when no mask is given, K/V not
  copied); the Llama 2 entries and ``llama-tiny`` keep the ``repeat_kv`` copy of transformers 4.x
  (``LlamaConfig.sdpa_enable_gqa``), as they were first written. Note that with ``enable_gqa``
  CUDA has no fused fp32 kernel up to torch 2.13 (flash is 16-bit only, mem-efficient takes no
  GQA), so an fp32 step runs the math kernel and materializes the ``(B, H, T, T)`` scores, in HF
  as here;
* Qwen2 gives q/k/v (not o_proj) a bias (``qkv_bias``);
* Mistral's sliding window (``sliding_window``): below it a causal mask hides nothing more, and
  HF passes no mask (``is_causal=True``, ``enable_gqa``); from ``seq_len >= sliding_window`` on HF
  builds one boolean ``(B, 1, T, T)`` mask per forward (an expanded ``(1, 1, T, T)``), shared by
  every layer, and — having a mask — repeats K/V for SDPA. The zoo does the same.

Layers are called as ``layer(hidden, cos, sin, mask)``; ``mask`` is None unless a sliding
window applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from .llm_blocks import GatedMLP, RotaryEmbedding, apply_rotary_pos_emb, causal_mask, sdpa_attention, sdpa_needs_mask
from .registry import HfConfig, InputKind, LossKind, ZooEntry, register

__all__ = (
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaModel",
    "LlamaRMSNorm",
    "parameter_count",
)


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
    # Qwen2: q_proj, k_proj and v_proj have a bias, o_proj has none.
    qkv_bias: bool = False
    # Mistral: each query attends to the last `sliding_window` keys (None: all earlier keys).
    sliding_window: int | None = None
    # transformers 5.x: grouped-query K/V reach SDPA uncopied (enable_gqa=True) when there is no
    # mask; False: always repeat_kv, as transformers 4.x did.
    sdpa_enable_gqa: bool = False

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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.sdpa_enable_gqa = cfg.sdpa_enable_gqa
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        # HF's hidden_shape (*input_shape, -1, head_dim): a tensor-parallel rank's local heads
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = sdpa_attention(q, k, v, self.num_heads // self.num_kv_heads, mask, enable_gqa=self.sdpa_enable_gqa)
        projected: Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return projected


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.sliding_window = cfg.sliding_window
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        b, t = input_ids.shape
        # HF makes the mask before the rotary tables (create_sliding_window_causal_mask).
        mask = causal_mask(b, t, x.device, self.sliding_window) if sdpa_needs_mask(t, self.sliding_window) else None
        cos, sin = self.rotary_emb(x, t)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
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
    qkv_bias = d + 2 * kv if cfg.qkv_bias else 0
    per_layer = 2 * d * d + 2 * d * kv + qkv_bias + 3 * d * cfg.intermediate_size + 2 * d
    return 2 * cfg.vocab_size * d + cfg.num_layers * per_layer + d


def _build(cfg: LlamaConfig, shape: tuple[int, ...]) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg)  # no position table: the sequence length does not change the model


def _register(name: str, family: str, cfg: LlamaConfig, count: int, source: str, hf: HfConfig, *,
              default_seq_len: int | None = None, extra: str = "") -> None:
    gqa = f", {cfg.num_kv_heads} KV heads" if cfg.num_kv_heads != cfg.num_heads else ""
    register(
        ZooEntry(
            name=name,
            family=family,
            builder=partial(_build, cfg),
            input_kind=InputKind.TOKENS,
            default_shape=(default_seq_len or cfg.max_position_embeddings,),
            loss=LossKind.LM_CROSS_ENTROPY,
            reference_parameters=count,
            vocab_size=cfg.vocab_size,
            description=f"{source}: {cfg.num_layers} layers, d {cfg.hidden_size}, "
                        f"{cfg.num_heads} heads{gqa}, SwiGLU {cfg.intermediate_size}{extra}",
            block_containers=("model.layers",),
            context_length=cfg.max_position_embeddings,
            decoder=True,
            hf=hf,
        )
    )


def _llama_json(repo: str, **values: object) -> HfConfig:
    """A Llama checkpoint's config.json: the fields every Llama release shares, then its own."""
    return HfConfig(repo, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "initializer_range": 0.02, "pretraining_tp": 1, "rope_scaling": None, "tie_word_embeddings": False,
        "use_cache": True, **values})


_TINY = LlamaConfig(512, 8, 8, 2, 1376, max_position_embeddings=512)

# Reference counts: the hub checkpoints, checked against transformers' own classes built from
# the same configs (tests/test_zoo_vs_references.py). The Hugging Face configs are the
# checkpoints' config.json values (token ids and dtypes included, though they change no memory).
_LLAMA_2 = {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
            "torch_dtype": "float16", "vocab_size": 32000}
_register("llama-2-7b", "llama", LlamaConfig(4096, 32, 32, 32, 11008), 6_738_415_616,
          "HF LlamaForCausalLM (meta-llama/Llama-2-7b-hf)",
          _llama_json("meta-llama/Llama-2-7b-hf", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_hidden_layers=32, num_key_value_heads=32, **_LLAMA_2))
_register("llama-2-13b", "llama", LlamaConfig(5120, 40, 40, 40, 13824), 13_015_864_320,
          "HF LlamaForCausalLM (meta-llama/Llama-2-13b-hf)",
          _llama_json("meta-llama/Llama-2-13b-hf", hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                      num_hidden_layers=40, num_key_value_heads=40, **_LLAMA_2))
_register("llama-2-70b", "llama", LlamaConfig(8192, 80, 64, 8, 28672), 68_976_648_192,
          "HF LlamaForCausalLM (meta-llama/Llama-2-70b-hf)",
          _llama_json("meta-llama/Llama-2-70b-hf", hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                      num_hidden_layers=80, num_key_value_heads=8, **_LLAMA_2))
# Not a released model: the same values as a LlamaConfig, written as a config.json would hold them.
_register("llama-tiny", "llama", _TINY, parameter_count(_TINY),
          "HF LlamaForCausalLM (memcalc's own small config, not a released model)",
          _llama_json("memcalc/llama-tiny", hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                      num_hidden_layers=8, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-05,
                      rope_theta=10000.0, vocab_size=32000))


def _llama_3(hidden: int, layers: int, heads: int, intermediate: int) -> LlamaConfig:
    """Llama 3: 8 KV heads, a 128,256-token vocabulary, rope_theta 500,000, 8,192-token context."""
    return LlamaConfig(hidden, layers, heads, 8, intermediate, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, sdpa_enable_gqa=True)


_LLAMA_3 = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
            "max_position_embeddings": 8192, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
            "torch_dtype": "bfloat16", "vocab_size": 128256}
_register("llama-3-8b", "llama", _llama_3(4096, 32, 32, 14336), 8_030_261_248,
          "HF LlamaForCausalLM (meta-llama/Meta-Llama-3-8B)",
          _llama_json("meta-llama/Meta-Llama-3-8B", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_hidden_layers=32, **_LLAMA_3))
_register("llama-3-70b", "llama", _llama_3(8192, 80, 64, 28672), 70_553_706_496,
          "HF LlamaForCausalLM (meta-llama/Meta-Llama-3-70B)",
          _llama_json("meta-llama/Meta-Llama-3-70B", hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                      num_hidden_layers=80, **_LLAMA_3))

# Llama 3.1 405B: a 131,072-token context by rope_scaling "llama3" (8,192 by default here). The
# scaling changes the rotary frequencies' values, not their shapes: the plain-torch definition
# (torch:llama-3.1-405b) keeps the default rope, memory for memory the same.
_register("llama-3.1-405b", "llama",
          LlamaConfig(16384, 126, 128, 8, 53248, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0, sdpa_enable_gqa=True),
          405_853_388_800, "HF LlamaForCausalLM (meta-llama/Llama-3.1-405B)",
          _llama_json("meta-llama/Llama-3.1-405B", hidden_size=16384, intermediate_size=53248,
                      num_attention_heads=128, num_hidden_layers=126, **{
                          **_LLAMA_3, "max_position_embeddings": 131072, "mlp_bias": False,
                          "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192, "rope_type": "llama3"}}),
          default_seq_len=8192, extra=", rope_scaling llama3")

# Mistral 7B v0.1: max_position_embeddings 32,768, but trained on 8,192 tokens (its paper's
# context_len), which is the default here.
_register("mistral-7b", "mistral",
          LlamaConfig(4096, 32, 32, 8, 14336, max_position_embeddings=32768, sliding_window=4096,
                      sdpa_enable_gqa=True),
          7_241_732_096, "HF MistralForCausalLM (mistralai/Mistral-7B-v0.1)",
          HfConfig("mistralai/Mistral-7B-v0.1", {
              "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
              "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
              "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}),
          default_seq_len=8192, extra=", sliding window 4096")

# Qwen2.5 7B: use_sliding_window is false in its config, so every layer attends to all earlier
# tokens; max_position_embeddings 131,072 (its card: beyond 32,768 with YaRN) — 8,192 by default.
_register("qwen2.5-7b", "qwen2",
          LlamaConfig(3584, 28, 28, 4, 18944, vocab_size=152064, max_position_embeddings=131072,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, sdpa_enable_gqa=True),
          7_615_616_512, "HF Qwen2ForCausalLM (Qwen/Qwen2.5-7B)",
          HfConfig("Qwen/Qwen2.5-7B", {
              "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
              "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
              "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
              "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
              "vocab_size": 152064}),
          default_seq_len=8192, extra=", q/k/v bias")

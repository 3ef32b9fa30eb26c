"""Mixture-of-experts language models: Mixtral 8x7B, Qwen3-30B-A3B, DeepSeek-V3 and gpt-oss-20b,
as their released ``config.json`` (plain data) that transformers builds its own model from.

These entries have no plain-torch definition (``builder=None``): their routers, expert kernels
(``transformers.integrations.moe``: one grouped GEMM per projection by default), multi-head
latent attention (DeepSeek-V3) and attention sinks (gpt-oss) are transformers' code, which memcalc
runs on meta rather than imitates. Without transformers the names say so and stop.

The configs are the checkpoints' config.json values, with two keys left out: ``auto_map``
(DeepSeek-V3's remote code; transformers has the class itself) and ``quantization_config`` (the
released DeepSeek-V3 weights are FP8 blocks, gpt-oss's experts MXFP4; memcalc's ``--precision``
and ``--weight-dtype`` choose the weights' dtype instead, as for every zoo model).

Parameter counts: what transformers 5.24 builds on meta from these configs (tests/test_moe.py
checks it), against the published totals: Mixtral 46.7B, Qwen3-30B-A3B 30.5B, gpt-oss-20b 20.9B,
DeepSeek-V3 671B without its multi-token-prediction layer (``num_nextn_predict_layers``: 14B
more in the checkpoint, which transformers does not build). DeepSeek-V3's checkpoint counts
671,026,419,200: 14,848 more than here, its 58 MoE layers' ``e_score_correction_bias`` (256
each), which transformers holds as a buffer, not a parameter.
"""

from __future__ import annotations

from collections.abc import Mapping

from .registry import HfConfig, InputKind, LossKind, ZooEntry, register

__all__ = ()

#: The sequence a step takes by default: far below the released contexts, a common training length.
_DEFAULT_SEQ_LEN = 4096


def _register(name: str, family: str, count: int, context: int, description: str, repo: str,
              values: Mapping[str, object]) -> None:
    hf = HfConfig(repo, values)
    vocab = values["vocab_size"]
    assert isinstance(vocab, int), repo
    register(ZooEntry(
        name=name,
        family=family,
        builder=None,
        input_kind=InputKind.TOKENS,
        default_shape=(_DEFAULT_SEQ_LEN,),
        loss=LossKind.LM_CROSS_ENTROPY,
        reference_parameters=count,
        vocab_size=vocab,
        description=f"HF {hf.architecture} ({repo}): {description}",
        block_containers=("model.layers",),
        context_length=context,
        decoder=True,
        hf=hf,
    ))


_register("mixtral-8x7b", "mixtral", 46_702_792_704, 32768,
          "32 layers, d 4096, 32 heads, 8 KV heads, 8 experts of SwiGLU 14336, top-2", "mistralai/Mixtral-8x7B-v0.1", {
              "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
              "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
              "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
              "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
              "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000})

_register("qwen3-30b-a3b", "qwen3_moe", 30_532_122_624, 40960,
          "48 layers, d 2048, 32 heads, 4 KV heads of 128, 128 experts of SwiGLU 768, top-8", "Qwen/Qwen3-30B-A3B", {
              "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
              "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
              "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
              "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
              "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
              "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
              "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
              "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936})

_register("deepseek-v3", "deepseek_v3", 671_026_404_352, 163840,
          "61 layers (3 dense), d 7168, 128 heads of multi-head latent attention, 256 routed experts of "
          "SwiGLU 2048 + 1 shared, top-8", "deepseek-ai/DeepSeek-V3", {
              "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
              "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
              "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
              "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
              "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
              "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
              "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
              "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                               "original_max_position_embeddings": 4096, "type": "yarn"},
              "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
              "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
              "use_cache": True, "v_head_dim": 128, "vocab_size": 129280})

_register("gpt-oss-20b", "gpt_oss", 20_914_757_184, 131072,
          "24 layers, d 2880, 64 heads, 8 KV heads of 64, sliding window 128 on alternate layers, 32 experts of "
          "SwiGLU 2880, top-4", "openai/gpt-oss-20b", {
              "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
              "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
              "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
              "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
              "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
              "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
              "pad_token_id": 199999, "rms_norm_eps": 1e-05,
              "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                               "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
              "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
              "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088})

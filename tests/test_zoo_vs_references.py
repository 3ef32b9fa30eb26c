"""The zoo against the libraries it reproduces, where they are installed (this project's GPU
machine has torchvision, timm and transformers; the CPU machine may have none — then these
tests skip). Parameter counts must be equal and estimates identical, except where the
reference does more work by default (said per case).

With transformers installed a zoo language model's name builds transformers' own model from the
released config the zoo holds; the zoo's plain-torch definitions compared here are ``torch:NAME``."""

from __future__ import annotations

import pytest

import memcalc

#: The models are compared under one loss, memcalc's: an ``hf:`` model whose loss is not chosen computes
#: its own (transformers' ForCausalLMLoss, test_hf_loss_differs_from_memcalcs_by_its_fp32_upcast).
_LM = "lm-cross-entropy"


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("zoo, hf", [("gpt2", "hf:gpt2"), ("llama-2-7b", "hf:llama"), ("bert-base", "hf:bert")])
def test_parameter_counts_equal_hugging_face(transformers, zoo, hf):
    from memcalc.sources.resolve import resolve

    ours = resolve(f"torch:{zoo}", batch_size=1, seq_len=8).module
    theirs = resolve(hf, batch_size=1, seq_len=8).module
    count = lambda m: sum(p.numel() for p in m.parameters())
    if zoo == "bert-base":  # hf:bert builds BertLMHeadModel; the zoo is BertModel with pooler
        theirs = theirs.bert
        assert count(ours) == count(theirs) + 768 * 768 + 768  # HF's LM-head model drops the pooler
    else:
        assert count(ours) == count(theirs)


@pytest.mark.parametrize("precision", ["fp32"])
@pytest.mark.slow  # a transformers Llama estimated beside the zoo's
def test_llama_estimate_identical_to_hugging_face(transformers, precision):
    # Same activations saved for backward; the peaks differ by HF's rotary `inv_freq` buffer
    # (64 floats, a 512-byte block; the zoo computes it in forward) — 1 KiB in 125 GiB.
    kw = dict(batch_size=1, seq_len=256, optimizer="adamw", gpu="a100-80gb", precision=precision, loss=_LM)
    ours = memcalc.estimate("torch:llama-2-7b", **kw)
    theirs = memcalc.estimate("hf:llama", **kw)
    assert ours.textbook.activation_bytes == theirs.textbook.activation_bytes
    assert abs(ours.bytes.peak_allocated - theirs.bytes.peak_allocated) <= 2048


def test_gpt2_differs_from_hugging_face_only_by_its_training_kv_cache(transformers):
    # HF's GPT-2 defaults to use_cache=True: even in training every layer copies K and V into a
    # DynamicCache (cat with an empty tensor) that lives as long as the outputs — 2 × B·T·d
    # fp32 per layer. The zoo's GPT-2 has no cache (HF with use_cache=False, whose mask code
    # reads tensor values and so cannot run on meta tensors).
    b, t, d, layers = 8, 512, 768, 12
    kw = dict(batch_size=b, seq_len=t, optimizer="adamw", gpu="a100-80gb", loss=_LM)
    ours = memcalc.estimate("torch:gpt2", **kw)
    theirs = memcalc.estimate("hf:gpt2", **kw)
    assert theirs.textbook.activation_bytes - ours.textbook.activation_bytes == layers * 2 * b * t * d * 4


@pytest.mark.slow  # a transformers Llama estimated beside the zoo's
def test_llama_under_amp_is_within_two_percent_of_hugging_face(transformers):
    # A known gap, not yet explained: under amp-bf16 HF's Llama runs ~3 more casts and one more
    # copy per layer than the zoo's (its attention/RoPE dtype handling under autocast) and keeps
    # ~1.8 % more activations at batch 1, 256 tokens. fp32 is identical (test above).
    kw = dict(batch_size=1, seq_len=256, optimizer="adamw", gpu="a100-80gb", precision="amp-bf16", loss=_LM)
    ours = memcalc.estimate("torch:llama-2-7b", **kw).textbook.activation_bytes
    theirs = memcalc.estimate("hf:llama", **kw).textbook.activation_bytes
    assert 0 < (theirs - ours) / theirs < 0.02


# ---- Llama 3, Mistral, Qwen2.5, Gemma 2 against transformers' own classes ----------------------
# The hub configs (config.json) of the checkpoints the zoo entries reproduce, as transformers'
# config classes take them (fields left out keep the class defaults, which the hub files share).
HF_CONFIGS = {
    "llama-3-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3-70b": ("LlamaConfig", dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3.1-405b": ("LlamaConfig", dict(
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"})),
    "mistral-7b": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0,
        rms_norm_eps=1e-5, sliding_window=4096, tie_word_embeddings=False)),
    "qwen2.5-7b": ("Qwen2Config", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-6, sliding_window=131072, use_sliding_window=False, max_window_layers=28,
        tie_word_embeddings=False)),
    "gemma-2-2b": ("Gemma2Config", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma-2-9b": ("Gemma2Config", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
}


def _hf_config(transformers, name, **overrides):
    class_name, fields = HF_CONFIGS[name]
    return getattr(transformers, class_name)(**fields, **overrides)


# quick: one per config class (the larger sizes of a class differ in numbers only: the full suite)
@pytest.mark.quick_cases("llama-3-8b", "mistral-7b", "qwen2.5-7b", "gemma-2-2b")
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_new_llm_parameter_counts_equal_transformers(transformers, name):
    import torch

    import models_zoo

    entry = models_zoo.get(name)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(_hf_config(transformers, name))
        ours = entry.build()
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(ours) == count(theirs) == entry.reference_parameters
    # the attention HF runs by default, which the zoo's forward reproduces
    if name.startswith("gemma"):
        _skip_unless_gemma_defaults_to_eager(theirs.config._attn_implementation)
    assert theirs.config._attn_implementation == ("eager" if name.startswith("gemma") else "sdpa")


def _skip_unless_gemma_defaults_to_eager(chosen: str) -> None:
    """The zoo's Gemma-2 reproduces the eager attention transformers 5.24 runs by default;
    transformers 5.17 (the floor CI's version matrix runs) picks sdpa for it, so the zoo's Gemma
    is not that release's: the comparisons are skipped there (an ``hf:`` Gemma config estimates
    what the installed transformers runs)."""
    if chosen != "eager":
        pytest.skip(f"this transformers runs Gemma-2 with {chosen} attention by default; the zoo's follows eager")


def test_transformers_hands_grouped_kv_heads_to_sdpa_unless_masked(transformers):
    # What the zoo's sdpa_attention assumes of transformers 5.x (integrations/sdpa_attention.py)
    import torch
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    k = torch.empty(1, 8, 16, 128, device="meta")
    assert use_gqa_in_sdpa(None, k, k)  # no mask: enable_gqa=True, K/V not repeated
    assert not use_gqa_in_sdpa(torch.ones(1, 1, 16, 16, dtype=torch.bool, device="meta"), k, k)  # repeat_kv


def test_masks_equal_transformers(transformers):
    import importlib

    import torch

    from models_zoo.llm_blocks import causal_mask, eager_float_mask

    mu = importlib.import_module("transformers.masking_utils")
    cpu = torch.device("cpu")
    sliding = mu.sdpa_mask(batch_size=2, q_length=12, kv_length=12, allow_is_causal_skip=False,
                           mask_function=mu.sliding_window_causal_mask_function(5))
    assert torch.equal(causal_mask(2, 12, cpu, sliding_window=5), sliding)
    eager = mu.eager_mask(batch_size=2, q_length=12, kv_length=12, dtype=torch.bfloat16)
    assert torch.equal(eager_float_mask(causal_mask(2, 12, cpu), torch.bfloat16), eager)


@pytest.fixture
def hf_without_cache(transformers, monkeypatch, tmp_path):
    """``hf:config.json`` specs of the zoo's LLMs with ``use_cache=False``. transformers' mask code
    then looks for packed sequences by reading ``position_ids`` values, which meta tensors do not
    have: that check is skipped (one unpadded sequence per row, as the zoo assumes)."""
    import importlib

    masking = importlib.import_module("transformers.masking_utils")
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)

    def spec(name):
        path = tmp_path / f"{name}.json"
        _hf_config(transformers, name, use_cache=False).to_json_file(str(path))
        return f"hf:{path}"

    return spec


@pytest.mark.parametrize("name, seq_len, precision", [
    ("llama-3-8b", 256, "fp32"),  # enable_gqa: CUDA's math kernel in fp32 (mem-efficient has no GQA)
    ("llama-3-8b", 256, "amp-bf16"),
    ("qwen2.5-7b", 256, "fp32"),
    ("qwen2.5-7b", 256, "bf16"),
    ("mistral-7b", 256, "fp32"),  # below the sliding window: no mask, enable_gqa
    ("mistral-7b", 4096, "amp-bf16"),  # at the window: HF's boolean mask and repeat_kv
    ("gemma-2-2b", 256, "fp32"),  # eager attention, two float masks
    ("gemma-2-2b", 256, "amp-bf16"),
    ("gemma-2-2b", 8192, "fp32"),  # past the window: the sliding mask differs from the causal one
])
@pytest.mark.slow  # a transformers model per case; gpt2_differs_from_hugging_face stays quick
def test_new_llm_estimates_identical_to_transformers_without_cache(hf_without_cache, name, seq_len, precision):
    from memcalc import Category

    kw = dict(batch_size=2, seq_len=seq_len, optimizer="adamw", gpu="a100-80gb", precision=precision, loss=_LM)
    if name.startswith("gemma"):
        import torch
        import transformers

        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(_hf_config(transformers, name))
        _skip_unless_gemma_defaults_to_eager(hf.config._attn_implementation)
    ours = memcalc.estimate(f"torch:{name}", **kw)
    theirs = memcalc.estimate(hf_without_cache(name), **kw)
    assert ours.textbook.activation_bytes == theirs.textbook.activation_bytes
    assert ours.attention_backend == theirs.attention_backend
    assert ours.peak_phase == theirs.peak_phase
    # At the peak every category is equal but buffers: HF's rotary inv_freq pair (and Gemma's 0-dim
    # embed_scale), which the zoo computes in forward instead. What remains is the allocator's
    # rounding: those buffers' own, and unsplit remainders of reused cached blocks (under 1 MiB
    # each; seen up to 2 MiB in all), because HF's buffers and its rotary and mask code make a
    # few more small blocks than the zoo's, so later blocks land elsewhere.
    for category in Category:
        if category is not Category.BUFFERS:
            assert ours.bytes.category(category) == theirs.bytes.category(category), category
    assert 0 < theirs.bytes.category(Category.BUFFERS) - ours.bytes.category(Category.BUFFERS) <= 2048
    assert abs(ours.bytes.rounding - theirs.bytes.rounding) <= 4 << 20


@pytest.mark.slow  # a transformers Llama-3 estimated beside the zoo's
def test_llama_3_differs_from_transformers_only_by_its_training_kv_cache(transformers, tmp_path):
    # HF's default use_cache=True: every layer cats K and V (after RoPE, before any repeat) into a
    # DynamicCache that lives as long as the outputs. In fp32 the attention (enable_gqa → CUDA's
    # math kernel) saves its own repeated copies, so the cache's K and V are extra:
    # 2 · B·T·kv_heads·head_dim fp32 per layer.
    b, t, layers, kv_width = 2, 256, 32, 8 * 128
    path = tmp_path / "llama-3-8b.json"
    _hf_config(transformers, "llama-3-8b").to_json_file(str(path))
    kw = dict(batch_size=b, seq_len=t, optimizer="adamw", gpu="a100-80gb", loss=_LM)
    ours = memcalc.estimate("torch:llama-3-8b", **kw)
    theirs = memcalc.estimate(f"hf:{path}", **kw)
    assert theirs.textbook.activation_bytes - ours.textbook.activation_bytes == layers * 2 * b * t * kv_width * 4

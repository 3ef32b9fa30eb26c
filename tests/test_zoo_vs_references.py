"""The zoo against the libraries it reproduces, where they are installed (this project's GPU
machine has torchvision, timm and transformers; the CPU machine may have none — then these
tests skip). Parameter counts must be equal and estimates identical, except where the
reference does more work by default (said per case)."""

from __future__ import annotations

import pytest

import memcalc


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("zoo, hf", [("gpt2", "hf:gpt2"), ("llama-2-7b", "hf:llama"), ("bert-base", "hf:bert")])
def test_parameter_counts_equal_hugging_face(transformers, zoo, hf):
    from memcalc.sources.resolve import resolve

    ours = resolve(zoo, batch_size=1, seq_len=8).module
    theirs = resolve(hf, batch_size=1, seq_len=8).module
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    if zoo == "bert-base":  # hf:bert builds BertLMHeadModel; the zoo is BertModel with pooler
        theirs = theirs.bert
        assert count(ours) == count(theirs) + 768 * 768 + 768  # HF's LM-head model drops the pooler
    else:
        assert count(ours) == count(theirs)


@pytest.mark.parametrize("precision", ["fp32"])
def test_llama_estimate_identical_to_hugging_face(transformers, precision):
    # Same activations saved for backward; the peaks differ by HF's rotary `inv_freq` buffer
    # (64 floats, a 512-byte block; the zoo computes it in forward) — 1 KiB in 125 GiB.
    kw = dict(batch_size=1, seq_len=256, optimizer="adamw", gpu="a100-80gb", precision=precision)
    ours = memcalc.estimate("llama-2-7b", **kw)
    theirs = memcalc.estimate("hf:llama", **kw)
    assert ours.textbook.activation_bytes == theirs.textbook.activation_bytes
    assert abs(ours.bytes.peak_allocated - theirs.bytes.peak_allocated) <= 2048


def test_gpt2_differs_from_hugging_face_only_by_its_training_kv_cache(transformers):
    # HF's GPT-2 defaults to use_cache=True: even in training every layer copies K and V into a
    # DynamicCache (cat with an empty tensor) that lives as long as the outputs — 2 × B·T·d
    # fp32 per layer. The zoo's GPT-2 has no cache (HF with use_cache=False, whose mask code
    # reads tensor values and so cannot run on meta tensors).
    b, t, d, layers = 8, 512, 768, 12
    kw = dict(batch_size=b, seq_len=t, optimizer="adamw", gpu="a100-80gb")
    ours = memcalc.estimate("gpt2", **kw)
    theirs = memcalc.estimate("hf:gpt2", **kw)
    assert theirs.textbook.activation_bytes - ours.textbook.activation_bytes == layers * 2 * b * t * d * 4


def test_llama_under_amp_is_within_two_percent_of_hugging_face(transformers):
    # A known gap, not yet explained: under amp-bf16 HF's Llama runs ~3 more casts and one more
    # copy per layer than the zoo's (its attention/RoPE dtype handling under autocast) and keeps
    # ~1.8 % more activations at batch 1, 256 tokens. fp32 is identical (test above).
    kw = dict(batch_size=1, seq_len=256, optimizer="adamw", gpu="a100-80gb", precision="amp-bf16")
    ours = memcalc.estimate("llama-2-7b", **kw).textbook.activation_bytes
    theirs = memcalc.estimate("hf:llama", **kw).textbook.activation_bytes
    assert 0 < (theirs - ours) / theirs < 0.02

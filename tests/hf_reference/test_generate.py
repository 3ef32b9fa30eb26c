"""``model.generate()`` run for real on the CPU (greedy, a prompt and N new tokens), against
memcalc's ``mode="generate"`` for the same call (its CPU target): transformers' own generate()
traced on meta (memcalc/stacks/transformers/generate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_harness import (
    LLAMA3_VOCAB,
    MISTRAL_VOCAB,
    TOLERANCE,
    describe,
    generate_peak,
    llama_config,
    model_bytes,
    profiled_peak,
    relative_error,
    write_config,
)

import memcalc
from memcalc.core.categories import Phase

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _check(tmp_path: Path, name: str, config: dict[str, object], batch: int, prompt: int, new_tokens: int,
           weights: torch.dtype, precision: str) -> memcalc.MemoryReport:
    real = generate_peak(config, batch, prompt, new_tokens, weights)
    report = memcalc.estimate(write_config(tmp_path, config), batch_size=batch, seq_len=prompt, mode="generate",
                              new_tokens=new_tokens, precision=precision, gpu="cpu")
    row = describe(name, real, report.peak_requested) + f" (memcalc's peak: {report.peak_location})"
    print(row)
    assert abs(relative_error(report.peak_requested, real)) <= TOLERANCE, row
    return report


def test_generate_prompt_and_new_tokens(tmp_path: Path) -> None:
    # before mode generate (mode inference with a static KV cache of 16 tokens): +182.4%, its prefill
    # forward computing all 2 × 256 × 128256 logits where generate() keeps the last position's (logits_to_keep=1)
    report = _check(tmp_path, "generate, prompt 256 + 16 new", llama_config(LLAMA3_VOCAB), 2, 256, 16,
                    torch.float32, "fp32")
    # the 128k-vocabulary logits of the last step, copied to float32 for the token choice, over the largest cache
    assert report.peak_phase is Phase.DECODE and report.peak_step == 15


def test_generate_long_prompt_peaks_in_the_prefill(tmp_path: Path) -> None:
    report = _check(tmp_path, "generate bf16, prompt 960 + 32 new", llama_config(MISTRAL_VOCAB, hidden=256), 2, 960,
                    32, torch.bfloat16, "bf16")
    assert report.peak_phase is Phase.PREFILL and report.peak_step == 0


def test_inference_with_a_static_kv_cache(tmp_path: Path) -> None:
    # --kv-cache N on a transformers model: its own StaticCache of prompt + N tokens, filled by the
    # prefill forward, as a user runs it. Before: memcalc's static cache beside the model's own
    # DynamicCache of the prompt (measured +2.74% here, 108.27 MB against 105.39 MB: the prompt's keys and
    # values twice; now +0.00%).
    import inspect

    import transformers

    config = llama_config(MISTRAL_VOCAB, hidden=256)
    batch, prompt, new = 2, 128, 384
    model = transformers.LlamaForCausalLM._from_config(transformers.AutoConfig.for_model(**config)).eval()
    ids = torch.randint(1, MISTRAL_VOCAB, (batch, prompt))
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run() -> None:
        cache = transformers.StaticCache(config=model.config, max_cache_len=prompt + new)
        with torch.inference_mode():
            model(ids, use_cache=True, **{keyword: cache})

    real = profiled_peak(model_bytes(model, ids), run)
    report = memcalc.estimate(write_config(tmp_path, config), batch_size=batch, seq_len=prompt, mode="inference",
                              kv_cache=new, gpu="cpu")
    row = describe("inference, static KV cache 128 + 384", real, report.bytes.peak_allocated)
    print(row)
    assert abs(relative_error(report.bytes.peak_allocated, real)) <= TOLERANCE, row

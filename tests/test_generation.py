"""mode generate: a Hugging Face causal LM's own ``generate()`` traced on meta tensors
(memcalc.engine.generation, memcalc.stacks.transformers.generate).

Bytes are worked out here from the cache's shapes; the comparison with the real generate() on the
CPU is tests/hf_reference/test_generate.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import SMALL_LLAMA, hf_config_source

import memcalc
from memcalc.core.categories import Mode, Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.report.render import render_report

pytest.importorskip("transformers")

# SMALL_LLAMA: 2 layers, 2 key-value heads of 64 / 4 = 16 dimensions, a 1000-token vocabulary
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def _generate(tmp_path: Path, batch: int, prompt: int, new_tokens: int, **kwargs: object) -> memcalc.MemoryReport:
    return memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=batch, seq_len=prompt,
                            mode="generate", new_tokens=new_tokens, gpu="cpu", **kwargs)


def test_a_long_prompt_peaks_in_the_prefill_with_the_prompts_cache(tmp_path: Path):
    report = _generate(tmp_path, 2, 128, 4)
    assert report.mode is Mode.GENERATE and report.new_tokens == 4
    assert report.peak_phase is Phase.PREFILL and report.peak_step == 0
    assert report.peak_location == "prefill, model.layers.1.mlp"
    # the DynamicCache after the prompt: keys and values of every layer, B × heads × T × head_dim float32
    assert report.bytes.kv_cache == LAYERS * 2 * 2 * KV_HEADS * 128 * HEAD_DIM * 4
    assert report.bytes.gradients == report.bytes.optimizer_state == 0


def test_a_short_prompt_peaks_in_a_decode_step_over_the_grown_cache(tmp_path: Path):
    report = _generate(tmp_path, 1, 16, 64)
    assert report.peak_phase is Phase.DECODE and 1 <= report.peak_step <= 63  # type: ignore[operator]
    assert report.peak_location.startswith(f"decode step {report.peak_step} of 63, ")
    # the cache has grown past the prompt: one token per decode step (a cat per layer, keys and values)
    per_token = LAYERS * 2 * 1 * KV_HEADS * HEAD_DIM * 4
    assert report.bytes.kv_cache > (16 + report.peak_step - 1) * per_token  # type: ignore[operator]


def test_the_prefill_keeps_the_last_positions_logits_only(tmp_path: Path):
    # generate() passes logits_to_keep=1: the LM head's output is B × 1 × vocab float32 in the
    # prefill as in each decode step; one forward over the prompt (mode inference) makes B × T × vocab
    def lm_head_bytes(report: memcalc.MemoryReport) -> int:
        return next(row.activation_bytes for row in report.modules if row.name == "lm_head")

    assert lm_head_bytes(_generate(tmp_path, 2, 128, 4)) == 2 * 1 * 1000 * 4
    forward = memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=2, seq_len=128,
                               mode="inference", gpu="cpu")
    assert lm_head_bytes(forward) == 2 * 128 * 1000 * 4


def test_json_adds_the_tokens_and_the_peak_step(tmp_path: Path):
    data = _generate(tmp_path, 2, 128, 4).to_dict()
    assert data["mode"] == "generate" and data["peak_phase"] == "prefill"
    assert (data["new_tokens"], data["peak_step"]) == (4, 0)
    assert "new_tokens" not in memcalc.estimate("mlp", batch_size=2).to_dict()


def test_the_header_names_the_call(tmp_path: Path):
    text = render_report(_generate(tmp_path, 2, 128, 4))
    assert "generate() of 4 new tokens (prefill + 3 decode steps)" in text


# ---- refusals ------------------------------------------------------------------------------
def test_a_model_without_generate_is_refused_with_the_static_cache_as_the_way_out():
    with pytest.raises(InapplicableOptionError, match="torch:llama-tiny is not one") as caught:
        memcalc.estimate("torch:llama-tiny", batch_size=1, seq_len=16, mode="generate", new_tokens=4)
    assert "--mode inference --kv-cache" in (caught.value.hint or "")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mode="generate"), InvalidInputError, "needs the number of tokens to generate"),
    (dict(mode="inference", new_tokens=4), InapplicableOptionError, "needs mode generate"),
    (dict(mode="generate", new_tokens=0), InvalidInputError, "at least 1; got 0"),
    (dict(mode="generate", new_tokens=4, kv_cache=4), InapplicableOptionError, "generate\\(\\) keeps itself"),
])
def test_inconsistent_generation_options_are_refused(tmp_path: Path, kwargs: dict[str, object],
                                                     error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=8, **kwargs)


def test_a_generation_under_a_strategy_is_refused(tmp_path: Path):
    with pytest.raises(InapplicableOptionError, match="mode generate is estimated on one GPU"):
        memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=8, mode="generate",
                         new_tokens=2, distributed=memcalc.Distributed("ddp", world_size=2))


def test_timing_a_generation_is_refused(tmp_path: Path):
    source = hf_config_source(tmp_path, SMALL_LLAMA)
    with pytest.raises(InvalidInputError, match="time of a generation"):
        memcalc.estimate(source, batch_size=1, seq_len=8, mode="generate", new_tokens=2, gpu="h100-80gb", time=True)
    report = memcalc.estimate(source, batch_size=1, seq_len=8, mode="generate", new_tokens=2, gpu="h100-80gb")
    with pytest.raises(InvalidInputError, match="time of a generation"):
        memcalc.step_time(report)


def test_measuring_a_generation_is_refused(tmp_path: Path):
    from memcalc.fields import build_step
    from memcalc.measure.step import measure

    step = build_step(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=8, mode="generate",
                      new_tokens=2)
    with pytest.raises(InapplicableOptionError, match="measuring mode generate"):
        measure(step, device="cpu")


_FAKE_TRANSFORMERS = """
def find_packed_sequence_indices(t, ask):
    return ask(t)

def _ignore_causal_mask_sdpa(t, ask):
    return ask(t)

def a_new_check(t, ask):
    return ask(t)

class StopCheck:
    def __call__(self, t, ask):
        return ask(t)
"""


def test_reads_are_answered_from_the_table_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from memcalc.stacks.transformers.reads import hf_reads

    # functions of those names in a file under a "transformers" folder, reading a meta tensor
    folder = tmp_path / "transformers"
    folder.mkdir()
    (folder / "fake_reads.py").write_text(_FAKE_TRANSFORMERS)
    monkeypatch.syspath_prepend(str(folder))
    import fake_reads  # type: ignore[import-not-found]

    t = torch.ones((), device="meta")
    try:
        step, generation = hf_reads(Mode.TRAIN, None), hf_reads(Mode.GENERATE, 3)
        assert fake_reads.find_packed_sequence_indices(t, step) is True  # no packed sequences, in every step
        assert fake_reads._ignore_causal_mask_sdpa(t, step) is None  # padding: a training step does not guess
        assert fake_reads._ignore_causal_mask_sdpa(t, generation) is True  # a prompt without padding
        assert fake_reads.a_new_check(t, generation) is None  # not in the table: not guessed
        assert step(t) is None  # outside transformers' code
        stop = fake_reads.StopCheck()
        assert [stop(t, generation) for _ in range(3)] == [False, False, True]  # stop at the 3rd new token
    finally:
        sys.modules.pop("fake_reads", None)


# ---- the command line ------------------------------------------------------------------------
def test_cli_estimates_a_generation(tmp_path: Path):
    import json

    from click.testing import CliRunner

    from memcalc.cli import main

    args = [hf_config_source(tmp_path, SMALL_LLAMA), "--batch", "2", "--seq-len", "128", "--mode", "generate",
            "--optim", "none"]
    result = CliRunner().invoke(main, [*args, "--new-tokens", "4", "--gpu", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data == _generate(tmp_path, 2, 128, 4, optimizer="none").to_dict()
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 2 and "--new-tokens" in refused.output


def test_timing_a_generation_is_refused_before_any_estimate(tmp_path: Path):
    # estimate(time=True) and iter_sweep(time=True) refuse in one place (api._check_timeable),
    # when called: a sweep yields lazily, so it is refused before its first point is estimated
    source = hf_config_source(tmp_path, SMALL_LLAMA)
    with pytest.raises(InvalidInputError, match="the time of a generation"):
        memcalc.estimate(source, batch_size=1, seq_len=8, mode="generate", new_tokens=2, gpu="h100-80gb", time=True)
    with pytest.raises(InvalidInputError, match="the time of a generation"):
        memcalc.iter_sweep(source, batch_sizes=[1], optimizers=["none"], gpu="h100-80gb", mode="generate",
                           new_tokens=2, seq_len=8, time=True)



# ---- --kv-cache on a transformers model: one cache, the model's own (issue 32, item 6) ----------------
def _inference(tmp_path: Path, kv_cache: int | None) -> memcalc.MemoryReport:
    return memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=2, seq_len=32, mode="inference",
                            kv_cache=kv_cache, gpu="cpu")


def test_kv_cache_is_the_models_own_static_cache_counted_once(tmp_path: Path):
    plain, empty, grown = (_inference(tmp_path, n) for n in (None, 0, 64))
    # the StaticCache of 32 prompt + 64 generated tokens, float32:
    # 2 layers · 2 KV heads · 16 head_dim · 2 (K, V) · 96 tokens · batch 2 · 4 B = 98,304 B
    assert grown.bytes.kv_cache == LAYERS * KV_HEADS * HEAD_DIM * 2 * 96 * 2 * 4 == 98_304
    assert any("the model's own StaticCache (max_cache_len 96)" in note for note in grown.notes)
    # the plain forward keeps its DynamicCache of the prompt (use_cache=True); a static cache of the
    # prompt alone replaces it, so the peak does not grow by the prompt's keys and values again
    # (before: + 2 · 2 · 16 · 2 · 32 · 2 · 4 = 32,768 B). What it adds is StaticLayer's
    # cumulative_length, one int64 per layer (2 · 8 = 16 B), moved to the keys' device at the first
    # update (a real copy on CUDA; a real CPU run made it before the step, so 16 B over there).
    assert empty.bytes.kv_cache == LAYERS * KV_HEADS * HEAD_DIM * 2 * 32 * 2 * 4 == 32_768
    assert empty.bytes.peak_allocated - plain.bytes.peak_allocated == LAYERS * 8
    # and each generated token adds its keys and values once: 64 tokens · 2 · 2 · 16 · 2 · 2 · 4 B
    assert grown.bytes.peak_allocated - empty.bytes.peak_allocated == 64 * LAYERS * KV_HEADS * HEAD_DIM * 2 * 2 * 4


def test_kv_cache_measured_on_the_cpu_is_the_estimate(tmp_path: Path):
    # --measure runs the same forward with the model's own StaticCache (before: a buffer of the
    # cache's size beside the model's DynamicCache, the estimate's double count measured back)
    from memcalc.fields import build_step
    from memcalc.measure.step import attach_measurement

    source = hf_config_source(tmp_path, SMALL_LLAMA)
    options = dict(batch_size=2, seq_len=32, mode="inference", kv_cache=64, gpu="cpu")
    report = memcalc.estimate(source, **options)
    measured = attach_measurement(report, build_step(source, **options)).measurement
    assert measured is not None and measured.peak_allocated is not None
    assert 0 <= report.bytes.peak_allocated - measured.peak_allocated <= LAYERS * 8  # the cumulative_length above

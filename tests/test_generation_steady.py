"""A generation's steady decode steps extrapolated (memcalc.engine.steady): the report of N tokens
from a trace of the prefill and a few decode steps is the report of the full trace, byte for byte —
its text, its JSON and its timeline. Where the pattern is not confirmed (or the model's source rules
it out), every step is traced and the report says so."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import SMALL_LLAMA, hf_config_source

import memcalc
import memcalc.estimation as estimation
from memcalc.core.categories import Phase
from memcalc.engine import allocator, run, steady, steady_replay
from memcalc.engine.timeline import Program
from memcalc.engine.trace import StepTrace
from memcalc.report.render import render_report

pytest.importorskip("transformers")

SMALL_GPT2: dict[str, object] = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
    "vocab_size": 1000, "n_positions": 256}
TOKEN_BY_TOKEN = "generation traced token by token"


def _both(source: str, monkeypatch: pytest.MonkeyPatch, **kwargs: object
          ) -> tuple[memcalc.MemoryReport, memcalc.MemoryReport]:
    """The estimate with the steady steps extrapolated, and with every step traced."""
    options = dict(mode="generate", optimizer="none", **kwargs)
    extrapolated = memcalc.estimate(source, **options)  # type: ignore[arg-type]
    with monkeypatch.context() as patch:
        patch.setattr(steady, "EXTRAPOLATE_FROM", 10**9)
        full = memcalc.estimate(source, **options)  # type: ignore[arg-type]
    return extrapolated, full


def _assert_identical(extrapolated: memcalc.MemoryReport, full: memcalc.MemoryReport) -> None:
    assert json.dumps(extrapolated.to_dict()) == json.dumps(full.to_dict())
    assert render_report(extrapolated) == render_report(full)
    one, other = extrapolated.timeline(), full.timeline()
    for name, value in vars(one).items():
        theirs = getattr(other, name)
        assert (value == theirs).all() if isinstance(value, np.ndarray) else value == theirs, name
    assert not any(TOKEN_BY_TOKEN in note for note in extrapolated.notes)


@pytest.mark.parametrize("config, batch, prompt, tokens", [
    pytest.param(SMALL_LLAMA, 1, 8, 18, id="llama-quick"),
    pytest.param(SMALL_LLAMA, 1, 16, 40, id="llama-decode-peak", marks=pytest.mark.slow),
    pytest.param(SMALL_LLAMA, 2, 128, 20, id="llama-prefill-peak", marks=pytest.mark.slow),
    pytest.param(SMALL_GPT2, 3, 10, 33, id="gpt2", marks=pytest.mark.slow),
])
def test_extrapolated_generation_is_the_full_trace_byte_for_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   config: dict[str, object], batch: int,
                                                                   prompt: int, tokens: int):
    extrapolated, full = _both(hf_config_source(tmp_path, config), monkeypatch, batch_size=batch, seq_len=prompt,
                               new_tokens=tokens)
    _assert_identical(extrapolated, full)
    assert extrapolated.new_tokens == tokens


@pytest.mark.slow
def test_extrapolated_generation_in_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # bf16: the cache grows by 2 heads · 16 · 2 B = 64 B per layer, tensor and token, an eighth of the
    # allocator's 512-B rounding, so the rounded sizes step every eighth token, not every token
    extrapolated, full = _both(hf_config_source(tmp_path), monkeypatch, batch_size=1, seq_len=9, new_tokens=70,
                               precision="bf16")
    _assert_identical(extrapolated, full)


@pytest.mark.slow
@pytest.mark.parametrize("prompt, tokens, boundary", [
    # the cache's keys (or values) per layer: batch 64 · 2 heads · 16 · 4 B = 8 KiB per token, so
    # 128 tokens make 1 MiB (the small pool's largest request: above it the large pool's 20-MiB
    # segments) and 1,280 make 10 MiB (above it a segment of its own, rounded to 2 MiB)
    pytest.param(100, 60, 128, id="small-to-large-pool"),
    pytest.param(1250, 60, 1280, id="20-MiB-segment-to-own-segment"),
])
def test_extrapolated_generation_across_an_allocator_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               prompt: int, tokens: int, boundary: int):
    # the boundary is crossed in the steps written out, not in the ones traced
    assert prompt + max(steady.TRACED_TOKENS) < boundary < prompt + tokens
    config = {**SMALL_LLAMA, "max_position_embeddings": 2048}
    extrapolated, full = _both(hf_config_source(tmp_path, config), monkeypatch, batch_size=64, seq_len=prompt,
                               new_tokens=tokens)
    _assert_identical(extrapolated, full)
    assert extrapolated.peak_reserved == full.peak_reserved  # exactly: the replay of the same events


@pytest.mark.slow
def test_extrapolated_generation_over_a_static_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # the config names transformers' StaticCache (GenerationConfig.from_model_config takes it): allocated
    # once, for prompt + tokens - 1 positions (the last token is never fed back), full from the prefill on
    options: dict[str, object] = dict(batch_size=1, seq_len=8, new_tokens=30)
    static = hf_config_source(tmp_path, {**SMALL_LLAMA, "cache_implementation": "static"})
    extrapolated, full = _both(static, monkeypatch, **options)
    _assert_identical(extrapolated, full)
    # 2 layers · (keys + values) · 2 heads · 37 positions · 16 · 4 B = 18,944 B, at a prefill peak
    assert extrapolated.bytes.kv_cache == 2 * 2 * 2 * (8 + 30 - 1) * 16 * 4 == 18_944
    assert extrapolated.peak_phase is Phase.PREFILL
    (tmp_path / "dynamic").mkdir()
    dynamic = memcalc.estimate(hf_config_source(tmp_path / "dynamic", SMALL_LLAMA), mode="generate",
                               optimizer="none", **options)  # type: ignore[arg-type]
    assert dynamic.peak_phase is Phase.DECODE  # over a DynamicCache: the last step's cat peaks


@pytest.mark.slow
def test_a_sliding_window_is_traced_token_by_token_and_says_so(tmp_path: Path):
    # the cache stops growing at the window: a few traced steps cannot show where
    config = {**SMALL_LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 24}
    report = memcalc.estimate(hf_config_source(tmp_path, config), batch_size=1, seq_len=8, mode="generate",
                              new_tokens=20, optimizer="none")
    assert any(note == f"{TOKEN_BY_TOKEN}: its decode steps are not extrapolated, as its config sets sliding_window "
                       f"(24), which the prompt and the new tokens reach" for note in report.notes)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mistral", "layer-types"])
def test_a_sliding_window_the_generation_never_fills_is_extrapolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     kind: str):
    # 8 + 40 positions, one fewer than the window: the last forward caches 47, the window would keep 48
    window = {"sliding_window": 8 + 40 + 1}
    config = ({**SMALL_LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"], **window}
              if kind == "mistral" else {**SMALL_LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                         "use_sliding_window": True, "max_window_layers": 0, **window,
                                         "layer_types": ["sliding_attention", "full_attention"]})
    extrapolated, full = _both(hf_config_source(tmp_path, config), monkeypatch, batch_size=2, seq_len=8, new_tokens=40)
    _assert_identical(extrapolated, full)


@pytest.mark.slow
def test_a_rule_sized_scratch_in_each_step_falls_back_to_the_full_trace(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    # the CPU target's flash attention scratch is sized by memcalc's rule from the cache length:
    # not extrapolated; the report is the full trace's, plus the note that says why
    extrapolated, full = _both(hf_config_source(tmp_path), monkeypatch, batch_size=2, seq_len=8, new_tokens=20,
                               gpu="cpu")
    notes = [n for n in extrapolated.notes if TOKEN_BY_TOKEN in n]
    assert len(notes) == 1 and "sized by a rule of memcalc's" in notes[0]
    assert json.dumps(extrapolated.to_dict()) == json.dumps(full.to_dict())  # the JSON holds no notes
    text = render_report(extrapolated).splitlines()
    assert [line for line in text if TOKEN_BY_TOKEN not in line] == render_report(full).splitlines()


def test_a_try_that_confirms_too_few_steps_is_traced_again_with_more(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    # three tokens' decode steps (1, 2 and the last) hold two steps before the last: too few to
    # confirm; the next try traces five tokens (steps 1-3 steady) and extrapolates, exactly
    from memcalc.core.progress import progress_to
    from memcalc.engine.generation import GENERATING

    monkeypatch.setattr(steady, "TRACED_TOKENS", (4, 5))
    told: list[tuple[str, int, int | None]] = []
    with progress_to(lambda task, done, total: told.append((task, done, total))):
        extrapolated, full = _both(hf_config_source(tmp_path), monkeypatch, batch_size=2, seq_len=8, new_tokens=24)
    _assert_identical(extrapolated, full)
    generating = [done for task, done, _ in told if task == GENERATING]
    assert generating[:10] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 24]  # (then the full trace's, token by token)
    monkeypatch.setattr(steady, "TRACED_TOKENS", (4,))  # no other try: every step traced, and why
    again = memcalc.estimate(hf_config_source(tmp_path), batch_size=2, seq_len=8, new_tokens=24, mode="generate",
                             optimizer="none")
    notes = [n for n in again.notes if TOKEN_BY_TOKEN in n]
    assert notes == [f"{TOKEN_BY_TOKEN}: its decode steps were not extrapolated (only decode steps 1 to 2 make the "
                     f"same storages, fewer than 3 before the last)"]
    assert json.dumps(again.to_dict()) == json.dumps(full.to_dict())


def test_short_generations_are_traced_in_full():
    assert steady.traced_tokens(steady.EXTRAPOLATE_FROM - 1) is None
    assert steady.traced_tokens(1_000) == steady.TRACED_TOKENS[0]
    assert steady.traced_tokens(1_000, len(steady.TRACED_TOKENS)) is None  # the tries are over: every step


def test_an_extrapolated_generation_tells_the_tokens_traced_then_all(tmp_path: Path):
    from memcalc.core.progress import progress_to
    from memcalc.engine.generation import GENERATING

    told: list[tuple[str, int, int | None]] = []
    with progress_to(lambda task, done, total: told.append((task, done, total))):
        memcalc.estimate(hf_config_source(tmp_path), batch_size=1, seq_len=8, mode="generate", new_tokens=50,
                         optimizer="none")
    # 0 before the prefill, 1 .. 4 as the traced decode forwards begin, 50 once the rest is written out
    traced = steady.TRACED_TOKENS[0]
    generating = [t for t in told if t[0] == GENERATING]  # (the replay tells its own task after it)
    assert generating == [(GENERATING, done, 50) for done in range(traced)] + [(GENERATING, 50, 50)]
    assert told[:len(generating)] == generating


def _synthetic(tokens: int, odd_first_step: bool) -> tuple[StepTrace, list[steady.RunCounts], steady.RunCounts]:
    """The trace of a generation of ``tokens`` tokens, written out step by step: the cache's cat
    one token longer each decode step (freeing the step before's), an activation, and one born
    after the stop check; the last step frees its cache as generate() returns. With
    ``odd_first_step``, decode step 1 makes the same storages as the others, its activation 512 B
    larger (off the line the others draw)."""
    trace = StepTrace()
    counts: list[steady.RunCounts] = []

    def born(nbytes: int, op: str, phase: Phase) -> int:
        for column, value in ((trace.nbytes, nbytes), (trace.op, op), (trace.phase, phase),
                              (trace.module, "model.layers.0"), (trace.category, None)):
            column.append(value)  # type: ignore[attr-defined]
        trace.events.append(len(trace.nbytes) - 1)
        trace.op_counts[op] += 1
        return len(trace.nbytes) - 1

    trace.phase_log.append((Phase.PREFILL, 0))
    cache = born(8192, "aten.cat.default", Phase.PREFILL)
    trace.events.append(~born(4096, "aten.mm.default", Phase.PREFILL))
    for step in range(1, tokens):
        counts.append(steady.RunCounts(Counter(trace.op_counts), {}, (), {}, ()))
        trace.phase_log.append((Phase.DECODE, len(trace.events)))
        new = born(8192 + 512 * step, "aten.cat.default", Phase.DECODE)
        trace.events.append(~cache)
        cache = new
        activation = born(4096 + (512 if odd_first_step and step == 1 else 0), "aten.mm.default", Phase.DECODE)
        trace.events.append(~activation)
        if step < tokens - 1:
            trace.events.append(~born(1024, "aten.add.Tensor", Phase.DECODE))  # after the stop check
        else:
            trace.events.append(~cache)  # generate() returns
    return trace, counts, steady.RunCounts(Counter(trace.op_counts), {}, (), {}, ())


@pytest.mark.parametrize("odd_first_step", [False, True])
def test_the_steady_steps_start_where_the_decode_steps_are_alike(odd_first_step: bool):
    full, _, end = _synthetic(40, odd_first_step)
    short, counts, short_end = _synthetic(steady.TRACED_TOKENS[0], odd_first_step)
    extension = steady.extend(short, counts, short_end, 40)
    if odd_first_step:  # steps 2 and 3 alone are too few: the next try's six decode steps confirm 2-5
        assert extension == "a storage's size does not grow by the same bytes at each decode step"
        short, counts, short_end = _synthetic(steady.TRACED_TOKENS[1], odd_first_step)
        extension = steady.extend(short, counts, short_end, 40)
    assert isinstance(extension, steady.Extension)
    assert extension.op_counts == end.op_counts
    _assert_unwritten_reads_as(short, full)
    for column in ("events", "nbytes", "op", "phase", "module", "category", "phase_log"):
        assert getattr(short, column) == getattr(full, column), column
    assert short.unwritten is None  # the first read of a list wrote the steps out


def _assert_unwritten_reads_as(short: StepTrace, full: StepTrace) -> None:
    """The extrapolated steps held unwritten (trace.UnwrittenSteps) read, through the accessors that
    leave them so, as the trace written step by step: every storage's columns, ranges within a step,
    across steps and across the prefix, the last step, the events and bytes as arrays."""
    assert short.unwritten is not None and short.steady is not None and short.unwritten.run is short.steady
    n, uids = short.steady.storages, full.num_storages
    assert (short.num_storages, short.num_events) == (uids, len(full.events))
    assert short.events_array().tolist() == full.events and short.nbytes_array().tolist() == full.nbytes
    for column in ("nbytes", "phase", "module", "category", "op"):
        expected = getattr(full, column)
        assert [short.column_at(column, uid) for uid in range(uids)] == expected, column
    base = short.steady.base
    ranges = ((0, uids), (base, base + n), (base + 1, base + 2), (base - 1, base + 2 * n + 1), (uids - n - 1, uids))
    for column in ("nbytes", "phase", "module", "category", "op"):
        expected = getattr(full, column)
        for lo, hi in ranges:
            assert short.column_range(column, lo, hi) == expected[lo:hi], (column, lo, hi)
        if column != "nbytes":
            assert [value for piece, times in short.parts(column) for _ in range(times) for value in piece] == expected
    assert short.unwritten is not None  # none of those wrote them out


#: wide enough that each layer's cache is a large-pool block from the prompt on (1,024 · 4 B = 4 KiB of
#: keys per layer and token), so that the skipping replay skips decode steps (the small pool holds one
#: token's activations); six layers, so that it skips layers within the steps it feeds too
WIDE_LLAMA: dict[str, object] = {**SMALL_LLAMA, "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
                                 "intermediate_size": 256, "max_position_embeddings": 4096, "num_hidden_layers": 6}


def _allocator_stats(source: str, monkeypatch: pytest.MonkeyPatch, *, short: bool, **options: object
                     ) -> tuple[allocator.AllocatorStats, bool, bool]:
    """The allocator's stats of the estimate's replay; whether its trace had written steady decode
    steps (``StepTrace.steady``), and whether the skipping replay answered. ``short``: as an estimate
    runs (a few decode steps traced, the small pool's repeated steps skipped); else every decode step
    traced and every event replayed."""
    seen: list[tuple[allocator.AllocatorStats, bool, bool]] = []
    replayed, skipping, report = run._replayed, run.replay_generation, estimation.build_report
    answered = [False]

    def spy(program: Program, trace: StepTrace, *args: Any, **given: Any
            ) -> tuple[allocator.AllocatorStats, allocator.AllocatorStats]:
        answered[0] = False
        unwritten = trace.unwritten is not None
        first, whole = replayed(program, trace, *args, **given)
        seen.append((whole, trace.steady is not None, answered[0]))
        assert unwritten == short  # the short path's replay reads the extrapolated steps held unwritten
        return first, whole

    def reported(resolved: Any, traced: run.TracedStep, *args: Any, **given: Any) -> memcalc.MemoryReport:
        made = report(resolved, traced, *args, **given)
        # nothing the report shows wrote the extrapolated steps out (its timeline, asked for, does)
        assert (traced.trace.unwritten is not None) == short
        return made

    def told(*args: Any, **given: Any) -> allocator.AllocatorStats | None:
        stats = skipping(*args, **given)
        answered[0] = stats is not None
        return stats

    with monkeypatch.context() as patch:
        patch.setattr(run, "_replayed", spy)
        patch.setattr(run, "replay_generation", told)
        patch.setattr(estimation, "build_report", reported)
        if not short:
            patch.setattr(steady, "EXTRAPOLATE_FROM", 10**9)
            patch.setattr(steady_replay, "SKIP_FROM", 10**9)
        memcalc.estimate(source, mode="generate", optimizer="none", **options)  # type: ignore[arg-type]
    return seen[-1]


@pytest.mark.parametrize("config, batch, prompt, tokens", [
    pytest.param(WIDE_LLAMA, 1, 300, 70, id="llama"),
    # batch 64: the cache crosses from the small pool into the large pool's 20-MiB segments at 128 tokens
    pytest.param({**SMALL_LLAMA, "max_position_embeddings": 2048}, 64, 100, 60, id="small-to-large-pool",
                 marks=pytest.mark.slow),
    pytest.param({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 1024, "n_layer": 4,
                  "n_head": 8, "vocab_size": 1000, "n_positions": 4096}, 2, 200, 60, id="gpt2-batch-2",
                 marks=pytest.mark.slow),
])
def test_the_short_path_has_the_full_paths_allocator_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            config: dict[str, object], batch: int, prompt: int,
                                                            tokens: int):
    """A few decode steps traced and the rest written (engine.steady), replayed with the small pool's
    repeated steps skipped (engine.steady_replay), against every decode step traced and every event
    replayed: the same peak allocated (and its event), peak requested, peak and final reserved, and
    the same segments (cudaMallocs), which no report shows."""
    source = hf_config_source(tmp_path, config)
    options: dict[str, object] = dict(batch_size=batch, seq_len=prompt, new_tokens=tokens)
    short, written, skipped = _allocator_stats(source, monkeypatch, short=True, **options)
    full, written_full, skipped_full = _allocator_stats(source, monkeypatch, short=False, **options)
    assert written and skipped  # the short path took both short cuts
    assert not written_full and not skipped_full
    assert short == full
    assert short.num_segments == short.num_mallocs > 1 and short.peak_reserved >= short.peak_allocated > 0


def test_a_replay_under_a_capacity_reads_the_held_steps_written_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A capacity the unlimited replay exceeds is replayed again under it, its small pool's repeated
    steps skipped as without a limit (engine.steady_replay); a step that does not fit is replayed
    once more with expandable segments, every event listed: the steps the extrapolation held
    unwritten are written out for it (trace.UnwrittenSteps). Either way the report is the full trace's."""
    source = hf_config_source(tmp_path, WIDE_LLAMA)
    options: dict[str, Any] = dict(batch_size=1, seq_len=300, new_tokens=70)
    unlimited = memcalc.estimate(source, mode="generate", optimizer="none", **options)
    limits: list[int | None] = []
    skipped: list[int | None] = []
    replay, skipping = allocator.replay, run.replay_generation

    def spy(*args: Any, **given: Any) -> allocator.AllocatorStats:
        limits.append(given.get("capacity"))
        return replay(*args, **given)

    def skipping_spy(*args: Any, **given: Any) -> allocator.AllocatorStats | None:
        stats = skipping(*args, **given)
        if stats is not None:
            skipped.append(given.get("capacity"))
        return stats

    monkeypatch.setattr(allocator, "replay", spy)
    monkeypatch.setattr(run, "replay_generation", skipping_spy)
    capacity = unlimited.peak_reserved - (1 << 20)
    extrapolated, full = _both(source, monkeypatch, capacity=capacity, **options)
    # each estimate's replay under the capacity skipping, and, where it does not fit, with expandable segments
    assert skipped.count(capacity) == 2
    assert limits.count(capacity) == (0 if extrapolated.fits else 2)
    _assert_identical(extrapolated, full)
    assert extrapolated.fits == full.fits is not None

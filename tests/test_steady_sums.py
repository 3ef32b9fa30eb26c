"""A long generation's report read off a few of its written decode steps (memcalc.engine.steady_sums):
the module rows' high water, the categories at the peak and the peak requested equal those read off
every event, so
the report — its text at depth 9, its JSON, to_dict() — is the same, byte for byte, on the same
extrapolated trace. (tests/test_generation_steady.py compares it with the trace of every step.)"""

from __future__ import annotations

import json
from dataclasses import astuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import SMALL_LLAMA, hf_config_source

import memcalc
from memcalc.core.categories import Category, Phase
from memcalc.engine import steady_replay, steady_sums
from memcalc.engine.trace import SteadyRun, StepTrace
from memcalc.report.render import render_report

pytest.importorskip("transformers")

SMALL_GPT2: dict[str, object] = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
    "vocab_size": 1000, "n_positions": 256}


def _both(source: str, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> tuple[memcalc.MemoryReport,
                                                                                memcalc.MemoryReport, set[str]]:
    """The estimate with the sums read off a few steps, with them read off every event, and which
    sums the first read off a few steps ("rows": the module rows' high water, "peak": the
    categories at the peak)."""
    options = dict(mode="generate", optimizer="none", **kwargs)
    calls: set[str] = set()
    stream, requested = steady_sums.stream, steady_replay._peak_requested
    reading: list[str] = []  # "requested" while the replay reads its peak requested

    def counted(*args: Any, **kw: Any) -> steady_sums.Stream:
        calls.add(reading[-1] if reading else "peak" if len(args) + len(kw) == 3 else "rows")
        return stream(*args, **kw)

    def read(*args: Any) -> int:
        reading.append("requested")
        try:
            return requested(*args)
        finally:
            reading.pop()

    with monkeypatch.context() as patch:
        patch.setattr(steady_sums, "stream", counted)
        patch.setattr(steady_replay, "_peak_requested", read)
        compact = memcalc.estimate(source, **options)
    with monkeypatch.context() as patch:
        patch.setattr(steady_sums, "SKIP_FROM", 10**9)
        full = memcalc.estimate(source, **options)
    return compact, full, calls


def _assert_identical(compact: memcalc.MemoryReport, full: memcalc.MemoryReport) -> None:
    assert json.dumps(compact.to_dict()) == json.dumps(full.to_dict())
    for depth in (1, 9):
        assert render_report(compact, module_depth=depth) == render_report(full, module_depth=depth)
    assert compact.modules == full.modules
    assert compact.peak_requested == full.peak_requested  # read off a few steps too; not in to_dict()
    assert not any("token by token" in note for note in compact.notes)


# quick: a decode peak (llama), a prefill peak on the other architecture (gpt2), and amp
@pytest.mark.quick_cases("llama-decode-peak", "gpt2", "amp-bf16")
@pytest.mark.parametrize("config, options, peak", [
    pytest.param(SMALL_LLAMA, dict(batch_size=1, seq_len=8, new_tokens=40), Phase.DECODE, id="llama-decode-peak"),
    pytest.param(SMALL_LLAMA, dict(batch_size=2, seq_len=128, new_tokens=24), Phase.PREFILL, id="llama-prefill-peak"),
    pytest.param(SMALL_GPT2, dict(batch_size=3, seq_len=10, new_tokens=33), Phase.PREFILL, id="gpt2"),
    pytest.param(SMALL_GPT2, dict(batch_size=1, seq_len=4, new_tokens=60), Phase.DECODE, id="gpt2-decode-peak"),
    pytest.param(SMALL_LLAMA, dict(batch_size=1, seq_len=9, new_tokens=70, precision="bf16"), Phase.DECODE,
                 id="bf16"),
    pytest.param(SMALL_LLAMA, dict(batch_size=1, seq_len=9, new_tokens=40, precision="amp-bf16"), Phase.DECODE,
                 id="amp-bf16"),
])
def test_the_sums_off_a_few_steps_are_those_off_every_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            config: dict[str, object], options: dict[str, Any],
                                                            peak: Phase | None):
    compact, full, calls = _both(hf_config_source(tmp_path, config), monkeypatch, **options)
    _assert_identical(compact, full)
    assert compact.peak_phase is peak
    # the module rows read off a few steps; the categories too where the peak is in the last steps, the
    # peak requested where the replay skips steps (from steady_replay.SKIP_FROM decode steps on)
    skips = options["new_tokens"] - 1 >= steady_replay.SKIP_FROM
    assert calls == {"rows"} | ({"peak"} if peak is Phase.DECODE else set()) | ({"requested"} if skips else set())


@pytest.mark.slow
@pytest.mark.parametrize("prompt, tokens", [
    pytest.param(100, 60, id="small-to-large-pool"),  # the cache's 1-MiB boundary crossed in the written steps
    pytest.param(1250, 60, id="20-MiB-segment-to-own-segment"),
])
def test_the_sums_across_an_allocator_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prompt: int,
                                               tokens: int):
    config = {**SMALL_LLAMA, "max_position_embeddings": 2048}
    compact, full, calls = _both(hf_config_source(tmp_path, config), monkeypatch, batch_size=64, seq_len=prompt,
                                 new_tokens=tokens)
    _assert_identical(compact, full)
    assert "rows" in calls


@pytest.mark.slow
def test_the_sums_over_a_static_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    static = hf_config_source(tmp_path, {**SMALL_LLAMA, "cache_implementation": "static"})
    compact, full, calls = _both(static, monkeypatch, batch_size=1, seq_len=8, new_tokens=30)
    _assert_identical(compact, full)
    assert "rows" in calls


def _trace(count: int, accumulates: bool = False) -> tuple[StepTrace, list[Category]]:
    """A hand-made trace: a prefix storage, then ``count`` steps each making a growing storage that
    the next step frees (``accumulates``: never freed) and a scratch freed at once."""
    trace = StepTrace()
    trace.nbytes.append(1000)
    trace.events.append(0)
    start = len(trace.events)
    for s in range(count + 1):  # count written steps, then the last one
        kept, scratch = 1 + 2 * s, 2 + 2 * s
        trace.events += [kept, scratch, ~scratch]
        if s and not accumulates:
            trace.events.insert(len(trace.events) - 3, ~(kept - 2))
        trace.nbytes += [100 + 10 * s, 50]
    trace.events += [~0, ~(2 * count + 1)]
    n = len(trace.nbytes)
    trace.phase += [Phase.DECODE] * n
    trace.module += ["m"] * n
    trace.category += [Category.ACTIVATIONS] * n
    trace.steady = SteadyRun(start + 3 if not accumulates else start, 4 if not accumulates else 3, count - 1, 2,
                             3, not accumulates)
    return trace, [Category.ACTIVATIONS] * n


def _applies(trace: StepTrace, categories: list[Category]) -> SteadyRun | None:
    return steady_sums.applies(trace, categories, np.asarray(trace.events, dtype=np.int64),
                               np.asarray(trace.nbytes, dtype=np.int64))


def test_a_run_that_is_not_affine_or_short_or_changed_is_read_event_by_event():
    trace, categories = _trace(8, accumulates=True)
    assert _applies(trace, categories) is None  # affine False
    trace, categories = _trace(8)
    assert _applies(trace, categories) is not None
    categories[-3] = Category.WORKSPACE  # the last written step's storage is not the first's
    assert _applies(trace, categories) is None
    trace, categories = _trace(3)
    assert _applies(trace, categories) is None  # too few written steps to pay
    trace, categories = _trace(8)
    assert trace.steady is not None
    trace.nbytes[trace.steady.base + 2 * trace.steady.storages] = 0  # a written storage resized (set apart)
    assert _applies(trace, categories) is None
    trace, categories = _trace(8)
    trace.events[trace.steady.start + 2 * trace.steady.length + 1] += 1  # a written step's event renamed
    assert _applies(trace, categories) is None
    trace, categories = _trace(8)
    assert trace.steady is not None
    trace.steady = SteadyRun(*astuple(trace.steady)[:5], affine=True)
    step = trace.steady.start
    for k in range(trace.steady.count):  # each written step's kept storage no longer freed by the next
        trace.events[step + k * trace.steady.length] = trace.events[step + k * trace.steady.length + 2]
    assert _applies(trace, categories) is None


def test_the_stream_sums_are_every_events_sums():
    # the hand-made trace's running sums at every event, against the stream's
    trace, categories = _trace(12)
    run = _applies(trace, categories)
    assert run is not None
    signed = [trace.nbytes[e] if e >= 0 else -trace.nbytes[~e] for e in trace.events]
    running = [sum(signed[:i + 1]) for i in range(len(signed))]
    for until in range(len(trace.events)):
        at, weights, _ = steady_sums.stream(run, len(trace.events), until)
        assert sum(int(w) * signed[int(i)] for i, w in zip(at, weights, strict=True)) == running[until], until
    at, weights, read = steady_sums.stream(run, len(trace.events))
    sums, total = [], 0
    for i, w, r in zip(at.tolist(), weights.tolist(), read.tolist(), strict=True):
        total += w * signed[i]
        if r and trace.events[i] >= 0:
            sums.append(total)
    assert max(sums) == max(running[i] for i, e in enumerate(trace.events) if e >= 0)

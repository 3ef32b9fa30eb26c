"""The module table's inference rows (``run._forward_high_water``: numpy over millions of events in a
long generation) against the definition walked event by event: per module, the most activation
bytes born in its forward (its submodules included) alive at one moment."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import SMALL_LLAMA, hf_config_source

import memcalc
from memcalc.core.categories import Category, Phase
from memcalc.engine import run

pytest.importorskip("transformers")

GPT2: dict[str, object] = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 12,
                           "n_head": 4, "vocab_size": 1000, "n_positions": 256}


def _walked(traced: run.TracedStep) -> dict[str, int]:
    """The definition, one event at a time."""
    trace = traced.trace
    live: dict[str, int] = {}
    high: dict[str, int] = {}
    for event in trace.events:
        uid = event if event >= 0 else ~event
        phase = trace.phase[uid]
        if not (phase.runs_forward and phase is not Phase.LOSS and traced.categories[uid] is Category.ACTIVATIONS):
            continue
        for ancestor in run._self_and_ancestors(trace.module[uid]):
            live[ancestor] = live.get(ancestor, 0) + (trace.nbytes[uid] if event >= 0 else -trace.nbytes[uid])
            if event >= 0 and live[ancestor] > high.get(ancestor, 0):
                high[ancestor] = live[ancestor]
    return high


@pytest.mark.parametrize("config, batch, prompt, tokens", [
    pytest.param(GPT2, 1, 40, 30, id="gpt2-12-layers"),  # a block's members: < 1/8 of the events, merged
    pytest.param(SMALL_LLAMA, 2, 24, 20, id="llama-batch-2"),
])
def test_rows_are_the_high_water_walked_event_by_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       config: dict[str, object], batch: int, prompt: int,
                                                       tokens: int) -> None:
    seen: list[tuple[run.TracedStep, dict[str, int]]] = []
    original = run._forward_high_water

    def spy(traced: run.TracedStep, columns: run._Columns) -> dict[str, int]:
        seen.append((traced, original(traced, columns)))
        return seen[-1][1]

    monkeypatch.setattr(run, "_forward_high_water", spy)
    memcalc.estimate(hf_config_source(tmp_path, config), mode="generate", optimizer="none", batch_size=batch,
                     seq_len=prompt, new_tokens=tokens)
    traced, rows = seen[-1]
    assert len(rows) > 10 and rows == _walked(traced)

"""Depth extrapolation's first part (:mod:`memcalc.distributed.depth_chunks`): a distributed step of
a Llama traced at 3 and at 4 layers differs by blocks of added events only, the same blocks as
between 2 and 3 layers, and a 4-layer trace is longer than a 3-layer one by exactly what those
blocks add."""

from __future__ import annotations

from itertools import pairwise

import pytest

import memcalc
import memcalc.distributed.strategies as strategies
from memcalc.distributed.depth_chunks import depth_chunks
from memcalc.distributed.setting import Distributed
from memcalc.engine.run import TracedStep
from memcalc.engine.step_spec import Step

_RESOLVE = Step.resolved  # the real resolver and tracer, before any test wraps them
_TRACE = strategies.trace_step


def _traced(monkeypatch: pytest.MonkeyPatch, layers: int, mesh: dict[str, int]) -> TracedStep:
    """The one role's real traced step of the zoo's plain-torch Llama cut to ``layers`` decoder layers
    (its forward runs every layer its list holds; the tracer is wrapped to keep its result, not replaced)."""
    seen: list[TracedStep] = []

    def keep(*args, **kwargs):  # type: ignore[no-untyped-def]
        traced = _TRACE(*args, **kwargs)
        seen.append(traced)
        return traced

    monkeypatch.setattr(strategies, "trace_step", keep)
    def shallower(step: Step, *args, **kwargs):  # type: ignore[no-untyped-def]
        resolved = _RESOLVE(step, *args, **kwargs)
        del resolved.module.get_submodule("model.layers")[layers:]  # the model built with ``layers`` layers
        return resolved

    monkeypatch.setattr(Step, "resolved", shallower)
    memcalc.estimate("torch:llama-tiny", batch_size=2, seq_len=128, distributed=Distributed(**mesh), checkpoint=True,
                     precision="amp-bf16")
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("mesh", [{"dp_shard": 4}, {"dp_shard": 2, "tp": 2}])
def test_one_more_layer_adds_the_same_blocks_of_events(monkeypatch: pytest.MonkeyPatch, mesh: dict[str, int]) -> None:
    steps = [_traced(monkeypatch, n, mesh) for n in (2, 3, 4)]
    chunks = [depth_chunks(a.trace, a.categories, b.trace, b.categories, ("model.layers",))
              for a, b in pairwise(steps)]
    assert chunks[0] is not None and chunks[1] is not None
    sizes = [[r.stop - r.start for r in c.runs if r.added] for c in chunks]
    assert sizes[0] == sizes[1] and len(sizes[0]) >= 2  # a forward and a backward period at least
    per_layer = chunks[1].added_events
    assert len(steps[2].trace.events) - len(steps[1].trace.events) == per_layer
    assert len(steps[1].trace.events) - len(steps[0].trace.events) == per_layer
    assert len(chunks[1].added_preexisting) == len(chunks[0].added_preexisting) > 0

"""The cyclic garbage collector is paused while a step is traced and replayed
(:mod:`memcalc.engine.collector`), and the user's setting is what it was afterwards, errors
included."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import memcalc
from memcalc.core.errors import MemcalcError
from memcalc.engine import allocator

#: What :class:`RecordsCollector`'s forward saw (module-level: memcalc traces its own copy of a module).
SEEN: list[bool] = []


class RecordsCollector(nn.Module):
    """A Linear whose forward notes whether the collector was on while memcalc traced it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(gc.isenabled())
        return self.linear(x)


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the user's model fails")


@pytest.fixture
def collector_state():
    """Restore the test process's collector whatever a test did to it."""
    before = gc.isenabled()
    yield
    (gc.enable if before else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_the_collector_is_paused_while_tracing_and_restored(enabled, collector_state):
    (gc.enable if enabled else gc.disable)()
    SEEN.clear()
    memcalc.estimate(RecordsCollector(), batch_size=2, input_shape=(8,))
    assert SEEN and not any(SEEN)  # the traced forward ran with the collector off
    assert gc.isenabled() is enabled


def test_the_collector_is_restored_after_an_error(collector_state):
    gc.enable()
    with pytest.raises(MemcalcError):
        memcalc.estimate(Fails(), batch_size=2, input_shape=(8,))
    assert gc.isenabled()


def test_a_replay_pauses_and_restores(collector_state):
    """The allocator replay, which the batch search runs alone, pauses too; nested pauses leave the
    collector to the outermost."""
    gc.enable()
    seen: list[bool] = []

    def events():
        seen.append(gc.isenabled())
        yield (allocator.ALLOC, "a", 1024)  # one 1 KiB block: 1024 bytes allocated, a 2 MiB segment
        yield (allocator.FREE, "a", 0)

    stats = allocator.replay(events())
    assert seen == [False]
    assert stats.peak_allocated == 1024
    assert gc.isenabled()

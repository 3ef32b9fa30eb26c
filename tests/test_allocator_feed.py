"""``CachingAllocatorModel.feed`` (the replay's inlined loop over uids) makes the decisions
``malloc`` and ``free`` make: the same blocks, segments and stats, on random sequences of small,
mid-sized (20-MiB segments) and large requests, exact fits and 0-byte ones, with the default
settings (the inlined path) and with settings it hands to ``malloc`` (a capacity, max_split_size)."""

from __future__ import annotations

import random

import pytest

from memcalc.core.alloc_conf import AllocConf
from memcalc.engine import allocator

MiB = 1 << 20


def _requests(seed: int, count: int) -> tuple[list[int], list[int]]:
    """Events (uid: born, ~uid: freed) and each uid's bytes: a random walk of births and frees."""
    rng = random.Random(seed)
    sizes = [0, 1, 511, 512, 513, 4096, 100_000, MiB - 1, MiB, MiB + 1, 3 * MiB, 9 * MiB + 7, 10 * MiB,
             12 * MiB + 512, 25 * MiB]
    events: list[int] = []
    nbytes: list[int] = []
    live: list[int] = []
    for _ in range(count):
        if live and rng.random() < 0.45:
            events.append(~live.pop(rng.randrange(len(live))))
            continue
        size = rng.choice(sizes) if rng.random() < 0.3 else rng.choice([rng.randrange(1, 2 * MiB),
                                                                     rng.randrange(1, 30 * MiB)])
        nbytes.append(size)
        events.append(len(nbytes) - 1)
        live.append(len(nbytes) - 1)
    return events, nbytes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity, settings", [
    pytest.param(None, None, id="defaults"),
    pytest.param(None, AllocConf(max_split_size=20 * MiB), id="max-split-size"),
    pytest.param(200 * MiB, None, id="capacity"),
])
def test_feed_makes_mallocs_and_frees_decisions(seed: int, capacity: int | None, settings: AllocConf | None) -> None:
    events, nbytes = _requests(seed, 3000)
    rounded = [allocator.round_size(n) for n in nbytes]
    one = allocator.CachingAllocatorModel(capacity, settings=settings)
    held_one: dict[int, int] = {}
    for event in events:
        if event >= 0:
            one.malloc(event, nbytes[event])
            if event in one._live and one._live[event].size != rounded[event]:
                held_one[event] = one._live[event].size
        else:
            one.free(~event)
    two = allocator.CachingAllocatorModel(capacity, settings=settings)
    held_two: dict[int, int] = {}
    two.feed(events, nbytes, rounded, held_two)
    two.check_invariants()
    assert two.stats() == one.stats()
    assert two.segments() == one.segments()
    assert held_two == held_one
    assert {key: block.addr for key, block in two._live.items()} == {key: b.addr for key, b in one._live.items()}


def test_feed_refuses_what_malloc_and_free_refuse() -> None:
    model = allocator.CachingAllocatorModel()
    model.feed([0], [4096], [4096], {})
    with pytest.raises(allocator.AlreadyLiveError):
        model.feed([0], [4096], [4096], {})
    with pytest.raises(allocator.NotLiveError):
        model.feed([~1], [4096, 4096], [4096, 4096], {})

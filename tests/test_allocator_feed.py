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


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("host, settings", [
    pytest.param(False, None, id="defaults"),
    pytest.param(False, AllocConf(max_split_size=20 * MiB), id="max-split-size"),
    pytest.param(True, None, id="host"),
])
def test_replay_keys_is_replay_with_prefix(seed: int, host: bool, settings: AllocConf | None) -> None:
    # the estimate's replay of its program as keys (engine/run.py) against the same program as
    # (kind, key, nbytes) events: the same stats after the prefix (the first iteration) and at the end
    events, nbytes = _requests(seed, 3000)
    as_tuples = [(allocator.ALLOC, event, nbytes[event]) if event >= 0 else (allocator.FREE, ~event, 0)
                 for event in events]
    prefix = 1234
    expected = allocator.replay_with_prefix(as_tuples, prefix, settings, host=host)
    assert allocator.replay_keys(events, nbytes, prefix, settings, host=host) == expected
    whole, same = allocator.replay_keys(events, nbytes, None, settings, host=host)
    assert whole is same and whole == allocator.replay(as_tuples, settings=settings, host=host)
    assert expected[0] != expected[1]  # the prefix's stats are not the whole's: the check can fail

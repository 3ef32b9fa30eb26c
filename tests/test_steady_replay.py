"""The replay of a long generation with its small pool's repeated decode steps skipped
(memcalc.engine.steady_replay) gives the stats of the replay of every event: peak allocated and
its index, peak requested, peak and final reserved, segments — on generations whose cache
crosses the allocator's boundaries in the steps skipped, and on models whose small pool cycles."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import SMALL_LLAMA, hf_config_source

import memcalc
from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Phase
from memcalc.engine import allocator, run, steady_replay
from memcalc.engine.timeline import Program, allocator_events
from memcalc.engine.trace import StepTrace

transformers = pytest.importorskip("transformers")
#: Seen in the oldest matrix leg (transformers 5.17): the wide llama's decode steps show no cycle
#: in the small pool within 32 steps, so every event is replayed (the stats still equal the full
#: replay's); with 5.24 and 5.25 they repeat every 3 or 12 steps. Why is not yet found.
NO_LLAMA_CYCLE = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 24)

pytest.importorskip("transformers")

# wide enough that the cache is the large pool's from the prompt on (1,024 · 4 B = 4 KiB of keys per
# layer and token: 1 MiB, the small pool's largest request, at 256 tokens), so that the small pool
# holds one token's activations, the same each step but for the sequences' growth (8 B per token)
WIDE_LLAMA: dict[str, object] = {**SMALL_LLAMA, "hidden_size": 1024, "num_attention_heads": 8,
                                 "num_key_value_heads": 8, "intermediate_size": 256, "max_position_embeddings": 4096}
#: six layers: a decode step's layers repeat, and the replay skips those that repeat the ones before
DEEP_LLAMA: dict[str, object] = {**WIDE_LLAMA, "num_hidden_layers": 6}
WIDE_GPT2: dict[str, object] = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 1024, "n_layer": 2, "n_head": 8,
    "vocab_size": 1000, "n_positions": 4096}


def _traced(monkeypatch: pytest.MonkeyPatch, source: str, **options: object) -> tuple[Program, StepTrace]:
    """The program and trace of the generation ``options`` estimate, as the report replays them."""
    seen: list[tuple[Program, StepTrace]] = []
    original = run._replayed

    def spy(program: Program, trace: StepTrace, settings: AllocConf | None, host: bool, **given: Any
            ) -> tuple[allocator.AllocatorStats, allocator.AllocatorStats]:
        seen.append((program, trace))
        return original(program, trace, settings, host, **given)

    with monkeypatch.context() as patch:
        patch.setattr(run, "_replayed", spy)
        memcalc.estimate(source, mode="generate", optimizer="none", **options)  # type: ignore[arg-type]
    return seen[-1]


def _replays(monkeypatch: pytest.MonkeyPatch, source: str, **options: object
             ) -> tuple[allocator.AllocatorStats | None, allocator.AllocatorStats, int, int]:
    """The skipping replay's stats and the full replay's, the events the skipping one fed the
    allocator and all the events, of the generation ``options`` estimate."""
    program, trace = _traced(monkeypatch, source, **options)
    fed = [0]
    feed = steady_replay._feed

    def counted(model: allocator.CachingAllocatorModel, events: np.ndarray, rounded: np.ndarray,
                held: dict[int, int]) -> None:
        fed[0] += len(events)
        feed(model, events, rounded, held)

    monkeypatch.setattr(steady_replay, "_feed", counted)
    fast = steady_replay.replay_generation(program, trace, None, False)
    full = allocator.replay(allocator_events(program, trace.nbytes))
    return fast, full, fed[0], len(program.events)


# quick: llama's cycle, and gpt2's cache leaving the small pool in the steps skipped
@pytest.mark.quick_cases("llama", "gpt2-6-layers-cache-leaves-small-pool")
@pytest.mark.parametrize("config, batch, prompt, tokens", [
    pytest.param(WIDE_LLAMA, 1, 300, 200, id="llama"),
    pytest.param(WIDE_GPT2, 1, 300, 200, id="gpt2"),
    # each layer's cache (4 KiB a token) crosses from the small pool to the large at 256 tokens
    pytest.param({**WIDE_GPT2, "n_layer": 6}, 1, 200, 120, id="gpt2-6-layers-cache-leaves-small-pool"),
    pytest.param(DEEP_LLAMA, 2, 100, 150, id="llama-6-layers-batch-2"),
    # the cache crosses from 1 MiB to 10 MiB (a 20-MiB segment's requests, then its own segment)
    # at 2,560 tokens, and the sequences' rounding steps every 64 tokens, in the steps skipped
    pytest.param(WIDE_LLAMA, 1, 2500, 120, id="llama-past-10-MiB", marks=pytest.mark.slow),
])
def test_skipping_replay_gives_the_full_replays_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       config: dict[str, object], batch: int, prompt: int,
                                                       tokens: int) -> None:
    fast, full, fed, events = _replays(monkeypatch, hf_config_source(tmp_path, config), batch_size=batch,
                                       seq_len=prompt, new_tokens=tokens)
    assert fast == full
    if fed == events and NO_LLAMA_CYCLE and config is WIDE_LLAMA:
        pytest.xfail(f"transformers {transformers.__version__}: no cycle found, every event replayed")
    assert fed < events  # something was skipped: the test compares the two paths


@pytest.mark.quick_cases("gpt2")  # llama's layers skipped in the full suite (its cycle: the test above)
@pytest.mark.parametrize("config, prompt, tokens", [
    pytest.param(DEEP_LLAMA, 300, 200, id="llama"),
    pytest.param({**WIDE_GPT2, "n_layer": 6}, 300, 130, id="gpt2"),
])
def test_skipping_repeated_layers_keeps_the_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  config: dict[str, object], prompt: int, tokens: int) -> None:
    """The layers skipped within the decode steps replayed: fewer events fed than with whole
    steps only, and the stats of the replay of every event."""
    source = hf_config_source(tmp_path, config)
    fast, full, fed, events = _replays(monkeypatch, source, batch_size=1, seq_len=prompt, new_tokens=tokens)
    monkeypatch.setattr(steady_replay, "MAX_UNIT_PERIOD", 0)
    steps_only, _, fed_steps_only, _ = _replays(monkeypatch, source, batch_size=1, seq_len=prompt, new_tokens=tokens)
    assert fast == full == steps_only
    # on the oldest leg (transformers 5.17, NO_LLAMA_CYCLE above) the deep Llama's decode steps show
    # no cycle, so whole steps skip nothing; its layers still repeat within the steps
    assert fed < fed_steps_only <= events
    assert fed_steps_only < events or (NO_LLAMA_CYCLE and config is DEEP_LLAMA)


def test_short_generations_and_capacities_replay_every_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, _, _, _ = _replays(monkeypatch, hf_config_source(tmp_path), batch_size=1, seq_len=8,
                             new_tokens=steady_replay.SKIP_FROM)  # SKIP_FROM - 1 decode steps
    assert fast is None


def test_skipping_replay_tells_its_decode_steps(tmp_path: Path) -> None:
    from memcalc.core.progress import progress_to

    told: list[tuple[str, int, int | None]] = []
    with progress_to(lambda task, done, total: told.append((task, done, total))):
        memcalc.estimate(hf_config_source(tmp_path, WIDE_LLAMA), mode="generate", optimizer="none", batch_size=1,
                         seq_len=300, new_tokens=40)
    done = [d for task, d, total in told if task == steady_replay.REPLAYING and total == 39]  # 39 decode steps
    assert done[0] == 0 and done[-1] == 39 and done == sorted(done)
    if len(done) == 40 and NO_LLAMA_CYCLE:
        pytest.xfail(f"transformers {transformers.__version__}: no cycle found, every decode step replayed")
    assert len(done) < 39  # steps skipped: not told


def _pool(keys: list[int], sizes: list[int], frees: list[int]) -> allocator.CachingAllocatorModel:
    """An allocator that made ``keys`` (of ``sizes`` bytes) in order and then freed ``frees``."""
    model = allocator.CachingAllocatorModel()
    for key, size in zip(keys, sizes, strict=True):
        model.malloc(key, size)
    for key in frees:
        model.free(key)
    return model


def test_small_state_names_the_same_pool_alike_and_tells_each_difference() -> None:
    """The state compared before a stretch is skipped: the same blocks with owners named from
    ``base`` compare equal, whatever their uids; a block's owner, a block freed, an older owner
    (named by uid, below ``first``) and a 0-byte request each make it differ."""
    sizes = [512, 4096, 0, 1536, 20_000, 2 << 20]  # the last a large-pool block: not the small pool's
    state = steady_replay._small_state
    one = state(_pool([100, 101, 102, 103, 104, 105], sizes, [101]), 100, 100)
    assert one == state(_pool([700, 701, 702, 703, 704, 705], sizes, [701]), 700, 700)  # renamed
    assert one == state(_pool([100, 101, 102, 103, 104, 905], sizes, [101]), 100, 100)  # a large block's owner
    assert one != state(_pool([100, 101, 102, 104, 103, 105], sizes, [101]), 100, 100)  # owners swapped
    assert one != state(_pool([100, 101, 102, 103, 104, 105], sizes, [101, 103]), 100, 100)  # one more freed
    assert one != state(_pool([100, 101, 102, 103, 104, 105], sizes, [101]), 101, 100)  # 100: older, by uid
    assert one != state(_pool([100, 101, 112, 103, 104, 105], sizes, [101]), 100, 100)  # the 0-byte key
    assert one != state(_pool([100, 101, 102, 103, 104, 105], sizes, [101, 102]), 100, 100)  # ... freed
    assert one != state(_pool([100, 101, 102, 103, 104, 105], [1024, *sizes[1:]], [101]), 100, 100)  # a size


@pytest.mark.parametrize("seed", range(4))
def test_bases_are_each_steps_first_birth(seed: int) -> None:
    """Each decode step's first storage, from one reduction, as a step-by-step search finds it
    (the least uid born in the step, then the one after every key); None where a step is born
    nothing or a step's first storage is not above the step before's."""
    rng = np.random.default_rng(seed)
    events = rng.integers(0, 5000, size=3000)
    events[rng.random(events.size) < 0.4] ^= -1  # frees: ~uid
    bounds = [*sorted({0, *rng.integers(1, events.size, size=20).tolist()}), events.size]

    def searched(events: np.ndarray, bounds: list[int]) -> list[int] | None:
        out = []
        for a, b in itertools.pairwise(bounds):
            births = events[a:b][events[a:b] >= 0]
            if not births.size:
                return None
            out.append(int(births.min()))
        out.append(int(events.max()) + 1)
        return out if all(x < y for x, y in itertools.pairwise(out)) else None

    ordered = np.sort(events[events >= 0])  # births in order: every step's first above the one before
    ordered_bounds = [*range(0, ordered.size, 150), ordered.size]
    for stream, cut in ((events, bounds), (ordered, ordered_bounds)):
        assert steady_replay._bases(stream, cut) == searched(stream, cut)
    assert steady_replay._bases(ordered, ordered_bounds) is not None
    frees = ordered.copy()
    frees[150:300] ^= -1  # the second step frees only: born nothing
    assert steady_replay._bases(frees, ordered_bounds) is None is searched(frees, ordered_bounds)


def test_values_by_event_are_each_storages_signed_at_its_free() -> None:
    """One gather from the values and their mirror (a free's key ``~uid`` indexes from the end)
    reads, at each event, the value of its storage, negated at a free where asked: as a loop does."""
    rng = np.random.default_rng(7)
    values = rng.integers(0, 1 << 40, size=500)
    events = rng.integers(0, values.size, size=2000)
    events[rng.random(events.size) < 0.5] ^= -1  # frees: ~uid
    uids = [e if e >= 0 else ~e for e in events.tolist()]
    assert steady_replay._uids(events).tolist() == uids
    assert steady_replay._by_event(values, events).tolist() == [int(values[u]) for u in uids]
    signed = [int(values[u]) * (1 if e >= 0 else -1) for u, e in zip(uids, events.tolist(), strict=True)]
    assert steady_replay._by_event(values, events, signed=True).tolist() == signed
    flags = values % 3 == 0  # a boolean table, as the small pool's mask
    assert steady_replay._by_event(flags, events).tolist() == [bool(flags[u]) for u in uids]


#: wide heads (8 of 1,024 fp32 values: 32 KiB of keys a token per layer), so that each layer's caches
#: (10 MiB at 320 tokens) leave their 20-MiB segments within the decode steps and the allocator,
#: under a capacity, releases its cache there; six layers, which the replay skips within a step too
PRESSED_LLAMA: dict[str, object] = {**DEEP_LLAMA, "hidden_size": 8192, "intermediate_size": 256}


def _pressing_capacities(program: Program, trace: StepTrace, count: int) -> list[int]:
    """Capacities that make the allocator release its cache in the decode steps: ``count`` of the
    reserved figures the unlimited replay reaches after the first decode step but the last (the
    allocator under one releases at its next new segment, and goes on releasing at later ones),
    spread, and the peak allocated less 512 B (an OOM there at the latest)."""
    recorded = allocator.replay_recorded(allocator_events(program, trace.nbytes))
    decode = program.iteration_starts[0] + next(start for phase, start in trace.phase_log if phase is Phase.DECODE)
    levels = sorted(set(recorded.reserved[decode:]))[:-1]
    return [*levels[::-(-len(levels) // count)], recorded.stats.peak_allocated - allocator.K_MIN_BLOCK_SIZE]


@pytest.mark.quick_cases("llama-6-layers")
@pytest.mark.parametrize("config, prompt, tokens, count, releases", [
    pytest.param(PRESSED_LLAMA, 300, 100, 4, True, id="llama-6-layers"),
    # two layers: whole decode steps skipped; the caches' own segments (past 10 MiB) grow every 64 tokens
    pytest.param({**WIDE_LLAMA, "hidden_size": 8192, "intermediate_size": 256}, 320, 200, 100, True,
                 id="llama-2-layers"),
    # gpt2's caches from 1.3 to 11 MiB, in 20-MiB segments none of which is ever wholly free: each
    # release frees nothing, and an OOM follows
    pytest.param({**WIDE_GPT2, "n_layer": 6, "n_embd": 8192}, 40, 300, 100, False, id="gpt2-6-layers"),
])
def test_skipping_replay_under_a_capacity_gives_the_full_replays_stats(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, object], prompt: int, tokens: int,
        count: int, releases: bool) -> None:
    """Under capacities that make the allocator release its cache (and run out) at several points of
    the decode steps, some within the steps or layers skipped: the stats of the replay of every event
    under the same capacity, retries, OOMs and the first OOM's index included."""
    program, trace = _traced(monkeypatch, hf_config_source(tmp_path, config), batch_size=1, seq_len=prompt,
                             new_tokens=tokens)
    caught = [0]  # the skips that met a release: their small pool brought to it (feed(pool=True))
    feed = steady_replay._Replay.feed

    def counted(self: steady_replay._Replay, lo: int, hi: int, *, pool: bool | None = None) -> None:
        caught[0] += pool is True
        feed(self, lo, hi, pool=pool)

    monkeypatch.setattr(steady_replay._Replay, "feed", counted)
    capacities = _pressing_capacities(program, trace, count)
    ooms, frees = [], 0
    for capacity in capacities:
        fast = steady_replay.replay_generation(program, trace, None, False, capacity=capacity)
        full = allocator.replay(allocator_events(program, trace.nbytes), capacity=capacity)
        assert fast == full, capacity
        assert full.num_alloc_retries > 0  # under pressure
        ooms.append(full.num_ooms)
        frees += full.num_device_frees
    assert len(capacities) >= 3 and (frees > 0) is releases  # cached segments released
    assert (min(ooms) == 0 or not releases) and max(ooms) > 0  # within the capacity after releases, and not
    if not caught[0] and NO_LLAMA_CYCLE and config.get("num_hidden_layers") == 2:
        pytest.xfail(f"transformers {transformers.__version__}: no cycle found, every decode step replayed")
    assert caught[0] > 0  # some releases fell in a stretch skipped: the path that brings its small pool there


def test_capacity_replay_refuses_garbage_collection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``garbage_collection_threshold`` frees cached segments before any new one is refused, in the
    steps skipped too: replayed event by event (None here), as without a capacity it does not apply."""
    program, trace = _traced(monkeypatch, hf_config_source(tmp_path, WIDE_LLAMA), batch_size=1, seq_len=40,
                             new_tokens=steady_replay.SKIP_FROM + 1)
    collecting = AllocConf(garbage_collection_threshold=0.5)
    assert steady_replay.replay_generation(program, trace, collecting, False, capacity=1 << 40) is None
    assert steady_replay.replay_generation(program, trace, None, False, capacity=1 << 40) is not None


def test_report_under_a_capacity_reads_the_skipping_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation whose unlimited peak reserved exceeds the capacity is judged by the replay under
    the capacity (engine.run._fit_under), the skipping one: the same report as with every event
    replayed, its allocator under pressure."""
    source = hf_config_source(tmp_path, PRESSED_LLAMA)
    options: dict[str, Any] = {"batch_size": 1, "seq_len": 300, "new_tokens": 60}
    program, trace = _traced(monkeypatch, source, **options)
    options.update(mode="generate", optimizer="none")
    capacity = _pressing_capacities(program, trace, 1)[0]
    fed: list[int | None] = []
    skipping = run.replay_generation

    def spy(*args: Any, capacity: int | None = None, **given: Any) -> allocator.AllocatorStats | None:
        stats = skipping(*args, capacity=capacity, **given)
        if capacity is not None:
            fed.append(None if stats is None else stats.num_alloc_retries)
        return stats

    monkeypatch.setattr(run, "replay_generation", spy)
    report = memcalc.estimate(source, capacity=capacity, **options)
    assert fed and fed[0]  # the skipping replay judged it, under pressure
    monkeypatch.setattr(run, "replay_generation",  # under the capacity: every event replayed
                        lambda *args, capacity=None, **given: skipping(*args, **given) if capacity is None else None)
    every = memcalc.estimate(source, capacity=capacity, **options)
    assert report.to_dict() == every.to_dict()
    assert report.peak_reserved_unconstrained > capacity and report.reserved_within_capacity is not None
    assert report.fits is (report.reserved_within_capacity <= capacity)  # past an OOM it over-commits

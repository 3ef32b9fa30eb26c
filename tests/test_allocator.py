"""Tests for memcalc.allocator, the model of PyTorch's CUDA caching allocator.

Every expected number is worked out by hand in a comment from the rules in
c10/cuda/CUDACachingAllocator.cpp: round_size (512 B granularity), get_allocation_size
(2 MiB / 20 MiB / round up to 2 MiB), should_split (small: remainder ≥ 512 B; large:
remainder > 1 MiB), best fit by (size, address), and coalescing on free.
"""

from __future__ import annotations

import random

import pytest

from memcalc.engine.allocator import (
    ALLOC,
    EMPTY_CACHE,
    FREE,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorStats,
    CachingAllocatorModel,
    replay,
    replay_with_prefix,
    round_size,
    segment_size,
)

KiB = 1024
MiB = 1024 * 1024


# --- round_size / segment_size ------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "rounded"),
    [
        (1, 512),  # below kMinBlockSize → kMinBlockSize
        (511, 512),
        (512, 512),  # already a multiple of 512
        (513, 1024),  # next multiple of 512
        (1000, 1024),
        (0, 0),  # a 0-byte request never reaches the allocator
        (MiB + 1, MiB + 512),
    ],
)
def test_round_size(nbytes: int, rounded: int) -> None:
    assert round_size(nbytes) == rounded


def test_round_size_rejects_negative() -> None:
    with pytest.raises(ValueError):
        round_size(-1)


@pytest.mark.parametrize(
    ("nbytes", "segment"),
    [
        (512, 2 * MiB),  # small pool → kSmallBuffer
        (MiB, 2 * MiB),  # exactly kSmallSize is still small (size <= kSmallSize)
        (MiB + 1, 20 * MiB),  # rounds to 1 MiB + 512: large, < 10 MiB → kLargeBuffer
        (10 * MiB - 512, 20 * MiB),  # still < kMinLargeAlloc → kLargeBuffer
        (10 * MiB, 10 * MiB),  # ≥ kMinLargeAlloc → round up to 2 MiB: already a multiple
        (11 * MiB, 12 * MiB),  # ≥ kMinLargeAlloc → 11 MiB rounds up to 12 MiB
        (10 * MiB + 512, 12 * MiB),
    ],
)
def test_segment_size(nbytes: int, segment: int) -> None:
    assert segment_size(round_size(nbytes)) == segment


def test_constants_match_the_cpp() -> None:
    assert (K_MIN_BLOCK_SIZE, K_SMALL_SIZE, K_SMALL_BUFFER, K_LARGE_BUFFER) == (512, MiB, 2 * MiB, 20 * MiB)


def test_one_mib_request_goes_to_the_small_pool() -> None:
    # 1 MiB is ≤ kSmallSize: small pool, 2 MiB segment. The 1 MiB remainder is ≥ 512 B, so it
    # is split off and a second 1 MiB request fills it: reserved 2 MiB, allocated 2 MiB.
    m = CachingAllocatorModel()
    m.malloc("a", MiB)
    assert (m.allocated, m.reserved) == (MiB, 2 * MiB)
    m.malloc("b", MiB)
    assert (m.allocated, m.reserved) == (2 * MiB, 2 * MiB)
    assert m.stats().num_segments == 1


def test_just_over_one_mib_takes_a_20_mib_segment() -> None:
    # 1 MiB + 1 → 1 MiB + 512 (large pool) → 20 MiB segment; remainder 19 MiB - 512 > 1 MiB is
    # split off, so allocated is just the rounded request.
    m = CachingAllocatorModel()
    m.malloc("a", MiB + 1)
    assert (m.allocated, m.reserved) == (MiB + 512, 20 * MiB)


def test_ten_mib_gets_its_own_exact_segment() -> None:
    # 10 MiB ≥ kMinLargeAlloc → segment rounded to 2 MiB = 10 MiB, remainder 0.
    m = CachingAllocatorModel()
    m.malloc("a", 10 * MiB)
    assert (m.allocated, m.reserved) == (10 * MiB, 10 * MiB)


# --- splitting and reuse ------------------------------------------------------------------


def test_two_small_blocks_share_one_segment() -> None:
    # 512 B and 1 B both round to 512 B; the first takes the front of a 2 MiB segment, the
    # second the front of the cached remainder: reserved 2 MiB, allocated 1024 B.
    m = CachingAllocatorModel()
    m.malloc("a", 512)
    m.malloc("b", 1)
    assert (m.allocated, m.reserved) == (1024, 2 * MiB)
    assert m.address_of("b") == m.address_of("a") + 512
    assert m.stats().num_segments == 1
    m.check_invariants()


def test_six_and_four_mib_share_one_20_mib_segment() -> None:
    # 6 MiB → 20 MiB segment, split (14 MiB left > 1 MiB). 4 MiB → best fit is the 14 MiB
    # block, split again (10 MiB left). Reserved 20 MiB, allocated 6 + 4 = 10 MiB.
    m = CachingAllocatorModel()
    m.malloc("a", 6 * MiB)
    m.malloc("b", 4 * MiB)
    assert (m.allocated, m.reserved) == (10 * MiB, 20 * MiB)
    assert m.address_of("b") == m.address_of("a") + 6 * MiB
    assert m.stats().num_segments == 1
    m.check_invariants()


@pytest.mark.parametrize("nbytes", [4000, 6 * MiB, 12 * MiB])
def test_free_then_malloc_same_size_reuses_the_cached_block(nbytes: int) -> None:
    # The freed block (merged back with its segment's free remainder) is cached; the same
    # request finds it again: one segment, same address, reserved unchanged.
    m = CachingAllocatorModel()
    m.malloc("a", nbytes)
    address, reserved = m.address_of("a"), m.reserved
    m.free("a")
    assert (m.allocated, m.reserved) == (0, reserved)  # freeing never returns memory to CUDA
    m.malloc("b", nbytes)
    assert m.address_of("b") == address
    assert m.reserved == reserved
    assert m.stats().num_segments == 1


def test_coalescing_two_adjacent_free_blocks() -> None:
    # a, b, c = 6 MiB each in one 20 MiB segment: a@0, b@6, c@12, free tail 2 MiB @18
    # (each split leaves > 1 MiB: 14, 8, 2). Free a then b: b merges with a → 12 MiB @0.
    # A 12 MiB request best-fits that block (2 MiB tail too small); remainder 0, no split.
    # allocated = 12 (d) + 6 (c) = 18 MiB, still one 20 MiB segment.
    m = CachingAllocatorModel()
    for key in "abc":
        m.malloc(key, 6 * MiB)
    base = m.address_of("a")
    m.free("a")
    m.free("b")
    m.check_invariants()
    m.malloc("d", 12 * MiB)
    assert m.address_of("d") == base
    assert (m.allocated, m.reserved) == (18 * MiB, 20 * MiB)
    assert m.stats().num_segments == 1


def test_without_coalescing_the_same_request_needs_a_new_segment() -> None:
    # Control for the test above: free only a. Cached blocks are 6 MiB @0 and 2 MiB @18;
    # neither holds 12 MiB → cudaMalloc a 12 MiB segment (≥ 10 MiB, round to 2 MiB).
    # reserved 20 + 12 = 32 MiB.
    m = CachingAllocatorModel()
    for key in "abc":
        m.malloc(key, 6 * MiB)
    m.free("a")
    m.malloc("d", 12 * MiB)
    assert m.reserved == 32 * MiB
    assert m.stats().num_segments == 2


def test_coalescing_on_both_sides_then_empty_cache() -> None:
    # a@0, b@6, c@12 (6 MiB each), tail 2 MiB @18. Free a (6 MiB @0), free c (merges with the
    # tail → 8 MiB @12), free b: merges prev and next → one 20 MiB block = the whole segment.
    # empty_cache then cudaFrees it: reserved 0.
    m = CachingAllocatorModel()
    for key in "abc":
        m.malloc(key, 6 * MiB)
    base = m.address_of("a")
    for key in "acb":
        m.free(key)
    assert m.segments() == [(base, 20 * MiB, [(base, 20 * MiB, False)])]
    m.check_invariants()
    m.empty_cache()
    stats = m.stats()
    assert (stats.final_allocated, stats.final_reserved, stats.final_segments) == (0, 0, 0)
    assert stats.num_device_frees == 1
    assert stats.peak_reserved == 20 * MiB


def test_empty_cache_keeps_partly_used_segments() -> None:
    # One 2 MiB small segment with a live 512 B block and a cached 2 MiB - 512 remainder:
    # the remainder is split (its prev is live), so empty_cache cannot free it.
    m = CachingAllocatorModel()
    m.malloc("a", 512)
    m.empty_cache()
    assert m.reserved == 2 * MiB


def test_large_remainder_of_exactly_one_mib_is_not_split() -> None:
    # 19 MiB ≥ 10 MiB → segment rounded to 2 MiB = 20 MiB. Remainder 1 MiB is not > kSmallSize,
    # so should_split is false and the whole 20 MiB block is handed out. The C++ counts
    # block->size in allocated_bytes (alloc_found_block), so allocated is 20 MiB, not 19.
    # The unrounded request is still tracked as requested bytes: 19 MiB.
    m = CachingAllocatorModel()
    m.malloc("a", 19 * MiB)
    assert m.block_size_of("a") == 20 * MiB
    assert (m.allocated, m.reserved) == (20 * MiB, 20 * MiB)
    assert m.stats().peak_requested == 19 * MiB


def test_eleven_mib_is_charged_twelve() -> None:
    # 11 MiB → 12 MiB segment; remainder 1 MiB not split → allocated 12 MiB.
    m = CachingAllocatorModel()
    m.malloc("a", 11 * MiB)
    assert (m.allocated, m.reserved) == (12 * MiB, 12 * MiB)


def test_large_remainder_just_over_one_mib_is_split_but_not_used_by_small_requests() -> None:
    # 19 MiB - 512 → 20 MiB segment; remainder 1 MiB + 512 > 1 MiB → split:
    # allocated 19 MiB - 512. A 1 MiB request belongs to the small pool, which never looks at
    # large-pool blocks → new 2 MiB segment: reserved 22 MiB, allocated 20 MiB - 512.
    m = CachingAllocatorModel()
    m.malloc("a", 19 * MiB - 512)
    assert (m.allocated, m.reserved) == (19 * MiB - 512, 20 * MiB)
    m.malloc("b", MiB)
    assert (m.allocated, m.reserved) == (20 * MiB - 512, 22 * MiB)
    assert m.stats().num_segments == 2


def test_unsplit_reuse_inside_a_20_mib_buffer() -> None:
    # 9 MiB → 20 MiB segment, split (11 MiB left). 10.5 MiB best-fits the 11 MiB block;
    # remainder 0.5 MiB is not > 1 MiB → not split: allocated 9 + 11 = 20 MiB.
    m = CachingAllocatorModel()
    m.malloc("a", 9 * MiB)
    m.malloc("b", 10 * MiB + 512 * KiB)
    assert m.block_size_of("b") == 11 * MiB
    assert (m.allocated, m.reserved) == (20 * MiB, 20 * MiB)
    # Freeing b gives back its whole 11 MiB block to allocated.
    m.free("b")
    assert m.allocated == 9 * MiB


# --- best fit -----------------------------------------------------------------------------


def test_best_fit_picks_the_smallest_adequate_cached_block() -> None:
    # Three whole cached segments of 12, 16 and 14 MiB (each request ≥ 10 MiB gets an exact
    # 2 MiB-rounded segment). A 13 MiB request: the smallest ≥ 13 is the 14 MiB one (z's);
    # remainder 1 MiB is not split → allocated 14 MiB, reserved stays 42 MiB.
    m = CachingAllocatorModel()
    for key, size in (("x", 12 * MiB), ("y", 16 * MiB), ("z", 14 * MiB)):
        m.malloc(key, size)
    z_address = m.address_of("z")
    for key in "xyz":
        m.free(key)
    m.malloc("w", 13 * MiB)
    assert m.address_of("w") == z_address
    assert (m.allocated, m.reserved) == (14 * MiB, 42 * MiB)
    assert m.stats().num_segments == 3


def test_best_fit_ties_go_to_the_lower_address() -> None:
    # Two cached 12 MiB segments; whatever order they were freed in, the (size, address)
    # ordering of BlockComparatorSize makes the lower address win.
    m = CachingAllocatorModel()
    m.malloc("p", 12 * MiB)
    m.malloc("q", 12 * MiB)
    p_address = m.address_of("p")
    assert m.address_of("q") > p_address
    m.free("q")
    m.free("p")
    m.malloc("r", 12 * MiB)
    assert m.address_of("r") == p_address


def test_best_fit_in_the_small_pool() -> None:
    # One 2 MiB segment: a 512 @0, b 4096 @512, c 512 @4608, d 1024 @5120, e 512 @6144,
    # tail free @6656. Free b and d (both between live blocks: no merging). A 1000 B request
    # rounds to 1024: candidates 1024 (d's), 4096 (b's), tail → d's block, exact fit.
    m = CachingAllocatorModel()
    for key, size in (("a", 512), ("b", 4096), ("c", 512), ("d", 1024), ("e", 512)):
        m.malloc(key, size)
    base = m.address_of("a")
    assert m.address_of("d") == base + 5120
    m.free("b")
    m.free("d")
    m.malloc("f", 1000)
    assert m.address_of("f") == base + 5120
    assert m.allocated == 512 + 512 + 512 + 1024
    assert m.reserved == 2 * MiB
    m.check_invariants()


# --- capacity and OOM ---------------------------------------------------------------------


def test_cached_segments_are_released_to_make_room() -> None:
    # capacity 40 MiB. a = 20 MiB → 20 MiB segment; free a → cached whole segment.
    # b = 30 MiB: no cached block fits; cudaMalloc 30 MiB would make 50 > 40 → release the
    # unsplit cached 20 MiB segment (reserved 0), retry: 30 ≤ 40 → success.
    # peak_reserved = max(20, 30) = 30 MiB; 2 segments made, 1 freed, 1 retry.
    events = [(ALLOC, "a", 20 * MiB), (FREE, "a", 0), (ALLOC, "b", 30 * MiB)]
    stats = replay(events, capacity=40 * MiB)
    assert stats.oom_at is None
    assert (stats.final_allocated, stats.final_reserved, stats.peak_reserved) == (30 * MiB, 30 * MiB, 30 * MiB)
    assert (stats.num_segments, stats.num_mallocs, stats.num_device_frees) == (2, 2, 1)
    assert stats.num_alloc_retries == 1
    # Without a capacity the cache is kept: reserved 20 + 30 = 50 MiB.
    assert replay(events).final_reserved == 50 * MiB


def test_true_oom_is_reported_not_raised() -> None:
    # capacity 40 MiB. a = 30 MiB stays live; b = 20 MiB needs a 20 MiB segment: 50 > 40 and
    # nothing cached to release → OOM at event 1. The model over-commits and goes on:
    # reserved 50 MiB afterwards.
    events = [(ALLOC, "a", 30 * MiB), (ALLOC, "b", 20 * MiB), (FREE, "b", 0), (FREE, "a", 0)]
    stats = replay(events, capacity=40 * MiB)
    assert stats.oom_at == 1
    assert stats.num_ooms == 1
    assert stats.peak_reserved == 50 * MiB
    assert stats.peak_allocated == 50 * MiB


def test_fragmentation_oom_split_segments_are_not_released() -> None:
    # capacity 24 MiB. a = 6 MiB → 20 MiB segment split, 14 MiB cached but part of a split
    # segment. b = 16 MiB: 14 < 16 so no fit; 20 + 16 = 36 > 24; release_cached_blocks frees
    # only unsplit segments → nothing; retry fails → OOM at event 1 though only 6 MiB is live.
    stats = replay([(ALLOC, "a", 6 * MiB), (ALLOC, "b", 16 * MiB)], capacity=24 * MiB)
    assert stats.oom_at == 1


def test_first_oom_index_is_kept() -> None:
    # capacity 2 MiB. a: 1 MiB, small pool → 2 MiB segment, exactly at capacity.
    # x: 1.5 MiB → large pool, 20 MiB segment: 22 > 2 and a's segment is split (a is live),
    # so nothing to release → OOM at event 1 (the model over-commits: reserved 22 MiB).
    # b: 2 MiB fits x's cached 18.5 MiB remainder → no OOM. c: 30 MiB → its own 30 MiB
    # segment → OOM again at event 3, but oom_at stays 1; num_ooms counts both.
    events = [(ALLOC, "a", MiB), (ALLOC, "x", 1536 * KiB), (ALLOC, "b", 2 * MiB), (ALLOC, "c", 30 * MiB)]
    stats = replay(events, capacity=2 * MiB)
    assert stats.oom_at == 1
    assert stats.num_ooms == 2
    assert stats.final_reserved == 2 * MiB + 20 * MiB + 30 * MiB


def test_empty_cache_event_kind() -> None:
    # a = 6 MiB in a 20 MiB segment, freed → whole cached segment; EMPTY_CACHE releases it.
    stats = replay([(ALLOC, "a", 6 * MiB), (FREE, "a", 0), (EMPTY_CACHE, None, 0)])
    assert (stats.final_reserved, stats.peak_reserved, stats.num_device_frees) == (0, 20 * MiB, 1)


# --- bookkeeping --------------------------------------------------------------------------


def test_peak_index_points_at_the_peak_event() -> None:
    # allocated after each event: 1 MiB, 2 MiB, 1 MiB, 1 MiB + 512 → peak 2 MiB at event 1.
    events = [(ALLOC, "a", MiB), (ALLOC, "b", MiB), (FREE, "a", 0), (ALLOC, "c", 512)]
    stats = replay(events)
    assert isinstance(stats, AllocatorStats)
    assert (stats.peak_allocated, stats.peak_index) == (2 * MiB, 1)
    assert stats.final_allocated == MiB + 512
    # a and b fill the first 2 MiB segment; c reuses a's freed 1 MiB block (split 512 off it).
    assert (stats.peak_reserved, stats.num_segments) == (2 * MiB, 1)


def test_zero_byte_allocations_cost_nothing() -> None:
    stats = replay([(ALLOC, "z", 0), (FREE, "z", 0)])
    assert (stats.peak_allocated, stats.peak_reserved, stats.num_segments) == (0, 0, 0)
    assert stats.peak_index == -1


def test_empty_replay() -> None:
    assert replay([]) == AllocatorStats(0, 0, 0, 0, 0, 0, None, -1)


def test_misuse_is_an_error() -> None:
    m = CachingAllocatorModel()
    m.malloc("a", 512)
    with pytest.raises(ValueError):
        m.malloc("a", 512)
    with pytest.raises(KeyError):
        m.free("nope")
    with pytest.raises(ValueError):
        replay([(2, "a", 512)])


def test_random_sequence_keeps_invariants() -> None:
    # A fixed pseudo-random mix of small, mid and large requests; the state must stay
    # consistent throughout, and once everything is freed every segment must have coalesced
    # back into one free block, so empty_cache returns all of it.
    rng = random.Random(0)
    for capacity in (None, 200 * MiB):
        m = CachingAllocatorModel(capacity)
        live: list[int] = []
        for step in range(4000):
            if live and rng.random() < 0.45:
                m.free(live.pop(rng.randrange(len(live))))
            else:
                kind = rng.random()
                if kind < 0.5:
                    nbytes = rng.randrange(1, K_SMALL_SIZE + 1)
                elif kind < 0.85:
                    nbytes = rng.randrange(K_SMALL_SIZE + 1, 10 * MiB)
                else:
                    nbytes = rng.randrange(10 * MiB, 40 * MiB)
                m.malloc(step, nbytes)
                live.append(step)
            if step % 250 == 0:
                m.check_invariants()
        m.check_invariants()
        for key in live:
            m.free(key)
        assert m.allocated == 0
        for _, size, parts in m.segments():
            assert parts == [(parts[0][0], size, False)]
        m.empty_cache()
        assert m.reserved == 0
        stats = m.stats()
        assert stats.peak_allocated <= stats.peak_reserved


def test_host_allocator_rounds_and_caches_nothing():
    # The CPU target's allocator: each request its own segment of exactly its bytes, given back at
    # its free. 100 + 1,000 = 1,100 B, free the 100, + 50 = 1,050: the peak is 1,100 B; CUDA's
    # would be 512 + 1,024 = 1,536 B allocated in one 2 MiB segment.
    events = [(ALLOC, "a", 100), (ALLOC, "b", 1_000), (FREE, "a", 0), (ALLOC, "c", 50)]
    host = replay(events, host=True)
    assert (host.peak_allocated, host.peak_reserved, host.peak_requested) == (1_100, 1_100, 1_100)
    assert (host.final_allocated, host.final_reserved, host.peak_index) == (1_050, 1_050, 1)
    assert host.num_segments == 3 and host.num_device_frees == 1
    cuda = replay(events)
    assert (cuda.peak_allocated, cuda.peak_reserved) == (1_536, 2 * 1024**2)


# --- one replay for a prefix and the whole ------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_replay_with_prefix_is_two_replays_in_one(seed: int) -> None:
    # build_report reads the first iteration's peak off the whole step's replay: the stats after a
    # prefix must be those of the prefix replayed alone, and the whole's those of replay()
    rng = random.Random(seed)
    events: list[tuple[int, int, int]] = []
    live: list[int] = []
    for key in range(400):
        events.append((ALLOC, key, rng.choice([rng.randrange(1, 4 * KiB), rng.randrange(1, 3 * MiB),
                                                rng.randrange(MiB, 40 * MiB)])))
        live.append(key)
        while live and rng.random() < 0.45:
            events.append((FREE, live.pop(rng.randrange(len(live))), 0))
        if rng.random() < 0.01:
            events.append((EMPTY_CACHE, -1, 0))  # no key: the replay empties the cache
    streams = {key: 1 for key in range(0, 400, 7)} if seed % 2 else None
    for prefix in (0, 1, len(events) // 3, len(events)):
        first, whole = replay_with_prefix(iter(events), prefix, streams=streams)
        assert first == replay(events[:prefix], streams=streams)
        assert whole == replay(events, streams=streams)

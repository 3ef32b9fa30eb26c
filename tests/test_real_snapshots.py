"""Golden tests: the real H100 snapshots' allocation streams, replayed through memcalc's model of
the caching allocator (``tests/data/gpu/*-h100/``, memcalc.measure.snapshot).

Each snapshot's trace is every alloc and free the real run made, with the size it requested, and
every cudaMalloc/cudaFree the real allocator made in answer. Replayed from the segments the trace
began with, the model must make the same cudaMallocs — the real reserved after *every* event,
not only at the peak — when it is given the real segment addresses (its best-fit tie-break is
by address). With its own addresses, as in an estimate, it places segments as the CUDA driver
placed them (``VA_GRANULARITY``: each new 32-MiB-rounded address range below the last, a later
segment in the lowest free range it fits), and then too every snapshot comes out exact; the
placement itself is checked against the real addresses of the two runs whose process began with
an empty cache.
"""

from __future__ import annotations

import itertools
import json
import lzma
import shutil
import tarfile
from pathlib import Path

import pytest

from memcalc.engine.allocator import CachingAllocatorModel
from memcalc.measure.snapshot import RealSnapshot, load_snapshot, replay_snapshot

DATA = Path(__file__).parent / "data" / "gpu"
SHARED = DATA / "2026-11-25-h100"
LATER = DATA / "2026-11-26-h100"
STEMS = ("gpt2-b4-s1024-adamw-amp-bf16-accum4", "gpt2-b8-s1024-adamw-amp-bf16", "gpt2-b8-s1024-eval",
         "llama-tiny-b8-s512-adamw-amp-bf16-ckpt", "llama-tiny-b8-s512-inference-bf16",
         "llama-tiny-b8-s512-inference-bf16-kv512", "resnet18-b1-sgd", "resnet50-b64-sgd-momentum-amp-fp16",
         "unet-b2-sgd", "vit_b_16-b32-adamw-bf16")
LATER_STEMS = ("resnet18-b64-sgd", "resnet50-b32-sgd", "resnet50-b64-eval", "vgg16-b16-sgd")
# With the model's own addresses the tie-break between equal-sized cached blocks may fall
# otherwise than on the GPU. With the placement read off these snapshots (VA_GRANULARITY), none
# does; with increasing addresses never reused (the model before it), gpt2-b8-s1024-eval came out
# -3.40% and resnet18-b64-sgd -3.64%.
OWN_ADDRESS_ERROR: dict[str, float] = {}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared snapshots, extracted once (80 MB: never committed extracted)."""
    folder = tmp_path_factory.mktemp("h100-snapshots")
    with tarfile.open(SHARED / "snapshots.tar.xz") as archive:
        archive.extractall(folder, filter="data")
    for stem in LATER_STEMS:
        with lzma.open(LATER / f"{stem}.pickle.xz") as source, open(folder / f"{stem}.pickle", "wb") as target:
            shutil.copyfileobj(source, target)
    return folder


@pytest.mark.parametrize("stem", STEMS + LATER_STEMS)
@pytest.mark.quick_cases("resnet18-b1-sgd", "llama-tiny-b8-s512-inference-bf16-kv512")
def test_replay_makes_the_real_allocators_cudamallocs(snapshots: Path, stem: str) -> None:
    snapshot = load_snapshot(snapshots / f"{stem}.pickle")
    replay = replay_snapshot(snapshot, real_addresses=True)
    assert replay.first_divergence is None, f"reserved differs from the real one after event {replay.first_divergence}"
    assert replay.reserved == snapshot.reserved
    assert replay.stats.peak_reserved == snapshot.peak_reserved
    if stem in STEMS:  # the measured peak the run reported is the trace's own
        measured = json.loads((snapshots / f"{stem}.json").read_text())
        assert snapshot.peak_reserved == measured["peak_reserved"]


@pytest.mark.parametrize("stem", STEMS + LATER_STEMS)
@pytest.mark.quick_cases("resnet18-b1-sgd", "gpt2-b8-s1024-eval")  # exact, and one whose tie-break differs
def test_replay_with_the_models_own_addresses(snapshots: Path, stem: str) -> None:
    replay = replay_snapshot(load_snapshot(snapshots / f"{stem}.pickle"), real_addresses=False)
    assert replay.reserved_error == pytest.approx(OWN_ADDRESS_ERROR.get(stem, 0.0), abs=5e-4)


def test_the_seed_is_what_the_trace_began_with(snapshots: Path) -> None:
    # resnet18 b1: the trace starts at the cuBLAS warm-up, after two 32 MiB workspaces (one per
    # cuBLAS/cuBLASLt handle on sm90) and two 2 MiB small-pool segments holding 1 MiB each
    snapshot = load_snapshot(snapshots / "resnet18-b1-sgd.pickle")
    assert sorted(s.size for s in snapshot.seed) == [2 << 20, 2 << 20, 32 << 20, 32 << 20]
    assert snapshot.start_reserved == 68 << 20  # 2·32 + 2·2 MiB
    assert sorted(sum(block[2] for block in s.live) for s in snapshot.seed) == [1 << 20, 1 << 20, 32 << 20, 32 << 20]


def test_given_addresses_decide_the_best_fit_tie_break() -> None:
    # two 12 MiB requests: each its own 12 MiB segment (≥ 10 MiB: rounded to 2 MiB); freed, two
    # equal cached blocks, and best fit takes the lower address — the first segment with the
    # model's own placement (the second fills the first's 32 MiB range above it), the second with
    # addresses given in decreasing order
    for addresses, reused in (([0x2000_0000, 0x1000_0000], "b"), (None, "a")):
        model = CachingAllocatorModel(segment_addresses=addresses)
        model.malloc("a", 12 << 20)
        model.malloc("b", 12 << 20)
        taken = {"a": model.address_of("a"), "b": model.address_of("b")}
        model.free("a")
        model.free("b")
        model.malloc("c", 12 << 20)
        assert model.address_of("c") == taken[reused]
        model.check_invariants()


def test_seeded_segment_keeps_its_layout() -> None:
    model = CachingAllocatorModel()
    model.seed_segment(0x1000, 2 << 20, True, [(128 << 10, "w", 1 << 20, 1000)])
    # 2 MiB small segment: 128 KiB free, the 1 MiB block, 896 KiB free
    assert model.segments() == [(0x1000, 2 << 20, [(0x1000, 128 << 10, False), (0x1000 + (128 << 10), 1 << 20, True),
                                                   (0x1000 + (1152 << 10), 896 << 10, False)])]
    assert (model.allocated, model.reserved) == (1 << 20, 2 << 20)
    model.malloc("x", 100 << 10)  # best fit: the 128 KiB gap, not the 896 KiB one
    assert model.address_of("x") == 0x1000
    model.check_invariants()


def test_own_placement_is_the_drivers() -> None:
    # a 74 MiB segment takes the top of a new 96 MiB range (74 rounded up to 32 MiB), a 78 MiB one
    # the next range below it; a 22 MiB one the lowest free range it fits (the 78's tail, 18 MiB,
    # is too small: the 74's, 22 MiB, takes it whole); 20 MiB then needs a new 32 MiB range
    model = CachingAllocatorModel()
    for key, mib in (("a", 74), ("b", 78), ("c", 22), ("d", 20)):
        model.malloc(key, mib << 20)
    a, b, c, d = (model.address_of(k) for k in "abcd")
    assert a - b == 96 << 20 and c == a + (74 << 20) and b - d == 32 << 20
    # released by empty_cache, a segment's addresses are free again, merged with its free
    # neighbours: b's 78 MiB, its 18 MiB tail above and the 12 MiB tail of d's range below make
    # 108 MiB, where a 100 MiB segment goes
    model.free("b")
    model.empty_cache()
    model.malloc("e", 100 << 20)
    assert model.address_of("e") == b - (12 << 20)
    model.check_invariants()


def _own_bases(snapshot: RealSnapshot) -> list[int]:
    """The base of each segment the model's own placement gives, in cudaMalloc order."""
    bases: list[int] = []

    class Recording(CachingAllocatorModel):
        def _segment_address(self, size: int) -> int:
            bases.append(super()._segment_address(size))
            return bases[-1]

    replay_snapshot(snapshot, model=Recording())
    return bases


@pytest.mark.parametrize(("stem", "agree", "pairs"), [("resnet18-b64-sgd", 648, 666), ("resnet50-b32-sgd", 4601, 5050)])
def test_own_placement_orders_segments_as_the_driver_did(snapshots: Path, stem: str, agree: int, pairs: int) -> None:
    # the 2026-11-26 runs began their step with the build's cache emptied: their segments lie in
    # fresh address ranges, as an estimate's do. Of every pair of the trace's segments, the model
    # places this many in the real address order (what the best-fit tie-break reads); the rest
    # follow device memory the allocator does not see (CUDA's lazily loaded kernels take address
    # ranges too: resnet18's 34 MiB segment lies 96 MiB below the one before it, not 64)
    snapshot = load_snapshot(snapshots / f"{stem}.pickle")
    real, own = list(snapshot.segment_addresses), _own_bases(snapshot)
    assert len(real) == len(own)
    ordered = [(real[i] < real[j]) == (own[i] < own[j]) for i, j in itertools.combinations(range(len(real)), 2)]
    assert (sum(ordered), len(ordered)) == (agree, pairs)

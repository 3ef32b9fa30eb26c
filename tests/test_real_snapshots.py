"""Golden tests: the real H100 snapshots' allocation streams, replayed through memcalc's model of
the caching allocator (``tests/data/gpu/*-h100/``, memcalc.measure.snapshot).

Each snapshot's trace is every alloc and free the real run made, with the size it requested, and
every cudaMalloc/cudaFree the real allocator made in answer. Replayed from the segments the trace
began with, the model must make the same cudaMallocs — the real reserved after *every* event,
not only at the peak — when it is given the real segment addresses (its best-fit tie-break is
by address). With its own addresses, as in an estimate, the tie-break may fall otherwise: that
is the part of reserved memory no model of the allocator can know.
"""

from __future__ import annotations

import json
import lzma
import shutil
import tarfile
from pathlib import Path

import pytest

from memcalc.engine.allocator import CachingAllocatorModel
from memcalc.measure.snapshot import load_snapshot, replay_snapshot

DATA = Path(__file__).parent / "data" / "gpu"
SHARED = DATA / "2026-11-25-h100"
LATER = DATA / "2026-11-26-h100"
STEMS = ("gpt2-b4-s1024-adamw-amp-bf16-accum4", "gpt2-b8-s1024-adamw-amp-bf16", "gpt2-b8-s1024-eval",
         "llama-tiny-b8-s512-adamw-amp-bf16-ckpt", "llama-tiny-b8-s512-inference-bf16",
         "llama-tiny-b8-s512-inference-bf16-kv512", "resnet18-b1-sgd", "resnet50-b64-sgd-momentum-amp-fp16",
         "unet-b2-sgd", "vit_b_16-b32-adamw-bf16")
LATER_STEMS = ("resnet18-b64-sgd", "resnet50-b32-sgd", "resnet50-b64-eval", "vgg16-b16-sgd")
# With the model's own addresses the tie-break between equal-sized cached blocks may fall
# otherwise than on the GPU. Measured: every snapshot exact but these two.
OWN_ADDRESS_ERROR = {"gpt2-b8-s1024-eval": -0.0340, "resnet18-b64-sgd": -0.0364}


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
    # model's increasing addresses, the second with addresses given in decreasing order
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

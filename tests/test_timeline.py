"""``MemoryReport.timeline()``: the memory after every event of the simulated step — a tiny
step worked out by hand, then the invariants on real models (the peak is the report's, the
categories never exceed what is allocated, the phases cover both iterations in order, the
largest storages are alive at the peak), capacities, multi-GPU roles, and laziness."""

from __future__ import annotations

import dataclasses
import gc
import itertools

import numpy as np
import pytest

import memcalc
import memcalc.engine.run as engine_run
from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.timeline import Allocation, Timeline

MiB = 2**20
# The order a train step's phases come in; setup only before the first iteration's step.
_PHASE_ORDER = (Phase.SETUP, Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.OPTIMIZER, Phase.ZERO_GRAD)


@pytest.fixture(scope="module")
def resnet() -> memcalc.MemoryReport:
    return memcalc.estimate("resnet18", batch_size=4, input_shape=(3, 64, 64), optimizer="adam")


@pytest.fixture(scope="module")
def gpt2_checkpointed() -> memcalc.MemoryReport:
    return memcalc.estimate("gpt2", batch_size=2, seq_len=64, checkpoint=True, optimizer="adamw")


# ---- a step worked out by hand ------------------------------------------------------------------


def test_fc_eval_step_by_hand():
    # Linear(32, 16, bias=False), batch 100, fp32, eval, the CPU target (no cuBLAS workspace; the
    # CPU allocator rounds nothing and caches nothing): weight 32·16·4 = 2,048 B; input
    # 100·32·4 = 12,800 B; output 100·16·4 = 6,400 B. Events: weight, input (pre-existing), the
    # mm's output, its free.
    r = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none", gpu="cpu")
    t = r.timeline()
    assert t.num_events == 4
    assert t.allocated.tolist() == [2_048, 14_848, 21_248, 14_848]
    assert t.reserved.tolist() == t.allocated.tolist()  # each tensor its own malloc, given back at its free
    params, inputs, acts = (t.categories.index(c) for c in (Category.PARAMETERS, Category.INPUTS,
                                                              Category.ACTIVATIONS))
    expected = np.zeros((4, len(Category)), dtype=np.int64)
    expected[:, params] = 2_048
    expected[1:, inputs] = 12_800
    expected[2, acts] = 6_400
    assert (t.by_category == expected).all()
    assert t.is_alloc.tolist() == [True, True, True, False]
    assert t.phase == (Phase.SETUP, Phase.SETUP, Phase.FORWARD, Phase.FORWARD)
    assert t.op == ("", "", "aten.mm.default", "aten.mm.default")
    assert t.category == (Category.PARAMETERS, Category.INPUTS, Category.ACTIVATIONS, Category.ACTIVATIONS)
    assert [(s.phase, s.iteration, s.start, s.end) for s in t.spans] == [
        (Phase.SETUP, 1, 0, 2), (Phase.FORWARD, 1, 2, 4)]
    assert t.peak_index == 2 and t.peak_allocated == r.bytes.peak_allocated == 21_248
    assert t.largest_at_peak == (
        Allocation(12_800, Category.INPUTS, Phase.SETUP, "", ""),
        Allocation(6_400, Category.ACTIVATIONS, Phase.FORWARD, "", "aten.mm.default"),
        Allocation(2_048, Category.PARAMETERS, Phase.SETUP, "", ""),
    )
    # the host allocator's actions: a segment of exactly its bytes per tensor, freed with it
    assert [(e.action, e.size, e.event, e.storage, e.requested) for e in t.allocator_events] == [
        ("segment_alloc", 2_048, 0, -1, 0), ("alloc", 2_048, 0, 0, 2_048),
        ("segment_alloc", 12_800, 1, -1, 0), ("alloc", 12_800, 1, 1, 12_800),
        ("segment_alloc", 6_400, 2, -1, 0), ("alloc", 6_400, 2, 2, 6_400),
        ("free_completed", 6_400, 3, 2, 6_400), ("segment_free", 6_400, 3, -1, 0),
    ]
    assert t.capacity is None and t.role == ""


def test_fc_train_step_by_hand_both_iterations():
    # The same layer trained with SGD (loss: output.mean()), on the CPU target (unrounded). Per
    # iteration: the output (6,400 B), the loss (4 B), autograd's ones_like seed (4 B), mean's
    # backward (6,400 B), the weight's gradient (2,048 B); then the frees, the gradient last, at
    # zero_grad. SGD without momentum keeps no state: the second iteration repeats the first.
    r = memcalc.estimate("fc-32-16", batch_size=100, optimizer="sgd", gpu="cpu")
    t = r.timeline()
    step = [21_248, 21_252, 21_256, 27_656, 29_704, 23_304, 23_300, 16_900, 16_896, 14_848]
    assert t.allocated.tolist() == [2_048, 14_848, *step, *step]
    # 12,800 + 6,400 + 6,400 + 2,048 + 2,048 + 4 + 4 = 29,704 B
    assert t.peak_index == 6 and r.bytes.peak_allocated == 29_704  # first reached in iteration 1
    assert t.op[2:7] == ("aten.mm.default", "aten.mean.default", "aten.ones_like.default", "aten.div.Scalar",
                         "aten.mm.default")
    grads = t.series(Category.GRADIENTS)
    assert grads.tolist() == [0] * 6 + [2_048] * 5 + [0] + [0] * 4 + [2_048] * 5 + [0]
    assert [(s.phase, s.iteration, s.start, s.end) for s in t.spans] == [
        (Phase.SETUP, 1, 0, 2), (Phase.FORWARD, 1, 2, 3), (Phase.LOSS, 1, 3, 4), (Phase.BACKWARD, 1, 4, 11),
        (Phase.ZERO_GRAD, 1, 11, 12),  # no optimizer event: SGD allocates nothing, the span is left out
        (Phase.FORWARD, 2, 12, 13), (Phase.LOSS, 2, 13, 14), (Phase.BACKWARD, 2, 14, 21),
        (Phase.ZERO_GRAD, 2, 21, 22)]
    # at the peak: input 12,800, output 6,400, mean's gradient 6,400, weight and its grad 2,048
    # each, the loss and the seed 4 each
    assert [a.nbytes for a in t.largest_at_peak] == [12_800, 6_400, 6_400, 2_048, 2_048, 4, 4]
    # the breakdown at the peak is the report's
    assert {c: int(t.by_category[t.peak_index, j]) for j, c in enumerate(t.categories)} == \
        {c: r.bytes.category(c) for c in Category}


# ---- invariants on real models -------------------------------------------------------------------


def _check_invariants(r: memcalc.MemoryReport, t: Timeline) -> None:
    n = t.num_events
    assert t.by_category.shape == (n, len(t.categories)) and t.reserved.shape == (n,)
    assert len(t.phase) == len(t.module) == len(t.op) == len(t.category) == len(t.is_alloc) == n
    # the peak is the report's, to the byte, at the report's event
    assert int(t.allocated.max()) == r.bytes.peak_allocated
    assert t.peak_index == int(np.argmax(t.allocated))
    assert t.phase[t.peak_index] is r.peak_phase and t.module[t.peak_index] == r.peak_module
    assert {c: int(t.by_category[t.peak_index, j]) for j, c in enumerate(t.categories)} == \
        {c: r.bytes.category(c) for c in Category}
    # requested bytes never exceed the allocator's blocks, blocks never exceed its segments
    assert (t.by_category.sum(axis=1) <= t.allocated).all()
    assert (t.by_category >= 0).all()
    assert (t.allocated <= t.reserved).all()
    # the allocator's actions add up to allocated and reserved after every event
    alloc_delta = np.zeros(n, dtype=np.int64)
    seg_delta = np.zeros(n, dtype=np.int64)
    sign = {"alloc": 1, "free_completed": -1, "segment_alloc": 1, "segment_free": -1}
    for e in t.allocator_events:
        (seg_delta if e.action.startswith("segment") else alloc_delta)[e.event] += sign[e.action] * e.size
    assert (np.cumsum(alloc_delta) == t.allocated).all()
    if r.capacity is None:
        assert (np.cumsum(seg_delta) == t.reserved).all()
    # phase spans: contiguous, covering every event, iteration 1 then 2, phases in step order
    spans = t.spans
    assert spans[0].start == 0 and spans[-1].end == n
    assert all(a.end == b.start for a, b in itertools.pairwise(spans)) and all(s.start < s.end for s in spans)
    assert [s.iteration for s in spans] == sorted(s.iteration for s in spans)
    assert {s.iteration for s in spans} == ({1, 2} if r.mode is Mode.TRAIN else {1})
    for iteration in (1, 2):
        phases = [s.phase for s in spans if s.iteration == iteration]
        assert phases == sorted(phases, key=_PHASE_ORDER.index)
    # the largest storages at the peak: at most ten, largest first, alive there
    largest = t.largest_at_peak
    assert 0 < len(largest) <= 10
    sizes = [a.nbytes for a in largest]
    assert sizes == sorted(sizes, reverse=True)
    alive: dict[int, int] = {}
    for e in t.allocator_events:
        if e.event > t.peak_index:
            break
        if e.action == "alloc":
            alive[e.address] = e.requested
        elif e.action == "free_completed":
            del alive[e.address]
    assert sorted(alive.values(), reverse=True)[: len(sizes)] == sizes
    for c in Category:  # and each category's share is within that category's bytes at the peak
        assert sum(a.nbytes for a in largest if a.category is c) <= r.bytes.category(c)


def test_resnet_invariants(resnet):
    t = resnet.timeline()
    _check_invariants(resnet, t)
    # the tracer names the op that made each storage
    first_conv = t.op.index("aten.convolution.default")
    assert t.phase[first_conv] is Phase.FORWARD and t.module[first_conv] == "conv1"
    assert t.module[t.op.index("aten.native_batch_norm.default")] == "bn1"
    assert all(op == "" for op, phase in zip(t.op, t.phase, strict=True) if phase is Phase.SETUP)
    # the workspaces are no op's output: labelled synthetic
    workspaces = {op for op in t.op if op.startswith("synthetic:")}
    assert "synthetic: cuBLAS workspace (forward handle)" in workspaces  # the cuBLAS handle of the forward thread
    assert any(op.startswith("synthetic: cuDNN convolution workspace") for op in workspaces)  # cuDNN's


def test_transformer_with_checkpointing_invariants(gpt2_checkpointed):
    t = gpt2_checkpointed.timeline()
    _check_invariants(gpt2_checkpointed, t)
    # checkpointing recomputes the blocks' forward during backward: their ops are born there
    recomputed = {m for m, p, op in zip(t.module, t.phase, t.op, strict=True)
                  if p is Phase.BACKWARD and op == "aten.addmm.default"}
    assert any(m.startswith("transformer.h.") for m in recomputed)


def test_micro_batches_repeat_forward_loss_backward():
    r = memcalc.estimate("fc-32-16", batch_size=100, optimizer="sgd", gpu="cpu", accum_steps=2)
    t = r.timeline()
    per_iteration = [s.phase for s in t.spans if s.iteration == 2]
    assert per_iteration == [Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.FORWARD, Phase.LOSS,
                             Phase.BACKWARD, Phase.ZERO_GRAD]
    assert int(t.allocated.max()) == r.bytes.peak_allocated


def test_kv_cache_is_labelled():
    # memcalc's own cache (a plain-torch model keeps none): allocated before the prefill
    r = memcalc.estimate("torch:gpt2", batch_size=1, seq_len=32, mode="inference", kv_cache=32)
    t = r.timeline()
    kv = t.category.index(Category.KV_CACHE)
    assert kv < t.spans[0].end and t.phase[kv] is Phase.SETUP
    assert t.op[kv] == "synthetic: KV cache" and int(t.series(Category.KV_CACHE)[-1]) == r.bytes.kv_cache > 0
    assert {s.iteration for s in t.spans} == {1}
    # a transformers model's own StaticCache: each layer allocates its keys and values at its first
    # update, in the forward; 12 layers · 768 · 2 (K, V) · 64 tokens · 4 B = 4,718,592 B, as before
    own = memcalc.estimate("gpt2", batch_size=1, seq_len=32, mode="inference", kv_cache=32)
    t = own.timeline()
    kv = t.category.index(Category.KV_CACHE)
    assert t.phase[kv] is Phase.FORWARD and t.op[kv] == "aten.zeros.default"
    assert t.category.count(Category.KV_CACHE) == 24
    assert int(t.series(Category.KV_CACHE)[-1]) == own.bytes.kv_cache == r.bytes.kv_cache == 12 * 768 * 2 * 64 * 4


# ---- capacity, roles, laziness ------------------------------------------------------------------


def test_reserved_under_a_capacity_is_the_reports():
    kw = {"batch_size": 8, "input_shape": (3, 64, 64), "optimizer": "adam"}
    free = memcalc.estimate("resnet18", **kw)
    assert free.peak_reserved > free.bytes.peak_allocated  # some cache to give back
    capacity = (free.bytes.peak_allocated + free.peak_reserved) // 2
    r = memcalc.estimate("resnet18", capacity=capacity, **kw)
    t = r.timeline()
    assert t.capacity == capacity
    assert r.peak_reserved < r.peak_reserved_unconstrained  # the allocator freed its cache
    assert int(t.reserved.max()) == r.peak_reserved
    assert int(t.allocated.max()) == r.bytes.peak_allocated == free.bytes.peak_allocated


def test_fsdp_timelines_per_role():
    r = memcalc.estimate("gpt2", batch_size=2, seq_len=64, distributed=memcalc.Distributed("fsdp", world_size=2))
    assert [role.name for role in r.roles] == ["every rank"]
    t = r.timeline()
    assert t.role == "every rank"
    _check_invariants(r, t)
    role = r.roles[0].report.timeline()
    assert role.role == "every rank" and role.peak_allocated == r.roles[0].peak_allocated
    # the all-gathered parameters come back in backward through a storage resize, no aten op
    assert "storage.resize_" in {op for op, p in zip(role.op, role.phase, strict=True) if p is Phase.BACKWARD}


def test_dataparallel_roles_have_their_own_timelines():
    r = memcalc.estimate("fc-32-16", batch_size=8, optimizer="adam", gpu="cpu",
                         distributed=memcalc.Distributed("dp", world_size=2))
    names = [role.name for role in r.roles]
    assert len(names) == 2
    timelines = [role.report.timeline() for role in r.roles]
    assert [t.role for t in timelines] == names
    assert [t.peak_allocated for t in timelines] == [role.peak_allocated for role in r.roles]
    assert r.timeline().role == r.busiest_role.name
    assert timelines[0].num_events != timelines[1].num_events  # only the output device steps the optimizer


def test_timeline_is_built_only_when_asked_and_once(monkeypatch):
    calls = []
    build = engine_run.build_timeline
    monkeypatch.setattr(engine_run, "build_timeline", lambda *a, **k: calls.append(1) or build(*a, **k))
    r = memcalc.estimate("fc-32-16", batch_size=10)
    assert calls == []
    first = r.timeline()
    assert calls == [1]
    assert r.timeline() is first and calls == [1]
    # replace() keeps the builder (the API adds notes that way)
    assert dataclasses.replace(r, notes=("x",)).timeline() is first


def test_report_equality_repr_and_json_unchanged():
    a = memcalc.estimate("fc-32-16", batch_size=10)
    b = memcalc.estimate("fc-32-16", batch_size=10)
    a.timeline()
    assert a == b and hash(a) == hash(b)
    assert "timeline" not in repr(a)
    assert a.to_dict() == b.to_dict() and "timeline" not in str(a.to_dict())


def test_report_made_by_hand_has_no_timeline(resnet):
    bare = dataclasses.replace(resnet, on_request=dataclasses.replace(resnet.on_request, timeline=None))
    with pytest.raises(ValueError, match="no step to replay"):
        bare.timeline()


def test_the_categories_a_report_keeps_are_the_traced_steps_codes(monkeypatch):
    """A report keeps its storages' categories as int64 codes (``CategoryColumn``, untracked by
    Python's collector), made with the list by ``final_categories`` piece by piece: read back,
    they are the list, its gradients and optimizer state (set after the pieces) included."""
    from memcalc.engine.timeline import CategoryColumn, category_codes, final_categories

    made: list[tuple[list[Category], np.ndarray]] = []

    def recording(*args):
        made.append(final_categories(*args))
        return made[-1]

    monkeypatch.setattr(engine_run, "final_categories", recording)
    r = memcalc.estimate("fc-32-16", batch_size=10, optimizer="adam", gpu="cpu")
    (categories, codes), = made
    kept = r.on_request.timeline._args[2]
    assert isinstance(kept, CategoryColumn) and kept.codes is codes and not gc.is_tracked(codes)
    assert {Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.PARAMETERS} <= set(categories)
    assert np.array_equal(codes, category_codes(categories)) and category_codes(kept) is codes
    assert list(kept) == categories and len(kept) == len(categories)
    assert [kept[u] for u in range(len(kept))] == categories and kept[2:7] == categories[2:7]

"""plan's memory bound from its traces (:mod:`memcalc.search.plan_peaks`) and the most sharded
sibling traced first: a traced peak, scaled to a smaller micro-batch, never exceeds what that
configuration's own trace allocates (nor those with less sharding or checkpointing), and the
search answers as tracing every configuration would where the bound rules some out."""

from __future__ import annotations

import json

import pytest

import memcalc
from memcalc.core.report import ByteBreakdown
from memcalc.distributed.collectives import DEFAULT_NETWORK
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.pipeline import PipelineOverCapacity
from memcalc.search import plan as planning
from memcalc.search.plan_peaks import Peaks, scaled_floor


def test_scaled_floor_by_hand():
    peak = ByteBreakdown(parameters=100, buffers=4, inputs=8, gradients=20, optimizer_state=40, activations=400,
                         workspace=32, peak_allocated=2048)
    # states whole, the batch's part (activations, inputs, workspace) by 2 / 4 of the traced micro-batch
    assert scaled_floor(peak, 4, 2) == 164 + 440 / 2
    peaks = Peaks()
    peaks.record(("kin",), 4, 1, 4, peak, "traced")
    assert peaks.floor(("kin",), 4, 1, 2) == (164 + 220, "traced")
    assert peaks.floor(("kin",), 2, 0, 1) == (164 + 110, "traced")  # less sharding, less checkpointing: still
    assert peaks.floor(("kin",), 8, 1, 2) == (0.0, "")  # more sharding: no bound
    assert peaks.floor(("kin",), 4, 2, 2) == (0.0, "")  # more checkpointing: no bound
    assert peaks.floor(("kin",), 4, 1, 8) == (0.0, "")  # a larger micro-batch: no bound
    assert peaks.floor(("other",), 4, 1, 1) == (0.0, "")


_MESHES = {"llama-tiny": [Mesh(dp_shard=2, tp=2), Mesh(dp_shard=4), Mesh(dp_replicate=2, dp_shard=2)],
           "gpt2": [Mesh(dp_shard=4), Mesh(dp_replicate=2, dp_shard=2)]}


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(_MESHES))
def test_a_traced_peak_scaled_to_a_smaller_micro_batch_never_exceeds_the_trace(model):
    """Every configuration with accumulation (two micro-batches traced) over 4 GPUs, each traced;
    the floor each gives its family's others with as much sharding or less, as much checkpointing
    or less and a micro-batch as large or smaller is at most their traced peak, and near it for the
    same mesh and checkpointing (the bound is not a token one)."""
    from memcalc.fields import build_step

    step = build_step(model, batch_size=1, seq_len=256, precision="amp-bf16", gpu="h100-80gb", time=True)
    facts = planning.model_facts(step)
    search = planning._Search(step, facts, DEFAULT_NETWORK, planning.CHECKPOINTS, None, sequence=256)
    configs = [c for c in planning._configs(search, _MESHES[model], 16, 1e15) if c.accum > 1]
    peaks = {c: search.report(c).bytes for c in configs}
    checked = scaled = 0
    for a in configs:
        for b in configs:
            if (a.family() != b.family() or b.mesh.dp_shard > a.mesh.dp_shard or b.ckpt > a.ckpt
                    or b.micro > a.micro):
                continue
            floor = scaled_floor(peaks[a], a.micro, b.micro)
            peak = peaks[b].peak_allocated
            assert floor <= peak, (a.describe(planning.CHECKPOINTS), b.describe(planning.CHECKPOINTS), floor, peak)
            checked += 1
            if a.mesh == b.mesh and a.ckpt == b.ckpt and b.micro < a.micro:
                assert floor >= 0.6 * peak, (a.describe(planning.CHECKPOINTS), b.micro, floor, peak)
                scaled += 1
    assert checked >= 20 and scaled >= 4, (checked, scaled)


@pytest.mark.slow
@pytest.mark.parametrize("logits", [False, True], ids=["peaks", "logits-bound"])
@pytest.mark.parametrize("gib", [2, 4])
def test_the_search_answers_as_tracing_every_configuration_would_where_peaks_rule_some_out(gib, logits, monkeypatch):
    """llama-tiny over 2 GPUs at 2,048 tokens in fp32, on a GPU of 2 or 4 GiB (many configurations do
    not fit): the search rules some out by a traced peak scaled down, and its rows are those of
    every configuration traced, with the same figures; those it names as not fitting do not fit."""
    from dataclasses import replace

    from memcalc.fields import build_step

    step = build_step("llama-tiny", batch_size=1, seq_len=2048, precision="fp32", gpu="t4", time=True)
    step = replace(step, capacity=gib * 2**30)
    facts = planning.model_facts(step)
    if not logits:  # the memory bound without the loss's logits (plan_bounds.logits_bytes), which rules out
        # before any trace what the scaled peaks rule out here: the peaks' check stays not vacuous
        monkeypatch.setattr(planning, "logits_bytes", lambda precision: None)
    result = planning.find_plan(step, 2, 32, facts, network=DEFAULT_NETWORK, top=5)
    ruled = [p for p in result.pruned if "scaled to its micro-batch; not traced" in p]
    assert ruled or logits, result.pruned  # the bound did rule some out: the check below is not vacuous
    # every configuration the bound without the logits leaves, traced: what the logits bound rules out among them
    # does not fit, or the rows would differ
    monkeypatch.setattr(planning, "logits_bytes", lambda precision: None)
    search = planning._Search(step, facts, DEFAULT_NETWORK, planning.CHECKPOINTS, None, sequence=2048)
    every: list[planning.PlanCandidate] = []
    unfit: set[str] = set()
    for config in planning._configs(search, list(result.meshes), 32, 1e15):
        try:
            candidate = planning._confirm(search, config)[0]
        except PipelineOverCapacity:  # a pipeline stopped at a rank that does not fit
            candidate = None
        except memcalc.MemcalcError:
            continue  # refused
        if candidate is None:
            unfit.add(config.describe(planning.CHECKPOINTS))
        else:
            every.append(candidate)
    every.sort(key=lambda c: c.seconds)
    for note in ruled:
        assert note.split(": does not fit")[0] in unfit, note
    assert [json.dumps(c.to_dict(result.network), sort_keys=True) for c in result.best] == [
        json.dumps(c.to_dict(result.network), sort_keys=True) for c in every[:len(result.best)]]

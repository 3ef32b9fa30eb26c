"""``memcalc plan`` (:mod:`memcalc.search.plan`, :mod:`memcalc.distributed.collectives`): the
collective bytes worked out by hand, the ranking's sanity (what does not fit is never listed;
more GPUs per node is never slower), the JSON shape and a golden CLI output."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import memcalc
from memcalc.cli.commands import main
from memcalc.distributed.collectives import Collective, ModelFacts, Network, group_span
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.strategy.base import DIMENSIONS
from memcalc.search.plan import PlanResult, collectives_of, meshes_over

P = 1_000_000  # parameters of a hand-worked model
FP32 = ModelFacts(parameters=P, trainable=P, gather_bytes=4, reduce_bytes=4, layers=4, heads=8, kv_heads=8)
AMP = ModelFacts(parameters=P, trainable=P, gather_bytes=2, reduce_bytes=4, layers=4, heads=8, kv_heads=8)


def _by_what(collectives: tuple[Collective, ...]) -> dict[str, Collective]:
    return {c.what: c for c in collectives}


def test_fsdp_over_8_ranks_fp32_bytes_by_hand():
    # FULL_SHARD over n = 8: all-gather forward + backward, 2 × P × 4 bytes × 7/8 received;
    # reduce-scatter of the fp32 gradients: P × 4 × 7/8.
    got = _by_what(collectives_of(Mesh(dp_shard=8), FP32, 1))
    assert got["all-gather of parameters (forward and backward)"].received == 2 * P * 4 * 7 / 8 == 7_000_000
    assert got["reduce-scatter of gradients"].received == P * 4 * 7 / 8 == 3_500_000
    assert {c.span for c in got.values()} == {8}


def test_fsdp_amp_gathers_bf16_reduces_fp32_every_micro_batch():
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over 4 ranks, 3 micro-batches:
    # all-gather 3 × 2 × P × 2 × 3/4 = 9 P; reduce-scatter 3 × P × 4 × 3/4 = 9 P.
    got = _by_what(collectives_of(Mesh(dp_shard=4), AMP, 3))
    assert got["all-gather of parameters (forward and backward)"].received == 9 * P
    assert got["all-gather of parameters (forward and backward)"].count == 6
    assert got["reduce-scatter of gradients"].received == 9 * P


def test_ddp_all_reduce_bytes_by_hand():
    # ring all-reduce over 8 replicas: reduce-scatter then all-gather, 2 × P × 4 × 7/8.
    (ddp,) = collectives_of(Mesh(dp_replicate=8), FP32, 1)
    assert ddp.received == 2 * P * 4 * 7 / 8 == 7_000_000
    assert ddp.span == 8


def test_hsdp_all_reduces_each_replica_shard_across_nodes():
    # HSDP 4 × 8 on 32 GPUs, nodes of 8: dp_shard spans GPUs 0-7 (within a node); dp_replicate
    # groups stride 8 and span 32 GPUs (between nodes). Each all-reduces its shard P × 4 / 8
    # over 4 replicas: 2 × (P / 2) × 3/4 = 0.75 P bytes.
    mesh = Mesh(dp_replicate=4, dp_shard=8)
    assert group_span(mesh, "dp_shard") == 8 and group_span(mesh, "dp_replicate") == 32
    got = {c.dimension: c for c in collectives_of(mesh, FP32, 1) if "all-reduce" in c.what}
    assert got["dp_replicate"].received == 2 * (P * 4 / 8) * 3 / 4 == 750_000
    network = Network(gpus_per_node=8, intra_node_gbps=400, inter_node_gbps=40)
    assert got["dp_replicate"].seconds(network) == 750_000 / 40e9


def test_bandwidth_follows_the_node():
    network = Network(gpus_per_node=8, intra_node_gbps=450, inter_node_gbps=50)
    assert network.bandwidth(8) == 450e9 and network.bandwidth(16) == 50e9


def test_meshes_come_from_the_registry():
    # today's modelled dimensions: dp_replicate × dp_shard = 8 (1×8, 2×4, 4×2, 8×1)
    assert set(DIMENSIONS) >= {"dp_replicate", "dp_shard"}
    meshes = meshes_over(8, FP32)
    assert all(m.world_size == 8 for m in meshes)
    assert all(name in DIMENSIONS for m in meshes for name in m.used)
    if set(DIMENSIONS) == {"dp_replicate", "dp_shard"}:
        assert sorted((m.dp_replicate, m.dp_shard) for m in meshes) == [(1, 8), (2, 4), (4, 2), (8, 1)]


def test_bad_network_is_refused():
    with pytest.raises(memcalc.InvalidInputError, match="bandwidth"):
        memcalc.plan("llama-tiny", gpus=2, gpu="h100-80gb", global_batch=2, seq_len=64, inter_node_gbps=0)


@pytest.fixture(scope="module")
def tight_plan() -> PlanResult:
    """llama-tiny on two T4s at 2,048 tokens: some configurations do not fit."""
    return memcalc.plan("llama-tiny", gpus=2, gpu="t4", global_batch=32, seq_len=2048, precision="fp32", top=20)


@pytest.mark.slow
def test_plan_lists_only_what_fits_fastest_first(tight_plan):
    best = tight_plan.best
    assert best, tight_plan.pruned
    assert all(c.report.fits for c in best)
    assert [c.seconds for c in best] == sorted(c.seconds for c in best)
    for c in best:
        assert c.micro_batch * c.accum_steps * c.mesh.dp_replicate * c.mesh.dp_shard == 32
        assert c.seconds >= max(c.compute_seconds, c.comm_seconds)
    assert tight_plan.pruned  # what did not fit is named, not listed


@pytest.mark.slow
def test_plan_json_shape(tight_plan):
    data = json.loads(json.dumps(tight_plan.to_dict()))
    assert set(data) == {"gpus", "global_batch", "network", "dimensions_searched", "dimensions_not_searched",
                         "meshes", "configurations", "estimates", "pruned", "assumptions", "best"}
    assert data["network"] == {"gpus_per_node": 8, "intra_node_gbps": 450.0, "inter_node_gbps": 50.0}
    row = data["best"][0]
    assert set(row) == {"mesh", "micro_batch", "accum_steps", "checkpoint", "peak_allocated", "peak_reserved",
                        "capacity", "headroom", "step_seconds", "compute_seconds", "communication_seconds",
                        "exposed_communication_seconds", "tokens_per_second", "collectives"}
    assert row["headroom"] == row["capacity"] - row["peak_allocated"] > 0
    # every dimension whose communication is in plan's cost model (planned), and only those
    assert set(data["dimensions_searched"]) == {name for name, cls in DIMENSIONS.items() if cls.planned}
    assert {"dp_shard", "dp_replicate"} <= set(data["dimensions_searched"])
    assert set(data["dimensions_not_searched"]) == {"dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"} - set(
        data["dimensions_searched"])


@pytest.mark.slow
def test_more_gpus_per_node_is_never_slower():
    one = memcalc.plan("llama-tiny", gpus=16, gpu="h100-80gb", global_batch=16, seq_len=128, gpus_per_node=4)
    two = memcalc.plan("llama-tiny", gpus=16, gpu="h100-80gb", global_batch=16, seq_len=128, gpus_per_node=16)
    assert two.best[0].seconds <= one.best[0].seconds
    for a in one.best:
        for b in two.best:
            if (a.mesh, a.micro_batch, a.checkpoint) == (b.mesh, b.micro_batch, b.checkpoint):
                assert b.comm_seconds <= a.comm_seconds


@pytest.mark.slow
def test_plan_gpt2_on_8_gpus_cli(golden):
    result = CliRunner().invoke(main, ["plan", "gpt2", "--gpus", "8", "--gpu", "h100-80gb", "--global-batch", "32",
                                       "--seq-len", "1024"])
    assert result.exit_code == 0, result.output
    golden(result.output)


def test_plan_cli_json_and_usage():
    runner = CliRunner()
    # the zoo's mlp has no blocks to checkpoint: plan says so and searches without
    result = runner.invoke(main, ["plan", "mlp", "--gpus", "2", "--gpu", "h100-80gb", "--global-batch", "4",
                                  "--top", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["best"]) == 2 and {row["checkpoint"] for row in data["best"]} == {"off"}
    assert [p.split(":")[0] for p in data["pruned"]] == ["checkpointing full", "checkpointing selective-op"]
    assert data["meshes"] == ["dp_shard=2", "dp_replicate=2"] or set(DIMENSIONS) != {"dp_replicate", "dp_shard"}
    missing = runner.invoke(main, ["plan", "llama-tiny", "--gpu", "h100-80gb", "--global-batch", "4"])
    assert missing.exit_code == 2 and "--gpus" in missing.output
    uneven = runner.invoke(main, ["plan", "llama-tiny", "--gpus", "4", "--gpu", "h100-80gb", "--global-batch", "3",
                                  "--seq-len", "64"])
    assert uneven.exit_code == 2 and "splits a global batch of 3" in uneven.output


@pytest.mark.slow
def test_nothing_fits_exits_1_naming_what_was_pruned():
    # gpt2-xl in fp32 with Adam holds 16 bytes × 1.56e9 parameters = 25 GB on one 14.6 GiB T4: not even
    # full checkpointing at micro-batch 1 fits, and so nothing less checkpointed is estimated
    result = CliRunner().invoke(main, ["plan", "gpt2-xl", "--gpus", "1", "--gpu", "t4", "--global-batch", "1",
                                       "--seq-len", "128", "--precision", "fp32"])
    assert result.exit_code == 1, result.output
    assert "Nothing fits" in result.output
    assert "checkpointing full: not even micro-batch 1 fits" in result.output
    assert "checkpointing off: not estimated" in result.output


def test_a_registered_dimension_is_searched_with_its_degrees(monkeypatch):
    # a stand-in dimension, registered as a new dimension's file registers it (in ep's place: ep's
    # own file is not searched by plan, planned=False): plan then searches its degrees (here:
    # the divisors of the heads and KV heads, 8, that are ≤ 4), and a mesh the strategies refuse
    # (dp_replicate with ep, not modelled together) is named, not estimated
    from memcalc.distributed.strategy.base import Plan, RankStrategy, every_rank, register
    from memcalc.fields import build_step
    from memcalc.search import plan as planning

    monkeypatch.delitem(DIMENSIONS, "ep")  # put back after the test

    @register()
    class StandIn(RankStrategy):
        name = "ep"
        mesh_dimension = "ep"

        @classmethod
        def plan_degrees(cls, facts: ModelFacts, gpus: int) -> tuple[int, ...]:
            return tuple(d for d in (1, 2, 4) if gpus % d == 0 and facts.heads is not None and facts.heads % d == 0)

        def plan(self, plan: Plan, step) -> Plan:
            return every_rank(plan, self.distributed)

    try:
        meshes = meshes_over(8, FP32)
        assert {m.ep for m in meshes} == {1, 2, 4}
        assert Mesh(dp_shard=2, ep=4) in meshes and all(m.world_size == 8 for m in meshes)
        step = build_step("mlp", batch_size=1)
        why = planning._refusal(step, Mesh(dp_replicate=2, ep=4))
        assert why is not None and "not modelled" in why
        assert planning._refusal(step, Mesh(dp_shard=8)) is None
    finally:
        del DIMENSIONS["ep"]


@pytest.mark.slow
def test_the_most_sharded_compute_bounds_the_others_from_below():
    # plan orders candidates by the most-sharded mesh's compute: a less sharded rank steps its optimizer
    # over more parameters (and DDP autocasts its fp32 replica), so its traced time is never less
    seconds = []
    for mesh in ({"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2}, {"dp_replicate": 4}):
        report = memcalc.estimate("llama-tiny", batch_size=2, seq_len=128, precision="amp-bf16", gpu="h100-80gb",
                                  distributed=memcalc.Distributed(**mesh), time=True)
        assert report.time is not None
        seconds.append(report.time.seconds)
    assert seconds == sorted(seconds), seconds

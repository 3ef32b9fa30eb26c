"""The device mesh (memcalc.distributed.mesh) and the strategy objects behind it
(memcalc.distributed.strategy): a mesh of one data-parallel dimension is the shorthand it
stands for, to the byte; degrees are checked by name; dimensions not modelled yet are refused by
name; HSDP holds per rank what its dp_shard group alone holds; the per-rank table and JSON say
which dimension shards what."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from dataclasses import replace
from typing import ClassVar

import pytest
from click.testing import CliRunner
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.mesh import MAX_WORLD_SIZE, Mesh, parse_mesh
from memcalc.distributed.setting import Distributed, Strategy
from memcalc.distributed.strategy.base import Plan, RankStrategy, every_rank, register
from memcalc.distributed.strategy.catalogue import APPLICATION_ORDER, dimensions, shorthands, strategies_for
from memcalc.distributed.strategy.dp_shard import DpShard
from memcalc.engine.step_spec import Step

MiB = 2**20
# two Linear(1024, 1024, bias=False): Ψ = 2,097,152 parameters, 8 MiB in fp32; batch 1 of 1024 features
PSI = 2 * 1024 * 1024
INPUT = 1024 * 4
#: The registries, every strategy file imported (the dicts themselves: tests change them).
DIMENSIONS, SHORTHANDS = dimensions(), shorthands()


def two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))


def _two(distributed: Distributed) -> memcalc.MemoryReport:
    # gpu="cpu": no cuBLAS workspace; Adam foreach, as tests/test_strategies.py's hand-worked figures
    return memcalc.estimate(two_layers, input_shape=(1024,), batch_size=1, loss="mean", gpu="cpu", optimizer="adam",
                            loop=memcalc.Loop(optimizer_impl="foreach"), distributed=distributed)


# ============================================================================================
# One dimension of a mesh is its shorthand
# ============================================================================================


def test_dp_shard_mesh_by_hand_is_the_fsdp_shorthand(without_gloo_copies):
    # FSDP2 FULL_SHARD over dp_shard=4, Adam, fp32. Per rank, at the optimizer step:
    #   parameters Ψ/4 × 4 B = 2 MiB; gradients Ψ/4 × 4 B = 2 MiB; Adam's two moments 2 × 2 MiB = 4 MiB
    #   model states = 16 B × Ψ / 4 = 8 MiB
    # At the peak (unit 1's reduce-scatter in backward, tests/test_strategies.py works it out):
    #   parameters 2 MiB (the shards), gradients 4 (unit 1 unsharded) + 1 (its shard) = 5 MiB,
    #   Adam 4 MiB.
    mesh = _two(Distributed(dp_shard=4))
    shorthand = _two(Distributed("fsdp", world_size=4))
    (role,) = mesh.roles
    b = role.bytes
    assert (b.parameters, b.gradients, b.optimizer_state) == (2 * MiB, 5 * MiB, 4 * MiB)
    assert role.model_states == 16 * PSI // 4 == 8 * MiB
    assert mesh.peak_requested == 19 * MiB + 3 * INPUT + 8 == 19_935_240
    assert mesh.to_dict() == shorthand.to_dict()  # the same report, key for key
    assert mesh.notes == shorthand.notes
    data = mesh.to_dict()
    assert data["strategy"] == "fsdp" and data["world_size"] == 4
    assert data["mesh"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    assert data["roles"][0]["sharding"] == [
        {"states": ["parameters", "gradients", "optimizer_state", "batch"], "dimension": "dp_shard", "degree": 4}]


def test_dp_replicate_mesh_by_hand_is_the_ddp_shorthand():
    # DDP over dp_replicate=2: every rank the whole model: parameters 8 MiB, gradients 8 MiB, Adam 16 MiB
    #   model states = 16 B × Ψ = 32 MiB, the same on every rank whatever the degree
    mesh = _two(Distributed(dp_replicate=2))
    (role,) = mesh.roles
    assert role.model_states == 16 * PSI == 32 * MiB
    assert (role.bytes.parameters, role.bytes.optimizer_state) == (8 * MiB, 16 * MiB)
    assert mesh.to_dict() == _two(Distributed("ddp", world_size=2)).to_dict()
    assert mesh.to_dict()["roles"][0]["sharding"] == [{"states": ["batch"], "dimension": "dp_replicate", "degree": 2}]


def test_zero_roles_say_what_each_stage_partitions_and_dp_says_nothing():
    zero2 = memcalc.estimate("mlp", batch_size=2, distributed=Distributed("zero2", world_size=2,
                                                                          reduce_bucket_size=1024)).to_dict()
    assert "mesh" not in zero2  # DeepSpeed's flat group, not a torch device mesh
    assert zero2["roles"][0]["sharding"] == [
        {"states": ["gradients", "optimizer_state", "batch"], "dimension": "zero2", "degree": 2}]
    dp = memcalc.estimate("mlp", batch_size=2, distributed=Distributed("dp", world_size=2)).to_dict()
    assert "mesh" not in dp and all("sharding" not in role for role in dp["roles"])  # one process, no ranks


# ============================================================================================
# The setting: degrees, shorthands, consistency
# ============================================================================================


def test_shorthands_are_meshes_of_one_dimension():
    assert Distributed(dp_shard=8) == Distributed("fsdp", world_size=8) == Distributed(mesh={"dp_shard": 8})
    assert Distributed(dp_replicate=4) == Distributed("ddp", world_size=4)
    assert Distributed(dp_shard=1, tp=1) == Distributed()  # every degree 1: one GPU
    assert Distributed("fsdp", world_size=8, dp_shard=8) == Distributed(dp_shard=8)  # consistent: accepted
    assert Distributed("zero3", world_size=8).mesh is None and Distributed("dp", world_size=2).mesh is None


@pytest.mark.parametrize("distributed", [
    Distributed(), Distributed("ddp", world_size=1), Distributed("ddp", world_size=4, bucket_cap_mb=5),
    Distributed("fsdp", world_size=2, sharding="shard_grad_op"), Distributed("dp", device_ids=[1, 3]),
    Distributed("zero3", world_size=8, reduce_bucket_size=1024), Distributed(dp_shard=2, tp=2, pp=2),
    Distributed(dp_replicate=2, dp_shard=4, batch_is_global=True),
], ids=lambda d: f"{d.strategy.value}-{d.world_size}")
def test_replace_gives_the_setting_back(distributed):
    assert dataclasses.replace(distributed) == distributed


def test_the_world_size_is_the_product_of_the_degrees():
    d = Distributed(dp_shard=8, tp=4, pp=2)
    assert d.strategy is Strategy.MESH and d.world_size == 8 * 4 * 2 == 64
    assert d.data_parallel_size == 8  # the global batch splits over dp_replicate × dp_shard only
    assert d.mesh == Mesh(dp_shard=8, tp=4, pp=2) and d.mesh.describe() == "dp_shard=8,tp=4,pp=2"
    assert Distributed(dp_shard=8, tp=4, batch_is_global=True).per_rank_batch(32) == 4
    with pytest.raises(InvalidInputError, match="does not split evenly over 8 data-parallel ranks"):
        Distributed(dp_shard=8, tp=4, batch_is_global=True).per_rank_batch(12)
    assert Distributed(dp_shard=4, tp=2).sharding.value == "full_shard"
    assert Distributed(dp_shard=4, tp=2, sharding="shard_grad_op").sharding.value == "shard_grad_op"


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_shard=0), r"dp_shard=0 is not a number of GPUs"),
    (dict(tp=-2), r"tp=-2 is not a number of GPUs"),
    (dict(pp=2.0), r"pp=2.0 is not a number of GPUs"),
    (dict(cp="2"), r"cp='2' is not a number of GPUs"),
    (dict(ep=True), r"ep=True is not a number of GPUs"),
    (dict(dp_shard=MAX_WORLD_SIZE, tp=2), r"spans 2,097,152 GPUs, more than 1,048,576"),
    (dict(mesh={"dp": 2}), r"unknown mesh dimension 'dp'"),
    (dict(mesh={"dp_shard": 2}, dp_shard=2), r"either as keywords .* or as mesh="),
    (dict(strategy="ddp", dp_shard=4), r"--strategy ddp is the mesh dimension dp_replicate, which the mesh "
                                       r"dp_shard=4 does not use"),
    (dict(strategy="zero2", dp_shard=4), r"--strategy zero2 is not a device mesh dimension"),
    (dict(strategy="dp", dp_shard=4), r"--strategy dp is not a device mesh dimension"),
    (dict(dp_shard=4, world_size=8), r"--world-size 8 disagrees with the mesh dp_shard=4 \(4 GPUs"),
    (dict(strategy="mesh"), r"a mesh is given by its degrees"),
    (dict(dp_shard=2, device_ids=[0, 1]), r"device ids go with --strategy dp"),
])
def test_bad_meshes_are_refused_by_name(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        Distributed(**kwargs)


def test_an_option_of_a_dimension_not_in_the_mesh_is_refused():
    with pytest.raises(InapplicableOptionError, match=r"bucket_cap_mb \(--bucket-cap-mb\) applies only to strategy "
                                                      r"ddp \(the mesh dimension dp_replicate\); with the mesh "
                                                      r"dp_shard=2,tp=2 it would be ignored"):
        Distributed(dp_shard=2, tp=2, bucket_cap_mb=10)
    with pytest.raises(InapplicableOptionError, match=r"sharding .* applies only to strategy fsdp"):
        Distributed(dp_replicate=2, sharding="shard_grad_op")
    assert Distributed(dp_replicate=2, bucket_cap_mb=10).bucket_cap_mb == 10  # dp_replicate reads it


@pytest.mark.parametrize("text, degrees", [
    ("dp_shard=8", {"dp_shard": 8}),
    ("dp_shard=8,tp=4,pp=2", {"dp_shard": 8, "tp": 4, "pp": 2}),
    (" dp_replicate = 2 , cp=1 ", {"dp_replicate": 2, "cp": 1}),
])
def test_parse_mesh(text, degrees):
    assert parse_mesh(text) == degrees


@pytest.mark.parametrize("text, message", [
    ("", "the mesh is empty"),
    ("dp_shard", r"the mesh item 'dp_shard' is not DIMENSION=DEGREE"),
    ("=4", r"the mesh item '=4' is not DIMENSION=DEGREE"),
    ("dp_shards=4", r"unknown mesh dimension 'dp_shards'"),
    ("dp_shard=4,dp_shard=2", r"the mesh names dp_shard twice"),
    ("tp=four", r"tp='four' is not a number of GPUs"),
    ("tp=-1", r"tp='-1' is not a number of GPUs"),
    ("tp=0", r"tp=0 is not a number of GPUs"),
    ("tp=2048,pp=1024", r"spans|more than"),
])
def test_parse_mesh_refuses_by_name(text, message):
    with pytest.raises(InvalidInputError, match=message):
        Mesh.of(parse_mesh(text))


def test_a_close_dimension_name_is_suggested():
    with pytest.raises(InvalidInputError) as caught:
        parse_mesh("dp_shrad=2")
    assert "did you mean dp_shard?" in str(caught.value)


# ============================================================================================
# Dimensions not modelled yet, HSDP
# ============================================================================================


@pytest.mark.parametrize("dimension, what", [("tp", "tensor parallelism"), ("pp", "pipeline parallelism"),
                                             ("cp", "context parallelism"), ("ep", "expert parallelism")])
def test_a_dimension_without_its_file_is_refused_by_name(dimension, what, monkeypatch):
    # every dimension has its file now: take it out of the registry, as a dimension without one would be
    monkeypatch.delitem(DIMENSIONS, dimension)
    distributed = Distributed(dp_shard=2, **{dimension: 2})  # accepted as a setting
    with pytest.raises(InapplicableOptionError, match=rf"{dimension}=2 \({what}\) is not modelled yet"):
        memcalc.estimate("mlp", batch_size=2, distributed=distributed)


def test_hsdp_holds_per_rank_what_dp_shard_alone_holds(without_gloo_copies):
    # HSDP (dp_replicate=2 × dp_shard=2): sharded over the two ranks of a row, the reduce-scatter
    # output all-reduced across the rows in place (tests/test_gloo_runs.py checks it against a real
    # 4-process run). Per rank, two_layers, Adam, fp32: parameters Ψ/2 × 4 B = 4 MiB, gradients
    # 4 MiB, Adam 8 MiB: model states 16 B × Ψ / 2 = 16 MiB (dp_shard=4 would give 8 MiB)
    hsdp = _two(Distributed(dp_replicate=2, dp_shard=2))
    (role,) = hsdp.roles
    assert role.model_states == 16 * PSI // 2 == 16 * MiB
    assert role.bytes.parameters == 4 * MiB and role.ranks == (0, 1, 2, 3)
    alone = _two(Distributed(dp_shard=2))
    assert hsdp.peak_requested == alone.peak_requested and hsdp.bytes == alone.bytes
    data = hsdp.to_dict()
    assert (data["strategy"], data["world_size"], data["global_batch_size"]) == ("mesh", 4, 4)  # batch 1 per rank
    assert data["roles"][0]["sharding"] == [
        {"states": ["parameters", "gradients", "optimizer_state", "batch"], "dimension": "dp_shard", "degree": 2},
        {"states": ["batch"], "dimension": "dp_replicate", "degree": 2}]
    assert any(note.startswith("HSDP: 2 replicas") for note in hsdp.notes)


def test_hsdp_refuses_ddps_bucket_options():
    with pytest.raises(InapplicableOptionError, match="bucket_cap_mb and gradient_as_bucket_view are DDP's"):
        memcalc.estimate("mlp", batch_size=2, distributed=Distributed(dp_replicate=2, dp_shard=2, bucket_cap_mb=5))


# ============================================================================================
# The seam: a new dimension is one registered class
# ============================================================================================


def test_every_dimension_file_registers_and_the_order_covers_every_dimension():
    assert set(DIMENSIONS) >= {"dp_replicate", "dp_shard"}
    assert sorted(APPLICATION_ORDER) == sorted(Mesh().degrees)
    with pytest.raises(ValueError, match="already DpShard"):
        register()(type("Again", (DpShard,), {}))


def test_every_file_of_the_strategy_package_registers_a_strategy():
    # the catalogue imports every module of the package: a new dimension is one file, found there
    package = importlib.import_module("memcalc.distributed.strategy")
    registered = {cls.__module__ for cls in (*SHORTHANDS.values(), *DIMENSIONS.values())}
    files = {f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)} - {
        f"{package.__name__}.base", f"{package.__name__}.catalogue"}
    assert files == registered
    assert set(SHORTHANDS) == {s for s in Strategy if s.is_shorthand and s is not Strategy.SINGLE}


def test_a_registered_dimension_composes_with_dp_shard(monkeypatch):
    # a stand-in for a tensor-parallel file: it renames every role and adds a note; dp_shard,
    # applied after it (torchtitan's order), wraps each role in FSDP2 as it would alone
    class StandIn(RankStrategy):
        name: ClassVar[str] = "tp"
        mesh_dimension: ClassVar[str | None] = "tp"

        def plan(self, plan: Plan, step: Step) -> Plan:
            plan = every_rank(plan, self.distributed)
            roles = tuple(replace(role, name="tp rank") for role in plan.roles)
            return replace(plan, roles=roles, notes=(*plan.notes, "stand-in"))

    monkeypatch.setitem(DIMENSIONS, "tp", StandIn)
    distributed = Distributed(dp_shard=2, tp=2)
    assert [type(s).__name__ for s in strategies_for(distributed)] == ["StandIn", "DpShard"]
    r = memcalc.estimate("mlp", batch_size=2, distributed=distributed)
    assert [role.name for role in r.roles] == ["tp rank"] and r.roles[0].ranks == (0, 1, 2, 3)
    assert "stand-in" in r.notes and r.to_dict()["strategy"] == "mesh" and r.world_size == 4
    assert r.roles[0].sharding is not None and [s.dimension for s in r.roles[0].sharding] == ["dp_shard"]


# ============================================================================================
# The command line
# ============================================================================================


def test_cli_mesh_dp_shard_is_the_fsdp_shorthand(golden):
    common = ["mlp", "--depth", "0", "--gpu", "a100-40gb"]
    result = CliRunner().invoke(main, [*common, "--mesh", "dp_shard=4"])
    assert result.exit_code == 0, result.output
    golden(result.output)  # the per-rank table: params, grads, optimizer, batch /4 (dp_shard)
    shorthand = CliRunner().invoke(main, [*common, "--strategy", "fsdp", "--world-size", "4"])
    assert shorthand.output == result.output
    data = json.loads(CliRunner().invoke(main, [*common, "--mesh", "dp_shard=4", "--format", "json"]).output)
    assert data["mesh"]["dp_shard"] == 4 and data["roles"][0]["sharding"][0]["dimension"] == "dp_shard"


@pytest.mark.parametrize("args", [
    pytest.param(["--mesh", "dp=4"], id="unknown_dimension"),
    pytest.param(["--mesh", "tp=x"], id="degree_not_a_number"),
    pytest.param(["--mesh", "dp_shard=2,dp_shard=2"], id="dimension_twice"),
    pytest.param(["--mesh", "dp_shard=4", "--strategy", "ddp"], id="strategy_not_in_the_mesh"),
    pytest.param(["--mesh", "dp_shard=4", "--strategy", "zero1"], id="strategy_not_a_mesh"),
    pytest.param(["--mesh", "dp_shard=4", "--world-size", "2"], id="world_size_disagrees"),
    pytest.param(["--mesh", "dp_shard=4", "--bucket-cap-mb", "10"], id="option_of_another_dimension"),
    pytest.param(["--mesh", "dp_shard=2", "--measure"], id="measure_a_mesh"),
])
def test_cli_mesh_usage_error(args, golden):
    result = CliRunner().invoke(main, ["mlp", *args])
    assert result.exit_code == 2, result.output
    golden(result.output)


def test_cli_mesh_with_its_own_strategy():
    ok = CliRunner().invoke(main, ["mlp", "--mesh", "dp_shard=2", "--strategy", "fsdp", "--fsdp-sharding",
                                   "shard_grad_op", "--format", "json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["strategy"] == "fsdp"


def test_cli_mesh_unmodelled_dimension(golden):
    refused = CliRunner().invoke(main, ["mlp", "--mesh", "dp_replicate=2,dp_shard=2,tp=2,cp=2,ep=2"])
    assert refused.exit_code == InapplicableOptionError.exit_code, refused.output
    golden(refused.output)  # tp=2 with ep=2, cp=2 and dp_replicate=2, dp_shard=2 is not modelled yet, and what to do


def test_an_older_torch_is_refused_by_name(monkeypatch):
    # memcalc drives torch.distributed.pipelining's internals as torch 2.13 has them (its stages'
    # shape vote, _initialize_stage's signature); torch 2.11's differ, so pp is refused there
    from memcalc.distributed import pipeline

    monkeypatch.setattr(pipeline, "_torch_release", lambda: (2, 11))
    with pytest.raises(InapplicableOptionError, match="older PipelineStage"):
        memcalc.estimate("torch:llama-tiny", batch_size=2, seq_len=32, gpu="cpu", distributed=Distributed(pp=2))


def test_ep_without_transformers_expert_parallelism_is_refused_by_name(monkeypatch) -> None:
    # ep runs transformers' own apply_expert_parallelism; where the installed transformers has none
    # (5.17, the oldest matrix leg), the estimate says so by name before it builds anything
    from memcalc.distributed.strategy import ep

    monkeypatch.setattr(ep, "expert_parallelism_available", lambda: False)
    with pytest.raises(InapplicableOptionError, match=r"transformers\.distributed\.expert_parallel"):
        memcalc.estimate("mlp", batch_size=2, distributed=memcalc.Distributed(ep=2))

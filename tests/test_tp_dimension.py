"""The mesh's ``tp`` dimension (memcalc/distributed/strategy/tp.py): ``Distributed(tp=N, tp_plan=...)``
and ``--mesh tp=N --tp-plan ...``. Per-rank bytes worked out by hand, even and uneven splits (one
role, or rank 0 and the last rank), the refusals by name, and the optimizer stepped on the local
shards allocating what stepping the DTensors allocates. The per-rank comparison with real gloo
runs is tests/test_gloo_tp.py (the same rank program)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from gloo_tp import small_llama
from torch import nn
from torch.distributed.tensor import DTensor

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed import tensor_parallel
from memcalc.distributed.tensor_parallel import TensorParallel
from memcalc.engine.run import build_report
from memcalc.fields import build_step
from memcalc.targets.backend import trace_step

#: The zoo's mlp: Flatten, Linear(784, 1024), ReLU, Linear(1024, 1024), ReLU, Linear(1024, 10).
MLP_PLAN = {"1": "colwise", "3": "rowwise", "5": "colwise_rep"}
FOREACH = memcalc.Loop(optimizer_impl="foreach")


def _mlp(distributed: memcalc.Distributed, **kw: object) -> memcalc.MemoryReport:
    return memcalc.estimate("mlp", batch_size=8, gpu="cpu", optimizer="adam", loop=FOREACH, distributed=distributed,
                            **kw)


def test_mlp_tp2_holds_its_shards_worked_by_hand():
    report = _mlp(memcalc.Distributed(tp=2, tp_plan=MLP_PLAN))
    (role,) = report.roles  # an even split: one trace for both ranks
    assert role.name == "every rank" and role.ranks == (0, 1)
    # colwise 1: rows of weight and bias halved, 512 × 784 + 512 = 401,920;
    # rowwise 3: columns halved, 1024 × 512 = 524,288, its bias whole, 1,024 → 525,312;
    # colwise_rep 5: 5 × 1024 + 5 = 5,125. Σ 932,357 elements × 4 B = 3,729,428 B
    assert role.report.bytes.parameters == (512 * 784 + 512 + 1024 * 512 + 1024 + 5 * 1024 + 5) * 4 == 3_729_428
    # Adam: two moments of each local shard; the model states: 4 copies of the shards
    assert role.report.bytes.optimizer_state == 2 * 3_729_428
    assert role.model_states == 4 * 3_729_428
    assert [s.describe() for s in role.sharding] == ["params, grads, optimizer /2 (tp)"]
    data = report.to_dict()
    assert data["strategy"] == "mesh" and data["world_size"] == 2 and data["mesh"]["tp"] == 2
    assert data["global_batch_size"] == 8  # every tp rank runs the same batch


def _uneven() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 66), nn.ReLU(), nn.Linear(66, 64))


def test_an_uneven_split_traces_rank_0_and_the_last_rank():
    # 66 over 4 ranks, torch.chunk: 17, 17, 17, 15 (colwise then rowwise with sharded activations
    # between them fails in torch itself: DTensor.from_local takes the local 17 for an even split)
    report = memcalc.estimate(_uneven, input_shape=(64,), batch_size=4, gpu="cpu", optimizer="adam", loss="mean",
                              distributed=memcalc.Distributed(tp=4, tp_plan={"0": "colwise_rep", "2": "rowwise_rep"}))
    first, last = report.roles
    assert (first.name, first.ranks) == ("every rank, tp rank 0", (0, 1, 2))
    assert (last.name, last.ranks) == ("every rank, tp rank 3", (3,))
    # rank 0: colwise 17 × 64 + 17 = 1,105; rowwise 64 × 17 + 64 (bias whole) = 1,152 → 2,257 × 4 B
    # rank 3: 15 × 64 + 15 = 975; 64 × 15 + 64 = 1,024 → 1,999 × 4 B
    assert first.report.bytes.parameters == (17 * 64 + 17 + 64 * 17 + 64) * 4 == 9_028
    assert last.report.bytes.parameters == (15 * 64 + 15 + 64 * 15 + 64) * 4 == 7_996
    assert any("tp ranks 1 to 2 hold at most rank 0's shards" in note for note in report.notes)


def test_the_optimizer_on_local_shards_allocates_what_stepping_dtensors_allocates(monkeypatch):
    # the same storages, in the same sizes, at the same peak: foreach Adam over the DTensors
    # (sharding propagation of every foreach op) and over their local tensors
    built: list[torch.optim.Optimizer] = []
    original = tensor_parallel._on_local_shards

    def keeping(*args):
        built.append(original(*args))
        return built[-1]

    monkeypatch.setattr(tensor_parallel, "_on_local_shards", keeping)
    step = build_step("mlp", batch_size=8, optimizer="adam", gpu="cpu", loop=FOREACH)
    results = []
    for local in (False, True):
        resolved = step.resolved(batch_size=8)
        program = TensorParallel(2, MLP_PLAN, local_step=local)
        options = replace(step, optimizer=program.optimizer_spec(step.optimizer))  # as estimate_per_rank does
        traced = trace_step(resolved, options, hooks=program)
        report = build_report(resolved, traced, step)
        results.append((report.peak_requested, report.bytes, Counter(traced.trace.nbytes)))
    assert results[0] == results[1]
    (optimizer,) = built  # the local step was taken: its state is keyed by plain local tensors
    assert optimizer.state and not any(isinstance(p, DTensor) for p in optimizer.state)


def test_gradients_of_other_placements_step_the_dtensors():
    # sequence-parallel norms: their weights are Replicate, their gradients Partial (DTensor
    # all-reduces them inside each foreach op): the step runs on the DTensors, as the real one
    report = memcalc.estimate(small_llama(), inputs=torch.zeros((4, 32), dtype=torch.long), gpu="cpu",
                              optimizer="adam", loop=FOREACH, distributed=memcalc.Distributed(tp=2))
    resolved_step = build_step(small_llama(), inputs=torch.zeros((4, 32), dtype=torch.long), optimizer="adam",
                               gpu="cpu", loop=FOREACH)
    resolved = resolved_step.resolved(batch_size=None)
    traced = trace_step(resolved, resolved_step, hooks=TensorParallel(2, None, local_step=False))
    assert report.peak_requested == build_report(resolved, traced, resolved_step).peak_requested


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_shard=2, tp_plan=MLP_PLAN), r"tp_plan \(--tp-plan\) applies only to the mesh dimension tp"),
    (dict(tp_plan=MLP_PLAN), r"tp_plan \(--tp-plan\) applies only to the mesh dimension tp"),
    (dict(dp_shard=2, loss_parallel=True), r"loss_parallel \(--loss-parallel\) applies only to the mesh dimension tp"),
])
def test_tp_options_are_refused_without_tp(kwargs, message):
    with pytest.raises(InapplicableOptionError, match=message):
        memcalc.Distributed(**kwargs)


@pytest.mark.parametrize("plan", [{"1": 2}, "1=colwise", [("1",)], {}])
def test_a_tp_plan_that_is_not_patterns_to_strings_is_refused(plan):
    with pytest.raises(InvalidInputError, match="tp_plan maps module-name patterns to style strings"):
        memcalc.Distributed(tp=2, tp_plan=plan)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_replicate=2), r"tp=2 with dp_replicate=2 is not modelled yet"),  # DDP over DTensors
    # tp x ep (x cp) composes with FSDP2 and HSDP, tp x ep x cp with one of dp_shard and dp_replicate
    (dict(dp_replicate=2, dp_shard=2, cp=2, ep=2),
     r"tp=2 with ep=2, cp=2 and dp_replicate=2, dp_shard=2 is not modelled yet"),
])
def test_tp_with_a_dimension_it_does_not_compose_with_is_refused_by_name(kwargs, message):
    with pytest.raises(InapplicableOptionError, match=message):
        _mlp(memcalc.Distributed(tp=2, tp_plan=MLP_PLAN, **kwargs))


def test_a_2x2_mesh_shards_each_rank_s_parameters_worked_by_hand():
    # FSDP2 over tensor parallelism (dp_shard=2, tp=2): FSDP2 chunks dim 0 of each rank's local tp
    # shard over the 2 dp_shard ranks (padded: rank 0 holds the larger chunk, so it is the one traced)
    report = _mlp(memcalc.Distributed(dp_shard=2, tp=2, tp_plan=MLP_PLAN))
    (role,) = report.roles  # the same shapes on every rank: one trace for all four
    assert role.ranks == (0, 1, 2, 3)
    # colwise 1: weight 1024 × 784 → tp 512 rows → dp_shard 256 rows: 256 × 784 = 200,704; bias 1024 → 512 → 256
    # rowwise 3: weight 1024 × 1024 → tp 512 columns → dp_shard 512 rows: 512 × 512 = 262,144; bias whole
    #            under tp (Replicate) → dp_shard 512
    # colwise_rep 5: weight 10 × 1024 → tp 5 rows → dp_shard ceil(5 / 2) = 3 rows: 3,072; bias 10 → 5 → 3
    # Σ 466,691 elements × 4 B = 1,866,764 B (a quarter of the model would be 1,863,690 B: the rowwise bias is
    # halved once only, and the odd rows are padded)
    shard = (256 * 784 + 256 + 512 * 512 + 512 + 3 * 1024 + 3) * 4
    assert shard == 1_866_764
    # at the optimizer step every unit is resharded: the shards, their gradients, Adam's two moments
    assert role.model_states == 4 * shard
    assert role.report.bytes.optimizer_state == 2 * shard
    assert [s.describe() for s in role.sharding] == ["params, grads, optimizer /2 (tp)",
                                                      "params, grads, optimizer, batch /2 (dp_shard)"]
    data = report.to_dict()
    assert data["world_size"] == 4 and data["global_batch_size"] == 16  # two data-parallel groups of 8
    assert [s["dimension"] for s in data["roles"][0]["sharding"]] == ["tp", "dp_shard"]


def test_hsdp_over_tp_falls_out():
    # dp_replicate around dp_shard x tp: the replicas all-reduce each unit's sharded gradients in place
    # (no memory of its own), so a rank holds what it holds on the 2 x 2 mesh
    hsdp = _mlp(memcalc.Distributed(dp_replicate=2, dp_shard=2, tp=2, tp_plan=MLP_PLAN))
    mesh = _mlp(memcalc.Distributed(dp_shard=2, tp=2, tp_plan=MLP_PLAN))
    (role,) = hsdp.roles
    assert role.ranks == tuple(range(8)) and hsdp.to_dict()["global_batch_size"] == 32
    assert role.report.peak_requested == mesh.roles[0].report.peak_requested


def test_cli_mesh_tp(golden):
    args = ["mlp", "--batch", "8", "--gpu", "a100-40gb", "--mesh", "tp=2", "--tp-plan",
            "1=colwise,3=rowwise,5=colwise_rep"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    golden(result.output)  # the per-rank table: params, grads, optimizer /2 (tp)
    data = json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).output)
    assert data["roles"][0]["sharding"] == [
        {"states": ["parameters", "gradients", "optimizer_state"], "dimension": "tp", "degree": 2}]


def test_cli_mesh_dp_shard_tp(golden):
    args = ["mlp", "--batch", "8", "--gpu", "a100-40gb", "--mesh", "dp_shard=2,tp=2", "--tp-plan",
            "1=colwise,3=rowwise,5=colwise_rep"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    golden(result.output)  # the per-rank table: /2 (tp), /2 (dp_shard)
    data = json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).output)
    assert [(s["dimension"], s["degree"]) for s in data["roles"][0]["sharding"]] == [("tp", 2), ("dp_shard", 2)]


def test_cli_mesh_dp_replicate_tp_is_refused(golden):
    result = CliRunner().invoke(main, ["mlp", "--batch", "8", "--mesh", "dp_replicate=2,tp=2", "--tp-plan",
                                       "1=colwise,3=rowwise,5=colwise_rep"])
    assert result.exit_code == InapplicableOptionError.exit_code, result.output
    golden(result.output)


@pytest.mark.parametrize("args", [
    pytest.param(["--tp-plan", "1=colwise"], id="tp_plan_without_tp"),
    pytest.param(["--mesh", "tp=2", "--tp-plan", "1"], id="tp_plan_item_without_style"),
    pytest.param(["--mesh", "tp=2", "--tp-plan", "1=colwise,1=rowwise"], id="tp_plan_pattern_twice"),
    pytest.param(["--mesh", "dp_shard=2", "--loss-parallel"], id="loss_parallel_without_tp"),
])
def test_cli_tp_usage_error(args, golden):
    result = CliRunner().invoke(main, ["mlp", *args])
    assert result.exit_code == 2, result.output
    golden(result.output)

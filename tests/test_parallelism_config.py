"""accelerate's ``ParallelismConfig`` as memcalc's device mesh (memcalc.stacks.transformers.parallelism_config,
memcalc.distributed.launch.trainer_mesh): ``TrainingArguments(parallelism_config=...)`` and the accelerate config
file's ``parallelism_config`` section.

The mapping runs accelerate's own ``ParallelismConfig`` (its validation, its mesh dims and their order); the
estimates under it are compared byte for byte with the ``--mesh`` form's (CLI JSON), and each setting whose
composition differs from memcalc's is refused by name.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from trl_llama import CONFIG

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.stacks.transformers.parallelism_config import read_parallelism_config

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")
#: TRL's trainers read the config (the ``trl`` extra, which the version legs of .ci/run leave out).
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the trl extra is not installed")
ParallelismConfig = accelerate.ParallelismConfig

SEQ = 64


@pytest.fixture
def model(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return f"hf:{path}"


# ---- the mapping, by hand, on accelerate's own object ---------------------------------------------------------------
@pytest.mark.parametrize(("sizes", "degrees"), [
    ({"dp_shard_size": 4}, (("dp_shard", 4),)),
    ({"dp_shard_size": 2, "tp_size": 2}, (("dp_shard", 2), ("tp", 2))),
    ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2, "cp_size": 2},
     (("dp_replicate", 2), ("dp_shard", 2), ("cp", 2), ("tp", 2))),
    ({"dp_shard_size": 2, "cp_size": 4}, (("dp_shard", 2), ("cp", 4))),
    ({}, ()),
])
def test_sizes_become_the_mesh_in_accelerates_order(sizes: dict[str, int], degrees: tuple[Any, ...]) -> None:
    """The degrees are accelerate's sizes, in the order of the mesh it builds (``_get_mesh``: dp_replicate,
    dp_shard, cp, sp, tp; tp innermost as memcalc's ranks are); FSDP2 shards over (dp_replicate, dp_shard_cp),
    the flattened dp_shard × cp, which is memcalc's FSDP2 over dp_shard × cp."""
    config = ParallelismConfig(**sizes)
    read = read_parallelism_config(config, "test")
    assert read is not None and read.degrees == degrees
    names = config._get_mesh()
    assert tuple(zip(*names, strict=True)) == degrees if names else degrees == ()
    if config.dp_shard_enabled or config.cp_enabled:
        assert config.fsdp_dim_names[-1] == "dp_shard_cp"
        assert config.dp_shard_cp_dim_names == [n for n in ("dp_shard", "cp") if dict(degrees).get(n, 1) > 1]
    product = 1
    for _, degree in degrees:
        product *= degree
    assert read.world_size == product == config.total_size


def test_to_json_and_the_config_files_section_read_alike() -> None:
    """``TrainingArguments.to_dict()`` writes ``ParallelismConfig.to_json()`` (handlers as dicts, its private
    ``_sizes``); ``accelerate config`` writes the keys prefixed. All three spellings give one mesh."""
    config = ParallelismConfig(dp_shard_size=2, tp_size=2, cp_size=2)
    section = {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2,
               "parallelism_config_cp_size": 2, "parallelism_config_cp_comm_strategy": "allgather"}
    reads = [read_parallelism_config(v, "test") for v in (config, config.to_json(), section)]
    assert {r.degrees for r in reads if r is not None} == {(("dp_shard", 2), ("cp", 2), ("tp", 2))}


def test_training_arguments_object_round_trip(tmp_path: Path) -> None:
    """A real ``TrainingArguments(parallelism_config=...)``'s ``to_dict()`` (what ``--training-args`` files
    hold) is read to the same mesh as the object."""
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                             parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    as_json = json.loads(args.to_json_string())["parallelism_config"]
    assert as_json["dp_shard_size"] == 2 and as_json["tp_size"] == 2
    for value in (args.parallelism_config, as_json):
        read = read_parallelism_config(value, "test")
        assert read is not None and read.as_dict() == {"dp_shard": 2, "tp": 2}


@pytest.mark.parametrize(("value", "error", "match"), [
    ({"sp_size": 2}, InapplicableOptionError, r"sp_size=2: DeepSpeed's Ulysses"),
    ({"cp_size": 2, "dp_shard_size": 2, "cp_comm_strategy": "alltoall"}, InapplicableOptionError,
     r"cp_comm_strategy='alltoall'"),
    ({"cp_size": 2, "dp_shard_size": 2, "cp_handler": {"cp_comm_strategy": "alltoall"}}, InapplicableOptionError,
     r"cp_comm_strategy='alltoall'"),
    ({"dp_replicate_size": 2, "tp_size": 2}, InapplicableOptionError, r"composing DDP \+ TP is not supported"),
    ({"tp_sise": 2}, InvalidInputError, r"no setting 'tp_sise'; did you mean 'tp_size'"),
    ({"tp_size": 2.0}, InvalidInputError, r"tp_size must be an integer"),
    # accelerate's own refusals, its words
    ({"cp_size": 2, "dp_replicate_size": 2}, InvalidInputError, r"refuses it: Context parallelism .* pure data"),
    ({"tp_size": 0}, InvalidInputError, r"tp_size must be at least 1"),
    ({"cp_backend": "ring"}, InvalidInputError, r"cp_backend must be one of"),
])
def test_refusals(value: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        read_parallelism_config(value, "test")


# ---- estimates: the --mesh form's, byte for byte ------------------------------------------------------------------
def _json(args: list[str]) -> str:
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return result.output


@needs_trl
def test_cli_training_args_parallelism_config_is_the_mesh_form(model: str, tmp_path: Path) -> None:
    """TRL's SFTTrainer with ``parallelism_config: {dp_shard_size: 2}`` in its config is accelerate's FSDP2 over
    two ranks: the JSON equals ``--mesh dp_shard=2`` beside the same config without it, byte for byte."""
    base = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False}
    with_pc, without = tmp_path / "pc.json", tmp_path / "plain.json"
    with_pc.write_text(json.dumps({**base, "parallelism_config": {"dp_shard_size": 2}}))
    without.write_text(json.dumps(base))
    common = [model, "--loop", "trl-sft", "--seq-len", str(SEQ), "--gpu", "cpu"]
    theirs = _json([*common, "--training-args", str(with_pc)])
    mine = _json([*common, "--training-args", str(without), "--mesh", "dp_shard=2"])
    assert theirs == mine
    data = json.loads(theirs)
    assert data["strategy"] == "fsdp" and data["world_size"] == 2


ACCELERATE_MESH = """\
distributed_type: FSDP
num_processes: 8
fsdp_config:
  fsdp_version: 2
parallelism_config:
  parallelism_config_dp_shard_size: 2
  parallelism_config_cp_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_comm_strategy: allgather
"""


def test_cli_accelerate_config_section_is_the_mesh_form(model: str, tmp_path: Path) -> None:
    """An accelerate config with FSDP2 and a parallelism_config section (dp_shard 2, cp 2, tp 2: FSDP2 over
    dp_shard × cp of the model's own tp plan's DTensors, the allgather ring) equals ``--mesh dp_shard=2,cp=2,tp=2``."""
    path = tmp_path / "fsdp_tp_cp.yaml"
    path.write_text(ACCELERATE_MESH)
    common = [model, "--seq-len", str(SEQ), "--batch", "2", "--gpu", "cpu"]
    theirs = _json([*common, "--accelerate-config", str(path)])
    assert theirs == _json([*common, "--mesh", "dp_shard=2,cp=2,tp=2"])
    assert json.loads(theirs)["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1, "cp": 2, "ep": 1}


@pytest.mark.parametrize(("text", "error", "match"), [
    (ACCELERATE_MESH.replace("num_processes: 8", "num_processes: 4"), InvalidInputError,
     r"total_size 8 .* is not num_processes 4"),
    ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"
     "  parallelism_config_tp_size: 2\n", InapplicableOptionError, r"leaves FSDP no dimension"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nparallelism_config:\n  parallelism_config_tp_size: 2\n",
     InapplicableOptionError, r"goes with distributed_type FSDP and fsdp_version 2"),
])
def test_accelerate_config_refusals(model: str, tmp_path: Path, text: str, error: type[Exception],
                                    match: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(error, match=match):
        memcalc.estimate(model, seq_len=SEQ, gpu="cpu", accelerate_config=str(path))


@pytest.mark.parametrize(("sizes", "said"), [({"dp_shard_size": 2, "tp_size": 2}, "dp_shard_size=2, tp_size=2"),
                                            ({"dp_replicate_size": 2, "dp_shard_size": 2},
                                             "dp_replicate_size=2, dp_shard_size=2")])
def test_trainers_own_loop_under_hsdp_tp_refused(model: str, sizes: dict[str, int], said: str) -> None:
    args = {"per_device_train_batch_size": 2, "parallelism_config": sizes}
    with pytest.raises(InapplicableOptionError, match=rf"loop trainer with its config's parallelism_config "
                                                      rf"\({said}\) is not modelled: the Trainer's loop is estimated "
                                                      rf"under accelerate's DDP, FSDP2 over one dimension and ZeRO"):
        memcalc.estimate(model, trainer_args=args, seq_len=SEQ, gpu="cpu")


@pytest.mark.parametrize(("sizes", "strategy"), [({"dp_shard_size": 2}, "fsdp"), ({"dp_replicate_size": 2}, "ddp")])
def test_trainers_own_loop_under_its_data_parallel_mesh(model: str, sizes: dict[str, int], strategy: str) -> None:
    """A dp_shard or dp_replicate parallelism_config runs the Trainer's loop under FSDP2 or DDP, as
    --strategy does (the same estimate)."""
    args = {"per_device_train_batch_size": 2, "parallelism_config": sizes}
    theirs = memcalc.estimate(model, trainer_args=args, seq_len=SEQ, gpu="cpu")
    ours = memcalc.estimate(model, trainer_args={"per_device_train_batch_size": 2}, seq_len=SEQ, gpu="cpu",
                            distributed=memcalc.Distributed(strategy, world_size=2))
    assert theirs.distribution is not None and theirs.distribution.strategy == strategy
    assert theirs.peak_requested == ours.peak_requested


@needs_trl
@pytest.mark.parametrize(("sizes", "said"), [({"dp_shard_size": 2, "tp_size": 2}, "dp_shard_size=2, tp_size=2"),
                                            ({"dp_replicate_size": 2, "dp_shard_size": 2},
                                             "dp_replicate_size=2, dp_shard_size=2")])
def test_trl_under_hsdp_tp_refused(model: str, sizes: dict[str, int], said: str) -> None:
    args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False,
            "parallelism_config": sizes}
    with pytest.raises(InapplicableOptionError, match=rf"loop trl-sft with its config's parallelism_config "
                                                      rf"\({said}\) is not modelled: .* not HSDP, tensor"):
        memcalc.estimate(model, loop="trl-sft", trainer_args=args, seq_len=SEQ, gpu="cpu")


@needs_trl
def test_disagreeing_mesh_refused(model: str) -> None:
    args = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False,
            "parallelism_config": {"dp_shard_size": 2}}
    with pytest.raises(InapplicableOptionError, match=r"mesh dp_shard=2, 2 GPUs\) disagrees with the 4 GPUs"):
        memcalc.estimate(model, loop="trl-sft", trainer_args=args, seq_len=SEQ, gpu="cpu",
                         distributed=memcalc.Distributed(dp_shard=4))


def test_tp_needs_the_models_own_plan(tmp_path: Path) -> None:
    """accelerate's tp is the plan ``from_pretrained(tp_plan="auto")`` applies: a zoo model in plain torch has
    none (memcalc would use torchtitan's), so a launch file's tp on it is refused."""
    path = tmp_path / "config.yaml"
    path.write_text(ACCELERATE_MESH)
    with pytest.raises(InapplicableOptionError, match=r"tp_size=2: accelerate tensor-parallelises .* has none"):
        memcalc.estimate("torch:llama-tiny", seq_len=SEQ, gpu="cpu", accelerate_config=str(path))


@pytest.mark.parametrize("rank", [0, 5])
def test_accelerates_real_mesh_has_memcalcs_sub_meshes(rank: int) -> None:
    """accelerate's own ``build_device_mesh`` over a fake 8-rank group (dp_shard 2, cp 2, tp 2): tp is the
    innermost dimension (a rank's tp peers are consecutive, memcalc's ``rank = outer × tp + tp rank``), and FSDP2's
    mesh (``fsdp_dim_names``: the flattened ``dp_shard_cp``) holds the dp_shard × cp = 4 ranks of one tp rank, the
    group memcalc's FSDP2 over dp_shard × cp shards across."""
    import torch.distributed as dist
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=rank, world_size=8, store=fake_pg.FakeStore())
    try:
        config = ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)
        mesh = config.build_device_mesh("cpu")
        tp_rank = rank % 2
        assert mesh.mesh_dim_names == ("dp_shard", "cp", "tp")
        assert dist.get_process_group_ranks(mesh["tp"].get_group()) == [rank - tp_rank, rank - tp_rank + 1]
        fsdp = mesh[tuple(config.fsdp_dim_names)]
        assert fsdp.size() == 4
        assert dist.get_process_group_ranks(fsdp.get_group()) == [tp_rank + 2 * i for i in range(4)]
        assert dist.get_process_group_ranks(mesh["cp"].get_group()) == [r for r in range(8)
                                                                         if r // 4 == rank // 4 and r % 2 == tp_rank]
    finally:
        dist.destroy_process_group()


@needs_trl
def test_fit_reads_the_mesh_too(model: str) -> None:
    """``max_batch_size`` (``memcalc fit``) lays the parallelism_config's mesh over the search as the estimate
    does: the same answer as ``Distributed(dp_shard=2)``, not the one-GPU one (FSDP2 frees 1/2 of the model
    states per rank, so the batch that fits differs)."""
    base = {"per_device_train_batch_size": 2, "bf16": False, "gradient_checkpointing": False}
    common: dict[str, Any] = {"loop": "trl-sft", "seq_len": SEQ, "gpu": "cpu", "budget": "2GiB"}
    theirs = memcalc.max_batch_size(model, trainer_args={**base, "parallelism_config": {"dp_shard_size": 2}},
                                    **common)
    mine = memcalc.max_batch_size(model, trainer_args=base, distributed=memcalc.Distributed(dp_shard=2), **common)
    one = memcalc.max_batch_size(model, trainer_args=base, **common)
    assert theirs.batch_size == mine.batch_size != one.batch_size
    assert theirs.report.bytes.peak_allocated == mine.report.bytes.peak_allocated

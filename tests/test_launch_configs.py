"""Launch configurations (issue 35, item 3): accelerate's config file and a DeepSpeed JSON read
into memcalc's strategies. Three layers: each key's mapping, checked on the reader's output and
on hand-worked bytes (ZeRO-2 with ``offload_optimizer``: DeepSpeed's own
``estimate_zero2_model_states_mem_needs(cpu_offload=True)``, 2 bytes per parameter; ``overlap_comm``:
one more reduce bucket); an estimate through a file equal to the same setting given by hand;
golden CLI output; bad input refused by name, exit 2, one line.

DeepSpeed does not install on this CPU-only machine and ZeRO cannot run here: its bytes are
checked against its published formulas (memcalc.distributed.deepspeed_formulas), not a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed import deepspeed_formulas as ds
from memcalc.distributed.launch.accelerate_config import read_accelerate
from memcalc.distributed.launch.deepspeed_config import read_deepspeed
from memcalc.distributed.launch.read import hidden_size_of, read_launch
from memcalc.distributed.vocabulary import ZeroStage3

MiB = 2**20
PSI = 2 * 1024 * 1024  # two_layers: two 1024×1024 weights, no bias
FOREACH = memcalc.Loop(optimizer_impl="foreach")

ACCELERATE_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""

ACCELERATE_DEEPSPEED = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
mixed_precision: fp16
num_machines: 2
num_processes: 16
"""

DEEPSPEED_ZERO2 = {
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "train_batch_size": 64,
    "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 100,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7,
                          "overlap_comm": True, "contiguous_gradients": True,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))


def _two(**kw):
    # gpu="cpu": no cuBLAS workspace; every byte is the model's (as tests/test_strategies.py)
    return memcalc.estimate(two_layers, input_shape=(1024,), loss="mean", gpu="cpu", loop=FOREACH, **kw)


def _write(tmp_path: Path, name: str, content: str | dict) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# ============================================================================================
# What each key becomes
# ============================================================================================


def test_deepspeed_json_mapping():
    setup = read_deepspeed(DEEPSPEED_ZERO2)
    # 5e7 is written as a float in DeepSpeed's own examples; 64 = 8 × 2 × 4 GPUs
    assert dict(setup.distributed) == {"strategy": "zero2", "reduce_bucket_size": 50_000_000, "overlap_comm": True,
                                       "offload_optimizer": True, "world_size": 4}
    assert dict(setup.values) == {"precision": "amp-bf16", "batch_size": 8, "accum_steps": 2, "optimizer": "adamw"}
    assert setup.auto_hidden == ()


def test_deepspeed_auto_values_are_filled_as_transformers_fills_them():
    setup = read_deepspeed({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                            "fp16": {"enabled": "auto"},
                            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                  "stage3_prefetch_bucket_size": "auto"}})
    assert dict(setup.values) == {}  # auto: the other options' batch and precision
    assert setup.auto_hidden == ("reduce_bucket_size", "stage3_prefetch_bucket_size")
    # trainer_config_finalize: reduce_bucket_size = hidden_size * hidden_size (GPT-2: 768² = 589,824),
    # stage3_prefetch_bucket_size = int(0.9 * hidden_size²) (530,841), under ZeRO-3
    filled = setup.with_hidden_size(768).distributed
    assert filled["reduce_bucket_size"] == 589_824
    assert filled["stage3"] == ZeroStage3(prefetch_bucket_size=530_841)
    assert hidden_size_of(SimpleNamespace(config=SimpleNamespace(hidden_size=768)), "x") == 768
    assert hidden_size_of(SimpleNamespace(config=SimpleNamespace(hidden_sizes=[64, 512, 256])), "x") == 512
    with pytest.raises(InvalidInputError, match="no config with one"):
        hidden_size_of(two_layers(), "x")


def test_accelerate_fsdp_mapping(tmp_path):
    setup = read_accelerate(_write(tmp_path, "fsdp.yaml", ACCELERATE_FSDP))
    assert dict(setup.distributed) == {"strategy": "fsdp", "sharding": "shard_grad_op", "world_size": 4}
    assert dict(setup.values) == {"precision": "amp-bf16"}
    assert any("fsdp_cpu_ram_efficient_loading ignored" in note for note in setup.notes)


def test_accelerate_deepspeed_plugin_mapping(tmp_path):
    # num_processes is the total over the machines (accelerate launches num_processes // num_machines each)
    setup = read_accelerate(_write(tmp_path, "ds.yaml", ACCELERATE_DEEPSPEED))
    assert dict(setup.distributed) == {"strategy": "zero2", "offload_optimizer": True, "world_size": 16}
    assert dict(setup.values) == {"precision": "amp-fp16", "accum_steps": 1}


@pytest.mark.parametrize("kind, strategy", [("NO", None), ("MULTI_GPU", "ddp")])
def test_accelerate_plain_types(tmp_path, kind, strategy):
    text = f"distributed_type: '{kind}'\nnum_processes: {1 if kind == 'NO' else 2}\nmixed_precision: 'no'\n"
    setup = read_accelerate(_write(tmp_path, "a.yaml", text))
    assert setup.distributed.get("strategy") == strategy
    assert dict(setup.values) == {"precision": "fp32"}


def test_accelerate_deepspeed_config_file_is_read(tmp_path):
    _write(tmp_path, "z.json", {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    text = ("distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n"
            f"  deepspeed_config_file: {tmp_path}/z.json\n")
    setup = read_accelerate(_write(tmp_path, "a.yaml", text))
    assert dict(setup.distributed) == {"strategy": "zero1", "world_size": 8}
    assert dict(setup.values) == {"batch_size": 2, "precision": "fp32"}


# ============================================================================================
# Hand-worked bytes through the files
# ============================================================================================


def test_zero2_offload_optimizer_leaves_the_16_bit_model_on_the_gpu():
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20,
                                    "offload_optimizer": {"device": "cpu"}}}
    role = _two(deepspeed=config).roles[0]
    # the bf16 parameters, 2Ψ: DeepSpeed's estimate_zero2_model_states_mem_needs(cpu_offload=True);
    # the fp32 master, Adam's moments and the gradient partition are on the host
    assert role.model_states == 2 * PSI == ds.zero2_model_states(PSI, 4, cpu_offload=True).gpu_bytes
    on_gpu = _two(deepspeed={**config, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20}}).roles[0]
    # without offload: 2Ψ + 18Ψ/4 (DeepSpeed's formula, as tests/test_strategies.py checks)
    assert on_gpu.model_states == ds.zero2_model_states(PSI, 4).gpu_bytes == 2 * PSI + 18 * PSI // 4


def test_zero3_stage3_keys_and_offloads_by_hand():
    # two_layers (two 1024×1024 weights, no bias: nothing persists), fp32, 4 ranks, bucket 2^20
    # elements (4 MiB). As tests/test_strategies.py works it out: the second step's forward holds
    # shards 2 + flat all-gather output 8 + the two weights 8 + gradient partition 2 + master 2
    # + Adam 4 + bucket 4 = 30 MiB (with the input and module 0's output, 8 KiB)
    zero = {"stage": 3, "reduce_bucket_size": 2**20}
    base = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4}

    def peak(**keys):
        return _two(deepspeed={**base, "zero_optimization": {**zero, **keys}}).peak_requested - 2 * 4096

    assert peak() == 30 * MiB
    # offload_param: the 16-bit partitions (the shards, 2 MiB) are in host memory
    assert peak(offload_param={"device": "cpu"}) == 28 * MiB
    # offload_optimizer: master 2, Adam 4 and the gradient partition 2 are in host memory
    assert peak(offload_optimizer={"device": "cpu"}) == 22 * MiB
    assert peak(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}) == 20 * MiB
    # no prefetch, nothing kept for reuse: each weight gathered alone, straight into its padded buffer
    # (no flat output); the peak moves to backward: shards 2 + weight 4 + its gradient 4 + gradient
    # partition 2 + master 2 + Adam 4 + bucket 4 = 22 MiB, with what backward holds beside
    lean = peak(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    assert 22 * MiB <= lean < 22 * MiB + 32 * 1024
    # model states at the step (fp32, Ψ/4 = 2 MiB each): shards + gradient partition + master + Adam's
    # two moments + the fp32 gradient copy = 12 MiB; offload_param leaves the shards; offload_optimizer
    # leaves the shards alone

    def states(**keys):
        return _two(deepspeed={**base, "zero_optimization": {**zero, **keys}}).roles[0].model_states

    assert states() == 6 * PSI  # Ψ/4 fp32 elements = Ψ bytes each
    assert states(offload_param={"device": "cpu"}) == 5 * PSI
    assert states(offload_optimizer={"device": "cpu"}) == PSI


def test_zero3_keys_become_its_settings():
    setup = read_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7,
                                                  "stage3_param_persistence_threshold": 0,
                                                  "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 0,
                                                  "stage3_model_persistence_threshold": 10,
                                                  "offload_param": {"device": "cpu", "pin_memory": True},
                                                  "offload_optimizer": {"device": "cpu"}}})
    assert setup.distributed["stage3"] == ZeroStage3(prefetch_bucket_size=50_000_000, max_live_parameters=10**9,
                                                     max_reuse_distance=0, param_persistence_threshold=0,
                                                     model_persistence_threshold=10, offload_param=True)
    assert setup.distributed["offload_optimizer"] is True
    # below stage 3 DeepSpeed reads and ignores them
    two = read_deepspeed({"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 0}})
    assert "stage3" not in two.distributed and any("ignored at stage 2" in n for n in two.notes)
    # --strategy zero3 is DeepSpeed with its defaults
    assert memcalc.Distributed("zero3", world_size=2).stage3 == ZeroStage3()
    with pytest.raises(InapplicableOptionError, match="applies to strategy zero3"):
        memcalc.Distributed("zero2", world_size=2, stage3=ZeroStage3())


def test_overlap_comm_adds_one_reduce_bucket():
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20}}
    one = _two(deepspeed=config)
    two = _two(deepspeed={**config, "zero_optimization": {**config["zero_optimization"], "overlap_comm": True}})
    # ipg_buffer gets buf_1: 2**20 bf16 elements = 2 MiB more at the backward's peak
    assert two.peak_requested - one.peak_requested == 2**20 * 2


def test_accelerate_fsdp_is_the_setting_given_by_hand_as_accelerate_prepares_it(tmp_path):
    by_file = _two(accelerate_config=_write(tmp_path, "fsdp.yaml", ACCELERATE_FSDP))
    by_hand = _two(precision="amp-bf16", distributed=memcalc.Distributed("fsdp", world_size=4,
                                                                          sharding="shard_grad_op"))
    assert by_file.roles[0].model_states == by_hand.roles[0].model_states  # the same shards
    notes = by_file.roles[0].report.notes
    assert any(note.startswith("accelerate config") for note in notes)
    # accelerator.prepare's FSDP2 reduces in bf16 (the plugin's MixedPrecisionPolicy), memcalc's own in
    # float32 (torchtitan's): no float32 copy of the unsharded bf16 gradients to reduce-scatter
    assert any("reduce_dtype=bfloat16" in note for note in notes)
    assert by_file.peak_requested < by_hand.peak_requested


# ============================================================================================
# Bad input: named, with the closest key; exit 2, one line
# ============================================================================================


@pytest.mark.parametrize("config, error, message", [
    ({"zero_optimisation": {"stage": 2}}, InvalidInputError, "no key 'zero_optimisation'; did you mean "
                                                             "'zero_optimization'"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket": 5}}, InvalidInputError, "did you mean 'reduce_bucket_size'"),
    ({"zero_optimization": {"stage": 0}}, InapplicableOptionError, "ZeRO stage 0"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, InapplicableOptionError,
     "offload_param applies to ZeRO stage 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, InapplicableOptionError, "nvme"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, InapplicableOptionError, "nvme"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}}, InvalidInputError,
     "stage3_max_live_parameters is \"auto\", which transformers does not fill"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}}, InvalidInputError,
     "stage3_prefetch_bucket_size must be a whole number"),
    ({"zero_optimization": {"stage": 3, "stage3_param_persistence": 10}}, InvalidInputError,
     "did you mean 'stage3_param_persistence_threshold'"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, InvalidInputError, "both enabled"),
    ({"optimizer": {"type": "Lamb"}}, InapplicableOptionError, "'Lamb' is not modelled"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, InvalidInputError, "4 × N"),
])
def test_bad_deepspeed_config_is_refused_by_name(config, error, message):
    config = {"zero_optimization": {"stage": 1}, **config}  # DeepSpeed's default stage is 0, refused itself
    with pytest.raises(error, match=message.replace("(", r"\(")):
        read_deepspeed(config)


@pytest.mark.parametrize("text, message", [
    ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\n", "fsdp_version 1"),
    ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: true\n",
     "fsdp_offload_params"),
    ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n  fsdp_sharding_stratgy: 1\n",
     "did you mean 'fsdp_sharding_strategy'"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nnum_proceses: 2\n", "did you mean 'num_processes'"),
    ("distributed_type: XLA\nnum_processes: 2\n", "XLA is not modelled"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: fp8\n", "'fp8' is not modelled"),
    ("distributed_type: WARP_DRIVE\n", "WARP_DRIVE"),
    ("num_processes: 2\n", "distributed_type"),
])
def test_bad_accelerate_config_is_refused_by_name(tmp_path, text, message):
    with pytest.raises(InvalidInputError, match=message):
        read_accelerate(_write(tmp_path, "a.yaml", text))


def test_conflicts_are_refused(tmp_path):
    acc = _write(tmp_path, "fsdp.yaml", ACCELERATE_FSDP)
    with pytest.raises(InapplicableOptionError, match="precision 'fp16' disagrees with accelerate config"):
        _two(accelerate_config=acc, precision="fp16")
    with pytest.raises(InapplicableOptionError, match="decides the multi-GPU setting"):
        _two(accelerate_config=acc, distributed=memcalc.Distributed("ddp", world_size=2))
    with pytest.raises(InapplicableOptionError, match="world size 8 disagrees"):
        read_launch(accelerate_config=acc, world_size=8)
    with pytest.raises(InvalidInputError, match="not both"):
        read_launch(accelerate_config=acc, deepspeed={})
    with pytest.raises(InvalidInputError, match="does not say how many GPUs"):
        read_launch(deepspeed={"zero_optimization": {"stage": 2}})
    with pytest.raises(InvalidInputError, match="not found"):
        read_launch(deepspeed=tmp_path / "missing.json")


@pytest.mark.parametrize("args, message", [
    (["--deepspeed", "missing.json"], "DeepSpeed config not found: missing.json"),
    (["--deepspeed", "bad.json"], "no key 'zero_optimisation'; did you mean 'zero_optimization'?"),
    (["--deepspeed", "ds.json", "--strategy", "ddp"], "--deepspeed sets the multi-GPU setting; leave out --strategy"),
    (["--deepspeed", "ds.json", "--global-batch"], "leave out --global-batch"),
    (["--deepspeed", "ds.json", "--world-size", "2"], "world size 2 disagrees with DeepSpeed config ds.json"),
    (["--accelerate-config", "fsdp.yaml", "--precision", "fp16"], "precision 'fp16' disagrees with accelerate "
                                                                  "config fsdp.yaml"),
])
def test_cli_bad_launch_input_exits_2_with_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "bad.json", {"zero_optimisation": {"stage": 2}})
    _write(tmp_path, "ds.json", DEEPSPEED_ZERO2)
    _write(tmp_path, "fsdp.yaml", ACCELERATE_FSDP)
    result = CliRunner().invoke(main, ["mlp", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 2  # the error and its hint


# ============================================================================================
# Golden CLI output
# ============================================================================================


@pytest.mark.parametrize("name, content, flag", [
    pytest.param("fsdp.yaml", ACCELERATE_FSDP, "--accelerate-config", id="accelerate_fsdp"),
    pytest.param("ds.json", json.dumps(DEEPSPEED_ZERO2), "--deepspeed", id="deepspeed_zero2"),
])
def test_cli_launch_config(tmp_path, monkeypatch, golden, name, content, flag):
    monkeypatch.chdir(tmp_path)  # the note names the file as given: a relative path
    _write(tmp_path, name, content)
    result = CliRunner().invoke(main, ["mlp", flag, name, "--gpu", "a100-80gb", "--depth", "0"])
    assert result.exit_code == 0, result.output
    golden(result.output)

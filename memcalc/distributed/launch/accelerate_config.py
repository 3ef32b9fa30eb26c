"""accelerate's config file (``accelerate launch --config_file FILE.yaml``, as ``accelerate
config`` writes it) as memcalc's multi-GPU setting and step options: :func:`read_accelerate`.

The file is read as the installed accelerate reads it: ``ClusterConfig.process_config`` fills its
defaults, a key ``ClusterConfig`` does not have is refused (memcalc adds the closest one), and
``ClusterConfig(**config)`` checks ``distributed_type``. Then ``distributed_type`` picks the
strategy (``NO``: one GPU; ``MULTI_GPU``: DDP; ``FSDP``: FSDP2 per block; ``DEEPSPEED``: ZeRO,
through :func:`~memcalc.distributed.launch.deepspeed_config.read_deepspeed` on the config
accelerate's ``DeepSpeedPlugin`` builds, or on its ``deepspeed_config_file``), ``num_processes``
(the total over the machines: ``accelerate launch`` runs ``num_processes // num_machines`` per
machine) the world size, ``mixed_precision`` the precision (``amp-bf16`` / ``amp-fp16``). What each
``fsdp_config`` key becomes is docs/launch-configs.md. A ``parallelism_config`` section (with FSDP2
only, as ``accelerate launch`` asks) makes the device mesh
(:mod:`memcalc.stacks.transformers.parallelism_config`): FSDP2 over its ``dp_shard × cp``, with tp and cp.

The loop then runs the model ``accelerator.prepare`` returns (:attr:`LaunchSetup.accelerate_prepares`),
as accelerate 1.16 prepares it: under ``MULTI_GPU`` and ``NO`` with 16-bit ``mixed_precision``,
``prepare_model`` wraps the forward in autocast and copies its 16-bit outputs to float32; under FSDP2
``_prepare_fsdp2`` wraps nothing, and ``fsdp2_prepare_model`` shards its own units with the plugin's
``MixedPrecisionPolicy`` (param and reduce dtype 16-bit, float32 masters:
:mod:`memcalc.distributed.accelerate_fsdp`). On a ``parallelism_config`` mesh memcalc's own loops keep
torchtitan's layout (not checked against a real run there), and say so in a note.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.launch.deepspeed_config import read_deepspeed
from memcalc.distributed.launch.setup import LaunchSetup, load_mapping, refuse_unknown
from memcalc.stacks.transformers.hub import import_hf
from memcalc.stacks.transformers.parallelism_config import read_parallelism_config

__all__ = ("FSDP_KEYS", "read_accelerate")

#: accelerate's ``mixed_precision`` → memcalc's precision (``fp8`` is refused).
_PRECISION = {"no": "fp32", "fp16": "amp-fp16", "bf16": "amp-bf16"}

#: Top-level keys that matter only with a value set: what they turn on is not modelled.
_REFUSED_WHEN_SET = {
    "fp8_config": "FP8 training (TransformerEngine / torchao) is not modelled",
    "megatron_lm_config": "Megatron-LM is not modelled",
}

#: ``fsdp_config`` keys (accelerate adds the ``fsdp_`` prefix to a key without it).
FSDP_KEYS = frozenset({
    "fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params",
    "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params", "fsdp_backward_prefetch",
    "fsdp_forward_prefetch", "fsdp_state_dict_type", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states", "fsdp_activation_checkpointing", "fsdp_cpu_offload_pin_memory",
})

#: ``deepspeed_config`` keys of accelerate's ``DeepSpeedPlugin``.
_DEEPSPEED_KEYS = frozenset({
    "zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
    "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
    "zero3_save_16bit_model", "deepspeed_config_file", "deepspeed_multinode_launcher", "deepspeed_hostfile",
    "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names",
})
_LAUNCHER_KEYS = frozenset({"deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
                            "deepspeed_inclusion_filter", "zero3_init_flag", "zero3_save_16bit_model"})


def read_accelerate(path: Any) -> LaunchSetup:
    """The setting of an accelerate config file (``.yaml``/``.yml`` or ``.json``).

    Raises:
        MissingPackageError: accelerate is not installed.
        InvalidInputError: an unreadable file, an unknown key (named), a bad value.
        InapplicableOptionError: a setting memcalc does not model (FSDP1, parameter offload,
            fp8, another backend), named.
    """
    where = f"accelerate config {path}"
    data = load_mapping(path, "accelerate config", (".yaml", ".yml", ".json"))
    config_args = import_hf("accelerate", "--accelerate-config").commands.config.config_args
    cluster = config_args.ClusterConfig
    try:
        data = cluster.process_config(dict(data))
    except ValueError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None
    refuse_unknown(data, cluster.__dataclass_fields__, where)
    try:
        config = cluster(**data)
    except (ValueError, TypeError) as exc:
        raise InvalidInputError(f"{where}: {str(exc).splitlines()[0]}") from None
    _refuse_set(data, where)
    kind = str(getattr(config.distributed_type, "value", config.distributed_type))
    world = _world_size(config.num_processes, where)
    notes = [f"distributed_type {kind}, {world} process{'es' if world > 1 else ''}"]
    values: dict[str, Any] = {}
    precision = str(config.mixed_precision or "no").lower()
    if precision not in _PRECISION:
        raise InapplicableOptionError(f"{where}: mixed_precision {precision!r} is not modelled",
                                      hint="memcalc models no, fp16 and bf16.")
    values["precision"] = _PRECISION[precision]
    prepares = True  # the model is the one accelerator.prepare returns, prepared as this setting says
    if kind == "NO":
        distributed: dict[str, Any] = {}
        notes += _prepare_model_notes(precision)
    elif kind == "MULTI_GPU":
        distributed = {"strategy": "ddp", "world_size": world}
        notes += _prepare_model_notes(precision)
    elif kind == "FSDP":
        distributed, checkpoint, said = _fsdp(config.fsdp_config or {}, where)
        distributed["world_size"] = world
        notes += said
        distributed, said = _on_mesh(distributed, data.get("parallelism_config"), world, where)
        if set(distributed) - {"dp_shard", "sharding", "strategy", "world_size"}:
            prepares = False  # tp, cp or HSDP: memcalc's own loops keep torchtitan's FSDP2 layout and policy
            said.append(_MESH_LAYOUT)
        notes += said
        if checkpoint:
            values["checkpoint"] = True
    elif kind == "DEEPSPEED":
        deepspeed = _deepspeed(config.deepspeed_config or {}, precision, where)
        distributed = {**deepspeed.distributed, "world_size": world}
        values = {**deepspeed.values, **values}
        notes += deepspeed.notes
        return LaunchSetup(where, distributed, values, tuple(notes), deepspeed.auto_hidden)
    else:
        raise InapplicableOptionError(f"{where}: distributed_type {kind} is not modelled",
                                      hint="memcalc models NO, MULTI_GPU (DDP), FSDP (FSDP2) and DEEPSPEED (ZeRO).")
    return LaunchSetup(where, distributed, values, tuple(notes), accelerate_prepares=prepares)


def _prepare_model_notes(precision: str) -> list[str]:
    """What ``Accelerator.prepare_model`` does to the model's forward under DDP or on one GPU with
    16-bit mixed precision (accelerate/accelerator.py): one autocast region, its 16-bit outputs
    copied to float32 (``convert_outputs_to_fp32``), the copy what the loop's ``outputs`` holds."""
    if precision == "no":
        return []
    return [f"accelerator.prepare: the forward under {precision} autocast, its 16-bit outputs copied to float32 "
            f"(convert_outputs_to_fp32), which the loop's outputs hold"]


#: The layout memcalc's own loops keep on a ``parallelism_config`` mesh: accelerate's ``fsdp2_prepare_model``
#: units over a tp / cp / HSDP mesh are not checked against a real run.
_MESH_LAYOUT = ("on this mesh memcalc's own loops are estimated with FSDP2 per block and root and "
                "MixedPrecisionPolicy(reduce_dtype float32) (torchtitan's layout), not with accelerate's "
                "fsdp2_prepare_model units and 16-bit reduce")


def _on_mesh(distributed: dict[str, Any], section: Any, world: int,
             where: str) -> tuple[dict[str, Any], list[str]]:
    """FSDP2 over the mesh of the ``parallelism_config`` section (accelerate's ``ParallelismConfig``:
    :mod:`memcalc.stacks.transformers.parallelism_config`), its FSDP2 settings kept; unchanged without one."""
    mesh = read_parallelism_config(section, where)
    if mesh is None or not mesh.degrees:  # every size 1: accelerate sets dp_replicate to num_processes
        return distributed, []
    if mesh.world_size != world:
        raise InvalidInputError(f"{where}: parallelism_config's total_size {mesh.world_size} (mesh "
                                f"{mesh.describe()}) is not num_processes {world}; accelerate refuses it",
                                hint="Make the product of its sizes the number of processes.")
    if "dp_shard" not in mesh.as_dict() and "cp" not in mesh.as_dict():
        raise InapplicableOptionError(f"{where}: parallelism_config (mesh {mesh.describe()}) leaves FSDP no dimension "
                                      f"to shard across (dp_shard_size and cp_size 1); accelerate refuses it")
    return {**mesh.as_dict(), "sharding": distributed["sharding"]}, list(mesh.notes)


def _refuse_set(data: Mapping[str, Any], where: str) -> None:
    if data.get("parallelism_config") and str(data.get("distributed_type")).split(".")[-1].upper() != "FSDP":
        raise InapplicableOptionError(f"{where}: parallelism_config goes with distributed_type FSDP and fsdp_version "
                                      f"2 (accelerate launch refuses --use_parallelism_config without them)",
                                      hint="Set distributed_type: FSDP and fsdp_config.fsdp_version: 2.")
    for key, why in _REFUSED_WHEN_SET.items():
        if data.get(key):
            raise InapplicableOptionError(f"{where}: {key}: {why}")
    if data.get("use_cpu"):
        raise InapplicableOptionError(f"{where}: use_cpu runs on the CPU; give --gpu cpu to estimate a CPU run")
    backend = (data.get("dynamo_config") or {}).get("dynamo_backend", "NO")
    if str(backend).upper() != "NO":
        raise InapplicableOptionError(f"{where}: dynamo_config {backend}: torch.compile is not followed from a "
                                      f"launch config", hint="Give --compile to estimate a compiled step.")


def _world_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{where}: num_processes must be the number of processes (≥ 1), got {value!r}",
                                hint="accelerate's num_processes is the total over all machines.")
    return value


def _fsdp(fsdp: Mapping[str, Any], where: str) -> tuple[dict[str, Any], bool, list[str]]:
    """FSDP2 (``fsdp_version: 2``) per block, as memcalc's ``fsdp`` strategy shards it."""
    keys = {key if key.startswith("fsdp") else f"fsdp_{key}": value for key, value in fsdp.items()}
    refuse_unknown(keys, FSDP_KEYS, f"{where} fsdp_config")
    notes = []
    if int(keys.get("fsdp_version", 1)) != 2:
        raise InapplicableOptionError(f"{where}: fsdp_version {keys.get('fsdp_version', 1)} (FSDP1, accelerate's "
                                      f"default) is not modelled: memcalc models FSDP2's fully_shard",
                                      hint="Set fsdp_version: 2 in fsdp_config (accelerate's FSDP2), which memcalc "
                                           "estimates.")
    if keys.get("fsdp_offload_params"):
        raise InapplicableOptionError(f"{where}: fsdp_offload_params (CPUOffloadPolicy) is not modelled",
                                      hint="Leave it false to estimate FSDP2 without offload.")
    policy = str(keys.get("fsdp_auto_wrap_policy") or "TRANSFORMER_BASED_WRAP").upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        raise InapplicableOptionError(f"{where}: fsdp_auto_wrap_policy {policy} is not modelled: memcalc shards "
                                      f"each transformer block (TRANSFORMER_BASED_WRAP)")
    sharding = _reshard(keys, where)
    if keys.get("fsdp_cpu_ram_efficient_loading"):
        notes.append("fsdp_cpu_ram_efficient_loading ignored (it changes how the weights are loaded into host "
                     "memory, not the step)")
    if keys.get("fsdp_forward_prefetch"):
        raise InapplicableOptionError(f"{where}: fsdp_forward_prefetch (a second block gathered ahead in the "
                                      f"forward) is not modelled")
    checkpoint = bool(keys.get("fsdp_activation_checkpointing"))
    if checkpoint:
        notes.append("fsdp_activation_checkpointing → checkpoint every block")
    notes.append(f"FSDP2 {sharding}")
    return {"strategy": "fsdp", "sharding": sharding}, checkpoint, notes


def _reshard(keys: Mapping[str, Any], where: str) -> str:
    """``fsdp_reshard_after_forward`` (FSDP2's), or FSDP1's ``fsdp_sharding_strategy`` as
    accelerate maps it: FULL_SHARD → reshard (full_shard), SHARD_GRAD_OP → keep (shard_grad_op)."""
    value = keys.get("fsdp_reshard_after_forward", keys.get("fsdp_sharding_strategy", True))
    text = str(value).upper()
    if value is True or text in ("TRUE", "FULL_SHARD", "1"):
        return "full_shard"
    if value is False or text in ("FALSE", "SHARD_GRAD_OP", "2"):
        return "shard_grad_op"
    raise InapplicableOptionError(f"{where}: fsdp sharding {value!r} is not modelled",
                                  hint="memcalc models FULL_SHARD (reshard_after_forward true) and SHARD_GRAD_OP "
                                       "(false); HYBRID_SHARD: give --mesh dp_replicate=R,dp_shard=S.")


def _deepspeed(section: Mapping[str, Any], precision: str, where: str) -> LaunchSetup:
    """The DeepSpeed config accelerate's ``DeepSpeedPlugin`` builds from ``deepspeed_config``
    (or its ``deepspeed_config_file``), with ``mixed_precision``'s 16-bit section."""
    refuse_unknown(section, _DEEPSPEED_KEYS, f"{where} deepspeed_config")
    file = section.get("deepspeed_config_file")
    if file is not None:
        mixed = sorted(set(section) - _LAUNCHER_KEYS - {"deepspeed_config_file"})
        if mixed:  # accelerate refuses these beside a file, which must hold them
            raise InvalidInputError(f"{where}: deepspeed_config_file is given, so {', '.join(mixed)} must be in "
                                    f"that file, not in deepspeed_config (accelerate refuses both)")
        return read_deepspeed(file)
    config: dict[str, Any] = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": section.get("gradient_accumulation_steps", 1),
        "zero_optimization": {
            "stage": section.get("zero_stage", 2),
            "offload_optimizer": {"device": section.get("offload_optimizer_device", "none")},
            "offload_param": {"device": section.get("offload_param_device", "none")},
        },
    }
    if precision in ("fp16", "bf16"):
        config[precision] = {"enabled": True}
    return read_deepspeed(config, source=f"{where} deepspeed_config")

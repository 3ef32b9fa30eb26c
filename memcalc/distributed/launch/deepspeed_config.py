"""A DeepSpeed configuration (``--deepspeed ds.json``, a ``TrainingArguments(deepspeed=...)`` or
accelerate's ``deepspeed_config``) as memcalc's ZeRO setting: :func:`read_deepspeed`.

Every key is read, ignored with a reason, or refused by name (:data:`SECTIONS`); ``"auto"`` is
what Hugging Face's integration (``HfTrainerDeepSpeedConfig``) fills in: the batch, accumulation
and precision from the other options, ``reduce_bucket_size`` from the model's ``hidden_size``
(hidden_size²), ``stage3_prefetch_bucket_size`` (0.9 × hidden_size²) and
``stage3_param_persistence_threshold`` (10 × hidden_size). DeepSpeed itself is not imported (not a
dependency: it builds its ops for a GPU); the defaults are those of
``deepspeed/runtime/zero/config.py``. What each key becomes is the table in docs/launch-configs.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memcalc.core.counts import as_integer
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.launch.setup import AUTO_FROM_HIDDEN, LaunchSetup, load_mapping, refuse_unknown
from memcalc.distributed.vocabulary import ZeroStage3

__all__ = ("IGNORED", "TOP_LEVEL", "ZERO_KEYS", "read_deepspeed")

AUTO = "auto"

#: Top-level keys memcalc reads (the others of :data:`IGNORED` change nothing on the GPU).
TOP_LEVEL = frozenset({"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                       "gradient_accumulation_steps", "fp16", "bf16", "optimizer", "activation_checkpointing",
                       "communication_data_type", "prescale_gradients", "gradient_predivide_factor"})

#: Top-level keys that change nothing a step allocates on the GPU: logging, monitoring, the
#: schedule's numbers, clipping (DeepSpeed clips the partitions in place).
IGNORED = frozenset({"steps_per_print", "wall_clock_breakdown", "dump_state", "flops_profiler", "comms_logger",
                     "tensorboard", "wandb", "csv_monitor", "scheduler", "gradient_clipping",
                     "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown",
                     "seed", "timers", "monitor_config"})

#: ``zero_optimization`` keys memcalc reads or that change nothing on the GPU.
ZERO_KEYS = frozenset({
    "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
    "reduce_scatter", "allgather_partitions", "offload_optimizer", "offload_param", "cpu_offload",
    "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_model_persistence_threshold",
    "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save", "ignore_unused_parameters",
    "load_from_fp32_weights", "elastic_checkpoint", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_gradients", "mics_shard_size", "memory_efficient_linear",
})

_OFFLOAD_KEYS = frozenset({"device", "pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                           "fast_init", "ratio", "pipeline_read", "pipeline_write", "pipeline"})
#: ``stage3_*`` keys → :class:`ZeroStage3`'s fields (deepspeed/runtime/zero/config.py's aliases).
_STAGE3 = {"stage3_prefetch_bucket_size": "prefetch_bucket_size", "stage3_max_live_parameters": "max_live_parameters",
           "stage3_max_reuse_distance": "max_reuse_distance",
           "stage3_param_persistence_threshold": "param_persistence_threshold",
           "stage3_model_persistence_threshold": "model_persistence_threshold"}

_OPTIMIZERS = {"adam": "adam", "adamw": "adamw"}


def read_deepspeed(config: Any, *, source: str | None = None) -> LaunchSetup:
    """The ZeRO setting of a DeepSpeed configuration: a path (``.json``) or a mapping.

    Raises:
        InvalidInputError: an unreadable file, an unknown key (named, with the closest), a value
            of the wrong kind.
        InapplicableOptionError: a setting memcalc does not model (ZeRO stage 0, NVMe or
            parameter offload, DeepSpeed's activation partitioning...), named.
    """
    if isinstance(config, Mapping):
        data, where = dict(config), source or "the DeepSpeed config"
    else:
        data, where = load_mapping(config, "DeepSpeed config", (".json",)), source or f"DeepSpeed config {config}"
    refuse_unknown(data, TOP_LEVEL | IGNORED, where)
    zero = _section(data, "zero_optimization", where)
    refuse_unknown(zero, ZERO_KEYS, f"{where} zero_optimization")
    stage = _stage(zero.get("stage", 0), where)
    notes = [f"ZeRO stage {stage}"]
    distributed: dict[str, Any] = {"strategy": f"zero{stage}"}
    auto_hidden = []
    bucket = zero.get("reduce_bucket_size")
    if bucket == AUTO:
        auto_hidden.append("reduce_bucket_size")
    elif bucket is not None:
        distributed["reduce_bucket_size"] = _count(bucket, "zero_optimization.reduce_bucket_size", where)
    if "allgather_bucket_size" in zero:
        _count(zero["allgather_bucket_size"], "zero_optimization.allgather_bucket_size", where)
        notes.append("allgather_bucket_size: the parameters are all-gathered in place after the step (no memory)")
    overlap = _flag(zero, "overlap_comm", stage == 3, where)
    if overlap and stage < 3:
        distributed["overlap_comm"] = True
    elif overlap:
        notes.append("overlap_comm (ZeRO-3's default) not followed: memcalc's ZeRO-3 has one reduce bucket")
    if not _flag(zero, "contiguous_gradients", True, where) and stage == 2:
        raise InapplicableOptionError(f"{where}: zero_optimization.contiguous_gradients false is not modelled "
                                      f"(memcalc follows DeepSpeed's default, the contiguous gradient partition)")
    if _offload(zero, "offload_optimizer", where) or zero.get("cpu_offload") is True:
        distributed["offload_optimizer"] = True
        notes.append("offload_optimizer cpu")
    offload_param = _offload(zero, "offload_param", where)
    if offload_param and stage < 3:
        raise InapplicableOptionError(f"{where}: offload_param applies to ZeRO stage 3 (its partitioned parameters); "
                                      f"this config's stage is {stage}",
                                      hint="Remove offload_param, or use stage 3.")
    for key, default in (("zero_hpz_partition_size", 1), ("zero_quantized_weights", False),
                         ("zero_quantized_gradients", False), ("mics_shard_size", -1)):
        if zero.get(key, default) not in (default, None):  # ZeRO++ and MiCS partition and gather otherwise
            raise InapplicableOptionError(f"{where}: zero_optimization.{key} {zero[key]!r} is not modelled",
                                          hint=f"Leave {key} out to estimate plain ZeRO.")
    settings: dict[str, Any] = {}
    for key, field in _STAGE3.items():
        if key not in zero:
            continue
        if zero[key] == AUTO and key in AUTO_FROM_HIDDEN:
            if stage == 3:  # trainer_config_finalize fills them for ZeRO-3 only
                auto_hidden.append(key)
        elif zero[key] == AUTO:
            raise InvalidInputError(f"{where}: zero_optimization.{key} is \"auto\", which transformers does not fill",
                                    hint="Give it a number of elements.")
        else:
            settings[field] = _count(zero[key], f"zero_optimization.{key}", where, zero_ok=True)
    if stage == 3:
        distributed["stage3"] = ZeroStage3(**settings, offload_param=offload_param)
        if settings:
            notes.append(", ".join(f"{key} {settings[field]:,}" for key, field in _STAGE3.items() if field in settings))
        if offload_param:
            notes.append("offload_param cpu")
    elif any(key in zero for key in _STAGE3):
        keys = ", ".join(k for k in _STAGE3 if k in zero)
        notes.append(f"{keys}: ZeRO-3's, ignored at stage {stage} (as DeepSpeed does)")
    values = {**_precision(data, where), **_batch(data, where, distributed)}
    if "optimizer" in data:
        values["optimizer"] = _optimizer(data["optimizer"], where)
    _refuse_unmodelled(data, where)
    return LaunchSetup(where, distributed, values, tuple(notes), tuple(auto_hidden))


def _section(data: Mapping[str, Any], name: str, where: str) -> dict[str, Any]:
    section = data.get(name, {})
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise InvalidInputError(f"{where}: {name} must be a mapping, got {section!r}")
    return dict(section)


def _stage(value: Any, where: str) -> int:
    if value not in (0, 1, 2, 3) or isinstance(value, bool):
        raise InvalidInputError(f"{where}: zero_optimization.stage is 0, 1, 2 or 3, got {value!r}")
    if value == 0:
        raise InapplicableOptionError(f"{where}: ZeRO stage 0 (DeepSpeed's data parallelism with its FP16_Optimizer) "
                                      f"is not modelled", hint="Use --strategy ddp, or stage 1, 2 or 3.")
    return int(value)


def _count(value: Any, key: str, where: str, *, zero_ok: bool = False) -> int:
    if isinstance(value, float):  # DeepSpeed's own configs write 5e8
        number = int(value) if value.is_integer() else None
    else:
        number = None if isinstance(value, bool) else as_integer(value)
    if number is None or number < (0 if zero_ok else 1):
        raise InvalidInputError(f"{where}: {key} must be a whole number of elements, got {value!r}")
    return number


def _flag(section: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInputError(f"{where}: zero_optimization.{key} must be true or false, got {value!r}")
    return value


def _offload(zero: Mapping[str, Any], key: str, where: str) -> bool:
    """Whether ``offload_optimizer`` / ``offload_param`` moves to the CPU (NVMe refused)."""
    section = zero.get(key)
    if section is None:
        return False
    if not isinstance(section, Mapping):
        raise InvalidInputError(f"{where}: zero_optimization.{key} must be a mapping, got {section!r}")
    refuse_unknown(section, _OFFLOAD_KEYS, f"{where} zero_optimization.{key}")
    device = str(section.get("device", "none")).lower()
    if device == "nvme":
        raise InapplicableOptionError(f"{where}: zero_optimization.{key}.device nvme is not modelled")
    if device not in ("none", "cpu"):
        raise InvalidInputError(f"{where}: zero_optimization.{key}.device is none, cpu or nvme, got {device!r}")
    return device == "cpu"


def _precision(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``fp16.enabled`` / ``bf16.enabled`` (``"auto"``: the other options' precision, as the
    Trainer fills it in); DeepSpeed then runs the model in 16-bit with fp32 master weights."""
    on = []
    for name in ("fp16", "bf16"):
        section = _section(data, name, where)
        enabled = section.get("enabled", False)
        if enabled == AUTO:
            continue
        if not isinstance(enabled, bool):
            raise InvalidInputError(f"{where}: {name}.enabled must be true, false or \"auto\", got {enabled!r}")
        if enabled:
            on.append(name)
    if len(on) > 1:
        raise InvalidInputError(f"{where}: fp16 and bf16 are both enabled; DeepSpeed takes one")
    return {"precision": f"amp-{on[0]}"} if on else {}


def _batch(data: Mapping[str, Any], where: str, distributed: dict[str, Any]) -> dict[str, Any]:
    """``train_micro_batch_size_per_gpu`` → the batch; ``gradient_accumulation_steps`` → the
    accumulation; ``train_batch_size`` = micro × accumulation × world size → the world size."""
    values: dict[str, Any] = {}
    numbers = {}
    for key, option in (("train_micro_batch_size_per_gpu", "batch_size"),
                        ("gradient_accumulation_steps", "accum_steps"), ("train_batch_size", None)):
        value = data.get(key)
        if value is None or value == AUTO:
            continue
        numbers[key] = _count(value, key, where)
        if option is not None:
            values[option] = numbers[key]
    if "train_batch_size" in numbers and "train_micro_batch_size_per_gpu" in numbers:
        per_step = numbers["train_micro_batch_size_per_gpu"] * numbers.get("gradient_accumulation_steps", 1)
        if numbers["train_batch_size"] % per_step:
            raise InvalidInputError(f"{where}: train_batch_size {numbers['train_batch_size']} is not "
                                    f"train_micro_batch_size_per_gpu × gradient_accumulation_steps × GPUs "
                                    f"({per_step} × N)")
        distributed["world_size"] = numbers["train_batch_size"] // per_step
    return values


def _optimizer(section: Any, where: str) -> str:
    """DeepSpeed's ``optimizer.type``: Adam/AdamW (FusedAdam on the GPU: two fp32 moments, as
    torch's); the others are refused."""
    kind = section.get("type") if isinstance(section, Mapping) else None
    if not isinstance(kind, str):
        raise InvalidInputError(f"{where}: optimizer must be a mapping with a type, got {section!r}")
    found = _OPTIMIZERS.get(kind.lower())
    if found is None:
        raise InapplicableOptionError(f"{where}: optimizer type {kind!r} is not modelled",
                                      hint="memcalc models DeepSpeed's Adam and AdamW (or leave the optimizer "
                                           "out and give --optim).")
    return found


def _refuse_unmodelled(data: Mapping[str, Any], where: str) -> None:
    checkpointing = _section(data, "activation_checkpointing", where)
    on = [key for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
          if checkpointing.get(key)]
    if on:
        raise InapplicableOptionError(f"{where}: activation_checkpointing {', '.join(on)} (DeepSpeed's own "
                                      f"checkpointing, for models that call deepspeed.checkpointing) is not modelled",
                                      hint="Use --checkpoint for the model's own activation checkpointing.")
    for key in ("communication_data_type", "prescale_gradients", "gradient_predivide_factor"):
        value = data.get(key)
        if value not in (None, False, 1, 1.0):
            raise InapplicableOptionError(f"{where}: {key} {value!r} changes the gradients' reduction buffers, "
                                          f"which memcalc does not model")

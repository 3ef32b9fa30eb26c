"""Hugging Face ``TrainingArguments``, read into the step's options.

``memcalc.estimate(model, trainer_args=TrainingArguments(...))`` (CLI: ``--training-args
FILE.json|FILE.yaml``, a file as ``TrainingArguments.to_json_string()`` writes it) estimates
the step ``Trainer`` runs with those arguments; ``loop="trainer"`` alone takes the installed
class's defaults. :func:`read_training_args` reads them — the values the user set over the
defaults of the installed ``TrainingArguments`` dataclass's fields (the class is never
instantiated: its ``__post_init__`` sets up accelerate's device state and refuses ``bf16=True``
on a machine without a bf16 GPU) — and :func:`memcalc.fields.build_step` lays them under the
options the user gave explicitly, which win.

The arguments read (:func:`optimizer_of` for ``optim``) become ``batch_size``,
``accum_steps``, ``precision``, ``checkpoint``, ``optimizer``, ``gpu="cpu"`` and ``liger``;
``parallelism_config`` (accelerate's) the device mesh (:mod:`memcalc.stacks.transformers.parallelism_config`).
Arguments that change memory but that memcalc does not model are refused, naming each
(:data:`REFUSED`). The arguments in :data:`IGNORED` change nothing a step allocates on the
device (logging, saving, the schedule, the data pipeline, evaluation's own settings, settings
of several processes) and are ignored silently. An argument set away from its default that
memcalc does not know is named in the report's note as not read.

Each argument's mapping, and why each ignored one changes nothing: docs/notes/training-args.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from memcalc.core.checkpointing import FULL, OFF, Checkpointing
from memcalc.core.errors import InapplicableOptionError, InvalidInputError, MissingPackageError
from memcalc.core.loop import OptimizerImpl
from memcalc.core.trainer import TrainerArguments
from memcalc.engine.optimizers import Optimizer
from memcalc.stacks.transformers.hub import import_hf
from memcalc.stacks.transformers.parallelism_config import read_parallelism_config

__all__ = ("IGNORED", "MAPPED", "REFUSED", "TrainerSetup", "class_defaults", "load_training_args", "optimizer_of",
           "read_training_args")

#: The arguments that become the step's options (module docstring).
MAPPED = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "activation_checkpointing",
    "activation_checkpointing_kwargs", "gradient_checkpointing", "gradient_checkpointing_kwargs", "optim",
    "optim_args", "use_cpu", "max_grad_norm", "use_liger_kernel", "parallelism_config",
})

#: The arguments that change nothing a step allocates on the device (module docstring).
IGNORED = frozenset({
    # logging, saving, reporting, the hub
    "output_dir", "logging_strategy", "logging_steps", "logging_first_step", "log_on_each_node",
    "logging_nan_inf_filter", "log_level", "log_level_replica", "disable_tqdm", "report_to", "run_name", "project",
    "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "save_only_model", "save_strategy",
    "save_steps", "save_on_each_node", "save_total_limit", "enable_jit_checkpoint", "push_to_hub", "hub_token",
    "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision", "skip_memory_metrics",
    "include_num_input_tokens_seen", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    # the schedule and the optimizer's numbers
    "num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim_target_modules", "seed", "data_seed",
    # the data pipeline
    "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
    "remove_unused_columns", "label_names", "train_sampling_strategy", "length_column_name",
    # evaluation's settings (evaluation itself is refused)
    "eval_steps", "eval_delay", "per_device_eval_batch_size", "prediction_loss_only", "eval_do_concat_batches",
    "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
    "bf16_full_eval", "fp16_full_eval", "do_train", "do_eval", "do_predict",
    # several processes
    "average_tokens_across_devices", "accelerator_config", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "ddp_timeout", "local_rank",
    # the rest
    "tf32", "torch_empty_cache_steps", "use_cache", "fsdp_config", "resume_from_checkpoint",
    "ignore_data_skip", "restore_callback_states_from_checkpoint",
})


def _on(value: Any) -> bool:
    return bool(value)


def _set(value: Any) -> bool:
    return value is not None


def _evaluating(value: Any) -> bool:
    return str(_plain(value)).lower() not in ("no", "")


def _nonzero(value: Any) -> bool:
    return bool(value) and float(value) != 0.0


_COMPILE = "torch.compile fuses kernels and frees their intermediates in its own order; memcalc traces the eager step"
_EVAL = ("evaluation during training runs batches of per_device_eval_batch_size beside the model, its gradients' "
         "buffers and the optimizer state; memcalc estimates the training step")

#: Arguments that change memory in ways memcalc does not model: each with the test of a value
#: that turns it on, and why it is refused (with what to do, where memcalc has another way).
REFUSED: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "torch_compile": (_on, _COMPILE),
    "torch_compile_backend": (_set, _COMPILE),
    "torch_compile_mode": (_set, _COMPILE),
    "liger_kernel_config": (_on, "it chooses which of Liger's kernels are applied; memcalc models the default set "
                                 "(fused linear cross-entropy, RMSNorm, SwiGLU; RoPE as transformers')"),
    "neftune_noise_alpha": (_set, "NEFTune adds noise to the embeddings' output in a forward hook"),
    "auto_find_batch_size": (_on, "the Trainer halves the batch after an out-of-memory error; `memcalc fit` "
                                  "(memcalc.max_batch_size) finds the largest batch that fits"),
    "eval_strategy": (_evaluating, _EVAL),
    "eval_on_start": (_on, _EVAL),
    "label_smoothing_factor": (_nonzero, "the Trainer then computes a label-smoothed loss from the logits itself "
                                         "(LabelSmoother), not the model's own loss"),
    "fsdp": (_on, "FSDP shards the model over several GPUs: estimate it with --strategy fsdp "
                  "(distributed=memcalc.Distributed('fsdp', ...))"),
    "deepspeed": (_on, "DeepSpeed partitions the model's states: give its config as --deepspeed FILE.json "
                       "(deepspeed=...), or --strategy zero1|zero2|zero3"),
    "full_determinism": (_on, "deterministic algorithms choose other kernels, and cuBLAS gets the :16:8 workspace "
                              "(CUBLAS_WORKSPACE_CONFIG)"),
    "debug": (_on, "debug options run hooks on every module (underflow_overflow) or collect metrics"),
}

#: Keys of ``activation_checkpointing_kwargs`` that change nothing memcalc models: the RNG state
#: kept for the recomputation (a few bytes), and checks run on its metadata.
_HARMLESS_CHECKPOINT_KWARGS = frozenset({"preserve_rng_state", "determinism_check", "debug"})


@dataclass(frozen=True)
class TrainerSetup:
    """What the Trainer's arguments decide, as :func:`memcalc.estimate` keywords.

    Attributes:
        values: ``batch_size``, ``accum_steps``, ``precision``, ``checkpoint``, ``optimizer``
            and ``gpu`` (only ``optimizer`` and ``accum_steps`` for the defaults alone: the rest
            of the step is memcalc's own then).
        optimizer_impl: the optimizer's implementation (``auto``: what torch picks).
        record: what was read, for the report.
    """

    values: Mapping[str, Any]
    optimizer_impl: OptimizerImpl
    record: TrainerArguments


def read_training_args(args: Any = None) -> TrainerSetup:
    """The step's options from ``args``: a ``transformers.TrainingArguments`` (or a subclass), a
    mapping of its arguments (as ``to_dict()`` gives them), or the path of a ``.json`` or
    ``.yaml`` file of them; None: the installed class's defaults (``loop="trainer"`` alone).

    Raises:
        MissingPackageError: transformers (or PyYAML, for a YAML file) is not installed.
        InvalidInputError: ``args`` is none of those, or an argument's value is invalid.
        InapplicableOptionError: an argument that changes memory in a way memcalc does not
            model (:data:`REFUSED`), a checkpointing keyword or an optimizer it cannot follow.
    """
    # a file is read before transformers is imported (seconds): a missing or broken file is said at once
    from_file = load_training_args(args) if isinstance(args, (str, os.PathLike)) else None
    transformers = import_hf("transformers", "loop trainer (the Trainer's TrainingArguments)")
    version = transformers.__version__
    defaults = class_defaults(transformers.TrainingArguments)
    if args is None:
        return _defaults_setup(transformers, defaults, f"the TrainingArguments defaults of transformers {version}")
    given, source, own_defaults = ((from_file, str(args), {}) if from_file is not None
                                   else _given_values(transformers, args))
    if not isinstance(args, transformers.TrainingArguments):
        _refuse_unknown(given, defaults, f"training arguments file {args}" if from_file is not None
                        else "trainer_args")
    values = {**defaults, **{k: v for k, v in given.items() if k in defaults}}
    _refuse_unmodelled(values)
    read: list[tuple[str, str]] = []
    options: dict[str, Any] = {
        "batch_size": _count(values, "per_device_train_batch_size"),
        "accum_steps": _count(values, "gradient_accumulation_steps"),
        "precision": _precision(values),
        "checkpoint": _checkpointing(values),
    }
    read.append(("per_device_train_batch_size", f"{options['batch_size']} → batch_size {options['batch_size']}"))
    read.append(("gradient_accumulation_steps", f"{options['accum_steps']} → accum_steps {options['accum_steps']}"))
    half = next((name for name in ("bf16", "fp16") if values.get(name)), None)
    read.append((half or "bf16/fp16", f"→ precision {options['precision']}" if half else "off → precision fp32"))
    checkpointing = options["checkpoint"]
    read.append(("activation_checkpointing", "off" if not checkpointing else "→ checkpoint"
                 + (" (reentrant: use_reentrant=True)" if checkpointing.reentrant else "")))
    optimizer, impl, said = _optimizer(transformers, args, values)
    options["optimizer"] = optimizer
    read.append(("optim", said))
    if values.get("use_liger_kernel"):
        options["liger"] = True
        read.append(("use_liger_kernel", "→ liger"))
    if values.get("use_cpu"):
        options["gpu"] = "cpu"
        read.append(("use_cpu", "→ gpu cpu"))
    unread = _unread(given, defaults, own_defaults)
    # the mesh is not a line of `read`: the estimate is then the --mesh one's, byte for byte
    mesh = read_parallelism_config(values.get("parallelism_config"), "TrainingArguments")
    return TrainerSetup(options, impl, TrainerArguments(source=f"{source} (transformers {version})",
                                                         read=tuple(read), unknown=unread,
                                                         mesh=() if mesh is None else mesh.degrees,
                                                         ddp_find_unused_parameters=_find_unused(values)))


def _find_unused(values: Mapping[str, Any]) -> bool | None:
    """``ddp_find_unused_parameters`` as given (None: unset)."""
    value = values.get("ddp_find_unused_parameters")
    return None if value is None else bool(value)


def _defaults_setup(transformers: ModuleType, defaults: dict[str, Any], source: str) -> TrainerSetup:
    """``loop="trainer"`` alone: the defaults' optimizer and accumulation (the batch, the precision
    and checkpointing stay memcalc's options)."""
    optimizer, impl, said = _optimizer(transformers, None, defaults)
    accum = _count(defaults, "gradient_accumulation_steps")
    read = (("optim", said), ("gradient_accumulation_steps", f"{accum} → accum_steps {accum}"))
    return TrainerSetup({"optimizer": optimizer, "accum_steps": accum}, impl,
                        TrainerArguments(source, read, defaults_only=True))


# ---- the user's arguments ----------------------------------------------------------------------
def load_training_args(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The arguments in a ``.json`` file (``TrainingArguments.to_json_string()``) or a
    ``.yaml``/``.yml`` file (with PyYAML installed), as a mapping of argument to value.

    Raises:
        InvalidInputError: no such file, another extension, or not a mapping of arguments.
        MissingPackageError: a YAML file without PyYAML.
    """
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise InvalidInputError(f"training arguments file {file}: a .json or .yaml file, got "
                                f"{suffix or 'no extension'}",
                                hint="Write it with TrainingArguments.to_json_string() (JSON), or as YAML.")
    if not file.is_file():
        raise InvalidInputError(f"training arguments file not found: {file}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"training arguments file {file} cannot be read: {type(exc).__name__}: "
                                f"{exc.strerror if isinstance(exc, OSError) else exc}") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"training arguments file {file} is not valid JSON: {exc}") from None
    else:
        data = _load_yaml(file, text)
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise InvalidInputError(f"training arguments file {file} must hold a mapping of argument names to values, "
                                f"got {type(data).__name__}",
                                hint='e.g. {"per_device_train_batch_size": 8, "bf16": true}')
    return data


def _load_yaml(file: Path, text: str) -> Any:
    try:
        import yaml
    except ImportError as exc:
        error = MissingPackageError("pyyaml", f"reading the YAML training arguments {file}")
        error.hint = ("Install it with: pip install pyyaml, or give the arguments as JSON "
                      "(TrainingArguments.to_json_string()).")
        raise error from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"training arguments file {file} is not valid YAML: {exc}") from None


def _given_values(transformers: ModuleType, args: Any) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``args`` as a mapping of argument to value, where they came from, and the defaults of the
    class they were made with (a subclass's own arguments have theirs)."""
    if isinstance(args, (str, os.PathLike)):
        return load_training_args(args), str(args), {}
    if isinstance(args, Mapping):
        return dict(args), "your TrainingArguments", {}
    if isinstance(args, transformers.TrainingArguments):
        fields = dataclasses.fields(args)
        name = type(args).__name__
        return {f.name: getattr(args, f.name) for f in fields}, f"your {name}", class_defaults(type(args))
    raise InvalidInputError(f"trainer_args must be a transformers.TrainingArguments, a dict of its arguments or the "
                            f"path of a .json or .yaml file of them; got {type(args).__name__}",
                            hint="e.g. trainer_args=TrainingArguments(per_device_train_batch_size=8, bf16=True)")


def _refuse_unknown(given: Mapping[str, Any], defaults: Mapping[str, Any], source: str) -> None:
    """A file or a dict of arguments holds only TrainingArguments' own: ``TrainingArguments(**it)``
    raises on any other key, and a mistyped one (``gradient_accumulaton_steps``) would otherwise
    leave its argument at the default unnoticed. The names any release has (:data:`MAPPED`,
    :data:`IGNORED`, :data:`REFUSED`) are known too."""
    known = sorted(defaults.keys() | MAPPED | IGNORED | REFUSED.keys())
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], known, n=1)
    others = f" (and {', '.join(repr(n) for n in unknown[1:])})" if unknown[1:] else ""
    raise InvalidInputError(
        f"{source}: TrainingArguments has no argument {unknown[0]!r}{others}"
        + (f"; did you mean {close[0]!r}?" if close else ""),
        hint="TrainingArguments(**arguments) refuses it too. A subclass's own arguments (TRL's SFTConfig: "
             "max_length, packing) are read from the object itself: trainer_args=config in Python.")


def class_defaults(cls: type) -> dict[str, Any]:
    """The defaults of a dataclass's fields, as declared (no instance is made): what TrainingArguments and
    TRL's configs hold for an argument the user did not give."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None
    return out


def _unread(given: Mapping[str, Any], defaults: Mapping[str, Any], own_defaults: Mapping[str, Any]) -> tuple[str, ...]:
    """The arguments set away from their defaults that memcalc did not read: the installed
    class's that it knows nothing of, and those the class does not have (a mapping's are all
    listed: their defaults are unknown)."""
    known = MAPPED | IGNORED | REFUSED.keys()
    unread = []
    for name, value in given.items():
        if name in known:
            continue
        default = defaults.get(name, own_defaults.get(name, _NO_DEFAULT))
        if default is _NO_DEFAULT or not _same(value, default):
            unread.append(name)
    return tuple(unread)


_NO_DEFAULT = object()


def _plain(value: Any) -> Any:
    """An enum's value (``IntervalStrategy.NO`` → ``"no"``), anything else as it is."""
    return value.value if isinstance(value, enum.Enum) else value


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(_plain(value) == _plain(default))
    except Exception:  # values whose == is not a bool (arrays): not the default
        return False


# ---- what each argument becomes -----------------------------------------------------------------
def _refuse_unmodelled(values: Mapping[str, Any]) -> None:
    on = [(name, why) for name, (turned_on, why) in REFUSED.items() if turned_on(values.get(name))]
    if not on:
        return
    listed = "; ".join(f"{name}={_plain(values.get(name))!r}: {why}" for name, why in on)
    raise InapplicableOptionError(f"memcalc does not model these TrainingArguments, which change memory: {listed}",
                                  hint="Leave them at their defaults to estimate the step without them.")


def _count(values: Mapping[str, Any], name: str) -> int:
    value = values.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"TrainingArguments {name} must be an integer ≥ 1, got {value!r}")
    return value


def _precision(values: Mapping[str, Any]) -> str:
    """``bf16``/``fp16``: accelerate's ``mixed_precision``, autocast around the forward (and
    the fp32 copy of the outputs, which the ``trainer`` loop makes)."""
    if values.get("bf16") and values.get("fp16"):
        raise InvalidInputError("TrainingArguments bf16 and fp16 are both set; the Trainer takes one",
                                hint="Set one of them.")
    if values.get("bf16"):
        return "amp-bf16"
    return "amp-fp16" if values.get("fp16") else "fp32"


def _either(values: Mapping[str, Any], name: str, alias: str) -> Any:
    """``name``'s value, else its deprecated ``alias``'s (``TrainingArguments.__post_init__``
    resolves them so: the alias is used only when the new name is not set)."""
    value = values.get(name)
    return values.get(alias) if value is None else value


def _checkpointing(values: Mapping[str, Any]) -> Checkpointing:
    """The Trainer's checkpointing (``activation_checkpointing_enable`` with its kwargs): every
    layer, reentrant where ``use_reentrant=True`` asks (torch's ``CheckpointFunction``, traced as
    it runs); refusing what memcalc's per-block checkpointing cannot follow."""
    if not _either(values, "activation_checkpointing", "gradient_checkpointing"):
        return OFF
    kwargs = _either(values, "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs") or {}
    if isinstance(kwargs, str):  # a JSON string, as TrainingArguments.__post_init__ parses it
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            raise InvalidInputError(f"TrainingArguments activation_checkpointing_kwargs is not a JSON object: "
                                    f"{kwargs!r}") from None
    if not isinstance(kwargs, Mapping):
        raise InvalidInputError(f"TrainingArguments activation_checkpointing_kwargs must be a dict, got {kwargs!r}")
    why = []
    if kwargs.get("every_n_layers", 1) != 1:
        why.append(f"every_n_layers={kwargs['every_n_layers']}: memcalc checkpoints every layer")
    if kwargs.get("offload", False):
        why.append("offload=True: the saved activations held in host memory")
    other = sorted(set(kwargs) - _HARMLESS_CHECKPOINT_KWARGS - {"use_reentrant", "every_n_layers", "offload"})
    why += [f"{key}: not a keyword memcalc knows" for key in other]
    if why:
        raise InapplicableOptionError(f"memcalc cannot follow these activation_checkpointing_kwargs: {'; '.join(why)}",
                                      hint="Leave them out to estimate transformers' checkpointing of every layer "
                                           "(use_reentrant True or False).")
    return replace(FULL, reentrant=bool(kwargs.get("use_reentrant", False)))


def _optimizer(transformers: ModuleType, args: Any, values: Mapping[str, Any]) -> tuple[Optimizer, OptimizerImpl, str]:
    """The optimizer the installed Trainer builds for ``optim`` (``optim_args`` included), as
    memcalc's optimizer, its implementation and a description."""
    names = transformers.training_args.OptimizerNames
    name = str(_plain(values.get("optim")))
    try:
        optim = names(name)
    except ValueError:
        raise InvalidInputError(f"TrainingArguments optim {name!r} is not an optimizer of transformers "
                                f"{transformers.__version__}",
                                hint=f"One of: {', '.join(n.value for n in names)}.") from None
    target = args if isinstance(args, transformers.TrainingArguments) else SimpleNamespace(**{**values, "optim": optim})
    try:
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(target)
    except Exception as exc:  # the library's own refusal (a package it needs, an argument it lacks)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InapplicableOptionError(f"TrainingArguments optim {name!r}: the installed Trainer cannot build it "
                                      f"here ({reason})", hint=_OPTIMIZER_HINT) from exc
    key, impl = optimizer_of(name, cls, kwargs)
    return key, impl, f"{name} → optimizer {key.value}" + ("" if impl is OptimizerImpl.AUTO else f", {impl.value}")


_OPTIMIZER_HINT = ("memcalc follows the Trainer's adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop, "
                   "adamw_bnb_8bit (adamw_8bit), paged_adamw_8bit and paged_adamw_32bit; or give --optim "
                   "(optimizer=...) to estimate with one of memcalc's optimizers instead.")


def optimizer_of(name: str, cls: type, kwargs: Mapping[str, Any]) -> tuple[Optimizer, OptimizerImpl]:
    """memcalc's optimizer and implementation for the class and keywords ``Trainer`` builds for
    ``optim`` ``name``; :class:`InapplicableOptionError` for one memcalc does not model.

    The implementation is what the keywords say (``fused=True``: fused; ``foreach``: foreach or
    the for-loop); none: ``auto``, what torch picks for the device. ``momentum`` makes SGD's a
    momentum buffer; RMSprop's ``momentum`` or ``centered`` and AdamW's ``amsgrad`` add state
    memcalc's optimizers do not have, and are refused.
    """
    impl = (OptimizerImpl.FUSED if kwargs.get("fused") else OptimizerImpl.FOREACH if kwargs.get("foreach")
            else OptimizerImpl.FOR_LOOP if kwargs.get("foreach") is False else OptimizerImpl.AUTO)
    where = f"{cls.__module__}.{cls.__qualname__}"
    refused = None
    if cls is torch.optim.AdamW:
        if not kwargs.get("amsgrad"):
            return Optimizer.ADAMW, impl
        refused = "amsgrad=True keeps a third moment (max_exp_avg_sqs)"
    elif cls is torch.optim.SGD:
        momentum = float(kwargs.get("momentum") or 0.0)
        if not momentum:
            return Optimizer.SGD, impl
        return (Optimizer.SGD_NESTEROV if kwargs.get("nesterov") else Optimizer.SGD_MOMENTUM), impl
    elif cls is torch.optim.Adagrad:
        return Optimizer.ADAGRAD, impl
    elif cls is torch.optim.RMSprop:
        if not float(kwargs.get("momentum") or 0.0) and not kwargs.get("centered"):
            return Optimizer.RMSPROP, impl
        refused = "momentum or centered keeps a momentum buffer or a gradient average memcalc's rmsprop does not"
    elif cls.__module__.startswith("bitsandbytes.") and cls.__qualname__ == "AdamW":
        bits, paged = int(kwargs.get("optim_bits", 32)), bool(kwargs.get("is_paged", False))
        bnb = {(8, False): Optimizer.ADAMW_8BIT, (8, True): Optimizer.PAGED_ADAMW_8BIT,
               (32, True): Optimizer.PAGED_ADAMW_32BIT}.get((bits, paged))
        if bnb is not None:
            return bnb, OptimizerImpl.AUTO
        refused = f"bitsandbytes' AdamW with optim_bits={bits}, is_paged={paged}"
    elif where == "transformers.optimization.Adafactor":
        refused = ("transformers' own Adafactor is not torch.optim.Adafactor, which memcalc models "
                   "(--optim adafactor): it keeps other state and float32 copies of 16-bit parameters")
    raise InapplicableOptionError(f"TrainingArguments optim {name!r} builds {where}"
                                  + (f": {refused}" if refused else ", which memcalc does not model"),
                                  hint=_OPTIMIZER_HINT)

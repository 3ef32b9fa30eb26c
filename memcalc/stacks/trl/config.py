"""TRL's ``SFTConfig`` and ``DPOConfig``, read into the step's options and TRL's own settings.

``--loop trl-sft|trl-dpo --training-args FILE`` (API ``loop="trl-dpo", trainer_args=...``) reads
the config as ``--loop trainer`` reads ``TrainingArguments``: the config classes are
``TrainingArguments`` subclasses, so their inherited arguments go through
:func:`memcalc.stacks.transformers.training_args.read_training_args` (what each becomes is listed
there), over the *TRL class's* defaults — TRL changes two that decide memory: ``bf16`` (None,
which ``_BaseConfig.__post_init__`` turns into ``not fp16``: bf16 autocast) and
``gradient_checkpointing`` (True). Their own arguments are:

* read (:data:`READ`): the ones TRL's ``compute_loss`` and its collators read on every step —
  ``beta``, ``loss_type``, ``loss_weights``, ``ld_alpha``, ``f_divergence_type``,
  ``f_alpha_divergence_coef``, ``label_smoothing``, ``use_weighting``, ``discopop_tau``,
  ``precompute_ref_log_probs`` (DPO), ``completion_only_loss``, ``padding_free`` and ``packing``
  (SFT: BFD packing makes the batch padding-free, each packed row ``seq_len`` tokens),
  ``max_length`` (a cap on the sequence length), ``disable_dropout``;
* ignored (:data:`IGNORED`): the dataset's preparation on the host (``dataset_*``,
  ``truncation_mode``, ``eos_token``, ``pad_token``, ``chat_template_path``, ``shuffle_dataset``,
  ``pad_to_multiple_of``: memcalc's batch has no padding), ``precompute_ref_batch_size`` (the
  precomputation runs before training, beside no optimizer state), model loading
  (``model_init_kwargs``, ``trust_remote_code``), ``eval_packing``;
* refused (:data:`REFUSED`), naming each: what changes memory in a way memcalc does not follow.

The installed config class is never instantiated (``TrainingArguments.__post_init__`` sets up
accelerate's device state and refuses ``bf16=True`` without a bf16 device).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from memcalc.core.errors import InapplicableOptionError, InvalidInputError, MissingPackageError
from memcalc.core.trainer import TrlSettings
from memcalc.stacks.transformers.hub import import_hf
from memcalc.stacks.transformers.training_args import (
    TrainerSetup,
    class_defaults,
    load_training_args,
    read_training_args,
)

__all__ = ("CONFIGS", "IGNORED", "READ", "REFUSED", "TRAINERS", "import_trl", "read_trl_config")

#: The loop's name → TRL's config class.
CONFIGS: Mapping[str, str] = {"trl-sft": "SFTConfig", "trl-dpo": "DPOConfig", "trl-reward": "RewardConfig",
                               "trl-grpo": "GRPOConfig"}
#: The loop's name → the trainer (:class:`~memcalc.core.trainer.TrlSettings`).
TRAINERS: Mapping[str, str] = {"trl-sft": "sft", "trl-dpo": "dpo", "trl-reward": "reward", "trl-grpo": "grpo"}

#: TRL's own arguments that decide the estimated step (module docstring).
READ = frozenset({
    "beta", "loss_type", "loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef",
    "label_smoothing", "use_weighting", "discopop_tau", "precompute_ref_log_probs", "completion_only_loss",
    "max_length", "disable_dropout", "router_aux_loss_coef", "padding_free", "center_rewards_coefficient",
    "packing",
    # GRPOConfig's: the generation (memcalc.stacks.trl.grpo), its scoring and the loss
    "num_generations", "max_completion_length", "generation_batch_size", "steps_per_generation", "temperature",
    "top_p", "top_k", "min_p", "generation_kwargs", "repetition_penalty", "cache_implementation", "num_iterations",
    "epsilon", "epsilon_high", "delta", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "importance_sampling_level", "off_policy_mask_threshold",
    "use_bias_correction_kl", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
    "entropy_coef_delta", "entropy_target", "top_entropy_quantile", "ds3_gather_for_generation",
})

#: TRL's own arguments that change nothing a training step allocates on the device (module docstring).
IGNORED = frozenset({
    "dataset_text_field", "dataset_kwargs", "dataset_num_proc", "eos_token", "pad_token", "truncation_mode",
    "chat_template_path", "shuffle_dataset", "pad_to_multiple_of", "precompute_ref_batch_size",
    "model_init_kwargs", "trust_remote_code", "eval_packing", "packing_strategy",
    "ref_model_mixup_alpha", "ref_model_sync_steps",  # sync_ref_model's, which is refused
    # GRPO: the rewards are user functions on the host (their (rows, functions) float32 tensor is
    # counted, nothing else); evaluation, logging, and vLLM's settings (use_vllm is refused)
    "reward_weights", "scale_rewards", "multi_objective_aggregation", "mask_truncated_completions",
    "num_generations_eval", "chat_template_kwargs", "log_completions",
    "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
    "max_tool_calling_iterations", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
    "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
    "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length",
    "vllm_tensor_parallel_size", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
    "transformers_continuous_batching_config",
})


def _on(value: Any) -> bool:
    return bool(value)


#: TRL's arguments that change memory in ways memcalc does not follow: the test of a value that
#: turns each on, and why.
REFUSED: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "assistant_only_loss": (_on, "the assistant mask comes from the chat template's generation markers"),
    "activation_offloading": (_on, "activation offloading moves the saved activations to host memory "
                                   "(get_act_offloading_ctx_manager)"),
    "sync_ref_model": (_on, "TR-DPO's reference synchronisation runs a callback between steps"),
    "use_vllm": (_on, "vLLM generates the completions in its own engine and memory (colocated: "
                      "vllm_gpu_memory_utilization of the GPU), outside PyTorch's caching allocator"),
    "use_transformers_continuous_batching": (_on, "continuous batching generates through transformers' paged "
                                                  "cache (generate_batch), not generate()"),
    "use_transformers_paged": (_on, "continuous batching generates through transformers' paged cache"),
    "cast_lm_head_to_fp32": (_on, "GRPOTrainer replaces the LM head by a float32 copy"),
    "top_entropy_quantile": (lambda value: value < 1.0, "the high-entropy token mask selects tokens by their "
                                                        "values (a quantile over entropies[mask])"),
}


def import_trl(purpose: str) -> ModuleType:
    """``trl``, or a :class:`MissingPackageError` naming the ``trl`` extra."""
    try:
        import_hf("transformers", purpose)
        import trl
    except ImportError as exc:
        error = MissingPackageError("trl", purpose)
        error.hint = "Install it with: pip install 'memcalc[hf,trl]' (or pip install trl)"
        raise error from exc
    return trl


def read_trl_config(loop: str, args: Any = None) -> TrainerSetup:
    """The step's options and TRL's settings from ``args``: a TRL config object, a mapping of its
    arguments, the path of a ``.json``/``.yaml`` file of them, or None (the class's defaults).

    Raises:
        MissingPackageError: trl is not installed.
        InvalidInputError: an argument the config class does not have, or a config of another trainer.
        InapplicableOptionError: an argument memcalc does not follow (:data:`REFUSED`).
    """
    from_file = load_training_args(args) if isinstance(args, (str, os.PathLike)) else None
    trl = import_trl(f"loop {loop} (TRL's {CONFIGS[loop]})")
    cls = getattr(trl, CONFIGS[loop])
    defaults = class_defaults(cls)
    source = f"{args}" if from_file is not None else f"your {CONFIGS[loop]}"
    if args is None:
        given: dict[str, Any] = {}
        source = f"the {CONFIGS[loop]} defaults of trl {trl.__version__}"
    elif from_file is not None:
        given = dict(from_file)
    elif isinstance(args, Mapping):
        given = dict(args)
    elif dataclasses.is_dataclass(args) and isinstance(args, trl.trainer.base_config._BaseConfig):
        if not isinstance(args, cls):
            raise InvalidInputError(f"loop {loop} reads a {CONFIGS[loop]}; got a {type(args).__name__}",
                                    hint="Give the loop of that config's trainer (trl-sft: SFTConfig, trl-dpo: "
                                         "DPOConfig).")
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    else:
        raise InvalidInputError(f"trainer_args of loop {loop} must be a trl.{CONFIGS[loop]}, a dict of its arguments "
                                f"or the path of a .json or .yaml file of them; got {type(args).__name__}")
    _refuse_unknown(given, defaults, CONFIGS[loop], source)
    values = {**defaults, **given}
    if values.get("bf16") is None:  # _BaseConfig.__post_init__
        values["bf16"] = not values.get("fp16")
    _refuse_unmodelled(values, CONFIGS[loop], given)
    if values.get("packing") and values.get("packing_strategy", "bfd") not in ("bfd", "bfd_split"):
        raise InapplicableOptionError(f"memcalc does not model SFTConfig packing_strategy="
                                      f"{values.get('packing_strategy')!r}: its batch keeps an attention mask",
                                      hint="Use packing_strategy='bfd' (TRL's default).")
    if loop == "trl-grpo":
        _check_grpo(values)
    if loop == "trl-dpo" and values.get("padding_free"):
        raise InapplicableOptionError("memcalc does not model DPOConfig padding_free=True: DPOTrainer's padding-free "
                                      "batch (the chosen and rejected rows end to end in one) is not built",
                                      hint="Leave padding_free at False to estimate the padded batch.")
    transformers = import_hf("transformers", f"loop {loop}")
    base_fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    setup = read_training_args({k: v for k, v in values.items() if k in base_fields})
    max_length = values.get("max_length")
    if loop != "trl-grpo" and isinstance(max_length, int) and not isinstance(max_length, bool):
        # TRL truncates every sequence to max_length: without --seq-len, the longest it lets through
        setup = dataclasses.replace(setup, values={**setup.values, "seq_len": max_length})
    setup = dataclasses.replace(setup, record=dataclasses.replace(
        setup.record, source=f"{source} (trl {trl.__version__})", loop=loop,
        read=(*setup.record.read, *_read_own(values)),
        trl=TrlSettings(TRAINERS[loop],
                        tuple(sorted((k, _hashable(v)) for k, v in values.items() if k in READ)))))
    return setup


def _check_grpo(values: Mapping[str, Any]) -> None:
    """What ``GRPOConfig.__post_init__`` refuses, and the padding memcalc does not follow."""
    if isinstance(values.get("pad_to_multiple_of"), int):  # "auto" is None off Neuron devices
        raise InapplicableOptionError("memcalc does not model GRPOConfig pad_to_multiple_of: the prompts and "
                                      "completions padded to a multiple (memcalc's rows are not padded)",
                                      hint="Leave pad_to_multiple_of at 'auto' (None on a GPU).")
    generations = values.get("num_generations") or 0
    if generations < 2:
        raise InvalidInputError(f"GRPOConfig num_generations must be at least 2 (the advantages compare the "
                                f"completions of one prompt); got {generations}")
    if values.get("generation_batch_size") is not None and values.get("steps_per_generation") is not None:
        raise InvalidInputError("GRPOConfig: generation_batch_size and steps_per_generation cannot both be given",
                                hint="GRPOConfig(...) refuses it too.")
    completion = values.get("max_completion_length")
    if not isinstance(completion, int) or completion < 1:
        raise InvalidInputError(f"GRPOConfig max_completion_length must be a positive number of tokens; got "
                                f"{completion!r}")


def _read_own(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    shown = ("beta", "loss_type", "precompute_ref_log_probs", "completion_only_loss", "max_length", "num_generations",
             "max_completion_length", "num_iterations")
    return [(name, f"{values[name]!r} → seq_len" if name == "max_length" and isinstance(values[name], int)
             else repr(values[name])) for name in shown if name in values]


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return value


def _refuse_unknown(given: Mapping[str, Any], defaults: Mapping[str, Any], name: str, source: str) -> None:
    """``TrlConfig(**arguments)`` refuses a key it does not have; so does memcalc, with a close
    match (``rpo_alpha``, gone from TRL 1.x, names its replacement)."""
    unknown = [key for key in given if key not in defaults]
    if not unknown:
        return
    if unknown[0] == "rpo_alpha":
        raise InvalidInputError(f"{source}: {name} of the installed trl has no argument 'rpo_alpha'",
                                hint="TRL 1.x writes RPO as loss_type=['sigmoid', 'sft'] with loss_weights=[1.0, "
                                     "alpha]: give those.")
    close = difflib.get_close_matches(unknown[0], list(defaults), n=1)
    others = f" (and {', '.join(repr(n) for n in unknown[1:])})" if unknown[1:] else ""
    raise InvalidInputError(f"{source}: {name} has no argument {unknown[0]!r}{others}"
                            + (f"; did you mean {close[0]!r}?" if close else ""),
                            hint=f"{name}(**arguments) refuses it too.")


def _refuse_unmodelled(values: Mapping[str, Any], name: str, given: Mapping[str, Any]) -> None:
    on = [(key, why) for key, (turned_on, why) in REFUSED.items() if key in values and turned_on(values[key])]
    if on:
        listed = "; ".join(f"{key}={values[key]!r}: {why}" for key, why in on)
        raise InapplicableOptionError(f"memcalc does not model these {name} arguments, which change memory: {listed}",
                                      hint="Leave them at their defaults to estimate the step without them.")
    unknown_to_memcalc = [key for key in given if key not in READ | IGNORED | REFUSED.keys()
                          and key not in _base_names()]
    if unknown_to_memcalc:
        raise InapplicableOptionError(f"{name} arguments memcalc does not know: {', '.join(unknown_to_memcalc)} "
                                      f"(a newer trl)",
                                      hint="memcalc follows trl 1.16's SFTConfig, DPOConfig, RewardConfig and "
                                           "GRPOConfig.")


def _base_names() -> frozenset[str]:
    try:
        transformers = import_hf("transformers", "TRL's configs")
    except MissingPackageError:  # trl imports transformers: not reached
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(transformers.TrainingArguments))

"""The options that describe the user's setup rather than the step's shape: the training loop
(``--loop``, ``--keep-grads``, ``--optim-impl``, ``--training-args``), the software stack (``--torch-version``,
``--cuda-version``, ``--context-mib``) and fine-tuning (``--freeze``, ``--lora*``,
``--quant``, ``--double-quant``, ``--kbit-checkpointing``). Each group becomes one object of the API
(:class:`memcalc.Loop`, :class:`memcalc.Stack`, :class:`memcalc.FineTune`); ``--training-args``
is :func:`memcalc.estimate`'s ``trainer_args``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from memcalc.core.finetune import FineTune, KbitCheckpointing, LoRA, Quant
from memcalc.core.loop import Loop, LoopPreset, OptimizerImpl
from memcalc.core.stack import Stack
from memcalc.sources.user_code import load_function

__all__ = ("SETUP_PARAMETERS", "setup_arguments", "setup_options")

#: The command parameters :func:`setup_options` adds (popped by :func:`setup_arguments`).
SETUP_PARAMETERS = ("loop", "keep_grads", "optim_impl", "training_args", "torch_version", "cuda_version",
                    "context_mib", "freeze", "lora", "lora_alpha", "lora_dropout", "lora_targets", "quant",
                    "double_quant", "kbit_checkpointing")


def setup_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--loop``, ``--keep-grads``, ``--optim-impl``, ``--training-args``, the stack and the
    fine-tuning options."""
    presets = ", ".join(p.value for p in LoopPreset)
    options = [
        click.option("--loop", default=None, metavar="NAME|FILE.py:FN",
                     help=f"The training loop: a preset ({presets}; default minimal) or your own "
                          "fn(model, optimizer, batches) in a file or module (README, \"Which loop?\"). trainer: "
                          "Hugging Face Trainer's loop, with the optim (--optim and --optim-impl) and accumulation "
                          "of the installed transformers' TrainingArguments defaults unless you give them. trl-sft, "
                          "trl-dpo, trl-reward: TRL's SFTTrainer, DPOTrainer and RewardTrainer (their own "
                          "compute_loss, on meta), --training-args read as their SFTConfig / DPOConfig / "
                          "RewardConfig; trl-grpo: GRPOTrainer's generation (the model's generate()), scoring and "
                          "compute_loss, --training-args a GRPOConfig, --seq-len the prompt length."),
        click.option("--keep-grads", is_flag=True,
                     help="zero_grad(set_to_none=False): gradients stay allocated for the whole run."),
        click.option("--optim-impl", type=click.Choice([i.value for i in OptimizerImpl]), default=None,
                     help="torch.optim implementation (default auto: what the installed torch picks for the "
                          "target's parameters)."),
        click.option("--training-args", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Hugging Face TrainingArguments in a .json file (as TrainingArguments.to_json_string() "
                          "writes it) or a .yaml one (needs PyYAML), with --loop trainer (an SFTConfig or DPOConfig "
                          "with --loop trl-sft|trl-dpo): they set --batch "
                          "(per_device_train_batch_size), --accum-steps, --precision (bf16/fp16: autocast over the "
                          "weights as loaded; add --weight-dtype bf16 for a model loaded in bf16), --checkpoint, "
                          "--optim and --optim-impl (optim), --gpu cpu (use_cpu); parallelism_config (accelerate's "
                          "ParallelismConfig) the mesh, as --mesh (TRL loops: dp_shard/dp_replicate only; "
                          "docs/launch-configs.md). An option you give with a value "
                          "other than its default replaces the file's. Arguments that change memory in ways memcalc "
                          "does not model (torch_compile, deepspeed, fsdp, evaluation, ...) are refused."),
        click.option("--torch-version", default=None, metavar="X.Y",
                     help="The PyTorch whose kernels are modelled (default: the installed one)."),
        click.option("--cuda-version", default=None, metavar="X.Y",
                     help="The CUDA runtime, for the CUDA context (default: the installed torch's build, 12.x on a "
                          "CPU build)."),
        click.option("--context-mib", type=click.FloatRange(min=0), default=None, metavar="MIB",
                     help="The CUDA context in MiB, overriding memcalc's model of it."),
        click.option("--freeze", multiple=True, metavar="PATTERN",
                     help="Freeze the parameters whose names match this glob (repeatable): no gradient, no state."),
        click.option("--lora", type=click.IntRange(min=1), default=None, metavar="RANK",
                     help="Train LoRA adapters of this rank (the real peft library); the base is frozen."),
        click.option("--lora-alpha", type=float, default=None, help="LoRA alpha (default: PEFT's)."),
        click.option("--lora-dropout", type=click.FloatRange(min=0, max=1, max_open=True), default=0.0,
                     show_default=True, help="LoRA dropout."),
        click.option("--lora-targets", default=None, metavar="NAMES",
                     help="Comma-separated module names to adapt (default: PEFT's for the architecture)."),
        click.option("--quant", type=click.Choice([q.value for q in Quant]), default=None,
                     help="Store the frozen Linear weights quantized as bitsandbytes does (QLoRA: nf4)."),
        click.option("--double-quant", is_flag=True, help="With --quant nf4|fp4: quantize the absmax too."),
        click.option("--kbit-checkpointing", type=click.Choice([k.value for k in KbitCheckpointing]), default=None,
                     help="With --quant and --lora: how the recipe called prepare_model_for_kbit_training: "
                          "use_gradient_checkpointing off, on (PEFT's default: no kwargs; the kind is read off the "
                          "function transformers sets up: reentrant with peft 0.21 on torch 2.13, non-reentrant "
                          "with peft 0.22), or "
                          "on with use_reentrant True (reentrant) or False (non-reentrant). Its checkpointing stays "
                          "on where the loop enables none (the Trainer with gradient_checkpointing=False). Default: "
                          "on with --checkpoint, off without."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def setup_arguments(params: dict[str, Any]) -> dict[str, Any]:
    """Pop :func:`setup_options`' values from a command's ``params`` and return them as
    :func:`memcalc.estimate` keywords (``loop``, ``trainer_args``, ``stack``, ``finetune``;
    absent when default)."""
    values = {name: params.pop(name, None) for name in SETUP_PARAMETERS}
    out: dict[str, Any] = {}
    if values["training_args"] is not None:
        out["trainer_args"] = values["training_args"]
    loop_spec = values["loop"]
    if loop_spec is not None or values["keep_grads"] or values["optim_impl"] is not None:
        # the Trainer's arguments imply its loop: --keep-grads or --optim-impl alone then modify it
        body: Any = LoopPreset.MINIMAL if values["training_args"] is None else LoopPreset.TRAINER
        if loop_spec is not None:
            body = load_function(loop_spec) if ":" in loop_spec else loop_spec
        out["loop"] = Loop(body=body, keep_grads=bool(values["keep_grads"]),
                           optimizer_impl=values["optim_impl"] or OptimizerImpl.AUTO)
    if any(values[k] is not None for k in ("torch_version", "cuda_version", "context_mib")):
        out["stack"] = Stack(torch=values["torch_version"], cuda=values["cuda_version"],
                             context_mib=values["context_mib"])
    lora = None
    if values["lora"] is not None:
        targets = values["lora_targets"]
        lora = LoRA(rank=values["lora"], alpha=values["lora_alpha"], dropout=values["lora_dropout"] or 0.0,
                    targets=tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else None)
    elif values["lora_alpha"] is not None or values["lora_targets"] is not None or values["lora_dropout"]:
        raise click.UsageError("--lora-alpha, --lora-dropout and --lora-targets go with --lora RANK")
    if (values["freeze"] or lora is not None or values["quant"] is not None or values["double_quant"]
            or values["kbit_checkpointing"] is not None):
        out["finetune"] = FineTune(freeze=tuple(values["freeze"] or ()), lora=lora, quant=values["quant"],
                                   double_quant=bool(values["double_quant"]),
                                   kbit_checkpointing=values["kbit_checkpointing"])
    return out

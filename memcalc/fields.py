"""The step's options, listed once: one table of fields from which a user's values become a
:class:`~memcalc.engine.step_spec.Step`.

Each :class:`Field` says how one option is converted (its converter: a string from the command
line or an object from Python in, the step's typed value out, or an error naming the option),
its default, how the command line spells it and what its ``--help`` says. :func:`build_step`
reads the table once per estimate — for :func:`memcalc.estimate`, for the searches'
``**estimate_options`` and for every command of the CLI — then checks the combinations no single
field can judge (an optimizer for an eval step, a KV cache outside inference) and resolves the
software stack. The layers below take the step as it is and never convert again.

Adding an option is one :class:`Field` here (and, where it is offered on the command line of
every estimating command, its :class:`Flag`), one attribute of the ``Step``, one keyword of
:func:`memcalc.estimate` (tests/test_fields.py keeps those two lists equal to this one) and the
engine's use of it.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from memcalc.core.alloc_conf import AllocConf, alloc_conf_from_environment, parse_alloc_conf
from memcalc.core.categories import Mode
from memcalc.core.checkpointing import Checkpointing, parse_checkpointing
from memcalc.core.choices import parse_choice
from memcalc.core.counts import INT64_MAX, as_integer, fits_int64
from memcalc.core.errors import CLI_KEYWORD_HINTS, InapplicableOptionError, InvalidInputError, MissingPackageError
from memcalc.core.finetune import FineTune
from memcalc.core.float8 import RECIPES, Float8, parse_float8
from memcalc.core.gpu import CPU_PROFILE, GENERIC, GpuProfile
from memcalc.core.loop import Loop, LoopPreset, OptimizerImpl
from memcalc.core.losses import LossChoice
from memcalc.core.precision import Precision, WeightDtype
from memcalc.core.stack import Stack
from memcalc.core.trainer import TrainerArguments
from memcalc.core.units import BYTES_FORMS, parse_bytes
from memcalc.engine.optimizers import DEFAULT_OPTIMIZER, Optimizer, spec_for
from memcalc.engine.step_spec import Step, Target
from memcalc.sources.resolve import resolve
from memcalc.stacks.transformers.training_args import read_training_args
from memcalc.stacks.trl.config import read_trl_config
from memcalc.targets.budget import resolve_budget
from memcalc.targets.cuda.gpus.catalogue import catalogue, get_gpu
from memcalc.targets.cuda.gpus.local import names_local_gpu
from memcalc.targets.resolved_stack import resolve_stack

__all__ = ("BUDGET_FORMS", "CPU", "DISTRIBUTED", "FIELDS", "Field", "Flag", "build_step", "check_keywords",
           "positive_int")

#: ``gpu=memcalc.CPU``: estimate what a CPU run of the step allocates (no CUDA kernel choice,
#: no CUDA workspaces) — the figure to compare with a real CPU run.
CPU = "cpu"


@dataclass(frozen=True)
class Flag:
    """How the commands that estimate (``memcalc MODEL``, ``fit``, ``sweep``, ``compare``) offer a
    field: ``choice`` (the values of the field's enum), ``optimizer`` (the registered optimizers),
    ``int`` (at least ``minimum``), ``shape`` (``3,224,224``), ``switch`` (a flag without a value),
    ``text`` (a string its converter reads; with ``bare``, the value may be left out) or ``budget``
    (a search's capacity: one of the flags of :data:`BUDGET_FORMS`).

    A ``per_command`` flag is added by each command in the form it takes
    (:func:`memcalc.cli.options.field_option`: one value, or a comma-separated list for a sweep);
    the others every estimating command adds alike (:func:`memcalc.cli.options.step_options`)."""

    kind: Literal["choice", "optimizer", "int", "shape", "switch", "text", "budget"]
    minimum: int | None = None
    metavar: str | None = None  # a value's name in --help (a per_command flag's: a text value's, a list item's)
    show_default: bool = False
    #: A ``text`` flag's value when it is given bare (``--checkpoint`` alone: ``full``); None: a
    #: value is required.
    bare: str | None = None
    short: str | None = None  # a one-letter spelling (``-b``)
    per_command: bool = False
    #: The command line's default when the field's own is None (``--batch`` 1, ``--optim adam``).
    default: Any = None
    #: The list form's example (``1,16,64,256``); a choice lists its values instead.
    example: str | None = None


@dataclass(frozen=True)
class Field:
    """One option of the step.

    Attributes:
        name: the keyword of :func:`memcalc.estimate` (and, unless ``sets`` says otherwise, the
            :class:`~memcalc.engine.step_spec.Step` attribute it fills).
        convert: the user's value (as given, or the default) → the step's value; raises an
            error naming the option. Returns one value per name of ``sets``.
        default: the value when the option is not given (before conversion).
        flag: how the command line spells it (error messages name it too).
        help: what ``--help`` says of it.
        cli: how the command line offers it (:class:`Flag`); None: a command offers it in a
            form of its own (a budget, a group of options), or none does.
        choices: the enum of its values, for a ``choice`` flag and its converter.
        sets: the step attributes it fills, in the order ``convert`` returns them.
        searched: why a search (:func:`memcalc.max_batch_size`, :func:`memcalc.sweep`) does not
            take it among its ``**estimate_options``; None: it does.
    """

    name: str
    convert: Callable[[Any, Field], Any]
    default: Any = None
    flag: str | None = None
    help: str = ""
    cli: Flag | None = None
    choices: type[enum.Enum] | None = None
    sets: tuple[str, ...] = ()
    searched: str | None = None

    @property
    def attributes(self) -> tuple[str, ...]:
        """The step attributes this field fills."""
        return self.sets or (self.name,)

    @property
    def spelled(self) -> str:
        """``name (--flag)``, as error messages name the option."""
        return f"{self.name} ({self.flag})" if self.flag else self.name


# --------------------------------------------------------------------------------------------
# Converters: one per kind of value
# --------------------------------------------------------------------------------------------


def _integer(value: object, minimum: int) -> int | None:
    """``value`` as an ``int`` when it is an integer (NumPy's included) from ``minimum`` to
    :data:`~memcalc.core.counts.INT64_MAX`; else None. ``True`` and ``64.0`` are not counts."""
    number = as_integer(value)
    return number if number is not None and minimum <= number and fits_int64(number) else None


def _not_a_count(value: Any, name: str, flag: str | None, minimum: int, what: str = "an integer",
                 hint: str | None = None) -> InvalidInputError:
    """The error of a count out of range or not an integer, naming the option and the range."""
    number = as_integer(value)
    kind = "" if number is not None else f" ({type(value).__name__})"
    spelled = f"{name}{f' ({flag})' if flag else ''}"
    if number is not None and not fits_int64(number):
        return InvalidInputError(f"{spelled} must be at most {INT64_MAX:,} (2**63 - 1, the largest size PyTorch "
                                 f"holds); got {number:,}", hint=hint)
    least = "at least 1" if minimum == 1 else f"≥ {minimum}"
    return InvalidInputError(f"{spelled} must be {what}, {least}; got {value!r}{kind}", hint=hint)


def positive_int(value: Any, name: str, flag: str | None) -> Any:
    """``value`` (as an ``int``) when it is None or an integer from 1 to
    :data:`~memcalc.core.counts.INT64_MAX`; else :class:`InvalidInputError` naming it."""
    if value is None:
        return None
    number = _integer(value, 1)
    if number is None:
        raise _not_a_count(value, name, flag, 1)
    return number


def _positive_int(value: Any, field: Field) -> int | None:
    """None, or an integer ≥ 1."""
    return positive_int(value, field.name, field.flag)  # type: ignore[no-any-return]  # checked


def _count(value: Any, field: Field) -> int:
    """An integer ≥ 1 (never None: the default is 1)."""
    number = _integer(value, 1)
    if number is None:
        raise _not_a_count(value, field.name, field.flag, 1)
    return number


def _token_count(value: Any, field: Field, minimum: int, hint: str) -> int | None:
    """None, or a number of tokens ≥ ``minimum``; the error's hint shows the flag in use."""
    if value is None:
        return None
    number = _integer(value, minimum)
    if number is None:
        raise _not_a_count(value, field.name, field.flag, minimum, "a number of tokens to generate", hint=hint)
    return number


def _tokens(value: Any, field: Field) -> int | None:
    """None, or a number of tokens ≥ 0 (0: a KV cache for the prompt alone)."""
    return _token_count(value, field, 0, "e.g. --mode inference --kv-cache 256")


def _new_tokens(value: Any, field: Field) -> int | None:
    """None, or a number of tokens ≥ 1 (a generation makes at least one)."""
    return _token_count(value, field, 1, "e.g. --mode generate --seq-len 512 --new-tokens 128")


def _switch(value: Any, field: Field) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{field.name} must be True or False, got {value!r}")
    return value


def _checkpointing(value: Any, field: Field) -> Checkpointing:
    return parse_checkpointing(value, field.name)


def _float8(value: Any, field: Field) -> Float8 | None:
    return parse_float8(value, field.name)


def _choice(value: Any, field: Field) -> Any:
    """A member of the field's enum; None stays None where None is the field's default (it has
    a meaning of its own there: the model's loss, the dtype the precision implies)."""
    assert field.choices is not None
    return None if value is None and field.default is None else parse_choice(field.choices, value, field.name)


def _shape(shape: Any, field: Field) -> tuple[int, ...] | None:
    """One sample's shape as a tuple of positive integers (None: the model's default)."""
    if shape is None:
        return None
    given = tuple(shape) if isinstance(shape, Iterable) and not isinstance(shape, (str, bytes)) else ()
    dims = tuple(_integer(d, 1) for d in given)
    if not dims or None in dims:
        bad = next((d for d in given if as_integer(d) is not None and not fits_int64(as_integer(d) or 0)), None)
        beyond = f": {bad:,} is more than {INT64_MAX:,} (2**63 - 1, the largest size PyTorch holds)" if bad else ""
        raise InvalidInputError(f"input_shape must be one sample's shape, a sequence of positive integers without "
                                f"the batch dimension; got {shape!r}{beyond}",
                                hint="e.g. input_shape=(3, 224, 224) or (1024,)")
    return dims  # type: ignore[return-value]  # checked: no None


def _as_given(value: Any, field: Field) -> Any:
    """Taken as it is: the model's source judges it when it resolves the model."""
    return value


def _optimizer(value: Any, field: Field) -> Any:
    try:
        return spec_for(DEFAULT_OPTIMIZER if value is None else value)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


def _loss(loss: Any, field: Field) -> tuple[LossChoice | None, Any]:
    """A loss name, or the user's own loss function."""
    if loss is None:
        return None, None
    if isinstance(loss, str):
        return parse_choice(LossChoice, loss, "loss"), None
    if callable(loss):
        return None, loss
    raise InvalidInputError(f"loss must be a loss name or a function of the output, got {type(loss).__name__}",
                            hint=f"one of: {', '.join(c.value for c in LossChoice)}, or loss=my_loss")


def _gpu(gpu: Any, field: Field) -> tuple[GpuProfile, bool, Target]:
    """The GPU's profile (the generic one when none is named), whether one was named, and the
    target (CUDA, or the CPU)."""
    if gpu is None:
        return GENERIC, False, Target.CUDA
    if isinstance(gpu, GpuProfile):
        if gpu.is_cpu:  # a search's CPU budget hands its profile on
            return CPU_PROFILE, False, Target.CPU
        return gpu, gpu is not GENERIC, Target.CUDA
    if not isinstance(gpu, str):
        raise InvalidInputError(f"gpu must be a GPU name or a GpuProfile, got {type(gpu).__name__} {gpu!r}",
                                hint="Known GPUs: " + ", ".join(g.key for g in catalogue()) + ".")
    if gpu.strip().lower() == CPU:
        return CPU_PROFILE, False, Target.CPU
    return get_gpu(gpu), True, Target.CUDA


def _capacity(capacity: Any, field: Field) -> int | None:
    if capacity is None:
        return None
    try:
        return parse_bytes(capacity)
    except ValueError:
        raise InvalidInputError(f"capacity must be a positive number of bytes, got {capacity!r}",
                                hint=f"A capacity is {BYTES_FORMS}.") from None


def _loop(value: Any, field: Field) -> Loop:
    return Loop.of(value)


def _stack(stack: Any, field: Field) -> Stack:
    if stack is not None and not isinstance(stack, Stack):
        raise InvalidInputError(f"stack must be a memcalc.Stack(...), got {type(stack).__name__}",
                                hint='e.g. stack=memcalc.Stack(torch="2.4", cuda="12.1")')
    return stack or Stack()


def _trainer_args(value: Any, field: Field) -> TrainerArguments | None:
    """What :func:`build_step` read from the Trainer's arguments before the other fields were
    converted (they fill those fields), or None."""
    if value is None or isinstance(value, TrainerArguments):
        return value
    raise InvalidInputError(f"trainer_args were not read: got {type(value).__name__}",
                            hint="Give them to memcalc.estimate() or memcalc.fields.build_step(), which read them.")


def _finetune(finetune: Any, field: Field) -> FineTune:
    if finetune is not None and not isinstance(finetune, FineTune):
        raise InvalidInputError(f"finetune must be a memcalc.FineTune(...), got {type(finetune).__name__}",
                                hint='e.g. finetune=memcalc.FineTune(lora=memcalc.LoRA(16), quant="nf4")')
    return finetune or FineTune()


def _alloc_conf(value: Any, field: Field) -> AllocConf:
    """The allocator's settings: as given (a ``PYTORCH_CUDA_ALLOC_CONF`` string or an
    :class:`AllocConf`), else the environment's, as the job launched from it would read them."""
    if value is None:
        return alloc_conf_from_environment()
    if isinstance(value, AllocConf):
        return value
    return parse_alloc_conf(value, source=field.spelled)


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

_FIELDS = (
    Field("batch_size", _positive_int, flag="--batch", help="Batch size (samples per step).",
          searched="the search sets the batch size",
          cli=Flag("int", minimum=1, short="-b", show_default=True, per_command=True, default=1,
                   metavar="N", example="1,16,64,256")),
    Field("input_shape", _shape, flag="--input-shape",
          help="Shape of one sample, without the batch dimension, e.g. 3,224,224.", cli=Flag("shape")),
    Field("seq_len", _positive_int, flag="--seq-len", help="Sequence length for token models.",
          cli=Flag("int", minimum=1)),
    Field("inputs", _as_given, searched="the search makes inputs at each batch size: give input_shape or seq_len"),
    Field("mode", _choice, Mode.TRAIN, flag="--mode", choices=Mode, cli=Flag("choice", show_default=True),
          help="train: forward, loss, backward, optimizer step; eval: forward under no_grad; "
               "inference: forward under inference_mode; generate: the model's own generate() of "
               "--new-tokens tokens after a --seq-len prompt (Hugging Face causal LMs)."),
    Field("optimizer", _optimizer, flag="--optim", searched="give optimizers=[...]",
          cli=Flag("optimizer", show_default=True, per_command=True, default=DEFAULT_OPTIMIZER.value,
                   metavar="OPTIM"),
          help="Optimizer (training only); its state is created by the real torch.optim class."),
    Field("precision", _choice, Precision.FP32, flag="--precision", choices=Precision,
          searched="give precisions=[...]", cli=Flag("choice", show_default=True, per_command=True,
                                                       metavar="PRECISION"),
          help="fp32; amp-fp16/amp-bf16: CUDA autocast (fp32 master weights and optimizer state); "
               "fp16/bf16: the whole model in that dtype."),
    Field("weight_dtype", _choice, flag="--weight-dtype", choices=WeightDtype, cli=Flag("choice"),
          help="The dtype the parameters are stored in (default: what --precision implies); their gradients and "
               "optimizer state follow it. bf16 with --precision amp-bf16: a model loaded in bf16 and trained "
               "under autocast (Hugging Face Trainer's bf16=True on a model loaded with dtype=torch.bfloat16)."),
    Field("gpu", _gpu, flag="--gpu", sets=("gpu", "gpu_named", "target"),
          cli=Flag("text", metavar="NAME", per_command=True),
          help="A GPU from the catalogue (h100-80gb, a100-40gb, t4, ...): kernel choices, workspaces, "
               "its CUDA context, and whether the step fits."),
    Field("checkpoint", _checkpointing, False, flag="--checkpoint",
          cli=Flag("text", metavar="[full|selective-op|every:N|auto]", bare="full"),
          help="Activation checkpointing of the blocks (zoo models with blocks, Hugging Face layers): full "
               "(also --checkpoint alone) every block; selective-op every block, saving the outputs of "
               "torchtitan's op list (matmuls but every second one, attention, max) and recomputing the "
               "rest; every:N every Nth block; auto the setting among those whose peak fits the budget (--gpu's "
               "memory or --capacity) with the least recomputation."),
    Field("compile", _switch, False, flag="--compile", cli=Flag("switch"),
          help="The forward compiled by torch.compile (Inductor), as the real stack runs it: AOTAutograd's "
               "min-cut partitioner decides what is saved for backward (under "
               "torch._functorch.config.activation_memory_budget), Inductor's fused kernels and buffer reuse what "
               "is allocated; under amp the autocast casts are in the graph; under ddp/fsdp each block is compiled "
               "on its own (torchtitan's apply_compile). Training steps."),
    Field("float8", _float8, flag="--float8", cli=Flag("text", metavar="[" + "|".join(RECIPES) + "]"),
          help="Float8 training of the nn.Linear layers by torchao's convert_to_float8_training (tensorwise: one "
               "scale per tensor; rowwise: one per row), traced as torchao runs it: float8 casts of input, weight "
               "and grad_output, torch._scaled_mm. Needs torchao and an sm89+ GPU (--gpu h100-80gb, l40s, ...)."),
    Field("float8_all_gather", _switch, False, flag="--float8-all-gather", cli=Flag("switch"),
          help="With --float8 tensorwise under --strategy fsdp: FSDP2 all-gathers the float8 weights (torchao's "
               "enable_fsdp_float8_all_gather, torchtitan's float8.enable_fsdp_float8_all_gather), 1 byte per "
               "element, cast on each shard by torchao's fsdp_pre_all_gather."),
    Field("liger", _switch, False, flag="--liger", cli=Flag("switch"),
          help="Liger kernels on a Hugging Face causal LM (use_liger_kernel=True): fused linear cross-entropy "
               "(the logits made a chunk at a time), RMSNorm and SwiGLU, modelled from Liger-Kernel's code "
               "(Triton only: not traced). Llama, Mistral, Qwen2/3; training."),
    Field("accum_steps", _count, 1, flag="--accum-steps", cli=Flag("int", minimum=1, show_default=True),
          help="Gradient accumulation: micro-batches of --batch per optimizer step."),
    Field("kv_cache", _tokens, flag="--kv-cache", cli=Flag("int", minimum=0, metavar="TOKENS"),
          help="With --mode inference: a KV cache for the prompt plus TOKENS generated tokens "
               "(decoder language models)."),
    Field("new_tokens", _new_tokens, flag="--new-tokens", cli=Flag("int", minimum=1, metavar="TOKENS"),
          help="With --mode generate: the tokens generate() makes after the prompt (--seq-len), its "
               "max_new_tokens (Hugging Face causal language models)."),
    Field("loss", _loss, flag="--loss", choices=LossChoice, sets=("loss", "loss_fn"), cli=Flag("choice"),
          help="Loss to train with (training only; default: the zoo entry's, else auto: cross-entropy "
               "for (B, C) outputs, the output's mean otherwise)."),
    Field("capacity", _capacity, searched="the budget is the capacity", cli=Flag("budget", per_command=True),
          help="Bytes the caching allocator may reserve, overriding the GPU's."),
    # groups of options, each one object (memcalc.cli.setup offers each as several flags)
    Field("loop", _loop, help="The training loop around the model (--loop, --keep-grads, --optim-impl)."),
    Field("stack", _stack, help="The PyTorch and CUDA versions assumed (--torch-version, --cuda-version, "
                                "--context-mib)."),
    Field("finetune", _finetune, help="Frozen parameters, LoRA adapters and a quantized base (--freeze, --lora*, "
                                      "--quant, --double-quant)."),
    Field("trainer_args", _trainer_args,
          help="Hugging Face Trainer's arguments (--training-args FILE.json|.yaml): a transformers.TrainingArguments, "
               "a dict of its arguments or such a file. They set the batch (per_device_train_batch_size), "
               "accumulation, precision (bf16/fp16: autocast over the weights as loaded; give weight_dtype bf16 for "
               "a model loaded in bf16), checkpointing and the optimizer with its implementation (optim), and the "
               "trainer loop; an option given with a value other than its default replaces theirs."),
    # issue 38: the allocator's settings (PYTORCH_CUDA_ALLOC_CONF)
    Field("alloc_conf", _alloc_conf, flag="--alloc-conf", cli=Flag("text", metavar="SETTINGS"),
          help="The CUDA caching allocator's settings, as PYTORCH_CUDA_ALLOC_CONF spells them, e.g. "
               "expandable_segments:True,max_split_size_mb:512 (default: the environment's PYTORCH_CUDA_ALLOC_CONF "
               "or PYTORCH_ALLOC_CONF, as the real job reads them)."),
    Field("time", _switch, False, flag="--time", sets=("record_costs",),
          searched="time its answer with memcalc.step_time(result.report)",
          help="Also estimate the step time on --gpu: samples/s and tokens/s beside the memory."),
)

#: A ``budget`` flag's forms on a search's command line (``fit``, ``sweep``), one of them given:
#: :func:`memcalc.targets.budget.resolve_budget`'s keyword → (flag, metavar, help; ``{bytes_forms}``
#: is the command line's spelling of bytes).
BUDGET_FORMS: Mapping[str, tuple[str, str | None, str]] = {
    "gpu": ("--gpu", "NAME", "A GPU model (a100-40gb, h100-80gb, ...): its memory minus the CUDA context."),
    "budget": ("--budget", None, "Bytes the step may use, nothing subtracted: {bytes_forms}."),
    "device": ("--device", "auto|cuda:N", "A GPU of this machine: its free memory minus a new process's CUDA "
                                          "context (auto: the one with the most free memory)."),
}

#: Every option of the step, by its keyword, in the order they are converted.
FIELDS: Mapping[str, Field] = {f.name: f for f in _FIELDS}

#: :func:`memcalc.estimate`'s keyword for the multi-GPU setting, which is not one GPU's step
#: (:class:`memcalc.Distributed`): the searches pass it on beside the fields.
DISTRIBUTED = "distributed"

#: :func:`memcalc.estimate`'s keywords of a launch configuration (accelerate's config file, a
#: DeepSpeed config, the world size of one that does not say it): read into ``distributed``
#: and laid under the fields (:mod:`memcalc.distributed.launch`).
LAUNCH = ("accelerate_config", "deepspeed", "world_size")


# --------------------------------------------------------------------------------------------
# Building the step
# --------------------------------------------------------------------------------------------


def build_step(model: Any = None, /, **values: Any) -> Step:
    """The :class:`~memcalc.engine.step_spec.Step` of ``model`` with ``values`` (the keywords of
    :func:`memcalc.estimate` but ``distributed``), each converted once by its field.

    ``gpu="auto"``, ``"cuda"`` or ``"cuda:N"`` is this machine's GPU: its catalogue profile
    and, unless a capacity is given, its free memory less a new process's CUDA context; a note
    in the step (and so in the report) says which. A named GPU's usable memory is the capacity
    when none is given. The stack is resolved to concrete versions, and the GPU's CUDA context
    to those versions.

    Raises:
        InvalidInputError: an unknown keyword or an invalid value, naming the option.
        InapplicableOptionError: an option the step would ignore (an optimizer in eval, ...).
    """
    unknown = [name for name in values if name not in FIELDS]
    if unknown:
        raise InvalidInputError(f"unknown step option {unknown[0]!r}", hint=f"The options: {', '.join(FIELDS)}.")
    optimizer_given = values.get("optimizer") is not None  # by the user, not by the Trainer's arguments
    values = _with_trainer_args(values)
    gpu, capacity, note = _local_gpu(values.get("gpu"), values.get("capacity"), values.get("stack"))
    given = {**values, "gpu": gpu, "capacity": capacity}
    converted: dict[str, Any] = {}
    for field in _FIELDS:
        value = field.convert(given.get(field.name, field.default), field)
        converted.update(zip(field.attributes, value if len(field.attributes) > 1 else (value,), strict=True))
    trainer: TrainerArguments | None = converted["trainer_args"]
    notes = (*(() if note is None else (note,)), *(() if trainer is None else (trainer.describe(),)))
    step = Step(model=model, resolver=resolve, notes=notes, **converted)
    _check_combinations(step, optimizer_given=optimizer_given)
    if step.float8_all_gather and step.float8 is not None:  # _check_float8 refused it without float8
        step = replace(step, float8=step.float8.with_all_gather())
    # the stack, resolved once: concrete versions, and the GPU's context under them
    versions = resolve_stack(step.stack)
    step = replace(step, stack=versions.core, gpu=versions.apply(step.gpu) if step.emulate_cuda else step.gpu)
    if step.capacity is None and step.gpu_named:
        step = replace(step, capacity=step.gpu.usable_memory)
    return step


def _given(values: Mapping[str, Any], name: str) -> bool:
    """Whether the user gave option ``name`` a value of their own: one other than its default
    (an option at its default, given or not, takes the Trainer's arguments' value)."""
    value = values.get(name)
    default = FIELDS[name].default
    if value is None:
        return False
    return default is None or not _equal(value, default)


def _equal(a: Any, b: Any) -> bool:
    """Two option values alike, a string and its enum member included (``"fp32"``, ``Precision.FP32``)."""
    plain = [x.value if isinstance(x, enum.Enum) else x for x in (a, b)]
    return bool(plain[0] == plain[1])


def _with_trainer_args(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the Trainer's arguments laid under them, for the trainer loop.

    ``trainer_args`` (the user's TrainingArguments), or ``loop="trainer"`` alone (the installed
    TrainingArguments' defaults: the optimizer and accumulation), set the options the user left
    at their defaults (:func:`_given`); the options the user gave win, and the record says which
    they replaced. The loop becomes the trainer preset, in the optimizer implementation the
    ``optim`` argument implies unless the user chose another optimizer (which brings its own
    implementation, ``auto`` by default) or the implementation.

    Raises:
        InapplicableOptionError: ``trainer_args`` beside a loop other than the trainer's.
    """
    args, loop_value = values.get("trainer_args"), values.get("loop")
    loop = Loop.of(loop_value)
    if args is None and (loop.preset is None or not loop.preset.is_trainer):
        return values
    if args is not None and loop_value is not None and (loop.preset is None or not loop.preset.is_trainer):
        raise InapplicableOptionError(
            f"trainer_args (--training-args) describe Hugging Face Trainer's loop; the loop is {loop.name}",
            hint="Leave the loop out (the Trainer's arguments imply loop trainer), give loop "
                 "memcalc.Loop('trainer', ...), or a TRL trainer's loop (trl-sft, trl-dpo, trl-reward, trl-grpo) "
                 "for a TRL config.")
    preset = loop.preset if loop.preset is not None and loop.preset.is_trl else LoopPreset.TRAINER
    try:
        setup = read_trl_config(preset.value, args) if preset.is_trl else read_training_args(args)
    except MissingPackageError:
        if args is not None or preset.is_trl:
            raise
        # loop="trainer" alone, without transformers: the preset's loop (clipping, outputs
        # dropped) with memcalc's own options, as before the defaults were read from the class
        out = dict(values)
        out["loop"] = replace(loop, body=LoopPreset.TRAINER)
        out["trainer_args"] = TrainerArguments(
            "memcalc's own options (transformers is not installed, so its TrainingArguments defaults — the "
            "optimizer adamw_torch_fused among them — were not read; give --optim adamw --optim-impl fused "
            "for that default)", defaults_only=True)
        return out
    out = dict(values)
    replaced = []
    for name, value in setup.values.items():
        mine = values.get("inputs") if name == "batch_size" and values.get("inputs") is not None else None
        if mine is None and not _given(values, name):
            out[name] = value
        elif mine is not None or not _equal(values[name], value):
            replaced.append(f"{name} (inputs)" if mine is not None else name)
    theirs = setup.values["optimizer"]
    if not _given(values, "optimizer") or _equal(values["optimizer"], theirs):  # their optimizer, their implementation
        if loop.optimizer_impl is OptimizerImpl.AUTO:
            loop = replace(loop, optimizer_impl=setup.optimizer_impl)
        elif loop.optimizer_impl is not setup.optimizer_impl:
            replaced.append("optimizer_impl")
    out["loop"] = replace(loop, body=preset)
    out["trainer_args"] = replace(setup.record, overridden=tuple(replaced))
    return out


def check_keywords(function: str, keywords: Mapping[str, Any], own: Sequence[str] = ()) -> None:
    """Every keyword of a search's ``**estimate_options`` is an option of :func:`memcalc.estimate`
    that the search does not set itself; else :class:`InvalidInputError` naming it (and a
    close match).

    Args:
        function: the search, as the user called it (``"max_batch_size"``).
        keywords: its ``**estimate_options``.
        own: the search's own parameters (``gpu``, ``time``...), left out of the hint.
    """
    takes = [name for name, field in FIELDS.items() if field.searched is None and name not in own]
    takes.append(DISTRIBUTED)
    for name in keywords:
        field = FIELDS.get(name)
        if field is not None and field.searched is not None:
            raise InvalidInputError(f"{function}() does not take {name}: {field.searched}")
        if name not in takes:
            close = difflib.get_close_matches(name, takes, n=1)
            cli = CLI_KEYWORD_HINTS.get(name)
            raise InvalidInputError(f"{function}() got an unknown argument {name!r}"
                                    + (f"; did you mean {close[0]!r}?" if close and cli is None else ""),
                                    hint=(f"{cli[0].upper()}{cli[1:]}. " if cli else "")
                                    + f"The estimate options it takes: {', '.join(takes)}.")


def _check_generation(step: Step) -> None:
    """``new_tokens`` goes with mode generate, and mode generate with it; generate() keeps its
    own cache, so a static one (``kv_cache``) does not apply to it."""
    mode, new_tokens = step.mode, step.new_tokens
    if mode is Mode.GENERATE and new_tokens is None:
        raise InvalidInputError("mode generate needs the number of tokens to generate (new_tokens, --new-tokens)",
                                hint="e.g. --mode generate --seq-len 512 --new-tokens 128: a 512-token prompt, "
                                     "128 new tokens")
    if step.kv_cache is not None and mode is Mode.GENERATE:
        raise InapplicableOptionError(
            "kv_cache (--kv-cache) is the static cache of one inference forward; mode generate follows the cache "
            "generate() keeps itself (a DynamicCache growing by one token per step)",
            hint="Drop --kv-cache: --new-tokens says how many tokens generate() makes.")
    if new_tokens is not None and mode is not Mode.GENERATE:
        raise InapplicableOptionError(f"new_tokens (--new-tokens) needs mode generate; the mode is {mode.value}",
                                      hint="e.g. --mode generate --new-tokens 128")


def _check_combinations(step: Step, *, optimizer_given: bool) -> None:
    """What no single field can judge: options a step of this mode would ignore, and inputs
    whose batch contradicts ``batch_size``."""
    _check_inputs_batch(step.inputs, step.batch_size)
    _check_weight_dtype(step)
    _check_generation(step)
    mode = step.mode
    if step.kv_cache is not None and mode is not Mode.INFERENCE:
        # eval runs the forward under no_grad without a cache: the tokens would be ignored
        raise InapplicableOptionError(f"kv_cache (--kv-cache) needs mode inference; the mode is {mode.value}",
                                      hint="e.g. --mode inference --kv-cache 256")
    _check_float8(step)
    if step.compile and mode is not Mode.TRAIN:
        raise InapplicableOptionError(f"compile (--compile) is modelled for training steps (mode train); the mode "
                                      f"is {mode.value}", hint="Leave out --compile, or give mode train.")
    if mode is Mode.TRAIN:
        return
    if step.trainer_args is not None and not step.trainer_args.defaults_only:
        raise InapplicableOptionError(f"trainer_args (--training-args) describe a training run (mode train); "
                                      f"the mode is {mode.value}", hint="Leave them out, or give mode train.")
    if optimizer_given and step.optimizer_key != Optimizer.NONE:
        raise InapplicableOptionError(f"optimizer (--optim) applies to training (mode train); a mode "
                                      f"{mode.value} step runs no optimizer", hint="Leave the optimizer out.")
    if step.loss is not None or step.loss_fn is not None:
        raise InapplicableOptionError(f"loss (--loss) applies to training (mode train); a mode {mode.value} "
                                      f"step computes no loss", hint="Leave the loss out.")
    if step.accum_steps > 1 or step.checkpoint:
        what = ("gradient accumulation (accum_steps, --accum-steps)" if step.accum_steps > 1
                else "activation checkpointing (checkpoint, --checkpoint)")
        raise InapplicableOptionError(f"{what} applies to training (mode train); the mode is {mode.value}")
    if not step.loop.is_default:
        raise InapplicableOptionError(f"a training loop (loop, --loop, --keep-grads) applies to mode train; "
                                      f"the mode is {mode.value}")


def _check_float8(step: Step) -> None:
    """Float8 matmuls need a GPU that has them: ``torch._scaled_mm`` runs on sm89 and newer
    (Ada, Hopper, Blackwell). On the CPU, torch's ``_scaled_mm`` dequantizes both operands to
    float32 (an emulation whose temporaries are the CPU's, not a GPU's), so the CPU target takes
    only torchao's ``emulate=True``, whose plain matmuls run there as traced."""
    float8 = step.float8
    if float8 is None:
        if step.float8_all_gather:
            raise InapplicableOptionError("float8_all_gather (--float8-all-gather) all-gathers float8 training's "
                                          "weights; float8 (--float8) is off",
                                          hint="e.g. --float8 tensorwise --float8-all-gather --strategy fsdp")
        return
    if step.compile:
        raise InapplicableOptionError("float8 (--float8) with compile (--compile) is not modelled: memcalc traces "
                                      "torchao's float8 casts eager",
                                      hint="Leave out --compile to estimate the eager float8 step.")
    if not step.emulate_cuda:
        if not float8.emulated:
            raise InapplicableOptionError(
                "float8 (--float8) on the CPU target: the CPU runs no float8 matmul kernel (torch's CPU _scaled_mm "
                "dequantizes both operands to float32, temporaries memcalc does not model)",
                hint="Give an sm89+ GPU (--gpu h100-80gb), or from Python a torchao Float8LinearConfig(emulate=True), "
                     "whose matmuls run in float32 on any device.")
        return
    major, minor = step.gpu.compute_capability
    if (major, minor) < (8, 9) and not float8.emulated:
        raise InapplicableOptionError(
            f"float8 (--float8) needs float8 matmuls (torch._scaled_mm), which run on sm89 and newer GPUs (L4, L40S, "
            f"H100, H200, B200); {step.gpu.name} is sm{major}{minor}",
            hint="Give an sm89+ GPU with --gpu (memcalc gpus lists them), e.g. --gpu h100-80gb.")


def _check_weight_dtype(step: Step) -> None:
    """Weights in another dtype than the precision's need autocast (without it a model computes
    in its weights' dtype: that is precision fp16 or bf16), and not fp16 under amp-fp16 (torch's
    GradScaler refuses to unscale fp16 gradients: "Attempting to unscale FP16 gradients.")."""
    weights, precision = step.weight_dtype, step.precision
    if weights is None or weights.dtype is precision.parameter_dtype:
        return
    if not precision.is_amp:
        under = f"amp-{weights.value}" if weights is not WeightDtype.FP32 else f"amp-{precision.value}"
        raise InvalidInputError(
            f"weight_dtype (--weight-dtype) {weights.value} contradicts precision {precision.value}, which stores "
            f"the weights in {str(precision.parameter_dtype).removeprefix('torch.')} and computes in them without "
            f"autocast",
            hint=f"Give precision {weights.value} for {weights.value} weights without autocast, or precision "
                 f"{under} with weight_dtype {weights.value} for {weights.value} weights under autocast.")
    if precision is Precision.AMP_FP16 and weights is WeightDtype.FP16:
        raise InvalidInputError("weight_dtype (--weight-dtype) fp16 under precision amp-fp16: torch's GradScaler "
                                "refuses to unscale fp16 gradients",
                                hint="Give precision fp16 for a model trained in fp16 without autocast.")


def _inputs_batch(inputs: Any) -> int | None:
    """The batch (first dimension) of the first tensor in ``inputs``; None if there is none."""
    if isinstance(inputs, torch.Tensor):
        candidates: list[Any] = [inputs]
    elif isinstance(inputs, Mapping):
        candidates = list(inputs.values())
    elif isinstance(inputs, Sequence):
        candidates = list(inputs)
    else:
        return None  # not inputs at all: the model source says so
    first = next((t for t in candidates if isinstance(t, torch.Tensor)), None)
    if first is None:
        return None
    return int(first.shape[0]) if first.dim() else 1


def _check_inputs_batch(inputs: Any, batch_size: int | None) -> None:
    """``inputs`` carry their batch; a different ``batch_size`` beside them is a contradiction."""
    batch = None if inputs is None or batch_size is None else _inputs_batch(inputs)
    if batch is not None and batch != batch_size:
        raise InvalidInputError(f"batch_size={batch_size} disagrees with inputs, whose batch (first dimension) is "
                                f"{batch}", hint="Leave batch_size out (inputs carry their batch) or give inputs of "
                                                 f"batch {batch_size}.")


def _local_gpu(gpu: Any, capacity: Any, stack: Any) -> tuple[Any, Any, str | None]:
    """``gpu="auto"``, ``"cuda"`` or ``"cuda:N"``: this machine's GPU, as its catalogue profile
    (None, the generic one, when the catalogue lacks the card) and — unless ``capacity`` is
    given — its free memory less a new process's CUDA context, with a note saying which GPU,
    profile and capacity were used. Any other ``gpu`` comes back unchanged, with no note.

    The budget is :func:`~memcalc.targets.budget.resolve_budget`'s for ``device=``, so that
    ``estimate(gpu="cuda:0")`` and ``max_batch_size(device="cuda:0")`` see one GPU the same way.
    """
    if not names_local_gpu(gpu):
        return gpu, capacity, None
    found = resolve_budget(gpu=gpu, stack=stack)
    profile = (f"the catalogue profile {found.gpu.key}" if found.gpu is not None
               else "the generic sm80-class profile, the catalogue lacking this card")
    note = f"estimated for this machine's GPU: kernel choices, workspaces and CUDA context of {profile}; "
    if capacity is None:
        return found.gpu, found.capacity, note + f"capacity {found.source}"
    return found.gpu, capacity, note + f"capacity as given, not {found.source}"

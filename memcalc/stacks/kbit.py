"""QLoRA as the recipes run it: ``peft.prepare_model_for_kbit_training`` run for real on the
meta model, between transformers' quantized load and ``peft.get_peft_model``.

The recipe loads the model quantized in bf16, runs ``prepare_model_for_kbit_training`` and
``get_peft_model``, and trains with ``Trainer(bf16=True)``. memcalc's meta model follows it:
:func:`memcalc.stacks.bitsandbytes.quantized_base.quantize_linears` stands for
``from_pretrained``'s quantization, the parameters are cast to the load dtype and the model is
marked as transformers' quantizer marks it, then PEFT's own ``prepare_model_for_kbit_training``
runs on it: every parameter frozen, the unquantized 16-bit ones cast to float32 (marked
:data:`~memcalc.engine.prepare.KEEP_DTYPE`), and with ``--checkpoint`` transformers' own
gradient checkpointing, given memcalc's checkpoint function.

**The checkpoint's kind** depends on the installed peft, transformers and torch: peft 0.21 hands
transformers ``{}``, which binds no ``use_reentrant`` (torch 2.13 then runs reentrant); peft 0.22
hands it None, for which transformers binds its default ``use_reentrant=False``. memcalc copies
neither: :func:`kbit_checkpointing` reads the kind off the function transformers set up (one probe
call) and a step on memcalc's or the user's loop follows it; the Trainer (TRL's trainers too)
re-enables checkpointing with its own kwargs only with ``gradient_checkpointing=True``, whose kind
then wins; without it PEFT's stays on (docs/notes/kbit.md; the recipe's call:
:class:`~memcalc.core.finetune.KbitCheckpointing`).

**The step's precision.** After preparation no parameter is in 16 bits, so a bf16 recipe runs
float32 weights under bf16 autocast: :func:`kbit_precision` turns ``bf16`` into ``amp-bf16``
and ``fp16`` into ``amp-fp16``.

Only Hugging Face models are prepared (PEFT's function "only works for transformers models").
Checked against the real libraries on the CPU (tests/hf_reference/test_trainer_peft.py).
The recipe and each preparation step in full: docs/notes/kbit.md.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from memcalc.core.categories import Mode
from memcalc.core.checkpointing import FULL, CheckpointKind
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.finetune import FineTune, KbitCheckpointing, Quant
from memcalc.core.loop import LoopPreset
from memcalc.core.precision import Precision
from memcalc.core.units import format_bytes
from memcalc.engine.prepare import KEEP_DTYPE
from memcalc.engine.step_spec import Step
from memcalc.stacks.transformers.hub import import_hf

__all__ = ("bound_use_reentrant", "is_transformers_model", "kbit_checkpointing", "kbit_precision",
           "prepare_checkpointing", "prepare_for_kbit_training", "prepares_for_kbit", "set_up_reentrant")

#: The dtypes ``prepare_model_for_kbit_training`` casts to float32.
_HALF = (torch.float16, torch.bfloat16)
#: The autograd node of torch's reentrant checkpoint (``CheckpointFunction.apply``'s output).
_REENTRANT_NODE = "CheckpointFunctionBackward"
#: The attribute transformers keeps a checkpointable layer's checkpoint function in.
_FUNCTION = "_gradient_checkpointing_func"
#: peft 0.22's name of the kwargs ``prepare_model_for_kbit_training`` hands transformers
#: (0.21's ``gradient_checkpointing_kwargs``, deprecated in 0.22, warns there).
_KWARGS = "activation_checkpointing_kwargs"


#: TRL loops whose scoring forward re-enables checkpointing with the config's kwargs (TRL 1.16's
#: ``disable_gradient_checkpointing`` around DPO's reference and GRPO's generation and scoring).
_REENABLING = (LoopPreset.TRL_DPO, LoopPreset.TRL_GRPO)


def is_transformers_model(module: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (recognised by its class hierarchy, so that transformers
    need not be imported for a plain-torch model)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
               for cls in type(module).__mro__)


def prepares_for_kbit(module: nn.Module, finetune: FineTune, mode: Mode) -> bool:
    """Whether the QLoRA recipe's ``prepare_model_for_kbit_training`` applies: a quantized base
    with LoRA adapters, trained, on a Hugging Face model (module docstring)."""
    return (finetune.quant is not None and finetune.lora is not None and mode is Mode.TRAIN
            and is_transformers_model(module))


def kbit_precision(precision: Precision) -> Precision:
    """The precision a step of a model prepared for k-bit training runs at: float32 weights under
    the autocast of the precision's compute dtype (module docstring)."""
    return {Precision.BF16: Precision.AMP_BF16, Precision.FP16: Precision.AMP_FP16}.get(precision, precision)


def prepare_checkpointing(finetune: FineTune, checkpoint: bool) -> KbitCheckpointing:
    """How ``prepare_model_for_kbit_training`` is called: as ``finetune`` says, else on (PEFT's
    default call, no kwargs) when the step checkpoints and off when it does not."""
    if finetune.kbit_checkpointing is not None:
        return finetune.kbit_checkpointing
    return KbitCheckpointing.ON if checkpoint else KbitCheckpointing.OFF


def prepare_for_kbit_training(module: nn.Module, quant: Quant, *, precision: Precision,
                              checkpointing: KbitCheckpointing) -> str:
    """Load ``module`` (its Linear layers already quantized, on meta) in the precision's parameter
    dtype and run PEFT's ``prepare_model_for_kbit_training`` on it, in place. Returns the report's note.

    Args:
        module: a Hugging Face model on meta, quantized by
            :func:`memcalc.stacks.bitsandbytes.quantized_base.quantize_linears`.
        quant: the quantization (which ``is_loaded_in_*`` transformers sets).
        precision: the user's precision: the dtype the model is loaded in (``from_pretrained(dtype=...)``).
        checkpointing: PEFT's ``use_gradient_checkpointing`` and checkpointing kwargs.
    """
    peft = import_hf("peft", "QLoRA (--lora with --quant)")
    _load_in(module, precision.parameter_dtype)
    # transformers' Bnb4BitHfQuantizer / Bnb8BitHfQuantizer._process_model_after_weight_loading
    setattr(module, "is_loaded_in_8bit" if quant is Quant.INT8 else "is_loaded_in_4bit", True)
    half = {id(p): p.nbytes for p in module.parameters() if p.dtype in _HALF}
    with warnings.catch_warnings():
        # transformers' deprecation of gradient_checkpointing_enable, reached through PEFT: not the user's concern
        warnings.filterwarnings("ignore", category=FutureWarning)
        peft.prepare_model_for_kbit_training(module,
                                             use_gradient_checkpointing=checkpointing is not KbitCheckpointing.OFF,
                                             **_kwargs_as_named(peft.prepare_model_for_kbit_training,
                                                                checkpointing.kwargs or None))
    cast = [p for p in module.parameters() if id(p) in half and p.dtype is torch.float32]
    for p in module.parameters():
        if p.is_floating_point():
            setattr(p, KEEP_DTYPE, p.dtype)
    version = getattr(peft, "__version__", "?")
    note = f"prepare_model_for_kbit_training (peft {version}) run as the QLoRA recipe runs it: "
    if cast:
        before = sum(half[id(p)] for p in cast)
        note += (f"{len(cast)} parameter tensors left unquantized cast from {_name(precision.parameter_dtype)} "
                 f"to float32 ({format_bytes(before)} → {format_bytes(2 * before)})")
    else:
        note += "nothing to cast (the model is loaded in float32)"
    if precision is not kbit_precision(precision):
        note += (f"; the step runs as {kbit_precision(precision).value}: float32 weights under "
                 f"{_name(precision.compute_dtype)} autocast, as TrainingArguments({_name(precision.compute_dtype)}"
                 f"=True) trains them")
    if checkpointing is KbitCheckpointing.OFF:
        note += ("; without gradient checkpointing (prepare_model_for_kbit_training turns it on by default: "
                 "add --checkpoint, or --kbit-checkpointing on where the loop does not enable its own, if the "
                 "recipe keeps that default)")
    return note


def kbit_checkpointing(module: nn.Module, step: Step) -> Step:
    """``step`` with the checkpointing ``prepare_model_for_kbit_training`` left on ``module``
    (after :func:`prepare_for_kbit_training`, before the step is traced), where the loop keeps it.

    The Trainer's loop (and TRL's, which inherit it) calls ``activation_checkpointing_enable`` again
    in ``train()`` only with ``gradient_checkpointing=True``, with ``TrainingArguments``' kwargs
    (transformers' ``use_reentrant=False`` when none): that kind wins and ``step`` already carries
    it. With ``gradient_checkpointing=False`` the Trainer leaves the model as PEFT left it, and so
    does any other loop (memcalc's, a user's function): PEFT's checkpointing then runs, of the kind
    :func:`set_up_reentrant` reads off the function transformers installed, even where the step
    asked for none. A selective policy is memcalc's own setting, not PEFT's, and stays as it is.
    """
    if not prepares_for_kbit(module, step.finetune, step.mode):
        return step
    called = prepare_checkpointing(step.finetune, bool(step.checkpoint))
    preset = step.loop.preset
    if called is KbitCheckpointing.OFF or (step.checkpoint and (
            (preset is not None and preset.is_trainer) or step.checkpoint.reentrant
            or step.checkpoint.kind not in (CheckpointKind.FULL, CheckpointKind.EVERY))):
        return step
    reentrant = set_up_reentrant(module)
    kind = "reentrant" if reentrant else "non-reentrant"
    how = _how(module, called, reentrant)
    if step.checkpoint:
        if not reentrant:
            return step
        note = (f"the checkpoint prepare_model_for_kbit_training set up is reentrant: {how}; loop {step.loop.name} "
                f"keeps it (the Trainer's loop would re-enable checkpointing with its own kwargs, "
                f"use_reentrant=False by default)")
        return replace(step, checkpoint=replace(step.checkpoint, reentrant=True), notes=(*step.notes, note))
    if preset in _REENABLING:
        # trl.models.utils.disable_gradient_checkpointing: was_enabled (PEFT's) → enabled again with the config's kwargs
        raise InapplicableOptionError(
            f"loop {step.loop.name} with gradient_checkpointing off in its config and the checkpointing "
            f"prepare_model_for_kbit_training turned on is not modelled: TRL's reference or generation forward "
            f"disables it and enables it again with the config's gradient_checkpointing_kwargs (use_reentrant=False "
            f"when none), so the step changes kind in the middle of the run",
            hint="Give gradient_checkpointing=True with the kwargs you want (their kind then runs throughout), or "
                 "--kbit-checkpointing off.")
    keeps = ("the Trainer enables its own only with gradient_checkpointing=True" if preset is not None
             and preset.is_trainer else "nothing enables another")
    note = (f"prepare_model_for_kbit_training turned on gradient checkpointing (use_gradient_checkpointing=True) "
            f"and it stays on in loop {step.loop.name} ({keeps}): every layer, {kind} ({how})")
    return replace(step, checkpoint=replace(FULL, reentrant=reentrant), notes=(*step.notes, note))


def set_up_reentrant(module: nn.Module) -> bool:
    """Whether the checkpoint function transformers gave ``module``'s layers runs torch's
    reentrant ``CheckpointFunction``: the function itself is called once on a one-element CPU
    tensor and its output's autograd node read, so the answer is the installed torch's,
    transformers' and peft's own (peft 0.21 and 0.22 differ: module docstring), whatever their
    defaults become. False where no layer has one."""
    function = _installed_function(module)
    if function is None:
        return False
    probe = torch.zeros(1, requires_grad=True)
    with warnings.catch_warnings(), torch.enable_grad():
        # torch's warning that use_reentrant was not passed: the probe's, not the user's concern
        warnings.simplefilter("ignore")
        out = function(lambda t: t * 2, probe)
    return type(out.grad_fn).__name__ == _REENTRANT_NODE


def bound_use_reentrant(module: nn.Module) -> bool | None:
    """The ``use_reentrant`` transformers bound into the checkpoint function of ``module``'s layers
    (the keywords of its ``functools.partial(checkpoint, **kwargs)``), None where it bound none and
    torch's own default decides. It says *why* a kind was set up (peft 0.21's ``{}`` binds none,
    peft 0.22's None binds transformers' ``False``); :func:`set_up_reentrant` says *which*."""
    function = _installed_function(module)
    if not isinstance(function, functools.partial) or "use_reentrant" not in function.keywords:
        return None
    return bool(function.keywords["use_reentrant"])


def _installed_function(module: nn.Module) -> Callable[..., Any] | None:
    """The checkpoint function of the first layer transformers checkpoints, None where none does."""
    return next((getattr(sub, _FUNCTION) for sub in module.modules()
                 if getattr(sub, "gradient_checkpointing", False) and callable(getattr(sub, _FUNCTION, None))), None)


def _kwargs_as_named(prepare: Callable[..., Any], kwargs: dict[str, bool] | None) -> dict[str, Any]:
    """``kwargs`` under the name the installed ``prepare_model_for_kbit_training`` takes: peft 0.22's
    ``activation_checkpointing_kwargs`` where its signature has it (the deprecated
    ``gradient_checkpointing_kwargs`` would warn there), else 0.21's. Read off the signature rather
    than the version, so a peft that renames it back or keeps both is called as it asks."""
    named = _KWARGS if _KWARGS in inspect.signature(prepare).parameters else "gradient_checkpointing_kwargs"
    return {named: kwargs}


def _how(module: nn.Module, called: KbitCheckpointing, reentrant: bool) -> str:
    """Why PEFT's checkpoint is of its kind, for the note: what the recipe gave PEFT, else what
    transformers bound for PEFT's call (:func:`bound_use_reentrant`), else torch's own default."""
    if called.kwargs:
        return f"the recipe gave PEFT use_reentrant={called.kwargs['use_reentrant']}"
    bound = bound_use_reentrant(module)
    if bound is not None:
        return f"transformers bound use_reentrant={bound} into the checkpoint function for PEFT's call"
    return ("transformers bound no use_reentrant for PEFT's call, and torch "
            f"{torch.__version__.split('+')[0]}'s checkpoint without it runs {'' if reentrant else 'no '}"
            "CheckpointFunction")


def _load_in(module: nn.Module, dtype: torch.dtype) -> None:
    """``from_pretrained(dtype=dtype)``: the floating parameters in ``dtype``, except those marked
    :data:`KEEP_DTYPE` (bitsandbytes' float32 statistics); buffers keep the dtype the model's
    ``__init__`` gave them (a rotary embedding's float32 ``inv_freq``), as they do in transformers."""
    for p in module.parameters():
        if p.is_floating_point() and not hasattr(p, KEEP_DTYPE) and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).removeprefix("torch."))

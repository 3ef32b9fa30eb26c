"""Fine-tuning as people do it, applied to the resolved model before the step is traced:
frozen parameters (``--freeze``), LoRA adapters made by the real ``peft`` library (``--lora``)
and a quantized base (``--quant``, :mod:`memcalc.stacks.bitsandbytes`).

The order is QLoRA's: quantize the base, wrap it with ``peft.get_peft_model`` (which freezes
every parameter but the adapters), then freeze what the patterns name. Nothing here allocates
memory: the model is on meta, and PEFT builds its adapters under ``torch.device("meta")``.

Frozen parameters need nothing else: the step (:mod:`memcalc.engine.step`) hands the
optimizer the parameters that require grad only, and autograd makes no gradient for the others.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memcalc.core.categories import Mode
from memcalc.core.errors import InvalidInputError
from memcalc.core.finetune import FineTune, LoRA
from memcalc.core.precision import Precision
from memcalc.engine.model import ResolvedModel
from memcalc.engine.prepare import KEEP_DTYPE
from memcalc.engine.run import parameter_count
from memcalc.stacks.bitsandbytes.quantized_base import quantize_linears
from memcalc.stacks.kbit import kbit_precision, prepare_checkpointing, prepare_for_kbit_training, prepares_for_kbit
from memcalc.stacks.transformers.hub import import_hf

__all__ = ("PEFT_MODEL", "LoraResult", "add_lora", "apply_finetune", "finetune_module", "freeze_parameters",
           "linear_names", "step_precision")

#: How many names an error lists.
_SHOWN = 8


#: Attribute of a model :func:`add_lora` adapted: the ``PeftModel`` that ``get_peft_model``
#: returned around it, for code that calls its methods (TRL's reference: ``disable_adapter()``).
PEFT_MODEL = "memcalc_peft_model"

def apply_finetune(resolved: ResolvedModel, finetune: FineTune, *, precision: Precision, mode: Mode,
                   checkpoint: bool = False) -> ResolvedModel:
    """``resolved`` with its base quantized, LoRA adapters added and parameters frozen (in place
    on its meta module), and a note for each.

    A Hugging Face model trained with LoRA on a quantized base is prepared as the QLoRA recipe
    prepares it (:mod:`memcalc.stacks.kbit`): its step then runs at
    ``kbit_precision(precision)``, which :func:`step_precision` gives the caller.

    Args:
        resolved: the model on meta (:func:`memcalc.sources.resolve.resolve`).
        finetune: what to do.
        precision: gives the compute dtype of a quantized base, and the dtype it is loaded in.
        mode: in training, only frozen layers are quantized (bitsandbytes' weights cannot train):
            every eligible one with LoRA, those the freeze patterns name without it.
        checkpoint: the step checkpoints its blocks (QLoRA's preparation then turns on transformers'
            checkpointing, unless ``finetune.kbit_checkpointing`` says how the recipe called it).

    Returns:
        The same model, changed, with the notes added.

    Raises:
        InvalidInputError: a pattern or LoRA target that matches nothing, LoRA targets missing
            for a model PEFT has no default for, nothing to quantize.
        MissingPackageError: LoRA without ``peft`` installed.
    """
    if finetune.is_empty:
        return resolved
    module, notes = finetune_module(resolved.module, finetune, precision=precision, mode=mode, checkpoint=checkpoint)
    return dataclasses.replace(resolved, module=module, notes=(*resolved.notes, *notes))


def step_precision(resolved: ResolvedModel, finetune: FineTune, precision: Precision, mode: Mode) -> Precision:
    """The precision the step of ``resolved`` (after :func:`apply_finetune`) runs at: the user's,
    or for a model prepared for k-bit training the autocast of its compute dtype
    (:func:`memcalc.stacks.kbit.kbit_precision`)."""
    return kbit_precision(precision) if prepares_for_kbit(resolved.module, finetune, mode) else precision


def finetune_module(module: nn.Module, finetune: FineTune, *, precision: Precision,
                    mode: Mode, checkpoint: bool = False) -> tuple[nn.Module, list[str]]:
    """:func:`apply_finetune` on a module: the module to run (changed in place) and the notes.

    Freezing and LoRA work on a real module too (PEFT's adapters are made on the module's
    device); a quantized base exists on meta only.
    """
    notes: list[str] = []
    if finetune.quant is not None:
        if _device_of(module).type != "meta":
            raise InvalidInputError(f"a quantized base (--quant {finetune.quant.value}) is emulated on meta tensors "
                                    f"only: a real one needs bitsandbytes")
        every = finetune.lora is not None or mode is not Mode.TRAIN

        def frozen(name: str, layer: nn.Module) -> bool:
            return every or _matches_any(f"{name}.weight", finetune.freeze)

        summary = quantize_linears(module, finetune.quant, double_quant=finetune.double_quant,
                                   compute_dtype=precision.compute_dtype, select=frozen)
        notes.append(summary.note)
        if prepares_for_kbit(module, finetune, mode):
            called = prepare_checkpointing(finetune, checkpoint)
            notes.append(prepare_for_kbit_training(module, finetune.quant, precision=precision, checkpointing=called))
    if finetune.lora is not None:
        lora = add_lora(module, finetune.lora)
        module = lora.module
        notes.append(lora.note)
    if finetune.freeze:
        notes.append(freeze_parameters(module, finetune.freeze))
    return module, notes


# ---- freezing ----------------------------------------------------------------------------
def freeze_parameters(module: nn.Module, patterns: Iterable[str]) -> str:
    """Set ``requires_grad=False`` on the parameters whose name (``named_parameters()``, tied
    weights under each of their names) matches one of the glob ``patterns`` (``fnmatch``: ``*``
    crosses dots). Returns the report's note.

    Raises:
        InvalidInputError: a pattern matches no parameter (the error names a few).
    """
    named = list(module.named_parameters(remove_duplicate=False))
    frozen: dict[int, nn.Parameter] = {}
    for pattern in patterns:
        hits = [p for name, p in named if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            shown = ", ".join(name for name, _ in named[:_SHOWN])
            raise InvalidInputError(
                f"--freeze {pattern!r} matches no parameter of the model",
                hint=f"Patterns are globs over parameter names ('*' crosses dots), e.g. '*.embed_tokens.*'. "
                     f"The first names: {shown}{', ...' if len(named) > _SHOWN else '.'}")
        for p in hits:
            frozen[id(p)] = p
    for p in frozen.values():
        p.requires_grad_(False)
    given = ", ".join(repr(p) for p in patterns)
    return f"frozen by --freeze {given}: {parameter_count(frozen.values()):,} parameters in {len(frozen)} tensors"


def _matches_any(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


# ---- LoRA --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoraResult:
    """What :func:`add_lora` did: the model to trace and PEFT's own counts."""

    module: nn.Module  # the base model with PEFT's LoRA layers injected (what PeftModel.forward calls)
    rank: int
    targets: tuple[str, ...]
    default_for: str | None  # the model type whose PEFT default gave the targets; None: the user's
    trainable: int  # PeftModel.get_nb_trainable_parameters()
    total: int

    @property
    def note(self) -> str:
        """The report's note, e.g. ``LoRA r=16 on q_proj, v_proj (PEFT's default for llama): ...``."""
        where = ", ".join(self.targets)
        why = f" (PEFT's default for {self.default_for})" if self.default_for else ""
        share = 100 * self.trainable / self.total if self.total else 0.0
        return f"LoRA r={self.rank} on {where}{why}: {self.trainable:,} trainable of {self.total:,} ({share:.2f}%)"


def add_lora(module: nn.Module, lora: LoRA) -> LoraResult:
    """Inject LoRA adapters with ``peft.get_peft_model(module, LoraConfig(...))``, in place.

    PEFT freezes every other parameter; its adapters are created on the module's device
    directly (under ``torch.device(...)``: on meta, ``nn.Linear(in, r)`` and its init run
    without memory) and, as ``autocast_adapter_dtype=True`` does, stay float32 in a pure
    fp16/bf16 model (marked :data:`~memcalc.engine.prepare.KEEP_DTYPE`).

    Returns:
        The base model (with the adapters; ``PeftModel.forward`` calls it as is), the targets
        and PEFT's parameter counts.
    """
    peft = import_hf("peft", "LoRA adapters (--lora)")
    model_type = _model_type(module)
    targets = list(lora.targets) if lora.targets is not None else None
    default = _peft_default_targets(peft, model_type) if targets is None else None
    if targets is None and default is None:
        raise InvalidInputError(
            f"PEFT has no default LoRA targets for {_describe(module, model_type)}: name the layers to adapt",
            hint=f"--lora-targets NAMES (lora=memcalc.LoRA(r, targets=(...))) with names of its Linear layers: "
                 f"{', '.join(linear_names(module)[:_SHOWN]) or 'none found'}")
    kwargs: dict[str, Any] = {"r": lora.rank, "lora_dropout": lora.dropout, "target_modules": targets}
    if lora.alpha is not None:
        kwargs["lora_alpha"] = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    config = peft.LoraConfig(**kwargs)
    try:
        with torch.device(_device_of(module)), warnings.catch_warnings():
            # PEFT reads transformers' deprecated is_gradient_checkpointing: not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(module, config)
    except ValueError as exc:
        if "not found in the base model" not in str(exc) and "Target modules" not in str(exc):
            raise
        raise InvalidInputError(
            f"--lora-targets {','.join(targets or default or [])} matches no layer PEFT can adapt",
            hint=f"Its Linear layers: {', '.join(linear_names(module)[:_SHOWN]) or 'none found'}") from None
    for param in module.parameters():
        if param.requires_grad:  # the adapters: PEFT froze everything else
            setattr(param, KEEP_DTYPE, param.dtype)
    trainable, total = wrapped.get_nb_trainable_parameters()
    used = wrapped.peft_config["default"].target_modules
    chosen = tuple(sorted(used)) if isinstance(used, (set, list, tuple)) else (str(used),)
    # PEFT counts a bitsandbytes weight by its class (Params4bit); ours carry their own count
    total = parameter_count(module.parameters())
    module.__dict__[PEFT_MODEL] = wrapped  # for TRL, which runs PeftModel.disable_adapter() (not a submodule)
    return LoraResult(module=wrapped.get_base_model(), rank=lora.rank, targets=chosen,
                      default_for=model_type if default is not None else None, trainable=trainable, total=total)


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("meta")


def _model_type(module: nn.Module) -> str | None:
    """``config.model_type`` of a Hugging Face model (what PEFT's defaults are keyed by)."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    return model_type if isinstance(model_type, str) and model_type else None


def _peft_default_targets(peft: Any, model_type: str | None) -> list[str] | None:
    """PEFT's LoRA targets for ``model_type``
    (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``)."""
    if model_type is None:
        return None
    mapping = peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    targets = mapping.get(model_type)
    return list(targets) if targets else None


def linear_names(module: nn.Module) -> list[str]:
    """The distinct leaf names of the model's ``nn.Linear`` layers, in model order."""
    seen: dict[str, None] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and name:
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)


def _describe(module: nn.Module, model_type: str | None) -> str:
    if model_type is not None:
        return f"the model type {model_type!r}"
    return f"{type(module).__name__}, which is not a Hugging Face model"

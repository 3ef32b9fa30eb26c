"""Fine-tuning choices: which parameters train, adapters and a quantized base
(:class:`FineTune`, :class:`LoRA`, :class:`Quant`, :class:`KbitCheckpointing`).

Vocabulary only: :mod:`memcalc.stacks.peft` freezes and wraps the model with PEFT, and
:mod:`memcalc.stacks.bitsandbytes.quantized_base` stores the frozen Linear weights as bitsandbytes does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from memcalc.core.choices import parse_choice
from memcalc.core.errors import InvalidInputError

__all__ = ("FineTune", "KbitCheckpointing", "LoRA", "Quant")


class Quant(str, enum.Enum):
    """bitsandbytes' storage of the frozen Linear weights."""

    NF4 = "nf4"
    FP4 = "fp4"
    INT8 = "int8"


class KbitCheckpointing(str, enum.Enum):
    """How the recipe called ``peft.prepare_model_for_kbit_training``: its
    ``use_gradient_checkpointing`` (True by default) and ``activation_checkpointing_kwargs``
    (peft 0.22; ``gradient_checkpointing_kwargs`` in 0.21, deprecated in 0.22).

    The checkpointing it turns on stays on where the loop does not enable its own (the Trainer
    with ``gradient_checkpointing=False``, a user's loop): docs/checkpointing.md, "QLoRA"."""

    #: ``use_gradient_checkpointing=False``.
    OFF = "off"
    #: ``use_gradient_checkpointing=True`` with no kwargs (PEFT's default call): the kind read off
    #: the function transformers installs. peft 0.21 hands transformers ``{}``, so torch's default
    #: runs (reentrant on torch 2.13); peft 0.22 hands None, so transformers' ``use_reentrant=False``.
    ON = "on"
    #: ``activation_checkpointing_kwargs={"use_reentrant": True}``.
    REENTRANT = "reentrant"
    #: ``activation_checkpointing_kwargs={"use_reentrant": False}``.
    NON_REENTRANT = "non-reentrant"

    @property
    def kwargs(self) -> dict[str, bool]:
        """PEFT's ``activation_checkpointing_kwargs`` for this call (empty: none given)."""
        return {"use_reentrant": self is KbitCheckpointing.REENTRANT} if self in _GIVEN else {}


_GIVEN = (KbitCheckpointing.REENTRANT, KbitCheckpointing.NON_REENTRANT)


@dataclass(frozen=True)
class LoRA:
    """LoRA adapters, as ``peft.LoraConfig`` takes them.

    Attributes:
        rank: ``r``.
        alpha: ``lora_alpha`` (None: PEFT's default).
        dropout: ``lora_dropout`` (a dropout > 0 keeps a dropped copy of each adapted input).
        targets: module names to adapt (None: PEFT's default for the architecture).
    """

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidInputError(f"LoRA rank (--lora) must be an integer ≥ 1, got {self.rank!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise InvalidInputError(f"lora dropout (--lora-dropout) must be in [0, 1), got {self.dropout!r}")
        given: object = self.targets  # a str is accepted for one name
        if given is not None:
            targets = (given,) if isinstance(given, str) else tuple(given)  # type: ignore[arg-type]
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise InvalidInputError(f"lora targets must be module names, got {self.targets!r}",
                                        hint="e.g. --lora-targets q_proj,v_proj")
            object.__setattr__(self, "targets", targets)


@dataclass(frozen=True)
class FineTune:
    """``memcalc.estimate("hf:...", finetune=memcalc.FineTune(lora=memcalc.LoRA(16), quant="nf4"))``.

    Attributes:
        freeze: glob patterns over parameter names (``"*.embed_tokens.*"``): frozen parameters
            get no gradient and no optimizer state.
        lora: adapters (the base model is frozen, as PEFT does).
        quant: a quantized base (:class:`Quant` or its name): the frozen Linear weights stored
            as bitsandbytes stores them; embeddings and the LM head stay unquantized.
        double_quant: 4-bit only: the per-block absmax quantized again (bnb's
            ``compress_statistics``, QLoRA's double quantization).
        kbit_checkpointing: how the QLoRA recipe called ``prepare_model_for_kbit_training``
            (:class:`KbitCheckpointing` or its name); None: as the step's checkpointing says (on,
            without kwargs, with ``checkpoint``; off without).
    """

    freeze: tuple[str, ...] = ()
    lora: LoRA | None = None
    quant: Quant | None = None
    double_quant: bool = False
    kbit_checkpointing: KbitCheckpointing | None = None

    def __post_init__(self) -> None:
        given: object = self.freeze  # a str is accepted for one pattern
        freeze = (given,) if isinstance(given, str) else tuple(given)  # type: ignore[arg-type]
        if not all(isinstance(p, str) and p for p in freeze):
            raise InvalidInputError(f"freeze takes glob patterns over parameter names, got {self.freeze!r}")
        object.__setattr__(self, "freeze", freeze)
        if self.lora is not None and not isinstance(self.lora, LoRA):
            raise InvalidInputError(f"lora must be a memcalc.LoRA(rank, ...), got {type(self.lora).__name__}")
        if self.quant is not None:
            object.__setattr__(self, "quant", parse_choice(Quant, self.quant, "quant"))
        if not isinstance(self.double_quant, bool):
            raise InvalidInputError(f"double_quant must be True or False, got {self.double_quant!r}")
        if self.double_quant and self.quant not in (Quant.NF4, Quant.FP4):
            raise InvalidInputError("double quantization (--double-quant) applies to 4-bit weights (--quant nf4|fp4)")
        if self.kbit_checkpointing is not None:
            object.__setattr__(self, "kbit_checkpointing",
                               parse_choice(KbitCheckpointing, self.kbit_checkpointing, "kbit_checkpointing"))
            if self.quant is None or self.lora is None:
                raise InvalidInputError("kbit_checkpointing (--kbit-checkpointing) describes "
                                        "prepare_model_for_kbit_training, which the QLoRA recipe runs: it goes with "
                                        "a quantized base and LoRA (--quant and --lora)")

    @property
    def is_empty(self) -> bool:
        """Nothing to do: every parameter trains, none quantized."""
        return not self.freeze and self.lora is None and self.quant is None

"""Which activations a training step checkpoints: none, every block, every Nth block, or the
ops a policy saves inside every block (selective activation checkpointing).

A user's ``checkpoint`` (``True``/``False``, ``"full"``, ``"selective-op"``, ``"every:N"``, a
policy function, or a :class:`Checkpointing`) becomes one :class:`Checkpointing` at the API
boundary (:func:`parse_checkpointing`); the engine reads it to wrap the blocks
(:func:`memcalc.engine.prepare.apply_checkpointing`), with torch's own
``create_selective_checkpoint_contexts`` where a policy decides.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from memcalc.core.errors import InvalidInputError

__all__ = ("AUTO", "FULL", "OFF", "CheckpointKind", "Checkpointing", "SacPolicy", "parse_checkpointing")

#: A selective checkpointing policy, as ``create_selective_checkpoint_contexts`` calls it:
#: ``(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy``.
SacPolicy = Callable[..., Any]

#: How the command line and the API spell the settings, for the error message.
_SPELLINGS = ("full, selective-op, every:N (N ≥ 1), auto, off, True/False, or a policy function "
              "(ctx, op, *args, **kwargs)")


class CheckpointKind(str, enum.Enum):
    """The checkpointing setting, without its parameters."""

    #: No checkpointing: every activation a block's backward needs is kept.
    OFF = "off"
    #: Every block checkpointed: its input kept, the rest recomputed in backward.
    FULL = "full"
    #: Every Nth block checkpointed (torchtitan's per-layer selective AC, ``selective_ac_option="N"``).
    EVERY = "every"
    #: Every block checkpointed, saving the ops of torchtitan's op list (torchtitan's ``selective_ac_option="op"``).
    SELECTIVE_OP = "selective-op"
    #: Every block checkpointed, saving what the user's policy says.
    POLICY = "policy"
    #: Chosen under the memory budget: the setting (off, every:N, selective-op, full) whose peak
    #: fits with the least recomputation (:mod:`memcalc.distributed.checkpoint_auto`).
    AUTO = "auto"


@dataclass(frozen=True)
class Checkpointing:
    """A step's activation checkpointing.

    Attributes:
        kind: off, full, every Nth block, torchtitan's op list, or the user's policy.
        every: N of ``every:N``: blocks N, 2N, … (counted from 1) are checkpointed, as
            torchtitan's per-layer checkpointing counts them; 1 for the other kinds.
        policy: the user's policy function (``kind`` POLICY only).
        reentrant: ``use_reentrant=True``: torch's ``CheckpointFunction`` (the forward under
            ``no_grad``, the recomputation and an inner backward in the block's backward), as
            ``gradient_checkpointing_kwargs={"use_reentrant": True}`` and TRL's PEFT + ZeRO-3 ask;
            False: the non-reentrant checkpoint, PyTorch's recommendation and transformers' default.
    """

    kind: CheckpointKind = CheckpointKind.OFF
    every: int = 1
    policy: SacPolicy | None = None
    reentrant: bool = False

    def __post_init__(self) -> None:
        if self.reentrant and self.kind in (CheckpointKind.SELECTIVE_OP, CheckpointKind.POLICY, CheckpointKind.AUTO):
            # torch.utils.checkpoint: "Passing context_fn or debug is only supported when use_reentrant=False"
            raise InvalidInputError(f"checkpoint {self.kind.value} with reentrant checkpointing: torch's reentrant "
                                    "checkpoint takes no selective policy (context_fn needs use_reentrant=False)",
                                    hint="Use full or every:N with use_reentrant=True, or use_reentrant=False.")

    def __bool__(self) -> bool:
        """Whether anything is checkpointed (``if step.checkpoint:`` reads as before)."""
        return self.kind is not CheckpointKind.OFF

    @property
    def label(self) -> str:
        """How the command line spells it (``every:2``), or ``policy NAME`` for a function; a
        reentrant one says so (``full, reentrant``)."""
        if self.reentrant:
            return f"{replace(self, reentrant=False).label}, reentrant"
        if self.kind is CheckpointKind.EVERY:
            return f"every:{self.every}"
        if self.kind is CheckpointKind.POLICY:
            name = getattr(self.policy, "__name__", None)
            return f"policy {name if isinstance(name, str) else type(self.policy).__name__}"
        return str(self.kind.value)

    def checkpoints_block(self, index: int) -> bool:
        """Whether the block at ``index`` (0-based, in model order) is checkpointed: torchtitan's
        per-layer rule counts blocks from 1 and wraps those whose count is a multiple of N
        (``_apply_layer_sac``: ``_count % ac_freq == 0``)."""
        return bool(self) and (index + 1) % self.every == 0


#: No checkpointing.
OFF = Checkpointing()
#: Every block checkpointed (``checkpoint=True``, a bare ``--checkpoint``).
FULL = Checkpointing(CheckpointKind.FULL)
#: Chosen under the budget (``--checkpoint auto``).
AUTO = Checkpointing(CheckpointKind.AUTO)


def parse_checkpointing(value: object, name: str = "checkpoint") -> Checkpointing:
    """A user's checkpointing, as a :class:`Checkpointing`.

    Raises:
        InvalidInputError: a value that names no setting (with every spelling).
    """
    if isinstance(value, Checkpointing):
        return value
    if isinstance(value, bool):
        return FULL if value else OFF
    if isinstance(value, str):
        return _parse_text(value, name)
    if callable(value):
        return Checkpointing(CheckpointKind.POLICY, policy=value)
    raise InvalidInputError(f"{name} must be one of {_SPELLINGS}; got {value!r}")


def _parse_text(value: str, name: str) -> Checkpointing:
    text = value.strip().lower()
    kind, _, count = text.partition(":")
    if kind == CheckpointKind.EVERY.value:
        every = int(count) if count.isdigit() else 0
        if every < 1:
            raise InvalidInputError(f"{name} every:N needs a whole number of blocks N ≥ 1; got {value!r}",
                                    hint="e.g. every:2 checkpoints every second block")
        return FULL if every == 1 else Checkpointing(CheckpointKind.EVERY, every)
    if text in (CheckpointKind.OFF.value, CheckpointKind.FULL.value, CheckpointKind.SELECTIVE_OP.value,
                CheckpointKind.AUTO.value):
        return Checkpointing(CheckpointKind(text))
    raise InvalidInputError(f"unknown {name} {value!r}; choose one of: {_SPELLINGS}")

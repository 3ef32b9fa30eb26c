"""What a step took from Hugging Face ``TrainingArguments``: :class:`TrainerArguments`.

``memcalc.estimate(..., trainer_args=TrainingArguments(...))`` (CLI ``--training-args FILE``)
and ``loop="trainer"`` read the Trainer's arguments — the user's, or the installed class's
defaults — into the step's own options (the batch, the accumulation, the precision,
checkpointing, the optimizer and its implementation). :mod:`memcalc.stacks.transformers.training_args`
reads them; this record keeps what it read, so that the report can say where each value came
from. It is vocabulary only: it imports nothing of transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ("TrainerArguments", "TrlSettings")


@dataclass(frozen=True)
class TrainerArguments:
    """The Trainer's arguments a step was built from, as memcalc read them.

    Attributes:
        source: where they came from: ``"your TrainingArguments (transformers 5.24.0)"``, a file's
            path, or ``"the TrainingArguments defaults of transformers 5.24.0"`` (``loop="trainer"``
            alone).
        read: ``(argument, what it became)`` for every argument that decides the step, e.g.
            ``("optim", "adamw_torch_fused → optimizer adamw, fused")``.
        overridden: the step options given beside the arguments, which replaced theirs.
        unknown: arguments set away from their defaults that memcalc did not read: the installed
            class has them but memcalc knows nothing of them (a newer transformers), or the class
            lacks them (a subclass's own, an older transformers').
        defaults_only: the installed class's defaults, for ``loop="trainer"`` given alone.
        loop: the loop they describe: ``trainer``, or a TRL trainer's (``trl-sft``, ``trl-dpo``).
        trl: a TRL config's own settings (None: the Trainer's arguments alone).
        mesh: the device mesh of their ``parallelism_config`` (accelerate's ``ParallelismConfig``),
            as ``(dimension, degree)`` pairs of the degrees above 1; empty without one. The
            estimate runs on it (:func:`memcalc.estimate_step`), exactly as under ``--mesh``.
        ddp_find_unused_parameters: their ``ddp_find_unused_parameters`` (None: unset, the
            Trainer then decides from the model: :func:`memcalc.distributed.strategies.refuse_unused_reentrant`).
    """

    source: str
    read: tuple[tuple[str, str], ...] = ()
    overridden: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    defaults_only: bool = False
    loop: str = "trainer"
    trl: TrlSettings | None = None
    mesh: tuple[tuple[str, int], ...] = ()
    ddp_find_unused_parameters: bool | None = None

    def describe(self) -> str:
        """One line for the report's notes."""
        text = f"loop {self.loop} with {self.source}: " + "; ".join(f"{name} {became}" for name, became in self.read)
        if self.overridden:
            text += f"; replaced by your options: {', '.join(self.overridden)}"
        if self.unknown:
            text += f"; not read (memcalc does not know them): {', '.join(self.unknown)}"
        return text


@dataclass(frozen=True)
class TrlSettings:
    """What a TRL config decides beyond the Trainer's arguments (:mod:`memcalc.stacks.trl.config`
    reads it): the trainer (``"sft"`` or ``"dpo"``) and the values of its own arguments, as
    ``(name, value)`` pairs (hashable, as the frozen step is)."""

    trainer: str
    values: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        """The value of argument ``name`` (``default`` when the config has none)."""
        return dict(self.values).get(name, default)

"""The training loop being estimated, as a user names it: :class:`Loop`.

memcalc's default step is one idealised loop (``minimal``). Real jobs differ in ways that move
the peak by 4–45%: gradients kept alive into the next forward, the previous iteration's output
kept alive until it is rebound, the optimizer's implementation (per-parameter for-loop,
multi-tensor foreach, fused kernels). :class:`Loop` names those choices; the engine
(:mod:`memcalc.engine.loops`) runs them. This module is vocabulary only: it imports nothing
of the engine, so that options and reports can name a loop.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memcalc.core.choices import parse_choice
from memcalc.core.errors import InvalidInputError

__all__ = ("Loop", "LoopFn", "LoopPreset", "OptimizerImpl")

#: A user's own loop: ``fn(model, optimizer, batches)``. ``batches`` yields each iteration's
#: inputs (a tuple of positional arguments, or a dict of keyword arguments) as a DataLoader
#: hands them out; memcalc runs the user's code for real, on meta tensors.
LoopFn = Callable[[Any, Any, Any], Any]


class LoopPreset(str, enum.Enum):
    """The loops people actually run (docs/loops.md, "Which loop?", shows the code of each)."""

    MINIMAL = "minimal"  # forward → loss → backward (output dropped) → step → zero_grad(set_to_none)
    TUTORIAL = "tutorial"  # PyTorch quickstart: pred and loss stay alive until rebound
    TRAINER = "trainer"  # Hugging Face Trainer: outputs dropped, clip_grad_norm_, step, zero_grad
    ZERO_GRAD_LATE = "zero-grad-late"  # zero_grad() between forward and backward
    TRL_SFT = "trl-sft"  # TRL's SFTTrainer: the Trainer's loop around SFTTrainer.compute_loss
    TRL_DPO = "trl-dpo"  # TRL's DPOTrainer: policy and reference forwards in DPOTrainer.compute_loss
    TRL_REWARD = "trl-reward"  # TRL's RewardTrainer: chosen and rejected scored in one forward
    TRL_GRPO = "trl-grpo"  # TRL's GRPOTrainer: completions generated and scored, then GRPOTrainer.compute_loss

    @property
    def is_trainer(self) -> bool:
        """Whether the loop is Hugging Face Trainer's (its own, or a TRL trainer's, which inherit it)."""
        return self is LoopPreset.TRAINER or self.is_trl

    @property
    def is_trl(self) -> bool:
        """Whether the loop is a TRL trainer's (its compute_loss run on meta: :mod:`memcalc.stacks.trl`)."""
        return self in (LoopPreset.TRL_SFT, LoopPreset.TRL_DPO, LoopPreset.TRL_REWARD, LoopPreset.TRL_GRPO)


class OptimizerImpl(str, enum.Enum):
    """How ``torch.optim`` runs the step: its ``foreach``/``fused`` flags."""

    AUTO = "auto"  # what the installed torch picks for the target's parameters
    FOR_LOOP = "for-loop"  # foreach=False, fused=False: one parameter at a time
    FOREACH = "foreach"  # multi-tensor kernels: temporaries for every parameter at once
    FUSED = "fused"  # one fused kernel per group: no parameter-sized temporaries


@dataclass(frozen=True)
class Loop:
    """The loop around the model: ``memcalc.estimate(model, loop=memcalc.Loop("tutorial",
    keep_grads=True, optimizer_impl="fused"))``. A plain preset name or a function is
    accepted wherever a ``Loop`` is (``loop="trainer"``, ``loop=my_loop``).

    Attributes:
        body: a :class:`LoopPreset` (or its name), or the user's own ``fn(model, optimizer,
            batches)``, run for at least two iterations.
        keep_grads: ``zero_grad(set_to_none=False)``: gradients stay allocated for the whole
            run (torch < 2.0's default), instead of being freed after each step.
        optimizer_impl: :class:`OptimizerImpl` (or its name).
    """

    body: LoopPreset | LoopFn = LoopPreset.MINIMAL
    keep_grads: bool = False
    optimizer_impl: OptimizerImpl = OptimizerImpl.AUTO

    def __post_init__(self) -> None:
        body: Any = self.body
        if isinstance(body, str):
            object.__setattr__(self, "body", parse_choice(LoopPreset, body, "loop"))
        elif not callable(body):
            raise InvalidInputError(f"loop must be a preset name or a function fn(model, optimizer, batches), "
                                    f"got {type(body).__name__} {body!r}",
                                    hint="one of: " + ", ".join(p.value for p in LoopPreset) + ", or loop=my_loop")
        if not isinstance(self.keep_grads, bool):
            raise InvalidInputError(f"keep_grads must be True or False, got {self.keep_grads!r}")
        object.__setattr__(self, "optimizer_impl", parse_choice(OptimizerImpl, self.optimizer_impl, "optimizer_impl"))

    @classmethod
    def of(cls, value: Loop | LoopPreset | LoopFn | str | None) -> Loop:
        """``value`` as a :class:`Loop`: None is the default loop, a name a preset, a function
        the user's own loop."""
        if value is None:
            return cls()
        if isinstance(value, Loop):
            return value
        return cls(body=value)  # type: ignore[arg-type]  # a name: __post_init__ parses it

    @property
    def preset(self) -> LoopPreset | None:
        """The preset, or None for a user's own function."""
        return self.body if isinstance(self.body, LoopPreset) else None

    @property
    def is_default(self) -> bool:
        """The idealised loop memcalc synthesises its second iteration for (the fast path)."""
        return self.body is LoopPreset.MINIMAL and not self.keep_grads

    @property
    def name(self) -> str:
        """How the report names the loop: the preset, or the function's qualified name."""
        if isinstance(self.body, LoopPreset):
            return self.body.value
        return getattr(self.body, "__qualname__", None) or type(self.body).__name__

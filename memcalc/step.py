"""The step program: what "one training step" means, written once and run twice — on meta
tensors under the tracer (the estimate) and on real tensors (``--measure``), so that the two
can never drift apart.

One iteration is::

    output = model(*inputs)                       # forward
    loss = loss_fn(output, targets)               # loss
    loss.backward()                               # backward
    optimizer.step()                              # optimizer (state created lazily at step 1)
    optimizer.zero_grad(set_to_none=True)         # zero_grad
    del output, loss                              # a tidy loop: nothing survives the iteration

``eval`` mode is ``model.eval()`` and one forward under ``torch.no_grad()``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol, Sequence

import torch
from torch import nn

from models_zoo.registry import LossKind

from .categories import Category, Mode, Phase
from .losses import LossChoice, LossFn, compute_loss, make_targets, resolve_loss
from .optimizers import OptimizerSpec

__all__ = ("StepObserver", "StepOutcome", "run_step", "NullObserver")


class StepObserver(Protocol):
    """Callbacks the program makes; the tracer records, a measurement ignores most."""

    def set_phase(self, phase: Phase) -> None: ...
    def preexisting(self, tensor: torch.Tensor, category: Category) -> None: ...
    def backward_context(self) -> ContextManager[Any]: ...
    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None: ...
    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None: ...
    def finished(self) -> None:
        """The step is over; what dies after this (the program's locals) is not part of it."""


class NullObserver:
    def set_phase(self, phase: Phase) -> None:
        pass

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        pass

    def backward_context(self) -> ContextManager[Any]:
        return nullcontext()

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        pass

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def finished(self) -> None:
        pass


@dataclass(frozen=True)
class StepOutcome:
    loss_kind: LossKind | None  # None when a user loss_fn was given or in eval mode
    output_shape: tuple[int, ...]


def run_step(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    mode: Mode,
    optimizer: OptimizerSpec,
    loss: LossKind | LossChoice | str = LossChoice.AUTO,
    loss_fn: LossFn | None = None,
    iterations: int = 1,
    observer: StepObserver | None = None,
    foreach: bool = True,
) -> StepOutcome:
    """Run ``iterations`` training iterations (or one eval forward) of ``model``.

    The caller owns ``model``; its train/eval flag is restored on the way out.
    """
    obs: StepObserver = observer or NullObserver()
    was_training = model.training
    try:
        if mode is Mode.EVAL:
            return _eval_forward(model, inputs, obs)
        return _train(model, inputs, optimizer, loss, loss_fn, iterations, obs, foreach)
    finally:
        model.train(was_training)


def _eval_forward(model: nn.Module, inputs: Sequence[torch.Tensor], obs: StepObserver) -> StepOutcome:
    model.eval()
    with torch.no_grad():
        obs.set_phase(Phase.FORWARD)
        output = model(*inputs)
        shape = _shape(output)
        del output
    obs.finished()
    return StepOutcome(loss_kind=None, output_shape=shape)


def _train(model, inputs, optimizer_spec, loss, loss_fn, iterations, obs, foreach) -> StepOutcome:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer_spec.build(params, foreach) if params else None
    targets: tuple[torch.Tensor, ...] | None = None
    kind: LossKind | None = None
    shape: tuple[int, ...] = ()
    for _ in range(iterations):
        obs.set_phase(Phase.FORWARD)
        output = model(*inputs)
        shape = _shape(output)
        obs.set_phase(Phase.LOSS)
        if loss_fn is not None:
            loss_value = loss_fn(output)
        else:
            if kind is None:
                kind = resolve_loss(loss, output)
                targets = make_targets(kind, output)
                for target in targets:
                    obs.preexisting(target, Category.INPUTS)
            loss_value = compute_loss(kind, output, targets or ())
        obs.set_phase(Phase.BACKWARD)
        if loss_value.requires_grad:
            with obs.backward_context():
                loss_value.backward()
        obs.gradients_ready(params)
        if opt is not None:
            obs.set_phase(Phase.OPTIMIZER)
            opt.step()
            obs.optimizer_stepped(opt)
        obs.set_phase(Phase.ZERO_GRAD)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        del output, loss_value
    obs.finished()  # the optimizer (and its state) is still alive here, as in a real loop
    return StepOutcome(loss_kind=kind, output_shape=shape)


def _shape(output: Any) -> tuple[int, ...]:
    from .losses import primary_tensor

    try:
        return tuple(primary_tensor(output).shape)
    except TypeError:
        return ()

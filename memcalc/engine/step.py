"""The step program: what "one training step" means, written once and run twice — on meta
tensors under the tracer (the estimate) and on real tensors (``--measure``), so that the two
can never drift apart.

One iteration is (``accum_steps`` micro-batches, then one optimizer step)::

    for micro_batch in range(accum_steps):
        with autocast():                          # a no-op at fp32 / pure fp16 / pure bf16
            output = model(*args, **kwargs)       # forward (a dict batch: keyword arguments)
            loss = loss_fn(output, targets) / accum_steps   # loss (or output.loss: see below)
        scaler.scale(loss).backward()             # backward (scaler: amp-fp16 only)
        del output, loss
    scaler.unscale_(optimizer); scaler.step(optimizer); scaler.update()   # optimizer
    optimizer.zero_grad(set_to_none=True)         # zero_grad

When no loss was chosen and the model returns its own (``output.loss``: a Hugging Face model
given ``labels`` in its batch), the step trains with that one, as a Hugging Face loop does.

``eval`` mode is ``model.eval()`` and one forward under ``torch.no_grad()``; ``inference``
the same under ``torch.inference_mode()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import LossFunctionError, MemcalcError
from memcalc.core.losses import LossChoice, LossFn, LossKind
from memcalc.engine.losses import compute_loss, make_targets, primary_tensor, resolve_loss
from memcalc.engine.model import ModelInputs
from memcalc.engine.optimizers import OptimizerSpec

__all__ = ("NullObserver", "Scaler", "StepConfig", "StepObserver", "StepOutcome", "run_step")


class StepObserver(Protocol):
    """Callbacks the program makes; the tracer records, a measurement ignores most."""

    def set_phase(self, phase: Phase) -> None:
        """The step enters ``phase``."""

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        """``tensor`` exists before the step in a real loop (a target built after the forward)."""

    def backward_context(self) -> AbstractContextManager[Any]:
        """The context each ``backward()`` runs in."""

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        """Backward is over for this iteration: the ``.grad`` of ``params`` are final."""

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` ran: its state exists now."""

    def finished(self) -> None:
        """The step is over; what dies after this (the program's locals) is not part of it."""


class NullObserver:
    """An observer that ignores every callback (a plain run of the step)."""

    def set_phase(self, phase: Phase) -> None:
        pass

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        pass

    def backward_context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        pass

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def finished(self) -> None:
        pass


class Scaler(Protocol):
    """The part of ``torch.amp.GradScaler``'s interface the step uses."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale, for ``backward()``."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place."""

    def step(self, optimizer: torch.optim.Optimizer) -> Any:
        """``optimizer.step()`` unless the gradients hold inf/NaN."""

    def update(self) -> None:
        """Adjust the scale for the next iteration."""


@dataclass(frozen=True)
class StepConfig:
    """How to run the step. ``autocast`` is a factory of the context that wraps forward and
    loss (``torch.autocast`` for real, memcalc's emulation on meta); ``scaler`` makes it an
    amp-fp16 step."""

    mode: Mode
    optimizer: OptimizerSpec
    loss: LossKind | LossChoice | str = LossChoice.AUTO
    loss_fn: LossFn | None = None
    iterations: int = 1
    accum_steps: int = 1
    foreach: bool = True
    autocast: Callable[[], AbstractContextManager[Any]] = field(default=nullcontext)
    scaler_factory: Callable[[], Scaler | None] | None = None  # a factory may decline (None: no scaler)
    #: Train with the loss the model returns itself (``output.loss``) when it returns one: the
    #: user chose no loss, and a batch with ``labels`` makes a Hugging Face model compute it.
    model_loss: bool = False


@dataclass(frozen=True)
class StepOutcome:
    """What the step found out: the loss it trained with and the output's shape."""

    loss_kind: LossKind | None  # None with a user loss_fn, the model's own loss, or no loss
    output_shape: tuple[int, ...]
    model_loss: bool = False  # trained with the loss the model returned (``output.loss``)


def run_step(model: nn.Module, inputs: ModelInputs | Sequence[torch.Tensor], config: StepConfig,
             observer: StepObserver | None = None) -> StepOutcome:
    """Run ``config.iterations`` training iterations (or one eval/inference forward).

    ``inputs``: the forward's arguments (a plain sequence: positional). The caller owns
    ``model``; its train/eval flag is restored on the way out.
    """
    obs: StepObserver = observer or NullObserver()
    inputs = ModelInputs.of(inputs)
    was_training = model.training
    try:
        if config.mode is not Mode.TRAIN:
            return _forward_only(model, inputs, config, obs)
        return _train(model, inputs, config, obs)
    finally:
        model.train(was_training)


def _forward_only(model: nn.Module, inputs: ModelInputs, config: StepConfig,
                  obs: StepObserver) -> StepOutcome:
    model.eval()
    grad_mode = torch.inference_mode() if config.mode is Mode.INFERENCE else torch.no_grad()
    with grad_mode, config.autocast():
        obs.set_phase(Phase.FORWARD)
        output = inputs.call(model)
        shape = _shape(output)
        del output
    obs.finished()
    return StepOutcome(loss_kind=None, output_shape=shape)


def _train(model: nn.Module, inputs: ModelInputs, config: StepConfig, obs: StepObserver) -> StepOutcome:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = config.optimizer.build(params, config.foreach) if params else None
    scaler = config.scaler_factory() if config.scaler_factory is not None else None
    targets: tuple[torch.Tensor, ...] = ()
    kind: LossKind | None = None
    shape: tuple[int, ...] = ()
    model_loss = False
    for _ in range(config.iterations):
        for _micro in range(config.accum_steps):
            with config.autocast():
                obs.set_phase(Phase.FORWARD)
                output = inputs.call(model)
                shape = _shape(output)
                obs.set_phase(Phase.LOSS)
                if config.loss_fn is not None:
                    # the user's own code: a failure is the loss's, not the forward's or the input's
                    name = getattr(config.loss_fn, "__qualname__", None) or type(config.loss_fn).__name__
                    try:
                        returned: object = config.loss_fn(output)
                    except MemcalcError:
                        raise
                    except Exception as exc:
                        raise LossFunctionError(name, f"raised {type(exc).__name__}: {exc}") from exc
                    if not isinstance(returned, torch.Tensor) or returned.numel() != 1:
                        got = (f"a tensor of shape {tuple(returned.shape)}" if isinstance(returned, torch.Tensor)
                               else type(returned).__name__)
                        raise LossFunctionError(name, f"returned {got}, not a one-element tensor")
                    loss_value = returned
                elif (own := _model_loss(output, config)) is not None:
                    loss_value = own
                    model_loss = True
                else:
                    if kind is None:
                        kind = resolve_loss(config.loss, output)
                        targets = make_targets(kind, output)
                        for target in targets:
                            obs.preexisting(target, Category.INPUTS)
                    loss_value = compute_loss(kind, output, targets)
                if config.accum_steps > 1:
                    loss_value = loss_value / config.accum_steps
            obs.set_phase(Phase.BACKWARD)
            if loss_value.requires_grad:
                scaled = scaler.scale(loss_value) if scaler is not None else loss_value
                with obs.backward_context():
                    scaled.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is untyped in torch
                del scaled
            del output, loss_value
        obs.gradients_ready(params)
        if opt is not None:
            obs.set_phase(Phase.OPTIMIZER)
            if scaler is not None:
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            obs.optimizer_stepped(opt)
        obs.set_phase(Phase.ZERO_GRAD)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
    obs.finished()  # the optimizer (and its state) is still alive here, as in a real loop
    return StepOutcome(loss_kind=kind, output_shape=shape, model_loss=model_loss)


def _model_loss(output: Any, config: StepConfig) -> torch.Tensor | None:
    """The loss the model computed itself, when the loss was not chosen: a Hugging Face model
    given ``labels`` returns it as ``output.loss`` (a dict key of its ``ModelOutput``)."""
    if not config.model_loss:
        return None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    return None


def _shape(output: Any) -> tuple[int, ...]:
    try:
        return tuple(primary_tensor(output).shape)
    except TypeError:
        return ()

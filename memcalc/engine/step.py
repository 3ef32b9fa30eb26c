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

That loop (the ``minimal`` preset, ``memcalc.Loop()``) is traced once and its second iteration
synthesised (:mod:`memcalc.engine.timeline`) — unless the first freed a pre-existing storage (a
buffer the forward rebinds), when the tracer asks for the second to run too (``run_again``).
The other loops (:mod:`memcalc.engine.loops`) run for real, iteration by iteration; they and
:func:`run_step` share what the options decide — the autocast region, the loss and its
targets, the gradient scaler — through :class:`StepKit`.

``eval`` mode is ``model.eval()`` and one forward under ``torch.no_grad()``; ``inference``
the same under ``torch.inference_mode()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import LossFunctionError, MemcalcError
from memcalc.core.loop import OptimizerImpl
from memcalc.core.losses import LossChoice, LossFn, LossKind
from memcalc.engine.losses import compute_loss, make_targets, primary_tensor, resolve_loss
from memcalc.engine.model import ModelInputs
from memcalc.engine.optimizers import OptimizerSpec, TorchOptim
from memcalc.engine.step_backend import idle_modes_off
from memcalc.engine.trainable import build_optimizer, check_loss_trains

__all__ = ("NullObserver", "Scaler", "StepConfig", "StepKit", "StepObserver", "StepOutcome", "Targets", "fp32_outputs",
           "run_step")

#: The package of torch's own optimizers (``torch.optim.adam.Adam``, ``torch.optim.Adafactor``): their
#: step and ``zero_grad`` call no ``torch.nn.functional`` function, attention, dropout or loss
#: (tests/test_dispatch_cost.py).
_TORCH_OPTIM = "torch.optim"


class StepObserver(Protocol):
    """Callbacks the program makes; the tracer records, a measurement ignores most."""

    def set_phase(self, phase: Phase) -> None:
        """The step enters ``phase``."""

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        """``tensor`` exists before the step in a real loop (a target built after the forward)."""

    def batch_tensor(self, tensor: torch.Tensor) -> None:
        """``tensor`` arrives now with a batch (an input or a target of a batch after the first)."""

    def backward_context(self) -> AbstractContextManager[Any]:
        """The context each ``backward()`` runs in."""

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        """Backward is over for this iteration: the ``.grad`` of ``params`` are final."""

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` ran: its state exists now."""

    def run_again(self) -> bool:
        """After the last iteration asked for: whether one more must run. The tracer says yes
        once when the step freed a pre-existing storage (a buffer the forward rebinds), whose
        second iteration cannot be synthesised from the first."""

    def finished(self) -> None:
        """The step is over; what dies after this (the program's locals) is not part of it."""


class NullObserver:
    """An observer that ignores every callback (a plain run of the step)."""

    def set_phase(self, phase: Phase) -> None:
        pass

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        pass

    def batch_tensor(self, tensor: torch.Tensor) -> None:
        pass

    def backward_context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        pass

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def run_again(self) -> bool:
        return False

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
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH  # AUTO resolved for the target already
    autocast: Callable[[], AbstractContextManager[Any]] = field(default=nullcontext)
    scaler_factory: Callable[[], Scaler | None] | None = None  # a factory may decline (None: no scaler)
    amp: bool = False  # autocast mixed precision (``autocast`` opens a real or emulated region)
    #: Train with the loss the model returns itself (``output.loss``) when it returns one: the
    #: user chose no loss, and a batch with ``labels`` makes a Hugging Face model compute it.
    model_loss: bool = False
    #: The model's forward returns its 16-bit outputs copied to float32, as the forward
    #: ``Accelerator.prepare_model`` makes under mixed precision does (:func:`fp32_outputs`).
    fp32_outputs: bool = False
    #: ``backward`` is ``Accelerator.backward(loss)``: outside DeepSpeed it divides the loss by its
    #: ``gradient_accumulation_steps`` first (accelerate/accelerator.py), a new tensor alive through the
    #: backward beside the caller's undivided loss (:attr:`ACCELERATOR_LOSS_DIVISOR`).
    accelerator_backward: bool = False


#: The ``gradient_accumulation_steps`` ``Accelerator.backward`` divides by where memcalc models it: the
#: Trainer builds its accelerator with ``GradientAccumulationPlugin(num_steps=1)`` and divides the loss
#: itself (transformers/trainer.py); a loop of one's own under ``accelerate launch`` at ``accum_steps`` 1.
ACCELERATOR_LOSS_DIVISOR = 1


@dataclass(frozen=True)
class StepOutcome:
    """What the step found out: the loss it trained with and the output's shape."""

    loss_kind: LossKind | None  # None with a user loss_fn, the model's own loss, or no loss
    output_shape: tuple[int, ...]
    model_loss: bool = False  # trained with the loss the model returned (``output.loss``)


class Targets:
    """A batch's targets for memcalc's loss (the ``y`` of ``for X, y in batches``).

    Their shape is known only once the model's output is: the first batch's are made by the
    first loss (and count as existing before the step, as they would arrive with the batch);
    a later batch brings its own (:meth:`StepKit.targets_for`)."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.tensors = tensors  # None: not made yet


class StepKit:
    """What memcalc's options decide inside a training loop: the autocast region, the loss and
    its targets, the gradient scaler of amp-fp16, and whether ``zero_grad`` frees the
    gradients. :func:`run_step` and the presets of :mod:`memcalc.engine.loops` call these, so
    the loops differ only in their own code.

    Args:
        config: the step's options.
        observer: told about the targets it makes (None: nobody).
        keep_grads: ``zero_grad(set_to_none=False)``.
    """

    def __init__(self, config: StepConfig, observer: StepObserver | None = None, *, keep_grads: bool = False):
        self.config = config
        self.accum_steps = config.accum_steps
        self.keep_grads = keep_grads
        self.scaler = config.scaler_factory() if config.scaler_factory is not None else None
        self.loss_kind: LossKind | None = None
        self.model_loss = False
        self.output_shape: tuple[int, ...] = ()
        self._observer: StepObserver = observer or NullObserver()
        # (shape, dtype) of each target, known after the first loss; () when the loss needs none
        self._target_spec: tuple[tuple[tuple[int, ...], torch.dtype], ...] | None = None
        self._targets = Targets()  # run_step's one batch
        self._unscaled = False

    def autocast(self) -> AbstractContextManager[Any]:
        """The region around forward and loss (``torch.autocast`` under amp; else nothing)."""
        return self.config.autocast()

    def loss_fn(self, output: Any, targets: Targets | None = None) -> torch.Tensor:
        """The chosen loss of ``output`` (the user's ``loss_fn``, the model's own ``output.loss``,
        or memcalc's against ``targets``), divided by ``accum_steps`` when accumulating.

        Args:
            output: what the model returned.
            targets: the batch's targets; None: :func:`run_step`'s single batch's.

        Returns:
            A one-element tensor.
        """
        if not self.output_shape:
            self.output_shape = _shape(output)
        loss = self._loss(output, targets if targets is not None else self._targets)
        return loss / self.accum_steps if self.accum_steps > 1 else loss

    def _loss(self, output: Any, targets: Targets) -> torch.Tensor:
        config = self.config
        if config.loss_fn is not None:
            self._target_spec = ()
            return _user_loss(config.loss_fn, output)
        if (own := _model_loss(output, config)) is not None:
            self.model_loss = True
            self._target_spec = ()
            return own
        if self.loss_kind is None:
            self.loss_kind = resolve_loss(config.loss, output)
        if targets.tensors is None:
            made = make_targets(self.loss_kind, output)
            targets.tensors = made
            for target in made:
                if self._target_spec is None:  # the first batch's: they arrived with it, before the step
                    self._observer.preexisting(target, Category.INPUTS)
                else:  # a batch drawn before the first loss (a prefetch): they arrive now
                    self._observer.batch_tensor(target)
            if self._target_spec is None:
                self._target_spec = tuple((tuple(t.shape), t.dtype) for t in made)
        return compute_loss(self.loss_kind, output, targets.tensors)

    def targets_for(self, device: torch.device) -> Targets:
        """The targets a batch drawn now brings: zeros shaped as the first batch's (a valid class
        index, a valid regression target), or to be made by the loss if none was computed yet."""
        if self._target_spec is None:
            return Targets()
        return Targets(tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in self._target_spec))

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` (``scaler.scale(loss).backward()`` under amp-fp16), or
        ``Accelerator.backward(loss)`` (:attr:`StepConfig.accelerator_backward`); refused, as
        PyTorch refuses it, when the loss does not require grad."""
        check_loss_trains(loss)
        if self.config.accelerator_backward:  # accelerate's ``loss = loss / self.gradient_accumulation_steps``
            loss = loss / ACCELERATOR_LOSS_DIVISOR
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is untyped in torch

    def unscale_(self, optimizer: torch.optim.Optimizer | None) -> None:
        """``scaler.unscale_(optimizer)`` under amp-fp16, once per step (before clipping)."""
        if self.scaler is not None and optimizer is not None and not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """``optimizer.step()``; under amp-fp16 ``scaler.unscale_(optimizer)`` (unless done),
        ``scaler.step(optimizer)``, ``scaler.update()``. Nothing without an optimizer."""
        if optimizer is None:
            return
        if self.scaler is None:
            optimizer.step()
            return
        self.unscale_(optimizer)
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled = False

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """``optimizer.zero_grad()`` (the model's without an optimizer), with
        ``set_to_none=not keep_grads``."""
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=not self.keep_grads)
        else:
            model.zero_grad(set_to_none=not self.keep_grads)

    def outcome(self) -> StepOutcome:
        """What the loss found out, for the report."""
        return StepOutcome(loss_kind=self.loss_kind, output_shape=self.output_shape, model_loss=self.model_loss)


def run_step(model: nn.Module, inputs: ModelInputs | Sequence[torch.Tensor], config: StepConfig,
             observer: StepObserver | None = None) -> StepOutcome:
    """Run ``config.iterations`` training iterations (or one eval/inference forward).

    ``inputs``: the forward's arguments (a plain sequence: positional). The caller owns
    ``model``; its train/eval flag is restored on the way out. The step sets its own grad
    mode whatever the caller's (``torch.no_grad()``, ``torch.inference_mode()``): gradients
    for training, ``no_grad`` for eval, ``inference_mode`` for inference; the caller's is
    back on the way out.
    """
    obs: StepObserver = observer or NullObserver()
    inputs = ModelInputs.of(inputs)
    was_training = model.training
    try:
        with torch.inference_mode(False):  # the caller's inference mode would make every tensor one
            if config.mode is not Mode.TRAIN:
                return _forward_only(model, inputs, config, obs)
            with torch.enable_grad():  # a caller under torch.no_grad() would get no backward
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
    # torch's optimizers (built, stepped), zero_grad and amp-fp16's scaler call nothing a device's function
    # mode rewrites: it is taken off around them (and the observer's bookkeeping beside them) where it passes
    # their calls through anyway, a torch-function call saved for each .grad, state tensor and storage read
    with idle_modes_off() if isinstance(config.optimizer.factory, TorchOptim) else nullcontext():
        params = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(model, config.optimizer, config.optimizer_impl)
    plain = idle_modes_off if opt is None or _torch_optimizer(opt) else nullcontext
    step = StepKit(config, obs)
    with fp32_outputs(model, config):
        _iterations(model, inputs, config, obs, step, opt, params, plain)
    obs.finished()  # the optimizer (and its state) is still alive here, as in a real loop
    return step.outcome()


def _iterations(model: nn.Module, inputs: ModelInputs, config: StepConfig, obs: StepObserver, step: StepKit,
                opt: torch.optim.Optimizer | None, params: list[nn.Parameter],
                plain: Callable[[], AbstractContextManager[Any]]) -> None:
    """The training iterations of :func:`_train` (module docstring)."""
    iteration = 0
    while iteration < config.iterations or obs.run_again():
        iteration += 1
        for _micro in range(config.accum_steps):
            with step.autocast():
                obs.set_phase(Phase.FORWARD)
                output = inputs.call(model)
                obs.set_phase(Phase.LOSS)
                loss = step.loss_fn(output)
            obs.set_phase(Phase.BACKWARD)
            with obs.backward_context():
                step.backward(loss)
            del output, loss
        with plain():
            obs.gradients_ready(params)
            if opt is not None:
                obs.set_phase(Phase.OPTIMIZER)
                step.optimizer_step(opt)
                obs.optimizer_stepped(opt)
            obs.set_phase(Phase.ZERO_GRAD)
            step.zero_grad(model, opt)


@contextmanager
def fp32_outputs(model: nn.Module, config: StepConfig) -> Iterator[None]:
    """``model.forward`` as ``Accelerator.prepare_model`` leaves it under 16-bit mixed precision
    (accelerate/accelerator.py), while the loop runs: accelerate's own ``convert_outputs_to_fp32``
    around it, so the forward's fp16/bf16 outputs (a causal LM's logits) come back as float32 copies
    and the 16-bit ones die — the copies are what the loop's ``output`` holds through backward. The
    autocast region is the step's own (``config.autocast``). Nothing without ``config.fp32_outputs``;
    the forward is restored on the way out."""
    if not config.fp32_outputs:
        yield
        return
    convert = importlib.import_module("accelerate.utils").convert_outputs_to_fp32
    own = vars(model).get("forward")  # an instance's own forward (a stack's wrapper), put back after
    model.forward = convert(model.forward)
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's own (not a registered emulation's or a user's)."""
    module = type(optimizer).__module__
    return module == _TORCH_OPTIM or module.startswith(_TORCH_OPTIM + ".")


def _user_loss(loss_fn: LossFn, output: Any) -> torch.Tensor:
    """The user's own ``loss_fn(output)``: a failure is the loss's, not the forward's or the input's."""
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
    try:
        returned: object = loss_fn(output)
    except MemcalcError:
        raise
    except Exception as exc:
        raise LossFunctionError(name, f"raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(returned, torch.Tensor) or returned.numel() != 1:
        got = (f"a tensor of shape {tuple(returned.shape)}" if isinstance(returned, torch.Tensor)
               else type(returned).__name__)
        raise LossFunctionError(name, f"returned {got}, not a one-element tensor")
    return returned


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

"""Training loops run as written: the presets, and the user's own ``fn(model, optimizer, batches)``.

What is alive at the peak depends on the loop around the model: where ``zero_grad`` sits,
whether the last output is still referenced during the next forward, what is dropped before
backward. So these loops are not summarised: :func:`run_loop` runs the loop's real Python code
for two optimizer steps, and Python's own variable lifetimes decide when each tensor dies. On
meta tensors under the tracer that is the estimate (:mod:`memcalc.engine.loop_trace` tells the
phases apart without the loop's help); on real tensors it is ``--measure`` and the tests' CPU
runs — the same function both times.

``batches`` hands out ``2 × accum_steps`` batches, one at a time as a DataLoader does, each a
fresh copy of the model's inputs made when it is drawn, so the previous batch dies when the
loop lets go of it. A user's loop runs on meta tensors: it cannot read a value
(:class:`~memcalc.core.errors.DataDependentError`), and is refused with a ``loss`` or an amp
``precision`` (:func:`memcalc.engine.loop_trace.check_loop`). An exception from it is a
:class:`~memcalc.core.errors.LoopFunctionError` naming the function and the line.

The presets are the documentation of what each loop stands for (docs/loops.md, "Which loop?", quotes
them): ``step`` (:class:`~memcalc.engine.step.StepKit`) is what the options decide; the comment
on each line is the plain PyTorch it stands for.

What a loop function is given and may do, in full: docs/notes/loops.md.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn

from memcalc.core.categories import Category
from memcalc.core.errors import InvalidInputError, LoopFunctionError, MemcalcError
from memcalc.core.loop import Loop, LoopFn, LoopPreset
from memcalc.engine.model import ModelInputs
from memcalc.engine.step import NullObserver, StepConfig, StepKit, StepObserver, StepOutcome, Targets, fp32_outputs
from memcalc.engine.trainable import build_optimizer

__all__ = ("ITERATIONS", "PRESETS", "Batches", "LoopObserver", "NullLoopObserver", "loop_name", "minimal", "run_loop",
           "trainer", "tutorial", "zero_grad_late")

#: Optimizer steps a loop runs: the second is the first with the optimizer state already there
#: (every later one repeats the second), and the first output of a loop may outlive its iteration.
ITERATIONS = 2

Optimizer: TypeAlias = "torch.optim.Optimizer | None"  # None: optimizer "none" (forward + backward)
#: A preset: ``fn(model, optimizer, batches, step)``, batches yielding ``(X, y)``.
PresetFn = Callable[[nn.Module, Optimizer, "Batches", StepKit], None]


def minimal(model: nn.Module, optimizer: Optimizer, batches: Batches, step: StepKit) -> None:
    """memcalc's idealised loop: the output is dropped after backward, the gradients freed by
    ``zero_grad()`` after the step."""
    for i, (X, y) in enumerate(batches):
        with step.autocast():
            output = model(*X.args, **X.kwargs)       # output = model(X)
            loss = step.loss_fn(output, y)            # loss = loss_fn(output, y)
        step.backward(loss)                           # loss.backward()
        del output, loss
        if (i + 1) % step.accum_steps == 0:
            step.optimizer_step(optimizer)            # optimizer.step()
            step.zero_grad(model, optimizer)          # optimizer.zero_grad()


def tutorial(model: nn.Module, optimizer: Optimizer, batches: Batches, step: StepKit) -> None:
    """The PyTorch quickstart's ``train`` (pytorch/tutorials,
    beginner_source/basics/quickstart_tutorial.py): ``pred`` and ``loss`` stay alive until the
    next iteration rebinds them, so the last output is alive during the next forward."""
    for i, (X, y) in enumerate(batches):
        with step.autocast():
            pred = model(*X.args, **X.kwargs)         # pred = model(X)
            loss = step.loss_fn(pred, y)              # loss = loss_fn(pred, y)
        step.backward(loss)                           # loss.backward()
        if (i + 1) % step.accum_steps == 0:
            step.optimizer_step(optimizer)            # optimizer.step()
            step.zero_grad(model, optimizer)          # optimizer.zero_grad()


def zero_grad_late(model: nn.Module, optimizer: Optimizer, batches: Batches, step: StepKit) -> None:
    """``zero_grad()`` between forward and backward: the last step's gradients are alive during
    the whole next forward."""
    for i, (X, y) in enumerate(batches):
        with step.autocast():
            output = model(*X.args, **X.kwargs)       # output = model(X)
            loss = step.loss_fn(output, y)            # loss = loss_fn(output, y)
        if i % step.accum_steps == 0:
            step.zero_grad(model, optimizer)          # optimizer.zero_grad()
        step.backward(loss)                           # loss.backward()
        del output, loss
        if (i + 1) % step.accum_steps == 0:
            step.optimizer_step(optimizer)            # optimizer.step()


def trainer(model: nn.Module, optimizer: Optimizer, batches: Batches, step: StepKit) -> None:
    """Hugging Face ``Trainer._inner_training_loop`` (transformers 5.24, trainer.py): the
    micro-batches of one update are drawn first (``get_batch_samples``), each goes through
    :func:`_training_step`, then the gradients' norm is taken and they are clipped, the
    optimizer steps and ``model.zero_grad()`` frees them.

    The norm is taken whatever ``max_grad_norm`` is: above 0 ``_clip_grad_norm`` clips to it,
    at 0 ``_get_grad_norm`` takes it with ``max_norm=inf``. accelerate before 1.16 calls
    ``clip_grad_norm_`` both times (at inf the multiply scales by 1, in place); 1.16 calls
    ``get_total_norm`` and skips ``clip_grads_with_norm_`` at inf, a few scalar tensors less."""
    epoch_iterator = iter(batches)
    tr_loss = torch.zeros((), device=_device(model))                  # self._tr_loss = torch.tensor(0.0)
    while batch_samples := _get_batch_samples(epoch_iterator, step.accum_steps):
        for inputs in batch_samples:
            tr_loss_step = _training_step(model, inputs, step)
            tr_loss += tr_loss_step                                     # self._tr_loss += tr_loss_step
        _grad_norm = None                                               # (logged, alive until here)
        step.unscale_(optimizer)                                        # accelerator.clip_grad_norm_ unscales,
        _grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # then clips (max_grad_norm; inf at 0)
        step.optimizer_step(optimizer)                                  # self.optimizer.step()
        model.zero_grad(set_to_none=not step.keep_grads)                # model.zero_grad()


def _get_batch_samples(epoch_iterator: Iterator[tuple[ModelInputs, Targets]],
                       num_batches: int) -> list[tuple[ModelInputs, Targets]]:
    """``Trainer.get_batch_samples``: the next ``num_batches`` batches, all drawn before the
    first forward (the previous update's list is alive until this returns)."""
    batch_samples = []
    for _ in range(num_batches):
        try:
            batch_samples.append(next(epoch_iterator))
        except StopIteration:
            break
    return batch_samples


def _training_step(model: nn.Module, inputs: tuple[ModelInputs, Targets], step: StepKit) -> torch.Tensor:
    """``Trainer.training_step``: ``compute_loss`` under the autocast accelerate puts around the
    forward, ``del inputs`` (the caller's list still holds the batch), the loss divided by the
    accumulation steps, ``accelerator.backward(loss)``, and ``loss.detach()`` returned."""
    with step.autocast():
        loss = _compute_loss(model, inputs, step)
    del inputs
    step.backward(loss)
    return loss.detach()


def _compute_loss(model: nn.Module, inputs: tuple[ModelInputs, Targets], step: StepKit) -> torch.Tensor:
    """``Trainer.compute_loss``: ``outputs = model(**inputs)`` and its loss; the outputs die when
    it returns, before backward. Under amp, accelerate's ``prepare_model`` wraps the forward in
    ``convert_outputs_to_fp32`` (accelerate/accelerator.py): its 16-bit outputs are copied to
    float32 after the model (and the loss it computes from ``labels``) ran."""
    X, y = inputs
    outputs = model(*X.args, **X.kwargs)
    loss = step.loss_fn(outputs, y)
    if step.config.amp:
        outputs = _to_fp32(outputs)
    del outputs
    return loss


def _to_fp32(value: Any) -> Any:
    """accelerate's ``convert_to_fp32``: every fp16/bf16 tensor of an output as float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


PRESETS: dict[LoopPreset, PresetFn] = {
    LoopPreset.MINIMAL: minimal,
    LoopPreset.TUTORIAL: tutorial,
    LoopPreset.TRAINER: trainer,
    LoopPreset.ZERO_GRAD_LATE: zero_grad_late,
    # TRL's trainers inherit Trainer's loop and training step; what is their own, compute_loss, runs
    # in the model memcalc.stacks.trl wraps around the policy (its forward returns TRL's loss)
    LoopPreset.TRL_SFT: trainer,
    LoopPreset.TRL_DPO: trainer,
    LoopPreset.TRL_REWARD: trainer,
    LoopPreset.TRL_GRPO: trainer,  # generation and scoring run in the forward too, as in training_step
}


class LoopObserver(StepObserver, Protocol):
    """What the tracer learns from a running loop, beyond the step program's callbacks."""

    def batch_starts(self, index: int, starts_iteration: bool) -> None:
        """Batch ``index`` (0-based) is about to be made; ``starts_iteration``: it is the first
        micro-batch of an optimizer step."""

    def watching(self, model: nn.Module, optimizer: Optimizer) -> AbstractContextManager[Any]:
        """The context the loop function runs in (hooks that tell its phases apart)."""

    def in_forward(self) -> bool:
        """Whether the model's forward is running (an exception now is the forward's)."""


class NullLoopObserver(NullObserver):
    """A loop run without a tracer (a real measurement)."""

    def batch_starts(self, index: int, starts_iteration: bool) -> None:
        pass

    def watching(self, model: nn.Module, optimizer: Optimizer) -> AbstractContextManager[Any]:
        return nullcontext()

    def in_forward(self) -> bool:
        return False


class Batches:
    """The ``batches`` a loop draws from: ``count`` batches, each made when it is drawn.

    Nothing here holds a batch once it is handed out, so a batch lives exactly as long as the
    loop keeps a reference to it. A batch is a ``clone`` of the model's inputs: on meta a new
    storage of the same size, on a real run the same values (valid token ids).

    Args:
        inputs: the model's inputs, one batch's worth.
        count: how many batches to hand out (then ``StopIteration``).
        per_iteration: micro-batches per optimizer step (``accum_steps``).
        observer: told of every batch.
        step: a preset's kit: batches are then ``(X, y)`` pairs with memcalc's targets; None: a
            user's loop, given a tuple of positional arguments, or a dict — of keyword
            arguments, or the one argument of a forward that takes a dict (as a DataLoader of
            dicts yields it: ``model(batch)``, not ``model(*batch)``).
    """

    def __init__(self, inputs: ModelInputs, count: int, per_iteration: int, observer: LoopObserver,
                 step: StepKit | None) -> None:
        self._inputs = inputs
        self._count = count
        self._per_iteration = per_iteration
        self._observer = observer
        self._step = step
        self.drawn = 0

    def __iter__(self) -> Batches:
        return self

    def __len__(self) -> int:
        return self._count

    def __next__(self) -> Any:
        if self.drawn >= self._count:
            raise StopIteration
        index = self.drawn
        self.drawn += 1
        self._observer.batch_starts(index, index % self._per_iteration == 0)
        X = self._inputs.map(torch.clone)
        y = self._step.targets_for(X[0].device if len(X) else torch.device("meta")) if self._step else None
        for tensor in (*X, *(y.tensors or () if y is not None else ())):
            if index == 0:  # the batch the loop starts with: there before the step, as run_step's
                self._observer.preexisting(tensor, Category.INPUTS)
            else:
                self._observer.batch_tensor(tensor)
        if y is not None:
            return X, y
        if X.kwargs:
            return dict(X.kwargs)
        if len(X.args) == 1 and isinstance(X.args[0], dict):  # the forward takes the dict itself
            return X.args[0]
        return tuple(X.args)


def run_loop(model: nn.Module, inputs: ModelInputs, config: StepConfig, loop: Loop,
             observer: LoopObserver | None = None, *, iterations: int = ITERATIONS) -> StepOutcome:
    """Run ``loop`` (a preset or the user's function) for ``iterations`` optimizer steps of
    ``config.accum_steps`` micro-batches each (``config.iterations`` is run_step's, not read).

    Args:
        model: the model (its train/eval flag is restored on the way out).
        inputs: one batch's inputs; every batch drawn is a fresh copy.
        config: the step's options (optimizer and its implementation, loss, autocast, scaler,
            accumulation).
        loop: the loop: a preset, or ``fn(model, optimizer, batches)``.
        observer: the tracer's (None: a plain run).
        iterations: optimizer steps (the batches handed out: ``iterations × accum_steps``).

    Returns:
        What the loss found out (for a user's loop, nothing: it computes its own).

    Raises:
        LoopFunctionError: the user's loop raised outside the model's forward.
        InvalidInputError: inputs a user's loop cannot be handed (positional and keyword at once).
    """
    obs: LoopObserver = observer or NullLoopObserver()
    preset = loop.preset
    if preset is None and inputs.args and inputs.kwargs:
        raise InvalidInputError(
            f"a loop function's batches are a tuple of positional arguments or a dict of keyword arguments; "
            f"these inputs are both ({inputs.description})", hint="Give the inputs as a tuple or as a dict.")
    was_training = model.training
    model.train()
    optimizer = build_optimizer(model, config.optimizer, config.optimizer_impl)
    step = StepKit(config, obs, keep_grads=loop.keep_grads)
    batches = Batches(inputs, iterations * config.accum_steps, config.accum_steps, obs,
                      step if preset is not None else None)
    # the Trainer's loop copies its outputs to float32 itself (_compute_loss), as its prepared model does
    prepared = nullcontext() if preset is not None and preset.is_trainer else fp32_outputs(model, config)
    try:
        with obs.watching(model, optimizer), prepared:
            if preset is not None:
                PRESETS[preset](model, optimizer, batches, step)
            else:
                _run_user_loop(loop.body, model, optimizer, batches, obs)  # type: ignore[arg-type]  # not a preset
    finally:
        model.train(was_training)
    obs.finished()  # the optimizer and its state are alive here, as after a real loop's steps
    return step.outcome()


def _run_user_loop(fn: LoopFn, model: nn.Module, optimizer: Optimizer, batches: Batches,
                   obs: LoopObserver) -> None:
    """``fn(model, optimizer, batches)``; what it raises outside the model's forward is the loop's."""
    try:
        fn(model, optimizer, batches)
    except MemcalcError:
        raise
    except Exception as exc:
        if obs.in_forward():
            raise  # the model's forward failed: the caller names the model and its input
        raise LoopFunctionError(loop_name(fn), _problem(fn, exc, batches)) from exc


def loop_name(fn: LoopFn) -> str:
    """The loop function's qualified name (as the report names it)."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _problem(fn: LoopFn, exc: BaseException, batches: Batches) -> str:
    if isinstance(exc, StopIteration):
        return (f"drew more than the {len(batches)} batches memcalc hands out (two optimizer steps of "
                f"{len(batches) // 2} micro-batch(es)); draw them with `for batch in batches:`")
    return f"raised {type(exc).__name__}: {exc}{_where(fn, exc)}"


def _where(fn: LoopFn, exc: BaseException) -> str:
    """' (at file.py, line N)': the innermost line of the loop's own file."""
    try:
        source = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:
        return ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if source is not None and frame.filename == source:
            return f" (at {frame.filename}, line {frame.lineno})"
    return ""

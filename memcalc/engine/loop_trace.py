"""Watching a training loop run under the tracer: its phases, its gradients and optimizer
state, its iterations — found out without the loop's help, since a user's loop calls nothing
of memcalc.

* **forward**: from the model's forward pre-hook (the root module's) to its forward hook;
  then **loss** until backward starts.
* **backward**: ``Tensor.backward`` and ``torch.autograd.backward`` calls, seen by a
  ``TorchFunctionMode`` (so the loss's initial gradient is born in backward, as in
  :func:`~memcalc.engine.step.run_step`); what follows until the optimizer step (gradient
  clipping, a gradient scaler's unscaling) still counts as backward, as it does there.
* **optimizer**: from the optimizer's step pre-hook (``register_step_pre_hook``) to its post
  hook; then **zero_grad**, as is every ``optimizer.zero_grad()`` call.
* **setup**: a batch being drawn. A batch that starts an optimizer step starts an iteration.

Gradients are the ``.grad`` of the model's parameters, classified by storage when a backward
ends and when the optimizer steps; optimizer state is what ``optimizer.state`` holds after a
step.

The loop runs on meta tensors: a batch moved to a device (``x.to(device)``, ``x.cuda()``)
stays where it is, and a tensor the loop makes on ``device="cuda"`` is made on meta.
``torch.autocast`` has no effect on meta tensors (nor does memcalc's emulation see it): a
forward run inside one is noted (:attr:`LoopTracing.autocast_seen`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import DataDependentError, InapplicableOptionError
from memcalc.engine.step import StepObserver
from memcalc.engine.step_spec import Step
from memcalc.engine.trace import StorageTracer

__all__ = ("BATCH_LABEL", "LoopTracing", "check_loop")

#: How a drawn batch's storages are named in the timeline (their op).
BATCH_LABEL = "next(batches)"
# What starts a backward pass from Python.
_BACKWARD_CALLS = frozenset({torch.Tensor.backward, torch.autograd.backward})


class LoopTracing:
    """The tracer's observer of a loop run by :func:`memcalc.engine.loops.run_loop`.

    Args:
        tracer: the storage tracer the loop runs under.
        model: the model (its parameters' gradients are classified).
        recorder: the observer :func:`~memcalc.engine.step.run_step` would have, which
            classifies gradients and optimizer state and stops the tracer.
    """

    def __init__(self, tracer: StorageTracer, model: nn.Module, recorder: StepObserver) -> None:
        self.tracer = tracer
        self.model = model
        self.recorder = recorder
        self.batches_drawn = 0
        self.backward_calls = 0
        self.optimizer_steps = 0
        self.autocast_seen = False  # the model ran inside a torch.autocast region
        self._forward_depth = 0
        self._iteration_entries: list[int] = []  # positions in trace.phase_log of iteration starts

    # ---- the step program's callbacks ------------------------------------------------------
    def set_phase(self, phase: Phase) -> None:
        return None  # the hooks tell the phases apart

    def preexisting(self, tensor: torch.Tensor, category: Category) -> None:
        self.tracer.preexisting(tensor, category)

    def batch_tensor(self, tensor: torch.Tensor) -> None:
        uid = self.tracer.track(tensor, Category.INPUTS)
        self.tracer.trace.op[uid] = BATCH_LABEL

    def backward_context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def gradients_ready(self, params: Sequence[nn.Parameter]) -> None:
        self.recorder.gradients_ready(params)

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        self.recorder.optimizer_stepped(optimizer)

    def run_again(self) -> bool:
        return False  # the loop traces every iteration it runs already

    def finished(self) -> None:
        self.recorder.gradients_ready(list(self.model.parameters()))
        self.recorder.finished()

    # ---- the loop's ------------------------------------------------------------------------
    def batch_starts(self, index: int, starts_iteration: bool) -> None:
        self.batches_drawn += 1
        self.tracer.set_phase(Phase.SETUP)
        if starts_iteration and index > 0:
            self._iteration_entries.append(len(self.tracer.trace.phase_log) - 1)

    def in_forward(self) -> bool:
        return self._forward_depth > 0

    @contextmanager
    def watching(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        """Hooks on the model and the optimizer, and the backward watch, for the loop's run;
        all removed on the way out (the optimizer is memcalc's own, the model its meta twin)."""
        handles: list[RemovableHandle] = [model.register_forward_pre_hook(self._forward_starts),
                                          model.register_forward_hook(self._forward_ends)]
        if optimizer is not None:
            handles.append(optimizer.register_step_pre_hook(self._step_starts))
            handles.append(optimizer.register_step_post_hook(self._step_ends))
            optimizer.zero_grad = self._zero_grad(optimizer.zero_grad)  # type: ignore[method-assign]
        try:
            with _LoopWatch(self):
                yield
        finally:
            for handle in handles:
                handle.remove()
            if optimizer is not None:
                del optimizer.zero_grad  # the instance attribute: the class's method again

    def iteration_starts(self) -> list[int]:
        """Indices into ``trace.events`` where the iterations after the first begin."""
        log = self.tracer.trace.phase_log
        return [log[entry][1] for entry in self._iteration_entries]

    # ---- hooks -----------------------------------------------------------------------------
    def _forward_starts(self, _module: nn.Module, _args: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth == 1 and not self.tracer.modules.in_backward:
            self.tracer.set_phase(Phase.FORWARD)
        # torch counts the open torch.autocast regions, enabled or not (a CUDA one on a CPU-only
        # build disables itself but still counts; memcalc's emulated region is not one): any
        # open region makes our probe's count exceed 1
        if torch.autocast_increment_nesting() > 1:
            self.autocast_seen = True
        torch.autocast_decrement_nesting()

    def _forward_ends(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._forward_depth = max(self._forward_depth - 1, 0)
        if self._forward_depth == 0 and not self.tracer.modules.in_backward:
            self.tracer.set_phase(Phase.LOSS)

    def _step_starts(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.recorder.gradients_ready([p for group in optimizer.param_groups for p in group["params"]])
        self.tracer.set_phase(Phase.OPTIMIZER)

    def _step_ends(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.optimizer_steps += 1
        self.optimizer_stepped(optimizer)
        self.tracer.set_phase(Phase.ZERO_GRAD)

    def _zero_grad(self, zero_grad: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            self.tracer.set_phase(Phase.ZERO_GRAD)
            zero_grad(*args, **kwargs)
        return call

    def backward(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A backward pass the loop started: its phase, its module tracking, its gradients."""
        self.backward_calls += 1
        self.tracer.set_phase(Phase.BACKWARD)
        with self.tracer.modules.backward():
            result = func(*args, **kwargs)
        self.recorder.gradients_ready(list(self.model.parameters()))
        return result

    # ---- what the report says ----------------------------------------------------------------
    def notes(self, step: Step, batches: int, has_optimizer: bool) -> list[str]:
        """What the report should say about the loop's run: whatever it did not do."""
        name = step.loop.name
        notes: list[str] = []
        if self.batches_drawn == 0:
            notes.append(f"the loop {name} drew no batch from `batches`: the model's inputs are not counted")
        elif self.batches_drawn < batches:
            notes.append(f"the loop {name} drew {self.batches_drawn} of the {batches} batches it was offered")
        if self.backward_calls == 0:
            notes.append(f"the loop {name} never called backward(): no gradients were made")
        if has_optimizer and self.optimizer_steps == 0:
            notes.append(f"the loop {name} never called optimizer.step(): no optimizer state was made")
        if self.autocast_seen:
            notes.append(f"the loop {name} runs the model inside torch.autocast, which memcalc does not follow on "
                         f"meta tensors: this estimate is without autocast (use a preset with precision amp-bf16 "
                         f"or amp-fp16 for memcalc's emulation of it)")
        return notes

    def explain(self, exc: DataDependentError, loop: str) -> None:
        """A value read by the loop's own code (``loss.item()``), not by the model: say so, once,
        with the loop's line."""
        if not self.in_forward() and not exc.module:
            exc.read_by_loop(loop)


def check_loop(step: Step, *, multi_gpu: bool) -> None:
    """Refuse what a traced loop cannot honour, rather than ignore it.

    Raises:
        InapplicableOptionError: a multi-GPU strategy around a loop other than the Trainer's (its
            own or a TRL trainer's: memcalc.estimation checks which strategies), an eval or
            inference step, or — with the user's own loop, which computes its own loss, runs its
            own autocast and zeroes its own gradients — a chosen loss, an amp precision or ``keep_grads``.
    """
    loop = step.loop
    if multi_gpu and not (loop.preset is not None and loop.preset.is_trainer):
        raise InapplicableOptionError(
            f"the loop {loop.name} (loop, --loop, --keep-grads) is estimated on one GPU only for now; a multi-GPU "
            f"strategy runs memcalc's own loop or the Trainer's (--loop trainer, TRL's)",
            hint="Leave out the loop (and --keep-grads), or the strategy, or give --loop trainer.")
    if step.mode is not Mode.TRAIN:
        raise InapplicableOptionError(f"a training loop applies to mode train; the mode is {step.mode.value}")
    if loop.preset is not None:
        return
    if loop.keep_grads:
        raise InapplicableOptionError(
            f"your loop {loop.name} calls its own zero_grad: keep_grads (--keep-grads) would be ignored",
            hint="Call optimizer.zero_grad(set_to_none=False) in your loop instead.")
    if step.loss is not None or step.loss_fn is not None:
        raise InapplicableOptionError(
            f"your loop {loop.name} computes its own loss: the loss option (loss, --loss) would be ignored",
            hint="Leave out the loss, or use a preset loop (--loop minimal, tutorial, trainer, zero-grad-late).")
    if step.precision.is_amp:
        raise InapplicableOptionError(
            f"precision {step.precision.value} is memcalc's autocast, which it applies in its preset loops; "
            f"your loop {loop.name} runs as written, and a torch.autocast inside it has no effect on meta tensors",
            hint="Estimate your loop at fp32, bf16 or fp16, or use a preset loop with the amp precision.")


class _LoopWatch(TorchFunctionMode):
    """Sees the loop's torch calls: backward passes, and moves to a device (kept on meta)."""

    def __init__(self, tracing: LoopTracing) -> None:
        super().__init__()
        self.tracing = tracing

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _BACKWARD_CALLS:
            return self.tracing.backward(func, args, kwargs)
        if func is torch.Tensor.to and args and _on_meta(args[0]):
            return _to_on_meta(args[0], args[1:], kwargs)
        if func is torch.Tensor.cuda and args and _on_meta(args[0]):
            return args[0]  # .cuda() of a tensor that stands for a CUDA tensor already
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "meta"}  # a tensor made on the GPU: on meta here
        return func(*args, **kwargs)


def _on_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _is_cuda(device: Any) -> bool:
    try:
        return device is not None and torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


def _to_on_meta(tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``tensor.to(...)`` with any device left out: a meta tensor stands for the batch already on
    the GPU. A dtype or memory format still converts (``x.to(device, torch.bfloat16)``)."""
    copy = bool(kwargs.get("copy", False))  # _parse_to does not take it (generate()'s `.to(copy=True, ...)`)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(
        *args, **{k: v for k, v in kwargs.items() if k != "copy"})
    if device is None or device.type == "meta":
        return tensor.to(*args, **kwargs)
    options: dict[str, Any] = {"non_blocking": non_blocking, "copy": copy}
    if memory_format is not None:
        options["memory_format"] = memory_format
    return tensor.to(dtype if dtype is not None else tensor.dtype, **options)

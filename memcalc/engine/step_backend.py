"""The seam between the engine and a device: what a backend plugs into a traced step.

The engine runs the step on meta tensors and knows nothing of CUDA. A *step backend* adds
what a real device does differently: a function mode entered around the step (CUDA's
autocast and kernel choices, :mod:`memcalc.targets.cuda.emulation`), a callback after every aten op
(kernel workspaces, :mod:`memcalc.targets.cuda.workspaces`), an autocast region and a gradient
scaler for mixed precision, and notes for the report. :class:`PlainBackend` adds nothing: the
step as meta tensors run it.

Activation checkpointing must recompute under the autocast region of the original forward,
as ``torch.utils.checkpoint`` does for the real ``torch.autocast``. An emulated region is
invisible to checkpoint, so a backend announces its region here
(:func:`push_autocast_region`) and the checkpoint wrapper of :mod:`memcalc.engine.prepare`
reads it (:func:`current_autocast_region`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from memcalc.engine.trace import StorageTracer

__all__ = (
    "AfterOp",
    "AutocastRegion",
    "CompiledAutocast",
    "GradScalerLike",
    "PlainBackend",
    "StepBackend",
    "available_autocast_region",
    "current_autocast_region",
    "idle_modes_off",
    "outside_autocast_regions",
    "pop_autocast_region",
    "push_autocast_region",
)

#: Called after every aten op with ``(op, args, kwargs, output)``.
AfterOp = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]
#: A factory of context managers: each call opens one autocast region.
AutocastRegion = Callable[[], AbstractContextManager[Any]]


@dataclass(frozen=True)
class CompiledAutocast:
    """How a compiled autocast step gets its casts. ``torch.compile`` under ``torch.autocast``
    puts them in the graph: Dynamo guards on the ambient autocast state and AOTAutograd traces the
    joint graph under it, so the dispatcher's autocast kernels record each cast (and the
    partitioner decides which casts are saved or recomputed); the compiled code then runs with
    autocast off (AOTAutograd's runtime wrapper, ``disable_amp``).

    ``call``: a real ``torch.autocast`` entered around each call of the compiled forward, as a
    user's loop enters it (the CPU target: AOTAutograd traces on fake CPU tensors, so CPU
    autocast's own C++ kernels cast). ``trace``: an emulated policy in force only while
    AOTAutograd traces (the CUDA target: CUDA's op lists as the eager emulation applies them,
    since no CUDA autocast kernel runs on CPU tensors; the CUDA target's ``trace`` also picks
    CUDA's attention kernel, at any precision)."""

    call: AutocastRegion | None = None
    trace: AutocastRegion | None = None


class GradScalerLike(Protocol):
    """The part of ``torch.amp.GradScaler`` the step program calls."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale, for ``backward()``."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` unless the gradients hold inf/NaN."""

    def update(self) -> None:
        """Adjust the scale for the next iteration."""


class StepBackend(Protocol):
    """What a device adds to the traced step (see the module docstring)."""

    def attach(self, tracer: StorageTracer) -> None:
        """Called once, before the step, with the tracer the backend may add storages to."""

    def after_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Called after every aten op the tracer sees for which :meth:`after_op_applies`."""

    def after_op_applies(self, func: Any) -> bool:
        """Whether :meth:`after_op` can do anything for ``func``: asked once per op and trace,
        so that the ops without a rule (most) cost no call."""

    def mode(self) -> AbstractContextManager[Any]:
        """Entered around the whole step (outside the tracer's dispatch mode)."""

    def autocast(self) -> AutocastRegion | None:
        """The autocast region of a mixed-precision step, or None."""

    def grad_scaler(self) -> GradScalerLike | None:
        """A gradient scaler for the step (fp16 mixed precision), or None."""

    def attention_backends(self) -> Mapping[str, int]:
        """Attention kernels chosen during the step, with their call counts."""

    def compiled_autocast(self) -> CompiledAutocast | None:
        """How a compiled step's autocast casts get into its graph; None: no autocast."""

    def notes(self, module: torch.nn.Module) -> list[str]:
        """Lines for the report about what the backend modelled."""

    def approximated_ops(self) -> Mapping[str, int] | None:
        """The calls, by op name, whose memory inside the kernel the backend's own rules found
        approximated (the report's list); None: the engine's list by op name applies."""


class PlainBackend:
    """The step as meta tensors run it: nothing emulated, nothing added."""

    def attach(self, tracer: StorageTracer) -> None:
        return None

    def after_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        return None

    def after_op_applies(self, func: Any) -> bool:
        return False

    def mode(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def autocast(self) -> AutocastRegion | None:
        return None

    def grad_scaler(self) -> GradScalerLike | None:
        return None

    def attention_backends(self) -> Mapping[str, int]:
        return {}

    def compiled_autocast(self) -> CompiledAutocast | None:
        return None

    def notes(self, module: torch.nn.Module) -> list[str]:
        return []

    def approximated_ops(self) -> Mapping[str, int] | None:
        return None


class _Regions(threading.local):
    def __init__(self) -> None:
        self.stack: list[Callable[[], AutocastRegion | None]] = []
        self.available: list[AutocastRegion | None] = []


_REGIONS = _Regions()


def push_autocast_region(current: Callable[[], AutocastRegion | None], available: AutocastRegion | None = None) -> None:
    """A backend's mode was entered: ``current()`` says which region is in force now, ``available``
    opens one of its regions (None: the step has no autocast)."""
    _REGIONS.stack.append(current)
    _REGIONS.available.append(available)


def pop_autocast_region(current: Callable[[], AutocastRegion | None]) -> None:
    """The backend's mode was left (innermost first)."""
    if _REGIONS.stack and _REGIONS.stack[-1] is current:
        _REGIONS.stack.pop()
        _REGIONS.available.pop()


@contextmanager
def outside_autocast_regions() -> Iterator[None]:
    """No emulated autocast region in force on this thread while the block runs: a compiled
    forward (:mod:`memcalc.engine.compiled`), which Dynamo captured without one, runs so."""
    saved, available = list(_REGIONS.stack), list(_REGIONS.available)
    _REGIONS.stack.clear()
    _REGIONS.available.clear()
    try:
        yield
    finally:
        _REGIONS.stack[:] = saved
        _REGIONS.available[:] = available


@contextmanager
def idle_modes_off() -> Iterator[None]:
    """The torch-function modes on top of the stack that would pass every call of the block
    through as it came taken off while it runs, and put back after: a mode's Python handler
    costs about 3 µs a call (torch's, for the handler that does nothing), and torch.optim's step,
    ``zero_grad`` and memcalc's bookkeeping around them make about two such calls per aten op
    (each ``p.grad``, ``untyped_storage()`` and ``torch.zeros_like``), which the device's mode
    (:mod:`memcalc.targets.cuda.emulation`) passes on unchanged. A mode is taken off only where
    it says so, ``passes_through()`` (no autocast region in force); the first that does not,
    or has no such method (a ``torch.device`` context, which moves factory calls), stays with
    every mode below it. The caller vouches that the block calls no function the mode rewrites
    (:func:`memcalc.engine.step.run_step`: torch's own optimizers)."""
    popped: list[Any] = []
    try:
        while (depth := torch._C._len_torch_function_stack()) > 0:
            passes_through = getattr(torch._C._get_function_stack_at(depth - 1), "passes_through", None)
            if passes_through is None or not passes_through():
                break
            popped.append(torch._C._pop_torch_function_stack())
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def current_autocast_region() -> AutocastRegion | None:
    """The emulated autocast region in force now on this thread, or None."""
    return _REGIONS.stack[-1]() if _REGIONS.stack else None


def available_autocast_region() -> AutocastRegion | None:
    """What opens one of the innermost backend's autocast regions, in force or not: for a model
    that opens its own regions (:attr:`memcalc.engine.model.ResolvedModel.opens_autocast`), or None
    when the step has no autocast."""
    return _REGIONS.available[-1] if _REGIONS.available else None

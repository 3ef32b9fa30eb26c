"""The CUDA rules plugged into the engine: one :class:`CudaBackend` per traced step.

It puts together what :mod:`memcalc.targets.cuda` knows: the autocast and kernel-choice emulation
(:mod:`memcalc.targets.cuda.emulation`), the kernel workspaces (:mod:`memcalc.targets.cuda.workspaces`) and
the emulated gradient scaler of fp16 mixed precision; and, on both targets, autograd's in-place
gradient accumulation, which the tracer's dispatch mode turns off (:mod:`memcalc.targets.autograd`).

With ``target="cpu"`` the step is what this machine's CPU runs instead (:class:`CpuBackend`,
the rules of :mod:`memcalc.targets.cpu.kernels`): the CPU's attention and LSTM kernels and what they
allocate inside, no CUDA workspaces — the figure a real CPU run is compared with. Mixed
precision follows CPU autocast's own op lists there (``AutocastCPU`` in autocast_mode.cpp:
softmax and layer_norm stay in the lower precision; :mod:`memcalc.targets.autocast`).

:func:`trace_step` is the engine's :func:`~memcalc.engine.run.trace_model` with the backend of
the step's target: what every caller above this layer uses.

Every kernel fact is taken for the PyTorch of the step's :class:`~memcalc.core.stack.Stack`
(:func:`memcalc.targets.resolved_stack.resolve_torch_version`: the installed torch unless another is
asked for): SDPA's backend priority and constraints and autocast's op lists (the emulation),
the cuBLAS workspaces per step (the workspace model), cuDNN through the release's bundled
version.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from memcalc.core.categories import Mode
from memcalc.engine.model import ResolvedModel
from memcalc.engine.run import CostRecorderFactory, RankHooks, TracedStep, trace_model
from memcalc.engine.step_backend import AutocastRegion, CompiledAutocast, GradScalerLike, StepBackend
from memcalc.engine.step_spec import Step
from memcalc.engine.trace import StorageTracer
from memcalc.targets.autograd import GRADIENT_SUM, accumulate_in_place
from memcalc.targets.cpu.generator import generator_states
from memcalc.targets.cpu.kernels import CPU_KERNEL_RULES, CpuCapabilities, CpuEmulation, CpuKernels
from memcalc.targets.cuda.emulation import CudaEmulation
from memcalc.targets.cuda.workspaces import WORKSPACE_RULES, WorkspaceModel
from memcalc.targets.grad_scaler import EmulatedGradScaler
from memcalc.targets.grouped_mm import grouped_mm_on_meta
from memcalc.targets.resolved_stack import resolve_torch_version

__all__ = ("CpuBackend", "CudaBackend", "trace_step")

_RNN_NOTE = ("recurrent layers: on CUDA nn.LSTM/GRU/RNN run cuDNN's fused kernel with a reserve buffer "
             "that memcalc does not model; the estimate follows the step-by-step decomposition")


@contextmanager
def _emulating(emulation: CudaEmulation) -> Iterator[None]:
    """The emulation mode, with the meta kernels the real devices' kernels need in place of torch's
    (``_grouped_mm``'s dtypes and padding: :mod:`memcalc.targets.grouped_mm`)."""
    with grouped_mm_on_meta(), emulation:
        yield


class _EmulatingBackend:
    """What both targets share: an emulation mode entered around the step, an autocast region
    for mixed precision (its op lists are the target's) and the emulated gradient scaler of fp16."""

    def __init__(self, step: Step, emulation: CudaEmulation) -> None:
        self.step = step
        self.emulation = emulation
        self.tracer: StorageTracer | None = None

    def attach(self, tracer: StorageTracer) -> None:
        self.tracer = tracer
        # a checkpointed forward recomputed in backward runs under autocast again
        self.emulation.recomputing = lambda: tracer.modules.recomputing

    def accumulate_gradients(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Autograd's engine sums a second gradient into the first in place on a real device,
        which it does not do under the tracer (:mod:`memcalc.targets.autograd`)."""
        assert self.tracer is not None
        accumulate_in_place(self.tracer, func, args, kwargs, out)

    def approximated_ops(self) -> Mapping[str, int] | None:
        """The engine's list by op name (CUDA's cuDNN workspaces); the CPU's rules decide per call."""
        return None

    def mode(self) -> AbstractContextManager[Any]:
        return _emulating(self.emulation)

    def autocast(self) -> AutocastRegion | None:
        return self.emulation.autocast if self.step.precision.is_amp else None

    def grad_scaler(self) -> GradScalerLike | None:
        if not self.step.precision.uses_grad_scaler:
            return None
        return EmulatedGradScaler(torch.device("meta"))

    def compiled_autocast(self) -> CompiledAutocast | None:
        return None


class CudaBackend(_EmulatingBackend):
    """What a CUDA GPU does differently from meta tensors, for one step of ``step``."""

    def __init__(self, step: Step) -> None:
        torch_version = resolve_torch_version(step.stack.torch)
        super().__init__(step, CudaEmulation(step.precision, step.gpu.compute_capability,
                                                emulate_kernels=step.emulate_cuda, torch_version=torch_version))
        self.workspaces = (WorkspaceModel(step.gpu, training=step.mode is Mode.TRAIN,
                                          torch_version=torch_version)
                           if step.emulate_cuda else None)

    def attach(self, tracer: StorageTracer) -> None:
        super().attach(tracer)
        if self.workspaces is not None:
            self.workspaces.attach(tracer)

    def after_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.workspaces is not None:  # emulating CUDA: the device's engine and its kernels
            if func is GRADIENT_SUM:  # asked once per traced op: the call is made only where it can apply
                self.accumulate_gradients(func, args, kwargs, out)
            self.workspaces.after_op(func, args, kwargs, out)

    def after_op_applies(self, func: Any) -> bool:
        return self.workspaces is not None and (func is GRADIENT_SUM or WORKSPACE_RULES.get(func) is not None)

    def attention_backends(self) -> Mapping[str, int]:
        return dict(self.emulation.attention_backends)

    def compiled_autocast(self) -> CompiledAutocast | None:
        """What CUDA decides while AOTAutograd traces the compiled graph (on fake CPU tensors): a
        fresh emulation (its own weight-cast cache) with CUDA autocast's lists under amp, and
        CUDA's attention kernel at any precision. Dynamo's graph calls
        ``scaled_dot_product_attention``, a composite AOTAutograd decomposes by the tensors'
        device: on CPU to the CPU's choice, the math path wherever ``dropout_p > 0`` (GPT-2's
        attention in training), keeping the probabilities; a CUDA compile gets the fused kernel
        CUDA picks, which Inductor keeps as an extern kernel. Dropout and the rest are Inductor's."""
        precision, capability, version = (self.step.precision, self.step.gpu.compute_capability,
                                          self.emulation.torch_version)

        @contextmanager
        def cuda_choices() -> Iterator[None]:
            policy = CudaEmulation(precision, capability, emulate_kernels=False, emulate_attention=True,
                                   torch_version=version)
            with policy, policy.autocast():
                yield

        return CompiledAutocast(trace=cuda_choices)

    def notes(self, module: nn.Module) -> list[str]:
        notes = self.workspaces.notes() if self.workspaces is not None else []
        if self.step.emulate_cuda and any(isinstance(m, nn.RNNBase) for m in module.modules()):
            notes.append(_RNN_NOTE)
        return notes


class CpuBackend(_EmulatingBackend):
    """What this machine's CPU runs for one step of ``step`` (the CPU target,
    :mod:`memcalc.targets.cpu.kernels`): its own kernel choices and their inner allocations."""

    def __init__(self, step: Step, capabilities: CpuCapabilities | None = None) -> None:
        kernels = CpuKernels(capabilities or CpuCapabilities.here())
        emulation = CpuEmulation(step.precision, step.gpu.compute_capability, kernels)
        # the release whose kernel facts the shared emulation reads (CPU autocast's lists: CpuEmulation)
        emulation.torch_version = resolve_torch_version(step.stack.torch)
        super().__init__(step, emulation)
        self.kernels = kernels

    def attach(self, tracer: StorageTracer) -> None:
        super().attach(tracer)
        self.kernels.attach(tracer)

    def after_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func is GRADIENT_SUM:
            self.accumulate_gradients(func, args, kwargs, out)
        self.kernels.after_op(func, args, kwargs, out)

    def after_op_applies(self, func: Any) -> bool:
        return func is GRADIENT_SUM or CPU_KERNEL_RULES.get(func) is not None

    @contextmanager
    def _mode(self) -> Iterator[None]:
        with _emulating(self.emulation), generator_states(self.kernels):
            yield

    def mode(self) -> AbstractContextManager[Any]:
        """The emulation, and the CPU generator states torch's checkpoint saves
        (:mod:`memcalc.targets.cpu.generator`)."""
        return self._mode()

    def attention_backends(self) -> Mapping[str, int]:
        return {}  # the report's attention line speaks of CUDA's kernels; the notes name the CPU's

    def compiled_autocast(self) -> CompiledAutocast | None:
        """The real ``torch.autocast("cpu")`` around each compiled call: AOTAutograd traces on
        fake CPU tensors, so CPU autocast's own kernels put the casts in the graph."""
        dtype = self.step.precision.compute_dtype
        if not self.step.precision.is_amp:
            return None
        return CompiledAutocast(call=lambda: torch.autocast("cpu", dtype=dtype))

    def notes(self, module: nn.Module) -> list[str]:
        return self.kernels.notes()

    def approximated_ops(self) -> Mapping[str, int] | None:
        """The convolutions the CPU's rules left to oneDNN (or float32's backends), not every one."""
        return dict(self.kernels.approximated)


def trace_step(resolved: ResolvedModel, step: Step, *, hooks: RankHooks | None = None,
               costs: CostRecorderFactory | None = None) -> TracedStep:
    """Trace one step of ``resolved`` as a CUDA GPU would run it (or, with ``target="cpu"``,
    as this machine's CPU does).

    Args:
        resolved: the model and its inputs, on meta.
        step: the step (:func:`memcalc.fields.build_step` makes one from a user's values).
        hooks: a multi-GPU program's hooks on this rank's model.
        costs: makes the recorder of every kernel's FLOPs and bytes, for a step time
            (:func:`~memcalc.engine.run.trace_model`); None: none recorded.

    Returns:
        The traced step, ready for :func:`memcalc.engine.run.build_report`.
    """
    def backend() -> StepBackend:
        return CudaBackend(step) if step.emulate_cuda else CpuBackend(step)

    return trace_model(resolved, step, backend(), hooks=hooks, costs=costs, retrace=backend)

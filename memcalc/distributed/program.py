"""The base of every per-rank program: what one GPU of a multi-GPU strategy runs, as hooks
on the meta model memcalc traces.

PyTorch's own ``DistributedDataParallel`` and ``fully_shard`` (FSDP2) cannot run on meta
tensors (DDP's constructor reads parameter values with ``.item()``; FSDP2 refuses meta
parameters before training, allocates its all-gather buffers on the mesh's device, and frees
unsharded parameters with ``storage.resize_(0)``, which no dispatch mode sees), DataParallel
needs several real devices, and DeepSpeed is not a dependency. So each strategy's *memory
behaviour* is reproduced with real meta tensors at the moments the real implementation
allocates and frees them; everything else — the model's forward and backward at the rank's
batch, autograd's gradients, ``torch.optim``'s state on the rank's shard — runs for real
under :class:`~memcalc.engine.trace.StorageTracer`, exactly as for one GPU.

A program is handed to :func:`memcalc.engine.run.trace_model` (``hooks=``): ``install`` runs before
the model's storages are registered (so swapped-in shards are what gets registered),
``remove`` runs in its ``finally`` and puts the model back as it was. ``communication``
collects the storages that exist only for the collectives.

This module holds :class:`RankProgram` and the helpers several programs share; the programs
themselves are in :mod:`~memcalc.distributed.ddp` (DistributedDataParallel),
:mod:`~memcalc.distributed.dp` (DataParallel), :mod:`~memcalc.distributed.fsdp` (FSDP2 and
the sharded parameters of ZeRO-3) and :mod:`~memcalc.distributed.zero` (DeepSpeed ZeRO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import Any

import torch
from torch import nn

from memcalc.core.categories import Category, Phase
from memcalc.engine.optimizers import OptimizerSpec
from memcalc.engine.run import TracedStep
from memcalc.engine.trace import StorageTracer, tensors_of

__all__ = (
    "RankProgram",
    "StackedProgram",
    "coalesced_chunks",
    "map_output",
    "model_states_at_step",
)

#: The model states a role holds (parameters, gradients, optimizer state).
_MODEL_STATES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


class RankProgram:
    """Base class: hooks, undo actions, and the storages created for collectives."""

    def __init__(self) -> None:
        self.communication: set[int] = set()
        self.notes: list[str] = []
        self.tracer: StorageTracer | None = None
        self._handles: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        self._persistent: list[torch.Tensor] = []  # buffers that live as long as the model

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        self.tracer = tracer

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        """The optimizer the rank runs (ZeRO wraps the user's in its partitioned one)."""
        return spec

    def reduce_accumulated(self) -> None:
        """A pipeline stage's program, at the end of the step's backwards (torch's
        ``PipelineStage.perform_reduce_grad``): sync what the microbatches accumulated (none here)."""
        return None

    def remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._persistent.clear()

    # ---- helpers ---------------------------------------------------------------------------
    @property
    def _tracer(self) -> StorageTracer:
        assert self.tracer is not None, "install() first"
        return self.tracer

    def _buffer(self, numel: int, dtype: torch.dtype, category: Category, *, preexisting: bool = False,
                communication: bool = True) -> torch.Tensor:
        """A real meta tensor of ``numel`` elements: allocated now (or before the step)."""
        tensor = torch.empty(int(numel), dtype=dtype, device="meta")
        tracer = self._tracer
        uid = tracer.preexisting(tensor, category) if preexisting else tracer.track(tensor, category)
        if communication:
            self.communication.add(uid)
        if preexisting:
            self._persistent.append(tensor)
        return tensor

    def _transient(self, nbytes: int) -> None:
        """A collective's scratch buffer, allocated and freed at once (a flatten for NCCL)."""
        if nbytes > 0:
            self.communication.add(self._tracer.synthetic(nbytes, Category.WORKSPACE, persistent=False))

    def _at_backward(self, module: nn.Module, start: Callable[[], None] | None,
                     end: Callable[[], None] | None) -> None:
        """Call ``start`` when backward reaches the model's output and ``end`` when the
        autograd engine finishes (the final callback FSDP and DeepSpeed use)."""

        def on_output_grad(_grad: torch.Tensor) -> None:
            if start is not None:
                start()
            if end is not None:
                torch.autograd.Variable._execution_engine.queue_callback(end)

        def forward_hook(_module: nn.Module, _args: Any, output: Any) -> None:
            tensor = next((t for t in tensors_of(output) if t.requires_grad), None)
            if tensor is not None:
                tensor.register_hook(on_output_grad)  # type: ignore[no-untyped-call]

        self._handles.append(module.register_forward_hook(forward_hook))


class StackedProgram(RankProgram):
    """Several programs on one rank's model, in the order they apply (torchtitan's: tensor
    parallelism's ``parallelize_module``, then FSDP2 over its DTensor parameters): installed in
    that order, removed in reverse, the optimizer built through each in turn; one set of
    collective buffers and one list of notes for all of them."""

    def __init__(self, *programs: RankProgram) -> None:
        super().__init__()
        self.programs = programs
        for program in programs:
            program.communication = self.communication
            program.notes = self.notes

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        installed: list[RankProgram] = []
        try:
            for program in self.programs:
                program.install(tracer, module)
                installed.append(program)
        except BaseException:
            for program in reversed(installed):  # the engine removes a program only once installed
                program.remove()
            raise

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        for program in self.programs:
            spec = program.optimizer_spec(spec)
        return spec

    def reduce_accumulated(self) -> None:
        for program in self.programs:
            program.reduce_accumulated()

    def remove(self) -> None:
        for program in reversed(self.programs):
            program.remove()
        super().remove()


def coalesced_chunks(tensors: Sequence[torch.Tensor], limit: int) -> list[int]:
    """Bytes of each flat chunk ``torch._utils._take_tensors`` makes: consecutive tensors
    until a chunk reaches ``limit`` (a larger tensor is a chunk of its own)."""
    chunks: list[int] = []
    current = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if current and current + size > limit:
            chunks.append(current)
            current = 0
        current += size
    if current:
        chunks.append(current)
    return chunks


def map_output(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``output`` with ``fn`` applied to each of its tensors, containers rebuilt as they were."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*(map_output(o, fn) for o in output))
    if isinstance(output, (tuple, list)):
        return type(output)(map_output(o, fn) for o in output)
    if isinstance(output, dict):
        mapped = {k: map_output(v, fn) for k, v in output.items()}
        try:
            return type(output)(mapped)
        except TypeError:
            return mapped
    return output


def model_states_at_step(traced: TracedStep, communication: Set[int] = frozenset()) -> int:
    """Parameters + gradients + optimizer state (not collective buffers) alive during the
    optimizer step — their largest sum between ``step()`` starting and ``zero_grad()`` (or,
    without an optimizer, at ``zero_grad()``; in eval, at the end)."""
    trace = traced.trace
    categories = traced.categories

    def counted(uid: int) -> bool:
        return categories[uid] in _MODEL_STATES and uid not in communication

    alive = sum(trace.nbytes[u] for u in trace.preexisting if counted(u))
    end = trace.phase_starts.get(Phase.ZERO_GRAD, len(trace.events))
    start = trace.phase_starts.get(Phase.OPTIMIZER, end)
    best = 0
    for index, event in enumerate(trace.events[:end]):
        if index >= start:
            best = max(best, alive)
        uid = event if event >= 0 else ~event
        if counted(uid):
            alive += trace.nbytes[uid] if event >= 0 else -trace.nbytes[uid]
    return max(best, alive)

"""The CPU generator's state that torch's checkpoint saves, on the CPU target.

``torch.utils.checkpoint`` (``preserve_rng_state=True``, its default) saves ``torch.get_rng_state()``
when a checkpointed region runs forward, so that its recomputation draws the same random numbers:
a fresh uint8 CPU tensor, 5,056 B on torch 2.13 (the Mersenne Twister's state). The non-reentrant
checkpoint keeps it in its frame's recompute closure, alive as long as the region's saved tensors
(freed in the region's backward); the reentrant one keeps it on its ``ctx``, alive as long as the
``CheckpointFunctionBackward`` node (to the end of backward, when the graph goes). Each
recomputation saves one more for ``fork_rng`` while it runs. Read off the profiler of real
two-process gloo runs of a 3-layer transformers Llama (2026-12-07): one to three of these blocks
alive at the peak, the whole of each gap left between memcalc and the run.

memcalc traces torch's own checkpoint code, whose ``get_rng_state`` makes a real CPU tensor the
tracer (which follows the step's device) never sees. :func:`generator_states` records each state
that call returns as a block of its size, freed when the tensor is (a weak reference on its
storage): so the lifetime is the checkpoint's own, whichever kind. On a GPU the state is host
memory (``torch.cuda.get_rng_state`` is a CPU tensor too): the CUDA target has no such rule.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

__all__ = ("GENERATOR_STATE", "generator_states")

#: How the trace labels the block.
GENERATOR_STATE = "synthetic: the CPU generator's state (torch.get_rng_state)"


class _Holder(Protocol):
    """What the rule needs of :class:`~memcalc.targets.cpu.kernels.CpuKernels`."""

    def hold(self, nbytes: int, label: str) -> int: ...

    def release(self, uid: int) -> None: ...


@contextmanager
def generator_states(kernels: _Holder) -> Iterator[None]:
    """``torch.get_rng_state`` recorded while the step is traced: each state it returns is held
    from now until the tensor dies. Restored on exit; a state alive then is not freed in the trace."""
    real = torch.get_rng_state
    tracing = True

    def freed(uid: int) -> None:
        if tracing:
            kernels.release(uid)

    def get_rng_state() -> torch.Tensor:
        state = real()
        storage = state.untyped_storage()
        uid = kernels.hold(storage.nbytes(), GENERATOR_STATE)
        weakref.finalize(storage, freed, uid)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        tracing = False
        torch.get_rng_state = real

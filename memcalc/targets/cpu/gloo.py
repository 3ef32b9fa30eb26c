"""gloo's staging copies in the functional collectives, on the CPU target.

A real multi-process CPU step communicates over gloo. Of the functional collectives DTensor's
redistribution calls (``torch.ops._c10d_functional``: tensor and sequence parallelism's gathers and
reduce-scatters, expert parallelism's ``full_tensor`` under tp), two make a block of their own while
the caller's input and output are alive (``ProcessGroupGloo``, torch 2.13; a real two-process run's
profiler, 256,000 B input):

- ``all_gather_into_tensor``: ``AsyncAllgatherWork`` gathers into a flat tensor of the output's size
  (``newLikeFlat``, on gloo's worker thread: ``gloo:all_gather`` → ``aten::empty``) and copies it out;
  before it, an input-sized copy that is freed first (never above the staging). Events: output
  +512,000, +256,000, -256,000, staging +512,000, -512,000.
- ``reduce_scatter_tensor``: gloo reduce-scatters by all-reducing a clone of the whole input
  (``reduce_scatter_tensor_coalesced_`` → ``aten::clone``) and copying this rank's chunk out. Events:
  output +128,000, clone +256,000, -256,000.

``all_reduce`` (the functional op clones its input: the op's own output) and ``all_to_all_single``
allocate nothing more. Each staging block is modelled as freed when the op returns. NCCL gathers and
reduce-scatters in the caller's buffers, so the CUDA target has no such rule. FSDP2's collectives,
which memcalc models rather than traces, make the same copies there
(``ShardedProgram._gloo_copy``, :mod:`memcalc.distributed.fsdp`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch._ops import OpOverload

__all__ = ("ALL_GATHER", "GLOO_STAGING", "REDUCE_SCATTER", "all_gather_staging", "reduce_scatter_staging")

#: How the trace labels a staging block (a rank's communication buffers are found by it).
GLOO_STAGING = "synthetic: gloo's staging of"

#: The functional collectives whose gloo implementation stages a copy (:func:`all_gather_staging`,
#: :func:`reduce_scatter_staging`).
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


class _Kernels(Protocol):
    """What a rule needs of :class:`~memcalc.targets.cpu.kernels.CpuKernels`."""

    def add_temporary(self, nbytes: int, label: str | None = None) -> None: ...

    def follow(self, op: OpOverload) -> None: ...


def all_gather_staging(kernels: _Kernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                       out: Any) -> None:
    """``all_gather_into_tensor``: gloo's flat output of the gathered size (module docstring)."""
    if isinstance(out, torch.Tensor):
        kernels.follow(op)
        kernels.add_temporary(out.numel() * out.element_size(), f"{GLOO_STAGING} all_gather_into_tensor")


def reduce_scatter_staging(kernels: _Kernels, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                           out: Any) -> None:
    """``reduce_scatter_tensor``: gloo's clone of the whole input (module docstring)."""
    source = args[0] if args else kwargs.get("input")
    if isinstance(source, torch.Tensor):
        kernels.follow(op)
        kernels.add_temporary(source.numel() * source.element_size(), f"{GLOO_STAGING} reduce_scatter_tensor")

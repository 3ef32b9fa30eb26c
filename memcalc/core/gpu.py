"""What memcalc needs to know about a GPU: :class:`GpuProfile`, :data:`GENERIC`, the profile
used when none is named, and :data:`CPU_PROFILE`, the CPU target's (``gpu="cpu"``). The
catalogue of real cards lives in :mod:`memcalc.targets.cuda.gpus.catalogue`; this module is
vocabulary, so that options and reports can name a GPU without depending on the CUDA rules."""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.core.units import format_bytes

__all__ = ("CPU_PROFILE", "CUBLAS_WORKSPACE_DEFAULT", "GENERIC", "GENERIC_CONTEXT", "GpuPerformance", "GpuProfile")

KiB = 1024
MiB = 1024**2

#: ``4096 * 1024 * 2 + 16 * 1024 * 8`` = 8,519,680 B: PyTorch's ``:4096:2:16:8`` cuBLAS
#: workspace default off sm90 (aten/src/ATen/cuda/CublasHandlePool.cpp; see memcalc.targets.cuda.cublas).
CUBLAS_WORKSPACE_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8
#: GENERIC's context: a round number at the top of the reported 300–600 MiB range.
GENERIC_CONTEXT = 512 * MiB


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model: capacity as CUDA reports it and the fixed costs before the first tensor.

    ``total_memory`` is ``None`` only for :data:`GENERIC` (no capacity: estimates work, fit
    checks cannot). ``smi_total_mib`` is nvidia-smi's ``memory.total`` (bigger: it includes
    the driver's reserve) — shown to users and used to recognise local GPUs; ``None`` when
    unknown.
    """

    key: str
    name: str
    total_memory: int | None
    compute_capability: tuple[int, int]
    arch: str
    sm_count: int
    supports_bf16: bool
    cuda_context: int
    cublas_workspace: int
    aliases: tuple[str, ...] = ()
    smi_total_mib: int | None = None
    lazy_context: int | None = None
    context_basis: str = ""

    @property
    def lazy_loading_context(self) -> int:
        """The profile's own CUDA context with lazy module loading (before any stack)."""
        return self.cuda_context if self.lazy_context is None else self.lazy_context

    @property
    def context_measured(self) -> bool:
        """Whether the CUDA context was measured on this GPU rather than assumed: the stack
        names where in ``context_basis`` ("…, measured on NVIDIA H100 80GB HBM3, CUDA 13.0",
        :func:`memcalc.targets.cuda.gpus.catalogue.context_source`)."""
        return "measured on" in self.context_basis

    @property
    def is_cpu(self) -> bool:
        """Whether this is the CPU target's profile (:data:`CPU_PROFILE`), not a CUDA GPU."""
        return self.key == CPU_PROFILE.key

    @property
    def usable_memory(self) -> int | None:
        """What tensors, the caching allocator and workspaces can share: total minus context."""
        if self.total_memory is None:
            return None
        return self.total_memory - self.cuda_context

    def describe(self) -> str:
        """One line for listings: key, name, capacity (binary units), context."""
        total = "no capacity" if self.total_memory is None else format_bytes(self.total_memory, "GiB")
        return (f"{self.key}: {self.name}, {total}, sm{self.compute_capability[0]}{self.compute_capability[1]}, "
                f"context ~{format_bytes(self.cuda_context, 'MiB')}")


@dataclass(frozen=True)
class GpuPerformance:
    """How fast a GPU computes and moves bytes, for the step time: dense peak FLOP/s by math mode
    (a mode the GPU lacks is absent), bandwidth in bytes/s, and the document they are read from."""

    peaks: tuple[tuple[str, float], ...]
    bandwidth: float
    source: str


#: The profile used when no GPU is named: an sm80-class card of unknown capacity. Its cuBLAS
#: workspace is the non-Hopper default (8,519,680 B) and its context a flat 512 MiB, both
#: assumptions; ``total_memory=None`` means "no capacity": fit questions need a real GPU.
GENERIC = GpuProfile(
    key="generic",
    name="Generic CUDA GPU (sm80-class, capacity unknown)",
    total_memory=None,
    compute_capability=(8, 0),
    arch="ampere",
    sm_count=108,
    supports_bf16=True,
    cuda_context=GENERIC_CONTEXT,
    cublas_workspace=CUBLAS_WORKSPACE_DEFAULT,
    aliases=("default", "none", "any"),
)


#: The CPU target's profile (``gpu="cpu"``): what this machine's CPU allocates. No CUDA context,
#: no cuBLAS workspace, no capacity (a search takes one from a budget or the machine's RAM). Its
#: compute capability is :data:`GENERIC`'s only because the shared emulation takes one; the CPU
#: rules never read it.
CPU_PROFILE = GpuProfile(
    key="cpu",
    name="the CPU",
    total_memory=None,
    compute_capability=GENERIC.compute_capability,
    arch="cpu",
    sm_count=0,
    supports_bf16=True,
    cuda_context=0,
    cublas_workspace=0,
)

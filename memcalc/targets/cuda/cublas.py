"""cuBLAS workspaces: how big one is and how many a training step holds.

cuBLAS keeps a persistent workspace per (handle, stream), allocated through the caching
allocator at the first cuBLAS call; no meta kernel shows it. Its size
(:func:`cublas_workspace_bytes`, honouring ``CUBLAS_WORKSPACE_CONFIG``; cuBLASLt's
:func:`cublaslt_workspace_bytes`) and the count per training step
(:func:`cublas_workspaces_in_training_step`) are exact transcriptions of PyTorch's
``aten/src/ATen/cuda/CublasHandlePool.cpp``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from memcalc.core.gpu import CUBLAS_WORKSPACE_DEFAULT, GpuProfile
from memcalc.targets.versions import TARGET_TORCH_VERSION, parse_torch_version

__all__ = (
    "CUBLASLT_WORKSPACE_DEFAULT_KIB",
    "CUBLAS_WORKSPACES_PER_TRAINING_STEP",
    "CUBLAS_WORKSPACE_DEFAULT",
    "CUBLAS_WORKSPACE_SM90",
    "cublas_workspace_bytes",
    "cublas_workspaces_in_training_step",
    "cublaslt_workspace_bytes",
    "default_cublas_workspace",
    "separate_cublaslt_workspaces_in_training_step",
)

KiB = 1024

# --------------------------------------------------------------------------------------------
# cuBLAS workspace size — exact, from PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp
# (pytorch/pytorch @ 26a39059ec580351411f180816c47e2ef5134ae1, parseChosenWorkspaceSize /
# getChosenWorkspaceSize / parseCUDABlasLtWorkspaceSize / getCUDABlasLtWorkspaceSize):
#
#   /* :4096:2:16:8 default, 32MiB for Hopper */
#   const bool sm90 = properties->major == 9 && properties->minor == 0;
#   const size_t default_size = sm90 ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8;
#   ... std::regex exp(":([0-9]+):([0-9]+)"); total_size += curr_size * 1024 * count;
#
# The workspace is allocated through the caching allocator, once per (cuBLAS handle, stream)
# pair [setWorkspaceForHandle]. Handles come from a *thread-local* pool window, and autograd
# runs backward on its own per-device thread, so a plain training step usually holds two
# workspaces (forward thread + backward thread) — an inference from the code, not measured.
# CUBLAS_WORKSPACE_DEFAULT (``4096 * 1024 * 2 + 16 * 1024 * 8`` = 8,519,680 B, the
# ``:4096:2:16:8`` default off sm90) is defined with GpuProfile in memcalc.core.gpu.
# --------------------------------------------------------------------------------------------

#: ``4096 * 8 * 1024`` = 32 MiB: PyTorch's default on compute capability exactly 9.0.
CUBLAS_WORKSPACE_SM90 = 4096 * KiB * 8
#: ``CUBLASLT_WORKSPACE_SIZE`` default, 1024 KiB ("default size in KiB according to #73328").
CUBLASLT_WORKSPACE_DEFAULT_KIB = 1024

_CUBLAS_CONFIG_ITEM = re.compile(r":([0-9]+):([0-9]+)")
_LEADING_INT = re.compile(r"\s*([+-]?[0-9]+)")


def default_cublas_workspace(compute_capability: tuple[int, int]) -> int:
    """PyTorch's per-handle cuBLAS workspace when ``CUBLAS_WORKSPACE_CONFIG`` is unset.

    Only compute capability *exactly* (9, 0) gets 32 MiB: the C++ test is
    ``major == 9 && minor == 0``, so Blackwell (10.x, 12.x) gets the 8,519,680 B default.
    The same in every release memcalc models (2.4–2.13) on the catalogue's GPUs (≤ sm90): the
    32 MiB sm90 default dates from pytorch#91564 (merged 2023-01-03, torch 2.0). Blackwell's
    default moved back and forth in 2026 (pytorch#175344 "Try to reenable 32MiB workspaces on
    Blackwell", #182669, #189312 for sm110); which releases carry which is not verified, so it
    is not keyed by release.
    """
    return CUBLAS_WORKSPACE_SM90 if tuple(compute_capability) == (9, 0) else CUBLAS_WORKSPACE_DEFAULT


def _parse_cublas_config(value: str) -> int | None:
    """Sum ``SIZE_KiB * COUNT`` over every ``:SIZE:COUNT`` found anywhere in ``value``.

    Mirrors ``std::sregex_iterator`` over ``:([0-9]+):([0-9]+)``: ``":4096:2:16:8"`` finds
    ``:4096:2`` and ``:16:8``; text between matches is ignored; ``None`` when nothing matches
    (PyTorch then warns and uses the default).
    """
    matches = list(_CUBLAS_CONFIG_ITEM.finditer(value))
    if not matches:
        return None
    return sum(int(size) * KiB * int(count) for size, count in (m.groups() for m in matches))


def cublas_workspace_bytes(profile: GpuProfile, env: Mapping[str, str] = os.environ) -> int:
    """Bytes of one cuBLAS workspace (per handle and stream) on ``profile`` under ``env``.

    ``CUBLAS_WORKSPACE_CONFIG`` overrides the per-architecture default; an unparsable value
    falls back to the default, as PyTorch does. Note ``":0:0"`` parses to 0 bytes.
    """
    value = env.get("CUBLAS_WORKSPACE_CONFIG")
    if value is not None:
        parsed = _parse_cublas_config(value)
        if parsed is not None:
            return parsed
    return profile.cublas_workspace


def cublaslt_workspace_bytes(profile: GpuProfile, env: Mapping[str, str] = os.environ) -> int:
    """Bytes of the separate cuBLASLt workspace (per Lt handle and stream) PyTorch allocates.

    By default (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset) it is a separate allocation of
    ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024, parsed like ``std::stoi``), capped at the
    cuBLAS workspace size. With ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` cuBLASLt borrows the
    cuBLAS workspace, so the extra is 0 (``c10::utils::check_env`` accepts only "1" as true).
    """
    cublas = cublas_workspace_bytes(profile, env)
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1":
        return 0
    size_kib = CUBLASLT_WORKSPACE_DEFAULT_KIB
    raw = env.get("CUBLASLT_WORKSPACE_SIZE")
    if raw is not None:
        match = _LEADING_INT.match(raw)
        if match and abs(int(match.group(1))) < 2**31:  # std::stoi: leading int, int range
            size_kib = int(match.group(1))
    return max(0, min(size_kib * KiB, cublas))


# =============================================================================================
# cuBLAS workspaces per training step — aten/src/ATen/cuda/CublasHandlePool.cpp
# =============================================================================================

#: Workspaces a single-GPU training step holds in 2.11 (sizes: :func:`cublas_workspace_bytes`).
#:
#: ``getCurrentCUDABlasHandle`` → ``setWorkspaceForHandle`` keys each workspace by
#: ``(cublasHandle_t, cudaStream_t)`` in ``cublas_handle_stream_to_workspace()`` and allocates it
#: through the caching allocator (``allocateCUDABlasWorkspace`` → ``CUDACachingAllocator::get()
#: ->allocate``); it stays allocated for the process's life. Handles come from a
#: ``DeviceThreadHandlePool`` through a *thread-local* ``PoolWindow``, so each thread that runs
#: cuBLAS gets its own handle. The forward (and loss) run on the Python thread; the autograd
#: engine runs CUDA backward on its own per-device worker thread, on the same stream. Two
#: (handle, stream) pairs → two workspaces. cuBLASLt (addmm with bias, …) shares the cuBLAS
#: entry in 2.11 (``unified_cublas_and_lt_workspaces()`` is on by default outside fbcode since
#: #168175), so it adds none.
CUBLAS_WORKSPACES_PER_TRAINING_STEP = 2


def cublas_workspaces_in_training_step(torch_version: str = TARGET_TORCH_VERSION) -> int:
    """Persistent cuBLAS workspaces (caching-allocator blocks) after one forward + backward on
    one GPU and the default stream.

    2.4–2.12: two, as :data:`CUBLAS_WORKSPACES_PER_TRAINING_STEP` explains (2.3 and CUDA ≥ 12.2
    builds briefly let cuBLAS allocate its own workspace, #113994; #124250 restored the explicit
    one for 2.4). Newer snapshots make caching opt-in (``TORCH_CUBLAS_WORKSPACE_CACHE``) and fall
    back to cuBLAS's own workspace; that is not modelled (assumed two as well). The estimate
    asks this for its stack's release (:class:`memcalc.targets.cuda.workspaces.WorkspaceModel`).
    """
    return CUBLAS_WORKSPACES_PER_TRAINING_STEP


def separate_cublaslt_workspaces_in_training_step(torch_version: str = TARGET_TORCH_VERSION) -> int:
    """Persistent cuBLASLt workspaces *besides* the cuBLAS ones (``CUBLASLT_WORKSPACE_SIZE``,
    1 MiB default, each).

    * ≤ 2.7: 0 persistent — the Lt workspace was a per-call temporary from the caching
      allocator (CUDABlas.cpp), so it shows as a transient 1 MiB block per Lt GEMM.
    * 2.8–2.10: two — #156495 made it persistent per (Lt handle, stream) in a second map.
    * ≥ 2.11: 0 — unified with the cuBLAS workspace by default (#168175).

    Not applied to estimates yet: which GEMMs take the cuBLASLt path (``addmm``'s
    ``useLtInterface`` conditions) was not checked release by release; the difference is at most
    2 × 1 MiB.
    """
    version = parse_torch_version(torch_version)
    if (2, 8) <= version <= (2, 10):
        return CUBLAS_WORKSPACES_PER_TRAINING_STEP
    return 0

"""GPU catalogue (what a training step can use on card X) and local GPU discovery.

Two questions need GPU facts:

* "does it fit on an H100?" needs the capacity the *CUDA driver* hands out on that card, and
  the memory that is spent before the first tensor: the CUDA context and cuBLAS workspaces.
  :class:`GpuProfile` holds those numbers; :func:`get_gpu` finds one by a forgiving name.
* "does it fit on the GPU in this machine?" needs the GPUs this process would see, in the
  order torch numbers them: :func:`list_local_gpus`, :func:`resolve_device`.

Where the numbers come from
---------------------------
``total_memory`` is ``cudaDeviceProp::totalGlobalMem`` (what ``deviceQuery`` prints as
"Total amount of global memory" and ``torch.cuda.get_device_properties(i).total_memory``
returns). It is *smaller* than ``nvidia-smi``'s ``memory.total`` because the driver keeps a
reserve (e.g. H100 80GB HBM3: 81,559 MiB in nvidia-smi, ~81,090 MiB in CUDA), and it drifts by
~0.1–1 % between driver versions; each entry names the observation it uses. The nvidia-smi
figure is kept in ``smi_total_mib`` because that is what users see and what local discovery
reports.

The CUDA context size is not published by NVIDIA; :func:`_context_bytes` is a documented
assumption (see there). cuBLAS workspace sizes are exact, transcribed from PyTorch
(:func:`cublas_workspace_bytes`).
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memcalc.core.errors import InvalidInputError, MemcalcError
from memcalc.core.units import format_bytes

__all__ = (
    "GpuProfile",
    "GENERIC",
    "UnknownGpuError",
    "AmbiguousGpuError",
    "catalogue",
    "get_gpu",
    "match_profile",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "default_cublas_workspace",
    "LocalGpu",
    "PhysicalGpu",
    "GpuDiscoveryWarning",
    "list_local_gpus",
    "best_gpu",
    "resolve_device",
    "parse_nvidia_smi_csv",
    "parse_cuda_visible_devices",
    "visible_devices",
    "NVIDIA_SMI_QUERY",
)

KiB = 1024
MiB = 1024**2

# --------------------------------------------------------------------------------------------
# cuBLAS workspace — exact, from PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp
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
# --------------------------------------------------------------------------------------------

#: ``4096 * 1024 * 2 + 16 * 1024 * 8`` = 8,519,680 B: the ``:4096:2:16:8`` default off sm90.
CUBLAS_WORKSPACE_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8
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


# --------------------------------------------------------------------------------------------
# CUDA context — ASSUMPTION. Memory the driver takes when a process first touches a GPU, plus
# the lazily loaded kernels of a typical training step; max_memory_allocated() never sees it,
# the OOM check does (it shrinks cudaMemGetInfo's free). Observations that bound it:
#   * pytorch/pytorch#107667 and #109888 (ptrblck, 2023): "~300MB" / "around 400MB if CUDA
#     >= 11.7 is used and lazy module loading enabled (default in PyTorch)";
#   * invoke-ai/InvokeAI#9413 (torch 2.7.1+cu128, RTX 3090): a bare context is "a flat 256 MiB";
#   * before CUDA 11.7 (eager module loading) it exceeded 1000 MB — not modelled.
# It grows with the SM count because the driver reserves local memory (per-thread stacks,
# cudaLimitStackSize default 1 KiB) for every thread that can be resident at once:
# sm_count × max_threads_per_sm × 1 KiB. The formula below is that reservation on top of the
# bare 256 MiB; it lands at ~300–520 MiB, inside the reported range. It is not a measurement.
# --------------------------------------------------------------------------------------------

#: Bare context + driver bookkeeping with lazy loading (InvokeAI#9413 reading, rounded).
CONTEXT_BASE = 256 * MiB
#: ``cudaLimitStackSize`` default: 1 KiB of local memory per resident thread.
DEFAULT_STACK_PER_THREAD = 1 * KiB
#: Max resident threads per SM, CUDA C++ Programming Guide, "Technical Specifications per
#: Compute Capability" table.
_MAX_THREADS_PER_SM: dict[tuple[int, int], int] = {
    (7, 0): 2048,  # Volta
    (7, 5): 1024,  # Turing
    (8, 0): 2048,  # A100
    (8, 6): 1536,  # GA10x
    (8, 9): 1536,  # Ada
    (9, 0): 2048,  # Hopper
}
#: GENERIC's context: a round number at the top of the reported 300–600 MiB range.
GENERIC_CONTEXT = 512 * MiB


def _context_bytes(compute_capability: tuple[int, int], sm_count: int) -> int:
    """Assumed CUDA context + library footprint: ``256 MiB + SMs × threads/SM × 1 KiB``."""
    threads = _MAX_THREADS_PER_SM.get(tuple(compute_capability), 2048)
    return CONTEXT_BASE + sm_count * threads * DEFAULT_STACK_PER_THREAD


# --------------------------------------------------------------------------------------------
# Catalogue
# --------------------------------------------------------------------------------------------


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

    @property
    def usable_memory(self) -> int | None:
        """What tensors, the caching allocator and workspaces can share: total minus context."""
        if self.total_memory is None:
            return None
        return self.total_memory - self.cuda_context

    def describe(self) -> str:
        """One line for listings: key, name, capacity (binary units), context."""
        total = "no capacity" if self.total_memory is None else format_bytes(self.total_memory, "GiB")
        return f"{self.key}: {self.name}, {total}, sm{self.compute_capability[0]}{self.compute_capability[1]}, context ~{format_bytes(self.cuda_context, 'MiB')}"


def _profile(
    key: str,
    name: str,
    total_memory: int | None,
    cc: tuple[int, int],
    arch: str,
    sm_count: int,
    aliases: tuple[str, ...],
    smi_total_mib: int | None,
) -> GpuProfile:
    """Derive bf16, context and cuBLAS workspace from the compute capability, so the rules
    live in one place (bf16 tensor-core support starts at sm80)."""
    return GpuProfile(
        key=key,
        name=name,
        total_memory=total_memory,
        compute_capability=cc,
        arch=arch,
        sm_count=sm_count,
        supports_bf16=cc >= (8, 0),
        cuda_context=_context_bytes(cc, sm_count),
        cublas_workspace=default_cublas_workspace(cc),
        aliases=aliases,
        smi_total_mib=smi_total_mib,
    )


# Sources for total_memory (CUDA-reported) and smi_total_mib (nvidia-smi memory.total):
#   [dq]   deviceQuery "Total amount of global memory: N MBytes (B bytes)" — exact bytes;
#   [pt]   torch.cuda.get_device_properties(): "total_memory=N MB" = floor(bytes / 2**20);
#   [modal] modal-labs/modal-client PR #2797 (2025-01): nvidia-smi totals of H100 81559,
#           A100 80GB 81920, A100 40GB 40960, A10 23028, L4 23034, T4 15360 MiB.
_CATALOGUE: tuple[GpuProfile, ...] = (
    _profile(
        "h100-80gb", "NVIDIA H100 80GB HBM3",
        # [dq] 85,028,896,768 B (81,090 MiB), driver 12.8; torch 2.7 prints 81089-81090 MB.
        # nvidia-smi 81559 MiB: [modal], NVIDIA/nccl#1264.
        85_028_896_768, (9, 0), "hopper", 132,
        ("h100", "h100-sxm", "h100-sxm5", "h100-sxm-80gb", "h100-80gb-hbm3"),
        81559,
    ),
    _profile(
        "h100-pcie", "NVIDIA H100 PCIe",
        # [pt] total_memory=81008MB, multi_processor_count=114 (older driver) → 81,008 MiB.
        # nvidia-smi 81559 MiB: most public printouts (e.g. SkyPilot logs); one shows 81920.
        81008 * MiB, (9, 0), "hopper", 114,
        ("h100-pcie-80gb", "h100pcie"),
        81559,
    ),
    _profile(
        "h200", "NVIDIA H200",
        # [pt] total_memory=143156MB, multi_processor_count=132 (Modal H200) → 143,156 MiB.
        # nvidia-smi 143771 MiB: many public nvidia-smi printouts.
        143156 * MiB, (9, 0), "hopper", 132,
        ("h200-141gb", "h200-sxm", "h200-sxm-141gb", "h200-nvl"),
        143771,
    ),
    _profile(
        "a100-40gb", "NVIDIA A100-SXM4-40GB",
        # [dq] 42,298,834,944 B (40,339 MiB), driver 12.2 (bottlerocket-os/bottlerocket#3873).
        # nvidia-smi 40960 MiB: [modal].
        42_298_834_944, (8, 0), "ampere", 108,
        ("a100-sxm4-40gb", "a100-pcie-40gb", "a100-40g"),
        40960,
    ),
    _profile(
        "a100-80gb", "NVIDIA A100-SXM4-80GB",
        # [dq] 85,100,068,864 B (81,158 MiB), driver 12.5; 84,987,740,160 B (81,051 MiB) on
        # driver 12.2. nvidia-smi 81920 MiB: [modal].
        85_100_068_864, (8, 0), "ampere", 108,
        ("a100-sxm4-80gb", "a100-pcie-80gb", "a100-80gb-pcie", "a100-80g"),
        81920,
    ),
    _profile(
        "v100-16gb", "Tesla V100-SXM2-16GB",
        # [dq] 16,928,342,016 B (16,144 MiB), driver 12.4 (16,128 MiB on driver 11.0).
        # nvidia-smi 16384 MiB: public nvidia-smi printouts of V100-SXM2/PCIE-16GB.
        16_928_342_016, (7, 0), "volta", 80,
        ("v100-sxm2-16gb", "v100-pcie-16gb", "v100-16g"),
        16384,
    ),
    _profile(
        "v100-32gb", "Tesla V100-SXM2-32GB",
        # [dq] 34,072,559,616 B (32,494 MiB), driver 12.9 (32,511 MiB on 11.6–13.0 drivers).
        # nvidia-smi 32768 MiB: assumed (32 GiB board, no printout found).
        34_072_559_616, (7, 0), "volta", 80,
        ("v100-sxm2-32gb", "v100-pcie-32gb", "v100-32g"),
        32768,
    ),
    _profile(
        "l4", "NVIDIA L4",
        # [dq] 23,612,293,120 B (22,518 MiB), driver 12.0. nvidia-smi 23034 MiB: [modal].
        23_612_293_120, (8, 9), "ada", 58,
        ("l4-24gb",),
        23034,
    ),
    _profile(
        "t4", "Tesla T4",
        # [dq] 15,642,329,088 B (14,918 MiB), drivers 12.4 and 12.5 (15,102 MiB on 12.2/Colab).
        # nvidia-smi 15360 MiB with ECC on: [modal]; 16384 MiB when ECC is off.
        15_642_329_088, (7, 5), "turing", 40,
        ("t4-16gb", "tesla-t4"),
        15360,
    ),
    _profile(
        "a10g", "NVIDIA A10G",
        # [pt] total_memory=22587MB, multi_processor_count=80 (torch 2.15 dev, cu130) → 22,587
        # MiB. nvidia-smi 23028 MiB: [modal] lists it for the A10; assumed equal for the A10G.
        22587 * MiB, (8, 6), "ampere", 80,
        ("a10g-24gb",),
        23028,
    ),
    _profile(
        "rtx-3090", "NVIDIA GeForce RTX 3090",
        # [dq] 25,206,325,248 B (24,039 MiB), driver 12.4 (24,268 MiB on driver 11.8).
        # nvidia-smi 24576 MiB: assumed from a public tuning guide's printout.
        25_206_325_248, (8, 6), "ampere", 82,
        ("3090", "rtx3090", "geforce-rtx-3090", "rtx-3090-24gb"),
        24576,
    ),
    _profile(
        "rtx-4090", "NVIDIA GeForce RTX 4090",
        # [dq] 25,250,627,584 B (24,081 MiB), Linux driver 13.0 (24,210 MiB on 12.4; Windows
        # WDDM shows ~23,028). nvidia-smi 24564 MiB: assumed (brief's figure, not confirmed).
        25_250_627_584, (8, 9), "ada", 128,
        ("4090", "rtx4090", "geforce-rtx-4090", "rtx-4090-24gb"),
        24564,
    ),
)

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

# Vendor words dropped when matching, so "NVIDIA GeForce RTX 4090" == "rtx 4090".
_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "quadro")
# Queries shorter than this are not tried as the start of a family ("a100" → 40 or 80 GB?).
_MIN_PREFIX = 3


class UnknownGpuError(MemcalcError, LookupError):
    """A GPU name the catalogue does not know; ``suggestions`` are close canonical keys."""

    exit_code = 2

    def __init__(self, name: str, suggestions: Sequence[str], *, message: str | None = None):
        hint = f"Did you mean {' or '.join(suggestions)}?" if suggestions else None
        hint = (hint + " " if hint else "") + "Known GPUs: " + ", ".join(p.key for p in catalogue(include_generic=True)) + "."
        super().__init__(message or f"unknown GPU {name!r}", hint=hint)
        self.name = name
        self.suggestions = list(suggestions)


class AmbiguousGpuError(UnknownGpuError):
    """A name that matches several catalogue entries ("a100": 40 GB or 80 GB?)."""

    def __init__(self, name: str, candidates: Sequence[str]):
        super().__init__(name, candidates, message=f"GPU name {name!r} is ambiguous: it matches {', '.join(candidates)}")


def _normalise(name: str) -> str:
    """Lower-case, drop every non-alphanumeric and leading vendor words: ``"A100_40GB"``,
    ``"a100-40gb"`` and ``"NVIDIA A100 40GB"`` all become ``"a10040gb"``."""
    text = re.sub(r"[^a-z0-9]+", "", name.lower())
    stripped = True
    while stripped:
        stripped = False
        for word in _VENDOR_WORDS:
            if text.startswith(word) and len(text) > len(word):
                text = text[len(word):]
                stripped = True
    return text


def _names_of(profile: GpuProfile) -> tuple[str, ...]:
    return (profile.key, profile.name, *profile.aliases)


def _build_index() -> dict[str, GpuProfile]:
    index: dict[str, GpuProfile] = {}
    for profile in (*_CATALOGUE, GENERIC):
        for name in _names_of(profile):
            normal = _normalise(name)
            other = index.setdefault(normal, profile)
            if other is not profile:  # two entries claiming one spelling is a catalogue bug
                raise AssertionError(f"GPU name {name!r} is claimed by {other.key} and {profile.key}")
    return index


_INDEX = _build_index()


def catalogue(*, include_generic: bool = False) -> list[GpuProfile]:
    """Known GPUs in display order; :data:`GENERIC` last when asked for."""
    return [*_CATALOGUE, *((GENERIC,) if include_generic else ())]


def get_gpu(name: str) -> GpuProfile:
    """Find a profile by key, marketing/driver name or alias, forgivingly.

    Case, ``_``/``-``/spaces and vendor words ("NVIDIA", "Tesla", "GeForce") are ignored, so
    driver names such as "NVIDIA A100-SXM4-80GB" resolve too. A name that is only the start of
    several entries ("a100", "v100") raises :class:`AmbiguousGpuError` listing them. Anything
    else unknown raises :class:`UnknownGpuError` with close matches — including the start of a
    single entry ("h20" is not an H200), because a wrong capacity is worse than an error.
    """
    query = _normalise(name)
    if not query:
        raise UnknownGpuError(name, [])
    if query in _INDEX:
        return _INDEX[query]
    if len(query) >= _MIN_PREFIX:
        family = _unique_keys(p for spelled, p in _INDEX.items() if spelled.startswith(query))
        if len(family) > 1:
            raise AmbiguousGpuError(name, family)
        if family:  # "h20" starts "h200" but is another card: suggest, never guess
            raise UnknownGpuError(name, family)
    close = difflib.get_close_matches(query, list(_INDEX), n=5, cutoff=0.6)
    raise UnknownGpuError(name, _unique_keys(_INDEX[c] for c in close))


def _unique_keys(profiles: Iterable[GpuProfile]) -> list[str]:
    keys: list[str] = []
    for profile in profiles:
        if profile.key not in keys:
            keys.append(profile.key)
    return keys


def match_profile(device_name: str) -> GpuProfile | None:
    """The catalogue entry for a name as NVML/nvidia-smi/torch report it, or ``None``.

    Only exact (normalised) matches count: "NVIDIA A100-SXM4-80GB" → a100-80gb, but an
    unknown "NVIDIA A40" gives ``None`` rather than a guess.
    """
    return _INDEX.get(_normalise(device_name))


# --------------------------------------------------------------------------------------------
# Local GPU discovery
# --------------------------------------------------------------------------------------------

#: The query :func:`list_local_gpus` runs; values in MiB because of ``nounits``.
NVIDIA_SMI_QUERY = (
    "nvidia-smi",
    "--query-gpu=index,uuid,name,memory.total,memory.free",
    "--format=csv,noheader,nounits",
)
#: Seconds before giving up on nvidia-smi (a wedged driver can hang it).
NVIDIA_SMI_TIMEOUT_S = 15


class GpuDiscoveryWarning(UserWarning):
    """Discovery found GPUs but could not be sure how CUDA numbers them."""


@dataclass(frozen=True)
class PhysicalGpu:
    """A GPU as NVML/nvidia-smi enumerate it: physical index, ignoring CUDA_VISIBLE_DEVICES.

    ``total_memory`` here is NVML's framebuffer size (nvidia-smi ``memory.total``), which
    includes the driver's reserve; ``free_memory`` is what a new process can still get.
    """

    index: int
    uuid: str | None
    name: str
    total_memory: int
    free_memory: int


@dataclass(frozen=True)
class LocalGpu:
    """A GPU this process can use, numbered as torch numbers it (``cuda:<logical_index>``).

    ``physical_index`` is the NVML/nvidia-smi index; ``None`` only when the GPU was found
    through torch alone and CUDA_VISIBLE_DEVICES named it by UUID. Memory figures come from
    the source that found it: NVML/nvidia-smi totals include the driver reserve (bigger than
    :attr:`GpuProfile.total_memory`); ``free_memory`` is what can still be allocated.
    """

    logical_index: int
    physical_index: int | None
    name: str
    uuid: str | None
    total_memory: int
    free_memory: int

    @property
    def device(self) -> str:
        return f"cuda:{self.logical_index}"

    @property
    def profile(self) -> GpuProfile | None:
        """The catalogue entry for this card, when there is one."""
        return match_profile(self.name)


def parse_nvidia_smi_csv(text: str) -> list[PhysicalGpu]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.free
    --format=csv,noheader,nounits`` (memory in MiB) into :class:`PhysicalGpu` rows.

    Fields are split on commas; the name is everything between the UUID and the two memory
    columns, so a name with a comma survives. Raises ``ValueError`` on a malformed row or a
    memory column that is not a number (nvidia-smi prints ``[N/A]`` e.g. for MIG-enabled
    GPUs), so the caller can fall back to another source instead of inventing a capacity.
    """
    gpus: list[PhysicalGpu] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) < 5:
            raise ValueError(f"nvidia-smi line {line_no}: expected 5 fields, got {line!r}")
        index, uuid, *name_parts, total, free = fields
        try:
            gpus.append(PhysicalGpu(
                index=int(index),
                uuid=uuid if uuid and not uuid.startswith("[") else None,
                name=", ".join(name_parts),
                total_memory=int(total) * MiB,
                free_memory=int(free) * MiB,
            ))
        except ValueError:
            raise ValueError(f"nvidia-smi line {line_no}: unreadable index or memory in {line!r}") from None
    return gpus


# CUDA_VISIBLE_DEVICES — what is verified and what is assumed.
#   Verified (NVIDIA MPS docs, docs.nvidia.com/deploy/topics/topic_5_2_1.html): entries are
#   indices or UUIDs; devices are enumerated in the order listed; a UUID may be shortened to
#   its first characters "including GPU-".
#   Verified (Acceleware note, quoted at jianshuapi.com/p/0816c3a5fa5c): an invalid device
#   masks itself and every later entry; earlier ones stay visible.
#   Mirrored from PyTorch's own emulation (torch/cuda/__init__.py, torch 2.13:
#   _parse_visible_devices, _transform_uuid_to_ordinals, _device_count_nvml), written to
#   match CUDA: unset → all; integers are read like strtoul ("1gpu2" → 1) and a token with no
#   leading number (or a negative one) ends the list; an index ≥ the device count ends it; a
#   UUID prefix that matches no GPU or several GPUs ends it; a REPEATED device makes the whole
#   list EMPTY (not "ends the list"); "" → no devices; "MIG-..." is not mapped (PyTorch skips
#   NVML for it too).
#   Assumed: whitespace around entries is ignored; a list mixing indices and UUIDs is
#   resolved entry by entry (PyTorch's emulation does not mix); a UUID without "GPU-" is not
#   accepted (a bare hex prefix starting with a digit would read as an index, as strtoul does).

_GPU_PREFIX = "GPU-"
_MIG_PREFIX = "MIG-"


def parse_cuda_visible_devices(value: str | None) -> list[int | str] | None:
    """Syntactic pass over CUDA_VISIBLE_DEVICES: ``None`` when unset (all devices), else the
    entries up to the first unusable one — ints for indices, strings for ``GPU-`` UUIDs.

    A repeated entry empties the list; a ``MIG-`` entry ends it (unsupported here).
    """
    if value is None:
        return None
    entries: list[int | str] = []
    for raw in value.split(","):
        token = raw.strip()
        entry: int | str
        if token.startswith(_GPU_PREFIX):
            entry = token
        else:
            match = _LEADING_INT.match(token)
            if token.startswith(_MIG_PREFIX) or match is None or int(match.group(1)) < 0:
                break
            entry = int(match.group(1))
        if entry in entries:
            return []
        entries.append(entry)
    return entries


def _uuid_to_index(candidate: str, physical: Sequence[tuple[int, str | None]]) -> int | None:
    """The one physical index whose UUID starts with ``candidate``; ``None`` if none or many."""
    hits = [index for index, uuid in physical if uuid is not None and uuid.startswith(candidate)]
    return hits[0] if len(hits) == 1 else None


def visible_devices(
    cuda_visible_devices: str | None, physical: Sequence[tuple[int, str | None]]
) -> list[int]:
    """Physical indices in logical (torch) order, as CUDA applies ``CUDA_VISIBLE_DEVICES``.

    ``physical`` is ``(index, uuid)`` per GPU as NVML enumerates them. Integer entries are
    positions in that enumeration. See the rules above this function.
    """
    ordered = sorted(physical, key=lambda item: item[0])
    entries = parse_cuda_visible_devices(cuda_visible_devices)
    if entries is None:
        return [index for index, _ in ordered]
    result: list[int] = []
    for entry in entries:
        if isinstance(entry, int):
            if entry >= len(ordered):
                break
            index = ordered[entry][0]
        else:
            found = _uuid_to_index(entry, ordered)
            if found is None:
                break
            index = found
        if index in result:  # e.g. "0,GPU-<uuid of 0>": the same device twice
            return []
        result.append(index)
    return result


def _apply_visibility(physical: list[PhysicalGpu], env: Mapping[str, str]) -> list[LocalGpu]:
    by_index = {gpu.index: gpu for gpu in physical}
    order = visible_devices(env.get("CUDA_VISIBLE_DEVICES"), [(g.index, g.uuid) for g in physical])
    chosen = [by_index[i] for i in order]
    _warn_if_order_uncertain(chosen, env)
    return [
        LocalGpu(logical, gpu.index, gpu.name, gpu.uuid, gpu.total_memory, gpu.free_memory)
        for logical, gpu in enumerate(chosen)
    ]


def _warn_if_order_uncertain(gpus: Sequence[PhysicalGpu], env: Mapping[str, str]) -> None:
    """CUDA numbers devices fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, while NVML
    uses PCI order. Identical cards tie and keep PCI order; different models may not."""
    if env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" or len({g.name for g in gpus}) <= 1:
        return
    warnings.warn(
        "GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers them "
        "fastest-first, so cuda:N may not be nvidia-smi's GPU N. Set CUDA_DEVICE_ORDER=PCI_BUS_ID "
        "to make the numbering certain.",
        GpuDiscoveryWarning,
        stacklevel=4,
    )


def _import_pynvml() -> Any | None:
    try:
        import pynvml  # type: ignore[import-not-found]  # package nvidia-ml-py
    except Exception:
        return None
    return pynvml


def _import_torch_cuda() -> Any | None:
    try:
        import torch
    except Exception:
        return None
    return torch.cuda


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _from_nvml(nvml: Any) -> list[PhysicalGpu] | None:
    """Physical GPUs through NVML; ``None`` on any NVML failure (no driver, no permission)."""
    try:
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(PhysicalGpu(
                index=index,
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                name=_text(nvml.nvmlDeviceGetName(handle)),
                total_memory=int(memory.total),
                free_memory=int(memory.free),
            ))
        return gpus
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _from_nvidia_smi(
    env: Mapping[str, str], runner: Callable[..., Any], which: Callable[..., str | None]
) -> list[PhysicalGpu] | None:
    """Physical GPUs through nvidia-smi; ``None`` when it is absent, fails or prints junk."""
    executable = which("nvidia-smi", path=env.get("PATH", os.defpath))
    if executable is None:
        return None
    try:
        done = runner(
            [executable, *NVIDIA_SMI_QUERY[1:]],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if getattr(done, "returncode", 1) != 0:
        return None
    try:
        return parse_nvidia_smi_csv(_text(done.stdout or ""))
    except ValueError:
        return None


def _from_torch(cuda: Any, env: Mapping[str, str]) -> list[LocalGpu]:
    """GPUs through ``torch.cuda``, already filtered and ordered by CUDA itself.

    Last resort: ``mem_get_info`` creates a CUDA context on every GPU it asks about.
    """
    try:
        if not cuda.is_available():
            return []
        entries = parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
        gpus = []
        for logical in range(cuda.device_count()):
            props = cuda.get_device_properties(logical)
            free, total = cuda.mem_get_info(logical)
            uuid = getattr(props, "uuid", None)
            uuid_text = None if uuid is None else str(uuid)
            if uuid_text is not None and not uuid_text.startswith((_GPU_PREFIX, _MIG_PREFIX)):
                uuid_text = _GPU_PREFIX + uuid_text
            if entries is None:
                physical: int | None = logical
            elif logical < len(entries) and isinstance(entries[logical], int):
                physical = int(entries[logical])
            else:
                physical = None
            gpus.append(LocalGpu(logical, physical, str(props.name), uuid_text, int(total), int(free)))
        return gpus
    except Exception:
        return []


def list_local_gpus(
    env: Mapping[str, str] = os.environ,
    *,
    runner: Callable[..., Any] = subprocess.run,
    which: Callable[..., str | None] = shutil.which,
    nvml: Callable[[], Any | None] = _import_pynvml,
    torch_cuda: Callable[[], Any | None] = _import_torch_cuda,
) -> list[LocalGpu]:
    """The GPUs this process would see, in torch's numbering; ``[]`` when there are none.

    Sources, first that works: NVML (package nvidia-ml-py), then ``nvidia-smi``, both of
    which see every physical GPU, so CUDA_VISIBLE_DEVICES is applied here the way CUDA does
    (:func:`visible_devices`); then ``torch.cuda``, which applies it itself but creates a CUDA
    context per GPU. A ``MIG-`` entry in CUDA_VISIBLE_DEVICES skips straight to torch, which
    is the only source that reports a MIG slice's memory. Never raises for a missing driver,
    tool or package. The keyword arguments exist so tests can replace every outside source.
    """
    if _MIG_PREFIX not in env.get("CUDA_VISIBLE_DEVICES", ""):
        module = nvml()
        physical = _from_nvml(module) if module is not None else None
        if physical is None:
            physical = _from_nvidia_smi(env, runner, which)
        if physical is not None:
            return _apply_visibility(physical, env)
    cuda = torch_cuda()
    return _from_torch(cuda, env) if cuda is not None else []


def best_gpu(gpus: Sequence[LocalGpu]) -> LocalGpu | None:
    """The GPU with the most free memory (lowest logical index on a tie); ``None`` if none."""
    if not gpus:
        return None
    return max(gpus, key=lambda gpu: (gpu.free_memory, -gpu.logical_index))


_DEVICE_SPEC = re.compile(r"^(?:cuda(?::(\d+))?|(\d+))$")


def resolve_device(spec: str, gpus: Sequence[LocalGpu]) -> LocalGpu:
    """Pick a GPU from ``"auto"`` (most free memory), ``"cuda"`` (= ``cuda:0``, torch's
    default device), ``"cuda:N"`` or ``"N"`` — N being torch's index, after
    CUDA_VISIBLE_DEVICES. Raises :class:`~memcalc.core.errors.InvalidInputError` (a ``ValueError``)
    saying how many GPUs are visible when the choice does not exist.
    """
    text = spec.strip().lower()
    count = len(gpus)
    if count == 0:
        raise InvalidInputError(
            f"device {spec!r}: no GPU is visible to this process",
            hint="Check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES, or name a GPU model (--gpu).",
        )
    if text == "auto":
        chosen = best_gpu(gpus)
        assert chosen is not None
        return chosen
    match = _DEVICE_SPEC.match(text)
    if match is None:
        raise InvalidInputError(f"cannot read device {spec!r}", hint='Use "auto", "cuda", "cuda:N" or "N".')
    index = int(match.group(1) or match.group(2) or 0)
    by_logical = {gpu.logical_index: gpu for gpu in gpus}
    if index not in by_logical:
        visible = "1 GPU is visible (cuda:0)" if count == 1 else f"{count} GPUs are visible (cuda:0 … cuda:{count - 1})"
        raise InvalidInputError(
            f"device {spec!r} does not exist: {visible}",
            hint="Indices count only the GPUs left after CUDA_VISIBLE_DEVICES.",
        )
    return by_logical[index]


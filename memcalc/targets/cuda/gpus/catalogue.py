"""GPU catalogue: what a training step can use on card X.

"Does it fit on an H100?" needs the capacity the *CUDA driver* hands out on that card, and
the memory that is spent before the first tensor: the CUDA context and cuBLAS workspaces.
:class:`~memcalc.core.gpu.GpuProfile` holds those numbers; :func:`get_gpu` finds one by a
forgiving name. (The GPUs of *this* machine are found by :mod:`memcalc.targets.cuda.gpus.local`.)

Where the numbers come from
---------------------------
``total_memory`` is ``cudaDeviceProp::totalGlobalMem`` (what ``deviceQuery`` prints as
"Total amount of global memory" and ``torch.cuda.get_device_properties(i).total_memory``
returns). It is *smaller* than ``nvidia-smi``'s ``memory.total`` because the driver keeps a
reserve (e.g. H100 80GB HBM3: 81,559 MiB in nvidia-smi, ~81,090 MiB in CUDA), and it drifts by
~0.1–1 % between driver versions; each entry names the observation it uses. The nvidia-smi
figure is kept in ``smi_total_mib`` because that is what users see and what local discovery
reports.

The CUDA context size is not published by NVIDIA; :func:`_context_bytes` (lazy module
loading, each profile's ``cuda_context``) and :func:`cuda_context_bytes` (the one function that
turns a profile, a CUDA version and the module-loading mode into a context) are documented
assumptions (see there). cuBLAS workspace sizes are exact, transcribed from PyTorch
(:func:`memcalc.targets.cuda.cublas.cublas_workspace_bytes`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memcalc.core.errors import MemcalcError
from memcalc.core.gpu import GENERIC, GpuProfile
from memcalc.targets.cuda.cublas import default_cublas_workspace

__all__ = (
    "EAGER_MODULE_LOADING_EXTRA",
    "LAZY_LOADING_MIN_CUDA",
    "MEASURED_CONTEXTS",
    "AmbiguousGpuError",
    "MeasuredContext",
    "UnknownGpuError",
    "catalogue",
    "context_source",
    "cuda_context_bytes",
    "get_gpu",
    "match_profile",
    "measured_context",
)

KiB = 1024
MiB = 1024**2

# --------------------------------------------------------------------------------------------
# CUDA context — ASSUMPTION. Memory the driver takes when a process first touches a GPU, plus
# the lazily loaded kernels of a typical training step; max_memory_allocated() never sees it,
# the OOM check does (it shrinks cudaMemGetInfo's free). Observations that bound it:
#   * pytorch/pytorch#107667 and #109888 (ptrblck, 2023): "~300MB" / "around 400MB if CUDA
#     >= 11.7 is used and lazy module loading enabled (default in PyTorch)";
#   * invoke-ai/InvokeAI#9413 (torch 2.7.1+cu128, RTX 3090): a bare context is "a flat 256 MiB";
#   * before CUDA 11.7 (eager module loading) it exceeded 1000 MB: EAGER_MODULE_LOADING_EXTRA.
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


def _context_bytes(compute_capability: tuple[int, int], sm_count: int) -> int:
    """Assumed CUDA context + library footprint with lazy module loading:
    ``256 MiB + SMs × threads/SM × 1 KiB``."""
    threads = _MAX_THREADS_PER_SM.get((compute_capability[0], compute_capability[1]), 2048)
    return CONTEXT_BASE + sm_count * threads * DEFAULT_STACK_PER_THREAD


# --------------------------------------------------------------------------------------------
# Eager module loading — ASSUMPTION. Without lazy loading every kernel of every CUDA library a
# process loads goes into the context when the library is loaded: libtorch_cuda's at the first
# CUDA call, cuBLAS's and cuDNN's when a step first creates their handles.
#   * Lazy loading needs the CUDA 11.7+ runtime ("Lazy loading first introduced, disabled by
#     default" in 11.7; default on Linux from 12.2: CUDA Programming Guide, "Lazy Loading",
#     Change History), and PyTorch turns it on when the user has not chosen:
#     ``c10::utils::set_env("CUDA_MODULE_LOADING", "LAZY", false)`` in ``CUDAHooks::init``
#     (aten/src/ATen/cuda/detail/CUDAHooks.cpp; since 1.13, pytorch#85692 / #86509).
#   * pytorch#85692 measured it on torch 1.13 + CUDA 11.7: ``torch.randn(20, 16, 50, 100).cuda()``
#     leaves 287,047,680 B in use with LAZY and 666,632,192 B with eager loading — 362 MiB of
#     libtorch_cuda's own kernels, before cuBLAS or cuDNN is touched.
#   * ptrblck, pytorch#107667 (2023): "Before CUDA 11.7, *all* kernels were loaded into the
#     context once the library was loaded, which took >1000MB".
#   * issue 13 (runs compared with published measurements): ~1.3 GiB without lazy loading,
#     ~0.4 GiB with it.
# 800 MiB on top of the lazy figure puts the catalogue at 1,096 MiB (T4) to 1,320 MiB (H100
# SXM): above ptrblck's 1000 MB and at issue 13's ~1.3 GiB. Not a measurement.
# --------------------------------------------------------------------------------------------

#: What eager module loading adds to the lazy-loading context (see above).
EAGER_MODULE_LOADING_EXTRA = 800 * MiB
#: The first CUDA runtime that can load modules lazily (CUDA Programming Guide, "Lazy Loading").
LAZY_LOADING_MIN_CUDA = (11, 7)


# --------------------------------------------------------------------------------------------
# CUDA context — MEASURED, where a real GPU was measured. ``nvidia-smi`` memory.used minus
# ``torch.cuda.memory_reserved()`` after a cuBLAS matmul and a cuDNN convolution, in a fresh
# process, with CUDA_MODULE_LOADING=LAZY and =EAGER (tests/data/gpu/2026-11-25-h100/ctx.json).
# The H100's 693 MiB lazy figure is 173 MiB above the formula's 520 MiB, and eager loading adds
# 1,252 MiB, not the 800 MiB assumed: the assumptions above stay for the cards not measured.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredContext:
    """A CUDA context measured on one catalogue GPU under one CUDA release.

    Attributes:
        lazy: bytes with ``CUDA_MODULE_LOADING=LAZY``.
        eager: bytes with ``CUDA_MODULE_LOADING=EAGER``.
        cuda: the CUDA runtime it was measured with, ``(major, minor)``.
        where: the run, in a few words (driver, torch, date, data file).
    """

    lazy: int
    eager: int
    cuda: tuple[int, int]
    where: str


#: Measured CUDA contexts by catalogue key (every other figure is the assumption above).
MEASURED_CONTEXTS: dict[str, MeasuredContext] = {
    # ctx.json: LAZY context 726,663,168 B (693.0 MiB), EAGER 2,039,480,320 B (1,945.0 MiB)
    "h100-80gb": MeasuredContext(
        lazy=726_663_168, eager=2_039_480_320, cuda=(13, 0),
        where="driver 580.159.04, torch 2.11+cu130, 2026-11-25 (tests/data/gpu/2026-11-25-h100/ctx.json)"),
}


def measured_context(profile: GpuProfile) -> MeasuredContext | None:
    """The measured context of ``profile``'s catalogue GPU, if one was measured."""
    return MEASURED_CONTEXTS.get(profile.key)


def context_source(profile: GpuProfile, cuda_version: tuple[int, int]) -> str:
    """Whether :func:`cuda_context_bytes` is measured or assumed for this GPU and CUDA, in words
    for the report: ``"measured on NVIDIA H100 80GB HBM3, CUDA 13.0"`` (``"…, CUDA 13.0;
    assumed the same for CUDA 12.4"`` under another release), else ``"assumed"``."""
    measured = measured_context(profile)
    if measured is None or profile.lazy_loading_context != measured.lazy:
        return "assumed"
    text = f"measured on {profile.name}, CUDA {measured.cuda[0]}.{measured.cuda[1]}"
    if tuple(cuda_version[:1]) != measured.cuda[:1]:
        text += f"; assumed the same for CUDA {cuda_version[0]}.{cuda_version[1]}"
    return text


def cuda_context_bytes(profile: GpuProfile, cuda_version: tuple[int, int], *, lazy_loading: bool = True) -> int:
    """The CUDA context of ``profile`` under CUDA ``cuda_version``: the profile's lazy-loading
    figure when modules load lazily (asked for, and CUDA ≥ 11.7), that plus
    :data:`EAGER_MODULE_LOADING_EXTRA` when they load eagerly.

    Args:
        profile: the GPU; its :attr:`~memcalc.core.gpu.GpuProfile.lazy_loading_context` is the
            lazy figure (a stack applied before does not change it).
        cuda_version: the CUDA runtime, ``(major, minor)``.
        lazy_loading: whether lazy loading is asked for (``CUDA_MODULE_LOADING`` not ``EAGER``).

    Returns:
        Bytes.
    """
    lazy = lazy_loading and tuple(cuda_version) >= LAZY_LOADING_MIN_CUDA
    base = profile.lazy_loading_context
    if lazy:
        return base
    measured = measured_context(profile)
    if measured is not None and base == measured.lazy:  # a user's own profile keeps the assumption
        return measured.eager
    return base + EAGER_MODULE_LOADING_EXTRA


# --------------------------------------------------------------------------------------------
# Catalogue
# --------------------------------------------------------------------------------------------


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
        cuda_context=MEASURED_CONTEXTS[key].lazy if key in MEASURED_CONTEXTS else _context_bytes(cc, sm_count),
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

# Vendor words dropped when matching, so "NVIDIA GeForce RTX 4090" == "rtx 4090".
_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "quadro")
# Queries shorter than this are not tried as the start of a family ("a100" → 40 or 80 GB?).
_MIN_PREFIX = 3


class UnknownGpuError(MemcalcError, LookupError):
    """A GPU name the catalogue does not know; ``suggestions`` are close canonical keys."""

    exit_code = 2

    def __init__(self, name: str, suggestions: Sequence[str], *, message: str | None = None):
        hint = f"Did you mean {' or '.join(suggestions)}?" if suggestions else None
        known = ", ".join(p.key for p in catalogue(include_generic=True))
        hint = (hint + " " if hint else "") + "Known GPUs: " + known + "."
        super().__init__(message or f"unknown GPU {name!r}", hint=hint)
        self.name = name
        self.suggestions = list(suggestions)


class AmbiguousGpuError(UnknownGpuError):
    """A name that matches several catalogue entries ("a100": 40 GB or 80 GB?)."""

    def __init__(self, name: str, candidates: Sequence[str]):
        message = f"GPU name {name!r} is ambiguous: it matches {', '.join(candidates)}"
        super().__init__(name, candidates, message=message)


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

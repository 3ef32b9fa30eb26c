"""GPU catalogue: what a training step can use on card X.

"Does it fit on an H100?" needs the capacity the *CUDA driver* hands out on that card, and
the memory that is spent before the first tensor: the CUDA context and cuBLAS workspaces.
:class:`~memcalc.core.gpu.GpuProfile` holds those numbers; :func:`get_gpu` finds one by a
forgiving name. (The GPUs of *this* machine are found by :mod:`memcalc.targets.cuda.gpus.local`.)

Each card is one row of ``gpus.toml`` beside this module (:class:`GpuRecord`): memory, SMs,
threads per SM, measured context, datasheet peaks. Every consumer reads that row; a row missing
a field is refused at import (docs/architecture.md, "Adding a GPU").

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
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TypeVar

from memcalc.core.errors import MemcalcError
from memcalc.core.gpu import GENERIC, GpuPerformance, GpuProfile
from memcalc.targets.cuda.cublas import default_cublas_workspace

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the backport pyproject names
    import tomli as tomllib

__all__ = (
    "EAGER_MODULE_LOADING_EXTRA",
    "GPUS_FILE",
    "LAZY_LOADING_MIN_CUDA",
    "MEASURED_CONTEXTS",
    "RECORD_FIELDS",
    "AmbiguousGpuError",
    "GpuRecord",
    "GpuRecordError",
    "MeasuredContext",
    "UnknownGpuError",
    "catalogue",
    "context_source",
    "cuda_context_bytes",
    "get_gpu",
    "match_profile",
    "measured_context",
    "read_record",
    "read_records",
    "record",
    "records",
)

_T = TypeVar("_T")

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
def _context_bytes(sm_count: int, max_threads_per_sm: int) -> int:
    """Assumed CUDA context + library footprint with lazy module loading:
    ``256 MiB + SMs × threads/SM × 1 KiB``, both from the GPU's record (gpus.toml)."""
    return CONTEXT_BASE + sm_count * max_threads_per_sm * DEFAULT_STACK_PER_THREAD


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


def measured_context(profile: GpuProfile) -> MeasuredContext | None:
    """The measured context of ``profile``'s catalogue GPU, if one was measured."""
    found = _RECORDS.get(profile.key)
    return None if found is None else found.measured_context


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


# --------------------------------------------------------------------------------------------
# Catalogue: one record per GPU, read from gpus.toml (package data)
# --------------------------------------------------------------------------------------------

#: The data file, beside this module: every fact memcalc holds about each catalogue GPU.
GPUS_FILE = "gpus.toml"
_TERA = 1e12
_GB_S = 1e9


@dataclass(frozen=True)
class GpuRecord:
    """Everything memcalc knows about one catalogue GPU: one row of :data:`GPUS_FILE`.

    Attributes:
        profile: capacity, compute capability, SMs, context and cuBLAS workspace, as estimates use it.
        max_threads_per_sm: resident threads per SM (the assumed context reserves a stack for each).
        measured_context: the CUDA context measured on this card, or ``None`` (assumed).
        performance: dense peaks and bandwidth for the step time, or ``None`` (no sourced figures).
        no_performance: why ``performance`` is ``None`` (``""`` when it is not).
        memory_source: where ``total_memory`` and ``smi_total_mib`` were read.
    """

    profile: GpuProfile
    max_threads_per_sm: int
    measured_context: MeasuredContext | None
    performance: GpuPerformance | None
    no_performance: str
    memory_source: str

    @property
    def key(self) -> str:
        return self.profile.key


#: The fields every row of :data:`GPUS_FILE` must have, no more and no fewer.
RECORD_FIELDS = frozenset({
    "name", "aliases", "total_memory", "smi_total_mib", "memory_source", "compute_capability", "arch",
    "sm_count", "max_threads_per_sm", "cuda_context", "performance",
})
_CONTEXT_FIELDS = frozenset({"lazy", "eager", "cuda", "where"})
_PERFORMANCE_FIELDS = frozenset({"peaks_tflops", "bandwidth_gb_s", "source"})


class GpuRecordError(ValueError):
    """A row of :data:`GPUS_FILE` with a field missing, unknown or of the wrong kind."""


def _exact_fields(where: str, row: Mapping[str, object], fields: frozenset[str]) -> None:
    missing, unknown = fields - set(row), set(row) - fields
    if missing or unknown:
        raise GpuRecordError(f"{GPUS_FILE} [{where}]: " + "; ".join(
            part for part in (f"missing {', '.join(sorted(missing))}" if missing else "",
                              f"unknown {', '.join(sorted(unknown))}" if unknown else "") if part))


def _typed(where: str, field: str, value: object, kind: type[_T]) -> _T:
    # bool is an int in Python: a true/false where a number belongs is a typo, not a count
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GpuRecordError(f"{GPUS_FILE} [{where}]: {field} must be {kind.__name__}, got {value!r}")
    return value


def _pair(where: str, field: str, value: object) -> tuple[int, int]:
    items = _typed(where, field, value, list)
    if len(items) != 2:
        raise GpuRecordError(f"{GPUS_FILE} [{where}]: {field} must be [major, minor], got {value!r}")
    return _typed(where, field, items[0], int), _typed(where, field, items[1], int)


def _context(where: str, value: object) -> MeasuredContext | None:
    if value == "assumed":
        return None
    row = _typed(where, "cuda_context", value, dict)
    _exact_fields(f"{where}.cuda_context", row, _CONTEXT_FIELDS)
    return MeasuredContext(lazy=_typed(where, "cuda_context.lazy", row["lazy"], int),
                           eager=_typed(where, "cuda_context.eager", row["eager"], int),
                           cuda=_pair(where, "cuda_context.cuda", row["cuda"]),
                           where=_typed(where, "cuda_context.where", row["where"], str))


def _performance(where: str, value: object) -> tuple[GpuPerformance | None, str]:
    """The figures, or ``None`` and why there are none."""
    if isinstance(value, str):
        if not value.strip():
            raise GpuRecordError(f"{GPUS_FILE} [{where}]: performance must say why a GPU has no figures")
        return None, value
    row = _typed(where, "performance", value, dict)
    _exact_fields(f"{where}.performance", row, _PERFORMANCE_FIELDS)
    peaks = _typed(where, "performance.peaks_tflops", row["peaks_tflops"], dict)
    if not peaks:
        raise GpuRecordError(f"{GPUS_FILE} [{where}]: performance.peaks_tflops is empty")
    bandwidth = row["bandwidth_gb_s"]
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
        raise GpuRecordError(f"{GPUS_FILE} [{where}]: performance.bandwidth_gb_s must be positive, got {bandwidth!r}")
    for mode, tflops in peaks.items():
        if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or not tflops > 0:
            raise GpuRecordError(f"{GPUS_FILE} [{where}]: peaks_tflops.{mode} must be positive, got {tflops!r}")
    return GpuPerformance(peaks=tuple((str(mode), tflops * _TERA) for mode, tflops in peaks.items()),
                          bandwidth=bandwidth * _GB_S,
                          source=_typed(where, "performance.source", row["source"], str)), ""


def read_record(key: str, row: Mapping[str, object]) -> GpuRecord:
    """One row of :data:`GPUS_FILE` as a record; bf16 support and the cuBLAS workspace follow from
    the compute capability (bf16 tensor cores start at sm80), the context from the measurement or
    :func:`_context_bytes`.

    Raises:
        GpuRecordError: a field missing, unknown or of the wrong kind.
    """
    _exact_fields(key, row, RECORD_FIELDS)
    cc = _pair(key, "compute_capability", row["compute_capability"])
    sm_count = _typed(key, "sm_count", row["sm_count"], int)
    threads = _typed(key, "max_threads_per_sm", row["max_threads_per_sm"], int)
    measured = _context(key, row["cuda_context"])
    performance, no_performance = _performance(key, row["performance"])
    profile = GpuProfile(
        key=key,
        name=_typed(key, "name", row["name"], str),
        total_memory=_typed(key, "total_memory", row["total_memory"], int),
        compute_capability=cc,
        arch=_typed(key, "arch", row["arch"], str),
        sm_count=sm_count,
        supports_bf16=cc >= (8, 0),
        cuda_context=measured.lazy if measured is not None else _context_bytes(sm_count, threads),
        cublas_workspace=default_cublas_workspace(cc),
        aliases=tuple(_typed(key, "aliases", alias, str) for alias in _typed(key, "aliases", row["aliases"], list)),
        smi_total_mib=_typed(key, "smi_total_mib", row["smi_total_mib"], int),
    )
    return GpuRecord(profile, threads, measured, performance, no_performance,
                     _typed(key, "memory_source", row["memory_source"], str))


def read_records(text: str) -> tuple[GpuRecord, ...]:
    """Every row of a ``gpus.toml`` text, in file order (:func:`read_record`)."""
    return tuple(read_record(key, _typed(key, "row", row, dict)) for key, row in tomllib.loads(text).items())


_RECORDS: dict[str, GpuRecord] = {
    r.key: r for r in read_records(resources.files(__package__).joinpath(GPUS_FILE).read_text(encoding="utf-8"))}
_CATALOGUE: tuple[GpuProfile, ...] = tuple(r.profile for r in _RECORDS.values())
#: Measured CUDA contexts by catalogue key, from the records (every other context is assumed).
MEASURED_CONTEXTS: dict[str, MeasuredContext] = {
    key: r.measured_context for key, r in _RECORDS.items() if r.measured_context is not None}


def records() -> tuple[GpuRecord, ...]:
    """Every catalogue GPU's record, in display order."""
    return tuple(_RECORDS.values())


def record(gpu: GpuProfile) -> GpuRecord | None:
    """The record of ``gpu``'s catalogue card (``None`` for :data:`GENERIC`, the CPU and a user's own profile)."""
    return _RECORDS.get(gpu.key)

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

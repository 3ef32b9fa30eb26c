"""Local GPU discovery: the GPUs this process would see, in the order torch numbers them.

"Does it fit on the GPU in this machine?" needs the GPUs visible to this process (NVML,
``nvidia-smi`` or ``torch.cuda``, with ``CUDA_VISIBLE_DEVICES`` applied as CUDA applies it):
:func:`list_local_gpus`, :func:`best_gpu`, :func:`resolve_device`, :func:`find_local_gpu`.
Each found GPU is recognised in the catalogue
(:func:`memcalc.targets.cuda.gpus.catalogue.match_profile`) when it can be.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from memcalc.core.errors import InvalidInputError
from memcalc.core.gpu import GpuProfile
from memcalc.targets.cuda.gpus.catalogue import match_profile

__all__ = (
    "NVIDIA_SMI_QUERY",
    "NVIDIA_SMI_TIMEOUT_S",
    "GpuDiscoveryWarning",
    "LocalGpu",
    "PhysicalGpu",
    "best_gpu",
    "check_device_spec",
    "find_local_gpu",
    "list_local_gpus",
    "names_local_gpu",
    "nvidia_driver_loaded",
    "parse_cuda_visible_devices",
    "parse_nvidia_smi_csv",
    "resolve_device",
    "visible_devices",
)

MiB = 1024**2
_LEADING_INT = re.compile(r"\s*([+-]?[0-9]+)")


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
        import pynvml  # package nvidia-ml-py
    except Exception:  # a broken install is "no NVML": discovery never raises
        return None
    return pynvml


def _import_torch_cuda() -> Any | None:
    try:
        import torch
    except Exception:  # a broken install is "no torch": discovery never raises
        return None
    return torch.cuda


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _from_nvml(nvml: Any) -> list[PhysicalGpu] | None:
    """Physical GPUs through NVML; ``None`` on any NVML failure (no driver, no permission)."""
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError and friends: no driver, no permission
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
    except Exception:  # any NVML failure: fall back to the next source
        return None
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


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
    except Exception:  # torch.cuda without a usable driver: no GPUs
        return []


#: Where a loaded driver shows itself on Linux: NVIDIA's kernel module, and the AMD kernel driver
#: that a ROCm build of torch reaches through ``torch.cuda`` too.
_LINUX_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/kfd")


def nvidia_driver_loaded() -> bool:
    """Whether ``torch.cuda`` could see a GPU at all: on Linux, a GPU driver's kernel module is
    loaded (``/proc/driver/nvidia``; ``/dev/kfd`` for ROCm); elsewhere, unknown, so True.
    Without a driver, CUDA initialisation fails whatever torch is installed."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(path) for path in _LINUX_DRIVER_PATHS)


def list_local_gpus(
    env: Mapping[str, str] = os.environ,
    *,
    runner: Callable[..., Any] = subprocess.run,
    which: Callable[..., str | None] = shutil.which,
    nvml: Callable[[], Any | None] = _import_pynvml,
    torch_cuda: Callable[[], Any | None] = _import_torch_cuda,
    driver_loaded: Callable[[], bool] = nvidia_driver_loaded,
) -> list[LocalGpu]:
    """The GPUs this process would see, in torch's numbering; ``[]`` when there are none.

    Sources, first that works: NVML (package nvidia-ml-py), then ``nvidia-smi``, both of
    which see every physical GPU, so CUDA_VISIBLE_DEVICES is applied here the way CUDA does
    (:func:`visible_devices`); then ``torch.cuda``, which applies it itself but creates a CUDA
    context per GPU. A ``MIG-`` entry in CUDA_VISIBLE_DEVICES skips straight to torch, which
    is the only source that reports a MIG slice's memory. torch is asked only where a driver is
    loaded (:func:`nvidia_driver_loaded`): importing it costs seconds and finds nothing without one.
    Never raises for a missing driver, tool or package. The keyword arguments exist so tests can
    replace every outside source.
    """
    if _MIG_PREFIX not in env.get("CUDA_VISIBLE_DEVICES", ""):
        module = nvml()
        physical = _from_nvml(module) if module is not None else None
        if physical is None:
            physical = _from_nvidia_smi(env, runner, which)
        if physical is not None:
            return _apply_visibility(physical, env)
    if not driver_loaded():
        return []
    cuda = torch_cuda()
    return _from_torch(cuda, env) if cuda is not None else []


def best_gpu(gpus: Sequence[LocalGpu]) -> LocalGpu | None:
    """The GPU with the most free memory (lowest logical index on a tie); ``None`` if none."""
    if not gpus:
        return None
    return max(gpus, key=lambda gpu: (gpu.free_memory, -gpu.logical_index))


_DEVICE_SPEC = re.compile(r"^(?:cuda(?::(\d+))?|(\d+))$")
#: What a device spec may be, for messages.
_DEVICE_SPEC_FORMS = '"auto" (the GPU with the most free memory), "cuda" (= cuda:0), "cuda:N" or "N"'


def check_device_spec(spec: object) -> str:
    """``spec`` lower-cased and stripped when it reads as a device (``"auto"``, ``"cuda"``,
    ``"cuda:N"``, ``"N"``); :class:`~memcalc.core.errors.InvalidInputError` otherwise — before any
    GPU is looked for, so that a typo is not answered with "no GPU is visible"."""
    text = spec.strip().lower() if isinstance(spec, str) else None
    if text is None or (text != "auto" and _DEVICE_SPEC.match(text) is None):
        forms = (f"Give {_DEVICE_SPEC_FORMS}, N being torch's index after CUDA_VISIBLE_DEVICES (memcalc gpus "
                 f"lists them).")
        if text == "cpu":  # the CPU is a target of its own, not one of --device's GPUs
            raise InvalidInputError(f"device {spec!r} is not a device spec: --device picks a CUDA GPU of this "
                                    f"machine", hint=f'For this CPU give --gpu cpu (gpu="cpu" in the API): its own '
                                                     f"kernels, measured with the CPU profiler under --measure. "
                                                     f"{forms}")
        raise InvalidInputError(f"device {spec!r} is not a device spec", hint=forms)
    return text


def resolve_device(spec: str, gpus: Sequence[LocalGpu]) -> LocalGpu:
    """Pick a GPU from ``"auto"`` (most free memory), ``"cuda"`` (= ``cuda:0``, torch's
    default device), ``"cuda:N"`` or ``"N"`` — N being torch's index, after
    CUDA_VISIBLE_DEVICES. Raises :class:`~memcalc.core.errors.InvalidInputError` (a ``ValueError``)
    for anything else, and saying how many GPUs are visible when the choice does not exist.
    """
    text = check_device_spec(spec)
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
    assert match is not None  # check_device_spec
    index = int(match.group(1) or match.group(2) or 0)
    by_logical = {gpu.logical_index: gpu for gpu in gpus}
    if index not in by_logical:
        visible = "1 GPU is visible (cuda:0)" if count == 1 else f"{count} GPUs are visible (cuda:0 … cuda:{count - 1})"
        raise InvalidInputError(
            f"device {spec!r} does not exist: {visible}",
            hint="Indices count only the GPUs left after CUDA_VISIBLE_DEVICES.",
        )
    return by_logical[index]


def names_local_gpu(gpu: object) -> TypeGuard[str]:
    """Whether ``gpu`` (a ``gpu=`` value) names a GPU of this machine — ``"auto"``, ``"cuda"``
    or ``"cuda:N"`` — rather than a GPU of the catalogue.

    A bare ``"N"``, which :func:`resolve_device` takes, does not: "3090" and "4090" are
    catalogue names. Every string starting with "cuda" does, so that a malformed one
    (``"cuda:x"``) is refused as a device spec rather than as an unknown GPU model.
    """
    if not isinstance(gpu, str):
        return False
    text = gpu.strip().lower()
    return text == "auto" or text.startswith("cuda")


def find_local_gpu(spec: str) -> LocalGpu:
    """The GPU of this machine that ``spec`` names (as :func:`resolve_device` reads it),
    discovered now (:func:`list_local_gpus`).

    Raises:
        InvalidInputError: ``spec`` is not a device spec (said before any GPU is looked for),
            no GPU is visible, or the one named does not exist.
    """
    check_device_spec(spec)
    return resolve_device(spec, list_local_gpus())

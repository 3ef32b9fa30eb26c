"""Memory budgets: how many bytes the caching allocator may reserve, from a number, a
catalogue GPU or a local device. Below the table of fields (:mod:`memcalc.fields` resolves a
step's ``device=`` with it), so that building a step never climbs into the batch search.

Exactly one of ``budget``, ``gpu`` or ``device`` says how many bytes the caching allocator
may reserve (:func:`resolve_budget`):

* ``budget`` (``"24GiB"``, ``"80GB"``, an int): used as is — it is the memory the step may
  use; nothing is subtracted.
* ``gpu`` (a catalogue name): the card's CUDA-reported memory minus its assumed CUDA
  context (:attr:`memcalc.core.gpu.GpuProfile.usable_memory`).
* ``device`` (``"cuda:1"``, ``"auto"``): that local GPU's free memory, minus the context a
  new process will create on it (the catalogue's estimate for the card, else the generic
  512 MiB) — unless this process had already initialised CUDA before the question, in which
  case the step is taken to run here and its context is already out of the free memory.
  ``gpu="auto"``, ``"cuda"`` or ``"cuda:N"`` names such a device too (as
  :func:`memcalc.estimate` reads it): one spelling for "this machine's GPU" across the API.
* ``gpu="cpu"``: the CPU target (what this machine's CPU allocates, unrounded), under
  ``budget`` when one is given too, else under this machine's available RAM (``MemAvailable``
  of ``/proc/meminfo``: what the kernel says a new allocation can have without swapping).

The context is the one of the software stack asked for (``stack``: its CUDA version and
module loading, or ``context_mib``; :mod:`memcalc.targets.resolved_stack`), as the estimate's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from memcalc.core.errors import InvalidInputError
from memcalc.core.gpu import CPU_PROFILE, GENERIC, GpuProfile
from memcalc.core.stack import Stack
from memcalc.core.units import BYTES_FORMS, format_bytes, parse_bytes
from memcalc.targets.cuda.gpus import catalogue as gpu_catalogue
from memcalc.targets.cuda.gpus import local as gpu_local
from memcalc.targets.resolved_stack import ResolvedStack, resolve_stack

__all__ = ("Budget", "available_ram", "resolve_budget")


@dataclass(frozen=True)
class Budget:
    """Bytes the caching allocator may reserve, and where the number comes from.

    ``gpu``: the catalogue entry of the card, when one is known (given, or recognised from
    a local device's name); estimates then model that card's kernels and workspaces.
    """

    capacity: int
    source: str
    gpu: GpuProfile | None = None

def resolve_budget(
    budget: str | int | Budget | None = None,
    gpu: str | GpuProfile | None = None,
    device: str | None = None,
    *,
    stack: Stack | None = None,
    local_gpus: Callable[[], Sequence[gpu_local.LocalGpu]] | None = None,
) -> Budget:
    """Bytes the caching allocator may reserve, from exactly one of the three sources (see
    the module docstring); a :class:`Budget` is returned as is. ``stack``: the software stack
    whose CUDA context is subtracted (None: the defaults). ``local_gpus`` replaces GPU
    discovery (tests)."""
    if _names_cpu(gpu) and not isinstance(budget, Budget):
        return _from_cpu(budget, device)
    given = [name for name, value in (("budget", budget), ("gpu", gpu), ("device", device)) if value is not None]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise InvalidInputError(f"give exactly one of budget, gpu or device (got {what})")
    if isinstance(budget, Budget):
        return budget
    if gpu_local.names_local_gpu(gpu):  # "auto", "cuda:N": this machine's GPU
        gpu, device = None, gpu
    if budget is not None:
        return _from_budget(budget)
    if stack is not None and not isinstance(stack, Stack):
        raise InvalidInputError(f"stack must be a memcalc.Stack(...), got {type(stack).__name__}",
                                hint='e.g. stack=memcalc.Stack(torch="2.4", cuda="12.1")')
    versions = resolve_stack(stack)
    if gpu is not None:
        return _from_gpu(gpu, versions)
    assert device is not None
    return _from_device(device, local_gpus, versions)


def _names_cpu(gpu: object) -> bool:
    """Whether ``gpu`` is the CPU target: ``"cpu"`` or its profile."""
    if isinstance(gpu, GpuProfile):
        return gpu.is_cpu
    return isinstance(gpu, str) and gpu.strip().lower() == CPU_PROFILE.key


def _from_cpu(budget: str | int | None, device: str | None) -> Budget:
    """The CPU target's budget: ``budget`` as given, else this machine's available RAM."""
    if device is not None:
        raise InvalidInputError(f"gpu='cpu' is this machine's CPU; device={device!r} names a GPU: give one of them")
    if budget is not None:
        return replace(_from_budget(budget), source="as given, on the CPU", gpu=CPU_PROFILE)
    return Budget(available_ram(), "the CPU: this machine's available RAM (MemAvailable)", CPU_PROFILE)


def available_ram(meminfo: str = "/proc/meminfo") -> int:
    """Bytes the kernel says new allocations can have without swapping (``MemAvailable``)."""
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    raise InvalidInputError("this machine's available RAM cannot be read (no MemAvailable in /proc/meminfo)",
                            hint="Give the CPU step's budget: --gpu cpu --budget 16GiB (gpu='cpu', budget=...).")


def _from_budget(budget: str | int) -> Budget:
    try:
        capacity = parse_bytes(budget)
    except ValueError as exc:
        raise InvalidInputError(f"budget: {exc}", hint=f"A budget is {BYTES_FORMS}.") from None
    return Budget(capacity, "as given")


def _from_gpu(gpu: str | GpuProfile, versions: ResolvedStack) -> Budget:
    if not isinstance(gpu, (str, GpuProfile)):
        raise InvalidInputError(f"gpu must be a GPU name or a GpuProfile, got {type(gpu).__name__} {gpu!r}",
                                hint="Known GPUs: " + ", ".join(g.key for g in gpu_catalogue.catalogue()) + ".")
    profile = versions.apply(gpu if isinstance(gpu, GpuProfile) else gpu_catalogue.get_gpu(gpu))
    usable = profile.usable_memory
    if usable is None or profile.total_memory is None:
        raise InvalidInputError(
            f"GPU {profile.key!r} has no known capacity",
            hint="Name a GPU model (e.g. a100-40gb) or give a budget (e.g. 24GiB).")
    source = (f"{profile.key}: {format_bytes(profile.total_memory)} "
              f"− {format_bytes(profile.cuda_context)} CUDA context "
              f"({'measured' if profile.context_measured else 'assumed'})")
    return Budget(usable, source, profile)


def _from_device(spec: str, local_gpus: Callable[[], Sequence[gpu_local.LocalGpu]] | None,
                 versions: ResolvedStack) -> Budget:
    gpu_local.check_device_spec(spec)  # a typo is refused before GPUs are looked for
    context_exists = _cuda_initialised()  # read before discovery, which may initialise CUDA
    found = local_gpus() if local_gpus is not None else gpu_local.list_local_gpus()
    chosen = gpu_local.resolve_device(spec, found)
    profile = None if chosen.profile is None else versions.apply(chosen.profile)
    context = 0 if context_exists else versions.context_bytes(profile or GENERIC)
    capacity = chosen.free_memory - context
    label = f"{chosen.device} ({chosen.name}): {format_bytes(chosen.free_memory)} free"
    if context:
        label += f" − {format_bytes(context)} CUDA context (assumed)"
    if capacity <= 0:
        raise InvalidInputError(f"{label}: nothing is left for a training step",
                                hint="Free memory on that GPU, or pick another (memcalc gpus lists them).")
    return Budget(capacity, label, profile)


def _cuda_initialised() -> bool:
    """Whether this process already holds a CUDA context (never creates one)."""
    import torch

    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]  # unannotated in torch



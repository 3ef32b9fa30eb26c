"""The software stack an estimate assumes: a :class:`~memcalc.core.stack.Stack` resolved into
concrete versions (:func:`resolve_stack`), and what they decide.

* **PyTorch** keys every kernel fact (:mod:`memcalc.targets.cuda.sdpa`, :mod:`~memcalc.targets.autocast`,
  :mod:`~memcalc.targets.cuda.cublas`, cuDNN through :func:`~memcalc.targets.versions.cudnn_version_of`).
  Default: the installed torch's ``major.minor``. Supported: 2.4 through the installed one — a
  newer release is refused, because memcalc cannot know kernels it has never seen.
* **CUDA** decides the context (lazy module loading needs 11.7+). Default: the installed
  build's ``torch.version.cuda`` when the installed torch is the one assumed; otherwise (a CPU
  build, or another release) the CUDA of that release's default PyPI wheel
  (:data:`~memcalc.targets.versions.WHEEL_CUDA_VERSION`: 12.1 for 2.4 … 13.0 for 2.11+), the
  build a ``pip install torch==X.Y`` gets.
* **Module loading**: lazy unless ``CUDA_MODULE_LOADING`` says otherwise (read from this
  process's environment, as :func:`memcalc.targets.cuda.cublas.cublas_workspace_bytes` reads
  ``CUBLAS_WORKSPACE_CONFIG``): PyTorch sets it to ``LAZY`` when it is unset
  (``CUDAHooks::init``, aten/src/ATen/cuda/detail/CUDAHooks.cpp, since 1.13); ``EAGER`` loads
  every kernel; ``DEFAULT`` is the driver's default, lazy from CUDA 12.2 on Linux (CUDA
  Programming Guide, "Lazy Loading", Change History).
* **The CUDA context**: ``context_mib`` when given, else
  :func:`memcalc.targets.cuda.gpus.catalogue.cuda_context_bytes` of the GPU: measured where that GPU
  was measured (the H100 80GB under CUDA 13.0, both module-loading modes; the report's basis
  says so), assumed elsewhere.

The API boundary applies the result to the GPU profile (:meth:`ResolvedStack.apply`), so the
report's context, the usable memory, ``fits``, the headroom and the fit budget all use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from memcalc.core.errors import InvalidInputError
from memcalc.core.gpu import GpuProfile
from memcalc.core.stack import Stack
from memcalc.core.units import format_bytes
from memcalc.targets.cuda.gpus.catalogue import LAZY_LOADING_MIN_CUDA, context_source, cuda_context_bytes
from memcalc.targets.versions import OLDEST_TORCH_VERSION, WHEEL_CUDA_VERSION, parse_torch_version

__all__ = (
    "LAZY_BY_DEFAULT_CUDA",
    "ResolvedStack",
    "installed_torch_version",
    "lazy_module_loading",
    "resolve_stack",
    "resolve_torch_version",
    "supported_torch_versions",
)

MiB = 1024**2

#: The CUDA whose driver loads modules lazily when ``CUDA_MODULE_LOADING=DEFAULT`` (Linux; CUDA
#: Programming Guide, "Lazy Loading": "12.2 — Lazy loading enabled by default for Linux").
LAZY_BY_DEFAULT_CUDA = (12, 2)


def _version_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def installed_torch_version() -> str:
    """The installed torch's ``"major.minor"`` (``"2.13"`` for ``2.13.0+cpu``)."""
    return _version_text(parse_torch_version(torch.__version__))


def supported_torch_versions() -> tuple[str, ...]:
    """Every ``"2.Y"`` memcalc models: 2.4 through the installed torch."""
    newest = parse_torch_version(torch.__version__)
    return tuple(_version_text((OLDEST_TORCH_VERSION[0], minor))
                 for minor in range(OLDEST_TORCH_VERSION[1], newest[1] + 1)) if newest[0] == 2 else ()


def resolve_torch_version(requested: str | None) -> str:
    """``requested`` as ``"major.minor"`` (None: the installed torch), checked against
    :func:`supported_torch_versions`.

    Raises:
        InvalidInputError: a release outside 2.4 … the installed one, naming the range.
    """
    if requested is None:
        return installed_torch_version()
    try:
        version = parse_torch_version(requested)
    except ValueError:
        raise InvalidInputError(f"torch version must look like X.Y, got {requested!r}",
                                hint="e.g. --torch-version 2.4") from None
    text = _version_text(version)
    supported = supported_torch_versions()
    if text not in supported:
        newest = installed_torch_version()
        why = (f"it is newer than the installed torch {newest}, whose kernels are the newest memcalc knows"
               if version > parse_torch_version(newest) else "memcalc's kernel rules start at 2.4")
        raise InvalidInputError(
            f"torch {text} is not supported: {why}",
            hint=f"Supported: torch {supported[0]} through {supported[-1]} (--torch-version X.Y); "
                 "to model a newer release, install it." if supported else None)
    return text


def _default_cuda(torch_version: str) -> str:
    """The CUDA an estimate for ``torch_version`` assumes when none is given (module docstring)."""
    installed_cuda = torch.version.cuda
    if installed_cuda and torch_version == installed_torch_version():
        return _version_text(parse_torch_version(installed_cuda))
    version = parse_torch_version(torch_version)
    known = sorted(WHEEL_CUDA_VERSION)
    return WHEEL_CUDA_VERSION.get(version, WHEEL_CUDA_VERSION[known[0] if version < known[0] else known[-1]])


def lazy_module_loading(cuda_version: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether CUDA ``cuda_version`` loads kernels lazily under ``env`` (module docstring)."""
    cuda = parse_torch_version(cuda_version)
    if cuda < LAZY_LOADING_MIN_CUDA:
        return False
    value = env.get("CUDA_MODULE_LOADING")
    if value is None:  # PyTorch sets LAZY when the user has not chosen (CUDAHooks::init)
        return True
    choice = value.strip().upper()
    if choice in ("LAZY", "EAGER"):
        return choice == "LAZY"
    return cuda >= LAZY_BY_DEFAULT_CUDA  # DEFAULT (or a value CUDA does not know): the driver's default


@dataclass(frozen=True)
class ResolvedStack:
    """The versions an estimate assumes, all concrete.

    Attributes:
        torch: ``"major.minor"`` of the PyTorch whose kernels are modelled.
        cuda: ``"major.minor"`` of the CUDA runtime.
        lazy_loading: whether CUDA loads kernels lazily (:func:`lazy_module_loading`).
        context_mib: the user's CUDA context in MiB, overriding the model (None: modelled).
    """

    torch: str
    cuda: str
    lazy_loading: bool
    context_mib: float | None = None

    @property
    def core(self) -> Stack:
        """The same, as the :class:`~memcalc.core.stack.Stack` the options carry."""
        return Stack(torch=self.torch, cuda=self.cuda, context_mib=self.context_mib)

    def context_bytes(self, gpu: GpuProfile) -> int:
        """The CUDA context on ``gpu``: ``context_mib`` when given, else modelled."""
        if self.context_mib is not None:
            return round(self.context_mib * MiB)
        return cuda_context_bytes(gpu, parse_torch_version(self.cuda), lazy_loading=self.lazy_loading)

    def context_basis(self, gpu: GpuProfile | None = None) -> str:
        """How the context was arrived at, in a few words for the report; on a GPU whose
        context was measured (:data:`~memcalc.targets.cuda.gpus.catalogue.MEASURED_CONTEXTS`), where."""
        if self.context_mib is not None:
            return "given (--context-mib)"
        if self.lazy_loading:
            basis = "lazy module loading"
        elif parse_torch_version(self.cuda) < LAZY_LOADING_MIN_CUDA:
            basis = f"eager module loading: CUDA < {_version_text(LAZY_LOADING_MIN_CUDA)}"
        else:
            basis = "eager module loading: CUDA_MODULE_LOADING"
        source = "assumed" if gpu is None else context_source(gpu, parse_torch_version(self.cuda))
        return basis if source == "assumed" else f"{basis}, {source}"

    def apply(self, gpu: GpuProfile) -> GpuProfile:
        """``gpu`` with this stack's CUDA context (its lazy-loading figure kept, so applying a
        stack again starts from the profile's own figure). With lazy loading and no
        ``context_mib`` that is the profile's own figure: the profile itself comes back (an
        empty ``context_basis`` means lazy module loading)."""
        context = self.context_bytes(gpu)
        lazy = gpu.lazy_loading_context
        basis = self.context_basis(gpu)
        if self.context_mib is None and self.lazy_loading and context == lazy and basis == "lazy module loading":
            return gpu if gpu.lazy_context is None else replace(gpu, cuda_context=lazy, lazy_context=None,
                                                                context_basis="")
        return replace(gpu, cuda_context=context, lazy_context=lazy, context_basis=basis)

    def describe(self, gpu: GpuProfile | None = None) -> str:
        """``"torch 2.13, CUDA 13.0 (lazy module loading)"``, with the context on ``gpu``."""
        text = f"torch {self.torch}, CUDA {self.cuda} ({self.context_basis(gpu)})"
        if gpu is not None:
            text += f", CUDA context {format_bytes(self.context_bytes(gpu), 'MiB')}"
        return text


def resolve_stack(stack: Stack | None = None, env: Mapping[str, str] = os.environ) -> ResolvedStack:
    """The concrete versions ``stack`` stands for (None: every default).

    Args:
        stack: the user's :class:`~memcalc.core.stack.Stack`.
        env: the environment ``CUDA_MODULE_LOADING`` is read from.

    Returns:
        A :class:`ResolvedStack`.

    Raises:
        InvalidInputError: an unsupported torch version (the message names the range).
    """
    stack = stack or Stack()
    torch_version = resolve_torch_version(stack.torch)
    cuda = _version_text(parse_torch_version(stack.cuda)) if stack.cuda is not None else _default_cuda(torch_version)
    context = None if stack.context_mib is None else float(stack.context_mib)
    return ResolvedStack(torch=torch_version, cuda=cuda, lazy_loading=lazy_module_loading(cuda, env),
                         context_mib=context)

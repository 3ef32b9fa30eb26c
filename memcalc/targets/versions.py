"""The PyTorch, CUDA and cuDNN versions the CUDA rules are keyed by, and small helpers the
rule modules share.

The rules of :mod:`memcalc.targets` (:mod:`~memcalc.targets.cuda.sdpa`, :mod:`~memcalc.targets.cuda.attention_memory`,
:mod:`~memcalc.targets.autocast`, :mod:`~memcalc.targets.cuda.cublas`, :mod:`~memcalc.targets.cuda.cudnn`) are
transcribed from the PyTorch sources (cited per rule) for the version the GPU machine runs,
**PyTorch 2.11** (``torch==2.11.0+cu130``, which pins ``nvidia-cudnn-cu13==9.19.0.56``), and
checked there. Where 2.4–2.13 differ and the difference is known, a rule takes
``torch_version``; an estimate passes the version its :class:`~memcalc.core.stack.Stack`
resolves to (:mod:`memcalc.targets.resolved_stack`: the installed torch by default).

What the default PyPI wheel of each release bundles (:data:`BUNDLED_CUDNN_VERSION`,
:data:`WHEEL_CUDA_VERSION`) was read from the wheels' ``Requires-Dist`` (``pip install
--dry-run --no-deps --report`` for ``torch==X.Y.0``, manylinux x86_64, cp311).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the version facts are plain data: the GPU catalogue and `memcalc gpus` read them without torch
    import torch

__all__ = (
    "BUNDLED_CUDNN_VERSION",
    "OLDEST_TORCH_VERSION",
    "TARGET_TORCH_VERSION",
    "WHEEL_CUDA_VERSION",
    "ceil_div",
    "cudnn_version_of",
    "element_size",
    "parse_torch_version",
    "round_up",
)

#: The PyTorch the GPU machine runs (``torch 2.11.0+cu130``, /work/.library/device/KINDS.md).
TARGET_TORCH_VERSION = "2.11"

#: cuDNN bundled with the default PyPI wheel (``Requires-Dist: nvidia-cudnn-cu1x==…`` in each
#: wheel's METADATA, read with ``pip install --dry-run --report``), as
#: ``cudnnGetVersion()`` reports it (major*10000 + minor*100 + patch).
BUNDLED_CUDNN_VERSION: dict[tuple[int, int], int] = {
    (2, 4): 90100,  # torch 2.4.0: nvidia-cudnn-cu12==9.1.0.70 (CUDA 12.1 wheel)
    (2, 5): 90100,  # torch 2.5.0: nvidia-cudnn-cu12==9.1.0.70 (CUDA 12.4 wheel)
    (2, 6): 90100,  # torch 2.6.0: nvidia-cudnn-cu12==9.1.0.70 (CUDA 12.4 wheel)
    (2, 7): 90501,  # torch 2.7.0: nvidia-cudnn-cu12==9.5.1.17 (CUDA 12.6 wheel)
    (2, 8): 91002,  # torch 2.8.0: nvidia-cudnn-cu12==9.10.2.21 (CUDA 12.8 wheel)
    (2, 9): 91002,  # torch 2.9.0: nvidia-cudnn-cu12==9.10.2.21 (CUDA 12.8 wheel)
    (2, 10): 91002,  # torch 2.10.0: nvidia-cudnn-cu12==9.10.2.21 (CUDA 12.8 wheel)
    (2, 11): 91900,  # torch 2.11.0: nvidia-cudnn-cu13==9.19.0.56 (CUDA 13.0 wheel)
    (2, 12): 92000,  # torch 2.12.0: nvidia-cudnn-cu13==9.20.0.48 (CUDA 13.0 wheel)
    (2, 13): 92000,  # torch 2.13.0: nvidia-cudnn-cu13==9.20.0.48 (cuda-toolkit==13.0.3)
}

#: The CUDA runtime of each release's default PyPI wheel: ``nvidia-cuda-runtime-cu12==12.1.105``
#: (2.4), ``==12.4.127`` (2.5, 2.6), ``==12.6.77`` (2.7), ``==12.8.90`` (2.8–2.10);
#: ``cuda-toolkit[...]==13.0.2`` (2.11), ``nvidia-cublas>=13.1.0.3`` of CUDA 13.0 (2.12),
#: ``cuda-toolkit[...]==13.0.3`` (2.13). The CUDA a CPU build of torch stands for.
WHEEL_CUDA_VERSION: dict[tuple[int, int], str] = {
    (2, 4): "12.1",
    (2, 5): "12.4",
    (2, 6): "12.4",
    (2, 7): "12.6",
    (2, 8): "12.8",
    (2, 9): "12.8",
    (2, 10): "12.8",
    (2, 11): "13.0",
    (2, 12): "13.0",
    (2, 13): "13.0",
}

#: The oldest PyTorch memcalc models (the supported range is 2.4 … the installed torch): no
#: rule here was read from an older release's sources.
OLDEST_TORCH_VERSION = (2, 4)

_VERSION = re.compile(r"\s*(\d+)\.(\d+)")


def parse_torch_version(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` → ``(2, 11)``; only major.minor decide the rules here."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}; expected e.g. '2.11' or '2.11.0+cu130'")
    return int(match.group(1)), int(match.group(2))


def cudnn_version_of(torch_version: tuple[int, int], cudnn_version: int | None) -> int:
    """The cuDNN the checks see: the caller's, else the default wheel's of ``torch_version``
    (:data:`BUNDLED_CUDNN_VERSION`); a release outside the table takes its nearest neighbour."""
    if cudnn_version is not None:
        return cudnn_version
    if torch_version in BUNDLED_CUDNN_VERSION:
        return BUNDLED_CUDNN_VERSION[torch_version]
    known = sorted(BUNDLED_CUDNN_VERSION)
    return BUNDLED_CUDNN_VERSION[known[0] if torch_version < known[0] else known[-1]]


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (``torch.dtype.itemsize``: asked by rules run once per
    kernel call and per replayed batch, where a tensor made to ask it cost more than the rule)."""
    return int(dtype.itemsize)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return (value + multiple - 1) // multiple * multiple


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers."""
    return (a + b - 1) // b

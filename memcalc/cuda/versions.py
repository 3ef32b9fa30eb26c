"""The PyTorch and cuDNN versions the CUDA rules are transcribed for, and small helpers the
rule modules share.

The rules of :mod:`memcalc.cuda` (:mod:`~memcalc.cuda.sdpa`, :mod:`~memcalc.cuda.attention_memory`,
:mod:`~memcalc.cuda.autocast`, :mod:`~memcalc.cuda.cublas`, :mod:`~memcalc.cuda.cudnn`) are
transcribed from the PyTorch sources (cited per rule) for the version the GPU machine runs,
**PyTorch 2.11** (``torch==2.11.0+cu130``, which pins ``nvidia-cudnn-cu13==9.19.0.56``).
Where 2.4–2.13 differ and the difference is known, a rule takes ``torch_version``.
"""

from __future__ import annotations

import re

import torch

__all__ = (
    "BUNDLED_CUDNN_VERSION",
    "TARGET_TORCH_VERSION",
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
    (2, 9): 91002,  # torch 2.9.0: nvidia-cudnn-cu12==9.10.2.21 (CUDA 12.8 wheel)
    (2, 10): 91002,  # torch 2.10.0: nvidia-cudnn-cu12==9.10.2.21 (CUDA 12.8 wheel)
    (2, 11): 91900,  # torch 2.11.0: nvidia-cudnn-cu13==9.19.0.56 (CUDA 13.0 wheel)
    (2, 12): 92000,  # torch 2.12.0: nvidia-cudnn-cu13==9.20.0.48 (CUDA 13.0 wheel)
}

_VERSION = re.compile(r"\s*(\d+)\.(\d+)")


def parse_torch_version(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` → ``(2, 11)``; only major.minor decide the rules here."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}; expected e.g. '2.11' or '2.11.0+cu130'")
    return int(match.group(1)), int(match.group(2))


def cudnn_version_of(torch_version: tuple[int, int], cudnn_version: int | None) -> int:
    """The cuDNN the checks see: the caller's, else the wheel's, else the 2.11 one."""
    if cudnn_version is not None:
        return cudnn_version
    if torch_version in BUNDLED_CUDNN_VERSION:
        return BUNDLED_CUDNN_VERSION[torch_version]
    # older wheels bundled cuDNN 9.1–9.8 (below every threshold that matters); newer ones ≥ 9.20
    return 90100 if torch_version < (2, 9) else BUNDLED_CUDNN_VERSION[(2, 12)]


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return (value + multiple - 1) // multiple * multiple


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers."""
    return (a + b - 1) // b

"""How big one cuDNN convolution workspace is: :func:`conv_workspace_bytes` — a documented
*model*, not a transcription: cuDNN's heuristics are closed source.

cuDNN convolutions borrow a workspace from the caching allocator per call and give it back
when the call returns; no meta kernel shows it. What PyTorch does around it is read from
``aten/src/ATen/native/cudnn/Conv_v8.cpp`` (cuDNN v8 API, the default path); the sizes are
modelled (see :func:`conv_workspace_bytes` for the model and its uncertainty).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch

from memcalc.targets.versions import element_size

__all__ = ("ConvDirection", "conv_workspace_bytes")

# =============================================================================================
# cuDNN convolution workspace — a documented model
# =============================================================================================


class ConvDirection(str, enum.Enum):
    """The three cuDNN convolution operations (``convolution_backward`` runs one per mask bit)."""

    FORWARD = "forward"
    BACKWARD_DATA = "backward_data"
    BACKWARD_FILTER = "backward_filter"

    @classmethod
    def parse(cls, value: str | ConvDirection) -> ConvDirection:
        if isinstance(value, ConvDirection):
            return value
        aliases = {"backward_weight": cls.BACKWARD_FILTER, "backward_input": cls.BACKWARD_DATA,
                   "fprop": cls.FORWARD, "dgrad": cls.BACKWARD_DATA, "wgrad": cls.BACKWARD_FILTER}
        if value in aliases:
            return aliases[value]
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(d.value for d in cls)
            raise ValueError(f"unknown convolution direction {value!r}; expected one of {choices}") from None


def _uses_tensor_cores(dtype: torch.dtype, cc: tuple[int, int], allow_tf32: bool) -> bool:
    """fp16 on Volta+, bf16 on Ampere+, fp32 through TF32 on Ampere+ (``torch.backends.cudnn
    .allow_tf32`` defaults to True)."""
    if dtype == torch.float16:
        return cc >= (7, 0)
    if dtype == torch.bfloat16:
        return cc >= (8, 0)
    if dtype == torch.float32:
        return allow_tf32 and cc >= (8, 0)
    return False


def _is_depthwise(input_shape: Sequence[int], weight_shape: Sequence[int], groups: int) -> bool:
    return groups > 1 and groups == input_shape[1] and weight_shape[1] == 1


def conv_workspace_bytes(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    output_shape: Sequence[int],
    dtype: torch.dtype,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    direction: str | ConvDirection,
    compute_capability: tuple[int, int],
    *,
    channels_last: bool = False,
    allow_tf32: bool = True,
) -> int:
    """Estimated cuDNN workspace of one convolution call — a **model**, uncertainty high.

    What PyTorch does (Conv_v8.cpp, cuDNN v8 API, the default path): with
    ``torch.backends.cudnn.benchmark=False`` (default) it asks cuDNN's heuristics (mode A,
    falling back to mode B) for engine configs and ``try_plans`` them *in heuristic order*:
    ``run_conv_plan`` allocates ``plan.getWorkspaceSize()`` bytes from the caching allocator,
    runs, and frees them when the call returns; a plan whose workspace allocation throws
    ``OutOfMemoryError`` is skipped for the next one. ``CUDNN_CONV_WSCAP_DBG`` (MiB) is cuDNN's
    own cap on what heuristics may propose. So the workspace is a per-call temporary whose size
    is whatever the first heuristic engine wants — not published, not derivable from sources.

    The model (per call, bytes):

    * No tensor cores (fp32 without TF32, fp16 before Volta, fp64): 0 — implicit-precomputed-GEMM
      style engines need at most a small index buffer.
    * Depthwise (groups == C_in, one input channel per group): 0 — small dedicated kernels.
    * Tensor cores, NCHW (the default memory format): cuDNN "may use padding, folding, and
      NCHW-to-NHWC transformations to call the Tensor Core operations" (cuDNN developer guide,
      Legacy API › Convolution Functions › Data and Filter Formats); the transformed copies live
      in the workspace. Forward: bytes(x) + bytes(w) + bytes(y); backward-data:
      bytes(dy) + bytes(w) + bytes(dx); backward-filter: bytes(x) + bytes(dy) + the dW
      accumulator in fp32 (4·numel(w)).
    * Tensor cores, channels_last: forward and backward-data 0 (native NHWC implicit GEMM);
      backward-filter 4·numel(w) (split-K partial sums in fp32).

    Uncertainty: an upper-bound-flavoured guess for NCHW, easily 0 on some engines and a factor
    of 2 either way on others; measure with ``torch.cuda.memory_stats()["allocated_bytes.all.peak"]``
    around a single conv on the target GPU before trusting it. Stride, padding and dilation do
    not enter the model (they shape y, which does).
    """
    del stride, padding, dilation  # accepted for the call signature; the model ignores them
    which = ConvDirection.parse(direction)
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    if not _uses_tensor_cores(dtype, cc, allow_tf32) or _is_depthwise(input_shape, weight_shape, groups):
        return 0
    size = element_size(dtype)
    x_bytes = math.prod(input_shape) * size
    w_bytes = math.prod(weight_shape) * size
    y_bytes = math.prod(output_shape) * size
    w_fp32 = math.prod(weight_shape) * 4
    if channels_last:
        return w_fp32 if which is ConvDirection.BACKWARD_FILTER else 0
    model: dict[ConvDirection, int] = {
        ConvDirection.FORWARD: x_bytes + w_bytes + y_bytes,
        ConvDirection.BACKWARD_DATA: y_bytes + w_bytes + x_bytes,
        ConvDirection.BACKWARD_FILTER: x_bytes + y_bytes + w_fp32,
    }
    return model[which]

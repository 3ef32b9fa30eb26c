"""Drop-in candidate for memcalc.targets.cuda.cudnn.conv_workspace_bytes, fitted to H100 snapshots
(torch 2.11+cu130, cuDNN 9.19, benchmark=False, TF32 on; NCHW). See /tmp/cudnn_work/REPORT.md."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

H100_SMS = 132
# cuDNN adds 16 B (or 147 B) to every layout-copying engine's workspace; 16 B makes the
# allocator-rounded (512 B) size match.
_TAIL = 16


def _uses_tensor_cores(dtype: torch.dtype, cc: tuple[int, int], allow_tf32: bool) -> bool:
    if dtype == torch.float16:
        return cc >= (7, 0)
    if dtype == torch.bfloat16:
        return cc >= (8, 0)
    if dtype == torch.float32:
        return allow_tf32 and cc >= (8, 0)
    return False


def conv_workspace_bytes(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    output_shape: Sequence[int],
    dtype: torch.dtype,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    direction: str,
    compute_capability: tuple[int, int],
    *,
    channels_last: bool = False,
    allow_tf32: bool = True,
    sm_count: int = H100_SMS,
) -> int:
    """cuDNN workspace of one convolution call, NCHW, cuDNN v8 API heuristics (mode A) on Hopper.

    ``direction`` is cuDNN's: ``forward`` / ``backward_data`` / ``backward_filter`` (a transposed
    conv's forward is backward_data, its input-gradient is ``forward``). The shapes may be given in
    the layer's or in cuDNN's orientation: C and K are read from the weight, and the terms used
    are symmetric in x and y.

    What the snapshots show: the workspace of the heuristics' first engine is the NCHW->NHWC copies
    of (a subset of) x, w and y, plus 16 or 147 B, plus — for weight gradients — fp32 split-K
    partial sums of dW.
    """
    del padding, dilation
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    if not _uses_tensor_cores(dtype, cc, allow_tf32):
        return 0
    if groups > 1 and groups == input_shape[1] and weight_shape[1] == 1:  # depthwise
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    n = int(input_shape[0])
    k, c = int(weight_shape[0]), int(weight_shape[1]) * int(groups)
    r, s = int(weight_shape[2]), int(weight_shape[3]) if len(weight_shape) > 3 else 1
    x_bytes = math.prod(input_shape) * size
    w_bytes = math.prod(weight_shape) * size
    y_bytes = math.prod(output_shape) * size
    w_fp32 = math.prod(weight_shape) * 4
    wgrad = direction == "backward_filter"
    one = r * s == 1
    strided = any(int(st) > 1 for st in stride)
    spatial = min(math.prod(input_shape[2:]), math.prod(output_shape[2:]))

    def split_k_partials() -> int:
        # dW split over the reduction (N·P·Q) so that splits × tiles fill the SMs, each split an
        # fp32 copy of dW, at most one 128×128 fp32 tile per SM.
        tiles = math.ceil(k / 128) * math.ceil(c / 128) * r * s
        return min(max(1, sm_count // tiles) * w_fp32, sm_count * 128 * 128 * 4)

    if channels_last:  # no snapshot data: no layout copies; dW partials as for NCHW
        return split_k_partials() if wgrad else 0
    if c < 8 or k < 8:
        # RGB stems and tiny heads. 3x3 stems (VGG, U-Net) and a 1x1 head's fprop/dgrad use an
        # engine without workspace. The 7x7 ResNet stem pads C 3 -> 4 in its NHWC copies (fp32
        # fprop does not) and splits its wgrad into 120 fp32 copies of the padded dW (8 in fp16;
        # 36 at batch 1) — fitted to this one layer shape.
        if (one and not wgrad) or (not one and r * s <= 9):
            return 0
        if one or c >= 8:  # K < 8 head's wgrad: plain copies
            return x_bytes + w_bytes + y_bytes + _TAIL
        c4 = max(c, 4)
        x4, w4, w4_fp32 = x_bytes // c * c4, w_bytes // c * c4, w_fp32 // c * c4
        if direction == "forward":
            return (x_bytes + w_bytes if size == 4 else x4 + w4) + y_bytes + _TAIL
        rows = n * math.prod(output_shape[2:])
        splits = min(120, rows // 348) if size == 4 else 8
        return x4 + w4 + y_bytes + splits * w4_fp32 + _TAIL
    if one and not strided:
        # 1x1 stride 1 in NCHW is one GEMM per image: no layout copies at all (0-400 B); the weight
        # gradient keeps one fp32 dW per image and sums them. Small images (7x7) take the
        # NHWC-copy engine instead (w needs no copy: KCRS == KRSC for 1x1).
        if spatial >= 196:
            return min(n * w_fp32, x_bytes + w_bytes + y_bytes) if wgrad else 0
        return x_bytes + y_bytes + _TAIL
    if one:
        # 1x1 strided (ResNet downsample): copies of x and y (w needs none); C <= 64 takes an
        # engine without workspace. Weight gradient: x, w, y (observed extras up to 7.5 MiB not modelled).
        if wgrad:
            return x_bytes + w_bytes + y_bytes + _TAIL
        return 0 if c <= 64 else x_bytes + y_bytes + _TAIL
    if wgrad:
        return x_bytes + w_bytes + y_bytes + split_k_partials() + _TAIL
    if direction == "forward" and c == 64 and k == 128:
        # this engine writes y in NCHW itself: copies of the C-channel tensor and w only
        return (x_bytes if int(input_shape[1]) == c else y_bytes) + w_bytes + _TAIL
    return x_bytes + w_bytes + y_bytes + _TAIL

"""How big one cuDNN convolution workspace is: :func:`conv_workspace_bytes` — a rule *measured*
on H100 snapshots, not a transcription: cuDNN's heuristics are closed source.

cuDNN convolutions borrow a workspace from the caching allocator per call and give it back
when the call returns; no meta kernel shows it. What PyTorch does around it is read from
``aten/src/ATen/native/cudnn/Conv_v8.cpp`` (cuDNN v8 API, the default path); the sizes were
read off 1,133 real calls (593 per step, 305 distinct shapes) in seven H100 memory snapshots
(torch 2.11 + CUDA 13.0, cuDNN 9.19; ``benchmarks/results/2026-11-26-cudnn-workspaces/``,
whose ``REPORT.md`` gives the per-call table and the rule's error by class of call).

The rule is written once, as :func:`conv_workspace_line`: a call site's bytes at every batch of
a line of shapes (:class:`WorkspaceLine`), which a fit's trace family builds once and sizes each
replayed batch with (``ConvWorkspaceRule.along``); :func:`conv_workspace_bytes` is that line with
no slope. It reads the call's shapes and the GPU alone, no allocator state.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import torch

from memcalc.targets.versions import element_size

__all__ = ("ENGINE_EXCEPTIONS", "ConvDirection", "ConvWorkspaceRule", "EngineException", "WorkspaceLine",
           "conv_workspace_bytes", "conv_workspace_line")

#: The SM count the rule's split-K term was read on (H100 SXM); a GPU profile passes its own.
MEASURED_SM_COUNT = 132
#: What cuDNN adds to every layout-copying engine's workspace: 16 B (or 147 B; 400 or 272 B for
#: the GEMM engines), which the allocator's 512-B rounding hides but a snapshot shows.
WORKSPACE_TAIL = 16
#: A split-K weight gradient keeps at most one 128×128 fp32 tile of partial sums per SM.
SPLIT_K_TILE = 128
#: A 1x1 stride-1 convolution over at least this many pixels runs as one GEMM per image in NCHW
#: (14×14 and larger in the snapshots); 7×7 takes the NHWC-copy engine.
PER_IMAGE_GEMM_MIN_PIXELS = 196
#: The 7x7 RGB stem's fp32 weight gradient: min(120, output rows // 348) split-K copies of the
#: padded dW (8 in fp16), fitted to ResNet's stem at batches 1, 32 and 64 (exact to 607 B).
STEM_FP32_MAX_SPLITS = 120
STEM_ROWS_PER_SPLIT = 348
STEM_HALF_SPLITS = 8


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


@dataclass(frozen=True)
class EngineException:
    """One convolution whose engine departs from its class's rule in the snapshots, and what it
    copies instead. It matches on the channels (C, K), whether the filter is 1x1, the stride, the
    direction and the element size (``None``: any); ``copies`` names the tensors copied: ``x``,
    ``w``, ``y``, or ``C``, the one of x and y with C channels. ``source`` says where it was read."""

    channels: tuple[int, int]
    pointwise: bool
    strided: bool | None
    direction: ConvDirection
    element_size: int | None
    copies: tuple[str, ...]
    source: str

    def matches(self, c: int, k: int, pointwise: bool, strided: bool, direction: ConvDirection, size: int) -> bool:
        return ((c, k) == self.channels and pointwise == self.pointwise and self.strided in (None, strided)
                and direction is self.direction and self.element_size in (None, size))


_REPORT = "benchmarks/results/2026-11-26-cudnn-workspaces/REPORT.md"
#: The shapes whose engine copies other tensors than its class's (checked before the class rules).
ENGINE_EXCEPTIONS: tuple[EngineException, ...] = (
    EngineException((256, 512), pointwise=True, strided=True, direction=ConvDirection.FORWARD, element_size=4,
                    copies=("x", "w"),
                    source=f"fp32 C256 → K512 1x1 stride 2 at 56×56, ResNet-50/101/152's layer2.0.downsample, at "
                           f"batches 32 and 64: X+W (2 of the 27 strided 1x1 shapes); in fp16 it copies x and y as "
                           f"the others do ({_REPORT} §2, §4)"),
    EngineException((64, 128), pointwise=False, strided=None, direction=ConvDirection.FORWARD, element_size=None,
                    copies=("C", "w"),
                    source=f"C64 → K128 3x3/2x2 forward at every batch, U-Net's transposed up4 among them (in "
                           f"cuDNN's view): the 64-channel tensor and w, y written in NCHW by the engine "
                           f"({_REPORT} §2)"),
)


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


#: The second term of a :class:`WorkspaceLine` that bounds nothing: more bytes than any GPU holds.
_UNBOUNDED = 1 << 62


class WorkspaceLine(NamedTuple):
    """One call site's workspace at every batch ``B`` of a line of shapes (only the batch dimension
    of x and y grows): ``min(a + b·B, bound_a + bound_b·B) + per_split·min(max_splits, (rows_a +
    rows_b·B) // rows_per_split)``. The engine cuDNN picks is the same all along the line (the
    channels, filter and image size decide it); only the bytes of what it holds move, and a 1x1
    weight gradient's per-image dW (the bound) and the 7x7 stem's split count are the two terms
    that are not affine. Built once per trace family, it sizes a replay's batch in one
    expression where the rule re-read every shape (``search.affine``)."""

    a: int
    b: int
    bound_a: int = _UNBOUNDED
    bound_b: int = 0
    per_split: int = 0
    max_splits: int = 0
    rows_a: int = 0
    rows_b: int = 0
    rows_per_split: int = 1

    def at(self, batch: int) -> int:
        """The workspace's bytes at ``batch``."""
        least = min(self.a + self.b * batch, self.bound_a + self.bound_b * batch)
        return least + self.per_split * min(self.max_splits, (self.rows_a + self.rows_b * batch) // self.rows_per_split)


_NONE = WorkspaceLine(0, 0)


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
    sm_count: int = MEASURED_SM_COUNT,
) -> int:
    """The cuDNN workspace of one convolution call, in bytes: what the first engine of cuDNN's
    heuristics asks for, as the H100 snapshots show it.

    What PyTorch does (Conv_v8.cpp): with ``torch.backends.cudnn.benchmark=False`` (the default)
    it asks cuDNN's heuristics for engine configs and ``try_plans`` them in order;
    ``run_conv_plan`` allocates ``plan.getWorkspaceSize()`` bytes from the caching allocator,
    runs, and frees them when the call returns. In the snapshots no call ever allocated a second
    candidate's workspace.

    ``direction`` is cuDNN's: a transposed convolution's forward is ``backward_data``, its input
    gradient ``forward``. The shapes may be the layer's or cuDNN's: C and K are read from the
    weight, and the terms used are symmetric in x and y. X, W, Y below are the tensors' bytes.

    What the engines hold (``REPORT.md`` §2 gives the counts behind each line):

    * No tensor cores (fp32 without TF32, fp16 before Volta, fp64), or depthwise: 0.
    * The NHWC copies of x, w and y, plus :data:`WORKSPACE_TAIL` — the rule for 3x3 (and 2x2)
      forward and backward-data, in 79 of 99 shapes.
    * Weight gradients add fp32 split-K partial sums of dW: as many copies as fill the SMs with
      one per (K, C) 128-tile and filter tap, at most one tile per SM.
    * 1x1 stride 1 over ≥ :data:`PER_IMAGE_GEMM_MIN_PIXELS` pixels: one GEMM per image, no copies
      (0 B); its weight gradient keeps one fp32 dW per image (capped by the copies). Smaller
      images copy x and y (a 1x1 weight needs no copy: KCRS is KRSC).
    * 1x1 strided (ResNet's downsample): copies of x and y; C ≤ 64 takes an engine without one.
    * :data:`ENGINE_EXCEPTIONS`: shapes whose engine copies other tensors (a row each, with its source).
    * RGB stems (C or K < 8): 3x3 stems and a 1x1 head's forward use no workspace; ResNet's 7x7
      stem pads C 3 → 4 and splits its weight gradient widely (the ``STEM_*`` constants).

    Error on the snapshots' 593 calls per step: median 0 B; the step's sum within 0.2% on the
    fit set and 1% on the held-out set. What it misses: split-K extras of 2–16 MiB on some
    256/512-channel forwards and 1x1 weight gradients, engines that change with the batch (the
    64 → 64 3x3 forward copies x and w only at batch 32), a few shapes that take none at all,
    and batch 1, whose engines are mostly workspace-free
    (about 2× over in sum, all at the 10 MiB scale). Measured on an H100 only: other GPUs scale
    the split-K term by their ``sm_count``; bf16 and ``channels_last`` have no data (channels_last
    is assumed copy-free, with the same dW partials).
    """
    del padding, dilation  # accepted for the call signature; the engines seen do not depend on them
    line = conv_workspace_line(input_shape, weight_shape, output_shape, dtype, stride, groups, direction,
                               compute_capability, channels_last=channels_last, allow_tf32=allow_tf32,
                               sm_count=sm_count)
    assert line is not None, "a line without slopes is always one"
    return line.at(0)


#: ``a + b·B`` bytes: a term of :func:`conv_workspace_line`.
_Line: TypeAlias = tuple[int, int]


def _sum(*lines: _Line, fixed: int = 0) -> WorkspaceLine:
    a, b = fixed, 0
    for line in lines:
        a, b = a + line[0], b + line[1]
    return WorkspaceLine(a, b)


def conv_workspace_line(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    output_shape: Sequence[int],
    dtype: torch.dtype,
    stride: Sequence[int],
    groups: int,
    direction: str | ConvDirection,
    compute_capability: tuple[int, int],
    *,
    batch_slopes: tuple[int, int] = (0, 0),
    channels_last: bool = False,
    allow_tf32: bool = True,
    sm_count: int = MEASURED_SM_COUNT,
) -> WorkspaceLine | None:
    """:func:`conv_workspace_bytes` (whose rule this is: it is this at ``batch_slopes`` (0, 0)) at
    every batch ``B`` where x's batch dimension is ``input_shape[0] + batch_slopes[0]·B`` and y's
    ``output_shape[0] + batch_slopes[1]·B``; None where a term is not exact along the line (a
    padded stem copy whose bytes per batch step do not divide by C)."""
    which = ConvDirection.parse(direction)
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    if not _uses_tensor_cores(dtype, cc, allow_tf32) or _is_depthwise(input_shape, weight_shape, groups):
        return _NONE
    size = element_size(dtype)
    xs, ws, ys = tuple(map(int, input_shape)), tuple(map(int, weight_shape)), tuple(map(int, output_shape))
    k, c = ws[0], ws[1] * int(groups)
    taps = math.prod(ws[2:])
    x_step, y_step = int(batch_slopes[0]), int(batch_slopes[1])
    x_image = math.prod(xs[1:]) * size  # the bytes of one image of x
    y_pixels = math.prod(ys[2:])
    y_image = ys[1] * y_pixels * size
    batch: _Line = (xs[0], x_step)
    x: _Line = (xs[0] * x_image, x_step * x_image)
    y: _Line = (ys[0] * y_image, y_step * y_image)
    weights = math.prod(ws)
    w: _Line = (weights * size, 0)
    dw_fp32 = weights * 4
    wgrad = which is ConvDirection.BACKWARD_FILTER
    pointwise = taps == 1
    strided = any(int(s) > 1 for s in stride)

    def split_k_partials() -> int:
        tiles = math.ceil(k / SPLIT_K_TILE) * math.ceil(c / SPLIT_K_TILE) * taps
        return min(max(1, sm_count // tiles) * dw_fp32, sm_count * SPLIT_K_TILE * SPLIT_K_TILE * 4)

    if channels_last:
        return WorkspaceLine(split_k_partials(), 0) if wgrad else _NONE
    if c < 8 or k < 8:
        if (pointwise and not wgrad) or (not pointwise and taps <= 9):
            return _NONE
        if pointwise or c >= 8:  # a K < 8 head's weight gradient: plain copies
            return _sum(x, w, y, fixed=WORKSPACE_TAIL)
        padded = max(c, 4)  # the 7x7 stem: C padded to 4 in the NHWC copies (fp32 forward does not)
        if x[1] % c:
            return None  # x's bytes // C is not on a line
        x4: _Line = (x[0] // c * padded, x[1] // c * padded)
        w4: _Line = (w[0] // c * padded, 0)
        dw4_fp32 = dw_fp32 // c * padded
        if which is ConvDirection.FORWARD:
            return _sum(*((x, w) if size == 4 else (x4, w4)), y, fixed=WORKSPACE_TAIL)
        copies = _sum(x4, w4, y, fixed=WORKSPACE_TAIL)
        if size != 4:
            return copies._replace(a=copies.a + STEM_HALF_SPLITS * dw4_fp32)
        return copies._replace(per_split=dw4_fp32, max_splits=STEM_FP32_MAX_SPLITS, rows_a=batch[0] * y_pixels,
                               rows_b=batch[1] * y_pixels, rows_per_split=STEM_ROWS_PER_SPLIT)
    for row in ENGINE_EXCEPTIONS:
        if row.matches(c, k, pointwise, strided, which, size):
            copied = {"x": x, "w": w, "y": y, "C": x if xs[1] == c else y}
            return _sum(*(copied[name] for name in row.copies), fixed=WORKSPACE_TAIL)
    if pointwise and not strided:
        pixels = min(math.prod(xs[2:]), y_pixels)
        if pixels >= PER_IMAGE_GEMM_MIN_PIXELS:
            if not wgrad:
                return _NONE
            copies = _sum(x, w, y)  # one fp32 dW per image, capped by the copies
            return WorkspaceLine(batch[0] * dw_fp32, batch[1] * dw_fp32, copies.a, copies.b)
        return _sum(x, y, fixed=WORKSPACE_TAIL)
    if pointwise:
        if wgrad:
            return _sum(x, w, y, fixed=WORKSPACE_TAIL)
        return _NONE if c <= 64 else _sum(x, y, fixed=WORKSPACE_TAIL)
    if wgrad:
        return _sum(x, w, y, fixed=split_k_partials() + WORKSPACE_TAIL)
    return _sum(x, w, y, fixed=WORKSPACE_TAIL)


@dataclass(frozen=True)
class ConvWorkspaceRule:
    """:func:`conv_workspace_bytes` of one call site, from the shapes of x, w and y (``ndim``
    each, in one tuple), for the trace's :class:`~memcalc.engine.trace.ShapeSized`: which engine
    runs changes with the batch (a 1x1 weight gradient's per-image dW, the stem's split count),
    so the bytes are not affine in it although the shapes are."""

    ndim: int
    dtype: torch.dtype
    stride: tuple[int, ...]
    groups: int
    direction: ConvDirection
    compute_capability: tuple[int, int]
    sm_count: int

    def __call__(self, arguments: tuple[int, ...]) -> int:
        return _rule_bytes(self, arguments)

    def along(self, intercepts: tuple[int, ...], slopes: tuple[int, ...]) -> WorkspaceLine | None:
        """The rule at every batch ``B`` of the arguments ``intercepts + slopes·B`` (``()``: none),
        as one :class:`WorkspaceLine`: what a trace family (``search.affine``) builds once and
        sizes each replay's batch with. None when a slope is not a batch dimension's (x's or y's
        first) or a term is not exact on the line: the family then applies the rule per batch."""
        n = self.ndim
        if slopes and any(slope for i, slope in enumerate(slopes) if i not in (0, 2 * n)):
            return None
        return conv_workspace_line(intercepts[:n], intercepts[n:2 * n], intercepts[2 * n:], self.dtype, self.stride,
                                   self.groups, self.direction, self.compute_capability,
                                   batch_slopes=(slopes[0], slopes[2 * n]) if slopes else (0, 0),
                                   sm_count=self.sm_count)


@functools.lru_cache(maxsize=1 << 16)
def _rule_bytes(rule: ConvWorkspaceRule, arguments: tuple[int, ...]) -> int:
    """A call site's bytes, remembered: the tracer checks each call's (``StorageTracer.synthetic``),
    and a network repeats its layers' shapes within a step and across the traces of one fit."""
    line = rule.along(arguments, ())
    assert line is not None, "a line without slopes is always one"
    return line.at(0)

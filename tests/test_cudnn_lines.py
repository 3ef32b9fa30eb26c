"""A cuDNN convolution's workspace along a line of batches (``ConvWorkspaceRule.along``), which
the fit's trace family sizes every replayed batch with: worked by hand where it is not affine,
equal to the rule at the shapes of every batch across its branches, and the family's sizes equal
to a real trace's at a batch it never saw."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from memcalc.fields import build_step
from memcalc.targets.cuda import cudnn
from memcalc.targets.cuda.cudnn import ConvDirection, ConvWorkspaceRule, WorkspaceLine

H100, A100, T4 = (9, 0), (8, 0), (7, 5)


def rule(direction: ConvDirection, dtype: torch.dtype = torch.float16, stride: tuple[int, int] = (1, 1),
         groups: int = 1, cc: tuple[int, int] = H100, sm_count: int = 132) -> ConvWorkspaceRule:
    return ConvWorkspaceRule(4, dtype, stride, groups, direction, cc, sm_count)


def batch_line(x: tuple[int, ...], w: tuple[int, ...], y: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Arguments ``x, w, y`` at batch 0 and their slopes: x and y grow by one image a batch."""
    return (0, *x[1:], *w, 0, *y[1:]), (1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0)


def test_a_1x1_weight_gradient_switches_from_per_image_dw_to_the_copies_between_batches_2_and_3() -> None:
    # 256 -> 256 1x1 at 14x14 (196 pixels: one GEMM per image), fp16: per image dW 256·256·4 = 262,144 B;
    # the copies x + w + y = B·2·256·196·2 + 256·256·2 = 200,704·B + 131,072
    intercepts, slopes = batch_line((0, 256, 14, 14), (256, 256, 1, 1), (0, 256, 14, 14))
    line = rule(ConvDirection.BACKWARD_FILTER).along(intercepts, slopes)
    assert line == WorkspaceLine(0, 262_144, 131_072, 200_704)
    assert [line.at(b) for b in (1, 2, 3, 4)] == [262_144, 524_288, 733_184, 933_888]
    # the forward and the input gradient take that engine without a workspace
    assert rule(ConvDirection.FORWARD).along(intercepts, slopes) == WorkspaceLine(0, 0)


def test_the_rgb_stems_fp32_weight_gradient_splits_by_output_rows_up_to_120() -> None:
    # 7x7, 3 -> 64, stride 2, 224 -> 112, fp32: x per image 3·224²·4 = 602,112 B (padded to 4 channels:
    # 802,816), w 64·3·49·4 = 37,632 B (padded: 50,176), y per image 64·112²·4 = 3,211,264 B, the padded
    # fp32 dW 50,176 B; splits min(120, B·112² // 348): 36 at batch 1, 72 at 2, 120 from batch 4 (144)
    intercepts, slopes = batch_line((0, 3, 224, 224), (64, 3, 7, 7), (0, 64, 112, 112))
    line = rule(ConvDirection.BACKWARD_FILTER, torch.float32, stride=(2, 2)).along(intercepts, slopes)
    assert line is not None
    copies = 802_816 + 3_211_264  # per image
    assert line.at(1) == copies + 50_176 + 16 + 36 * 50_176
    assert line.at(2) == 2 * copies + 50_176 + 16 + 72 * 50_176
    assert line.at(64) == 64 * copies + 50_176 + 16 + 120 * 50_176 == 262_972_432  # test_kernels' worked figure


def test_a_slope_outside_the_batch_dimensions_is_left_to_the_rule() -> None:
    # an image size that grows with the batch changes which engine runs: no line, the family applies the rule
    intercepts = (0, 256, 14, 14, 256, 256, 1, 1, 0, 256, 14, 14)
    assert rule(ConvDirection.FORWARD).along(intercepts, (1, 0, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1)) is None
    # a 7x7 stem (C = 3 < 8: its copies padded to 4 channels, x's bytes // C · 4) whose x has 5 channels of
    # one pixel: 20 B per image, 20·B // 3 is not on a line
    stem = ConvWorkspaceRule(4, torch.float32, (2, 2), 1, ConvDirection.BACKWARD_FILTER, H100, 132)
    assert stem.along((0, 5, 1, 1, 8, 3, 7, 7, 0, 8, 1, 1), (1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0)) is None


CHANNELS = ((3, 64), (64, 3), (64, 128), (128, 64), (256, 512), (512, 512), (32, 2048))
FILTERS = ((1, 1), (3, 3), (7, 7), (2, 2))
IMAGES = (5, 14, 56)


# quick: a half-precision branch on Hopper and fp32 on Turing; fp32 on Ampere and bf16 on Hopper in the full suite
@pytest.mark.quick_cases("fp16-h100", "fp32-t4")
@pytest.mark.parametrize(("dtype", "cc"), [(torch.float16, H100), (torch.float32, A100), (torch.float32, T4),
                                           (torch.bfloat16, H100)],
                         ids=["fp16-h100", "fp32-a100", "fp32-t4", "bf16-h100"])
def test_the_line_is_the_rule_at_every_batch_in_every_branch(dtype: torch.dtype, cc: tuple[int, int]) -> None:
    seen: set[int] = set()
    for (c, k), (r, s), image, stride, direction, groups in itertools.product(
            CHANNELS, FILTERS, IMAGES, (1, 2), ConvDirection, (1, 2)):
        if c % groups or k % groups:
            continue
        out = (image - r) // stride + 1
        w = (k, c // groups, r, s)
        for x_per, y_per in (((c, image, image), (k, out, out)), ((k, out, out), (c, image, image))):  # transposed
            site = ConvWorkspaceRule(4, dtype, (stride, stride), groups, direction, cc, 108)
            intercepts, slopes = (3, *x_per, *w, 3, *y_per), (2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0)
            line = site.along(intercepts, slopes)
            if line is None:
                continue
            for batch in range(12):
                shapes = tuple(a + b * batch for a, b in zip(intercepts, slopes, strict=True))
                assert line.at(batch) == site(shapes) == cudnn.conv_workspace_bytes(
                    shapes[:4], shapes[4:8], shapes[8:], dtype, (stride, stride), (0, 0), (1, 1), groups, direction,
                    cc, sm_count=108), (w, x_per, y_per, direction, batch)
                seen.add(line.at(batch))
    if cc == T4 and dtype == torch.float32:
        assert seen == {0}  # no tensor cores for fp32 before Ampere: no workspace
    else:
        assert len(seen) > 100  # the grid reaches many distinct sizes, not a handful of zeros


class _ConvNet(nn.Module):
    """Each class of call the rule knows: the 7x7 RGB stem, a strided 1x1, 1x1 GEMMs per image at 14x14
    whose weight gradients switch engines with the batch, a 3x3, a 64 -> 128 forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 7, stride=2, padding=3)
        self.up = nn.Conv2d(64, 128, 3, padding=1)
        self.down = nn.Conv2d(128, 256, 1, stride=2)
        self.gemm = nn.Conv2d(256, 256, 1)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(self.down(self.up(self.stem(x)))).relu()
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16"])
def test_the_family_sizes_its_convolution_workspaces_as_a_real_trace_does(precision: str) -> None:
    from memcalc.search.affine import AffineFamily
    from memcalc.sources.resolve import resolve
    from memcalc.targets.backend import trace_step

    step = build_step(optimizer="sgd", gpu="h100-80gb", precision=precision)

    def traced(batch: int):  # type: ignore[no-untyped-def]
        return trace_step(resolve(_ConvNet(), batch_size=batch, input_shape=(3, 56, 56)), step)

    family = AffineFamily.from_traces(traced(1), 1, traced(4), 4)
    assert family is not None
    lines, uids, _ = family._lined_groups
    convs = [uid for uid, site, _, _ in family.sized if isinstance(site, ConvWorkspaceRule)]
    assert len(lines) >= 10 and sorted(uids.tolist()) == sorted(convs)  # every convolution on a line
    for batch in (2, 3, 7):
        real = traced(batch)
        assert family.nbytes(batch) == real.trace.nbytes  # every storage's size, the workspaces included
        assert family.matches(real, batch)

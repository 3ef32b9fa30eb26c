"""U-Net (Ronneberger et al. 2015) as implemented in milesial/Pytorch-UNet, the common PyTorch port.

Four downsampling stages 64-128-256-512-1024, each a :class:`DoubleConv` (two 3x3 conv + BN +
ReLU), and four up stages with transposed-convolution upsampling (``bilinear=False``) and
skip concatenation. Unlike the paper, the 3x3 convolutions are padded, so the output
keeps the input's size; odd sizes are handled by padding the upsampled map before the
concatenation (``F.pad``), exactly as milesial does.

The default input is the paper's 572x572 tile (3 channels); with padded convs the logits
are ``(B, 2, 572, 572)``, trained with per-pixel cross-entropy against ``(B, 572, 572)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register


class DoubleConv(nn.Module):
    """(3x3 conv, no bias → BN → ReLU) x 2, under ``double_conv``."""

    def __init__(self, in_channels: int, out_channels: int, mid_channels: int | None = None):
        super().__init__()
        mid = mid_channels or out_channels
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, mid, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.double_conv(x)
        return out


class Down(nn.Module):
    """2x2 max pool, then :class:`DoubleConv`."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.maxpool_conv(x)
        return out


class Up(nn.Module):
    """2x2 transposed conv halving the channels, pad to the skip's size, concat, :class:`DoubleConv`."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        x1 = self.up(x1)
        dy = x2.shape[2] - x1.shape[2]
        dx = x2.shape[3] - x1.shape[3]
        x1 = F.pad(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        out: Tensor = self.conv(torch.cat([x2, x1], dim=1))
        return out


class OutConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.conv(x)
        return out


class UNet(nn.Module):
    def __init__(self, n_channels: int = 3, n_classes: int = 2):
        super().__init__()
        self.n_channels = n_channels
        self.n_classes = n_classes
        self.inc = DoubleConv(n_channels, 64)
        self.down1 = Down(64, 128)
        self.down2 = Down(128, 256)
        self.down3 = Down(256, 512)
        self.down4 = Down(512, 1024)
        self.up1 = Up(1024, 512)
        self.up2 = Up(512, 256)
        self.up3 = Up(256, 128)
        self.up4 = Up(128, 64)
        self.outc = OutConv(64, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x = self.up1(self.down4(x4), x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        logits: Tensor = self.outc(self.up4(x, x1))
        return logits


register(
    ZooEntry(
        name="unet",
        family="unet",
        builder=lambda shape: UNet(n_channels=shape[0], n_classes=2),
        input_kind=InputKind.IMAGE,
        default_shape=(3, 572, 572),
        loss=LossKind.CROSS_ENTROPY,
        reference_parameters=31_037_698,
        description="U-Net (Ronneberger 2015) as milesial/Pytorch-UNet: 64-1024 channels, BN, "
                    "transposed-conv upsampling, 3 in / 2 classes, 31,037,698 parameters; "
                    "padded convs, so 572x572 in → 572x572 logits",
        aliases=("u-net",),
    )
)

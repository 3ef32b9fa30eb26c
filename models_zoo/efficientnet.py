"""EfficientNet-B0, layer for layer as torchvision's ``torchvision.models.efficientnet``.

``features`` holds the stem, seven stages (each an ``nn.Sequential`` of MBConv blocks, so
paths read ``features.3.0.block.1``) and the head conv. Residual branches pass through
:class:`StochasticDepth` exactly like torchvision's, which matters for memory: in training
it draws a per-sample Bernoulli mask and multiplies, one more activation per block.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from .mobilenet import Conv2dNormActivation, SqueezeExcitation, make_divisible
from .registry import InputKind, LossKind, ZooEntry, register


class StochasticDepth(nn.Module):
    """``torchvision.ops.StochasticDepth`` in "row" mode: drop whole samples of a residual branch.

    The mask is created with ``torch.empty(..., device=x.device)`` so it follows the input
    (meta stays meta).
    """

    def __init__(self, p: float, mode: str = "row"):
        super().__init__()
        if mode not in ("row", "batch"):
            raise ValueError(f"mode must be 'row' or 'batch', got {mode!r}")
        self.p = p
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        size = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(survival)
        if survival > 0.0:
            noise.div_(survival)
        return x * noise

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"


class MBConv(nn.Module):
    """1x1 expand (SiLU) → kxk depthwise (SiLU) → SE → 1x1 project, under ``block``."""

    def __init__(self, expand_ratio: float, kernel: int, stride: int, cin: int, cout: int,
                 stochastic_depth_prob: float):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = make_divisible(cin * expand_ratio, 8)
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, kernel_size=1, activation_layer=nn.SiLU))
        layers.append(Conv2dNormActivation(expanded, expanded, kernel_size=kernel, stride=stride, groups=expanded,
                                           activation_layer=nn.SiLU))
        layers.append(SqueezeExcitation(expanded, max(1, cin // 4), activation=partial(nn.SiLU, inplace=True)))
        layers.append(Conv2dNormActivation(expanded, cout, kernel_size=1, activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")
        self.out_channels = cout

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


# expand ratio, kernel, stride, in, out, repeats: B0 (width and depth multipliers 1.0).
StageSetting = tuple[float, int, int, int, int, int]
_B0: list[StageSetting] = [
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
]


class EfficientNet(nn.Module):
    def __init__(self, setting: list[StageSetting], dropout: float = 0.2, stochastic_depth_prob: float = 0.2,
                 num_classes: int = 1000, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = [
            Conv2dNormActivation(in_channels, setting[0][3], stride=2, activation_layer=nn.SiLU)
        ]
        total_blocks = sum(cfg[5] for cfg in setting)
        block_id = 0
        for expand, kernel, stride, cin, cout, repeats in setting:
            stage: list[nn.Module] = []
            for i in range(repeats):
                # Drop probability grows linearly with depth, as in torchvision.
                sd_prob = stochastic_depth_prob * block_id / total_blocks
                stage.append(MBConv(expand, kernel, stride if i == 0 else 1, cin if i == 0 else cout, cout, sd_prob))
                block_id += 1
            layers.append(nn.Sequential(*stage))
        last_in = setting[-1][4]
        last_out = 4 * last_in
        layers.append(Conv2dNormActivation(last_in, last_out, kernel_size=1, activation_layer=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(last_out, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x)).flatten(1)
        logits: Tensor = self.classifier(x)
        return logits


register(
    ZooEntry(
        name="efficientnet_b0",
        family="efficientnet",
        builder=lambda shape: EfficientNet(_B0, in_channels=shape[0]),
        input_kind=InputKind.IMAGE,
        default_shape=(3, 224, 224),
        loss=LossKind.CROSS_ENTROPY,
        reference_parameters=5_288_548,
        description="torchvision efficientnet_b0, stochastic depth 0.2 (ImageNet, 1000 classes)",
        block_containers=("features",),
    )
)

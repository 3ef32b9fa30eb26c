"""MobileNetV2 and MobileNetV3-Large, layer for layer as torchvision's ``mobilenetv2`` / ``mobilenetv3``.

Also home of the two building blocks torchvision keeps in ``torchvision.ops.misc``
(:class:`Conv2dNormActivation`, :class:`SqueezeExcitation`) and ``_make_divisible``, which
EfficientNet reuses. Module names match torchvision (``features.3.block.1``,
``features.4.block.2.fc1``) so reported peak locations read the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register

ModuleFactory = Callable[..., nn.Module]


def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round channels to a multiple of ``divisor`` without dropping more than 10% (torchvision)."""
    min_value = divisor if min_value is None else min_value
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """Conv → norm → activation as ``torchvision.ops.Conv2dNormActivation`` (indices 0, 1, 2).

    The convolution has no bias when a norm follows (the norm's shift makes it redundant);
    the activation runs in place, as in torchvision.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 groups: int = 1, norm_layer: ModuleFactory | None = nn.BatchNorm2d,
                 activation_layer: ModuleFactory | None = nn.ReLU, dilation: int = 1):
        padding = (kernel_size - 1) // 2 * dilation
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation=dilation,
                      groups=groups, bias=norm_layer is None)
        ]
        if norm_layer is not None:
            layers.append(norm_layer(out_channels))
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)
        self.out_channels = out_channels


class SqueezeExcitation(nn.Module):
    """``torchvision.ops.SqueezeExcitation``: global pool → 1x1 → act → 1x1 → gate, times input."""

    def __init__(self, input_channels: int, squeeze_channels: int,
                 activation: ModuleFactory = nn.ReLU, scale_activation: ModuleFactory = nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, x: Tensor) -> Tensor:
        scale = self.fc2(self.activation(self.fc1(self.avgpool(x))))
        return cast(Tensor, self.scale_activation(scale) * x)  # a module call is untyped (Any)


# --------------------------------------------------------------------------- MobileNetV2


class InvertedResidualV2(nn.Module):
    """V2 block: 1x1 expand (ReLU6) → 3x3 depthwise (ReLU6) → 1x1 linear project, under ``conv``."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = round(inp * expand_ratio)
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden, kernel_size=1, activation_layer=nn.ReLU6))
        layers += [
            Conv2dNormActivation(hidden, hidden, stride=stride, groups=hidden, activation_layer=nn.ReLU6),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, x + self.conv(x) if self.use_res_connect else self.conv(x))


# t (expansion), c (channels), n (repeats), s (first stride): the paper's Table 2.
_V2_SETTING = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.2):
        super().__init__()
        channels, last_channel = 32, 1280
        features: list[nn.Module] = [
            Conv2dNormActivation(in_channels, channels, stride=2, activation_layer=nn.ReLU6)
        ]
        for t, c, n, s in _V2_SETTING:
            for i in range(n):
                features.append(InvertedResidualV2(channels, c, s if i == 0 else 1, expand_ratio=t))
                channels = c
        features.append(Conv2dNormActivation(channels, last_channel, kernel_size=1, activation_layer=nn.ReLU6))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(last_channel, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1)).flatten(1)
        logits: Tensor = self.classifier(x)
        return logits


# --------------------------------------------------------------------------- MobileNetV3


def _bn_v3(channels: int) -> nn.BatchNorm2d:
    """V3 uses TensorFlow-like batch-norm settings."""
    return nn.BatchNorm2d(channels, eps=0.001, momentum=0.01)


def _hard_se(channels: int, squeeze: int) -> SqueezeExcitation:
    return SqueezeExcitation(channels, squeeze, scale_activation=nn.Hardsigmoid)


class InvertedResidualV3(nn.Module):
    """V3 bneck: optional 1x1 expand → kxk depthwise → optional SE → 1x1 project, under ``block``."""

    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, use_se: bool, use_hs: bool,
                 stride: int):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        act = nn.Hardswish if use_hs else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, kernel_size=1, norm_layer=_bn_v3, activation_layer=act))
        layers.append(Conv2dNormActivation(expanded, expanded, kernel_size=kernel, stride=stride, groups=expanded,
                                           norm_layer=_bn_v3, activation_layer=act))
        if use_se:
            layers.append(_hard_se(expanded, make_divisible(expanded // 4, 8)))
        layers.append(Conv2dNormActivation(expanded, cout, kernel_size=1, norm_layer=_bn_v3, activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.out_channels = cout

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.block(x)
        if self.use_res_connect:
            result += x
        return result


# in, kernel, expanded, out, SE, hard-swish, stride: torchvision's "mobilenet_v3_large" table.
V3Setting = tuple[int, int, int, int, bool, bool, int]
_V3_LARGE: list[V3Setting] = [
    (16, 3, 16, 16, False, False, 1),
    (16, 3, 64, 24, False, False, 2),
    (24, 3, 72, 24, False, False, 1),
    (24, 5, 72, 40, True, False, 2),
    (40, 5, 120, 40, True, False, 1),
    (40, 5, 120, 40, True, False, 1),
    (40, 3, 240, 80, False, True, 2),
    (80, 3, 200, 80, False, True, 1),
    (80, 3, 184, 80, False, True, 1),
    (80, 3, 184, 80, False, True, 1),
    (80, 3, 480, 112, True, True, 1),
    (112, 3, 672, 112, True, True, 1),
    (112, 5, 672, 160, True, True, 2),
    (160, 5, 960, 160, True, True, 1),
    (160, 5, 960, 160, True, True, 1),
]


class MobileNetV3(nn.Module):
    def __init__(self, setting: list[V3Setting], last_channel: int, num_classes: int = 1000,
                 in_channels: int = 3, dropout: float = 0.2):
        super().__init__()
        layers: list[nn.Module] = [
            Conv2dNormActivation(in_channels, setting[0][0], stride=2, norm_layer=_bn_v3,
                                 activation_layer=nn.Hardswish)
        ]
        layers += [InvertedResidualV3(*cfg) for cfg in setting]
        last_in = setting[-1][3]
        last_out = 6 * last_in
        layers.append(Conv2dNormActivation(last_in, last_out, kernel_size=1, norm_layer=_bn_v3,
                                           activation_layer=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(last_out, last_channel),
            nn.Hardswish(inplace=True),
            nn.Dropout(p=dropout, inplace=True),
            nn.Linear(last_channel, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x)).flatten(1)
        logits: Tensor = self.classifier(x)
        return logits


register(
    ZooEntry(
        name="mobilenet_v2",
        family="mobilenet",
        builder=lambda shape: MobileNetV2(in_channels=shape[0]),
        input_kind=InputKind.IMAGE,
        default_shape=(3, 224, 224),
        loss=LossKind.CROSS_ENTROPY,
        reference_parameters=3_504_872,
        description="torchvision mobilenet_v2, width 1.0 (ImageNet, 1000 classes)",
        block_containers=("features",),
    )
)

register(
    ZooEntry(
        name="mobilenet_v3_large",
        family="mobilenet",
        builder=lambda shape: MobileNetV3(_V3_LARGE, last_channel=1280, in_channels=shape[0]),
        input_kind=InputKind.IMAGE,
        default_shape=(3, 224, 224),
        loss=LossKind.CROSS_ENTROPY,
        reference_parameters=5_483_032,
        description="torchvision mobilenet_v3_large, width 1.0, SE + Hardswish (ImageNet, 1000 classes)",
        block_containers=("features",),
    )
)

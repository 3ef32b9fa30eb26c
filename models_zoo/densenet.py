"""DenseNet-121, layer for layer as torchvision's ``torchvision.models.densenet`` (memory_efficient=False).

Each dense layer concatenates *all* earlier feature maps of its block with ``torch.cat``
before its bottleneck: that per-layer concatenation (quadratic in block depth) is what makes
DenseNet's activation memory notorious, and why it is in the zoo. Module names match
torchvision (``features.denseblock3.denselayer7.conv2``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 (bottleneck to ``bn_size * growth``) then BN-ReLU-3x3 to ``growth`` channels.

    Takes the *list* of earlier feature maps, like torchvision's ``_DenseLayer``.
    """

    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int, drop_rate: float):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)
        self.drop_rate = float(drop_rate)

    def forward(self, inputs: list[Tensor] | Tensor) -> Tensor:
        prev = [inputs] if isinstance(inputs, Tensor) else inputs
        bottleneck = self.conv1(self.relu1(self.norm1(torch.cat(prev, 1))))
        out: Tensor = self.conv2(self.relu2(self.norm2(bottleneck)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        return out


class DenseBlock(nn.ModuleDict):
    """``denselayer1..N``; every layer sees the concatenation of the block input and all earlier outputs."""

    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int,
                 drop_rate: float):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}",
                            DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size, drop_rate))

    def forward(self, init_features: Tensor) -> Tensor:
        features = [init_features]
        for layer in self.values():
            # a copy: a checkpointed layer recomputes in backward with the list as it was then
            features.append(layer(list(features)))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """BN-ReLU-1x1 halving the channels, then 2x2 average pool."""

    def __init__(self, num_input_features: int, num_output_features: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, stride=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    def __init__(self, growth_rate: int = 32, block_config: tuple[int, ...] = (6, 12, 24, 16),
                 num_init_features: int = 64, bn_size: int = 4, drop_rate: float = 0.0,
                 num_classes: int = 1000, in_channels: int = 3):
        super().__init__()
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(in_channels, num_init_features, kernel_size=7, stride=2, padding=3, bias=False)),
            ("norm0", nn.BatchNorm2d(num_init_features)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]))
        channels = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}",
                                     DenseBlock(num_layers, channels, bn_size, growth_rate, drop_rate))
            channels += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(channels, channels // 2))
                channels //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(channels))
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.features(x), inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1)).flatten(1)
        logits: Tensor = self.classifier(out)
        return logits


register(
    ZooEntry(
        name="densenet121",
        family="densenet",
        builder=lambda shape: DenseNet(in_channels=shape[0]),
        input_kind=InputKind.IMAGE,
        default_shape=(3, 224, 224),
        loss=LossKind.CROSS_ENTROPY,
        reference_parameters=7_978_856,
        description="torchvision densenet121, growth 32, blocks 6-12-24-16, memory_efficient=False "
                    "(ImageNet, 1000 classes)",
        # Items are dense layers; note each takes the block's *list* of earlier feature maps.
        block_containers=tuple(f"features.denseblock{i}" for i in range(1, 5)),
    )
)

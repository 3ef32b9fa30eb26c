"""ResNet-18/34/50/101/152, layer for layer as torchvision's ``torchvision.models.resnet``.

Same module names (``conv1``, ``layer4.2.conv3``, ``fc``) and parameter counts, so peaks are
reported at the same module paths a torchvision user sees.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        result: Tensor = self.relu(out)
        return result


class Bottleneck(nn.Module):
    """torchvision's V1.5 bottleneck: the stride sits on the 3x3 convolution."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        result: Tensor = self.relu(out)
        return result


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], num_classes: int = 1000,
                 in_channels: int = 3):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x).flatten(1)
        logits: Tensor = self.fc(x)
        return logits


# block, blocks per stage, reference count.
_CONFIGS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], list[int], int]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2], 11_689_512),
    "resnet34": (BasicBlock, [3, 4, 6, 3], 21_797_672),
    "resnet50": (Bottleneck, [3, 4, 6, 3], 25_557_032),
    "resnet101": (Bottleneck, [3, 4, 23, 3], 44_549_160),
    "resnet152": (Bottleneck, [3, 8, 36, 3], 60_192_808),
}


def _build(block: type[BasicBlock] | type[Bottleneck], layers: list[int], shape: tuple[int, ...]) -> ResNet:
    return ResNet(block, layers, in_channels=shape[0])


for _name, (_block, _layers, _count) in _CONFIGS.items():
    register(
        ZooEntry(
            name=_name,
            family="resnet",
            builder=partial(_build, _block, _layers),
            input_kind=InputKind.IMAGE,
            default_shape=(3, 224, 224),
            loss=LossKind.CROSS_ENTROPY,
            reference_parameters=_count,
            description=f"torchvision {_name} (ImageNet, 1000 classes)",
            block_containers=("layer1", "layer2", "layer3", "layer4"),
        )
    )

"""VGG-11/16/19 (no batch norm), layer for layer as torchvision's ``torchvision.models.vgg``.

Same ``features`` / ``avgpool`` / ``classifier`` layout and indices (``features.28``,
``classifier.6``) so module paths in reports read like a torchvision user's. VGG is the
zoo's "huge fully connected head" case: ~120M of its ~138M parameters sit in the classifier.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register

# torchvision's cfgs: channel counts, "M" = 2x2 max pool.
_CFGS: dict[str, list[int | str]] = {
    "A": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "D": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    "E": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
          512, 512, 512, 512, "M"],
}


def _make_features(cfg: list[int | str], in_channels: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = in_channels
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            assert isinstance(v, int)
            layers += [nn.Conv2d(channels, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            channels = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    def __init__(self, cfg: list[int | str], num_classes: int = 1000, in_channels: int = 3,
                 dropout: float = 0.5):
        super().__init__()
        self.features = _make_features(cfg, in_channels)
        # Adaptive pooling to 7x7 makes the classifier size independent of the input size.
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x)).flatten(1)
        logits: Tensor = self.classifier(x)
        return logits


_CONFIGS = {
    "vgg11": ("A", 132_863_336),
    "vgg16": ("D", 138_357_544),
    "vgg19": ("E", 143_667_240),
}


def _build(cfg: str, shape: tuple[int, ...]) -> VGG:
    return VGG(_CFGS[cfg], in_channels=shape[0])


for _name, (_cfg, _count) in _CONFIGS.items():
    register(
        ZooEntry(
            name=_name,
            family="vgg",
            builder=partial(_build, _cfg),
            input_kind=InputKind.IMAGE,
            default_shape=(3, 224, 224),
            loss=LossKind.CROSS_ENTROPY,
            reference_parameters=_count,
            description=f"torchvision {_name} without batch norm (ImageNet, 1000 classes)",
            # ``features`` is a flat list of single convs/ReLUs/pools, not blocks: nothing
            # sensible to checkpoint item by item.
        )
    )

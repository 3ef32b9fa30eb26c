"""Small fully connected models: the design brief's worked example and a 3-layer MLP."""

from __future__ import annotations

from torch import nn

from .registry import InputKind, LossKind, ZooEntry, register


def mlp(in_features: int = 784, hidden: int = 1024, num_classes: int = 10) -> nn.Sequential:
    """784 → 1024 → 1024 → 10 with ReLU: the classic MNIST-sized MLP."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def _features(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


register(
    ZooEntry(
        name="mlp",
        family="mlp",
        builder=lambda shape: mlp(_features(shape)),
        input_kind=InputKind.FEATURES,
        default_shape=(784,),
        loss=LossKind.CROSS_ENTROPY,
        reference_parameters=784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10,
        description="3-layer MLP 784-1024-1024-10 with ReLU (MNIST-sized)",
    )
)

register(
    ZooEntry(
        name="fc-32-16",
        family="mlp",
        builder=lambda shape: nn.Linear(_features(shape), 16, bias=False),
        input_kind=InputKind.FEATURES,
        default_shape=(32,),
        loss=LossKind.MEAN,
        reference_parameters=32 * 16,
        description="one Linear(32, 16, bias=False): the design brief's worked example",
    )
)

"""memcalc's model zoo: architectures in plain torch, registered by name.

Importing this package registers every entry. Models are always built on the current
default device, so ``with torch.device("meta"): entry.build()`` allocates nothing.
"""

# Each import registers that module's entries.
from . import (  # noqa: F401  (registration side effect)
    bert,
    densenet,
    efficientnet,
    gemma2,
    gpt2,
    llama,
    mlp,
    mobilenet,
    registry,
    resnet,
    rnn,
    unet,
    vgg,
    vit,
)
from .registry import InputKind, LossKind, ZooEntry, closest, entries, get, names

__all__ = ("InputKind", "LossKind", "ZooEntry", "closest", "entries", "get", "names", "registry")

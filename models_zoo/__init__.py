"""memcalc's model zoo: architectures in plain torch, registered by name.

Importing this package registers every entry. Models are always built on the current
default device, so ``with torch.device("meta"): entry.build()`` allocates nothing.
"""

from . import registry
from .registry import InputKind, LossKind, ZooEntry, closest, entries, get, names

# Each import registers that module's entries.
from . import (  # noqa: E402,F401  (registration side effect)
    bert,
    densenet,
    efficientnet,
    gpt2,
    llama,
    mlp,
    mobilenet,
    resnet,
    rnn,
    unet,
    vgg,
    vit,
)

__all__ = ("InputKind", "LossKind", "ZooEntry", "closest", "entries", "get", "names", "registry")

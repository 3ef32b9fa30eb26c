"""memcalc's model zoo: architectures in plain torch, registered by name.

Importing this package registers every entry. Models are always built on the current
default device, so ``with torch.device("meta"): entry.build()`` allocates nothing. The language
models also carry their released Hugging Face config (``entry.hf``), which memcalc builds
transformers' model from where transformers is installed (``torch:NAME`` keeps this package's
definition).
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
    moe,
    registry,
    resnet,
    rnn,
    unet,
    vgg,
    vit,
)
from .registry import TORCH_PREFIX, HfConfig, InputKind, LossKind, ZooEntry, closest, entries, get, names, plain_torch

__all__ = ("TORCH_PREFIX", "HfConfig", "InputKind", "LossKind", "ZooEntry", "closest", "entries", "get", "names",
           "plain_torch", "registry")

"""A Hugging Face model's gradient checkpointing, as ``Trainer(gradient_checkpointing=True)`` and
``prepare_model_for_kbit_training`` turn it on: transformers' own
``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before transformers 5.2x)
run on the meta model, with memcalc's checkpoint function in place of torch's.

What running transformers' code brings, beyond wrapping the decoder layers (transformers 5.24,
``modeling_layers.py`` and ``modeling_utils.py``):

- each ``GradientCheckpointingLayer`` runs through ``_gradient_checkpointing_func`` with its
  cache removed (``cache=None``, ``use_cache=False``): a checkpointed layer keeps no keys and
  values, where a layer wrapped from outside writes them into the ``DynamicCache`` the model
  makes in training too (measured on the QLoRA harness case: 1.0 MiB of keys and values alive
  at the loss, +0.37%);
- ``enable_input_require_grads()`` for a token model: the input embeddings' output requires a
  gradient, so backward runs down to it.

memcalc's function (:func:`memcalc.engine.prepare.checkpointed`) is
``torch.utils.checkpoint.checkpoint`` with the recomputation under memcalc's emulated autocast
region: non-reentrant, as transformers 5 does by default (``{"use_reentrant": False}``), or
reentrant where the step asks (``gradient_checkpointing_kwargs={"use_reentrant": True}``; TRL's
PEFT + ZeRO-3), with the same ``use_reentrant`` handed to transformers' enable. The input
embeddings' ``requires_grad`` hook that reentrance needs (a reentrant block whose inputs need no
gradient gives its parameters none) is transformers' own, set for every token model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from memcalc.engine.model import CheckpointFn
from memcalc.engine.prepare import is_reentrant

__all__ = ("hf_checkpointing", "supports_checkpointing")

#: The class of transformers' checkpointable decoder and encoder layers.
_LAYER_CLASS = "GradientCheckpointingLayer"
#: The attribute of a module that holds the function its layers are checkpointed with.
_FUNCTION = "_gradient_checkpointing_func"


def supports_checkpointing(module: nn.Module) -> bool:
    """Whether the model's class declares gradient checkpointing (``supports_gradient_checkpointing``)."""
    return bool(getattr(module, "supports_gradient_checkpointing", False))


def hf_checkpointing(module: nn.Module, checkpoint: CheckpointFn,
                     chosen: Callable[[int], bool] = lambda index: True) -> int:
    """Turn on ``module``'s gradient checkpointing with ``checkpoint`` as its function, in the
    layers ``chosen`` by their index (every Nth: the others' ``gradient_checkpointing`` turned
    back off, the flag each ``GradientCheckpointingLayer`` reads in its ``__call__``).

    Returns:
        The number of layers checkpointed (transformers' ``GradientCheckpointingLayer`` s).
    """
    enable = getattr(module, "activation_checkpointing_enable", None)
    kwargs = {"use_reentrant": is_reentrant(checkpoint)}
    with warnings.catch_warnings():
        # transformers' deprecation notices of its own older names, reached from its code: not the user's concern
        warnings.filterwarnings("ignore", category=FutureWarning)
        if callable(enable):
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            module.gradient_checkpointing_enable(  # type: ignore[operator]  # PreTrainedModel's
                gradient_checkpointing_kwargs=kwargs)
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        # what the recipes write (model.config.use_cache = False), and what transformers forces in a
        # checkpointed training forward anyway; it spares the user transformers' warning that it does
        config.use_cache = False
    layers = index = 0
    for sub in module.modules():
        if hasattr(sub, _FUNCTION):
            setattr(sub, _FUNCTION, checkpoint)
        if getattr(sub, "gradient_checkpointing", False) and any(c.__name__ == _LAYER_CLASS for c in type(sub).__mro__):
            checkpointed = chosen(index)
            setattr(sub, "gradient_checkpointing", checkpointed)  # noqa: B010  # Module's __setattr__ is typed for tensors
            index += 1
            layers += checkpointed
    return layers

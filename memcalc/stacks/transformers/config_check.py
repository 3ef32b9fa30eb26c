"""A Hugging Face config checked before transformers builds a model from it: the fields that
size the model, the dtype it names and the class its ``architectures`` names.

transformers checks few of them itself: ``num_attention_heads: 0`` ends in a
``ZeroDivisionError`` inside the attention's ``__init__``, ``num_hidden_layers: -1`` in a
forward over no layers, an unknown ``torch_dtype`` in an ``AttributeError`` on ``torch``, a
string where an integer belongs in a dataclass validation error, and an unknown
``architectures`` class in nothing at all (``AutoModelForCausalLM`` builds another class). Each
is refused here with one message naming the field: "transformers cannot build the config of
hf:...: FIELD ...".
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from memcalc.core.errors import InvalidInputError

__all__ = ("SIZE_FIELDS", "check_architecture", "check_config", "check_config_file", "check_config_values",
           "config_error")

#: Fields that size a model, across the config classes of transformers: each an integer, at
#: least the minimum (a layer count may be 0; a head count, a width or a vocabulary may not).
SIZE_FIELDS: Mapping[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers", "num_encoder_layers",
                     "decoder_layers", "encoder_layers"), 0),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "hidden_size", "n_embd", "d_model", "intermediate_size", "d_ff",
                     "d_kv", "head_dim", "vocab_size", "max_position_embeddings", "n_positions"), 1),
}

#: The config fields that name the dtype of the weights (``dtype`` in transformers 5, ``torch_dtype`` before).
DTYPE_FIELDS = ("torch_dtype", "dtype")


def config_error(spec: str, problem: str, hint: str | None = None) -> InvalidInputError:
    """The one message of a config transformers cannot build: its source, then the problem."""
    return InvalidInputError(f"transformers cannot build the config of {spec}: {problem}",
                             hint=hint or "Fix that field of the config.json.")


def check_config_file(path: Path, spec: str) -> None:
    """The values of the ``config.json`` at ``path``, checked before transformers reads them
    (:func:`check_config_values`). A file that is not a JSON object is left to transformers,
    whose error names it."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(values, dict):
        check_config_values(values, spec)


def check_config_values(values: Mapping[str, Any], spec: str) -> None:
    """Each size field an integer in its range and the dtype a torch dtype's name; else
    :func:`config_error` naming the field."""
    for name, minimum in SIZE_FIELDS.items():
        value = values.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise config_error(spec, f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        if value < minimum:
            raise config_error(spec, f"{name} must be at least {minimum}, got {value}")
    for name in DTYPE_FIELDS:
        _check_dtype(values.get(name), name, spec)


def _check_dtype(value: object, name: str, spec: str) -> None:
    """``value`` None, a ``torch.dtype`` or the name of one (``"bfloat16"``, ``"torch.float16"``)."""
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return
    known = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))
    if isinstance(value, str) and value.removeprefix("torch.") in known:
        return
    close = difflib.get_close_matches(str(value).removeprefix("torch."), known, n=1)
    raise config_error(spec, f"{name} {value!r} is not a torch dtype"
                       + (f"; did you mean {close[0]!r}?" if close else ""),
                       hint="e.g. \"bfloat16\", \"float16\" or \"float32\".")


def check_config(transformers: ModuleType, config: Any, spec: str) -> None:
    """The config as transformers read it (its class's defaults filled in): its values
    (:func:`check_config_values`), an encoder-decoder's ``decoder_start_token_id`` (which the
    model's ``_shift_right`` needs to make decoder inputs from the labels), and the class its
    ``architectures`` names (:func:`check_architecture`)."""
    check_config_values(config.to_dict(), spec)
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", 0) is None:
        raise config_error(spec, "decoder_start_token_id is not set: an encoder-decoder model shifts the labels "
                                 "right and starts its decoder inputs with it",
                           hint="Add decoder_start_token_id (T5: 0, the pad token) to the config.json.")
    check_architecture(transformers, config, spec)


def check_architecture(transformers: ModuleType, config: Any, spec: str) -> None:
    """The class the config's ``architectures`` names first exists in the installed
    transformers; else :func:`config_error` naming it and the closest class (rather than
    building another class in its place)."""
    names = getattr(config, "architectures", None) or ()
    if not names:
        return
    model_class = getattr(transformers, str(names[0]), None)
    if isinstance(model_class, type) and issubclass(model_class, torch.nn.Module):
        return
    model_type = str(getattr(config, "model_type", "") or "").replace("_", "").lower()
    candidates = [n for n in dir(transformers) if n.endswith(("Model", "LMHeadModel")) or "For" in n]
    same_type = [n for n in candidates if n.lower().startswith(model_type)] if model_type else []
    close = difflib.get_close_matches(str(names[0]), same_type or candidates, n=1)
    raise config_error(spec, f"architectures names {names[0]!r}, a class the installed transformers does not have"
                             + (f"; did you mean {close[0]!r}?" if close else ""),
                       hint="Give a class transformers has, or leave architectures out to build the causal LM "
                            "of its model_type.")

"""``--attn``: which attention code a Hugging Face model runs (``hf:`` models only).

The option's value travels in a command's ``**kwargs`` with the other shared option groups;
:func:`attn_model` pops it and turns ``MODEL`` into a :class:`memcalc.stacks.transformers.hub.HuggingFace`
(an ``hf:`` model) or refuses it (any other model: the option would be ignored)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import click

from memcalc.stacks.transformers.hub import HfAttention, HuggingFace, with_attention

__all__ = ("ATTN_PARAMETER", "attn_model", "attn_option")

#: The command parameter :func:`attn_option` adds (popped by :func:`attn_model`).
ATTN_PARAMETER = "attn"


def attn_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--attn eager|sdpa|flash_attention_2``."""
    return click.option(
        "--attn", ATTN_PARAMETER, type=click.Choice([a.value for a in HfAttention]), default=None,
        help="Attention of an hf: model: eager (softmax(QKᵀ) as tensors), sdpa (the fused kernel CUDA picks) or "
             "flash_attention_2 (flash-attn's kernel, modelled without it). Default: what transformers picks.",
    )(func)


def attn_model(model: str, options: MutableMapping[str, Any]) -> str | HuggingFace:
    """``MODEL`` with ``--attn`` (taken out of ``options``) applied."""
    return with_attention(model, options.pop(ATTN_PARAMETER, None))

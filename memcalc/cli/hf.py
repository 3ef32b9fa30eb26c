"""``--attn`` and ``--task``: which attention code a Hugging Face model runs, and which head it
is built with (``hf:`` models only).

The options' values travel in a command's ``**kwargs`` with the other shared option groups;
:func:`attn_model` pops them and turns ``MODEL`` into a
:class:`memcalc.stacks.transformers.hub.HuggingFace` (an ``hf:`` model) or refuses them (any
other model: the options would be ignored). They describe the model, not the step, so they
are not fields of the step (:mod:`memcalc.fields`)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import click

from memcalc.stacks.transformers.heads import Head
from memcalc.stacks.transformers.hub import HfAttention, HuggingFace, with_attention

__all__ = ("ATTN_PARAMETER", "TASK_PARAMETER", "attn_model", "attn_option")

#: The command parameters :func:`attn_option` adds (popped by :func:`attn_model`).
ATTN_PARAMETER = "attn"
TASK_PARAMETER = "task"


def attn_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--attn eager|sdpa|flash_attention_2`` and ``--task HEAD``."""
    func = click.option(
        "--task", TASK_PARAMETER, type=click.Choice([h.value for h in Head]), default=None,
        help="Head of an hf: model, and so the loss it trains with from its labels (Trainer's): causal-lm, "
             "masked-lm, seq2seq, sequence-classification, token-classification or question-answering. Default: "
             "the head the config's architectures names, else a causal LM.",
    )(func)
    return click.option(
        "--attn", ATTN_PARAMETER, type=click.Choice([a.value for a in HfAttention]), default=None,
        help="Attention of an hf: model: eager (softmax(QKᵀ) as tensors), sdpa (the fused kernel CUDA picks) or "
             "flash_attention_2 (flash-attn's kernel, modelled without it). Default: what transformers picks.",
    )(func)


def attn_model(model: str, options: MutableMapping[str, Any]) -> str | HuggingFace:
    """``MODEL`` with ``--attn`` and ``--task`` (taken out of ``options``) applied."""
    return with_attention(model, options.pop(ATTN_PARAMETER, None), options.pop(TASK_PARAMETER, None))

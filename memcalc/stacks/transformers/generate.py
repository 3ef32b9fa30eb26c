"""``model.generate(prompt, max_new_tokens=N)`` of a Hugging Face causal LM, run for real on
meta tensors: transformers' own ``GenerationMixin.generate`` as installed — its prefill with
``logits_to_keep=1``, the cache class ``_prepare_cache_for_generation`` picks (``DynamicCache``
unless the generation config names another), the logits processors and stopping criteria it
builds, and each decode step of ``_sample`` — under memcalc's tracer.

The values generate() reads from tensors (whether the prompt is padded; whether to stop after
each token) cannot be read from meta tensors: the tracer takes them from
:mod:`memcalc.stacks.transformers.reads`, answered for a prompt without padding that generates all ``N``
tokens — no end-of-sequence token before, what ``max_new_tokens`` allows at most, and the
largest cache. So the estimate is the call's peak when it runs to ``max_new_tokens``; a run that
stops earlier at an end-of-sequence token peaks no higher, except through ``min_new_tokens``,
whose logits processor (not run here) copies the scores at each step.

The prefill is the first call of the model's forward, each decode step one more (the engine
tells them apart: :mod:`memcalc.engine.generation`); after each forward, the tensors of the
cache the output carries are marked as the KV cache.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from memcalc.engine.model import ModelInputs

__all__ = ("cache_tensors", "generate_on_meta", "quiet_generation", "static_cache", "steady_decoding")


def cache_tensors(output: Any) -> Iterator[torch.Tensor]:
    """The keys and values held by the cache a forward's output carries (transformers'
    ``Cache``: one ``CacheLayerMixin`` per layer, ``keys`` and ``values`` each)."""
    values = output.values() if isinstance(output, dict) else ()
    for value in values:
        for layer in getattr(value, "layers", None) or ():
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    yield tensor


def static_cache(module: nn.Module, max_cache_len: int) -> tuple[dict[str, Any], Callable[[], Iterable[torch.Tensor]]]:
    """The model's own static KV cache for ``max_cache_len`` tokens (``--kv-cache``): transformers'
    ``StaticCache(config=module.config, max_cache_len=...)``, as a user passes it to the forward
    (the forward's keywords: ``cache=`` since transformers 5.24, ``past_key_values=`` before it;
    ``use_cache=True``), and its keys and values once the forward has filled it. Each
    layer allocates its ``(B, kv_heads, max_cache_len, head_dim)`` keys and values itself at its
    first update, during the prefill, in the dtype of its keys; a sliding-window layer (Gemma-2)
    only its window, as the library sizes it."""
    from transformers import StaticCache  # the hf extra: only a Hugging Face model gets here

    cache = StaticCache(config=module.config, max_cache_len=max_cache_len)  # type: ignore[arg-type]
    keyword = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"

    def tensors() -> Iterator[torch.Tensor]:
        return cache_tensors({keyword: cache})

    return {keyword: cache, "use_cache": True}, tensors


@contextmanager
def quiet_generation() -> Iterator[None]:
    """transformers' generation logger (its notes on pad ids and attention masks): the user did not call it."""
    logger = logging.getLogger("transformers.generation.utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def generate_on_meta(module: nn.Module, inputs: ModelInputs, new_tokens: int,
                     mark_cache: Callable[[Iterable[torch.Tensor]], None]) -> torch.Tensor:
    """``module.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)`` on meta, the
    cache's tensors handed to ``mark_cache`` after each forward (its reads of tensor values are
    the tracer's to answer: module docstring).

    Args:
        module: a Hugging Face causal LM on meta.
        inputs: the prompt: ``input_ids`` (B, T), with its other keyword arguments (an attention mask).
        new_tokens: ``max_new_tokens``.
        mark_cache: told the cache's tensors after each forward.

    Returns:
        The generated sequences (B, T + new_tokens).
    """
    kwargs = dict(inputs.kwargs)
    ids = kwargs.pop("input_ids", None)
    if ids is None:
        ids = inputs.args[0]
    config: Any = module.generation_config  # GenerationMixin's GenerationConfig
    eos = config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    hook = module.register_forward_hook(lambda _m, _a, out: mark_cache(cache_tensors(out)))
    try:
        with quiet_generation():
            sequences: torch.Tensor = module.generate(  # type: ignore[operator]  # GenerationMixin's
                ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, **kwargs)
    finally:
        hook.remove()
    return sequences


#: Config attributes by which a model's attention (and so its cache) stops growing with the
#: tokens, or changes at some length: a sliding window, chunked attention, a cache of its own kind.
_WINDOWED = ("sliding_window", "attention_chunk_size")


def steady_decoding(module: nn.Module, inputs: ModelInputs, new_tokens: int) -> str | None:
    """Whether each decode step of ``module.generate()`` (the prompt of ``inputs``, ``new_tokens``
    tokens) runs the step before it over a cache one token longer (:mod:`memcalc.engine.steady`
    extrapolates such steps): None when it does — a full attention over a ``DynamicCache`` (or a
    ``StaticCache``), or a sliding window the generation never fills — else why not: a config that
    bounds or chunks the attention (``sliding_window`` where the prompt and the tokens reach it,
    ``attention_chunk_size``, layer types other than full or sliding attention: the cache stops
    growing at the window, which a few traced steps cannot show), or a generation config that names
    another cache class.

    A ``DynamicSlidingWindowLayer`` keeps the last ``window - 1`` positions and the mask counts a
    full window once ``window`` are cached; the last forward caches ``prompt + new_tokens - 1``, so
    below ``prompt + new_tokens < window`` every step is a full attention's."""
    config: Any = getattr(module, "config", None)
    ids = inputs.kwargs.get("input_ids", inputs.args[0] if inputs.args else None)
    positions = int(ids.shape[-1]) + new_tokens if isinstance(ids, torch.Tensor) else None
    for name in _WINDOWED:
        if name == "sliding_window" and getattr(config, "use_sliding_window", True) is False:
            continue  # Qwen2's window, off
        window = getattr(config, name, None)
        if name == "sliding_window" and isinstance(window, int) and positions is not None and positions < window:
            continue  # never filled: the cache grows by one token each step, as a full attention's
        if window:
            return f"its config sets {name}" + (f" ({window}), which the prompt and the new tokens reach"
                                                if name == "sliding_window" and positions is not None else "")
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
    window = getattr(config, "sliding_window", None)
    if kinds == {"sliding_attention"} and isinstance(window, int) and positions is not None and positions < window:
        kinds = set()  # a window never filled (above)
    if kinds:
        return f"its layers include {', '.join(sorted(kinds))}"
    generation: Any = getattr(module, "generation_config", None)
    cache = getattr(generation, "cache_implementation", None)
    if cache not in (None, "dynamic", "static"):
        return f"its generation config names cache_implementation={cache!r}"
    return None

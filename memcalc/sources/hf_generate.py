"""``model.generate(prompt, max_new_tokens=N)`` of a Hugging Face causal LM, run for real on
meta tensors: transformers' own ``GenerationMixin.generate`` as installed — its prefill with
``logits_to_keep=1``, the cache class ``_prepare_cache_for_generation`` picks (``DynamicCache``
unless the generation config names another), the logits processors and stopping criteria it
builds, and each decode step of ``_sample`` — under memcalc's tracer.

**What cannot run on meta: the values generate() reads.** A handful of lines turn a tensor
into a Python bool (``aten._local_scalar_dense``), which a meta tensor cannot answer. They are
answered here, each by the value it has in the run memcalc estimates — a greedy run whose prompt
has no padding and that generates all ``N`` tokens (no end-of-sequence token before; what
``max_new_tokens`` allows at most, and the largest cache). The answers (:data:`_READS`) are keyed
by the function that reads (its ``__qualname__``) and a fragment of its line, both from
transformers 5.24 (``generation/utils.py``, ``masking_utils.py``):

- ``GenerationMixin._prepare_special_tokens``: whether the end-of-sequence id is the pad id, or
  negative — warnings only: False;
- ``GenerationMixin.generate``: right padding in the prompt (a warning): False; the attention
  mask all ones: True, so generate drops it, as it does for a prompt without padding;
- ``GenerationMixin._get_logits_processor``: dummy encoder ids below 0: False (token ids);
- ``_ignore_causal_mask_sdpa`` (``fast_all(padding_mask)``): no padding: True;
- ``StopCheck.__call__`` (``unfinished_sequences.max() == 0``, once per generated token): False
  until the ``N``-th token, then True — ``MaxLengthCriteria``'s answer at ``max_length``.

A read that is not in the table stops the estimate with its file, line and function named
(a transformers release that reads somewhere new), rather than guessing.

The prefill is the first call of the model's forward, each decode step one more (the engine
tells them apart: :mod:`memcalc.engine.generation`); after each forward, the tensors of the
cache the output carries are marked as the KV cache.
"""

from __future__ import annotations

import linecache
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.errors import MemcalcError
from memcalc.engine.model import ModelInputs

__all__ = ("cache_tensors", "generate_on_meta")


@dataclass(frozen=True)
class _Read:
    """One place transformers reads a tensor's value, and the value of the estimated run there."""

    function: str  # the reading frame's ``co_qualname``
    fragment: str  # a fragment of the line ("" : any line of the function)
    value: bool
    why: str


#: The reads of generate() answered (module docstring); StopCheck's is counted apart.
_READS = (
    _Read("GenerationMixin._prepare_special_tokens", "", False, "pad/eos sanity checks: warnings only"),
    _Read("GenerationMixin.generate", "has_right_padding", False, "the prompt has no right padding"),
    _Read("GenerationMixin.generate", '["attention_mask"] == 1).all()', True,
          "the prompt has no padding: the attention mask is all ones and generate drops it"),
    _Read("GenerationMixin._get_logits_processor", "< 0).any()", False, "token ids are not negative"),
    _Read("_ignore_causal_mask_sdpa", "", True, "the prompt has no padding"),
)
#: The stop check of ``_sample``: read once per generated token.
_STOP_CHECK = "StopCheck.__call__"
#: transformers' source files, as they appear in a frame's file name.
_TRANSFORMERS = "/transformers/"


class _ReadAnswers(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """Answers generate()'s reads of tensor values (module docstring); every other op passes on."""

    def __init__(self, new_tokens: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode.__init__ is untyped
        self.new_tokens = new_tokens
        self.stop_checks = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return self._answer(args[0])
        return func(*args, **(kwargs or {}))

    def _answer(self, tensor: torch.Tensor) -> bool:
        frame = _reading_frame()
        if frame is None:
            raise MemcalcError("generate() read a tensor's value outside transformers' code",
                               hint="memcalc runs generate() as installed; please report this.")
        function, filename, line = frame
        if function == _STOP_CHECK:
            self.stop_checks += 1
            return self.stop_checks >= self.new_tokens
        text = _statement(filename, line)
        for read in _READS:
            if read.function == function and read.fragment in text:
                return read.value
        where = filename.rsplit(_TRANSFORMERS, 1)[-1]
        raise MemcalcError(
            f"generate() reads a tensor's value at transformers/{where}, line {line} ({function}: "
            f"{' '.join(text.split())!r}), which memcalc does not know how the estimated run answers",
            hint="memcalc answers the reads of the transformers release it was written for (5.24); please report "
                 "this with your transformers version.")


def _reading_frame() -> tuple[str, str, int] | None:
    """``(qualname, file, line)`` of the innermost transformers frame on the stack: the code whose
    line turned a tensor into a Python value."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if _TRANSFORMERS in code.co_filename:
            return getattr(code, "co_qualname", code.co_name), code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def _statement(filename: str, line: int, most: int = 12) -> str:
    """The source of the statement that starts at ``line``: Python reports a multi-line
    condition's read at its first line (``if (``), so the lines are joined until its brackets close."""
    text = linecache.getline(filename, line)
    for extra in range(1, most):
        if text.count("(") + text.count("[") <= text.count(")") + text.count("]"):
            break
        text += linecache.getline(filename, line + extra)
    return text


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


@contextmanager
def _quiet_generation() -> Iterator[None]:
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
    """``module.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)`` on meta, its
    reads answered (module docstring), the cache's tensors handed to ``mark_cache`` after each
    forward.

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
        with _quiet_generation(), _ReadAnswers(new_tokens):
            sequences: torch.Tensor = module.generate(  # type: ignore[operator]  # GenerationMixin's
                ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, **kwargs)
    finally:
        hook.remove()
    return sequences

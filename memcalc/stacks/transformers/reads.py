"""The values a Hugging Face model's own code reads from tensors, answered as the run memcalc
estimates would answer them.

A few lines of transformers turn a tensor into a Python bool (``aten._local_scalar_dense``) to
pick a faster path or to stop a loop; on meta tensors there is no value to read. The tracer asks
:func:`hf_reads`' oracle (:attr:`memcalc.engine.model.ResolvedModel.reads`) before it gives up on
such a read: the oracle finds the transformers line that reads (the innermost transformers frame
on the stack: its function's ``__qualname__`` and the statement there) and answers from a table,
each answer the value of the estimated run — a batch of ordinary sequences, neither padded nor
packed; a generation that produces all its new tokens. A read the table does not hold is not
guessed: the tracer reports it as a data-dependent read, naming the op, the module and the phase.

The table, from transformers 5.24 (``masking_utils.py``, ``generation/utils.py``):

In every step:

- ``find_packed_sequence_indices`` (a forward without a cache, as under gradient checkpointing):
  whether the position ids hold several packed sequences — ``(packed_sequence_mask[:, -1] ==
  0).all()`` is True: they do not, the model made them ``0, 1, 2, ...`` itself.

In ``generate()`` only (mode generate; an attention mask given to a training step still stops
the estimate, with the advice to leave it out):

- ``GenerationMixin._prepare_special_tokens``: whether the end-of-sequence id is the pad id, or
  negative — warnings only: False;
- ``GenerationMixin.generate``: right padding in the prompt (a warning): False; the attention
  mask all ones: True, so generate drops it, as it does for a prompt without padding;
- ``GenerationMixin._get_logits_processor``: dummy encoder ids below 0: False (token ids);
- ``_ignore_causal_mask_sdpa`` (``fast_all(padding_mask)``): no padding: True;
- ``StopCheck.__call__`` (``unfinished_sequences.max() == 0``, once per generated token): False
  until the ``N``-th token, then True — ``MaxLengthCriteria``'s answer at ``max_length``.
"""

from __future__ import annotations

import linecache
import sys
from dataclasses import dataclass
from types import FrameType

import torch

from memcalc.core.categories import Mode
from memcalc.engine.trace import ReadOracle

__all__ = ("GENERATION_READS", "STEP_READS", "Read", "hf_reads")


@dataclass(frozen=True)
class Read:
    """One place transformers reads a tensor's value, and the value of the estimated run there."""

    function: str  # the reading frame's ``co_qualname``
    fragment: str  # a fragment of the statement that reads ("": any statement of the function)
    value: bool
    why: str


#: The reads answered in every step (module docstring).
STEP_READS = (
    Read("find_packed_sequence_indices", "", True,
         "the position ids hold no packed sequences: the model counted them 0, 1, 2, ... itself"),
)
#: The reads of generate() (module docstring); StopCheck's is counted apart.
GENERATION_READS = (
    *STEP_READS,
    Read("GenerationMixin._prepare_special_tokens", "", False, "pad/eos sanity checks: warnings only"),
    Read("GenerationMixin.generate", "has_right_padding", False, "the prompt has no right padding"),
    Read("GenerationMixin.generate", '["attention_mask"] == 1).all()', True,
         "the prompt has no padding: the attention mask is all ones and generate drops it"),
    Read("GenerationMixin._get_logits_processor", "< 0).any()", False, "token ids are not negative"),
    Read("_ignore_causal_mask_sdpa", "", True, "the prompt has no padding"),
)
#: The stop check of ``_sample``: read once per generated token.
_STOP_CHECK = "StopCheck.__call__"
#: transformers' source files, as they appear in a frame's file name.
_TRANSFORMERS = "/transformers/"


class _Oracle:
    """Answers a read from its table; counts generate()'s stop checks."""

    def __init__(self, reads: tuple[Read, ...], new_tokens: int | None) -> None:
        self.reads = reads
        self.new_tokens = new_tokens
        self.stop_checks = 0

    def __call__(self, tensor: torch.Tensor) -> bool | None:
        frame = _reading_frame()
        if frame is None:
            return None
        function, filename, line = frame
        if function == _STOP_CHECK and self.new_tokens is not None:
            self.stop_checks += 1
            return self.stop_checks >= self.new_tokens
        text = _statement(filename, line)
        for read in self.reads:
            if read.function == function and read.fragment in text:
                return read.value
        return None


def hf_reads(mode: Mode, new_tokens: int | None) -> ReadOracle:
    """The oracle of one step of ``mode`` (``new_tokens``: a generation's, None otherwise)."""
    if mode is Mode.GENERATE:
        return _Oracle(GENERATION_READS, new_tokens)
    return _Oracle(STEP_READS, None)


def _reading_frame() -> tuple[str, str, int] | None:
    """``(qualname, file, line)`` of the innermost transformers frame on the stack: the code whose
    statement turned a tensor into a Python value."""
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

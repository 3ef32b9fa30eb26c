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

The table (transformers 5.24): packed-sequence detection (not packed); mixture-of-experts
routing under ``experts_implementation="eager"`` (**balanced**, an assumption:
:class:`BalancedRouting`); and in ``generate()`` only, the special-token, padding and stopping
checks (no padding; stop at the ``N``-th token).

Each read, where it is and its answer: docs/notes/hf-reads.md.
"""

from __future__ import annotations

import linecache
import sys
from dataclasses import dataclass
from types import FrameType

import torch

from memcalc.core.categories import Mode
from memcalc.engine.trace import ReadOracle

__all__ = ("GENERATION_READS", "STEP_READS", "BalancedRouting", "Read", "hf_reads", "routing_notes")


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


#: The eager experts loop of transformers' MoE models: ``MixtralExperts.forward``, ``GptOssExperts.forward``, ...
_EXPERTS_FORWARD = "Experts.forward"


class BalancedRouting:
    """The reads of transformers' eager experts loop, answered for a balanced routing (module
    docstring): every expert gets its share of the ``P`` token-expert pairs of the forward."""

    def __init__(self) -> None:
        self.expert = -1  # the expert the loop works on (its index), -1 before the first

    def answer(self, tensor: torch.Tensor, text: str, local: dict[str, object]) -> bool | int | None:
        """The value of ``tensor`` read by the statement ``text`` of an experts forward whose locals
        are ``local``: a count of rows for ``nonzero`` (a tensor of one or more dimensions), else
        the scalar a 0-dim tensor holds."""
        mask, module = local.get("expert_mask"), local.get("self")
        experts = getattr(module, "num_experts", None)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 3 or not isinstance(experts, int):
            return None
        pairs = mask.shape[1] * mask.shape[2]  # (classes, top_k, tokens)
        if "expert_hit =" in text:
            self.expert = -1
            return min(experts, pairs)
        if "expert_idx == self.num_experts" in text:  # once per expert, first in its iteration
            self.expert += 1
            return False
        if tensor.dim() == 0:  # the expert's index, read to index its weights
            return self.expert
        if "torch.where(expert_mask[expert_idx])" in text:
            return pairs // experts + (1 if self.expert % experts < pairs % experts else 0)
        return None


class _Oracle:
    """Answers a read from its table; counts generate()'s stop checks; routes experts' tokens."""

    def __init__(self, reads: tuple[Read, ...], new_tokens: int | None) -> None:
        self.reads = reads
        self.new_tokens = new_tokens
        self.stop_checks = 0
        self.routing = BalancedRouting()

    def __call__(self, tensor: torch.Tensor) -> bool | int | None:
        frame = _reading_frame()
        if frame is None:
            return None
        function, filename, line = frame.qualname, frame.filename, frame.line
        if function == _STOP_CHECK and self.new_tokens is not None:
            self.stop_checks += 1
            return self.stop_checks >= self.new_tokens
        text = _statement(filename, line)
        if function.endswith(_EXPERTS_FORWARD):
            return self.routing.answer(tensor, text, frame.local)
        for read in self.reads:
            if read.function == function and read.fragment in text:
                return read.value
        return None


def hf_reads(mode: Mode, new_tokens: int | None) -> ReadOracle:
    """The oracle of one step of ``mode`` (``new_tokens``: a generation's, None otherwise)."""
    if mode is Mode.GENERATE:
        return _Oracle(GENERATION_READS, new_tokens)
    return _Oracle(STEP_READS, None)


@dataclass(frozen=True)
class _Frame:
    qualname: str
    filename: str
    line: int
    local: dict[str, object]


def routing_notes(module: torch.nn.Module) -> tuple[str, ...]:
    """The routing assumption of a mixture-of-experts ``module`` (none for a dense one): the
    experts implementation its config runs, and what memcalc assumes of the router's split."""
    experts = [m for m in module.modules() if isinstance(getattr(m, "num_experts", None), int)
               and hasattr(m, "has_gate")]  # transformers' @use_experts_implementation classes
    if not experts:
        return ()
    config = getattr(experts[0], "config", None)
    implementation = getattr(config, "_experts_implementation", None) or "eager"
    count = experts[0].num_experts
    split = (f"transformers' {implementation} experts kernel takes all tokens · top_k rows at once, so its memory "
             f"does not depend on the split" if implementation == "grouped_mm" else
             f"transformers' {implementation} experts loop reads the split: answered as balanced")
    return (f"mixture of experts: routing assumed balanced (each of the {count} experts gets tokens · top_k / "
            f"{count}); {split}",)


def _reading_frame() -> _Frame | None:
    """The innermost transformers frame on the stack: the code whose statement turned a tensor
    into a Python value (its function, file, line and local variables)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if _TRANSFORMERS in code.co_filename:
            return _Frame(getattr(code, "co_qualname", code.co_name), code.co_filename, frame.f_lineno,
                          frame.f_locals)
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

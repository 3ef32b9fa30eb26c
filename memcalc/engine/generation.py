"""Generation traced as the model runs it: ``mode="generate"`` calls the model's own
``generate()`` (:attr:`memcalc.engine.model.ResolvedModel.generate`: a Hugging Face causal LM's,
made runnable on meta by :mod:`memcalc.stacks.transformers.generate`) under the tracer, and tells the
phases apart as it runs.

The peak of a generation is the highest point of the whole call. Where it lies depends on the
model and the sizes: in the **prefill** (one forward over the whole prompt: its activations,
its attention, the logits it keeps), or in a **decode step** (one forward of one new token,
over a cache that has grown by one token per step; a ``DynamicCache`` grows by ``torch.cat``,
so for a moment each layer holds its old keys and values and the longer copy). So every
forward of the model starts a phase: the first :attr:`~memcalc.core.categories.Phase.PREFILL`
(with generate()'s setup before it), each later one :attr:`~memcalc.core.categories.Phase.DECODE`
— decode step *k* is the *k*-th forward after the prefill, with the token selection after it.
:func:`decode_step_at` counts them back from the trace.

Each forward is one new token: the tokens done so far are told to the progress listener as
:data:`GENERATING` (:mod:`memcalc.core.progress`), so that a long generation shows a bar. A
generation whose steady decode steps are extrapolated (:mod:`memcalc.engine.steady`) stops after
the tokens traced (the model's reads answer its stop check then); its caller tells the last token.

The cache's keys and values are marked :attr:`~memcalc.core.categories.Category.KV_CACHE`
as the forward that made them returns; everything else generate() allocates is an activation
(the model's, or the selection's: the last position's logits copied to float32, the argmax,
the sequences grown by one token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from memcalc.core.categories import Phase
from memcalc.core.progress import report_progress
from memcalc.engine.model import GenerateFn, ModelInputs
from memcalc.engine.step import StepConfig, StepOutcome
from memcalc.engine.trace import StepTrace

__all__ = ("GENERATING", "GenerationObserver", "decode_step_at", "run_generation")

#: The progress task of a generation: its units are the new tokens.
GENERATING = "generating tokens"


class GenerationObserver(Protocol):
    """What the tracer learns from a generation."""

    def set_phase(self, phase: Phase) -> None:
        """The generation enters ``phase``."""

    def kv_cache(self, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` are the cache's keys and values."""

    def finished(self) -> None:
        """The call is over; what dies after this is not part of it."""


def run_generation(model: nn.Module, inputs: ModelInputs, config: StepConfig, generate: GenerateFn,
                   new_tokens: int, observer: GenerationObserver, *,
                   on_decode: Callable[[int], None] | None = None) -> StepOutcome:
    """Run ``generate(model, inputs, new_tokens, ...)`` with the model in eval mode, inside the
    step's autocast region (generate() runs under ``torch.no_grad()`` itself), a phase per forward.

    Args:
        on_decode: told ``k`` as decode step ``k`` begins (after its phase is set).

    Returns:
        The outcome: no loss; the generated sequences' shape as the output's (stopped early by
        the model's reads: the tokens made until then, and the last token is not told).
    """
    was_training = model.training
    forwards = 0

    def forward_starts(_module: nn.Module, _args: Any) -> None:
        nonlocal forwards
        observer.set_phase(Phase.PREFILL if forwards == 0 else Phase.DECODE)
        if 0 < forwards < new_tokens:  # forward k makes token k: the k - 1 before it are done
            report_progress(GENERATING, forwards, new_tokens)
        if forwards and on_decode is not None:
            on_decode(forwards)
        forwards += 1

    model.eval()
    handle = model.register_forward_pre_hook(forward_starts)
    try:
        with config.autocast():
            observer.set_phase(Phase.PREFILL)  # generate()'s setup: the cache, the masks, the processors
            report_progress(GENERATING, 0, new_tokens)
            sequences = generate(model, inputs, new_tokens, observer.kv_cache)
            if forwards == new_tokens:
                report_progress(GENERATING, new_tokens, new_tokens)
            shape = tuple(sequences.shape)
            del sequences
    finally:
        handle.remove()
        model.train(was_training)
    observer.finished()
    return StepOutcome(loss_kind=None, output_shape=shape)


def decode_step_at(trace: StepTrace, event: int) -> int:
    """The decode step ``trace.events[event]`` happens in: 0 in the prefill, *k* in the *k*-th
    forward after it (:func:`run_generation` logs a :attr:`Phase.DECODE` per decode step)."""
    return sum(1 for phase, start in trace.phase_log if phase is Phase.DECODE and start <= event)

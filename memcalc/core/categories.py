"""The vocabulary of the report: what a byte is for (:class:`Category`) and when it was
allocated (:class:`Phase`)."""

from __future__ import annotations

import enum

__all__ = ("Category", "Mode", "Phase")


class Category(str, enum.Enum):
    """What a storage is for. Assigned once, from the strongest evidence (a parameter's
    storage is a parameter even if an op also returned it)."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    INPUTS = "inputs"  # the batch and its targets
    GRADIENTS = "gradients"  # storages that end up as a parameter's .grad
    OPTIMIZER_STATE = "optimizer_state"  # storages held in optimizer.state after the step
    ACTIVATIONS = "activations"  # created in forward/loss; alive during backward = saved for backward
    WORKSPACE = "workspace"  # temporaries: activation gradients, optimizer scratch, kernel workspaces
    KV_CACHE = "kv_cache"  # keys and values kept for generation (inference with a KV cache)


class Phase(str, enum.Enum):
    """The part of the step an allocation happens in."""

    SETUP = "setup"  # pre-existing storages: parameters, buffers, inputs
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    ZERO_GRAD = "zero_grad"
    PREFILL = "prefill"  # generation: generate()'s setup and its forward over the prompt, the first token chosen
    DECODE = "decode"  # generation: the forward of one new token over the cache, the next token chosen
    SCORING = "scoring"  # a GRPO step's no-grad log-prob forwards over the completions (old policy, reference)

    @property
    def generates(self) -> bool:
        """The phase belongs to a generation (a GRPO step's: generate() and the scoring of its completions)."""
        return self in (Phase.PREFILL, Phase.DECODE, Phase.SCORING)

    @property
    def runs_forward(self) -> bool:
        """The model's forward runs in this phase (what is born in it is an activation)."""
        return self in (Phase.FORWARD, Phase.LOSS, Phase.PREFILL, Phase.DECODE, Phase.SCORING)


class Mode(str, enum.Enum):
    """``train`` runs forward, loss, backward, optimizer step and zero_grad (two iterations, so
    that the steady state with optimizer state already allocated is covered); ``eval`` runs
    the forward only, under ``torch.no_grad()`` with the model in eval mode; ``inference``
    the same under ``torch.inference_mode()`` (with a static KV cache for decoder LLMs on
    request); ``generate`` runs the model's own ``generate(prompt, max_new_tokens=N)``: the
    prefill, then one forward per new token over the cache generate() keeps."""

    TRAIN = "train"
    EVAL = "eval"
    INFERENCE = "inference"
    GENERATE = "generate"

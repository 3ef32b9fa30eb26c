"""What memcalc does to its own (meta) copy of the model before the step: the dtype the
parameters are stored in, activation checkpointing per block, and the size of a KV cache. The
user's module is never touched: these run on the meta twin or on a model memcalc built."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memcalc.core.checkpointing import FULL, Checkpointing, CheckpointKind
from memcalc.core.errors import InvalidInputError
from memcalc.core.precision import Precision
from memcalc.engine.model import Checkpointer, CheckpointFn, ModelInputs
from memcalc.engine.sac_policy import selective_context_fn
from memcalc.engine.step_backend import current_autocast_region
from memcalc.engine.step_spec import Step

__all__ = (
    "KEEP_DTYPE",
    "apply_checkpointing",
    "cast_inputs",
    "cast_parameters",
    "checkpoint_function",
    "checkpointed",
    "checkpointing_note",
    "is_reentrant",
    "kv_cache_bytes",
    "kv_elements_per_token",
    "kv_prompt",
    "prepare_step",
)


#: Attribute of a parameter whose dtype the model's fp16/bf16 cast must not change (the
#: float32 statistics of a quantized weight; PEFT's float32 LoRA adapters, ``autocast_adapter_dtype``).
KEEP_DTYPE = "memcalc_keep_dtype"


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Parameters and buffers in ``dtype`` (in place, on meta: free), except the parameters
    marked :data:`KEEP_DTYPE`, which stay in theirs; float32 leaves the model as built."""
    if dtype is torch.float32:
        return
    module.to(dtype)
    for p in module.parameters():
        kept = getattr(p, KEEP_DTYPE, None)
        if isinstance(kept, torch.dtype) and p.dtype != kept:
            p.data = p.data.to(kept)


def cast_inputs(inputs: ModelInputs | Sequence[torch.Tensor], precision: Precision) -> ModelInputs:
    """Floating inputs in the model's dtype under pure fp16/bf16 (token ids stay int64),
    positional and keyword alike."""
    dtype = precision.parameter_dtype
    if dtype is torch.float32:
        return ModelInputs.of(inputs)
    return ModelInputs.of(inputs).map(lambda t: t.to(dtype) if t.is_floating_point() else t)


def prepare_step(module: nn.Module, inputs: ModelInputs | Sequence[torch.Tensor], step: Step, *,
                 containers: Sequence[str], model_name: str,
                 own_checkpointing: Checkpointer | None = None) -> tuple[ModelInputs, int]:
    """Everything the step changes in the model before it runs — the same for the estimate
    (on meta) and the measurement (real): the parameters' dtype, the inputs of pure fp16/bf16,
    and per-block checkpointing (the model's own, ``own_checkpointing``, when it has one).
    Returns the cast inputs and the number of blocks checkpointed."""
    cast_parameters(module, step.parameter_dtype)
    blocks = (apply_checkpointing(module, containers, model_name, own_checkpointing, step.checkpoint)
              if step.checkpoint else 0)
    return cast_inputs(inputs, step.precision), blocks


def apply_checkpointing(module: nn.Module, containers: Sequence[str], model_name: str,
                        own: Checkpointer | None = None,
                        checkpointing: Checkpointing = FULL) -> int:
    """Checkpoint the model's blocks with :func:`checkpoint_function` of ``checkpointing`` (every
    block, every Nth, or with a selective policy; non-reentrant, PyTorch's recommendation, unless it
    says reentrant): through the model's own mechanism when it has one (``own``: a Hugging Face model's
    gradient checkpointing, which also drops its KV cache in the checkpointed layers), else by
    wrapping the blocks of the named containers — a block keeps its name and hooks, its
    ``forward`` is replaced on this instance only. Returns the number of blocks checkpointed."""
    function = checkpoint_function(checkpointing)
    if own is not None:
        return own(module, function, checkpointing.checkpoints_block)
    if not containers:
        raise InvalidInputError(
            f"{model_name} has no repeated blocks that memcalc knows how to checkpoint",
            hint="--checkpoint applies to zoo models with blocks (ResNet stages, transformer layers); "
                 "in your own model, call torch.utils.checkpoint.checkpoint in forward and memcalc simulates it.")
    blocks = [block for path in containers for block in module.get_submodule(path).children()]
    chosen = [block for index, block in enumerate(blocks) if checkpointing.checkpoints_block(index)]
    for block in chosen:
        block.forward = functools.partial(function, block.forward)
    return len(chosen)


def checkpointing_note(checkpointing: Checkpointing, blocks: int, containers: Sequence[str]) -> str:
    """The report's note on what was checkpointed: the setting, the blocks and their containers
    (and reentrance, where the setting has it)."""
    where = f"{blocks} blocks ({', '.join(containers)})"
    if checkpointing.reentrant:
        where += " (reentrant: torch's CheckpointFunction, use_reentrant=True)"
    if checkpointing.kind is CheckpointKind.EVERY:
        return f"activation checkpointing of one block in {checkpointing.every} ({checkpointing.label}): {where}"
    if checkpointing.kind is CheckpointKind.SELECTIVE_OP:
        return (f"selective activation checkpointing (selective-op: torchtitan's op list, saving matmul outputs but "
                f"every second, attention and max, recomputing the rest) on {where}")
    if checkpointing.kind is CheckpointKind.POLICY:
        return f"selective activation checkpointing ({checkpointing.label}) on {where}"
    return f"activation checkpointing on {where}"


def checkpoint_function(checkpointing: Checkpointing) -> CheckpointFn:
    """:func:`checkpointed` with the ``context_fn`` of ``checkpointing``'s selective policy
    (torch's ``create_selective_checkpoint_contexts``), reentrant where ``checkpointing`` is, or as
    it is where neither is asked."""
    if checkpointing.reentrant:
        return functools.partial(checkpointed, reentrant=True)
    made = selective_context_fn(checkpointing)
    return checkpointed if made is None else functools.partial(checkpointed, context_fn=made)


def is_reentrant(function: CheckpointFn) -> bool:
    """Whether ``function`` (from :func:`checkpoint_function`) checkpoints with reentrance: a
    model's own checkpointing passes it on (transformers' ``use_reentrant`` keyword)."""
    return bool(isinstance(function, functools.partial) and function.keywords.get("reentrant", False))


def checkpointed(forward: Any, *args: Any, context_fn: Any = None, reentrant: bool = False, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=reentrant, **kwargs)``
    whose recomputation runs under the autocast region of the original forward, as checkpoint
    does for ``torch.autocast`` (memcalc's emulated autocast is invisible to checkpoint itself);
    ``context_fn``: checkpoint's, for a selective policy (None: the whole forward is recomputed).

    ``reentrant``: torch's ``CheckpointFunction`` itself — the forward under ``no_grad``, the
    positional inputs saved, and in the block's backward the recomputation and an inner
    ``torch.autograd.backward`` — so what it keeps alive is PyTorch's. It takes no keyword
    arguments, so the block's are bound to the function (as transformers' layers bind theirs,
    ``partial(super().__call__, **kwargs)``)."""
    region = current_autocast_region()

    def run(*a: Any, **k: Any) -> Any:
        with region() if region is not None else nullcontext():
            return forward(*a, **k)

    if reentrant:
        return checkpoint(functools.partial(run, **kwargs) if kwargs else run, *args, use_reentrant=True)
    if context_fn is None:
        return checkpoint(run, *args, use_reentrant=False, **kwargs)
    return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def kv_elements_per_token(module: nn.Module) -> int:
    """Elements of key + value cached per token across all layers, read from the attention
    projections by the names used in the zoo and in Hugging Face models: ``k_proj``/``v_proj``
    (Llama, Mistral, Qwen: grouped-query heads included) or a fused ``c_attn``/``qkv`` (GPT-2:
    two thirds of its output are keys and values)."""
    total = 0
    for name, sub in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        weight = getattr(sub, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        out_features = int(getattr(sub, "out_features",
                                   weight.shape[0] if isinstance(sub, nn.Linear) else weight.shape[1]))
        if leaf in ("k_proj", "v_proj", "key", "value"):
            total += out_features
        elif leaf in ("c_attn", "qkv", "query_key_value"):
            total += 2 * out_features // 3
    return total


def kv_prompt(inputs: ModelInputs | Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """``(batch, prompt length)`` of the token ids ``(B, T)`` a KV cache is sized for: the
    ``input_ids`` keyword argument, else the first input; None when they are not token ids."""
    call = ModelInputs.of(inputs)
    ids = call.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = call[0] if len(call) else None
    if ids is None or ids.dim() != 2:
        return None
    return int(ids.shape[0]), int(ids.shape[1])


def kv_cache_bytes(module: nn.Module, inputs: ModelInputs | Sequence[torch.Tensor], precision: Precision,
                   generated: int, *, model_name: str = "the model", decoder: bool | None = None) -> int:
    """Bytes of a static KV cache for the prompt (token ids ``(B, T)``) plus ``generated``
    tokens, in the compute dtype.

    ``decoder`` is what the model's source knows (a zoo entry, a Hugging Face config): False
    refuses the cache outright — an encoder such as BERT has key and value projections too,
    but attends to the whole sequence at once and generates nothing, so it keeps no cache."""
    if decoder is False:
        raise InvalidInputError(
            f"a KV cache needs a decoder language model (causal attention, generating tokens); "
            f"{model_name} is not one, so --kv-cache (kv_cache=) does not apply to it",
            hint="Drop --kv-cache to estimate its forward, or choose a decoder (gpt2, llama-2-7b, hf:gpt2, ...).")
    per_token = kv_elements_per_token(module)
    prompt = kv_prompt(inputs)
    if per_token == 0 or prompt is None:
        raise InvalidInputError("--kv-cache needs a decoder language model taking token ids (B, T) "
                                "with k_proj/v_proj or c_attn attention projections")
    batch, length = prompt
    itemsize = torch.empty((), dtype=precision.compute_dtype).element_size()
    return per_token * batch * (length + generated) * itemsize

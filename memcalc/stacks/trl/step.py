"""TRL's ``SFTTrainer``, ``DPOTrainer`` and ``RewardTrainer`` on meta: their own ``compute_loss``.

A TRL trainer is ``transformers.Trainer`` with its own ``compute_loss`` (and collator): the loop,
the training step, the optimizer and the clipping are the Trainer's, which memcalc's ``trainer``
loop follows (:func:`memcalc.engine.loops.trainer`). :func:`trl_model` wraps the policy in a
module whose forward *is* the installed trainer's ``compute_loss`` (``DPOTrainer.compute_loss``,
``SFTTrainer.compute_loss``), called on a trainer object that holds what that method reads and
nothing else (the trainer's ``__init__`` loads a tokenizer and prepares a dataset on the host;
it is not run). What the ``__init__`` does to the models is done as it does it:

* the policy gets TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, its chunked
  log-probabilities: the ``(batch, seq, vocab)`` logits are never made), with the outputs the
  trainer asks for (SFT: log-probs, entropy, top-1; DPO: log-probs, entropy, mean logits, top-1,
  and ``log_sum_sq_probs`` under ``use_weighting``); the reference model, a bare head;
* DPO's reference model: a frozen copy of the policy (``DPOTrainer`` loads the same checkpoint
  again: ``create_model_from_path``), in eval mode; none with LoRA (PEFT's adapter-disabled
  policy: ``use_adapter(model, None)``) or with ``precompute_ref_log_probs`` (the batch then
  carries ``ref_chosen_logps`` and ``ref_rejected_logps``);
* ``disable_dropout`` (DPOConfig's and RewardConfig's default): dropout set to 0;
* the reward model (a sequence classifier with one label) gets the pad token's id, 0, when its
  config has none (``RewardTrainer`` sets the tokenizer's: it finds each row's last token so).

The batch is the collator's (``DataCollatorForPreference``: chosen and rejected rows concatenated,
``2 × batch`` rows of ``seq_len`` tokens, an attention mask and a completion mask;
``DataCollatorForLanguageModeling``: ids, attention mask, labels; with ``padding_free`` one row of
the samples end to end, ``position_ids`` and the sequences' bounds), with no padding: every
sample is ``seq_len`` long, the prompt half of it (for DPO, and for SFT's ``completion_only_loss``).
TRL's metrics read values (``.item()``, ``if total > 0``): those reads are answered 1 — a
Python number for a log, with no tensor behind it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from types import FrameType, SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.trainer import TrlSettings
from memcalc.engine.model import ModelInputs, ReadsFn, ResolvedModel
from memcalc.engine.step_backend import available_autocast_region
from memcalc.engine.step_spec import Step
from memcalc.engine.trace import ReadOracle
from memcalc.stacks.peft import PEFT_MODEL
from memcalc.stacks.transformers.reads import hf_reads
from memcalc.stacks.trl import grpo
from memcalc.stacks.trl.config import import_trl

__all__ = ("TrlStepModule", "trl_model")


class TrlStepModule(nn.Module):
    """The policy (``policy``) and DPO's frozen reference (``reference``), whose forward is the
    TRL trainer's ``compute_loss``; it returns ``{"loss": loss}`` as a model's own loss."""

    def __init__(self, policy: nn.Module, reference: nn.Module | None, compute_loss: Callable[..., Any],
                 autocast_dtype: torch.dtype | None, cuda: bool) -> None:
        super().__init__()
        self.policy = policy
        if reference is not None:
            self.reference = reference
        self._compute_loss = compute_loss
        self._autocast_dtype = autocast_dtype
        self._cuda = cuda
        #: Under ZeRO-3, DeepSpeed's ``GatheredParameters`` over given parameters, yielding their
        #: gathered tensors (set by the rank program: memcalc.distributed.strategy.deepspeed_zero)
        self.zero3_gather: Callable[[Sequence[torch.Tensor | None]],
                                    AbstractContextManager[list[torch.Tensor | None]]] | None = None

    def forward(self, **inputs: Any) -> dict[str, torch.Tensor]:
        _TRITON_RULES["on"] = self._cuda  # for this step's forward and the backward that follows it
        _ZERO3.gather = self.zero3_gather
        with _meta_autocast(self._autocast_dtype), _BoolMaskIndex():  # type: ignore[no-untyped-call]
            return {"loss": self._compute_loss(self.policy, dict(inputs))}

    def train(self, mode: bool = True) -> TrlStepModule:
        super().train(mode)
        if isinstance(self.reference if hasattr(self, "reference") else None, nn.Module):
            self.reference.eval()  # DPOTrainer prepares it with evaluation_mode=True
        return self


class _BoolMaskIndex(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """``x[mask]`` as torch runs it, ``x[mask.nonzero().unbind(1)]``: TRL's metrics select the
    completion tokens so (``chosen_mean_logits[chosen_mask.bool()].sum()``); the tracer then
    asks how many rows the ``nonzero`` finds (:func:`_reads`) instead of giving up on a
    boolean index, which meta tensors cannot run."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            indices: list[Any] = []
            for index in args[1]:
                if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                    indices.extend(torch.ops.aten.nonzero.default(index).unbind(1))
                else:
                    indices.append(index)
            return func(args[0], indices)
        return func(*args, **(kwargs or {}))


#: Whether the step estimated is a CUDA one, where TRL's chunked log-prob kernel runs its Triton
#: folds (set by each forward: estimates run one at a time).
_TRITON_RULES = {"on": False}


def _install_triton_rules(kernels: Any) -> None:
    """On a CUDA target, ``trl.kernels.chunked_logprob`` folds each ``(tokens, vocab chunk)``
    tile with Triton kernels (``_use_triton``: Triton installed and a CUDA device), which write
    in place into the tile and the running statistics and allocate nothing; and accumulates the
    gradient GEMMs with ``torch.addmm(..., out_dtype=float32, out=acc)`` (``_addmm_fp32``), with
    no float32 copies of its operands. On meta ``_use_triton`` is False, so its torch folds
    (``_forward_tile``, ``_backward_tile``: tile-sized float32 temporaries) and the copying
    ``addmm_`` would run: for a CUDA target they are replaced by what the Triton path allocates
    (nothing); for the CPU target they run as TRL wrote them. Installed once, idempotently."""
    if getattr(kernels, "_memcalc_rules", False):
        return
    forward_tile, backward_tile, addmm = kernels._forward_tile, kernels._backward_tile, kernels._addmm_fp32

    def fold_forward(tile: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not (_TRITON_RULES["on"] and tile.is_meta):
            forward_tile(tile, *args, **kwargs)

    def fold_backward(tile: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not (_TRITON_RULES["on"] and tile.is_meta):
            backward_tile(tile, *args, **kwargs)

    def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if not (_TRITON_RULES["on"] and acc.is_meta):
            addmm(acc, a, b)

    kernels._forward_tile, kernels._backward_tile, kernels._addmm_fp32 = fold_forward, fold_backward, addmm_fp32
    setattr(kernels, "_memcalc_rules", True)  # noqa: B010  # a module attribute of ours, in TRL's module


class _Zero3Head:
    """Under ZeRO-3 (``_ZERO3.gather`` set by the step's forward), what TRL's fused LM head does there:
    it reads ``lm_head.weight`` without calling the module, so no hook of DeepSpeed's gathers it, and
    ``trl.trainer.utils.maybe_gather_lm_head_ctx`` wraps the chunked log-prob forward, and its
    backward again, in ``deepspeed.zero.GatheredParameters`` over the head's weight and bias when they
    are not AVAILABLE. On meta, transformers' ``is_deepspeed_zero3_enabled()`` is False (no DeepSpeed
    config is registered) and DeepSpeed is not imported: that context is the rank program's
    (``gather``), and the kernel is handed the gathered tensors (``swap``), which DeepSpeed gives it by
    swapping ``param.data`` under the same parameter."""

    def __init__(self) -> None:
        self.gather: Callable[[Sequence[torch.Tensor | None]],
                              AbstractContextManager[list[torch.Tensor | None]]] | None = None
        self.swap: dict[int, torch.Tensor | None] = {}


_ZERO3 = _Zero3Head()


def _install_zero3_head(utils: Any) -> None:
    """Route ``maybe_gather_lm_head_ctx`` and the fused head's ``_ChunkedLogProbFunction.apply`` (both
    looked up in ``trl.trainer.utils`` at call time; the kernel's backward imports the context from
    there) through :class:`_Zero3Head`; with no ZeRO-3 program they are TRL's. Installed once."""
    if getattr(utils, "_memcalc_zero3", False):
        return
    original_ctx, function = utils.maybe_gather_lm_head_ctx, utils._ChunkedLogProbFunction

    @contextmanager
    def gathered(gather: Callable[[Sequence[torch.Tensor | None]], AbstractContextManager[list[Any]]],
                 params: tuple[torch.Tensor | None, ...]) -> Iterator[None]:
        with gather(params) as tensors:
            previous = _ZERO3.swap
            _ZERO3.swap = {id(p): t for p, t in zip(params, tensors, strict=True) if p is not None}
            try:
                yield
            finally:
                _ZERO3.swap = previous

    def maybe_gather_lm_head_ctx(*params: torch.Tensor | None) -> AbstractContextManager[None]:
        gather = _ZERO3.gather
        return original_ctx(*params) if gather is None else gathered(gather, params)

    class ChunkedLogProb:
        @staticmethod
        def apply(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args: Any) -> Any:
            swap = _ZERO3.swap
            return function.apply(hidden, swap.get(id(weight), weight),
                                  None if bias is None else swap.get(id(bias), bias), *args)

    utils.maybe_gather_lm_head_ctx, utils._ChunkedLogProbFunction = maybe_gather_lm_head_ctx, ChunkedLogProb
    setattr(utils, "_memcalc_zero3", True)  # noqa: B010  # a module attribute of ours, in TRL's module


@contextmanager
def _meta_autocast(dtype: torch.dtype | None) -> Iterator[None]:
    """``torch.is_autocast_enabled("meta")`` / ``torch.get_autocast_dtype("meta")`` answered as
    on the device under the step's amp (memcalc emulates autocast; torch has none for meta and
    raises). TRL's chunked log-prob kernel picks its tiles' dtype so (``compute_dtype``)."""
    enabled, get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_enabled(*device: Any) -> bool:
        return dtype is not None if device and device[0] == "meta" else enabled(*device)

    def autocast_dtype(device: str) -> torch.dtype:
        return dtype if device == "meta" and dtype is not None else get_dtype(device)

    torch.is_autocast_enabled, torch.get_autocast_dtype = is_enabled, autocast_dtype  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, get_dtype


class _Accelerator:
    """What ``compute_loss`` asks of accelerate on one process: gathers are the tensor itself,
    the unwrapped model the model; ``autocast()`` opens the step's emulated autocast region
    (:attr:`region`: none unless a GRPO step under amp sets it, as its forward begins)."""

    parallelism_config = None
    num_processes = 1
    process_index = 0
    is_main_process = True
    sync_gradients = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.region: Callable[[], AbstractContextManager[Any]] = nullcontext

    def gather_for_metrics(self, value: Any) -> Any:
        return value

    def gather(self, value: Any) -> Any:
        return value

    def reduce(self, value: Any, reduction: str = "sum") -> Any:
        return value

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self) -> AbstractContextManager[Any]:
        return self.region()


def trl_model(resolved: ResolvedModel, step: Step) -> ResolvedModel:
    """``resolved`` (fine-tuned already: PEFT's model when LoRA) as TRL's trainer runs it, with
    the batch of its collator (module docstring)."""
    record = step.trainer_args
    assert record is not None and record.trl is not None  # fields.build_step read the config
    settings = record.trl
    trl = import_trl(f"loop {step.loop.name}")
    policy = resolved.module.__dict__.get(PEFT_MODEL, resolved.module)  # the PeftModel of --lora
    peft = _is_peft(policy)
    base: Any = policy.get_base_model() if peft else policy
    _check_head(base, settings.trainer, resolved.name, step.loop.name)
    utils = importlib.import_module("trl.trainer.utils")
    if settings.get("disable_dropout", False):
        utils.disable_dropout_in_model(policy)
    reference = None
    if settings.trainer == "grpo":
        return _grpo_model(resolved, step, trl, policy, base, peft)
    if settings.trainer == "reward":
        trainer_cls = trl.RewardTrainer
        text = base.config.get_text_config()
        if text.pad_token_id is None:  # RewardTrainer sets it from the tokenizer's pad token (id 0 here)
            text.pad_token_id = 0
    elif settings.trainer == "dpo":
        trainer_cls = trl.DPOTrainer
        outputs: tuple[str, ...] = ("log_probs", "entropy", "mean_logits", "is_top1")
        if settings.get("use_weighting"):
            outputs += ("log_sum_sq_probs",)
        if not peft and not settings.get("precompute_ref_log_probs"):
            reference = copy.deepcopy(base)
            reference.requires_grad_(False)
            reference.eval()
    else:
        trainer_cls = trl.SFTTrainer
        outputs = ("log_probs", "entropy", "is_top1")
    if settings.trainer != "reward":
        utils.add_fused_lm_head(base, outputs=outputs)
    if reference is not None:
        utils.add_fused_lm_head(reference)
    trainer = _trainer(trainer_cls, settings, policy, reference, step, _device(policy))
    module = TrlStepModule(policy, reference, lambda model, inputs: trainer_cls.compute_loss(trainer, model, inputs),
                           step.precision.compute_dtype if step.precision.is_amp else None, step.emulate_cuda)
    _install_triton_rules(importlib.import_module("trl.kernels.chunked_logprob"))
    _install_zero3_head(utils)
    inputs = _batch(resolved.inputs, settings, step)
    notes = (*resolved.notes, _note(settings, reference is not None, trl.__version__, resolved.batch_size))
    checkpointing = resolved.checkpointing
    return replace(
        resolved, module=module, inputs=inputs, labels=None, notes=notes,
        checkpointing=(None if checkpointing is None
                       else lambda m, fn, which: checkpointing(_policy_of(m), fn, which)),
        reads=_reads(resolved.reads, bool(settings.get("padding_free") or settings.get("packing"))),
        build_real=_no_real(step.loop.name), separate_models=("reference",) if reference is not None else (),
        trained_root="policy", block_containers=_containers(policy, base, resolved.block_containers))


def _grpo_model(resolved: ResolvedModel, step: Step, trl: Any, policy: nn.Module, base: Any,
                peft: bool) -> ResolvedModel:
    """``GRPOTrainer.__init__``'s models (the policy's fused head with log-probs and entropy; a frozen
    reference with a bare one when ``beta != 0`` without LoRA) in :class:`GrpoStepModule`."""
    settings = step.trainer_args.trl  # type: ignore[union-attr]  # trl_model checked it
    assert settings is not None
    plan = grpo.grpo_plan(settings, resolved.batch_size, step.accum_steps)
    utils = importlib.import_module("trl.trainer.utils")
    if settings.get("disable_dropout", False):
        utils.disable_dropout_in_model(policy)
    reference = None
    if plan.reference and not peft:
        reference = copy.deepcopy(base)  # GRPOTrainer loads the checkpoint again (create_model_from_path)
        reference.requires_grad_(False)
        reference.eval()
    temperature = settings.get("temperature", 1.0)
    utils.add_fused_lm_head(base, temperature=temperature, outputs=("log_probs", "entropy"))
    if reference is not None:
        utils.add_fused_lm_head(reference, temperature=temperature)
    eos = grpo.eos_token_ids(base)
    accelerator = _Accelerator(_device(policy))
    trainer = grpo.grpo_trainer(trl, settings, policy, reference, step, accelerator, eos)
    reads = grpo.Reads(plan.completion)
    amp = step.precision.is_amp
    autocast_dtype = step.precision.compute_dtype if amp else None
    cuda = step.emulate_cuda
    if amp:
        for prepared in (policy, reference):
            if prepared is not None:
                _prepare_forward(prepared, accelerator)

    @contextmanager
    def wrap(module: grpo.GrpoStepModule) -> Iterator[None]:
        _TRITON_RULES["on"] = cuda
        accelerator.region = available_autocast_region() or nullcontext
        _ZERO3.gather = module.zero3_gather
        with _meta_autocast(autocast_dtype), _BoolMaskIndex():  # type: ignore[no-untyped-call]
            yield

    module = grpo.GrpoStepModule(policy, reference, trainer, plan, grpo.generation_config(base, settings, eos),
                                 reads, wrap, gather_for_generation=bool(settings.get("ds3_gather_for_generation",
                                                                                      True)))
    _install_triton_rules(importlib.import_module("trl.kernels.chunked_logprob"))
    _install_zero3_head(utils)
    prompt = int(resolved.inputs.kwargs["input_ids"].shape[1]) if "input_ids" in resolved.inputs.kwargs else 0
    inputs = grpo.grpo_batch(resolved.inputs, plan, step.loop.name)
    kind = ("none (beta = 0)" if not plan.reference else "the policy with its adapters disabled (PEFT)" if peft
            else "a frozen copy of the policy")
    notes = (*resolved.notes, grpo.grpo_note(plan, int(inputs.kwargs["input_ids"].shape[1]) or prompt,
                                             trl.__version__, kind))
    checkpointing = resolved.checkpointing
    return replace(
        resolved, module=module, inputs=inputs, labels=None, notes=notes,
        checkpointing=(None if checkpointing is None
                       else lambda m, fn, which: checkpointing(_policy_of(m), fn, which)),
        reads=grpo.grpo_reads(reads, _innermost_library), build_real=_no_real(step.loop.name),
        block_containers=_containers(policy, base, resolved.block_containers), opens_autocast=amp,
        separate_models=("reference",) if reference is not None else (), trained_root="policy")


def _prepare_forward(model: nn.Module, accelerator: _Accelerator) -> None:
    """What ``Accelerator.prepare_model`` does to a model's forward under mixed precision (the
    policy's, and the reference's with ``evaluation_mode=True``): each call is one autocast region,
    its 16-bit outputs copied to float32 (accelerate's own ``convert_outputs_to_fp32``). Only a
    call of the prepared model's forward is so: with LoRA the prepared model is the ``PeftModel``,
    whose ``generate`` runs the base model's forward, outside any region (``GRPOTrainer``'s
    generation then runs in the weights' dtype), where TRL's scoring and training forwards open
    ``accelerator.autocast()`` themselves."""
    convert_outputs_to_fp32 = importlib.import_module("accelerate.utils").convert_outputs_to_fp32
    forward = model.forward

    @functools.wraps(forward)  # as torch.autocast's decorator: generate() reads the forward's signature
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(autocast_forward)


def _check_head(base: Any, trainer: str, name: str, loop: str) -> None:
    """SFT and DPO train a causal language model (TRL's fused head projects through its output
    embeddings); the reward trainer a sequence classifier (one that ``RewardTrainer`` loads itself
    has ``num_labels=1``; one given to it keeps its own, whose scores it splits the same way)."""
    if trainer == "reward":
        if not type(base).__name__.endswith("ForSequenceClassification"):
            raise InapplicableOptionError(f"loop {loop}: {name} is not a sequence classifier (RewardTrainer scores "
                                          f"each sequence)", hint="Give --task sequence-classification.")
        return
    if not hasattr(base, "get_output_embeddings") or base.get_output_embeddings() is None:
        raise InapplicableOptionError(f"loop {loop}: {name} has no language-model head (TRL's "
                                      f"{trainer.upper()}Trainer trains causal language models)",
                                      hint="Give a causal language model (an hf: config of a *ForCausalLM).")


def _containers(policy: nn.Module, base: nn.Module, containers: tuple[str, ...]) -> tuple[str, ...]:
    """The resolved model's block containers (paths in ``base``) as paths in the TRL module, whose
    ``policy`` is ``base`` or, with LoRA, the ``PeftModel`` around it (``base_model.model``)."""
    inner = next(name for name, module in policy.named_modules() if module is base)
    prefix = f"policy.{inner}." if inner else "policy."
    return tuple(prefix + c for c in containers)


def _policy_of(module: nn.Module) -> nn.Module:
    policy = module.get_submodule("policy")
    return policy


def _is_peft(module: nn.Module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "disable_adapter")


def _device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("meta"))


def _trainer(cls: type, settings: TrlSettings, policy: nn.Module, reference: nn.Module | None, step: Step,
             device: torch.device) -> Any:
    """An instance of the installed trainer class holding what its ``compute_loss`` reads (the
    attributes ``DPOTrainer.__init__`` / ``SFTTrainer.__init__`` set from the config)."""
    trainer: Any = object.__new__(cls)
    values = dict(settings.values)
    args = SimpleNamespace(**{"loss_type": "nll", **values},
                           gradient_checkpointing_kwargs={"use_reentrant": step.checkpoint.reentrant},
                           average_tokens_across_devices=False)
    config: Any = getattr(policy, "config", None)
    coef = values.get("router_aux_loss_coef")
    text = config.get_text_config() if config is not None else None
    aux_coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    state: dict[str, Any] = {
        "args": args, "model": policy, "ref_model": reference, "accelerator": _Accelerator(device),
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)}, "_total_train_tokens": 0,
        "_tp_size": 1, "maybe_activation_offload_context": nullcontext(), "router_aux_loss_coef": aux_coef,
        "aux_loss_enabled": hasattr(text, "output_router_logits") and aux_coef != 0.0,
        "compute_loss_func": None, "label_smoother": None, "current_gradient_accumulation_steps": step.accum_steps,
    }
    if settings.trainer == "dpo":
        loss_types = values.get("loss_type") or ("sigmoid",)
        loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types)
        state.update(
            beta=values.get("beta", 0.1), precompute_ref_logps=bool(values.get("precompute_ref_log_probs")),
            loss_types=loss_types, loss_weights=list(values.get("loss_weights") or [1.0] * len(loss_types)),
            ld_alpha=values.get("ld_alpha"), f_divergence_type=values.get("f_divergence_type", "reverse_kl"),
            f_alpha_divergence_coef=values.get("f_alpha_divergence_coef", 0.5),
            label_smoothing=values.get("label_smoothing", 0.0), use_weighting=bool(values.get("use_weighting")))
    trainer.__dict__.update(state)
    return trainer


def _batch(inputs: ModelInputs, settings: TrlSettings, step: Step) -> ModelInputs:
    """The collator's batch for the resolved model's ``input_ids`` (module docstring)."""
    ids = inputs.kwargs.get("input_ids") if inputs.kwargs else (inputs.args[0] if inputs.args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InapplicableOptionError(f"loop {step.loop.name} needs token ids (batch, seq_len) as the model's input; "
                                      f"got {inputs.description}", hint="Give --seq-len N.")
    batch, length = ids.shape
    max_length = settings.get("max_length")
    if isinstance(max_length, int) and length > max_length:
        raise InapplicableOptionError(f"seq_len {length} is longer than the config's max_length {max_length}: "
                                      f"TRL truncates every sequence to it",
                                      hint=f"Give --seq-len {max_length} or less, or raise max_length.")
    device = ids.device

    def long(rows: int) -> torch.Tensor:
        return torch.empty(rows, length, dtype=torch.long, device=device)

    if settings.trainer == "reward":  # reward_trainer.DataCollatorForPreference: chosen rows, then rejected
        return ModelInputs((), {"input_ids": long(2 * batch), "attention_mask": long(2 * batch)})
    if settings.trainer == "dpo":
        rows = 2 * batch  # DataCollatorForPreference: the chosen rows, then the rejected ones
        out = {"input_ids": long(rows), "attention_mask": long(rows), "completion_mask": long(rows)}
        if settings.get("precompute_ref_log_probs"):
            out["ref_chosen_logps"] = torch.empty(batch, dtype=torch.float32, device=device)
            out["ref_rejected_logps"] = torch.empty(batch, dtype=torch.float32, device=device)
        return ModelInputs((), out)
    if settings.get("padding_free") or settings.get("packing"):  # BFD packing is padding-free (SFTTrainer.__init__)
        # the collator's padding-free batch: the samples end to end in one row, positions restarting at
        # each, the sequences' bounds for varlen kernels (cu_seq_lens, int32) and each token's sequence
        tokens = batch * length
        flat = {"input_ids": torch.empty(1, tokens, dtype=torch.long, device=device),
                "labels": torch.empty(1, tokens, dtype=torch.long, device=device),
                "position_ids": torch.empty(1, tokens, dtype=torch.long, device=device),
                "cu_seq_lens_q": torch.empty(batch + 1, dtype=torch.int32, device=device),
                "cu_seq_lens_k": torch.empty(batch + 1, dtype=torch.int32, device=device),
                "max_length_q": length, "max_length_k": length,
                "seq_idx": torch.empty(1, tokens, dtype=torch.int32, device=device)}
        return ModelInputs((), flat)
    out = {"input_ids": long(batch), "attention_mask": long(batch), "labels": long(batch)}
    return ModelInputs((), out)


def _reads(model_reads: ReadsFn | None, packed: bool) -> ReadsFn:
    """The model's own reads (transformers'), then TRL's metrics': any value read in TRL's code
    is a number logged, answered 1. A padding-free batch (``packed``) holds several sequences in
    its row: transformers' ``find_packed_sequence_indices`` then finds them (``(mask[:, -1] ==
    0).all()`` is False), where memcalc's ordinary batch answers True. The collator's attention
    mask pads nothing (every row is ``seq_len`` tokens): transformers' reads of it are answered as
    for an unpadded prompt (:data:`~memcalc.stacks.transformers.reads.GENERATION_READS`: the mask
    all ones, no causal mask built for SDPA)."""
    def reads(mode: Mode, new_tokens: int | None) -> ReadOracle:
        inner = model_reads(mode, new_tokens) if model_reads is not None else None
        unpadded = hf_reads(Mode.GENERATE, None)

        def oracle(tensor: torch.Tensor) -> bool | int | float | torch.Tensor | None:
            library, function = _innermost_library()
            if library == "trl":
                return 1 if not tensor.dtype.is_floating_point else 1.0
            if packed and function == "find_packed_sequence_indices":
                return False
            answer = inner(tensor) if inner is not None else None
            return unpadded(tensor) if answer is None else answer
        return oracle
    return reads


#: memcalc's source folder, as it appears in a frame's file name.
_OWN = f"{os.sep}memcalc{os.sep}"


def _innermost_library() -> tuple[str, str]:
    """The innermost frame of a library (transformers or TRL) on the stack: which, and its function."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if _OWN in name:  # memcalc's own frames (memcalc/stacks/trl/ would pass for TRL's)
            frame = frame.f_back
            continue
        for library in ("trl", "transformers"):
            if f"/{library}/" in name:
                return library, frame.f_code.co_name
        frame = frame.f_back
    return "", ""


def _no_real(loop: str) -> Callable[[torch.device], tuple[nn.Module, ModelInputs]]:
    def build(device: torch.device) -> tuple[nn.Module, ModelInputs]:
        raise InapplicableOptionError(f"--measure does not run loop {loop}: run TRL's trainer itself and read "
                                      f"torch.cuda.max_memory_allocated()")
    return build


def _note(settings: TrlSettings, frozen_copy: bool, version: str, batch: int) -> str:
    if settings.trainer == "sft":
        return f"TRL {version} SFTTrainer.compute_loss on meta: the fused LM head's chunked log-probabilities"
    if settings.trainer == "reward":
        return (f"TRL {version} RewardTrainer.compute_loss on meta: chosen and rejected rows scored in one forward "
                f"(the batch of {batch} pairs is {2 * batch} rows)")
    reference = ("a frozen copy of the policy" if frozen_copy else "precomputed log-probs in the batch"
                 if settings.get("precompute_ref_log_probs") else "the policy with its adapters disabled (PEFT)")
    return (f"TRL {version} DPOTrainer.compute_loss on meta: chosen and rejected rows in one forward (the batch "
            f"of {batch} pairs is {2 * batch} rows), the reference: {reference}")



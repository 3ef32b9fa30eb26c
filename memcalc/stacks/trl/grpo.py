"""TRL's ``GRPOTrainer`` on meta: each training step generates, scores, then learns.

``GRPOTrainer.training_step`` is Trainer's (memcalc's ``trainer`` loop), but its
``_prepare_inputs`` first makes the batch: every ``steps_per_generation × num_iterations`` steps
it runs ``_generate_and_score_completions`` over the *generation batch* (``generation_batch_size``
rows: ``generation_batch_size / num_generations`` prompts, each ``num_generations`` times), then
shuffles it and buffers it in ``steps_per_generation`` slices, one per step. So
:class:`GrpoStepModule`'s forward is, in TRL's order (trl 1.16, grpo_trainer.py):

1. **generation** (:attr:`Phase.PREFILL`, :attr:`Phase.DECODE`): the policy's own ``generate()``
   under ``torch.no_grad()`` with the ``GenerationConfig`` ``GRPOTrainer.__init__`` builds
   (sampling, ``max_new_tokens=max_completion_length``, ``generation_kwargs`` laid over it); each
   completion runs to ``max_completion_length`` (the reads of its stop check say so);
2. **scoring** (:attr:`Phase.SCORING`): the tensors ``_generate_and_score_completions`` builds
   from the completions (it reads them to the host as token lists, then pads them back: prompt and
   completion ids and masks), and under ``torch.no_grad()`` TRL's own
   ``_get_per_token_logps_and_entropies`` in chunks of ``per_device_train_batch_size`` rows: the old
   policy's log-probs when ``gradient_accumulation_steps`` is not a multiple of
   ``steps_per_generation × num_iterations``, the reference's when ``beta != 0`` (a frozen copy of
   the policy, which ``GRPOTrainer`` loads again; with LoRA, the policy with its adapters
   disabled: ``use_adapter(model, None)``). Rewards are the user's functions on the host: only
   their ``(rows, functions)`` float32 tensor and the advantages are on the device (a reward
   *model* is not followed). TRL's own ``shuffle_sequence_dict`` and ``split_tensor_dict`` make
   the buffer, which lives until the next generation has replaced it;
3. **training** (the forward, loss, backward): TRL's own ``GRPOTrainer.compute_loss`` over the
   step's slice, ``prompt + completion`` tokens a row, through TRL's fused LM head.

The report gives the peak of each part (``phase_peaks``: generation — 1 and 2 — and training).
The drawn batch is the generation batch's prompt ids and attention mask (what ``generate`` gets
on the device); one is drawn every micro-batch, as TRL's dataloader draws the prompts' text.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.trainer import TrlSettings
from memcalc.engine.model import ModelInputs, ReadsFn
from memcalc.engine.step_spec import Step
from memcalc.engine.trace import ReadOracle, StorageTracer
from memcalc.stacks.transformers.generate import cache_tensors, quiet_generation
from memcalc.stacks.transformers.reads import hf_reads

__all__ = ("GrpoPlan", "GrpoStepModule", "Reads", "eos_token_ids", "generation_config", "grpo_batch", "grpo_note",
           "grpo_plan", "grpo_reads", "grpo_trainer")


@dataclass(frozen=True)
class GrpoPlan:
    """The batch sizes and schedule ``GRPOConfig.__post_init__`` derives, on one process.

    Attributes:
        batch: ``per_device_train_batch_size``: the rows of one training micro-batch.
        generations: ``num_generations``: completions per prompt.
        steps_per_generation: micro-batches each generation feeds.
        generation_rows: ``generation_batch_size``: the rows generated at once.
        completion: ``max_completion_length``.
        generate_every: steps between generations (``steps_per_generation × num_iterations``).
        old_log_probs: the old policy's log-probs are computed (``gradient_accumulation_steps``
            not a multiple of ``generate_every``).
        reference: ``beta != 0``: the reference's log-probs are computed.
    """

    batch: int
    generations: int
    steps_per_generation: int
    generation_rows: int
    completion: int
    generate_every: int
    old_log_probs: bool
    reference: bool


def grpo_plan(settings: TrlSettings, batch: int, accum_steps: int) -> GrpoPlan:
    """``GRPOConfig.__post_init__``'s sizes for one process.

    Raises:
        InvalidInputError: a generation batch that is not whole micro-batches or whole prompt groups.
    """
    generations = int(settings.get("num_generations", 8))
    rows, steps = settings.get("generation_batch_size"), settings.get("steps_per_generation")
    if rows is None and steps is None:
        steps = accum_steps
    if rows is not None:
        if rows % batch:
            raise InvalidInputError(f"GRPOConfig generation_batch_size ({rows}) must be a multiple of "
                                    f"per_device_train_batch_size ({batch})")
        steps = rows // batch
    rows = batch * int(steps)
    if rows % generations:
        raise InvalidInputError(f"GRPOConfig: the generation batch ({rows} rows) must be a multiple of num_generations "
                                f"({generations}): whole groups of completions of one prompt",
                                hint="GRPOConfig(...) refuses it too: change per_device_train_batch_size, "
                                     "steps_per_generation or num_generations.")
    every = int(steps) * int(settings.get("num_iterations", 1))
    return GrpoPlan(batch=batch, generations=generations, steps_per_generation=int(steps), generation_rows=rows,
                    completion=int(settings.get("max_completion_length", 512)), generate_every=every,
                    old_log_probs=accum_steps % every != 0, reference=settings.get("beta", 0.0) != 0.0)


class Reads:
    """The reads of the step, answered by the oracle of its current part: a fresh generation
    oracle for each ``generate()`` (its stop checks counted from 0), the forwards' otherwise."""

    def __init__(self, completion: int) -> None:
        self.completion = completion
        self.forward = hf_reads(Mode.GENERATE, None)  # an unpadded batch: masks all ones
        self.current: ReadOracle = self.forward

    @contextmanager
    def generating(self) -> Iterator[None]:
        self.current = hf_reads(Mode.GENERATE, self.completion)
        try:
            yield
        finally:
            self.current = self.forward


class GrpoStepModule(nn.Module):
    """The policy (``policy``) and the reference (``reference``, when ``beta != 0`` without LoRA),
    whose forward is one ``GRPOTrainer.training_step``'s ``_prepare_inputs`` and ``compute_loss``
    (module docstring); it returns ``{"loss": loss}`` as a model's own loss."""

    def __init__(self, policy: nn.Module, reference: nn.Module | None, trainer: Any, plan: GrpoPlan,
                 generation_config: Any, reads: Reads, wrap: Callable[[GrpoStepModule], Any],
                 gather_for_generation: bool = True) -> None:
        super().__init__()
        self.policy = policy
        if reference is not None:
            self.reference = reference
        self._trainer = trainer
        self._plan = plan
        self._generation_config = generation_config
        self._reads = reads
        self._wrap = wrap  # the contexts TRL's code runs in on meta (memcalc.stacks.trl.step)
        self._step = 0
        self._buffered: list[dict[str, Any]] | None = None
        #: ``ds3_gather_for_generation``: under ZeRO-3, generate() with every parameter gathered
        self.gather_for_generation = gather_for_generation
        #: Under ZeRO-3 (set by the rank program: memcalc.distributed.strategy.deepspeed_zero), DeepSpeed's
        #: ``GatheredParameters`` over given parameters, yielding their gathered tensors (TRL's fused head)
        self.zero3_gather: Callable[[Sequence[torch.Tensor | None]],
                                    AbstractContextManager[list[torch.Tensor | None]]] | None = None
        #: Under ZeRO-3, ``unwrap_model_for_generation``'s gathering of the policy's engine for generate()
        self.zero3_generation: Callable[[], AbstractContextManager[None]] | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        trl_utils = importlib.import_module("trl.trainer.utils")
        with self._wrap(self):
            plan = self._plan
            if self._step % plan.generate_every == 0 or self._buffered is None:
                batch = self._generate_and_score(input_ids, attention_mask)
                _set_phase(Phase.FORWARD)  # _prepare_inputs, after _generate_and_score_completions returned
                batch = trl_utils.shuffle_sequence_dict(batch)
                for value in batch.values():
                    if isinstance(value, torch.Tensor) and (tracer := _tracer()) is not None:
                        tracer.track(value, Category.INPUTS)  # the training steps' batch from here on
                self._buffered = trl_utils.split_tensor_dict(batch, plan.steps_per_generation)  # the old one dies
                del batch
            inputs = self._buffered[self._step % plan.steps_per_generation]
            self._step += 1
            _set_phase(Phase.FORWARD)
            loss = type(self._trainer).compute_loss(self._trainer, self.policy, inputs)
        return {"loss": loss}

    def train(self, mode: bool = True) -> GrpoStepModule:
        super().train(mode)
        if isinstance(getattr(self, "reference", None), nn.Module):
            self.reference.eval()  # GRPOTrainer prepares it with evaluation_mode=True
        return self

    def _generate_and_score(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``_generate_single_turn`` and ``_generate_and_score_completions``'s tensors (module docstring)."""
        plan, trainer, device = self._plan, self._trainer, ids.device
        rows, prompt = ids.shape
        whole = self.zero3_generation if self.gather_for_generation and self.zero3_generation is not None else None
        with self._generating(), whole() if whole is not None else nullcontext(), torch.no_grad():
            sequences = self.policy.generate(input_ids=ids, attention_mask=mask,  # type: ignore[operator]
                                             generation_config=self._generation_config)
        _set_phase(Phase.SCORING)
        completion = sequences[:, prompt:]
        # the completion mask cut at the first EOS, read to the host with the ids (no EOS: nothing is cut)
        is_eos = torch.isin(completion, torch.tensor(trainer.eos_token_ids, device=device))
        eos_idx = torch.full((rows,), is_eos.size(1), dtype=torch.long, device=device)
        has_eos, first_eos = is_eos.any(dim=1), is_eos.int().argmax(dim=1)
        indices = torch.arange(is_eos.size(1), device=device).expand(rows, -1)
        cut = (indices <= eos_idx.unsqueeze(1)).int()
        del sequences, completion, is_eos, eos_idx, has_eos, first_eos, indices, cut
        # the token lists padded again and moved to the device
        def long(columns: int) -> torch.Tensor:
            return torch.empty(rows, columns, dtype=torch.long, device=device)

        prompt_ids, prompt_mask = long(prompt), long(prompt)
        completion_ids, completion_mask = long(plan.completion), long(plan.completion)
        num_items_in_batch = completion_mask.sum()
        prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        full_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        scored: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if plan.old_log_probs:
                scored["old_per_token_logps"] = self._log_probs(self.policy, prompt_completion_ids, full_mask)
            if plan.reference:
                scored["ref_per_token_logps"] = self._reference_log_probs(prompt_completion_ids, full_mask)
        del prompt_completion_ids, full_mask
        # the user's reward functions run on the host: their (rows, functions) table and the advantages
        rewards_per_func = torch.zeros(rows, 1, dtype=torch.float32, device=device)
        rewards = rewards_per_func.nansum(dim=1)
        grouped = rewards.view(-1, plan.generations)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(plan.generations, dim=0)
        std = grouped.std(dim=1).repeat_interleave(plan.generations, dim=0)
        advantages = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
        del rewards_per_func, rewards, grouped, mean, std
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": completion_mask, "advantages": advantages,
                "num_items_in_batch": num_items_in_batch, **scored}

    def _log_probs(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        trainer = self._trainer
        logps, _, _ = type(trainer)._get_per_token_logps_and_entropies(
            trainer, model, ids, mask, self._plan.completion, batch_size=self._plan.batch)
        return logps  # type: ignore[no-any-return]

    def _reference_log_probs(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "reference"):
            return self._log_probs(self.reference, ids, mask)
        use_adapter = importlib.import_module("trl.trainer.utils").use_adapter
        with use_adapter(self.policy, adapter_name=None):  # PEFT: the adapters disabled are the reference
            return self._log_probs(self.policy, ids, mask)

    @contextmanager
    def _generating(self) -> Iterator[None]:
        """generate()'s forwards as phases (the first the prefill, each later one a decode step),
        their caches marked as the KV cache, its reads answered by a generation's oracle."""
        forwards = 0

        def starts(_module: nn.Module, _args: Any) -> None:
            nonlocal forwards
            _set_phase(Phase.PREFILL if forwards == 0 else Phase.DECODE)
            forwards += 1

        def ends(_module: nn.Module, _args: Any, output: Any) -> None:
            if (tracer := _tracer()) is not None:
                for tensor in cache_tensors(output):
                    if tensor.device.type == tracer.device_type:
                        tracer.track(tensor, Category.KV_CACHE)

        _set_phase(Phase.PREFILL)  # generate()'s setup: the cache, the processors
        handles = [self.policy.register_forward_pre_hook(starts), self.policy.register_forward_hook(ends)]
        try:
            with self._reads.generating(), quiet_generation():
                yield
        finally:
            for handle in handles:
                handle.remove()


def _tracer() -> StorageTracer | None:
    """The storage tracer the step runs under (None: a run without one)."""
    return next((mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, StorageTracer)), None)


def _set_phase(phase: Phase) -> None:
    if (tracer := _tracer()) is not None:
        tracer.set_phase(phase)


def generation_config(policy: nn.Module, settings: TrlSettings, eos_ids: list[int]) -> Any:
    """The ``GenerationConfig`` ``GRPOTrainer.__init__`` builds (its non-vLLM branch): sampling,
    the config's sampling settings, ``generation_kwargs`` over them; the pad id the tokenizer's
    (here the model's, else the first EOS id, else 0)."""
    from transformers import GenerationConfig

    config: Any = getattr(policy, "config", None)
    text = config.get_text_config() if config is not None else None
    pad = getattr(text, "pad_token_id", None)
    kwargs: dict[str, Any] = {
        "max_new_tokens": settings.get("max_completion_length", 512), "do_sample": True,
        "pad_token_id": pad if pad is not None else (eos_ids[0] if eos_ids else 0),
        "bos_token_id": getattr(text, "bos_token_id", None), "eos_token_id": eos_ids,
        "temperature": settings.get("temperature", 1.0), "top_p": settings.get("top_p", 1.0),
        "top_k": settings.get("top_k", 0), "min_p": settings.get("min_p"),
        "repetition_penalty": settings.get("repetition_penalty", 1.0),
        "cache_implementation": settings.get("cache_implementation"),
    }
    kwargs.update(dict(settings.get("generation_kwargs") or ()))
    return GenerationConfig(**kwargs, disable_compile=True)  # type: ignore[no-untyped-call]


def eos_token_ids(policy: nn.Module) -> list[int]:
    """``GRPOTrainer.__init__``'s ``eos_token_ids``: the model's generation config's, with the
    tokenizer's EOS id in front when it is not among them. memcalc has no tokenizer: the config's
    ids stand for it, and a config that names none gets id 0 (every tokenizer TRL accepts has an
    EOS token, and which id it is changes no size: the logits processors that mask it, such as
    ``min_new_tokens``'s, then run as they do in the real step)."""
    generation: Any = getattr(policy, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        config: Any = getattr(policy, "config", None)
        eos = getattr(config.get_text_config(), "eos_token_id", None) if config is not None else None
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return ids or [0]


def grpo_trainer(trl: Any, settings: TrlSettings, policy: nn.Module, reference: nn.Module | None, step: Step,
                 accelerator: Any, eos_ids: list[int]) -> Any:
    """A ``GRPOTrainer`` holding what ``_get_per_token_logps_and_entropies`` and ``_compute_loss``
    read (the attributes ``GRPOTrainer.__init__`` sets from the config), on one process."""
    values = dict(settings.values)
    plan_steps = values.get("steps_per_generation") or step.accum_steps
    trainer: Any = object.__new__(trl.GRPOTrainer)
    config: Any = getattr(policy, "config", None)
    text = config.get_text_config() if config is not None else None
    coef = values.get("router_aux_loss_coef")
    aux_coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    epsilon = values.get("epsilon", 0.2)
    entropy_coef = values.get("entropy_coef", 0.0)
    trainer.__dict__.update(
        args=SimpleNamespace(**{**values, "steps_per_generation": plan_steps, "report_to": []},
                             gradient_checkpointing_kwargs={"use_reentrant": step.checkpoint.reentrant}),
        model=policy, ref_model=reference, accelerator=accelerator, beta=values.get("beta", 0.0),
        loss_type=values.get("loss_type", "dapo"), epsilon_low=epsilon,
        epsilon_high=values.get("epsilon_high") if values.get("epsilon_high") is not None else epsilon,
        importance_sampling_level=values.get("importance_sampling_level", "token"),
        off_policy_mask_threshold=values.get("off_policy_mask_threshold"),
        top_entropy_quantile=values.get("top_entropy_quantile", 1.0), router_aux_loss_coef=aux_coef,
        aux_loss_enabled=hasattr(text, "output_router_logits") and aux_coef != 0.0, use_vllm=False,
        vllm_importance_sampling_correction=False, max_completion_length=values.get("max_completion_length", 512),
        temperature=values.get("temperature", 1.0), entropy_coef=entropy_coef,
        use_adaptive_entropy=bool(values.get("use_adaptive_entropy")),
        _entropy_bonus_enabled=entropy_coef != 0.0 or bool(values.get("use_adaptive_entropy")),
        _entropy_window_stats=None, _last_world_entropy=0.0, current_gradient_accumulation_steps=step.accum_steps,
        _metrics={"train": _Metrics(), "eval": _Metrics()}, eos_token_ids=eos_ids,
        maybe_activation_offload_context=nullcontext())
    return trainer


class _Metrics(dict[str, list[Any]]):
    """TRL's ``defaultdict(list)`` of metrics (logged numbers, no tensors)."""

    def __missing__(self, key: str) -> list[Any]:
        self[key] = []
        return self[key]


def grpo_batch(inputs: ModelInputs, plan: GrpoPlan, loop: str) -> ModelInputs:
    """The generation batch's prompts as ``generate`` gets them: ids and an attention mask, int64,
    ``generation_batch_size`` rows of the resolved model's ``seq_len`` (the prompt length)."""
    ids = inputs.kwargs.get("input_ids") if inputs.kwargs else (inputs.args[0] if inputs.args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InapplicableOptionError(f"loop {loop} needs token ids (batch, seq_len) as the model's input: the "
                                      f"prompts; got {inputs.description}",
                                      hint="Give --seq-len N (the prompt length).")
    shape = (plan.generation_rows, ids.shape[1])
    return ModelInputs((), {"input_ids": torch.empty(shape, dtype=torch.long, device=ids.device),
                            "attention_mask": torch.empty(shape, dtype=torch.long, device=ids.device)})


def grpo_reads(holder: Reads, inner_library: Callable[[], tuple[str, str]]) -> ReadsFn:
    """The step's reads: TRL's own (its metrics' ``.item()``: a logged number) answered 1; the
    model's and generate()'s by the oracle of the step's current part."""
    def reads(_mode: Mode, _new_tokens: int | None) -> ReadOracle:
        def oracle(tensor: torch.Tensor) -> bool | int | float | torch.Tensor | None:
            library, _function = inner_library()
            if library == "trl":
                return 1 if not tensor.dtype.is_floating_point else 1.0
            return holder.current(tensor)
        return oracle
    return reads


def grpo_note(plan: GrpoPlan, prompt: int, version: str, reference: str) -> str:
    """What the report says of the GRPO step."""
    scoring = [name for name, on in (("old policy", plan.old_log_probs), ("reference", plan.reference)) if on]
    return (f"TRL {version} GRPOTrainer on meta: every {plan.generate_every} step(s), generate() of "
            f"{plan.generation_rows} completions ({plan.generation_rows // plan.generations} prompts × "
            f"{plan.generations}) of {plan.completion} tokens after {prompt}-token prompts"
            f"{', scored by the ' + ' and the '.join(scoring) if scoring else ''}; then compute_loss over "
            f"{plan.batch} rows of {prompt + plan.completion} tokens; the reference: {reference}")

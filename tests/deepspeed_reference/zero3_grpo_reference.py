"""Real DeepSpeed ZeRO-3 on the CPU running a GRPO step as TRL's ``GRPOTrainer`` does (two ranks over
gloo): the policy in a training engine (a torch Adam) with TRL's fused LM head; each step generates
through TRL's own ``unwrap_model_for_generation`` (``gather_deepspeed3_params`` =
``ds3_gather_for_generation``: True gathers every parameter for the whole ``generate()`` and takes
DeepSpeed's module hooks off; False generates with DeepSpeed's per-module gathers), scores the
completions with the frozen reference in the second engine TRL builds itself (``prepare_deepspeed``,
when ``beta != 0``), then runs the training forward through the engine, backward and the step.

Not run: ``GRPOTrainer`` itself (its ``__init__`` needs a tokenizer and a dataset, its rewards user
functions on the host); the calls above are the ones its ``_generate_single_turn``,
``_generate_and_score_completions`` and ``compute_loss`` make on the models, with TRL's and DeepSpeed's
own code. Recorded, for three steps: which parameters of each model are gathered (a bitmask over its
``named_parameters``) after each module's forward pre-hook and post-hook, after generation, after
backward and after each step. The reference for tests/test_trl_grpo_zero3.py. Run as
tests/deepspeed_reference/zero3_gathers.py says (DeepSpeed installed with ``DS_BUILD_OPS=0`` into DIR)::

    PYTHONPATH=DIR:. python tests/deepspeed_reference/zero3_grpo_reference.py tests/data/deepspeed_zero3_grpo.json
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch
import two_ranks as shared

PREFETCH = {"stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 10_000,
            "stage3_max_live_parameters": 60_000, "stage3_max_reuse_distance": 0}
NO_PREFETCH = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
               "stage3_max_reuse_distance": 0}
#: name: (the stage-3 settings, ds3_gather_for_generation, beta, steps_per_generation, LoRA). With
#: steps_per_generation 2 (gradient_accumulation_steps 1) the old policy's log-probs are computed too; with
#: LoRA (PEFT's default targets, r 8, adapters in the model's dtype as TRL makes them under ZeRO-3) the
#: reference is the policy with its adapters disabled. Both call the policy itself (TRL's ``self.model``),
#: not its engine.
CASES: dict[str, tuple[dict[str, int], bool, float, int, bool]] = {
    "gather-prefetch-beta": (PREFETCH, True, 0.04, 1, False),
    "gather-no-prefetch": (NO_PREFETCH, True, 0.0, 1, False),
    "layerwise-prefetch-beta": (PREFETCH, False, 0.04, 1, False),
    "layerwise-no-prefetch": (NO_PREFETCH, False, 0.0, 1, False),
    "gather-old-logps-beta": (PREFETCH, True, 0.04, 2, False),
    "lora-gather-beta": (PREFETCH, True, 0.04, 1, True),
    "lora-layerwise-no-prefetch-beta": (NO_PREFETCH, False, 0.04, 1, True),
}
#: per_device_train_batch_size, num_generations, the prompt's tokens, max_completion_length
BATCH, GENERATIONS, PROMPT, COMPLETION, STEPS = 4, 2, 8, 3, 3


def _run(name: str, extra: dict[str, int], gather: bool, beta: float, per_generation: int,
         lora: bool) -> dict[str, Any]:
    print(name, file=sys.stderr, flush=True)
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from trl.models import prepare_deepspeed
    from trl.trainer.utils import add_fused_lm_head

    config = shared.stage3_config(BATCH, extra)
    keep = HfDeepSpeedConfig(config)  # is_deepspeed_zero3_enabled(): TRL's head gathers for real
    policy = shared.small_llama()
    add_fused_lm_head(policy, outputs=("log_probs", "entropy"))
    reference = None
    if beta and not lora:
        reference = shared.frozen_copy(policy)
        add_fused_lm_head(reference)
    if lora:  # as GRPOTrainer does under ZeRO-3: adapters in the model's dtype
        policy = shared.with_lora(policy)
    trained = [p for p in policy.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=policy, optimizer=torch.optim.Adam(trained, lr=1e-3), config=config)
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config, zero_stage=3))
    accelerator = SimpleNamespace(state=state, unwrap_model=lambda model: model.module)
    ref_engine = None if reference is None else prepare_deepspeed(reference, accelerator)
    events: list[list[str]] = []
    models = {"policy": policy} if reference is None else {"policy": policy, "reference": reference}
    gathered = shared.gathered_masks(models)
    handles: list[Any] = []

    def probe() -> None:
        """The recording hooks, after DeepSpeed's: registered again after each generation, whose ``add_hooks``
        registers DeepSpeed's anew (which would then run after these)."""
        for handle in handles:
            handle.remove()
        handles[:] = shared.record_forward_hooks(models, events, gathered)

    probe()
    case = {"settings": extra, "ds3_gather_for_generation": gather, "beta": beta,
            "steps_per_generation": per_generation, "lora": shared.LORA_RANK if lora else None, "events": events}
    try:
        _steps(engine, ref_engine, accelerator, gather, beta, per_generation, events, gathered, probe)
    except AssertionError as error:  # DeepSpeed's own check failed: recorded, with the events before it
        return {**case, "error": str(error).rsplit(")", 1)[-1].strip()}
    finally:
        del keep
    return case


def _steps(engine: Any, ref_engine: Any, accelerator: Any, gather: bool, beta: float, per_generation: int,
           events: list[list[str]], gathered: Any, probe: Any) -> None:
    """GRPOTrainer's schedule (gradient_accumulation_steps 1): every ``per_generation`` steps a generation of
    ``per_generation × BATCH`` rows, scored in chunks of ``BATCH`` rows by the old policy (when
    ``per_generation`` > 1) and the reference (``beta``); each step trains on its slice."""
    import transformers
    from trl.models import unwrap_model_for_generation
    from trl.trainer.utils import use_adapter

    generation = transformers.GenerationConfig(max_new_tokens=COMPLETION, min_new_tokens=COMPLETION, do_sample=True,
                                               eos_token_id=2, pad_token_id=2)
    torch.manual_seed(1)
    prompts = torch.randint(3, shared.LLAMA["vocab_size"], (BATCH * per_generation, PROMPT))
    policy = engine.module
    for step in range(STEPS):
        print(f"step {step}", file=sys.stderr, flush=True)
        if step % per_generation == 0:
            with unwrap_model_for_generation(engine, accelerator, gather_deepspeed3_params=gather) as unwrapped, \
                    torch.no_grad():
                ids = unwrapped.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                         generation_config=generation)
            events.append([f"generated {step}", gathered()])
            probe()
            labels = ids.clone()
            labels[:, :-COMPLETION] = -100  # only the completion tokens are scored
            chunks = list(zip(ids.split(BATCH), labels.split(BATCH), strict=True))
            ref_logps = []
            with torch.no_grad():
                if per_generation > 1:  # the old policy's log-probs: self.model, the policy itself
                    for chunk, chunk_labels in chunks:
                        policy(input_ids=chunk, attention_mask=torch.ones_like(chunk), labels=chunk_labels,
                               fused_lm_head=True)
                for chunk, chunk_labels in chunks:
                    if ref_engine is not None:
                        ref = ref_engine(input_ids=chunk, attention_mask=torch.ones_like(chunk), labels=chunk_labels,
                                         fused_lm_head=True)
                    elif beta:  # LoRA: self.model with its adapters disabled
                        with use_adapter(policy, adapter_name=None):
                            ref = policy(input_ids=chunk, attention_mask=torch.ones_like(chunk), labels=chunk_labels,
                                         fused_lm_head=True)
                    else:
                        continue
                    ref_logps.append(ref.log_probs[:, -COMPLETION:])
        index = step % per_generation
        chunk, chunk_labels = chunks[index]
        out = engine(input_ids=chunk, attention_mask=torch.ones_like(chunk), labels=chunk_labels, fused_lm_head=True)
        logps = out.log_probs[:, -COMPLETION:]
        advantages = torch.randn(BATCH, 1)
        loss = -(torch.exp(logps - logps.detach()) * advantages).mean()  # GRPO's on-policy ratio
        if ref_logps:
            delta = ref_logps[index] - logps
            loss = loss + beta * (torch.exp(delta) - delta - 1).mean()
        shared.backward_and_step(engine, loss, step, events, gathered)


def main() -> None:
    out: dict[str, Any] = {**shared.start(trl=True), "config": shared.LLAMA, "batch": BATCH,
                           "num_generations": GENERATIONS, "prompt": PROMPT, "completion": COMPLETION,
                           "cases": {name: _run(name, *case) for name, case in CASES.items()}}
    shared.write_record(out)


if __name__ == "__main__":
    shared.run_on_two_ranks(__file__, main, "29627")

"""Real DeepSpeed ZeRO-3 on the CPU running TRL's DPO models (two ranks over gloo): the policy in a
training engine (a torch Adam), the frozen reference in the second engine TRL builds itself
(``trl.models.prepare_deepspeed``: the same stage-3 config, no optimizer, eval mode), both with
TRL's fused LM head (``add_fused_lm_head``; ``maybe_gather_lm_head_ctx`` gathers the head for real:
transformers' ``HfDeepSpeedConfig`` is registered). Each step is DPO's: the policy on the chosen
and rejected rows, the reference on them under ``no_grad``, the sigmoid loss, backward, step. A LoRA case
(:data:`LORA_CASES`) has no reference engine: the policy runs again with its adapters disabled.

Recorded, for three steps: which parameters of each model are gathered (a bitmask over its
``named_parameters``) after each module's forward pre-hook and post-hook, at the end of backward
before ``release_backward_leftovers`` (``leftovers``), after backward and after each step; and the
stage-3 settings the reference engine runs with (TRL's ``config_kwargs.update`` of dotted
``zero_optimization.*`` keys does not reach DeepSpeed's config). The reference for tests/test_trl_zero3.py.
Run as tests/deepspeed_reference/zero3_gathers.py says (DeepSpeed installed with ``DS_BUILD_OPS=0`` into
DIR)::

    PYTHONPATH=DIR:. python tests/deepspeed_reference/zero3_dpo_reference.py tests/data/deepspeed_zero3_dpo.json
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import two_ranks as shared

#: The stage-3 settings run (the norms persist; prefetch and the live bound act at this size).
CASES: dict[str, dict[str, int]] = {
    "prefetch": {"stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 10_000,
                 "stage3_max_live_parameters": 60_000, "stage3_max_reuse_distance": 0},
    "no-prefetch": {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_reuse_distance": 0},
}
#: Cases run with LoRA (PEFT's default targets, r 8): the reference is the policy with its adapters
#: disabled, called directly (``use_adapter(model, None)``; TRL's ``self.model``), no second engine.
LORA_CASES = {"lora-prefetch": CASES["prefetch"]}
BATCH, SEQ, STEPS = 2, 32, 3


def _run(extra: dict[str, int], lora: bool = False) -> dict[str, Any]:
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from trl.models import prepare_deepspeed
    from trl.trainer.utils import add_fused_lm_head

    config = shared.stage3_config(BATCH, extra)
    keep = HfDeepSpeedConfig(config)  # is_deepspeed_zero3_enabled(): TRL's head gathers for real
    policy = shared.small_llama()
    reference = shared.frozen_copy(policy)
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(reference)
    if lora:  # as SFTTrainer/DPOTrainer do under ZeRO-3: adapters in the model's dtype
        policy = shared.with_lora(policy)
    trained = [p for p in policy.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=policy, optimizer=torch.optim.Adam(trained, lr=1e-3), config=config)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))
    ref_engine = None if lora else prepare_deepspeed(reference, accelerator)
    events: list[list[str]] = []
    models = {"policy": policy} if lora else {"policy": policy, "reference": reference}
    gathered = shared.gathered_masks(models)
    shared.record_forward_hooks(models, events, gathered)
    offload = engine.optimizer.parameter_offload
    leftovers = offload.release_backward_leftovers

    def release_backward_leftovers() -> None:  # backward_epilogue: what backward left gathered, before its release
        events.append([f"leftovers {sum(e.startswith('backward') for e, _ in events)}", gathered()])
        leftovers()

    offload.release_backward_leftovers = release_backward_leftovers
    torch.manual_seed(1)
    ids = torch.randint(0, shared.LLAMA["vocab_size"], (2 * BATCH, SEQ))
    labels = ids.clone()
    labels[:, : SEQ // 2] = -100  # the prompt half
    for step in range(STEPS):
        out = engine(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
        with torch.no_grad():
            if ref_engine is None:
                from trl.trainer.utils import use_adapter

                with use_adapter(policy, None):
                    ref = policy(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                                 fused_lm_head=True)
            else:
                ref = ref_engine(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                                 fused_lm_head=True)
        logps, ref_logps = out.log_probs.sum(1), ref.log_probs.sum(1)
        chosen, rejected = (logps - ref_logps).chunk(2)
        loss = -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)).mean()
        shared.backward_and_step(engine, loss, step, events, gathered)
    del keep
    if ref_engine is None:
        return {"settings": extra, "lora": shared.LORA_RANK, "events": events}
    settings = {"param_persistence_threshold": ref_engine.zero_param_persistence_threshold(),
                "prefetch_bucket_size": ref_engine.zero_prefetch_bucket_size(),
                "max_live_parameters": ref_engine.zero_max_live_parameters(),
                "max_reuse_distance": ref_engine.zero_max_reuse_distance()}
    return {"settings": extra, "reference_engine": settings, "events": events}


def main() -> None:
    out: dict[str, Any] = {**shared.start(trl=True), "config": shared.LLAMA, "batch": BATCH, "seq_len": SEQ,
                           "cases": {**{name: _run(extra) for name, extra in CASES.items()},
                                     **{name: _run(extra, lora=True) for name, extra in LORA_CASES.items()}}}
    shared.write_record(out)


if __name__ == "__main__":
    shared.run_on_two_ranks(__file__, main, "29623")

"""Real DeepSpeed ZeRO-3 on the CPU running TRL's SFT step on a PEFT LoRA model with gradient
checkpointing (two ranks over gloo): the checkpointing TRL forces there, reentrant
(``SFTTrainer.__init__``: "PEFT + DeepSpeed ZeRO-3 requires reentrant checkpointing", trl#2514),
set up as the trainers do it — ``get_peft_model(..., autocast_adapter_dtype=False)``, TRL's fused
LM head on the base model (``add_fused_lm_head``; transformers' ``HfDeepSpeedConfig`` registered,
so it gathers the head for real), ``gradient_checkpointing_enable`` with ``use_reentrant=True`` as
``Trainer`` calls it, and ``enable_input_require_grads`` as TRL calls it — then SFT's step: the
fused head's log-probs, the summed NLL over the label tokens, ``engine.backward``, ``engine.step``.
Cases without checkpointing are the control: the reentrant recomputation runs each layer's forward
again inside its backward, where DeepSpeed's hooks gather the layer's parameters once more.

Recorded, for three steps: which parameters of the PeftModel are gathered (a bitmask over its
``named_parameters``) after each module's forward pre-hook and post-hook (the recomputed forwards
included), after backward and after each step. The reference for tests/test_reentrant_zero3.py. Run
(DeepSpeed installed with ``DS_BUILD_OPS=0 pip install --target DIR deepspeed``)::

    PYTHONPATH=DIR:. TORCH_EXTENSIONS_DIR=/tmp/ds-ext python \\
        tests/deepspeed_reference/zero3_reentrant_reference.py tests/data/deepspeed_zero3_reentrant.json
"""

from __future__ import annotations

import os
from typing import Any

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from two_ranks import run_on_two_ranks, write_record

#: A small Llama: embedding and head 512·64 = 32,768 elements, q and o 4,096, k and v 2,048, the MLP's
#: 8,192 each, norms 64 (zero3_dpo_reference.py's).
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False}
#: The stage-3 settings run.
NO_PREFETCH = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
               "stage3_max_reuse_distance": 0}
PREFETCH = {"stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 10_000,
            "stage3_max_live_parameters": 60_000, "stage3_max_reuse_distance": 0}
#: name: (stage-3 settings, gradient checkpointing (reentrant, as TRL forces it))
CASES: dict[str, tuple[dict[str, int], bool]] = {
    "reentrant": (NO_PREFETCH, True), "no-checkpointing": (NO_PREFETCH, False),
    "reentrant-prefetch": (PREFETCH, True),
}
#: Not TRL's step: the model's own loss (no fused head) with the non-reentrant checkpoint, as memcalc's
#: own loop runs it (``--lora R --checkpoint --strategy zero3``); the recomputation's frozen parameters
#: are attributed to the latest backward module there too.
OWN_LOOP_CASES: dict[str, dict[str, int]] = {"own-loop-non-reentrant": NO_PREFETCH}
LORA_RANK = 8
BATCH, SEQ, STEPS = 2, 32, 3


def _mask(order: list[str], gathered: Any) -> str:
    index = {name: i for i, name in enumerate(order)}
    return hex(sum(1 << index[name] for name in set(gathered)))


def _run(extra: dict[str, int], checkpointing: bool, trl_step: bool = True) -> dict[str, Any]:
    import deepspeed
    import peft
    import transformers
    from transformers.integrations import HfDeepSpeedConfig
    from trl.trainer.utils import add_fused_lm_head

    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, **extra}}
    keep = HfDeepSpeedConfig(config)  # is_deepspeed_zero3_enabled(): TRL's head gathers for real
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")})
    model = transformers.LlamaForCausalLM(llama)
    # SFTTrainer.__init__: the adapters in the model's dtype under ZeRO-3, then the fused head on the base model
    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_dropout=0.0), autocast_adapter_dtype=False)
    if trl_step:
        add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    if checkpointing:
        model.enable_input_require_grads()  # SFTTrainer.__init__, for PEFT with gradient checkpointing
        # Trainer._inner_training_loop, with the kwargs SFTTrainer forced: {"use_reentrant": True}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": trl_step})
        model.config.use_cache = False
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(trained, lr=1e-3), config=config)
    events: list[list[str]] = []
    names = [n for n, _ in model.named_parameters()]

    def gathered() -> str:
        return _mask(names, (n for n, p in model.named_parameters() if p.ds_status.name != "NOT_AVAILABLE"))

    for index, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        module.register_forward_pre_hook(lambda m, a, i=index: events.append([f"pre policy.{i}", gathered()]))
        module.register_forward_hook(lambda m, a, o, i=index: events.append([f"post policy.{i}", gathered()]))
    torch.manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    labels = ids.clone()
    labels[:, : SEQ // 2] = -100  # the prompt half (completion-only loss)
    for step in range(STEPS):
        if trl_step:
            out = engine(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, use_cache=False,
                         fused_lm_head=True)
            loss = (-out.log_probs).sum() / out.label_mask.sum().clamp(min=1)  # SFTTrainer.compute_loss, "nll"
        else:
            loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        events.append([f"backward {step}", gathered()])
        engine.step()
        events.append([f"step {step}", gathered()])
    del keep
    return {"settings": extra, "checkpointing": checkpointing, "trl_step": trl_step, "lora": LORA_RANK,
            "events": events}


def main() -> None:
    import deepspeed
    import peft
    import trl

    deepspeed.init_distributed(dist_backend="gloo")
    cases = {name: _run(extra, checkpointing) for name, (extra, checkpointing) in CASES.items()}
    cases.update({name: _run(extra, True, trl_step=False) for name, extra in OWN_LOOP_CASES.items()})
    out: dict[str, Any] = {"deepspeed": deepspeed.__version__, "trl": trl.__version__, "peft": peft.__version__,
                           "torch": torch.__version__, "world_size": torch.distributed.get_world_size(),
                           "config": CONFIG, "batch": BATCH, "seq_len": SEQ, "cases": cases}
    write_record(out)


if __name__ == "__main__":
    run_on_two_ranks(__file__, main, "29641")

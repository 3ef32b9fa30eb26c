"""TRL's real ``GRPOTrainer`` on the CPU (two optimizer steps, fp32; bf16 where memcalc follows this
CPU's bf16 GEMM) against memcalc's ``--loop trl-grpo`` on its CPU target: the step's peak, and the
peak of its generation phase alone.

The policy is a tiny Llama saved to a folder, which ``GRPOTrainer`` loads itself (as it loads its
reference model when ``beta != 0``); the prompts are tokenized by the word-level tokenizer of
tests/hf_reference/test_trl.py, every prompt the same length. Generation samples, so the
completions are made a fixed length: ``max_completion_length`` tokens each, the end-of-sequence
token held back by ``min_new_tokens`` (``generation_kwargs``, which memcalc's estimate runs too);
the seed is fixed. The reward is a plain function of the completions' text.

**The generation window.** ``GRPOTrainer._generate_and_score_completions`` runs under a
``record_function`` range; the real generation peak is the highest running sum of the profiler's
``[memory]`` events inside the ranges (plus the bytes alive when the measured window opened),
memcalc's the report's ``generation_peak``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_harness import describe, llama_config, model_bytes, relative_error, write_config
from support import bf16_followed
from test_trl import _COMMON, VOCAB, _tokenizer, _words

import memcalc

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

TOLERANCE = 0.01
#: The profiler range around each generation.
GENERATION = "memcalc: GRPO generation and scoring"


def _profiled(existing: int, run: Any) -> tuple[int, int]:
    """``existing`` plus the highest running sum of the ``[memory]`` events during ``run()``, and
    during the :data:`GENERATION` ranges alone."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = list(prof.profiler.kineto_results.events())
    ranges = [(e.start_ns(), e.end_ns()) for e in events if e.name() == GENERATION]
    assert ranges, "no generation ran"
    current = peak = generation = 0
    for start, delta in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        current += delta
        peak = max(peak, current)
        if any(a <= start <= b for a, b in ranges):
            generation = max(generation, current)
    return existing + peak, existing + generation


def _real(tmp_path: Path, config: dict[str, Any], batch: int, prompt: int, lora: int, **grpo: Any) -> tuple[int, int]:
    import datasets
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(transformers.AutoConfig.for_model(**config),
                                                       dtype=torch.float32)
    model.save_pretrained(tmp_path / "policy")
    prompts = [{"prompt": _words(prompt, k)} for k in range(64)]

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch,
                          **{**_COMMON, **_config(grpo)})
    peft_config = None
    if lora:
        import peft

        peft_config = peft.LoraConfig(r=lora, task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=str(tmp_path / "policy"), reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_list(prompts), processing_class=_tokenizer(),
                              peft_config=peft_config)
    generate = trainer._generate_and_score_completions

    def ranged(inputs: Any) -> Any:
        with torch.profiler.record_function(GENERATION):
            return generate(inputs)

    trainer._generate_and_score_completions = ranged
    reference = list(trainer.ref_model.parameters()) if trainer.ref_model is not None else []
    return _profiled(model_bytes(trainer.model, *reference), trainer.train)


def _config(grpo: dict[str, Any]) -> dict[str, Any]:
    completion = grpo.get("max_completion_length", 32)
    return {"num_generations": 4, "max_completion_length": completion, "gradient_checkpointing": False,
            "generation_kwargs": {"min_new_tokens": completion}, **grpo}


def _estimate(tmp_path: Path, config: dict[str, Any], batch: int, prompt: int, lora: int,
              **grpo: Any) -> memcalc.MemoryReport:
    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"per_device_train_batch_size": batch, "bf16": False, **_config(grpo)}))
    return memcalc.estimate(write_config(tmp_path, config), loop="trl-grpo", trainer_args=str(arguments),
                            seq_len=prompt, gpu="cpu",
                            finetune=memcalc.FineTune(lora=memcalc.LoRA(lora)) if lora else None)


#: A Llama whose keys and values are wide beside its vocabulary: with LoRA (no gradients or
#: optimizer state for the base weights) its generation's KV cache outgrows the training step.
WIDE = {**llama_config(1024, hidden=512, layers=4), "num_attention_heads": 8, "num_key_value_heads": 8}

#: name: (the model's config, per_device_train_batch_size, prompt length, LoRA rank, GRPOConfig arguments)
CASES: dict[str, tuple[dict[str, Any], int, int, int, dict[str, Any]]] = {
    "GRPO": (llama_config(VOCAB), 4, 32, 0, {}),
    "GRPO, reference model (beta 0.04)": (llama_config(VOCAB), 4, 32, 0, {"beta": 0.04}),
    "GRPO, old log-probs (num_iterations 2)": (llama_config(VOCAB), 4, 32, 0, {"num_iterations": 2}),
    "GRPO, a generation for 4 accumulated micro-batches": (
        llama_config(VOCAB), 2, 32, 0, {"gradient_accumulation_steps": 4, "beta": 0.04}),
    # 32 completion tokens, not 64: the generation still peaks (estimated 2.5% above the training
    # step, 3.0% with 64) at half the decode steps and two thirds of the tokens a micro-batch trains on
    "GRPO, LoRA, generation peaks (16 rows, wide layers)": (
        WIDE, 1, 32, 8, {"gradient_accumulation_steps": 16, "num_generations": 8, "max_completion_length": 32,
                         "beta": 0.04}),
    # GRPOConfig's default: the policy checkpointed in training, not in generation (TRL disables it there)
    "GRPO, gradient checkpointing": (llama_config(VOCAB), 4, 32, 0, {"gradient_checkpointing": True}),
    "GRPO, LoRA + gradient checkpointing, adapter-disabled reference (beta 0.04)": (
        llama_config(VOCAB), 4, 32, 16, {"gradient_checkpointing": True, "beta": 0.04}),
    # bf16: accelerate's autocast around each call of the prepared model's forward (and TRL's own
    # accelerator.autocast() around its scoring and training forwards); with LoRA generate() runs the
    # base model's forward, outside any autocast region
    "GRPO, bf16 + gradient checkpointing": (llama_config(VOCAB), 4, 32, 0, {"bf16": True,
                                                                          "gradient_checkpointing": True}),
    "GRPO, bf16, LoRA + gradient checkpointing, reference (beta 0.04)": (
        llama_config(VOCAB), 4, 32, 16, {"bf16": True, "gradient_checkpointing": True, "beta": 0.04}),
}
#: Cases with bf16 matmuls: followed where memcalc follows this CPU's bf16 GEMM (tests/support.py).
BF16 = frozenset(name for name, case in CASES.items() if case[4].get("bf16"))


@pytest.mark.slow  # 20 s to 2 minutes a case on two CPU cores (generation runs token by token)
@pytest.mark.parametrize("name", [pytest.param(n, marks=bf16_followed) if n in BF16 else n for n in CASES])
def test_grpo_trainer(name: str, tmp_path: Path) -> None:
    config, batch, prompt, lora, grpo = CASES[name]
    real, real_generation = _real(tmp_path, config, batch, prompt, lora, **grpo)
    report = _estimate(tmp_path, config, batch, prompt, lora, **grpo)
    assert report.generation_peak is not None and report.training_peak is not None
    rows = [describe(name, real, report.peak_requested),
            describe(f"{name}: generation phase", real_generation, report.generation_peak)]
    print("\n".join(rows), f"(peak in {report.peaks_in})")
    assert abs(relative_error(report.peak_requested, real)) <= TOLERANCE, rows[0]
    assert abs(relative_error(report.generation_peak, real_generation)) <= TOLERANCE, rows[1]

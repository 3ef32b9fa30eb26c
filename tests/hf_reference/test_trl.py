"""TRL's real ``SFTTrainer`` and ``DPOTrainer`` on the CPU (two optimizer steps, fp32), against
memcalc's ``--loop trl-sft|trl-dpo`` on its CPU target (tests/hf_reference/hf_harness.py says how
each side is measured; the reference model, when TRL keeps one, is alive when the window opens).

The dataset is tokenized by a real word-level tokenizer built here (nothing from the Hub): every
prompt and completion the same length, so that the collator pads nothing, as memcalc's batch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_harness import describe, llama_config, model_bytes, profiled_peak, relative_error, write_config

import memcalc

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

#: TRL's peaks against memcalc's, within 1% (the issue's bar; the Trainer cases hold 0.5%).
TOLERANCE = 0.01
VOCAB = 8192
WORDS = 200


def _tokenizer() -> Any:
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(WORDS)]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _words(n: int, offset: int) -> str:
    return " ".join(f"w{(offset + i) % WORDS}" for i in range(n))


def _model(lora: int, llama: dict[str, object] | None = None) -> torch.nn.Module:
    """The Llama of ``llama`` (None: :func:`llama_config` over :data:`VOCAB`), with LoRA of rank ``lora``."""
    import transformers

    config = transformers.AutoConfig.for_model(**(llama or llama_config(VOCAB)))
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=lora, task_type="CAUSAL_LM"))
    return model


_COMMON = dict(use_cpu=True, max_steps=2, report_to="none", save_strategy="no", logging_strategy="no",
               disable_tqdm=True, dataloader_num_workers=0, seed=0, bf16=False)


def _dpo_peak(tmp_path: Path, batch: int, seq_len: int, lora: int, **config: Any) -> int:
    import datasets

    prompt = seq_len // 2
    completion = seq_len - prompt - 1  # the collator adds the end-of-sequence token to each completion
    rows = [{"prompt": _words(prompt, k), "chosen": " " + _words(completion, k + 1),
             "rejected": " " + _words(completion, k + 2)} for k in range(2 * batch)]
    config = {"gradient_checkpointing": False, **config}
    args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch, **_COMMON, **config)
    model = _model(lora)
    reference = None if lora or config.get("precompute_ref_log_probs") else copy.deepcopy(model)
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=args,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=_tokenizer())
    alive = [*(reference.parameters() if reference is not None else ())]
    return profiled_peak(model_bytes(model, *alive), trainer.train)


def _sft_peak(tmp_path: Path, batch: int, seq_len: int, **config: Any) -> int:
    import datasets

    if config.get("packing"):  # documents of a quarter of a row each: BFD packs four to a row of max_length
        rows = [{"text": _words(seq_len // 4 - 1, k)} for k in range(8 * batch)]
    elif config.get("completion_only_loss"):
        rows = [{"prompt": _words(seq_len // 2, k), "completion": " " + _words(seq_len - seq_len // 2 - 1, k + 1)}
                for k in range(2 * batch)]
    else:
        rows = [{"text": _words(seq_len - 1, k)} for k in range(2 * batch)]
    config = {"gradient_checkpointing": False, **config}
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch, **_COMMON, **config)
    model = _model(0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=_tokenizer())
    return profiled_peak(model_bytes(model), trainer.train)


def _estimate(tmp_path: Path, loop: str, batch: int, seq_len: int, lora: int,
              distributed: memcalc.Distributed | None = None, llama: dict[str, object] | None = None,
              **config: Any) -> int:
    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"per_device_train_batch_size": batch, "bf16": False,
                                     "gradient_checkpointing": False, **config}))
    finetune = memcalc.FineTune(lora=memcalc.LoRA(lora)) if lora else None
    report = memcalc.estimate(write_config(tmp_path, llama or llama_config(VOCAB)), loop=loop,
                              trainer_args=str(arguments), seq_len=seq_len, gpu="cpu", finetune=finetune,
                              distributed=distributed)
    return report.peak_requested


def _check(name: str, real: int, estimated: int) -> None:
    row = describe(name, real, estimated)
    print(row)
    assert abs(relative_error(estimated, real)) <= TOLERANCE, row


DPO_CASES = {
    "DPO, frozen reference": (0, {}),
    "DPO, precomputed reference log-probs": (0, {"precompute_ref_log_probs": True}),
    "DPO, LoRA (adapter-disabled reference)": (16, {}),
    "DPO, RPO (sigmoid + sft losses)": (0, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    # DPOConfig's default: the policy checkpointed, the reference's no-grad forward run with it disabled
    "DPO, gradient checkpointing": (0, {"gradient_checkpointing": True}),
    "DPO, LoRA + gradient checkpointing": (16, {"gradient_checkpointing": True}),
}


@pytest.mark.slow  # 10–20 s a case on two CPU cores
@pytest.mark.parametrize("name", list(DPO_CASES))
def test_dpo_trainer(name: str, tmp_path: Path) -> None:
    lora, config = DPO_CASES[name]
    real = _dpo_peak(tmp_path, 2, 128, lora, **config)
    _check(name, real, _estimate(tmp_path, "trl-dpo", 2, 128, lora, **config))


@pytest.mark.slow
def test_sft_completion_only(tmp_path: Path) -> None:
    real = _sft_peak(tmp_path, 2, 128, completion_only_loss=True)
    _check("SFT, completion-only loss", real, _estimate(tmp_path, "trl-sft", 2, 128, 0, completion_only_loss=True))


@pytest.mark.slow
def test_sft_padding_free(tmp_path: Path) -> None:
    # without packing TRL enforces no max_length on a padding-free batch, and refuses one
    real = _sft_peak(tmp_path, 4, 64, padding_free=True, max_length=None)
    _check("SFT, padding-free", real, _estimate(tmp_path, "trl-sft", 4, 64, 0, padding_free=True, max_length=None))


@pytest.mark.slow
def test_sft_packing(tmp_path: Path) -> None:
    real = _sft_peak(tmp_path, 2, 64, packing=True, max_length=64)
    _check("SFT, BFD packing", real, _estimate(tmp_path, "trl-sft", 2, 64, 0, packing=True, max_length=64))


@pytest.mark.slow
def test_reward_trainer(tmp_path: Path) -> None:
    import datasets
    import transformers

    batch, seq_len = 2, 128
    config = {**llama_config(VOCAB, architecture="LlamaForSequenceClassification"), "num_labels": 1,
              "pad_token_id": 0}
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification._from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32)
    prompt, completion = seq_len // 2, seq_len - seq_len // 2 - 1  # the end-of-sequence token closes each
    rows = [{"prompt": _words(prompt, k), "chosen": " " + _words(completion, k + 1),
             "rejected": " " + _words(completion, k + 2)} for k in range(2 * batch)]
    args = trl.RewardConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch,
                            gradient_checkpointing=False, **_COMMON)
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                processing_class=_tokenizer())
    real = profiled_peak(model_bytes(model), trainer.train)
    arguments = tmp_path / "args.json"
    arguments.write_text(json.dumps({"per_device_train_batch_size": batch, "bf16": False,
                                     "gradient_checkpointing": False}))
    report = memcalc.estimate(write_config(tmp_path, config), loop="trl-reward", trainer_args=str(arguments),
                              seq_len=seq_len, gpu="cpu")
    _check("Reward model", real, report.peak_requested)


def test_sft_trainer(tmp_path: Path) -> None:
    """The quick suite's TRL case: SFT on plain text, batch 2 of 64 tokens."""
    real = _sft_peak(tmp_path, 2, 64)
    _check("SFT", real, _estimate(tmp_path, "trl-sft", 2, 64, 0))

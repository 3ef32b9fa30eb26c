"""``--loop trl-sft|trl-dpo|trl-reward|trl-grpo``: TRL's configs as memcalc reads them (memcalc.stacks.trl.config), the
step's model and batch worked out by hand (memcalc.stacks.trl.step), and the refusals. The real
``SFTTrainer``/``DPOTrainer`` against these estimates is in tests/hf_reference/test_trl.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from trl_llama import CONFIG, HIDDEN, LAYER, LAYERS, VOCAB, P

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Category, Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.loop import LoopPreset
from memcalc.core.precision import Precision
from memcalc.fields import build_step

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

BATCH, SEQ = 2, 64


@pytest.fixture
def model(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return f"hf:{path}"


def _estimate(model: str, loop: str, **config: Any) -> memcalc.MemoryReport:
    args = {"per_device_train_batch_size": BATCH, "bf16": False, "gradient_checkpointing": False, **config}
    return memcalc.estimate(model, loop=loop, trainer_args=args, seq_len=SEQ, gpu="cpu")


def test_defaults_are_trls() -> None:
    """``loop="trl-dpo"`` alone: DPOConfig's defaults, which are not TrainingArguments' — bf16 None
    (``not fp16``: bf16 autocast) and gradient checkpointing on."""
    step = build_step(lambda: None, loop="trl-dpo")
    assert step.loop.body is LoopPreset.TRL_DPO
    assert step.precision is Precision.AMP_BF16
    assert step.checkpoint
    assert step.trainer_args is not None and step.trainer_args.trl is not None
    assert step.trainer_args.trl.trainer == "dpo"
    assert step.trainer_args.trl.get("beta") == 0.1
    assert step.trainer_args.describe().startswith("loop trl-dpo with the DPOConfig defaults of trl")


def test_dpo_frozen_reference(model: str) -> None:
    """The policy and its frozen copy: 2·P of parameters. The collator's batch: chosen and rejected
    rows, 2·B, of input_ids, attention_mask and completion_mask, int64: 3 · 2B·L·8 bytes (the bytes
    requested: the category counts them before the allocator's rounding)."""
    report = _estimate(model, "trl-dpo")
    assert report.bytes.parameters == 2 * P
    assert report.trainable_parameters == P // 4
    assert report.bytes.inputs == 3 * (2 * BATCH * SEQ * 8)  # 6,144 B


def test_dpo_precomputed_reference(model: str) -> None:
    """No reference model; the batch carries ref_chosen_logps and ref_rejected_logps, B float32 each."""
    report = _estimate(model, "trl-dpo", precompute_ref_log_probs=True)
    assert report.bytes.parameters == P
    assert report.bytes.inputs == 3 * (2 * BATCH * SEQ * 8) + 2 * BATCH * 4  # 6,160 B


def test_dpo_lora_reference_is_the_policy(model: str) -> None:
    """With LoRA the reference is the adapter-disabled policy: no copy, P plus the adapters (r on
    q_proj, v_proj: H·r + r·H and H·r + r·(H/2) per layer, fp32)."""
    r = 8
    args = {"per_device_train_batch_size": BATCH, "bf16": False, "gradient_checkpointing": False}
    report = memcalc.estimate(model, loop="trl-dpo", trainer_args=args, seq_len=SEQ, gpu="cpu",
                              finetune=memcalc.FineTune(lora=memcalc.LoRA(r)))
    adapters = 4 * LAYERS * (2 * HIDDEN * r + HIDDEN * r + r * HIDDEN // 2)
    assert report.bytes.parameters == P + adapters
    assert any("adapters disabled" in note for note in report.notes)


def test_sft_batch(model: str) -> None:
    """SFT: one row a sample, input_ids, attention_mask and labels: 3 · B·L·8 bytes; no reference."""
    report = _estimate(model, "trl-sft")
    assert report.bytes.parameters == P
    assert report.bytes.inputs == 3 * (BATCH * SEQ * 8)


def test_sft_padding_free_batch(model: str) -> None:
    """Padding-free SFT: the B samples end to end in one row — input_ids, labels and position_ids
    (int64), seq_idx (int32), 1·BL each, and cu_seq_lens_q/k, B+1 int32 each."""
    report = _estimate(model, "trl-sft", padding_free=True)
    tokens = BATCH * SEQ
    assert report.bytes.inputs == 3 * tokens * 8 + tokens * 4 + 2 * (BATCH + 1) * 4


def test_reward_model(tmp_path: Path) -> None:
    """The reward model: the embedding V·H, the layers, the final norm H and a one-label score head
    H·1 (no bias), fp32; chosen and rejected rows, 2·B, of input_ids and attention_mask."""
    path = tmp_path / "reward.json"
    path.write_text(json.dumps({**CONFIG, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}))
    report = _estimate(f"hf:{path}", "trl-reward")
    assert report.bytes.parameters == 4 * (VOCAB * HIDDEN + LAYERS * LAYER + HIDDEN + HIDDEN)
    assert report.bytes.inputs == 2 * (2 * BATCH * SEQ * 8)
    assert any("RewardTrainer.compute_loss" in note for note in report.notes)


def test_reward_needs_a_classifier(model: str) -> None:
    with pytest.raises(InapplicableOptionError, match="not a sequence classifier"):
        _estimate(model, "trl-reward")


def test_packing_strategy_wrapped_refused(model: str) -> None:
    with pytest.raises(InapplicableOptionError, match="packing_strategy='wrapped'"):
        _estimate(model, "trl-sft", packing=True, packing_strategy="wrapped")


def test_unknown_argument_named(model: str) -> None:
    with pytest.raises(InvalidInputError, match="'betaa'; did you mean 'beta'"):
        _estimate(model, "trl-dpo", betaa=0.2)


def test_rpo_alpha_names_its_replacement(model: str) -> None:
    with pytest.raises(InvalidInputError, match="rpo_alpha") as info:
        _estimate(model, "trl-dpo", rpo_alpha=0.5)
    assert "loss_type=['sigmoid', 'sft']" in (info.value.hint or "")


@pytest.mark.parametrize(("loop", "argument"), [("trl-sft", "assistant_only_loss"), ("trl-dpo", "padding_free"),
                                                ("trl-sft", "activation_offloading")])
def test_unmodelled_arguments_refused(model: str, loop: str, argument: str) -> None:
    with pytest.raises(InapplicableOptionError, match=argument):
        _estimate(model, loop, **{argument: True})


def test_sequence_longer_than_max_length(model: str) -> None:
    with pytest.raises(InapplicableOptionError, match="max_length 32"):
        _estimate(model, "trl-sft", max_length=32)


def test_cli(model: str, tmp_path: Path) -> None:
    args = tmp_path / "dpo.json"
    args.write_text(json.dumps({"per_device_train_batch_size": BATCH, "bf16": False, "gradient_checkpointing": False}))
    result = CliRunner().invoke(main, [model, "--loop", "trl-dpo", "--training-args", str(args), "--seq-len",
                                       str(SEQ), "--gpu", "cpu"])
    assert result.exit_code == 0, result.output
    assert "DPOTrainer.compute_loss on meta" in result.output
    assert "loop trl-dpo with" in result.output


# ---- GRPO: the generation batch, its phases and the refusals -------------------------------------
def _grpo(model: str, **config: Any) -> memcalc.MemoryReport:
    args = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8, "bf16": False,
            "gradient_checkpointing": False, **config}
    return memcalc.estimate(model, loop="trl-grpo", trainer_args=args, seq_len=16, gpu="cpu")


def test_grpo_plan_is_grpoconfigs() -> None:
    """GRPOConfig.__post_init__'s sizes on one process: steps_per_generation defaults to the
    accumulation, the generation batch is per_device_train_batch_size × steps_per_generation rows,
    a generation every steps_per_generation × num_iterations steps; the old policy's log-probs only
    when the accumulation is not a multiple of that."""
    from memcalc.core.trainer import TrlSettings
    from memcalc.stacks.trl.grpo import grpo_plan

    plan = grpo_plan(TrlSettings("grpo", (("num_generations", 4),)), batch=2, accum_steps=4)
    assert (plan.steps_per_generation, plan.generation_rows) == (4, 8)
    assert (plan.generate_every, plan.old_log_probs) == (4, False)
    plan = grpo_plan(TrlSettings("grpo", (("num_generations", 4), ("num_iterations", 2))), batch=2, accum_steps=4)
    assert (plan.generate_every, plan.old_log_probs) == (8, True)  # 4 % 8 != 0
    plan = grpo_plan(TrlSettings("grpo", (("num_generations", 3), ("generation_batch_size", 12))), 2, 1)
    assert (plan.steps_per_generation, plan.generation_rows) == (6, 12)
    with pytest.raises(InvalidInputError, match="multiple of num_generations"):
        grpo_plan(TrlSettings("grpo", (("num_generations", 3),)), batch=2, accum_steps=1)


def test_grpo_phases_and_batch(model: str) -> None:
    """One generation per step (accumulation 1): 4 rows of a 16-token prompt and 8 completion tokens.

    At the training peak the inputs are the drawn batch (the prompts' ids and mask, 2 · 4·16·8 B)
    and the buffer TRL's shuffle made (prompt ids and mask 2 · 4·16·8, completion ids and mask
    2 · 4·8·8, advantages 4·4, the 0-dim num_items_in_batch 8): 3,096 B. The KV cache's high
    water mark is in the last decode step: 2 layers · keys and values · 4 rows · 2 KV heads · 32
    dims · (16 + 8 − 1) positions · 4 B (the last token is sampled, not run), and for a moment the
    last layer's old values (22 positions), which DynamicCache's ``torch.cat`` has just copied."""
    report = _grpo(model)
    assert report.bytes.parameters == P  # beta 0: no reference model
    assert report.peaks_in == "training"
    assert report.generation_peak is not None and report.training_peak is not None
    assert report.peak_requested == max(report.generation_peak, report.training_peak) == report.training_peak
    assert report.bytes.inputs == 2 * 4 * 16 * 8 + 2 * 4 * 16 * 8 + 2 * 4 * 8 * 8 + 4 * 4 + 8
    timeline = report.timeline()
    kv = timeline.by_category[:, timeline.categories.index(Category.KV_CACHE)].max()
    row = 4 * 2 * (HIDDEN // 4) * 4  # one position of one layer's keys (or values), all rows: 1,024 B
    assert kv == LAYERS * 2 * row * (16 + 8 - 1) + row * (16 + 8 - 2)  # 94,208 + 22,528 B
    phases = {phase for phase in timeline.phase}
    assert {Phase.PREFILL, Phase.DECODE, Phase.FORWARD, Phase.BACKWARD} <= phases
    scoring = {module for phase, module in zip(timeline.phase, timeline.module, strict=True) if phase is Phase.SCORING}
    assert scoring == {""}  # beta 0, accumulation 1: the completions' tensors only, no model scores them
    assert report.to_dict()["phase_peaks"] == {"generation": report.generation_peak,
                                               "training": report.training_peak, "peaks_in": "training"}


def test_grpo_reference_and_old_log_probs(model: str) -> None:
    """beta != 0: a frozen copy of the policy (2·P of parameters), scored in the SCORING phase;
    num_iterations 2: the old policy's log-probs too. Both log-probs ride in the buffer, 4 rows ·
    8 completion tokens · float32 each."""
    plain = _grpo(model)
    report = _grpo(model, beta=0.04, num_iterations=2)
    assert report.bytes.parameters == 2 * P
    timeline = report.timeline()
    scoring = {module.split(".")[0] for phase, module in zip(timeline.phase, timeline.module, strict=True)
               if phase is Phase.SCORING}
    assert scoring == {"", "policy", "reference"}
    assert report.bytes.inputs == plain.bytes.inputs + 2 * 4 * 8 * 4
    assert any("scored by the old policy and the reference" in note for note in report.notes)


@pytest.mark.parametrize(("argument", "value", "error"), [
    ("use_vllm", True, "use_vllm"), ("top_entropy_quantile", 0.2, "top_entropy_quantile"),
    ("pad_to_multiple_of", 64, "pad_to_multiple_of"), ("num_generations", 1, "at least 2"),
    ("cast_lm_head_to_fp32", True, "cast_lm_head_to_fp32")])
def test_grpo_refusals(model: str, argument: str, value: Any, error: str) -> None:
    with pytest.raises((InapplicableOptionError, InvalidInputError), match=error):
        _grpo(model, **{argument: value})


def test_grpo_cli(model: str, tmp_path: Path) -> None:
    args = tmp_path / "grpo.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
                                "bf16": False, "gradient_checkpointing": False}))
    result = CliRunner().invoke(main, [model, "--loop", "trl-grpo", "--training-args", str(args), "--seq-len", "16",
                                       "--gpu", "cpu"])
    assert result.exit_code == 0, result.output
    assert "the step's peak is in its training: generation" in result.output
    assert "GRPOTrainer on meta" in result.output


# quick: checkpointing alone, and LoRA with checkpointing and the reference (LoRA alone: the full suite)
@pytest.mark.quick_cases("config0", "config2")
@pytest.mark.parametrize("config", [{"bf16": True, "gradient_checkpointing": True}, {"bf16": True, "lora": 8},
                                    {"bf16": True, "lora": 8, "gradient_checkpointing": True, "beta": 0.04}])
def test_grpo_amp_with_checkpointing_or_lora(model: str, config: dict[str, Any]) -> None:
    """Under amp each prepared forward is its own autocast region, as accelerate's (the exact checks
    against GRPOTrainer: tests/hf_reference/test_trl_grpo.py): the step answers with both phases."""
    lora = config.pop("lora", 0)
    args = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
            "gradient_checkpointing": False, **config}
    report = memcalc.estimate(model, loop="trl-grpo", trainer_args=args, seq_len=16, gpu="cpu",
                              finetune=memcalc.FineTune(lora=memcalc.LoRA(lora)) if lora else None)
    assert report.generation_peak is not None and report.training_peak is not None
    assert report.peaks_in in ("generation", "training")

"""Full fine-tunes through the real ``transformers.Trainer`` on the CPU (two optimizer steps),
against memcalc's CPU target for the same recipe (tests/hf_reference/hf_harness.py says how
each side is measured). The vocabularies are real ones: the logits dominate, as in the recipes (the
bf16 cases take smaller ones: hf_harness.BF16_VOCAB says why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_harness import BF16_VOCAB, LLAMA3_VOCAB, ODD_VOCAB, TOLERANCE, Recipe, check_trainer_recipe, llama_config

import memcalc

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # 3–15 s a case on two CPU cores

#: Trainer's optimizer on this stack is ``adamw_torch_fused`` (TrainingArguments' default).
_TRAINER = memcalc.Loop("trainer", optimizer_impl="fused")

RECIPES = {
    # fp32 weights, no autocast: memcalc's own semantics
    "fp32": Recipe(llama_config(LLAMA3_VOCAB), estimate=dict(optimizer="adamw", loop=_TRAINER)),
    # fp32 weights, Trainer(bf16=True), accelerate's bf16 autocast: the real run of
    # test_trainer_arguments.py's "defaults, amp bf16", which checks these options against it too
    # (one bf16 Trainer run, not two of the same step)
    "amp bf16 + checkpointing": Recipe(llama_config(BF16_VOCAB), bf16=True, checkpointing=True,
                                       estimate=dict(optimizer="adamw", precision="amp-bf16", checkpoint=True,
                                                     loop=_TRAINER)),
    "amp bf16 + accumulation 2": Recipe(llama_config(ODD_VOCAB), bf16=True, accumulation=2,
                                        estimate=dict(optimizer="adamw", precision="amp-bf16", accum_steps=2,
                                                      loop=_TRAINER)),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_trainer_full_fine_tune(name: str, tmp_path: Path) -> None:
    check_trainer_recipe(RECIPES[name], tmp_path, name, TOLERANCE)


def test_trainer_bf16_weights(tmp_path: Path) -> None:
    # a model loaded with dtype=torch.bfloat16, trained with Trainer(bf16=True): amp-bf16 over bf16 weights (pure
    # bf16, the nearest before weight_dtype, gives the same bytes here: autocast casts nothing).
    # Before the model's own loss: -39.7% (its fp32 upcast of the (2, 256, 128256) logits was missing)
    recipe = Recipe(llama_config(BF16_VOCAB), bf16=True, weights=torch.bfloat16,
                    estimate=dict(optimizer="adamw", precision="amp-bf16", weight_dtype="bf16", loop=_TRAINER))
    check_trainer_recipe(recipe, tmp_path, "bf16 weights + amp bf16", TOLERANCE)

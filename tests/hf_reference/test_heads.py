"""A model whose config's ``architectures`` names a head other than the causal LM's, trained
through the real ``transformers.Trainer`` on the CPU, against memcalc's CPU target."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_harness import TOLERANCE, Recipe, bert_config, check_trainer_recipe

import memcalc

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_bert_sequence_classification(tmp_path: Path) -> None:
    # before the head came from architectures: +462.5% (BertLMHeadModel's 30522-way logits per token)
    recipe = Recipe(bert_config(), batch=8, seq_len=128, bf16=True,
                    estimate=dict(optimizer="adamw", precision="amp-bf16",
                                  loop=memcalc.Loop("trainer", optimizer_impl="fused")))
    check_trainer_recipe(recipe, tmp_path, "BertForSequenceClassification, amp bf16", TOLERANCE)

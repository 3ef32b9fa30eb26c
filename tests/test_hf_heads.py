"""``hf:`` models train with their own loss and the head their config names
(memcalc/stacks/transformers/heads.py); the real-CPU comparisons are in tests/hf_reference/."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import SMALL_LLAMA, hf_config_source

import memcalc
from memcalc.sources.resolve import resolve

pytest.importorskip("transformers")

_BERT = {"model_type": "bert", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 128, "num_labels": 3}


@pytest.mark.parametrize("architecture, labels", [
    ("BertForSequenceClassification", {"labels": (4,)}),
    ("BertForTokenClassification", {"labels": (4, 16)}),
    ("BertForMaskedLM", {"labels": (4, 16)}),
    ("BertForQuestionAnswering", {"start_positions": (4,), "end_positions": (4,)}),
])
def test_the_head_is_the_class_architectures_names(tmp_path: Path, architecture: str, labels: dict):
    classes = 2 if architecture.endswith("QuestionAnswering") else 3  # a QA head's two logits: start, end
    source = hf_config_source(tmp_path, {**_BERT, "architectures": [architecture], "num_labels": classes})
    resolved = resolve(source, batch_size=4, seq_len=16)
    assert type(resolved.module).__name__ == architecture
    inputs = resolved.step_inputs(resolved.inputs, own_loss=True)
    assert {k: tuple(v.shape) for k, v in inputs.kwargs.items()} == labels
    # memcalc traces the model's own loss from them
    report = memcalc.estimate(source, batch_size=4, seq_len=16, optimizer="adamw")
    assert report.loss == "the model's own (output.loss)"


@pytest.mark.parametrize("task, architecture", [
    ("sequence-classification", "BertForSequenceClassification"),
    ("token-classification", "BertForTokenClassification"),
    ("masked-lm", "BertForMaskedLM"),
    ("question-answering", "BertForQuestionAnswering"),
])
def test_task_builds_the_head_asked_for_over_architectures(tmp_path: Path, task: str, architecture: str):
    (tmp_path / "bare").mkdir()
    (tmp_path / "named").mkdir()
    bert = {**_BERT, "num_labels": 2 if task == "question-answering" else 3}  # a QA head's two logits
    source = hf_config_source(tmp_path / "bare", {**bert, "architectures": ["BertModel"]})
    asked = memcalc.HuggingFace(str(source).removeprefix("hf:"), task=task)
    assert type(resolve(asked, batch_size=4, seq_len=16).module).__name__ == architecture
    named = hf_config_source(tmp_path / "named", {**bert, "architectures": [architecture]})
    # the same head as the config naming it: the same step, to the byte
    kw = dict(batch_size=4, seq_len=16, optimizer="adamw")
    assert memcalc.estimate(asked, **kw).bytes == memcalc.estimate(named, **kw).bytes


def test_task_a_model_type_lacks_is_refused_naming_it(tmp_path: Path):
    source = hf_config_source(tmp_path, SMALL_LLAMA)
    with pytest.raises(memcalc.InvalidInputError, match="has no seq2seq head in transformers"):
        memcalc.estimate(memcalc.HuggingFace(str(source).removeprefix("hf:"), task="seq2seq"), batch_size=1,
                         seq_len=8)
    with pytest.raises(memcalc.InvalidInputError, match="unknown task 'classify'"):
        memcalc.HuggingFace("bert", task="classify")


def test_a_config_without_architectures_is_a_causal_lm_as_before(tmp_path: Path):
    config = {k: v for k, v in SMALL_LLAMA.items() if k != "architectures"}
    resolved = resolve(hf_config_source(tmp_path, config), batch_size=2, seq_len=8)
    assert type(resolved.module).__name__ == "LlamaForCausalLM"


def test_labels_only_when_the_step_trains_with_the_models_loss(tmp_path: Path):
    resolved = resolve(hf_config_source(tmp_path), batch_size=2, seq_len=8)
    assert resolved.step_inputs(resolved.inputs, own_loss=False) is resolved.inputs  # eval, or a chosen loss
    assert tuple(resolved.step_inputs(resolved.inputs, own_loss=True).kwargs["labels"].shape) == (2, 8)


def test_the_models_own_loss_leaves_an_fp32_step_as_it_was(tmp_path: Path):
    # transformers' ForCausalLMLoss: logits.float() is the logits themselves in fp32 and the
    # cross-entropy is memcalc's. Its saved target is a new tensor (the labels shifted, B·T int64)
    # where memcalc's is the batch's target, an input: a few KiB of activations, not at the peak
    source = hf_config_source(tmp_path, {**SMALL_LLAMA, "vocab_size": 32000})
    b, t = 2, 256
    kw = dict(batch_size=b, seq_len=t, optimizer="adamw", gpu="a100-80gb")
    own = memcalc.estimate(source, **kw)
    chosen = memcalc.estimate(source, loss="lm-cross-entropy", **kw)
    assert own.bytes.peak_allocated == chosen.bytes.peak_allocated
    assert own.textbook.activation_bytes - chosen.textbook.activation_bytes == b * t * 8


def test_a_bf16_models_loss_saves_its_log_softmax_in_fp32(tmp_path: Path):
    # ForCausalLMLoss upcasts the bf16 logits (B, T, V) to fp32 before the cross-entropy: the
    # log-softmax it saves for backward is B·T·V fp32 (4 bytes) where memcalc's loss saved bf16 (2)
    source = hf_config_source(tmp_path, {**SMALL_LLAMA, "vocab_size": 32000})
    b, t, v = 2, 256, 32000
    kw = dict(batch_size=b, seq_len=t, optimizer="adamw", gpu="a100-80gb", precision="bf16")
    own = memcalc.estimate(source, **kw)
    chosen = memcalc.estimate(source, loss="lm-cross-entropy", **kw)
    extra = own.textbook.activation_bytes - chosen.textbook.activation_bytes
    assert b * t * v * 2 <= extra <= b * t * v * 2 + b * t * 8 + 64  # plus the shifted labels (fp32 test)
    assert own.bytes.peak_allocated > chosen.bytes.peak_allocated

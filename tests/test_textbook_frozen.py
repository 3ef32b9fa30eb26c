"""The textbook line with frozen parameters: they count once (weights only), and only the
trainable ones take the optimizer's multiplier and its state outside the multiplier. The
arithmetic is worked out in each test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import hf_config_source
from torch import nn

import memcalc
from memcalc import FineTune, LoRA
from memcalc.core.report import Textbook
from memcalc.engine.optimizers import Optimizer, spec_for
from memcalc.report.render import render_report


def _two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))


def _textbook_line(report: memcalc.MemoryReport) -> str:
    return next(line for line in render_report(report, modules=False).splitlines() if line.startswith("textbook:"))


def test_frozen_first_layer_with_adam_by_hand():
    # Linear(10, 10) + Linear(10, 10), the first frozen, Adam, fp32, batch 4, gpu="cpu":
    #   each Linear: 10·10 + 10 = 110 parameters · 4 B = 440 B   → frozen 440 B, trainable 440 B
    #   input batch: 4·10·4 = 160 B + int64 targets 4·8 = 32 B   → 192 B
    #   saved for backward: layer 0 records nothing (its input and parameters need no grad);
    #     layer 1's addmm saves its input h0 (4·10·4 = 160 B) for the weight's gradient;
    #     the logits (160 B); log_softmax's result (160 B); nll_loss's total_weight (4 B)
    #     and the loss (4 B)                                      → 488 B
    #   rule: 440·4 (weights + grads + 2 moments) + 440 (frozen: weights only) + 192 + 488 = 2,880 B
    #   (all parameters × 4, as before: 880·4 + 192 + 488 = 4,200 B)
    r = memcalc.estimate(_two_linears, batch_size=4, input_shape=(10,), optimizer="adam", gpu="cpu",
                         finetune=FineTune(freeze=("0.*",)))
    tb = r.textbook
    assert tb is not None
    assert (tb.parameter_bytes, tb.frozen_parameter_bytes, tb.trainable_parameter_bytes) == (880, 440, 440)
    assert (tb.multiplier, tb.input_bytes, tb.activation_bytes, tb.state_bytes) == (4, 192, 488, 0)
    assert tb.total == 440 * 4 + 440 + 192 + 488 == 2_880
    assert _textbook_line(r).startswith(
        "textbook: trainable parameters 440 B × 4 (weights + grads + 2 moments) + frozen parameters 440 B "
        "+ input batch 192 B + activations saved for backward 488 B = 2.81 KiB; ")
    full = memcalc.estimate(_two_linears, batch_size=4, input_shape=(10,), optimizer="adam", gpu="cpu").textbook
    assert full is not None and full.frozen_parameter_bytes == 0
    assert full.total == 880 * 4 + 192 + 488 == 4_200


def test_state_outside_the_multiplier_is_over_trainable_parameters_only():
    # Adafactor keeps, per matrix, a row and a column vector; per vector a full copy:
    #   trainable Linear(10, 10): weight (10 + 10)·4 = 80 B, bias 10·4 = 40 B → 120 B
    #   (the frozen layer's 120 B more was counted before)
    # rule: 440·2 + 120 + 440 + 192 + 488 = 2,120 B
    r = memcalc.estimate(_two_linears, batch_size=4, input_shape=(10,), optimizer="adafactor", gpu="cpu",
                         finetune=FineTune(freeze=("0.*",)))
    tb = r.textbook
    assert tb is not None and tb.state_bytes == 120 and tb.multiplier == 2
    assert tb.total == 440 * 2 + 120 + 440 + 192 + 488 == 2_120
    assert "trainable parameters 440 B × 2 + 120 B (weights + grads + factored" in _textbook_line(r)


def test_textbook_state_bytes_skips_parameters_without_grad():
    model = _two_linears()
    model[0].requires_grad_(False)
    spec = spec_for(Optimizer.ADAMW_8BIT)  # two 1-byte moments per element
    assert spec.textbook_state_bytes(model.parameters()) == 2 * 110  # the trainable layer's 110 elements


def test_lora_base_counts_once(tmp_path: Path):
    pytest.importorskip("peft")
    r = memcalc.estimate(hf_config_source(tmp_path), batch_size=1, seq_len=16, optimizer="adamw",
                         finetune=FineTune(lora=LoRA(8)))
    tb = r.textbook
    assert tb is not None and r.trainable_parameters == 3584  # PEFT's count (tests/test_finetune.py)
    # fp32: the adapters' 3,584 parameters · 4 B train; everything else (the base) is frozen
    assert tb.trainable_parameter_bytes == 3584 * 4
    assert tb.frozen_parameter_bytes == (r.parameters - 3584) * 4 == r.bytes.parameters - 3584 * 4
    assert tb.total == 3584 * 4 * 4 + tb.frozen_parameter_bytes + tb.input_bytes + tb.activation_bytes


def test_quantized_base_counts_once_as_stored(tmp_path: Path):
    # QLoRA: the frozen 4-bit weights and their statistics count once, as stored; the float32
    # adapters (kept float32 under amp-bf16) take Adam's × 4
    pytest.importorskip("peft")
    r = memcalc.estimate(hf_config_source(tmp_path), batch_size=1, seq_len=16, optimizer="adamw", precision="amp-bf16",
                         finetune=FineTune(lora=LoRA(8), quant="nf4"))
    tb = r.textbook
    assert tb is not None
    assert tb.trainable_parameter_bytes == 3584 * 4
    assert tb.parameter_bytes == r.bytes.parameters  # every stored byte, frozen or not
    assert tb.total == 3584 * 4 * 4 + (r.bytes.parameters - 3584 * 4) + tb.input_bytes + tb.activation_bytes


def test_without_frozen_parameters_the_line_is_unchanged():
    r = memcalc.estimate(_two_linears, batch_size=4, input_shape=(10,), optimizer="adam", gpu="cpu")
    assert _textbook_line(r).startswith(
        "textbook: parameters 880 B × 4 (weights + grads + 2 moments) + input batch 192 B ")


def test_outside_training_every_parameter_counts_once_as_before():
    r = memcalc.estimate(_two_linears, batch_size=4, input_shape=(10,), mode="eval", gpu="cpu",
                         finetune=FineTune(freeze=("0.*",)))
    tb = r.textbook
    assert tb is not None and tb.frozen_parameter_bytes == 0 and tb.multiplier == 1
    assert _textbook_line(r).startswith("textbook: parameters 880 B (weights) + input batch ")


@pytest.mark.parametrize(("frozen", "total"), [(0, 100 * 4 + 100 + 100), (60, 40 * 4 + 60 + 100 + 100)])
def test_textbook_total_by_hand(frozen: int, total: int):
    # positional fields as before, the frozen bytes last: (100 − frozen)·4 + frozen + inputs + activations
    tb = Textbook(100, 4, "weights + grads + 2 moments", 100, 100, 0, frozen)
    assert tb.total == total and tb.trainable_parameter_bytes == 100 - frozen
    assert tb.gap(total) == pytest.approx(0.0)


def test_tied_frozen_weights_count_once():
    # an embedding tied to the head, both frozen by one name: one storage of 50·8·4 = 1,600 B
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.embed(ids)))

    r = memcalc.estimate(Tied, inputs=(torch.zeros(2, 4, dtype=torch.long, device="meta"),), optimizer="sgd",
                         loss="mean", finetune=FineTune(freeze=("embed.*",)), gpu="cpu")
    tb = r.textbook
    assert tb is not None and tb.frozen_parameter_bytes == 50 * 8 * 4
    assert tb.trainable_parameter_bytes == (8 * 8 + 8) * 4

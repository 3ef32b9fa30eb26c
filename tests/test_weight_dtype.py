"""``weight_dtype``: parameters stored in another dtype than the precision implies, apart from
its autocast. bf16 weights under amp-bf16 is what Hugging Face Trainer's ``bf16=True`` does to
a model loaded with ``dtype=torch.bfloat16``; before this option memcalc offered only fp32
weights under autocast (``amp-bf16``) or bf16 weights without it (``bf16``).

The arithmetic worked out by hand, the step against the real CPU step (the profiler), and the
combinations refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support import bf16_followed, hf_config_source
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Category, Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.fields import build_step
from memcalc.measure.step import attach_measurement, measure_cpu
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import trace_step
from memcalc.targets.cpu.kernels import CpuCapabilities

# tests/test_against_cpu.py's bar
TOLERANCE = 0.005
HERE = CpuCapabilities.here()


def _linear() -> nn.Module:
    return nn.Linear(256, 256)


def _bytes_by_category(**options: object) -> dict[Category, int]:
    traced = trace_step(resolve(_linear, batch_size=8, input_shape=(256,)), build_step(optimizer="adam", **options))
    totals: dict[Category, int] = {}
    for uid, category in enumerate(traced.categories):
        totals[category] = totals.get(category, 0) + traced.trace.nbytes[uid]
    return totals


def test_bf16_weights_under_autocast_hold_bf16_gradients_and_adam_state():
    # Linear(256, 256): 256·256 + 256 = 65,792 parameters.
    #   bf16 weights: 65,792 · 2 B = 131,584 B; their gradients follow the parameters (autograd
    #   makes a gradient like its parameter): 131,584 B; Adam's exp_avg and exp_avg_sq are
    #   zeros_like(p): 2 · 131,584 = 263,168 B.
    #   amp-bf16 alone keeps fp32 master weights: 263,168 B, 263,168 B and 526,336 B.
    bf16 = _bytes_by_category(precision="amp-bf16", weight_dtype="bf16")
    assert (bf16[Category.PARAMETERS], bf16[Category.GRADIENTS], bf16[Category.OPTIMIZER_STATE]) == (
        131_584, 131_584, 263_168)
    fp32 = _bytes_by_category(precision="amp-bf16")
    assert (fp32[Category.PARAMETERS], fp32[Category.GRADIENTS], fp32[Category.OPTIMIZER_STATE]) == (
        263_168, 263_168, 526_336)


def test_bf16_weights_are_not_cast_again_by_autocast():
    # fp32 weights under amp-bf16: the forward casts the weight to a bf16 copy, 256·256·2 =
    # 131,072 B (cached for the step). bf16 weights are already in autocast's dtype: no copy.
    def weight_casts(**options: object) -> int:
        traced = trace_step(resolve(_linear, batch_size=8, input_shape=(256,)),
                            build_step(optimizer="adam", precision="amp-bf16", **options))
        trace = traced.trace
        return sum(1 for u in range(trace.num_storages) if trace.phase[u] is Phase.FORWARD
                   and trace.nbytes[u] == 256 * 256 * 2)

    assert weight_casts() == 1
    assert weight_casts(weight_dtype="bf16") == 0


def test_the_report_says_where_the_weights_are_and_the_precisions_own_dtype_changes_nothing():
    report = memcalc.estimate(_linear, batch_size=8, input_shape=(256,), precision="amp-bf16", weight_dtype="bf16")
    assert report.bytes.parameters == 131_584
    assert any(note.startswith("parameters stored in bfloat16 (weight_dtype) under amp-bf16") for note in report.notes)
    # the dtype the precision implies, given: the same step as without it
    for precision, weights in (("amp-bf16", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")):
        given = memcalc.estimate(_linear, batch_size=8, input_shape=(256,), precision=precision, weight_dtype=weights)
        plain = memcalc.estimate(_linear, batch_size=8, input_shape=(256,), precision=precision)
        assert given.to_dict() == plain.to_dict()


@bf16_followed
def test_bf16_weights_under_amp_bf16_match_the_real_cpu_step():
    # an MLP trained with AdamW; autocast casts the float32 input for the first Linear (a
    # LayerNorm first would fail on the real CPU: its kernel refuses a float32 input with bf16
    # weights, "mixed dtype (CPU): expect parameter to have scalar type of Float")
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))

    options = dict(batch_size=32, input_shape=(256,), optimizer="adamw", precision="amp-bf16", weight_dtype="bf16")
    estimate = memcalc.estimate(model, gpu="cpu", **options)
    torch.manual_seed(0)
    measured = measure_cpu(build_step(model, gpu="cpu", **options)).peak_allocated
    assert measured is not None
    error = (estimate.peak_requested - measured) / measured
    assert abs(error) <= TOLERANCE, f"estimated {estimate.peak_requested:,} B vs real CPU {measured:,} B ({error:+.2%})"


@pytest.mark.slow  # a real CPU step of a Hugging Face Llama; the MLP's above stays quick
@bf16_followed
def test_a_llama_loaded_in_bf16_under_amp_bf16_matches_the_real_cpu_step(tmp_path: Path):
    # Hugging Face Trainer's bf16=True on a model loaded with dtype=torch.bfloat16: through --measure's path
    pytest.importorskip("transformers")
    model = hf_config_source(tmp_path)
    step = build_step(model, batch_size=2, seq_len=32, optimizer="adamw", precision="amp-bf16", weight_dtype="bf16")
    report = memcalc.estimate(model, batch_size=2, seq_len=32, optimizer="adamw", precision="amp-bf16",
                              weight_dtype="bf16", gpu="cpu")
    torch.manual_seed(0)
    measured = attach_measurement(report, step, device="cpu").measurement
    assert measured is not None and measured.compared_with == report.peak_requested
    error = measured.relative_error()
    assert error is not None and abs(error) <= TOLERANCE, (
        f"estimated {report.peak_requested:,} B vs real CPU {measured.peak_allocated:,} B")


@pytest.mark.parametrize(("precision", "weights", "fragment"), [
    ("fp32", "bf16", "Give precision bf16 for bf16 weights without autocast, or precision amp-bf16"),
    ("bf16", "fp32", "or precision amp-bf16 with weight_dtype fp32"),
    ("fp16", "bf16", "Give precision bf16 for bf16 weights without autocast, or precision amp-bf16"),
    ("amp-fp16", "fp16", "Give precision fp16"),
])
def test_a_weight_dtype_the_precision_contradicts_is_refused(precision: str, weights: str, fragment: str):
    with pytest.raises(InvalidInputError) as caught:
        memcalc.estimate("mlp", batch_size=2, precision=precision, weight_dtype=weights)
    assert str(caught.value).startswith("weight_dtype (--weight-dtype)")
    assert fragment in (caught.value.hint or "")
    with pytest.raises(InvalidInputError, match="unknown weight_dtype 'int8'"):
        memcalc.estimate("mlp", batch_size=2, weight_dtype="int8")


def test_a_strategy_refuses_weights_it_would_not_model():
    with pytest.raises(InapplicableOptionError, match="not estimated under --strategy ddp"):
        memcalc.estimate("mlp", batch_size=2, precision="amp-bf16", weight_dtype="bf16",
                         distributed=memcalc.Distributed("ddp", world_size=2))


def test_the_cli_offers_it_in_every_command_and_explains_it():
    runner = CliRunner()
    helped = runner.invoke(main, ["estimate", "--help"]).output
    assert "--weight-dtype [fp32|bf16|fp16]" in helped and "Trainer's bf16=True" in " ".join(helped.split())
    result = runner.invoke(main, ["fc-32-16", "--batch", "2", "--precision", "amp-bf16", "--weight-dtype", "bf16"])
    assert result.exit_code == 0, result.output
    # fc-32-16: 32·16 bf16 weights = 1,024 B, four times over in the textbook line (weights, grads, 2 moments)
    assert "textbook: parameters 1.00 KiB × 4" in result.output
    assert "note: parameters stored in bfloat16 (weight_dtype) under amp-bf16" in result.output
    refused = runner.invoke(main, ["fc-32-16", "--weight-dtype", "bf16"])
    assert refused.exit_code == 2 and "contradicts precision fp32" in refused.output
    for command in ("fit", "sweep", "compare"):
        assert "--weight-dtype" in runner.invoke(main, [command, "--help"]).output, command

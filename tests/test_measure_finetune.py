"""``--measure`` with fine-tuning: the real step freezes the same parameters and carries the same
PEFT adapters as the estimate (:func:`memcalc.stacks.peft.finetune_module` on the real
model, before the optimizer is built), and agrees with the estimate for this CPU.

Compared as tests/test_against_cpu.py compares: the simulation's unrounded peak for
``gpu="cpu"`` against the CPU profiler's peak plus the storages there before the step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support import hf_config_source, skip_module_without
from torch import nn

import memcalc
from memcalc import FineTune, LoRA
from memcalc.cli import main
from memcalc.core.errors import InvalidInputError
from memcalc.fields import build_step
from memcalc.measure.step import attach_measurement, measure, measure_cpu

# imported by the steps that use them (support.skip_module_without)
skip_module_without("peft", "transformers")

# The bar of tests/test_against_cpu.py (0.5 %). On torch 2.13 these cases agree within 72 B
# (0.003 %): the optimizers' CPU step counters, which the estimate for this CPU leaves out.
TOLERANCE = 0.005



def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))


def _error(estimated: int, measured: int | None) -> float:
    assert measured is not None
    return (estimated - measured) / measured


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.quick_cases("adam")
def test_frozen_layers_measured_on_cpu_match_the_estimate(optimizer: str):
    finetune = FineTune(freeze=("0.*", "2.weight"))
    kwargs = dict(batch_size=64, input_shape=(256,), optimizer=optimizer)
    frozen = memcalc.estimate(_mlp, gpu="cpu", finetune=finetune, **kwargs)
    full = memcalc.estimate(_mlp, gpu="cpu", **kwargs)
    assert frozen.peak_requested < full.peak_requested  # the freeze changes the step: a measurement must see it
    torch.manual_seed(0)
    measured = measure_cpu(build_step(_mlp, finetune=finetune, **kwargs))
    error = _error(frozen.peak_requested, measured.peak_allocated)
    assert abs(error) <= TOLERANCE, f"estimated {frozen.peak_requested:,} B vs real CPU {measured.peak_allocated:,} B"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.slow  # a real LoRA step under the profiler per case
def test_lora_measured_on_cpu_matches_the_estimate(tmp_path: Path, precision: str):
    # bf16: the adapters stay float32 in a bf16 model (KEEP_DTYPE), in the real model as on meta
    model = hf_config_source(tmp_path)
    kwargs = dict(batch_size=2, seq_len=32, optimizer="adamw", precision=precision, finetune=FineTune(lora=LoRA(8)))
    report = memcalc.estimate(model, **kwargs)
    assert report.trainable_parameters == 3584  # PEFT's count: q_proj and v_proj adapted, r=8, 2 layers
    torch.manual_seed(0)
    measured = attach_measurement(report, build_step(model, **kwargs), device="cpu").measurement
    assert measured is not None and measured.device == "cpu (torch.profiler)"
    cpu = memcalc.estimate(model, gpu="cpu", **kwargs)
    assert measured.compared_with == cpu.peak_requested
    error = measured.relative_error()
    assert error is not None and abs(error) <= TOLERANCE, (
        f"{precision}: estimated {cpu.peak_requested:,} B vs real CPU {measured.peak_allocated:,} B")


def test_measuring_leaves_the_users_module_as_it_was():
    model = _mlp()
    measure(build_step(model, batch_size=4, input_shape=(256,), finetune=FineTune(freeze=("0.*",), lora=None)),
            device="cpu")
    assert all(p.requires_grad for p in model.parameters())


def test_a_quantized_base_is_not_measured(tmp_path: Path):
    with pytest.raises(InvalidInputError, match="bitsandbytes"):
        measure(build_step(hf_config_source(tmp_path), batch_size=1, seq_len=16,
                           finetune=FineTune(lora=LoRA(8), quant="nf4")), device="cpu")


# ---- the command line ------------------------------------------------------------------------
@pytest.mark.slow  # a real LoRA step under the profiler
def test_cli_measures_lora(tmp_path: Path):
    result = CliRunner().invoke(main, [hf_config_source(tmp_path), "--lora", "8", "--seq-len", "32", "--batch", "2",
                                       "--optim", "adamw", "--measure", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["trainable_parameters"] == 3584
    measured = data["measured"]
    assert measured["device"] == "cpu (torch.profiler)" and measured["oom"] is False
    assert abs(measured["relative_error"]) <= TOLERANCE


@pytest.mark.slow  # a real CPU step under the profiler
def test_cli_measures_frozen_parameters():
    args = ["mlp", "--batch", "16", "--freeze", "1.*", "--measure"]
    data = json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).output)
    assert data["trainable_parameters"] < data["parameters"]
    assert abs(data["measured"]["relative_error"]) <= TOLERANCE
    text = CliRunner().invoke(main, [*args, "--depth", "0"])
    assert text.exit_code == 0, text.output
    assert "trainable parameters:" in text.output and "measured on cpu (torch.profiler)" in text.output


@pytest.mark.parametrize("extra", [["--lora", "8"], ["--freeze", "*.layers.0.*"]])
def test_cli_still_refuses_to_measure_a_quantized_base(tmp_path: Path, extra: list[str]):
    result = CliRunner().invoke(main, [hf_config_source(tmp_path), *extra, "--quant", "nf4", "--seq-len", "16",
                                       "--measure"])
    assert result.exit_code == 2
    assert "--measure cannot run --quant nf4" in result.output and "bitsandbytes" in result.output

"""The ``memcalc`` command: golden output, JSON, exit codes and messages for bad input.

What a scenario prints is compared with ``tests/golden/<test name>.out`` by the ``golden``
fixture (tests/conftest.py); after an intended change, ``python -m pytest tests/test_cli.py
--overwrite`` rewrites the files (``MEMCALC_REGEN_GOLDEN=1`` does the same) for review in the
diff. Assertions here check what a golden file cannot: arithmetic, JSON keys, exit codes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memcalc.cli import main

FIXTURES = Path(__file__).parent / "fixtures"


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=True)


@pytest.mark.parametrize("args", [
    pytest.param(["fc-32-16", "--batch", "100", "--mode", "eval", "--optim", "none"], id="fc-32-16_eval"),
    pytest.param(["mlp", "--batch", "32", "--optim", "sgd", "--format", "github"], id="mlp_sgd_github"),
    pytest.param(["mlp", "-b", "32", "--optim", "adam", "--format", "json"], id="mlp_adam_json"),
    pytest.param(["resnet50", "--batch", "64", "--optim", "adam"], id="resnet50_readme"),  # the README's main job
    pytest.param(["mlp", "--precision", "bf16", "--gpu", "v100-16gb", "--depth", "0"], id="mlp_bf16_v100"),
    pytest.param(["gpt2", "--seq-len", "128", "--precision", "amp-bf16", "--gpu", "a100-80gb", "--depth", "0"],
                 id="gpt2_amp_bf16_a100"),
    pytest.param(["zoo"], id="zoo"),
    # SGD keeps no state: the second iteration's peak is the kept gradients', not "optimizer state"
    pytest.param(["mlp", "--optim", "sgd", "--keep-grads", "--depth", "0"], id="mlp_sgd_keep_grads"),
])
def test_estimate(args, golden):
    result = run(*args)
    assert result.exit_code == 0, result.output
    golden(result.output, suffix=".json" if "json" in args else ".out")


def test_worked_example_shows_the_articles_numbers():
    result = run("fc-32-16", "--batch", "100", "--mode", "eval", "--optim", "none", "--units", "B")
    assert result.exit_code == 0
    for figure in ("12,800 B", "2,048 B", "6,400 B"):
        assert figure in result.output
    # peak: each block rounded up to 512 B (21,504 B) + the cuBLAS workspace of the first matmul
    assert "8,541,184 B" in result.output and "cuBLAS workspace: 1 × 8,519,680 B" in result.output


def test_json_contract_keys():
    result = run("mlp", "--batch", "8", "--format", "json")
    data = json.loads(result.output)
    assert list(data) == ["model", "batch_size", "optimizer", "mode", "precision", "gpu", "parameters",
                          "peak_phase", "peak_module", "attention_backend", "fits", "loop", "keep_grads",
                          "optimizer_impl", "torch_version", "cuda_version", "trainable_parameters",
                          "paged_optimizer_state", "bytes"]
    assert data["batch_size"] == 8 and data["optimizer"] == "adam"


def test_units_option():
    result = run("mlp", "--batch", "8", "--units", "MiB", "--depth", "0")
    assert result.exit_code == 0
    assert " KiB" not in result.output and " GiB" not in result.output


# ---- bad input (the battery of usage errors, one golden file each, is tests/test_bad_inputs.py) ---
def test_op_that_cannot_run_symbolically(golden):
    # bool(tensor) in forward: the message names the op and where it ran, and says what to do
    result = run(f"{FIXTURES / 'user_models.py'}:make_branching", "--batch", "4", "--input-shape", "20")
    assert result.exit_code == 1, result.output
    golden(result.output)


def test_debug_shows_the_traceback():
    result = run("resnt50", "--debug")
    assert result.exit_code != 0
    assert result.exception is not None  # re-raised for the traceback


def test_model_that_does_not_fit_the_input_shape():
    # example_inputs gives (B, 20) to a Linear(7, 3): the meta kernel of addmm refuses. Not a
    # golden file: the message quotes torch's own error, whose words differ between the torch
    # releases of CI's version matrix.
    result = run(f"{FIXTURES / 'user_models.py'}:make_wrong_width", "--batch", "2")
    assert result.exit_code == 2, result.output  # the input is what the user can change
    assert "--input-shape" in result.output and "aten.addmm" in result.output
    assert "Traceback" not in result.output


def test_subcommand_and_model_coexist():
    assert run("zoo", "--format", "json").exit_code == 0
    assert run("--help").exit_code == 0
    assert "estimate" in run("--help").output


# ---- CUDA-faithful options ----------------------------------------------------------------
def test_gpu_json_fields():
    data = json.loads(run("resnet18", "--input-shape", "3,64,64", "--gpu", "t4", "--format", "json").output)
    assert data["gpu"] == "t4" and data["fits"] is True and data["precision"] == "fp32"
    assert data["bytes"]["cuda_context"] > 0 and data["bytes"]["peak_reserved"] >= data["bytes"]["peak_allocated"]


def test_inference_with_kv_cache():
    result = run("llama-tiny", "--seq-len", "64", "--mode", "inference", "--kv-cache", "32", "--precision", "bf16",
                 "--format", "json")
    data = json.loads(result.output)
    # 8 layers · 2 KV heads · 64 · 2 (K, V) · (64 + 32) tokens · 2 B = 393,216 B for batch 1
    assert data["bytes"]["kv_cache"] == 8 * 2 * 64 * 2 * 96 * 2 == 196_608 * 2


def test_measure_on_cpu_puts_the_real_peak_beside_the_estimate():
    # The CPU target (--gpu cpu): the real step runs on the CPU under torch.profiler, on a GPU
    # machine too, compared with the CPU-faithful simulation (an MLP agrees to the byte).
    result = run("mlp", "--batch", "16", "--optim", "adam", "--gpu", "cpu", "--measure", "--format", "json")
    assert result.exit_code == 0, result.output
    measured = json.loads(result.output)["measured"]
    assert measured["device"] == "cpu (torch.profiler)" and measured["oom"] is False
    assert abs(measured["relative_error"]) < 0.005
    text = run("mlp", "--batch", "16", "--gpu", "cpu", "--measure", "--depth", "0").output
    assert "measured on cpu (torch.profiler)" in text and "error" in text

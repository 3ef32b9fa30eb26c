"""The ``memcalc`` command: golden output, JSON, exit codes and messages for bad input.

Golden files live in tests/golden/; regenerate them with ``MEMCALC_REGEN_GOLDEN=1 pytest tests/test_cli.py``
and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from memcalc.cli import main
from memcalc.targets.stack import installed_torch_version

GOLDEN = Path(__file__).parent / "golden"
FIXTURES = Path(__file__).parent / "fixtures"


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=True)


#: The torch the golden files were recorded with. CI's version matrix runs them on other
#: releases too: there the installed release, named in the header's "assumed:" line and in the
#: JSON's torch_version, is read as this one, and every other character must be equal.
GOLDEN_TORCH = "2.13"


def _as_recorded(text: str) -> str:
    installed = installed_torch_version()
    if installed == GOLDEN_TORCH:
        return text
    return text.replace(f"assumed: torch {installed},", f"assumed: torch {GOLDEN_TORCH},").replace(
        f'"torch_version": "{installed}"', f'"torch_version": "{GOLDEN_TORCH}"')


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    text = _as_recorded(text)
    if os.environ.get("MEMCALC_REGEN_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with MEMCALC_REGEN_GOLDEN=1"
    assert text == path.read_text()


@pytest.mark.parametrize("name, args", [
    ("fc-32-16_eval.out", ["fc-32-16", "--batch", "100", "--mode", "eval", "--optim", "none"]),
    ("mlp_sgd_github.out", ["mlp", "--batch", "32", "--optim", "sgd", "--format", "github"]),
    ("mlp_adam.json", ["mlp", "-b", "32", "--optim", "adam", "--format", "json"]),
    ("zoo.out", ["zoo"]),
])
def test_golden_output(name, args):
    result = run(*args)
    assert result.exit_code == 0, result.output
    _golden(name, result.output)


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


def test_main_job_from_the_readme():
    result = run("resnet50", "--batch", "64", "--optim", "adam")
    assert result.exit_code == 0, result.output
    assert "peak allocated" in result.output and "backward" in result.output
    assert "textbook: parameters" in result.output and "× 4" in result.output


def test_units_option():
    result = run("mlp", "--batch", "8", "--units", "MiB", "--depth", "0")
    assert result.exit_code == 0
    assert " KiB" not in result.output and " GiB" not in result.output


# ---- bad input ---------------------------------------------------------------------------
def _no_traceback(result):
    assert "Traceback" not in result.output


def test_unknown_model_suggests_closest():
    result = run("resnt50", "--batch", "2")
    assert result.exit_code == 2
    assert "unknown model 'resnt50'" in result.output
    assert "Did you mean resnet50" in result.output
    _no_traceback(result)


@pytest.mark.parametrize("args, fragment", [
    (["mlp", "--batch", "0"], "--batch"),
    (["mlp", "--input-shape", "3,a,224"], "is not a shape"),
    (["mlp", "--input-shape", "3,-1"], "is not a shape"),
    (["mlp", "--optim", "adamax"], "--optim"),
    (["mlp", "--mode", "sideways"], "--mode"),
    (["mlp", "--format", "yaml"], "--format"),
])
def test_usage_errors_exit_2(args, fragment):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert fragment in result.output
    _no_traceback(result)


def test_op_that_cannot_run_symbolically_names_op_and_module():
    result = run(f"{FIXTURES / 'user_models.py'}:make_branching", "--batch", "4", "--input-shape", "20")
    assert result.exit_code == 1, result.output
    assert "_local_scalar_dense" in result.output  # the op: bool(tensor) reads a value
    assert "forward" in result.output
    assert "reads tensor values" in result.output  # the hint
    _no_traceback(result)


def test_debug_shows_the_traceback():
    result = run("resnt50", "--debug")
    assert result.exit_code != 0
    assert result.exception is not None  # re-raised for the traceback


def test_model_that_does_not_fit_the_input_shape():
    # example_inputs gives (B, 20) to a Linear(7, 3): the meta kernel of addmm refuses
    result = run(f"{FIXTURES / 'user_models.py'}:make_wrong_width", "--batch", "2")
    assert result.exit_code == 2, result.output  # the input is what the user can change
    assert "--input-shape" in result.output and "aten.addmm" in result.output
    _no_traceback(result)


def test_image_model_given_only_seq_len():
    result = run("resnet18", "--seq-len", "128")
    assert result.exit_code == 2
    assert "--input-shape" in result.output


def test_subcommand_and_model_coexist():
    assert run("zoo", "--format", "json").exit_code == 0
    assert run("--help").exit_code == 0
    assert "estimate" in run("--help").output


# ---- CUDA-faithful options ----------------------------------------------------------------
def test_unknown_gpu_exit_2_with_close_matches():
    result = run("mlp", "--gpu", "h1000")
    assert result.exit_code == 2
    assert "unknown GPU 'h1000'" in result.output and "h100-80gb" in result.output
    _no_traceback(result)


def test_ambiguous_gpu_lists_both():
    result = run("mlp", "--gpu", "a100")
    assert result.exit_code == 2 and "a100-40gb" in result.output and "a100-80gb" in result.output


def test_accum_steps_zero_is_a_usage_error():
    result = run("mlp", "--accum-steps", "0")
    assert result.exit_code == 2 and "--accum-steps" in result.output


def test_bf16_on_v100_says_so():
    result = run("mlp", "--precision", "bf16", "--gpu", "v100-16gb", "--depth", "0")
    assert result.exit_code == 0
    assert "no native bf16" in result.output


def test_gpu_json_fields():
    data = json.loads(run("resnet18", "--input-shape", "3,64,64", "--gpu", "t4", "--format", "json").output)
    assert data["gpu"] == "t4" and data["fits"] is True and data["precision"] == "fp32"
    assert data["bytes"]["cuda_context"] > 0 and data["bytes"]["peak_reserved"] >= data["bytes"]["peak_allocated"]
    text = run("gpt2", "--seq-len", "128", "--precision", "amp-bf16", "--gpu", "a100-80gb", "--depth", "0").output
    assert "attention kernels (as CUDA would choose): flash ×12" in text
    assert "fits in" in text and "yes" in text


def test_inference_with_kv_cache():
    result = run("llama-tiny", "--seq-len", "64", "--mode", "inference", "--kv-cache", "32", "--precision", "bf16",
                 "--format", "json")
    data = json.loads(result.output)
    # 8 layers · 2 KV heads · 64 · 2 (K, V) · (64 + 32) tokens · 2 B = 393,216 B for batch 1
    assert data["bytes"]["kv_cache"] == 8 * 2 * 64 * 2 * 96 * 2 == 196_608 * 2


def test_measure_on_cpu_puts_the_real_peak_beside_the_estimate():
    # No GPU here: the real step runs on the CPU under torch.profiler, compared with the
    # CPU-faithful simulation (an MLP agrees to the byte).
    result = run("mlp", "--batch", "16", "--optim", "adam", "--measure", "--format", "json")
    assert result.exit_code == 0, result.output
    measured = json.loads(result.output)["measured"]
    assert measured["device"] == "cpu (torch.profiler)" and measured["oom"] is False
    assert abs(measured["relative_error"]) < 0.005
    text = run("mlp", "--batch", "16", "--measure", "--depth", "0").output
    assert "measured on cpu (torch.profiler)" in text and "error" in text

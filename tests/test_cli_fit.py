"""``memcalc fit``, ``memcalc sweep`` and ``memcalc gpus`` through click's CliRunner: exit
codes, messages, the JSON shapes, the plot file. Local GPUs are stubbed; models are small."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

import memcalc.cli
from memcalc import api
from memcalc.cli import sweep as cli_sweep
from memcalc.search import budget as budgets
from memcalc.targets.cuda.gpus import local as gpus
from memcalc.targets.cuda.gpus.catalogue import get_gpu
from memcalc.targets.cuda.gpus.local import LocalGpu

main = memcalc.cli.main

MiB = 1024**2
GiB = 1024**3

ESTIMATE_KEYS = {"model", "batch_size", "optimizer", "mode", "parameters", "peak_phase", "peak_module", "bytes"}


def run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def two_gpus(monkeypatch):
    # nearly full cards (someone else is training on them), so that the mlp's batch is bounded
    found = [
        LocalGpu(0, 1, "NVIDIA A100-SXM4-40GB", "GPU-aaaa", 40960 * MiB, 600 * MiB),
        LocalGpu(1, 0, "NVIDIA A100-SXM4-40GB", "GPU-bbbb", 40960 * MiB, 1024 * MiB),
    ]
    monkeypatch.setattr(gpus, "list_local_gpus", lambda *a, **k: found)
    monkeypatch.setattr(budgets, "_cuda_initialised", lambda: False)
    return found


@pytest.fixture
def no_gpus(monkeypatch):
    monkeypatch.setattr(gpus, "list_local_gpus", lambda *a, **k: [])


@pytest.fixture(scope="module")
def mlp_budget() -> int:
    """A budget some hundreds of mlp samples above batch 1."""
    return int(api.estimate("mlp", batch_size=1).peak_reserved * 1.2)


# ------------------------------------------------------------------ fit


def test_fit_json_shape(mlp_budget):
    result = run("fit", "mlp", "--budget", str(mlp_budget), "--optim", "sgd", "--margin", "0", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"batch_size", "budget_bytes", "margin", "margin_basis", "margin_budget_bytes", "raw_batch_size",
                         "checked_from", "report"}
    assert data["budget_bytes"] == data["margin_budget_bytes"] == mlp_budget and data["margin"] == 0
    assert data["raw_batch_size"] >= data["batch_size"] >= data["checked_from"] >= 1
    batch = data["batch_size"]
    at_batch = api.estimate("mlp", batch_size=batch, optimizer="sgd", capacity=mlp_budget)
    assert data["report"] == at_batch.to_dict()  # the estimate JSON, unchanged
    assert ESTIMATE_KEYS <= set(data["report"]) and data["report"]["batch_size"] == batch
    assert at_batch.fits is True
    assert api.estimate("mlp", batch_size=batch + 1, optimizer="sgd", capacity=mlp_budget).fits is False


def test_fit_text_shows_batch_breakdown_and_neighbours(mlp_budget):
    result = run("fit", "mlp", "--budget", str(mlp_budget), "--margin", "0")
    assert result.exit_code == 0, result.output
    batch = json.loads(run("fit", "mlp", "--budget", str(mlp_budget), "--margin", "0", "--format", "json").stdout)[
        "batch_size"]
    out = result.stdout
    assert f"largest batch that fits: {batch} (batch {batch + 1} does not" in out
    assert "peak allocated" in out and "optimizer state" in out  # the breakdown at that batch
    neighbour_rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert [int(r[0]) for r in neighbour_rows] == list(range(batch - 2, batch + 3))
    assert "<- largest" in out


def test_fit_gpu_uses_total_minus_context():
    result = run("fit", "resnet18", "--input-shape", "3,64,64", "--gpu", "t4", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["budget_bytes"] == get_gpu("t4").usable_memory


def test_fit_budget_with_unit_as_a_separate_word():
    quoted = run("fit", "mlp", "--budget", "64 MiB", "--margin", "0", "--format", "json")
    unquoted = run("fit", "mlp", "--budget", "64", "MiB", "--margin", "0", "--format", "json")
    assert quoted.exit_code == unquoted.exit_code == 0, unquoted.output
    assert json.loads(unquoted.stdout) == json.loads(quoted.stdout)
    assert json.loads(unquoted.stdout)["budget_bytes"] == 64 * MiB


@pytest.mark.parametrize("args", [["--budget", "12 parsecs"], ["--budget", "12", "parsecs"], ["--budget", "lots"]])
def test_fit_unreadable_budget_is_a_usage_error_naming_the_forms(args):
    result = run("fit", "mlp", *args)
    assert result.exit_code == 2
    assert "--budget" in result.output and "24GiB" in result.output and "80GB" in result.output
    assert "Traceback" not in result.output


def test_fit_needs_exactly_one_budget_source():
    both = run("fit", "mlp", "--gpu", "a100-40gb", "--budget", "16GiB")
    assert both.exit_code == 2 and "only one of --gpu, --budget or --device" in both.output
    neither = run("fit", "mlp")
    assert neither.exit_code == 2 and "--gpu" in neither.output and "--budget" in neither.output


def test_fit_unknown_gpu_suggests_names():
    result = run("fit", "mlp", "--gpu", "a100-40")
    assert result.exit_code == 2 and "a100-40gb" in result.output


def test_fit_batch_one_does_not_fit_exits_1_with_advice():
    result = run("fit", "mlp", "--budget", "8MiB")
    assert result.exit_code == 1
    err = result.stderr
    assert "even batch 1 does not fit in 8.00 MiB" in err
    assert "needs" in err and "model states" in err.lower() and "dominate" in err
    for advice in ("--optim", "--precision", "checkpointing", "sharding"):
        assert advice in err


def test_fit_device_auto_takes_the_gpu_with_most_free_memory(two_gpus):
    result = run("fit", "mlp", "--device", "auto", "--format", "json")
    assert result.exit_code == 0, result.output
    expected = 1024 * MiB - get_gpu("a100-40gb").cuda_context  # cuda:1, minus a new process's context
    assert json.loads(result.stdout)["budget_bytes"] == expected


def test_fit_device_that_does_not_exist(two_gpus):
    result = run("fit", "mlp", "--device", "cuda:3")
    assert result.exit_code == 2
    assert "cuda:3" in result.stderr and "2 GPUs are visible" in result.stderr


def test_fit_device_without_gpu(no_gpus):
    result = run("fit", "mlp", "--device", "auto")
    assert result.exit_code == 2 and "no GPU is visible" in result.stderr


# ------------------------------------------------------------------ sweep


def test_sweep_one_row_per_configuration():
    result = run("sweep", "mlp", "--batch", "1,16,64", "--optim", "sgd,adam")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("1", "sgd"), ("16", "sgd"), ("64", "sgd"),
                                            ("1", "adam"), ("16", "adam"), ("64", "adam")]
    assert "peak allocated" in result.stdout and "activations" in result.stdout
    assert "fits" not in result.stdout  # no budget, no fits column


def test_sweep_json_rows_and_fits():
    result = run("sweep", "mlp", "--batch", "1,4096", "--budget", "36MiB", "--format", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["batch_size"] for r in rows] == [1, 4096]
    for row in rows:
        assert set(row) == {"batch_size", "optimizer", "precision", "fits", "report"}
        direct = api.estimate("mlp", batch_size=row["batch_size"], capacity=36 * MiB)
        assert row["report"] == direct.to_dict() and ESTIMATE_KEYS <= set(row["report"])
        assert row["fits"] == direct.fits


@pytest.mark.parametrize("args, item", [
    (["--batch", "1,x,16"], "'x'"),
    (["--batch", "1,0"], "'0'"),
    (["--batch", "1", "--optim", "sgd,lion"], "'lion'"),
    (["--batch", "1", "--precision", "fp32,fp8"], "'fp8'"),
])
def test_sweep_invalid_item_is_a_usage_error_naming_it(args, item):
    result = run("sweep", "mlp", *args)
    assert result.exit_code == 2
    assert item in result.output


def test_sweep_gpu_and_budget_together_is_a_usage_error():
    result = run("sweep", "mlp", "--batch", "1", "--gpu", "t4", "--budget", "1GiB")
    assert result.exit_code == 2 and "only one" in result.output


def test_sweep_progress_bar_only_on_a_terminal_and_never_with_json(monkeypatch):
    args = ["sweep", "mlp", "--batch", "1,2,3,4,5,6"]
    plain = run(*args)
    assert plain.exit_code == 0 and "estimating" not in plain.output  # CliRunner is not a terminal
    monkeypatch.setattr(cli_sweep, "_is_terminal", lambda stream: True)
    shown = run(*args)
    assert shown.exit_code == 0 and "estimating" in shown.stderr
    as_json = run(*args, "--format", "json")
    assert "estimating" not in as_json.output and len(json.loads(as_json.stdout)) == 6
    few = run("sweep", "mlp", "--batch", "1,2")  # a few configurations: no bar
    assert "estimating" not in few.output


def test_sweep_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    result = run("sweep", "mlp", "--batch", "1,64,256", "--optim", "sgd,adam", "--gpu", "t4", "--plot", str(path))
    assert result.exit_code == 0, result.output
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert f"wrote {path}" in result.stderr


def test_sweep_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    for name in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    path = tmp_path / "memory.png"
    result = run("sweep", "mlp", "--batch", "1", "--plot", str(path))
    assert result.exit_code == 1
    assert "matplotlib" in result.stderr and "pip install matplotlib" in result.stderr
    assert not path.exists()


# ------------------------------------------------------------------ gpus


def test_gpus_without_gpu_says_so_and_exits_0(no_gpus):
    result = run("gpus")
    assert result.exit_code == 0
    assert "No GPU is visible" in result.stdout
    as_json = run("gpus", "--format", "json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == []


def test_gpus_lists_and_marks_the_most_free(two_gpus):
    result = run("gpus")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("cuda:")}
    assert set(lines) == {"cuda:0", "cuda:1"}
    assert lines["cuda:1"].rstrip().endswith("*") and not lines["cuda:0"].rstrip().endswith("*")
    assert "a100-40gb" in lines["cuda:0"]
    # logical cuda:0 is physical GPU 1 (CUDA_VISIBLE_DEVICES=1,0)
    assert lines["cuda:0"].split()[1] == "1"
    assert "--device auto picks cuda:1" in result.stdout
    rows = json.loads(run("gpus", "--format", "json").stdout)
    assert [(r["device"], r["physical_index"], r["most_free"]) for r in rows] == [("cuda:0", 1, False), ("cuda:1", 0, True)]
    assert rows[1]["free_memory"] == 1024 * MiB and rows[0]["catalogue"] == "a100-40gb"


def test_gpus_through_nvidia_smi_with_reordering(monkeypatch):
    # the recorded-format sample, through the real discovery path with only nvidia-smi present
    sample = "0, GPU-1111, NVIDIA A100-SXM4-80GB, 81920, 80000\n1, GPU-2222, NVIDIA A100-SXM4-80GB, 81920, 1000\n"

    class Done:
        returncode = 0
        stdout = sample

    real = gpus.list_local_gpus
    monkeypatch.setattr(gpus, "list_local_gpus", lambda: real(
        {"CUDA_VISIBLE_DEVICES": "1,0", "PATH": "/usr/bin"}, runner=lambda *a, **k: Done(),
        which=lambda *a, **k: "/usr/bin/nvidia-smi", nvml=lambda: None, torch_cuda=lambda: None))
    rows = json.loads(run("gpus", "--format", "json").stdout)
    assert [(r["device"], r["physical_index"], r["uuid"]) for r in rows] == [
        ("cuda:0", 1, "GPU-2222"), ("cuda:1", 0, "GPU-1111")]
    assert [r["most_free"] for r in rows] == [False, True]



@pytest.mark.slow
def test_fit_with_a_strategy_gives_the_per_gpu_batch():
    from click.testing import CliRunner

    from memcalc.cli import main

    single = CliRunner().invoke(main, ["fit", "gpt2", "--seq-len", "64", "--budget", "3GiB", "--optim", "adamw",
                                       "--format", "json"])
    # a 1M-element reduce bucket: DeepSpeed's default (5·10⁸ elements) alone would take 2 GB here
    zero = CliRunner().invoke(main, ["fit", "gpt2", "--seq-len", "64", "--budget", "3GiB", "--optim", "adamw",
                                     "--strategy", "zero3", "--world-size", "8", "--reduce-bucket-size", "1000000",
                                     "--format", "json"])
    assert single.exit_code == 0 and zero.exit_code == 0, zero.output
    # ZeRO-3 shards weights, gradients and Adam state over 8 GPUs: more room for activations per GPU
    assert json.loads(zero.output)["batch_size"] > json.loads(single.output)["batch_size"]
    assert json.loads(zero.output)["report"]["strategy"] == "zero3"


def test_fit_strategy_without_world_size_is_a_usage_error():
    from click.testing import CliRunner

    from memcalc.cli import main

    result = CliRunner().invoke(main, ["fit", "mlp", "--budget", "1GiB", "--strategy", "ddp"])
    assert result.exit_code == 2 and "world" in result.output.lower()

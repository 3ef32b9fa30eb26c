"""``memcalc fit``, ``memcalc sweep`` and ``memcalc gpus`` through click's CliRunner: exit
codes, messages, the JSON shapes, the plot file. Local GPUs are stubbed; models are small. What
a scenario prints is compared with its golden file (tests/golden/, the ``golden`` fixture); the
usage errors are in the battery of tests/test_bad_inputs.py."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

import memcalc
import memcalc.cli
from memcalc import api
from memcalc.cli import progress as cli_progress
from memcalc.targets import budget as budgets
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
    result = run("fit", "mlp", "--budget", f"{mlp_budget}B", "--optim", "sgd", "--margin", "0", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    optional = {"batch_size_with_expandable_segments"}  # only when a larger batch fits with them
    assert set(data) - optional == {"batch_size", "budget_bytes", "margin", "margin_basis", "margin_budget_bytes",
                                    "raw_batch_size", "checked_from", "report"}
    assert data["budget_bytes"] == data["margin_budget_bytes"] == mlp_budget and data["margin"] == 0
    assert data["raw_batch_size"] >= data["batch_size"] >= data["checked_from"] >= 1
    batch = data["batch_size"]
    at_batch = api.estimate("mlp", batch_size=batch, optimizer="sgd", capacity=mlp_budget)
    assert data["report"] == at_batch.to_dict()  # the estimate JSON, unchanged
    assert ESTIMATE_KEYS <= set(data["report"]) and data["report"]["batch_size"] == batch
    assert at_batch.fits is True
    assert api.estimate("mlp", batch_size=batch + 1, optimizer="sgd", capacity=mlp_budget).fits is False


def test_fit_text_shows_batch_breakdown_and_neighbours(mlp_budget, golden):
    result = run("fit", "mlp", "--budget", f"{mlp_budget}B", "--margin", "0")
    assert result.exit_code == 0, result.output
    golden(result.output)  # the answer, the breakdown at that batch, the neighbours' table
    batch = json.loads(run("fit", "mlp", "--budget", f"{mlp_budget}B", "--margin", "0", "--format", "json").stdout)[
        "batch_size"]
    out = result.stdout
    assert f"largest batch that fits: {batch} (batch {batch + 1} does not" in out  # the JSON's answer
    neighbour_rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert [int(r[0]) for r in neighbour_rows] == list(range(batch - 2, batch + 3))


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


def test_fit_batch_one_does_not_fit_exits_1_with_advice(golden):
    # what needs the memory (model states dominate) and what to change: --optim, --precision, checkpointing, sharding
    result = run("fit", "mlp", "--budget", "8MiB")
    assert result.exit_code == 1
    assert result.stdout == ""  # the message is an error: stderr only
    golden(result.output)


def test_fit_device_auto_takes_the_gpu_with_most_free_memory(two_gpus):
    result = run("fit", "mlp", "--device", "auto", "--format", "json")
    assert result.exit_code == 0, result.output
    expected = 1024 * MiB - get_gpu("a100-40gb").cuda_context  # cuda:1, minus a new process's context
    assert json.loads(result.stdout)["budget_bytes"] == expected


def test_fit_device_that_does_not_exist(two_gpus, golden):
    result = run("fit", "mlp", "--device", "cuda:3")
    assert result.exit_code == 2 and result.stdout == ""
    golden(result.output)  # how many GPUs are visible


def test_fit_device_without_gpu(no_gpus, golden):
    result = run("fit", "mlp", "--device", "auto")
    assert result.exit_code == 2 and result.stdout == ""
    golden(result.output)


# ------------------------------------------------------------------ sweep


def test_sweep_one_row_per_configuration(golden):
    # batches within each optimizer, in the order given; no budget, no fits column
    result = run("sweep", "mlp", "--batch", "1,16,64", "--optim", "sgd,adam")
    assert result.exit_code == 0, result.output
    golden(result.output)


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


def test_sweep_progress_bar_only_on_a_terminal_and_never_with_json(monkeypatch):
    args = ["sweep", "mlp", "--batch", "1,2,3,4,5,6"]
    quick = run(*args)  # CliRunner is not a terminal; and a sweep of a second shows no bar anyway
    assert quick.exit_code == 0 and "estimating" not in quick.output
    monkeypatch.setattr(cli_progress, "SHOW_AFTER_S", 0.0)  # every sweep as if it took a while
    plain = run(*args)
    assert plain.exit_code == 0 and "estimating" not in plain.output  # not a terminal
    monkeypatch.setattr(cli_progress, "is_terminal", lambda stream: True)
    shown = run(*args)
    assert shown.exit_code == 0 and f"\restimating configurations  [{'#' * 30}]  6/6" in shown.stderr
    assert shown.stderr.endswith("\n")
    as_json = run(*args, "--format", "json")
    assert "estimating" not in as_json.output and len(json.loads(as_json.stdout)) == 6


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


def test_gpus_without_gpu_says_so_and_exits_0(no_gpus, golden):
    result = run("gpus")
    assert result.exit_code == 0
    golden(result.output)
    as_json = run("gpus", "--format", "json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == []


def test_gpus_lists_and_marks_the_most_free(two_gpus, golden):
    # cuda:1 marked as the most free; logical cuda:0 is physical GPU 1 (CUDA_VISIBLE_DEVICES=1,0)
    result = run("gpus")
    assert result.exit_code == 0, result.output
    golden(result.output)
    rows = json.loads(run("gpus", "--format", "json").stdout)
    assert [(r["device"], r["physical_index"], r["most_free"]) for r in rows] == [("cuda:0", 1, False), ("cuda:1", 0,
                                                                                                         True)]
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


# ---- the CPU target (issue 32, item 5): --gpu cpu is a budget, not an unknown GPU -----------------
def test_fit_gpu_cpu_with_a_budget_searches_the_cpu_target():
    data = json.loads(run("fit", "mlp", "--gpu", "cpu", "--budget", "64MiB", "--format", "json").output)
    assert data["budget_bytes"] == 64 * 2**20 and data["report"]["gpu"] == "cpu"
    assert data["report"]["bytes"]["cuda_context"] == 0
    # the CPU target's margin is 1%: the answer's peak lies under 99% of the budget, the next batch's above
    assert data["margin"] == 0.01 and data["report"]["bytes"]["peak_allocated"] <= data["margin_budget_bytes"]
    above = memcalc.estimate("mlp", batch_size=data["batch_size"] + 1, gpu="cpu").bytes.peak_allocated
    assert above > data["margin_budget_bytes"]


def test_fit_gpu_cpu_without_a_budget_takes_the_available_ram(monkeypatch):
    monkeypatch.setattr(budgets, "available_ram", lambda: 256 * 2**20)
    result = run("fit", "mlp", "--gpu", "cpu", "--optim", "sgd")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("budget: 256.00 MiB (the CPU: this machine's available RAM (MemAvailable))\n")
    assert "against real CPU steps" in result.output


def test_sweep_gpu_cpu_estimates_the_cpu_target(monkeypatch):
    monkeypatch.setattr(budgets, "available_ram", lambda: 256 * 2**20)
    rows = json.loads(run("sweep", "mlp", "--batch", "1,8", "--gpu", "cpu", "--format", "json").output)
    direct = memcalc.estimate("mlp", batch_size=8, gpu="cpu", capacity=256 * 2**20).to_dict()
    assert [r["batch_size"] for r in rows] == [1, 8] and rows[1]["report"] == direct
    assert direct["gpu"] == "cpu" and all(r["fits"] for r in rows)

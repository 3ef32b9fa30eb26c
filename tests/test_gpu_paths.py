"""The paths that run on a CUDA machine, checked on this CPU-only one (issue 22, item 4):
``estimate(gpu="cuda:N" | "auto")`` and ``memcalc MODEL --device``, ``--measure`` estimating for
the GPU it measures on, and ``benchmarks/accuracy.py`` on a GPU.

The machine's GPUs are the recorded nvidia-smi outputs of tests/data/nvidia_smi/ (as in
test_gpus.py); where a test needs CUDA itself, ``torch.cuda``'s answers and the real measurement
(``measure_cuda``) are replaced, and the replacement checks the options it is given the way the
real one does.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import memcalc
import memcalc.cli
from memcalc.core.errors import InvalidInputError
from memcalc.core.gpu import GENERIC
from memcalc.core.report import Measurement
from memcalc.engine.step_spec import Step
from memcalc.measure import step as measure_module
from memcalc.targets import budget as budgets
from memcalc.targets.budget import resolve_budget
from memcalc.targets.cuda.gpus import local as gpu_local
from memcalc.targets.cuda.gpus.catalogue import get_gpu

#: These tests fake a CUDA machine by stubbing torch.cuda's queries. On a CPU build every CUDA
#: call that slips past the stubs fails cleanly; a CUDA build without a GPU (the version matrix
#: installs CUDA builds of other releases) reaches the real CUDA runtime inside the measured
#: step instead, so they run on CPU builds (and on a real GPU), not there.
_FAKE_CUDA_NEEDS_CPU_BUILD = pytest.mark.skipif(
    torch.version.cuda is not None and not torch.cuda.is_available(),
    reason="a CUDA build without a GPU: the faked CUDA machine reaches the real CUDA runtime")

ROOT = Path(__file__).parent.parent
SMI = Path(__file__).parent / "data" / "nvidia_smi"
MiB = 1024**2
GiB = 1024**3
H100_NAME = "NVIDIA H100 80GB HBM3"


def machine(monkeypatch: pytest.MonkeyPatch, sample: str | None) -> None:
    """This machine's GPUs are the ones nvidia-smi printed in ``sample`` (None: no GPU at all),
    and no CUDA context exists yet in this process (so a new one is subtracted)."""
    real = gpu_local.list_local_gpus
    text = None if sample is None else (SMI / sample).read_text()

    def smi(args: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 0, stdout=text or "", stderr="")

    def listed(*_: Any, **__: Any) -> list[gpu_local.LocalGpu]:
        return real({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, runner=smi, nvml=lambda: None, torch_cuda=lambda: None,
                    which=lambda name, path=None: None if text is None else f"/usr/bin/{name}")

    monkeypatch.setattr(gpu_local, "list_local_gpus", listed)
    monkeypatch.setattr(budgets, "_cuda_initialised", lambda: False)


def cuda_device(monkeypatch: pytest.MonkeyPatch, index: int = 0) -> list[dict[str, Any]]:
    """``torch.cuda`` says a GPU is there (torch's current device: ``index``) and the real step's
    measurement is replaced; returns the calls it gets."""
    calls: list[dict[str, Any]] = []

    def measure_cuda(step: Step, *, device: torch.device | None = None, snapshot: str | None = None,
                     force: bool = False) -> Measurement:
        calls.append({"model": step.model, "options": step, "device": device, "snapshot": snapshot, "force": force})
        return Measurement(device=f"cuda: {H100_NAME}", peak_allocated=50 * MiB, peak_reserved=64 * MiB,
                           note="stand-in for a real run")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: index)
    monkeypatch.setattr(measure_module, "measure_cuda", measure_cuda)
    return calls


def run(*args: str) -> Any:
    return CliRunner().invoke(memcalc.cli.main, list(args))


# ------------------------------------------------------------------ the API: gpu="cuda:N" / "auto"


def test_a_local_gpu_is_estimated_with_its_catalogue_profile_and_its_free_memory(monkeypatch):
    machine(monkeypatch, "eight_h100.csv")
    local = memcalc.estimate("mlp", batch_size=4, gpu="cuda:3")
    h100 = get_gpu("h100-80gb")
    assert local.gpu.key == "h100-80gb" and local.gpu_named
    assert local.capacity == 40623 * MiB - h100.cuda_context  # cuda:3's free memory less a new context
    # the H100's kernels and workspaces (Hopper's cuBLAS workspace is 32 MiB, not the generic 8,519,680 B)
    catalogued = memcalc.estimate("mlp", batch_size=4, gpu="h100-80gb")
    assert local.bytes == catalogued.bytes
    assert local.bytes.peak_allocated != memcalc.estimate("mlp", batch_size=4).bytes.peak_allocated
    note = local.notes[0]
    assert "this machine's GPU" in note and "catalogue profile h100-80gb" in note
    assert f"cuda:3 ({H100_NAME})" in note and "free" in note


def test_auto_is_the_local_gpu_with_the_most_free_memory(monkeypatch):
    machine(monkeypatch, "two_gpus.csv")  # 2 × RTX 4090, cuda:1 the freer
    report = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", gpu="auto")
    assert report.gpu.key == "rtx-4090"
    assert report.capacity == 24080 * MiB - get_gpu("rtx-4090").cuda_context
    assert "cuda:1" in report.notes[0]


def test_a_card_the_catalogue_lacks_gets_the_generic_profile_and_its_own_memory(monkeypatch):
    machine(monkeypatch, "mixed.csv")  # cuda:2 is an A40
    report = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", gpu="cuda:2")
    assert report.gpu == GENERIC and not report.gpu_named
    assert report.capacity == 45488 * MiB - GENERIC.cuda_context
    assert "generic sm80-class profile, the catalogue lacking this card" in report.notes[0]
    assert "NVIDIA A40" in report.notes[0]


def test_a_capacity_given_beside_a_local_gpu_is_the_capacity(monkeypatch):
    machine(monkeypatch, "one_gpu.csv")
    report = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", gpu="cuda", capacity="1GiB")
    assert report.capacity == GiB and report.gpu.key == "a100-40gb"
    assert "capacity as given" in report.notes[0]


def test_a_local_gpu_on_a_machine_without_one_is_refused(monkeypatch):
    machine(monkeypatch, None)
    with pytest.raises(InvalidInputError, match="no GPU is visible"):
        memcalc.estimate("fc-32-16", batch_size=100, mode="eval", gpu="auto")


def test_a_malformed_device_is_refused_before_gpus_are_looked_for(monkeypatch):
    monkeypatch.setattr(gpu_local, "list_local_gpus", lambda *a, **k: pytest.fail("looked for GPUs"))
    with pytest.raises(InvalidInputError, match="not a device spec"):
        memcalc.estimate("fc-32-16", batch_size=100, mode="eval", gpu="cuda:x")


@pytest.mark.parametrize(("gpu", "local"), [("auto", True), ("cuda", True), ("CUDA:1", True), (" cuda:x", True),
                                            ("4090", False), ("h100-80gb", False), ("cpu", False), (None, False)])
def test_which_gpu_values_name_a_gpu_of_this_machine(gpu, local):
    # a bare "N" is not one: "3090" and "4090" are catalogue names
    assert gpu_local.names_local_gpu(gpu) is local


def test_a_budget_reads_gpu_auto_as_device_auto(monkeypatch):
    machine(monkeypatch, "eight_h100.csv")
    assert resolve_budget(gpu="auto") == resolve_budget(device="auto")
    with pytest.raises(InvalidInputError, match="exactly one"):
        resolve_budget(gpu="cuda:0", device="cuda:1")


# ------------------------------------------------------------------ memcalc MODEL --device


def test_cli_device_estimates_for_that_gpu_and_says_so(monkeypatch):
    machine(monkeypatch, "eight_h100.csv")
    result = run("mlp", "--batch", "4", "--device", "cuda:3", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gpu"] == "h100-80gb" and data["fits"] is True
    assert data["local_gpu"] == {"device": "cuda:3", "name": H100_NAME, "catalogue": "h100-80gb"}
    text = run("mlp", "--batch", "4", "--device", "cuda:3", "--depth", "0")
    assert text.exit_code == 0, text.output
    assert f"on {H100_NAME}" in text.stdout
    assert "note: estimated for this machine's GPU: kernel choices, workspaces and CUDA context of the catalogue " \
           "profile h100-80gb; capacity cuda:3" in text.stdout


def test_cli_device_and_gpu_together_are_refused(monkeypatch):
    machine(monkeypatch, "eight_h100.csv")
    result = run("mlp", "--device", "auto", "--gpu", "a100-40gb")
    assert result.exit_code == 2
    assert "only one of --gpu (a GPU model) or --device (a GPU of this machine)" in result.output


def test_cli_device_without_a_gpu_says_none_is_visible(monkeypatch):
    machine(monkeypatch, None)
    result = run("mlp", "--device", "auto")
    assert result.exit_code == 2
    assert "no GPU is visible to this process" in result.stderr and "nvidia-smi" in result.stderr


def test_cli_device_that_does_not_exist(monkeypatch):
    machine(monkeypatch, "one_gpu.csv")
    result = run("mlp", "--device", "cuda:1")
    assert result.exit_code == 2 and "1 GPU is visible (cuda:0)" in result.stderr


# ------------------------------------------------------------------ --measure on a CUDA machine


@_FAKE_CUDA_NEEDS_CPU_BUILD
def test_measure_on_a_cuda_machine_estimates_for_the_gpu_it_measures_on(monkeypatch):
    machine(monkeypatch, "eight_h100.csv")
    calls = cuda_device(monkeypatch, index=3)
    result = run("mlp", "--batch", "4", "--measure", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gpu"] == "h100-80gb"  # not the generic profile
    assert data["local_gpu"]["device"] == "cuda:3"
    assert data["measured"]["device"] == f"cuda: {H100_NAME}"
    assert data["measured"]["compared_with"] == data["bytes"]["peak_allocated"]
    [call] = calls
    assert call["device"] == torch.device("cuda", 3) and call["model"] == "mlp"
    assert call["options"].gpu.key == "h100-80gb"
    text = run("mlp", "--batch", "4", "--measure", "--depth", "0")
    assert "catalogue profile h100-80gb; capacity cuda:3" in text.stdout
    assert f"measured on cuda: {H100_NAME}" in text.stdout


@_FAKE_CUDA_NEEDS_CPU_BUILD
def test_measure_on_a_cuda_machine_keeps_the_gpu_given(monkeypatch):
    machine(monkeypatch, "eight_h100.csv")
    calls = cuda_device(monkeypatch, index=3)
    result = run("mlp", "--batch", "4", "--measure", "--gpu", "a100-80gb", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gpu"] == "a100-80gb" and "local_gpu" not in data
    assert calls[0]["device"] is None  # torch's current device, as measure() always did


@_FAKE_CUDA_NEEDS_CPU_BUILD
def test_measure_snapshot_on_a_cuda_machine_measures_and_names_the_file(monkeypatch, tmp_path):
    # --measure-snapshot implies --measure, and hands the path to the real step's measurement
    machine(monkeypatch, "eight_h100.csv")
    calls = cuda_device(monkeypatch, index=3)
    path = str(tmp_path / "run.pickle")
    result = run("mlp", "--batch", "4", "--gpu", "a100-80gb", "--measure-snapshot", path, "--format", "json")
    assert result.exit_code == 0, result.output
    assert len(calls) == 1 and calls[0]["snapshot"] == path and calls[0]["force"] is False
    assert "measured" in json.loads(result.stdout)


# ------------------------------------------------------------------ benchmarks/accuracy.py on a GPU

#: The keys of ../shared/gpu/2026-11-25-h100/suite-gpu.jsonl (a real H100 run), which a new
#: run's .jsonl must have so that the two compare line by line.
SHARED_ENVIRONMENT = ["device", "torch", "cuda", "cudnn", "n"]
SHARED_RECORD = {"config", "estimate_s", "estimate", "measured", "error_allocated", "error_reserved", "wall_s"}
SHARED_ESTIMATE = {"peak_allocated", "peak_reserved", "where", "attention"}
SHARED_MEASURED = {"peak_allocated", "peak_reserved", "oom", "note"}


@pytest.fixture
def accuracy(monkeypatch) -> ModuleType:
    """benchmarks/accuracy.py on a faked H100: torch.cuda and its versions answer as on the real
    run, the measurement is replaced (it fails for the fc-32-16 config)."""
    spec = importlib.util.spec_from_file_location("accuracy_benchmark", ROOT / "benchmarks" / "accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    calls = cuda_device(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: H100_NAME)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(module, "driver_version", lambda: "580.159.04")

    def measure_cuda(step: Step, **kwargs: Any) -> Measurement:
        if step.model == "fc-32-16":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
        return measure_module.measure_cuda(step, **kwargs)  # the stand-in above

    monkeypatch.setattr(module, "measure_cuda", measure_cuda)
    module.calls = calls
    return module


@_FAKE_CUDA_NEEDS_CPU_BUILD
def test_accuracy_suite_runs_on_a_gpu_and_writes_the_shared_format(accuracy, tmp_path, capsys):
    accuracy.main(["--suite", "quick", "--out", str(tmp_path)])
    [jsonl] = tmp_path.glob("accuracy-nvidia-h100-80gb-hbm3-quick-*.jsonl")
    env, *records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert list(env)[:5] == SHARED_ENVIRONMENT
    assert (env["device"], env["cuda"], env["cudnn"], env["n"]) == (H100_NAME, "13.0", 91900, 3)
    assert (env["driver"], env["profile"]) == ("580.159.04", "h100-80gb") and env["date"] and env["torch"]
    assert [r["config"] for r in records] == ["mlp b64 sgd train", "mlp b64 adam train", "fc-32-16 b100 none eval"]
    for record in records[:2]:
        assert set(record) == SHARED_RECORD
        assert set(record["estimate"]) == SHARED_ESTIMATE and set(record["measured"]) == SHARED_MEASURED
        assert record["measured"]["peak_allocated"] == 50 * MiB
        expected = (record["estimate"]["peak_allocated"] - 50 * MiB) / (50 * MiB)
        assert record["error_allocated"] == pytest.approx(expected)
        expected = (record["estimate"]["peak_reserved"] - 64 * MiB) / (64 * MiB)
        assert record["error_reserved"] == pytest.approx(expected)
    # the failed config is a record with its error, and the suite went on to write everything
    failed = records[2]
    assert set(failed) == SHARED_RECORD | {"error"}
    assert failed["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert failed["measured"] is None and failed["estimate"]["where"]
    # the estimates used the H100's profile; the measurement was given no GPU
    results = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert {r["estimate"]["gpu"] for r in results["configs"]} == {"h100-80gb"}
    assert (results["cuda"], results["cudnn"], results["driver"]) == ("13.0", 91900, "580.159.04")
    assert [c["options"].gpu for c in accuracy.calls] == [GENERIC, GENERIC]
    markdown = next(tmp_path.glob("*.md")).read_text()
    assert "CUDA 13.0, cuDNN 91900, driver 580.159.04" in markdown and "h100-80gb" in markdown
    assert "| fc-32-16 b100 none eval | failed: RuntimeError" in markdown
    progress = capsys.readouterr().err
    assert "[1/3] mlp b64 sgd train ..." in progress and "[3/3] fc-32-16 b100 none eval: FAILED" in progress


def test_accuracy_configs_filter_and_gpu_option(accuracy, tmp_path):
    accuracy.main(["--suite", "quick", "--configs", "ADAM", "--gpu", "a100-80gb", "--out", str(tmp_path)])
    env, *records = [json.loads(line) for line in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    assert env["n"] == 1 and env["profile"] == "a100-80gb"
    assert [r["config"] for r in records] == ["mlp b64 adam train"]
    with pytest.raises(SystemExit, match="no config of suite 'quick' contains 'lstm'"):
        accuracy.main(["--suite", "quick", "--configs", "lstm", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--gpu h1000"):
        accuracy.main(["--suite", "quick", "--gpu", "h1000", "--out", str(tmp_path)])

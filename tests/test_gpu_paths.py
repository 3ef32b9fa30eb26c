"""The paths that run on a CUDA machine, checked on this CPU-only one (issue 22, item 4):
``estimate(gpu="cuda:N" | "auto")`` and ``memcalc MODEL --device``, and ``--measure`` estimating
for the GPU it measures on.

The machine's GPUs are the recorded nvidia-smi outputs of tests/data/nvidia_smi/ (as in
test_gpus.py); where a test needs CUDA itself, ``torch.cuda``'s answers and the real measurement
(``measure_cuda``) are replaced, and the replacement checks the options it is given the way the
real one does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import memcalc
import memcalc.cli
from memcalc.core.errors import InvalidInputError
from memcalc.core.gpu import GENERIC
from memcalc.core.report import Measurement
from memcalc.cuda.gpus import local as gpu_local
from memcalc.cuda.gpus.catalogue import get_gpu
from memcalc.engine.options import EstimateOptions
from memcalc.report import measure as measure_module
from memcalc.search import budget as budgets
from memcalc.search.budget import resolve_budget

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

    def measure_cuda(resolved: Any, options: EstimateOptions | None = None, *, device: torch.device | None = None,
                     **option_values: Any) -> Measurement:
        options = options or EstimateOptions.create(**option_values)  # as the real one: refuses a gpu name
        calls.append({"model": resolved.name, "options": options, "device": device})
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


def test_measure_on_a_cuda_machine_keeps_the_gpu_given(monkeypatch):
    machine(monkeypatch, "eight_h100.csv")
    calls = cuda_device(monkeypatch, index=3)
    result = run("mlp", "--batch", "4", "--measure", "--gpu", "a100-80gb", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gpu"] == "a100-80gb" and "local_gpu" not in data
    assert calls[0]["device"] is None  # torch's current device, as measure() always did

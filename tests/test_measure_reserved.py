"""``measure_cuda`` measures the step as a fresh process runs it, in its steady state:

- its reserved memory, not the build's: the segments the model's build left cached are freed
  (``empty_cache``) after the build and before the peak statistics are reset, and the note says
  which reserved figure is shown;
- the cuBLAS workspaces earlier steps left are freed first (the H100 suite's inference configs
  counted a training step's backward-thread workspace: -7.8%), and again after any warm-up;
- under amp-fp16 the GradScaler backs off until no optimizer step is skipped (the H100 suite's
  ResNet-50 amp-fp16 run skipped both, and held no SGD momentum: +3.1%);
- with a snapshot asked for (``--measure-snapshot``), the allocator's history covers the step
  alone, and is written even when the step runs out of memory.

The CUDA calls are faked (no GPU here); the order of the real ones is what is checked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from memcalc.cli import main
from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError
from memcalc.engine.optimizers import spec_for
from memcalc.engine.step import StepConfig
from memcalc.engine.step_spec import Step
from memcalc.fields import build_step
from memcalc.measure import step as measure


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, calls: list[str], **cuda: Any) -> None:
    """torch.cuda's calls measure_cuda makes, faked (``cuda``: replacements by name), with the
    model's build and the cuBLAS clean-up stubbed; the calls that matter are logged in ``calls``."""
    fake = {
        "get_device_name": lambda device=None: "NVIDIA H100 80GB HBM3",
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_reserved": lambda device=None: 0,
        "memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: calls.append("reset_peak"),
        "max_memory_allocated": lambda device=None: 5 << 30,
        "max_memory_reserved": lambda device=None: 6 << 30,
    } | cuda
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(measure, "_clear_cublas_workspaces", lambda: calls.append("clear_cublas"))
    monkeypatch.setattr(measure, "_resolve", lambda step: None)
    monkeypatch.setattr(measure, "_prepare", lambda *args: (torch.nn.Linear(2, 2), (), []))


def test_the_build_cache_is_freed_before_the_peak_is_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    reserved = {"now": 0}

    def prepare(*args: Any, **kwargs: Any) -> tuple[Any, Any, list[Any]]:
        calls.append("build")
        reserved["now"] = 3 << 30  # the build left 3 GiB of segments, 1 GiB of it in use
        return torch.nn.Linear(1, 1), (), []

    def empty_cache() -> None:
        calls.append("empty_cache")
        reserved["now"] = 1 << 30

    _fake_cuda(monkeypatch, calls, empty_cache=empty_cache, memory_reserved=lambda device=None: reserved["now"])
    monkeypatch.setattr(measure, "_prepare", prepare)
    monkeypatch.setattr(measure, "_config", lambda *args: StepConfig(Mode.TRAIN, spec_for("sgd")))
    monkeypatch.setattr(measure, "_run", lambda *args: calls.append("step"))

    result = measure.measure_cuda(Step(), device=torch.device("cuda", 0))

    # the first empty_cache is measure_cuda's clean start; the last, its clean-up
    assert calls == ["clear_cublas", "empty_cache", "build", "clear_cublas", "empty_cache", "reset_peak", "step",
                     "empty_cache"]
    assert result.peak_reserved == 6 << 30
    assert measure.RESERVED_SHOWN in result.note
    assert "(2,147,483,648 B cached by the build freed first)" in result.note  # 3 GiB − 1 GiB


class _FakeScaler:
    """GradScaler's scale: halved by each run whose gradients overflow (the first ``overflows``)."""

    def __init__(self, device: str) -> None:
        self.scale = 2.0**16

    def get_scale(self) -> float:
        return self.scale


@pytest.mark.parametrize("overflows", [0, 3])
def test_an_amp_fp16_step_is_measured_once_its_scaler_skips_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                     overflows: int) -> None:
    calls: list[str] = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(torch.amp, "GradScaler", _FakeScaler)
    grads: list[bool] = []

    def run(module: torch.nn.Module, inputs: Any, config: StepConfig, *args: Any) -> None:
        scaler = config.scaler_factory()  # the one scaler every run shares
        grads.append(all(p.grad is None for p in module.parameters()))  # each run starts without gradients
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        if calls.count("run") < overflows:
            scaler.scale /= 2  # an overflow: the step skipped, the scale backed off
        calls.append("run")

    monkeypatch.setattr(measure, "_run", run)
    step = build_step("mlp", batch_size=2, precision="amp-fp16")
    config = StepConfig(Mode.TRAIN, spec_for("sgd"), scaler_factory=lambda: _FakeScaler("cuda"))
    monkeypatch.setattr(measure, "_config", lambda *args: config)

    result = measure.measure_cuda(step, device=torch.device("cuda", 0))

    warmups = overflows + 1  # the runs that backed off, then one that skipped nothing
    assert calls == ["clear_cublas", *["run"] * warmups, "clear_cublas", "reset_peak", "run"]
    assert all(grads)
    assert f"GradScaler warmed up over {warmups} run" in result.note


def test_a_step_without_a_scaler_is_not_warmed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(measure, "_config", lambda *args: StepConfig(Mode.TRAIN, spec_for("sgd")))
    monkeypatch.setattr(measure, "_run", lambda *args: calls.append("run"))

    result = measure.measure_cuda(build_step("mlp", batch_size=2, precision="amp-bf16"),
                                  device=torch.device("cuda", 0))

    assert calls == ["clear_cublas", "clear_cublas", "reset_peak", "run"]
    assert "GradScaler" not in result.note and "cuBLAS workspaces of earlier steps freed first" in result.note


def _fake_history(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """torch.cuda.memory's history recording and dump, faked: each call logged in ``calls``."""
    def record(enabled: str | None = "all", max_entries: int = 0, **kwargs: Any) -> None:
        calls.append("record" if enabled else "stop")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)

    def dump(path: str) -> None:  # writes where it is told, as torch's does: memcalc's temporary beside the file
        Path(path).write_bytes(b"the recorded history")
        calls.append("dump")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)


def test_a_real_snapshot_records_the_step_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # --measure-snapshot: the history starts after the build's cache is freed and where the peaks
    # are reset, and is written once the step is done: the stream memcalc compare sets beside the
    # estimate, without the build
    calls: list[str] = []
    _fake_cuda(monkeypatch, calls, empty_cache=lambda: calls.append("empty_cache"))
    _fake_history(monkeypatch, calls)
    monkeypatch.setattr(measure, "_config", lambda *args: StepConfig(Mode.TRAIN, spec_for("sgd")))
    monkeypatch.setattr(measure, "_run", lambda *args: calls.append("step"))

    monkeypatch.chdir(tmp_path)
    result = measure.measure_cuda(Step(), device=torch.device("cuda", 0), snapshot="run.pickle")

    assert calls == ["clear_cublas", "empty_cache", "clear_cublas", "empty_cache", "record", "reset_peak", "step",
                     "dump", "stop", "empty_cache"]
    assert os.listdir(tmp_path) == ["run.pickle"]  # written whole, under its name: no temporary left
    assert (tmp_path / "run.pickle").read_bytes() == b"the recorded history"
    assert "the step's allocator history written to run.pickle" in result.note
    assert "memcalc compare run.pickle MODEL" in result.note


def test_a_real_snapshot_of_an_oom_is_written_up_to_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[str] = []
    _fake_cuda(monkeypatch, calls)
    _fake_history(monkeypatch, calls)
    monkeypatch.setattr(measure, "_config", lambda *args: StepConfig(Mode.TRAIN, spec_for("sgd")))

    def run(*args: Any) -> None:
        calls.append("step")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(measure, "_run", run)

    monkeypatch.chdir(tmp_path)
    result = measure.measure_cuda(Step(), device=torch.device("cuda", 0), snapshot="oom.pickle")

    assert result.oom and result.peak_allocated is None
    assert (tmp_path / "oom.pickle").read_bytes() == b"the recorded history"
    assert calls[-4:] == ["reset_peak", "step", "dump", "stop"]  # recording stopped whatever happens
    assert result.note == ("CUDA out of memory. Tried to allocate 2.00 GiB; the step's allocator history up to the "
                           "OOM written to oom.pickle")


def test_a_real_snapshot_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InapplicableOptionError, match="a real memory snapshot is the CUDA caching allocator's"):
        measure.measure(build_step("mlp", batch_size=2), snapshot="run.pickle")
    # the CLI refuses it before estimating, and a file name it could not write before that
    runner = CliRunner()
    refused = runner.invoke(main, ["mlp", "--measure-snapshot", "run.pickle"])
    assert refused.exit_code == 2 and "this machine has no CUDA GPU" in refused.output
    named = runner.invoke(main, ["mlp", "--measure-snapshot", "run.txt"])
    assert named.exit_code == 2 and "'.txt' is not a snapshot format" in named.output


def test_the_cpu_target_is_measured_on_the_cpu_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # --gpu cpu estimates what the CPU allocator counts: its --measure runs the CPU step even
    # where CUDA is available (it measured CUDA on the H200 machine, 2026-11-28), and a CUDA
    # target still measures CUDA there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ran: list[str] = []
    monkeypatch.setattr(measure, "measure_cuda", lambda step, **_: ran.append("cuda"))
    monkeypatch.setattr(measure, "measure_cpu", lambda step: ran.append("cpu"))
    measure.measure(build_step("mlp", batch_size=2, gpu="cpu"))
    measure.measure(build_step("mlp", batch_size=2, gpu="h100-80gb"))
    assert ran == ["cpu", "cuda"]

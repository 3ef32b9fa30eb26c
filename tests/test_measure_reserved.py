"""``measure_cuda`` reports the step's reserved memory, not the build's: the segments the model's
build left cached are freed (``empty_cache``) after the build and before the peak statistics are
reset, and the note says which reserved figure is shown. The CUDA calls are faked (no GPU here);
the order of the real ones is what is checked."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memcalc.engine.options import Step
from memcalc.measure import step as measure


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

    fake = {
        "get_device_name": lambda device=None: "NVIDIA H100 80GB HBM3",
        "synchronize": lambda device=None: None,
        "empty_cache": empty_cache,
        "memory_reserved": lambda device=None: reserved["now"],
        "memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: calls.append("reset_peak"),
        "max_memory_allocated": lambda device=None: 5 << 30,
        "max_memory_reserved": lambda device=None: 6 << 30,
    }
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(measure, "_warm_cublas", lambda device: calls.append("warm"))
    monkeypatch.setattr(measure, "_resolve", lambda step: None)
    monkeypatch.setattr(measure, "_prepare", prepare)
    monkeypatch.setattr(measure, "_config", lambda *args: None)
    monkeypatch.setattr(measure, "_run", lambda *args: calls.append("step"))

    result = measure.measure_cuda(Step(), device=torch.device("cuda", 0))

    # the first empty_cache is measure_cuda's clean start; the last, its clean-up
    assert calls == ["empty_cache", "warm", "build", "empty_cache", "reset_peak", "step", "empty_cache"]
    assert result.peak_reserved == 6 << 30
    assert measure.RESERVED_SHOWN in result.note
    assert "(2,147,483,648 B cached by the build freed first)" in result.note  # 3 GiB − 1 GiB

"""Depth extrapolation (:mod:`memcalc.distributed.depth_step`): a deep model's step under FSDP2, tensor
parallelism and context parallelism's ring composed from the same step traced at 2, 3 and 4 blocks
gives the report of the step traced whole, byte for byte: the JSON, the module rows, the timeline
(every event, its storage's module, op, phase and category, the allocator's curve). Where the
composition declines (``every:2`` checkpointing, tensor parallelism alone) the estimate traces the
whole model and is checked the same way. Under ``time`` the kernels' cost records are composed too,
and must equal the whole trace's, record by record (each op's phase, module, FLOPs, bytes and
event)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

import memcalc
import memcalc.distributed.strategies as strategies
from memcalc.core.report import MemoryReport
from memcalc.distributed.setting import Distributed

_TRACED_BY_DEPTH = strategies.traced_by_depth


def _comparable(value: Any) -> Any:
    """``value`` with its arrays as lists and its dataclasses as dicts, for ``==``."""
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tolist())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _comparable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    return value


def _estimate(monkeypatch: pytest.MonkeyPatch, by_depth: bool, model: str, mesh: dict[str, int],
              **options: Any) -> tuple[MemoryReport, int]:
    """The estimate, and how many steps were composed (0: traced whole); ``by_depth`` False turns
    the composition off (every role traced whole, as before it existed)."""
    composed = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = _TRACED_BY_DEPTH(*args, **kwargs) if by_depth else None
        composed.append(out is not None)
        return out

    monkeypatch.setattr(strategies, "traced_by_depth", spy)
    report = memcalc.estimate(model, distributed=Distributed(mesh=mesh), **options)
    return report, sum(composed)


CASES = {
    "fsdp-llama": ("torch:llama-tiny", {"dp_shard": 4}, {}),
    "fsdp-tp-llama-amp": ("torch:llama-tiny", {"dp_shard": 2, "tp": 2}, {"precision": "amp-bf16", "checkpoint": True}),
    "fsdp-tp-llama-selective": ("torch:llama-tiny", {"dp_shard": 2, "tp": 2}, {"checkpoint": "selective-op"}),
    "fsdp-hf-llama-amp": ("llama-tiny", {"dp_shard": 4}, {"precision": "amp-bf16", "checkpoint": True}),
    "fsdp-gpt2": ("gpt2", {"dp_shard": 2}, {"seq_len": 128, "precision": "amp-bf16"}),
    "fsdp-llama-time": ("torch:llama-tiny", {"dp_shard": 2}, {"time": True, "gpu": "h100-80gb"}),
    "fsdp-tp-hf-llama-time": ("llama-tiny", {"dp_shard": 2, "tp": 2},
                              {"time": True, "gpu": "h100-80gb", "precision": "amp-bf16", "checkpoint": True}),
    "hsdp-tp-hf-llama-time": ("llama-tiny", {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
                              {"time": True, "gpu": "h100-80gb", "precision": "amp-bf16", "checkpoint": True}),
    "hsdp-llama-accumulation": ("torch:llama-tiny", {"dp_replicate": 2, "dp_shard": 2},
                                {"time": True, "gpu": "h100-80gb", "accum_steps": 2}),
    "fsdp-tp-hf-llama-selective-time": ("llama-tiny", {"dp_shard": 2, "tp": 2},
                                        {"time": True, "gpu": "h100-80gb", "precision": "amp-bf16",
                                         "checkpoint": "selective-op"}),
    # context parallelism: FSDP2 over dp_shard x cp (or the cp ranks alone), the ring around each
    # block's attention (2026-12-07: a 70B cp plan traced 80 layers per candidate)
    "cp-llama": ("torch:llama-tiny", {"cp": 2}, {}),
    "fsdp-cp-llama-checkpoint": ("torch:llama-tiny", {"dp_shard": 2, "cp": 2}, {"checkpoint": True}),
    "cp-tp-hf-llama-time": ("llama-tiny", {"cp": 2, "tp": 2},
                            {"time": True, "gpu": "h100-80gb", "precision": "amp-bf16", "checkpoint": True}),
    "fsdp-cp-tp-hf-llama-selective-time": ("llama-tiny", {"dp_shard": 2, "cp": 2, "tp": 2},
                                           {"time": True, "gpu": "h100-80gb", "precision": "amp-bf16",
                                            "checkpoint": "selective-op"}),
}
DECLINED = {
    # tensor parallelism alone: the optimizer all-reduces the replicated (norm) parameters' Partial
    # gradients in nested groups whose frees the composition does not place (its check declines)
    "tp-llama-checkpoint": ("torch:llama-tiny", {"tp": 2}, {"checkpoint": True}),
    "fsdp-llama-every-2": ("torch:llama-tiny", {"dp_shard": 2}, {"checkpoint": "every:2"}),
}


@pytest.mark.parametrize("case", [*CASES, *DECLINED])
# issue 36 item 7: the quick suite keeps one composed case, the one that composes the most (FSDP2 x
# tp, a Hugging Face model, amp, checkpointing, the cost records under --time: 1.7 CPU-s), the cheapest
# ring (FSDP2 over dp_shard x cp, checkpointing: 1.6 s at load 11), and one declined; the others run in
# the full suite
@pytest.mark.quick_cases("fsdp-tp-hf-llama-time", "fsdp-cp-llama-checkpoint", "fsdp-llama-every-2")
def test_a_composed_step_reports_what_the_whole_trace_reports(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    model, mesh, options = {**CASES, **DECLINED}[case]
    options = {"batch_size": 2, "seq_len": 64, **options}
    whole, none = _estimate(monkeypatch, False, model, mesh, **options)
    composed, used = _estimate(monkeypatch, True, model, mesh, **options)
    assert none == 0
    assert used == (1 if case in CASES else 0)  # every case composes but those declined
    assert json.dumps(composed.to_dict(), sort_keys=True) == json.dumps(whole.to_dict(), sort_keys=True)
    assert _comparable(composed.modules) == _comparable(whole.modules)
    assert _comparable(composed.timeline()) == _comparable(whole.timeline())
    if "time" in options:  # the traced step's own records (without, costs are traced when asked)
        costs, whole_costs = composed.on_request.costs, whole.on_request.costs
        assert costs.records and costs.records == whole_costs.records  # type: ignore[union-attr]
        assert costs.module_order == whole_costs.module_order  # type: ignore[union-attr]

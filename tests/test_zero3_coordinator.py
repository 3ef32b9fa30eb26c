"""memcalc's ZeRO-3 against real DeepSpeed: which parameters are gathered when.

tests/data/deepspeed_zero3_gathers.json was recorded from real DeepSpeed ZeRO-3 on the CPU (two
ranks over gloo, tests/deepspeed_reference/zero3_gathers.py): which parameters are gathered (a
bitmask over ``named_parameters``) after each module's forward pre-hook and post-hook, after
backward and after each optimizer step, for three steps, under six ``stage3_*`` settings on a
small MLP (persistence threshold, prefetch bucket, live and reuse bounds) and DeepSpeed's defaults
scaled to a Llama-3-8B-shaped model at 1/4096. memcalc traces two steps of the same models under
the same settings; the gathered parameters at every one of those points must be DeepSpeed's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import memcalc
from memcalc.distributed.vocabulary import ZeroStage3
from memcalc.distributed.zero import ZeroProgram
from memcalc.distributed.zero3_coordinator import persistent_flags

sys.path.insert(0, str(Path(__file__).parent / "deepspeed_reference"))
from zero3_gathers import LLAMA_CASES, LlamaShaped, mask_of  # the reference's own models

DATA = Path(__file__).parent / "data" / "deepspeed_zero3_gathers.json"
RECORDED = json.loads(DATA.read_text())
FOREACH = memcalc.Loop(optimizer_impl="foreach")
KEYS = {"stage3_param_persistence_threshold": "param_persistence_threshold",
        "stage3_prefetch_bucket_size": "prefetch_bucket_size", "stage3_max_live_parameters": "max_live_parameters",
        "stage3_max_reuse_distance": "max_reuse_distance"}


def model() -> nn.Module:
    """tests/deepspeed_reference/zero3_gathers.py's model."""
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64),
                         nn.LayerNorm(64), nn.Linear(64, 8))


def _events(monkeypatch: pytest.MonkeyPatch, stage3: ZeroStage3, llama: bool = False) -> list[list[Any]]:
    """memcalc's trace of two steps, with the gathered parameters read at DeepSpeed's points."""
    events: list[list[Any]] = []
    install = ZeroProgram.install

    def probe(self: ZeroProgram, tracer: Any, module: nn.Module) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        mask = mask_of(list(names.values()))
        install(self, tracer, module)
        assert self.sharded is not None and self.sharded.coordinator is not None
        coordinator = self.sharded.coordinator

        def gathered() -> str:
            return mask(names[id(p.original)] for p in coordinator.params if coordinator.available(p))

        for index, child in module.named_modules():
            if next(child.parameters(recurse=False), None) is None:
                continue
            self._handles.append(child.register_forward_pre_hook(
                lambda m, a, i=index: events.append([f"pre {i}", gathered()])))
            self._handles.append(child.register_forward_hook(
                lambda m, a, o, i=index: events.append([f"post {i}", gathered()])))
        steps = iter(range(10))
        around = self._around()
        assert around is not None

        def before() -> None:
            step = next(steps)
            events.append([f"backward {step}", gathered()])
            around[0]()

        def after() -> None:
            around[1]()
            events.append([f"step {len([e for e in events if e[0].startswith('backward')]) - 1}", gathered()])

        self._around = lambda: (before, after)  # type: ignore[method-assign]

    monkeypatch.setattr(ZeroProgram, "install", probe)
    memcalc.estimate(LlamaShaped if llama else model, input_shape=(2052 if llama else 64,), batch_size=4,
                     loss="mean", gpu="cpu", loop=FOREACH, optimizer="adam",
                     distributed=memcalc.Distributed("zero3", world_size=2, stage3=stage3))
    return events


@pytest.mark.parametrize("case", sorted(RECORDED["cases"]))
def test_gathered_parameters_are_deepspeeds(monkeypatch, case):
    recorded = RECORDED["cases"][case]
    settings = ZeroStage3(**{KEYS[k]: v for k, v in recorded["settings"].items()})
    real = recorded["events"]
    per_step = len(real) // 3
    # DeepSpeed's third step is its second: the two steps memcalc traces are the steady state
    assert real[2 * per_step:] == [[e.replace(" 1", " 2"), g] for e, g in real[per_step:2 * per_step]]
    assert _events(monkeypatch, settings, case in LLAMA_CASES) == real[:2 * per_step]


def test_the_recorded_cases_differ():
    # the settings change what is gathered: a test of the rules, not of one behaviour
    runs = {json.dumps(case["events"]) for case in RECORDED["cases"].values()}
    assert len(runs) == len(RECORDED["cases"]) and RECORDED["world_size"] == 2


def test_persistence_follows_named_parameters_order():
    # mark_persistent_parameters: at most the threshold each, and the model's total
    stage3 = ZeroStage3(param_persistence_threshold=100, model_persistence_threshold=150)
    assert persistent_flags([100, 101, 40, 20, 10], stage3) == [True, False, True, False, True]
    assert persistent_flags([0, 100_000, 100_001], ZeroStage3()) == [True, True, False]

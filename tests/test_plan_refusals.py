"""pp × tp without dp_shard refused before any trace (:mod:`memcalc.search.plan_refusals`):
the answer checked against the real trace's refusal, with and without a foreach optimizer, and
plan's rows unchanged by it, the refused mesh never traced."""

from __future__ import annotations

import json

import pytest
import torch as _torch

import memcalc
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.loop import Loop
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.setting import Distributed
from memcalc.fields import build_step
from memcalc.search import plan as planning

pytestmark = pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                reason="pipeline parallelism needs torch >= 2.13's pipelining")


def test_refused_exactly_when_the_trace_refuses():
    step = build_step("llama-tiny", batch_size=2, seq_len=64)
    mesh = Mesh(pp=2, tp=2)
    why = planning.refusal(step, mesh)
    assert why is not None and "plain tensors beside DTensors" in why and "foreach" in why
    with pytest.raises(InapplicableOptionError, match="plain tensors beside DTensors"):
        memcalc.estimate("llama-tiny", batch_size=2, seq_len=64, distributed=Distributed(mesh=mesh))
    # one parameter at a time the mix is no problem: not refused, and the real estimate runs
    loop = Loop(optimizer_impl="for-loop")
    assert planning.refusal(build_step("llama-tiny", batch_size=2, seq_len=64, loop=loop), mesh) is None
    report = memcalc.estimate("llama-tiny", batch_size=2, seq_len=64, distributed=Distributed(mesh=mesh), loop=loop)
    assert report.bytes.peak_allocated > 0
    # with dp_shard FSDP2 makes every parameter a DTensor: not refused
    assert planning.refusal(step, Mesh(pp=2, tp=2, dp_shard=2)) is None


@pytest.mark.slow
def test_plan_rows_unchanged_and_the_refused_mesh_not_traced(monkeypatch):
    traced: list[str] = []

    def run(*, with_refusal: bool) -> memcalc.PlanResult:
        if not with_refusal:
            monkeypatch.setattr(planning, "plain_beside_dtensors", lambda *args: None)
        return memcalc.plan("llama-tiny", gpus=4, gpu="h100-80gb", global_batch=8, seq_len=256, top=8,
                            on_estimate=traced.append)

    with_it = run(with_refusal=True)
    assert any("plain tensors beside DTensors" in p and p.startswith("tp=2,pp=2") for p in with_it.pruned)
    assert Mesh(pp=2, tp=2) not in with_it.meshes  # never a configuration, so never traced nor probed for
    assert not any(t.startswith("tp=2,pp=2") for t in traced), traced
    without = run(with_refusal=False)
    assert [json.dumps(c.to_dict(with_it.network), sort_keys=True) for c in with_it.best] == [
        json.dumps(c.to_dict(without.network), sort_keys=True) for c in without.best]
    assert Mesh(pp=2, tp=2) in without.meshes

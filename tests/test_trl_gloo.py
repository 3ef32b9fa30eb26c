"""TRL's DPO shape of step under DDP and FSDP2, run for real on two processes over gloo: the
policy trained, a frozen reference beside it run under ``no_grad`` after the policy's forward, each
wrapped as TRL wraps it under accelerate — DDP around the policy alone, the reference a replica
outside it (``prepare_model(evaluation_mode=True)``); FSDP2 per block and on the policy's root, the
reference by ``fully_shard`` on its root alone (``prepare_fsdp``), both with
``reshard_after_forward=True`` passed explicitly, as accelerate passes it. memcalc's per-rank
estimate, with the reference declared a separate model (what ``memcalc.stacks.trl.step.trl_model``
declares for TRL's reference), is compared with every rank's profiler peak (less Adam's CPU step
counters), as tests/test_gloo_runs.py does for plain DDP and FSDP2. This is the plain-torch
equivalent of the trainer's wrapping, not TRL's trainer itself (tests/test_trl_strategies.py runs
TRL's ``compute_loss`` per rank on meta).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from gloo_runs import BATCH, FEATURES, BlockNet, RankPeak, _measured_step, _step, spawn_ranks, until_complete
from torch import nn

import memcalc
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step

pytestmark = pytest.mark.slow  # one spawn of two processes: about a minute
WORLD = 2
TOLERANCE = 0.001  # as tests/test_gloo_runs.py holds plain DDP and FSDP2


class PolicyAndReference(nn.Module):
    """DPO's step shape: the policy's forward, then the frozen reference's under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: nn.Module = BlockNet()
        self.reference: nn.Module = copy.deepcopy(self.policy).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.policy(x)
        with torch.no_grad():
            ref = self.reference(x)
        return out - ref


def _wrap(model: PolicyAndReference, strategy: str, world_size: int) -> None:
    if strategy == "ddp":
        model.policy = nn.parallel.DistributedDataParallel(model.policy)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.policy.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model.policy, mesh=mesh, reshard_after_forward=True)
    fully_shard(model.reference, mesh=mesh, reshard_after_forward=True)


def _worker(rank: int, world_size: int, port: int, work_dir: str) -> None:
    from memcalc.measure.step import storage_bytes

    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    results = {}
    try:
        for strategy in ("ddp", "fsdp"):
            torch.manual_seed(0)
            model = PolicyAndReference()
            _wrap(model, strategy, world_size)
            x = torch.randn(BATCH, FEATURES)
            trainable = [p for p in model.parameters() if p.requires_grad]
            _step(model, x, trainable)  # the warm-up: FSDP's lazy init, DDP's bucket rebuild
            local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
            before = storage_bytes([*local, *model.buffers(), x])
            if isinstance(model.policy, nn.parallel.DistributedDataParallel):
                buckets = model.policy.reducer._get_zeros_like_grad_buckets()
                before += sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)
            peak = until_complete(lambda m=model, x=x, t=trainable: _measured_step(m, x, t), before,  # type: ignore[misc]
                                  4 * len(trainable), f"{strategy}: ")
            results[strategy] = {"peak": peak.peak, "step_counters": peak.step_counters, "attempts": peak.attempts}
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    work_dir = tmp_path_factory.mktemp("trl-gloo")
    spawn_ranks(_worker, WORLD, (str(work_dir),), 600.0, "TRL reference gloo runs")
    out: dict[str, list[RankPeak]] = {"ddp": [], "fsdp": []}
    for rank in range(WORLD):
        measured = json.loads((work_dir / f"rank{rank}.json").read_text())
        for name in out:
            out[name].append(RankPeak(**measured[name]))
    return out


def _estimate(strategy: str) -> int:
    resolved = Step.resolved

    def with_reference(self: Step, *args: Any, **kwargs: Any) -> ResolvedModel:
        return replace(resolved(self, *args, **kwargs), separate_models=("reference",))

    with mock.patch.object(Step, "resolved", with_reference):
        report = memcalc.estimate(PolicyAndReference, input_shape=(FEATURES,), batch_size=BATCH, optimizer="adam",
                                  loss="mean", gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"),
                                  distributed=memcalc.Distributed(strategy, world_size=WORLD))
    return report.peak_requested


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_policy_and_reference_against_every_rank(peaks: dict[str, list[RankPeak]], strategy: str) -> None:
    estimate = _estimate(strategy)
    for rank, measured in enumerate(peaks[strategy]):
        real = measured.step_peak
        error = (estimate - real) / real
        print(f"{strategy} rank {rank}: real {real:,} B, estimate {estimate:,} B, {error:+.4%} "
              f"({measured.attempts} step(s) for a complete trace)")
        assert abs(error) <= TOLERANCE, f"rank {rank}: estimate {estimate:,} B, real {real:,} B ({error:+.3%})"

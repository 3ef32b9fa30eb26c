"""gloo's staging copies in the functional collectives (:mod:`memcalc.targets.cpu.gloo`): the CPU
target's rule traced on one ``all_gather_into_tensor`` and one ``reduce_scatter_tensor`` over a fake
process group, against the same two calls run for real by two processes over gloo, each call's peak
above its input read from the profiler; the CUDA target (NCCL) adds nothing.

A 1000 × 64 float32 input (256,000 B) on 2 ranks, measured on torch 2.13 (2026-12-07): the all-gather
peaks at its 512,000 B output and gloo's flat 512,000 B staging, 1,024,000 B; the reduce-scatter at
its 128,000 B output and gloo's 256,000 B clone of the input, 384,000 B. Whole steps where the staging
is the peak: tests/test_gloo_tp.py (SEQUENCE_PARALLEL_SGD), tests/test_gloo_pipeline_ep.py (pp × tp × ep).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_runs import spawn_ranks

from memcalc.engine.trace import StorageTracer
from memcalc.targets.cpu import gloo
from memcalc.targets.cpu.kernels import CPU_KERNEL_RULES, CpuCapabilities, CpuKernels

WORLD = 2
#: The input: 1000 × 64 float32.
ROWS, COLUMNS = 1000, 64
functional = torch.ops._c10d_functional


def _all_gather(x: torch.Tensor, group: str) -> torch.Tensor:
    return functional.wait_tensor(functional.all_gather_into_tensor(x, WORLD, group))


def _reduce_scatter(x: torch.Tensor, group: str) -> torch.Tensor:
    return functional.wait_tensor(functional.reduce_scatter_tensor(x, "sum", WORLD, group))


CALLS: dict[str, Callable[[torch.Tensor, str], torch.Tensor]] = {"all_gather": _all_gather,
                                                                  "reduce_scatter": _reduce_scatter}


def _traced_peak(call: Callable[[torch.Tensor, str], torch.Tensor], *, rules: bool = True) -> int:
    """The traced call's peak above its input, the CPU target's kernel rules after each op (or none)."""
    kernels = CpuKernels(CpuCapabilities.here())
    tracer = StorageTracer("meta", after_op=kernels.after_op if rules else None,
                           after_op_applies=lambda op: CPU_KERNEL_RULES.get(op) is not None)
    kernels.attach(tracer)
    x = torch.empty(ROWS, COLUMNS, device="meta")
    with tracer:
        out = call(x, dist.group.WORLD.group_name)
        del out
    trace = tracer.stop()
    alive = peak = 0
    for event in trace.events:
        alive += trace.nbytes[event] if event >= 0 else -trace.nbytes[~event]
        peak = max(peak, alive)
    return peak


@pytest.fixture
def two_fake_ranks() -> Iterator[None]:
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=fake_pg.FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_cpu_target_stages_what_gloo_stages(two_fake_ranks: None) -> None:
    nbytes = ROWS * COLUMNS * 4  # 256,000 B
    # all-gather: the output (2 × 256,000 B) and gloo's flat output of the same size
    assert _traced_peak(_all_gather) == 2 * WORLD * nbytes == 1_024_000
    # reduce-scatter: the output (256,000 / 2 B) and gloo's clone of the whole input
    assert _traced_peak(_reduce_scatter) == nbytes // WORLD + nbytes == 384_000
    # NCCL gathers and reduce-scatters in the caller's buffers: the outputs alone
    assert _traced_peak(_all_gather, rules=False) == WORLD * nbytes
    assert _traced_peak(_reduce_scatter, rules=False) == nbytes // WORLD
    assert CPU_KERNEL_RULES.get(gloo.ALL_GATHER) is gloo.all_gather_staging
    assert CPU_KERNEL_RULES.get(gloo.REDUCE_SCATTER) is gloo.reduce_scatter_staging


def _worker(rank: int, world_size: int, port: int, work_dir: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from memcalc.measure.step import _profiler_peak

    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    peaks = {}
    try:
        x = torch.randn(ROWS, COLUMNS)
        group = dist.group.WORLD.group_name
        for name, call in CALLS.items():
            call(x, group)  # the warm-up
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = call(x, group)
                del out
            peaks[name] = _profiler_peak(prof)
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"staging-rank{rank}.json").write_text(json.dumps(peaks))


def test_against_the_real_calls_over_gloo(tmp_path: Path) -> None:
    if not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=fake_pg.FakeStore())
    try:
        estimated = {name: _traced_peak(call) for name, call in CALLS.items()}
    finally:
        dist.destroy_process_group()
    spawn_ranks(_worker, WORLD, (str(tmp_path),), 300.0, what="gloo staging runs")
    for rank in range(WORLD):
        real = json.loads((tmp_path / f"staging-rank{rank}.json").read_text())
        assert real == estimated == {"all_gather": 1_024_000, "reduce_scatter": 384_000}, f"rank {rank}"

"""Blocks compiled one by one (torchtitan's ``apply_compile``) under DDP and FSDP2: memcalc's
estimate against every rank of a real two-process gloo run (tests/gloo_runs.py), each block's
forward compiled by Inductor on the CPU before ``DistributedDataParallel`` / ``fully_shard``
wraps the model, the hooks eager around the compiled blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from gloo_runs import FEATURES, BlockNet, GlooCase, RankPeak, run_cases

import memcalc

pytestmark = pytest.mark.slow  # two processes compile the blocks with the C++ build: minutes

TOLERANCE = 0.01  # issue 34's bar
WORLD = 2
FOREACH = memcalc.Loop(optimizer_impl="foreach")
#: a batch at which the blocks' activations, which the compiled graphs save, weigh in the peak (in
#: backward): at the harness's 16 samples the peak is the model states', the same eager or compiled
BATCH = 1024
CASES = [GlooCase("ddp-compiled", "ddp", compile=True, batch=BATCH),
         GlooCase("fsdp-compiled", "fsdp", compile=True, batch=BATCH)]


@pytest.fixture(scope="module")
def gloo_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    work_dir: Path = tmp_path_factory.mktemp("gloo-compiled")
    return run_cases(CASES, work_dir, world_size=WORLD)


def _estimate(case: GlooCase, *, compiled: bool) -> memcalc.MemoryReport:
    distributed = memcalc.Distributed(case.strategy, world_size=WORLD)
    return memcalc.estimate(BlockNet, input_shape=(FEATURES,), batch_size=BATCH, optimizer="adam", loss="mean",
                            gpu="cpu", loop=FOREACH, distributed=distributed, compile=compiled)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_compiled_blocks_against_every_rank_of_a_real_gloo_run(gloo_peaks: dict[str, list[RankPeak]],
                                                              case: GlooCase) -> None:
    report = _estimate(case, compiled=True)
    assert any("each of its 3 blocks on its own" in note for note in report.notes)
    estimate = report.peak_requested
    for rank, measured in enumerate(gloo_peaks[case.name]):
        real = measured.step_peak
        error = (estimate - real) / real
        print(f"{case.name} rank {rank}: real {real:,} B, estimate {estimate:,} B, {error:+.3%}")
        assert abs(error) <= TOLERANCE, f"rank {rank}: estimate {estimate:,} B, real {real:,} B ({error:+.3%})"
    # the compiled blocks' graphs, not the eager blocks, were traced (measured: 1,024 B apart, DDP
    # 63,636,668 vs 63,637,692 B, FSDP2 51,951,760 vs 51,952,784 B)
    assert estimate != _estimate(case, compiled=False).peak_requested

"""memcalc's per-rank DDP and FSDP2 estimates on the CPU target against real training steps on
two processes over gloo (tests/gloo_runs.py), every rank's peak read from the profiler.

These are the collectives a real CPU run has: gloo copies what FSDP2 all-gathers and
reduce-scatters (memcalc.distributed.fsdp.ShardedProgram._gloo_copy), which the fake process
group of tests/test_strategies.py never allocates. Without those copies the estimates below
were 0.26% (FSDP2's defaults), 1.5% (LoRA) and 11.4% (a frozen block) under the real peak.

Each rank's peak is compared less Adam's CPU step counters (4 B per trainable tensor), which a
GPU would not hold and memcalc leaves out. memcalc describes the busiest rank: under FSDP2 rank
1's local shard of the head is a row shorter, and so is its Adam state (2 KiB less).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from gloo_runs import BATCH, FEATURES, BlockNet, GlooCase, RankPeak, run_cases

import memcalc
from memcalc import FineTune, LoRA

pytestmark = pytest.mark.slow  # one spawn of two processes for all cases: about a minute

# The issue's bar is 1%; the runs agree within 0.02% on torch 2.13 (to the byte on FSDP2's
# busiest rank without LoRA, below), so 0.1% is held: it still catches the 0.26% that leaving
# out gloo's copies costs FSDP2's defaults.
TOLERANCE = 0.001
WORLD = 2
#: The runs step Adam(foreach=True); the estimates step the same implementation.
FOREACH = memcalc.Loop(optimizer_impl="foreach")
#: A block in the middle frozen: FSDP2 gathers it and reduces nothing for it; DDP buckets only
#: the trainable parameters.
FROZEN = FineTune(freeze=("blocks.1.*",))
#: PEFT's LoRA (r=8) on both Linear layers of every block: the base frozen, the adapters share
#: each block's FSDP unit.
LORA = FineTune(lora=LoRA(8, targets=("fc1", "fc2")))

CASES = [
    GlooCase("ddp", "ddp"),
    GlooCase("ddp-bucket-view", "ddp", gradient_as_bucket_view=True),
    GlooCase("ddp-frozen", "ddp", FROZEN),
    GlooCase("ddp-lora", "ddp", LORA),
    GlooCase("fsdp-defaults", "fsdp"),
    GlooCase("fsdp-reshard", "fsdp", reshard_after_forward=True),
    GlooCase("fsdp-no-reshard", "fsdp", reshard_after_forward=False),
    GlooCase("fsdp-frozen", "fsdp", FROZEN),
    GlooCase("fsdp-lora", "fsdp", LORA),
]


@pytest.fixture(scope="module")
def gloo_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    pytest.importorskip("peft")  # the LoRA cases, in the runs and in the estimates
    work_dir: Path = tmp_path_factory.mktemp("gloo")
    return run_cases(CASES, work_dir, world_size=WORLD)


def _estimate(case: GlooCase) -> memcalc.MemoryReport:
    if case.strategy == "ddp":
        distributed = memcalc.Distributed("ddp", world_size=WORLD, gradient_as_bucket_view=case.gradient_as_bucket_view)
    else:
        # memcalc's FULL_SHARD is fully_shard's default (the root kept from forward to backward);
        # reshard_after_forward=True on the root too gives the same real peak here: the peak
        # comes later in backward, after the root's parameters are gathered again
        sharding = "shard_grad_op" if case.reshard_after_forward is False else "full_shard"
        distributed = memcalc.Distributed("fsdp", world_size=WORLD, sharding=sharding)
    return memcalc.estimate(BlockNet, input_shape=(FEATURES,), batch_size=BATCH, optimizer="adam", loss="mean",
                            gpu="cpu", loop=FOREACH, finetune=case.finetune, distributed=distributed)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_estimate_against_every_rank_of_a_real_gloo_run(gloo_peaks, case):
    estimate = _estimate(case).peak_requested
    ranks = gloo_peaks[case.name]
    assert len(ranks) == WORLD
    for rank, measured in enumerate(ranks):
        real = measured.step_peak
        error = (estimate - real) / real
        print(f"{case.name} rank {rank}: real {real:,} B, estimate {estimate:,} B, {error:+.3%} "
              f"({measured.attempts} step(s) for a complete trace)")
        assert abs(error) <= TOLERANCE, f"rank {rank}: estimate {estimate:,} B, real {real:,} B ({error:+.3%})"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_to_the_byte(gloo_peaks, case):
    estimate = _estimate(case).peak_requested
    ranks = gloo_peaks[case.name]
    if case.strategy == "ddp" or case.finetune.lora is not None:
        # the foreach Adam's wrapped floats (memcalc.targets.cpu.scalars) were the 12 B DDP's runs held
        # above the estimate (2026-12-07). DDP's LoRA run held 40 B above it: PEFT's ``lora_B(...) * scaling``
        # wraps the float, and MulBackward0 keeps that 8 B tensor until its backward; DDP's LoRA step
        # peaks in the backward of the last block's fc2, the other five adapted layers' numbers alive
        # (5 x 8 B; the profiler on the real rank, 2026-12-07). Every rank to the byte; under FSDP2 with
        # LoRA too (48 B under before: all six numbers alive at its peak; the head frozen, so no Adam
        # state for its uneven shard)
        assert all(rank.step_peak == estimate for rank in ranks)
        return
    # FSDP2: memcalc's rank is rank 0, whose shards are the largest. Rank 1's shard of the head
    # (9 rows over 2 ranks) is a row shorter: its Adam moments, sized like the unpadded local
    # shard, hold one row of 256 weights and one bias element less, twice, at 4 B
    assert estimate == ranks[0].step_peak
    assert ranks[0].step_peak - ranks[1].step_peak == 2 * 4 * (256 + 1)


# ============================================================================================
# HSDP: FSDP2 on a 2-D mesh, four processes
# ============================================================================================

#: dp_replicate × dp_shard: sharded within a row of two ranks, replicated across the two rows.
HSDP_MESH = {"dp_replicate": 2, "dp_shard": 2}
HSDP_CASES = [
    GlooCase("hsdp-defaults", "fsdp", replicate=2),
    GlooCase("hsdp-reshard", "fsdp", replicate=2, reshard_after_forward=True),
]


@pytest.fixture(scope="module")
def hsdp_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    work_dir: Path = tmp_path_factory.mktemp("gloo-hsdp")  # one spawn of four processes: about two minutes
    return run_cases(HSDP_CASES, work_dir, world_size=HSDP_MESH["dp_replicate"] * HSDP_MESH["dp_shard"])


@pytest.mark.parametrize("case", HSDP_CASES, ids=lambda case: case.name)
def test_hsdp_against_every_rank_of_a_real_2d_mesh(hsdp_peaks, case):
    # fully_shard over init_device_mesh("cpu", (2, 2)): FSDP2 all-gathers and reduce-scatters within
    # a row of two ranks and all-reduces each reduce-scatter output across the rows in place, so a
    # rank holds what it holds under dp_shard=2 alone (not a quarter: dp_shard=4 is 27% under here).
    # torch 2.13, measured: ranks 0 and 2 19,489,232 B (less Adam's step counters), ranks 1 and 3
    # 2,056 B less, as under FSDP over two ranks; the estimate is rank 0's to the byte.
    estimate = memcalc.estimate(BlockNet, input_shape=(FEATURES,), batch_size=BATCH, optimizer="adam", loss="mean",
                                gpu="cpu", loop=FOREACH, distributed=memcalc.Distributed(**HSDP_MESH)).peak_requested
    ranks = hsdp_peaks[case.name]
    assert len(ranks) == 4
    for rank, measured in enumerate(ranks):
        real = measured.step_peak
        error = (estimate - real) / real
        print(f"{case.name} rank {rank}: real {real:,} B, estimate {estimate:,} B, {error:+.3%} "
              f"({measured.attempts} step(s) for a complete trace)")
        assert abs(error) <= TOLERANCE, f"rank {rank}: estimate {estimate:,} B, real {real:,} B ({error:+.3%})"
    # the first rank of each row holds the larger shards of the head (9 rows over 2)
    assert estimate == ranks[0].step_peak == ranks[2].step_peak
    assert ranks[0].step_peak - ranks[1].step_peak == ranks[2].step_peak - ranks[3].step_peak == 2 * 4 * (256 + 1)


def _report_environment(rank: int, world_size: int, port: int, work_dir: str) -> None:
    import json
    import os

    import torch
    (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(
        {"policy": os.environ.get("OMP_WAIT_POLICY"), "threads": torch.get_num_threads()}))


def test_the_ranks_wait_passively_on_the_test_process_threads(tmp_path: Path) -> None:
    """The forkserver's ranks start with gloo_runs.RANK_ENVIRONMENT (OpenMP threads that sleep
    rather than spin while a rank waits on a collective: the gloo runs' wall time on CI's two
    cores) and on this process's thread count (what the CPU target sizes its per-thread buffers
    by); the test process's own environment is left as it was."""
    import json
    import os

    import torch
    from gloo_runs import RANK_ENVIRONMENT, spawn_ranks

    before = os.environ.get("OMP_WAIT_POLICY")
    spawn_ranks(_report_environment, WORLD, (str(tmp_path),), timeout_s=60.0, what="the environment report")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    policy = before if before is not None else RANK_ENVIRONMENT["OMP_WAIT_POLICY"]
    assert ranks == [{"policy": policy, "threads": torch.get_num_threads()}] * WORLD
    assert os.environ.get("OMP_WAIT_POLICY") == before

"""memcalc's per-rank pipeline estimates on the CPU target against real pipeline-parallel steps
on two processes over gloo (tests/gloo_pipeline.py): torch.distributed.pipelining's
PipelineStage with ScheduleGPipe and Schedule1F1B, 2 stages, 4 microbatches, Adam, every
rank's peak read from the profiler.

Each rank's peak is compared less Adam's CPU step counters (4 B per trainable tensor), which a
GPU would not hold and memcalc leaves out. On torch 2.13 all four ranks agree to the byte. One
finding is held here: a real process group's send work keeps its tensor until the work object
dies, and 1F1B keeps its last forward send work in a variable through the steady state, so the
first rank holds its first microbatch's output 128 KiB longer than a fake group's works would
(memcalc.distributed.pipeline._KeptWork); without it the first rank's 1F1B estimate was 1.56%
under the real peak.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch as _torch
import torch.distributed as dist
from gloo_pipeline import (
    BATCH,
    POSITIONS,
    PipelineCase,
    check_every_rank,
    peaks_by_rank,
    pipeline_model,
    run_pipeline_cases,
)
from gloo_runs import FEATURES, RankPeak

import memcalc
from memcalc.distributed.pipeline import Pipeline, PipelineEstimate, estimate_pipeline
from memcalc.fields import build_step

#: memcalc drives torch.distributed.pipelining's internals as torch 2.13 has them; an older torch
#: is refused by name (test_an_older_torch_is_refused_by_name)
pytestmark = pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                reason="pipeline parallelism needs torch >= 2.13's pipelining")

# issue 33: the quick suite keeps one real run of each kind: GPipe and 1F1B over 2 stages, one
# spawn of two forked processes for both schedules (about 19 CPU-s); the sharded, HSDP and SAC
# pipelines run in the full suite

#: The issue's bar is 1%; the runs agree to the byte, so 0.1% is held.
TOLERANCE = 0.001
WORLD = 2
MICROBATCHES = 4
CASES = [PipelineCase("gpipe", "GPipe", MICROBATCHES), PipelineCase("1f1b", "1F1B", MICROBATCHES)]


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    work_dir: Path = tmp_path_factory.mktemp("gloo-pp")
    return run_pipeline_cases(CASES, work_dir, world_size=WORLD)


def _estimate(case: PipelineCase) -> PipelineEstimate:
    step = build_step(pipeline_model, input_shape=(POSITIONS, FEATURES), batch_size=BATCH, optimizer="adam",
                      loss="mean", gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"))
    return estimate_pipeline(step, Pipeline(WORLD, case.schedule, microbatches=case.microbatches))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_pipeline_rank_against_a_real_gloo_run(real_peaks, case):
    estimate = _estimate(case)
    assert [r.rank for r in estimate.ranks] == list(range(WORLD))
    check_every_rank(case.name, real_peaks[case.name], [r.report.peak_requested for r in estimate.ranks], TOLERANCE)
    # the busiest rank is named as the real runs rank them
    real_busiest = max(range(WORLD), key=lambda r: real_peaks[case.name][r].step_peak)
    assert estimate.busiest.rank == real_busiest


#: pp=2 x dp_shard=2 on four processes (GPipe, 1F1B, Interleaved1F1B): each stage fully_shard-ed over its
#: two dp_shard ranks (tests/gloo_pipeline.py), ranks 0-1 the first stage, 2-3 the second (pp outermost). On torch
#: 2.13 ranks 0-2 agree to the byte; rank 3, the second dp_shard rank of the last stage, is 520 B
#: under memcalc (0.004%, 0.011%, 0.007%): its shard of the head's 9 rows is 4 rows, not the padded 5, in what
#: Adam's state is made from, and memcalc traces the first dp_shard rank of each stage for both.
DP_SHARD = 2
SHARDED_CASES = [PipelineCase("gpipe-dp2", "GPipe", MICROBATCHES, DP_SHARD),
                 PipelineCase("1f1b-dp2", "1F1B", MICROBATCHES, DP_SHARD),
                 # two stages of one block per rank (rank 0: stages 0 and 2), torch's UNSHARD / RESHARD
                 # and REDUCE_GRAD actions around them
                 PipelineCase("interleaved-dp2", "Interleaved1F1B", MICROBATCHES, DP_SHARD, stages_per_rank=2)]


@pytest.fixture(scope="module")
def sharded_real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    work_dir: Path = tmp_path_factory.mktemp("gloo-pp-dp")
    return run_pipeline_cases(SHARDED_CASES, work_dir, world_size=WORLD * DP_SHARD)


@pytest.mark.slow
@pytest.mark.parametrize("case", SHARDED_CASES, ids=lambda case: case.name)
def test_pipeline_with_dp_shard_against_a_real_gloo_run(sharded_real_peaks, case):
    setting = memcalc.Distributed(pp=WORLD, dp_shard=DP_SHARD, pp_schedule=case.schedule,
                                  microbatches=case.microbatches)
    report = memcalc.estimate(pipeline_model, input_shape=(POSITIONS, FEATURES), batch_size=BATCH, optimizer="adam",
                              loss="mean", gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"),
                              distributed=setting)
    check_every_rank(case.name, sharded_real_peaks[case.name], peaks_by_rank(report, WORLD * DP_SHARD), TOLERANCE)


#: pp=2 x dp_replicate=2 x dp_shard=2 on eight processes: HSDP stages (tests/gloo_pipeline.py), ranks
#: 0-3 the first stage, 4-7 the second (torchtitan's mesh order: pp, dp_replicate, dp_shard).
HSDP_CASES = [PipelineCase("1f1b-hsdp", "1F1B", MICROBATCHES, DP_SHARD, dp_replicate=2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", HSDP_CASES, ids=lambda case: case.name)
def test_pipeline_with_hsdp_stages_against_a_real_gloo_run(tmp_path: Path, case: PipelineCase) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    world = WORLD * case.data_parallel
    peaks = run_pipeline_cases([case], tmp_path, world_size=world, timeout_s=600.0)[case.name]
    setting = memcalc.Distributed(pp=WORLD, dp_replicate=case.dp_replicate, dp_shard=case.dp_shard,
                                  pp_schedule=case.schedule, microbatches=case.microbatches)
    report = memcalc.estimate(pipeline_model, input_shape=(POSITIONS, FEATURES), batch_size=BATCH, optimizer="adam",
                              loss="mean", gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"),
                              distributed=setting)
    check_every_rank(case.name, peaks, peaks_by_rank(report, world), TOLERANCE)


#: op-level selective activation checkpointing of every block under the pipeline (issue 33): each
#: block wrapped before the split, as torchtitan applies SAC, on two processes.
SAC_CASES = [PipelineCase("gpipe-sac", "GPipe", MICROBATCHES, checkpoint="selective-op"),
             PipelineCase("1f1b-sac", "1F1B", MICROBATCHES, checkpoint="selective-op")]


@pytest.fixture(scope="module")
def sac_real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    work_dir: Path = tmp_path_factory.mktemp("gloo-pp-sac")
    return run_pipeline_cases(SAC_CASES, work_dir, world_size=WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("case", SAC_CASES, ids=lambda case: case.name)
def test_selective_checkpointing_under_a_pipeline_against_a_real_gloo_run(sac_real_peaks, case):
    step = build_step(pipeline_model, input_shape=(POSITIONS, FEATURES), batch_size=BATCH, optimizer="adam",
                      loss="mean", gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"), checkpoint="selective-op")
    estimate = estimate_pipeline(step, Pipeline(WORLD, case.schedule, microbatches=case.microbatches))
    unchecked = _estimate(case)
    print(f"{case.name} without checkpointing: {[r.report.peak_requested for r in unchecked.ranks]} B per rank")
    check_every_rank(case.name, sac_real_peaks[case.name], [r.report.peak_requested for r in estimate.ranks],
                     TOLERANCE)

"""memcalc's pp × cp estimate (``--mesh pp=2,cp=2``) on the CPU target against real four-process runs over
gloo (tests/gloo_pipeline_cp.py): the small Llama of tests/gloo_tp.py in two stages, each stage's
attention torch's ring over its two cp ranks (head-tail load balanced, 16 of 32 tokens a rank), FSDP2
over the cp ranks, GPipe and 1F1B over 4 microbatches (Interleaved1F1B: the Llama at 4 layers, two
stages a rank), Adam, every rank's peak read from the profiler and compared less Adam's CPU step
counters (which memcalc leaves out, as a GPU keeps them on the host); and pp=2 × dp_shard=2 × cp=2 on
eight processes (FSDP2 over dp_shard × cp).

On torch 2.13 (2026-12-07) every rank agrees to the byte, real (less Adam's step counters) and estimated:
GPipe 5,768,960 B (stage 0, cp rank 0) and 6,639,508 B (stage 1); 1F1B 5,391,360 B and 5,595,284 B;
Interleaved1F1B 9,229,056 B and 9,088,148 B (pipeline ranks 0 and 1); pp × dp_shard × cp 4,462,848 B and
4,666,388 B. (Interleaved: a rank's two stages share the process's one ring patch; patched once a stage, the
ring ran twice and rank 0 came out 144,768 B over.) The last cp rank holds whole copies of one microbatch's
partially merged ring output (16,384 B) fewer than cp rank 0 (GPipe 3 on either stage; 1F1B 2 on stage 0, 1
on stage 1; interleaved 5 and 3): the ring's last step on that rank merges without a partial update, so the
model's ``transpose(1, 2).contiguous()`` makes no copy for o_proj to save. memcalc traces cp rank 0; with
the partial merge's layout left out (:func:`~memcalc.distributed.ring_attention.merged_output` as the
identity) its estimate is the last cp rank's real peak to the byte (GPipe 5,719,808 B and 6,590,356 B; 1F1B
5,358,592 B and 5,578,900 B; interleaved 9,147,136 B and 9,038,996 B; the 8-process mesh 4,430,080 B and
4,650,004 B).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch as _torch
import torch.distributed as dist
from gloo_pipeline import check_every_rank, peaks_by_rank
from gloo_pipeline_cp import BATCH, CP, MICROBATCHES, PP, PipelineCpCase, deep_llama, run_cases
from gloo_runs import RankPeak
from gloo_tp import LLAMA_SEQ, small_llama

import memcalc
from memcalc.distributed import ring_attention as ring_module

pytestmark = [pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                 reason="pipeline parallelism needs torch >= 2.13's pipelining"),
              pytest.mark.slow]  # spawns of four and eight processes: minutes each on 2 cores

#: Every rank agrees to the byte (module docstring).
TOLERANCE = 0.0
CASES = [PipelineCpCase("gpipe", "GPipe"), PipelineCpCase("1f1b", "1F1B"),
         PipelineCpCase("interleaved-1f1b", "Interleaved1F1B", stages_per_rank=2)]


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    return run_cases(CASES, tmp_path_factory.mktemp("gloo-pp-cp"))


def estimate(case: PipelineCpCase) -> memcalc.MemoryReport:
    setting = memcalc.Distributed(pp=PP, dp_shard=case.dp_shard, cp=CP, pp_schedule=case.schedule,
                                  microbatches=MICROBATCHES, batch_is_global=False)
    model = small_llama if case.stages_per_rank == 1 else deep_llama
    return memcalc.estimate(model, seq_len=LLAMA_SEQ, batch_size=BATCH, optimizer="adam", loss="mean",
                            gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"), distributed=setting)


def check_cp_ranks(name: str, peaks: list[RankPeak], estimate_of: Callable[[], memcalc.MemoryReport],
                   monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """Every rank's real step peak against memcalc's, to the byte: cp rank 0 of each stage against the
    estimate (memcalc traces that rank); the last cp rank against the estimate with the partial merge's
    output layout left out (``merged_output`` as the identity), for the last cp rank merges its ring's
    steps without a partial update, so the model's transpose(1, 2).contiguous() of the attention output
    is a view there, not a copy that o_proj saves (tests/test_gloo_cp.py; ring_attention's docstring)."""
    estimated = peaks_by_rank(estimate_of(), world)
    with monkeypatch.context() as patch:
        patch.setattr(ring_module, "merged_output", lambda out: out)
        last = peaks_by_rank(estimate_of(), world)
    mixed = [last[rank] if rank % CP == CP - 1 else estimated[rank] for rank in range(world)]
    for rank in range(world):
        if rank % CP == CP - 1:
            copies = (estimated[rank] - peaks[rank].step_peak) / PARTIAL_MERGE_COPY
            print(f"{name} rank {rank}: {copies} partial-merge copies below cp rank 0's estimate")
    check_every_rank(name, peaks, mixed, TOLERANCE)


#: One copy of a stage's partially merged ring output (its one layer, a microbatch): 2 samples · 4 heads ·
#: 16 tokens · 32 dims · 4 B. The last cp rank holds whole copies fewer than cp rank 0 at its peak.
PARTIAL_MERGE_COPY = 2 * 4 * 16 * 32 * 4


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_rank_of_pp_x_cp_against_a_real_gloo_run(real_peaks, case, monkeypatch):
    report = estimate(case)
    assert [role.ranks for role in report.roles] == [(0, 1), (2, 3)]  # pp outermost, cp innermost (torchtitan)
    assert [(s.dimension, s.degree) for s in report.roles[0].sharding] == [("pp", 2), ("cp", 2), ("cp", 2)]
    check_cp_ranks(case.name, real_peaks[case.name], lambda: estimate(case), monkeypatch, PP * CP)


#: pp=2 × dp_shard=2 × cp=2 on eight processes (1F1B): ranks numbered (pp_rank × dp_shard + dp_shard_rank) ×
#: cp + cp_rank, torchtitan's mesh order; FSDP2 over the four dp_shard × cp ranks of a stage.
DP_SHARD = 2
CASES_3D = [PipelineCpCase("1f1b-dp-cp", "1F1B", DP_SHARD)]


@pytest.fixture(scope="module")
def real_peaks_3d(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    return run_cases(CASES_3D, tmp_path_factory.mktemp("gloo-pp-dp-cp"), dp_shard=DP_SHARD, timeout_s=900.0)


@pytest.mark.parametrize("case", CASES_3D, ids=lambda case: case.name)
def test_every_rank_of_pp_x_dp_shard_x_cp_against_a_real_gloo_run(real_peaks_3d, case, monkeypatch):
    check_cp_ranks(case.name, real_peaks_3d[case.name], lambda: estimate(case), monkeypatch,
                   PP * DP_SHARD * CP)

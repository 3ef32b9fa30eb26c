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

With tp (torchtitan's long-context layout; tests/gloo_pipeline_cp.py's docstring) every rank agrees to the byte
too (2026-12-07): pp=2 × cp=2 × tp=2 on eight processes, cp rank 0 (both tp ranks) GPipe 3,400,960 B and
3,577,940 B, 1F1B 3,201,920 B and 2,890,964 B, Interleaved1F1B 5,153,280 B and 4,659,668 B; the last cp rank
GPipe 3,384,576 B and 3,553,364 B, 1F1B 3,193,728 B and 2,882,772 B, interleaved 5,120,512 B and 4,635,092 B;
pp=2 × dp_shard=2 × cp=2 × tp=2 on sixteen (1F1B) 2,737,280 B and 2,425,940 B, the last cp rank 2,729,088 B
and 2,417,748 B.
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
              pytest.mark.slow]  # spawns of four, eight and sixteen processes: minutes each on 2 cores

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
    setting = memcalc.Distributed(pp=PP, dp_shard=case.dp_shard, cp=CP, tp=case.tp, pp_schedule=case.schedule,
                                  microbatches=MICROBATCHES, batch_is_global=False)
    model = small_llama if case.stages_per_rank == 1 else deep_llama
    return memcalc.estimate(model, seq_len=LLAMA_SEQ, batch_size=BATCH, optimizer="adam", loss="mean",
                            gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"), distributed=setting)


def check_cp_ranks(name: str, peaks: list[RankPeak], estimate_of: Callable[[], memcalc.MemoryReport],
                   monkeypatch: pytest.MonkeyPatch, world: int, tp: int = 1) -> None:
    """Every rank's real step peak against memcalc's, to the byte: cp rank 0 of each stage against the
    estimate (memcalc traces that rank); the last cp rank against the estimate with the partial merge's
    output layout left out (``merged_output`` as the identity), for the last cp rank merges its ring's
    steps without a partial update, so the model's transpose(1, 2).contiguous() of the attention output
    is a view there, not a copy that o_proj saves (tests/test_gloo_cp.py; ring_attention's docstring).
    Ranks in torchtitan's order, tp innermost: a rank's cp rank is ``rank // tp % CP``."""
    estimated = peaks_by_rank(estimate_of(), world)
    with monkeypatch.context() as patch:
        patch.setattr(ring_module, "merged_output", lambda out: out)
        last = peaks_by_rank(estimate_of(), world)
    on_last = [rank // tp % CP == CP - 1 for rank in range(world)]
    mixed = [last[rank] if on_last[rank] else estimated[rank] for rank in range(world)]
    for rank in range(world):
        if on_last[rank]:  # a copy of the tp rank's H/tp heads
            copies = (estimated[rank] - peaks[rank].step_peak) / (PARTIAL_MERGE_COPY // tp)
            print(f"{name} rank {rank}: {copies} partial-merge copies below cp rank 0's estimate")
    check_every_rank(name, peaks, mixed, TOLERANCE)


#: One copy of a stage's partially merged ring output (its one layer, a microbatch): 2 samples · 4 heads ·
#: 16 tokens · 32 dims · 4 B (under tp, of the rank's 4/tp heads). The last cp rank holds whole copies fewer
#: than cp rank 0 at its peak.
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


#: pp=2 × cp=2 × tp=2 on eight processes (torchtitan's long-context 4-D mesh with dp_shard of one): torchtitan's
#: Llama plan on each stage's tp ranks, FSDP2 over its cp ranks, the ring over each tp rank's local heads; ranks
#: numbered (pp_rank × cp + cp_rank) × tp + tp_rank. The three schedules pp × cp is checked under, one spawn.
TP = 2
CASES_TP = [PipelineCpCase("gpipe-tp", "GPipe", tp=TP), PipelineCpCase("1f1b-tp", "1F1B", tp=TP),
            PipelineCpCase("interleaved-1f1b-tp", "Interleaved1F1B", stages_per_rank=2, tp=TP)]


@pytest.fixture(scope="module")
def real_peaks_tp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    return run_cases(CASES_TP, tmp_path_factory.mktemp("gloo-pp-cp-tp"), tp=TP, timeout_s=1200.0)


@pytest.mark.parametrize("case", CASES_TP, ids=lambda case: case.name)
def test_every_rank_of_pp_x_cp_x_tp_against_a_real_gloo_run(real_peaks_tp, case, monkeypatch):
    report = estimate(case)
    assert [role.ranks for role in report.roles] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # pp outermost, tp innermost
    check_cp_ranks(case.name, real_peaks_tp[case.name], lambda: estimate(case), monkeypatch, PP * CP * TP, tp=TP)


#: pp=2 × dp_shard=2 × cp=2 × tp=2 on sixteen processes (1F1B): torchtitan's 4-D long-context mesh, FSDP2 over
#: each stage's dp_shard × cp ranks of its tp shards; ranks ((pp_rank × dp_shard + dp_shard_rank) × cp + cp_rank)
#: × tp + tp_rank.
CASES_4D = [PipelineCpCase("1f1b-dp-cp-tp", "1F1B", DP_SHARD, tp=TP)]


@pytest.fixture(scope="module")
def real_peaks_4d(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    return run_cases(CASES_4D, tmp_path_factory.mktemp("gloo-pp-dp-cp-tp"), dp_shard=DP_SHARD, tp=TP,
                     timeout_s=1800.0)


@pytest.mark.parametrize("case", CASES_4D, ids=lambda case: case.name)
def test_every_rank_of_pp_x_dp_shard_x_cp_x_tp_against_a_real_gloo_run(real_peaks_4d, case, monkeypatch):
    report = estimate(case)
    assert [role.ranks for role in report.roles] == [tuple(range(8)), tuple(range(8, 16))]
    check_cp_ranks(case.name, real_peaks_4d[case.name], lambda: estimate(case), monkeypatch, PP * DP_SHARD * CP * TP,
                   tp=TP)

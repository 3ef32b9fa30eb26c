"""memcalc's pp × tp estimate (``--mesh pp=2,tp=2``) on the CPU target against real four-process
runs over gloo (tests/gloo_pipeline_tp.py): the small Llama of tests/gloo_tp.py in two stages,
each parallelized with torchtitan's Llama plan (sequence-parallel norms) over its two tp ranks,
GPipe and 1F1B over 4 microbatches, Adam, every rank's peak read from the profiler and compared
less Adam's CPU step counters (which memcalc leaves out, as a GPU keeps them on the host); and
the 3-D mesh pp=2 × dp_shard=2 × tp=2 on eight processes (FSDP2 over each stage's DTensors).

On torch 2.13 every rank agrees to the byte: GPipe 4,142,592 B (first stage) and 5,024,788 B (last);
1F1B 3,760,896 B and 3,889,036 B; the 3-D mesh 3,451,136 B and 3,579,020 B. (The last stage under 1F1B
was 8 B over until 2026-12-07: memcalc's traced stage held an 8 B stand-in of the model's input ids,
which a real later stage never allocates; memcalc.distributed.pipeline_split now makes it untraced.)
"""

from __future__ import annotations

import pytest
import torch as _torch
import torch.distributed as dist
from gloo_pipeline import check_every_rank, peaks_by_rank
from gloo_pipeline_tp import BATCH, MICROBATCHES, PP, TP, PipelineTpCase, run_cases
from gloo_runs import RankPeak
from gloo_tp import LLAMA_SEQ, small_llama

import memcalc

pytestmark = [pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                 reason="pipeline parallelism needs torch >= 2.13's pipelining"),
              pytest.mark.slow]  # spawns of four and eight processes: three minutes each on 2 cores

#: The issue's bar is 1%; the runs agree to 8 B, so 0.1% is held.
TOLERANCE = 0.001
CASES = [PipelineTpCase("gpipe", "GPipe"), PipelineTpCase("1f1b", "1F1B")]


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    return run_cases(CASES, tmp_path_factory.mktemp("gloo-pp-tp"))


def estimate(schedule: str) -> memcalc.MemoryReport:
    setting = memcalc.Distributed(pp=PP, tp=TP, pp_schedule=schedule, microbatches=MICROBATCHES)
    return memcalc.estimate(small_llama, seq_len=LLAMA_SEQ, batch_size=BATCH, optimizer="adam", loss="mean",
                            gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"), distributed=setting)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_rank_of_pp_x_tp_against_a_real_gloo_run(real_peaks, case):
    report = estimate(case.schedule)
    check_every_rank(case.name, real_peaks[case.name], peaks_by_rank(report, PP * TP), TOLERANCE)


#: The 3-D mesh pp=2 × dp_shard=2 × tp=2 on eight processes (1F1B): ranks numbered
#: (pp_rank × dp_shard + dp_shard_rank) × tp + tp_rank, torchtitan's mesh order.
DP_SHARD = 2
CASES_3D = [PipelineTpCase("1f1b-3d", "1F1B", DP_SHARD)]


@pytest.fixture(scope="module")
def real_peaks_3d(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankPeak]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    return run_cases(CASES_3D, tmp_path_factory.mktemp("gloo-pp-dp-tp"), dp_shard=DP_SHARD, timeout_s=900.0)


@pytest.mark.parametrize("case", CASES_3D, ids=lambda case: case.name)
def test_every_rank_of_the_3d_mesh_against_a_real_gloo_run(real_peaks_3d, case):
    setting = memcalc.Distributed(pp=PP, dp_shard=DP_SHARD, tp=TP, pp_schedule=case.schedule,
                                  microbatches=MICROBATCHES)
    report = memcalc.estimate(small_llama, seq_len=LLAMA_SEQ, batch_size=BATCH, optimizer="adam", loss="mean",
                              gpu="cpu", loop=memcalc.Loop(optimizer_impl="foreach"), distributed=setting)
    check_every_rank(case.name, real_peaks_3d[case.name], peaks_by_rank(report, PP * DP_SHARD * TP), TOLERANCE)

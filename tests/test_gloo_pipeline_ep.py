"""memcalc's pp × ep estimate (``--mesh pp=2,ep=2``: each pipeline stage's experts sharded over the
ep ranks by transformers' ``apply_expert_parallelism``, :mod:`memcalc.distributed.ep_stages`) on the
CPU target against real four-process runs over gloo (tests/gloo_pipeline_ep.py): the tiny Mixtral of
tests/test_ep.py (2 layers, 4 experts, top-2) in two stages of one layer, batch 4 · 64 tokens in 2
microbatches, balanced routing made real, every rank's peak read from the profiler.

Measured on torch 2.13 / transformers 5.24 (2026-12-06), every rank to the byte: 1F1B with SGD,
ranks 0 and 1 (stage 0) 2,669,136 B, ranks 2 and 3 (stage 1) 2,128,724 B, real and estimated; GPipe
with Adam, 3,294,800 B and 3,611,228 B real less Adam's CPU step counters, and estimated.

The 3-D mesh pp=2 × dp_shard=2 × ep=2 on eight processes (1F1B, SGD), each stage FSDP2-wrapped as
torchtitan wraps an MoE stage (each layer's experts over dp_shard, every layer and the stage's root
over dp_shard × ep, ``reshard_after_forward=False``): ranks 0-3 2,796,496 B, ranks 4-7 2,256,148 B, real
and estimated, to the byte.

torchtitan's 4-D MoE layout, pp × dp_shard × tp × ep (``--mesh pp=2,dp_shard=2,tp=2,ep=2``, etp=1, sixteen
processes, 1F1B, SGD, the 8-expert Mixtral): ranks 0-7 1,857,488 B real and estimated; ranks 8-15 1,846,668 B real and
estimated, to the byte (2026-12-07; 1,847,180 B real and 1,846,676 estimated before the harness and stand-in fix).

HSDP stages with experts (``--mesh pp=2,dp_replicate=2,dp_shard=2,ep=2``, sixteen processes, 1F1B, SGD):
ranks 0-7 2,796,496 B, ranks 8-15 2,256,148 B, real and estimated, to the byte (2026-12-07).

pp × tp × ep (``--mesh pp=2,tp=2,ep=2``, eight processes, 1F1B, SGD): ranks 0-3 1,632,072 B, ranks 4-7
1,532,616 B, real and estimated, to the byte (the comment at CASES_TP).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch as _torch
import torch.distributed as dist
from gloo_pipeline import check_every_rank, peaks_by_rank
from gloo_pipeline_ep import EP, PP, PipelineEpCase, run_cases
from support import hf_config_source
from test_ep import TINY_MIXTRAL, TINY_MIXTRAL_8

import memcalc
from memcalc.distributed.expert_parallel import expert_parallelism_available

pytest.importorskip("transformers")
pytestmark = [pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                 reason="pipeline parallelism needs torch >= 2.13's pipelining"),
              pytest.mark.skipif(not expert_parallelism_available(),
                                 reason="ep needs transformers' expert parallelism"),
              pytest.mark.slow]  # two spawns of four processes: about two minutes each on 2 cores

#: The issue's bar is 1%; the runs agree to the byte, so 0.1% is held.
TOLERANCE = 0.001
CASES = [PipelineEpCase("1f1b-sgd", "1F1B", 2, "sgd", 4, 64), PipelineEpCase("gpipe-adam", "GPipe", 2, "adam", 4, 64)]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    return hf_config_source(tmp_path_factory.mktemp("tiny-mixtral"), TINY_MIXTRAL)


def _real(source: str, cases: list[PipelineEpCase], work_dir: Path, **degrees: int) -> dict[str, list]:
    """The real runs of ``cases`` over gloo on the mesh ``pp × ep`` × ``degrees`` (dp_shard, tp)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    return run_cases(source, cases, work_dir, timeout_s=1000.0, **degrees)


def _check(source: str, real: dict[str, list], case: PipelineEpCase, **degrees: int) -> None:
    """Every rank of memcalc's estimate of ``case`` on ``pp × ep`` × ``degrees`` against its real peak."""
    setting = memcalc.Distributed(pp=PP, ep=EP, pp_schedule=case.schedule.lower(), microbatches=case.microbatches,
                                  **degrees)
    report = memcalc.estimate(source, gpu="cpu", batch_size=case.batch, seq_len=case.seq_len,
                              optimizer=case.optimizer, loss="mean", distributed=setting)
    world = PP * EP * math.prod(degrees.values())
    check_every_rank(case.name, real[case.name], peaks_by_rank(report, world), TOLERANCE)


@pytest.fixture(scope="module")
def real_peaks(source: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    return _real(source, CASES, tmp_path_factory.mktemp("gloo-pp-ep"))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_rank_of_pp_x_ep_against_a_real_gloo_run(source: str, real_peaks: dict[str, list],
                                                       case: PipelineEpCase) -> None:
    _check(source, real_peaks, case)


#: The 3-D mesh (ranks numbered (pp_rank × dp_shard + dp_shard_rank) × ep + ep_rank, torchtitan's order).
DP_SHARD = 2
CASES_3D = [PipelineEpCase("1f1b-sgd-3d", "1F1B", 2, "sgd", 4, 64, dp_shard=DP_SHARD)]


@pytest.fixture(scope="module")
def real_peaks_3d(source: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    return _real(source, CASES_3D, tmp_path_factory.mktemp("gloo-pp-dp-ep"), dp_shard=DP_SHARD)


@pytest.mark.parametrize("case", CASES_3D, ids=lambda case: case.name)
def test_every_rank_of_pp_x_dp_shard_x_ep_against_a_real_gloo_run(source: str, real_peaks_3d: dict[str, list],
                                                                  case: PipelineEpCase) -> None:
    _check(source, real_peaks_3d, case, dp_shard=DP_SHARD)


#: pp × tp × ep (ranks numbered (pp_rank × ep + ep_rank) × tp + tp_rank): each stage's dense part under
#: Mixtral's own tp plan, its experts over the 4 ep × tp ranks of its pipeline rank (etp=1). Measured
#: (2026-12-07, 1F1B, SGD): ranks 0-3 (stage 0) 1,632,072 B, ranks 4-7 (stage 1) 1,532,616 B, real and
#: estimated. Stage 0's peak is gloo's all-gather
#: staging: ``AllToAllEP._combine_tokens`` gathers the experts' output over tp (``full_tensor``), and
#: gloo's worker (``gloo:all_gather``: ``aten::empty``) gathers into a flat output-sized buffer of its own
#: while the caller's input and output are alive: one microbatch's tokens x hidden (65,536 B with one
#: microbatch of 256 tokens under GPipe; 32,768 B with two of 128, which lifts stage 0's peak 24,064 B).
#: memcalc models it on the CPU target (memcalc.targets.cpu.gloo); before, stage 0 was 1.47% under.
#: Stage 1's peak is the head's all-gather staging. It was 504 B under (1,533,128 B real, 1,532,624 B
#: estimated) until the live blocks at both peaks were compared from the real rank's profiler stacks:
#: the real rank alone held the position ids (``torch.arange``, 64 int64, 512 B), as the harness's stage
#: forward kept them through the head where ``MixtralForCausalLM`` runs the head after
#: ``MixtralModel.forward`` has returned (the harness now does too), and memcalc alone held an 8 B
#: ``input_ids`` stand-in that a real later stage never allocates (now made untraced,
#: memcalc.distributed.pipeline_split).
TP = 2
CASES_TP = [PipelineEpCase("1f1b-sgd-tp", "1F1B", 2, "sgd", 4, 64, tp=TP)]


@pytest.fixture(scope="module")
def real_peaks_tp(source: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    return _real(source, CASES_TP, tmp_path_factory.mktemp("gloo-pp-ep-tp"), tp=TP)


@pytest.mark.parametrize("case", CASES_TP, ids=lambda case: case.name)
def test_every_rank_of_pp_x_tp_x_ep_against_a_real_gloo_run(source: str, real_peaks_tp: dict[str, list],
                                                           case: PipelineEpCase) -> None:
    _check(source, real_peaks_tp, case, tp=TP)


#: HSDP stages with experts (pp=2 x dp_replicate=2 x dp_shard=2 x ep=2, sixteen processes; ranks numbered
#: ((pp_rank x dp_replicate + replica) x dp_shard + dp_shard_rank) x ep + ep_rank): each stage's units
#: fully_shard-ed over the 2-D (dp_replicate, dp_shard) mesh (experts) and (dp_replicate, dp_shard x ep) (the
#: rest), as torchtitan wraps them; the replicas' all-reduce is in place, so every rank holds what it holds
#: under pp x dp_shard x ep.
CASES_HSDP = [PipelineEpCase("1f1b-sgd-hsdp", "1F1B", 2, "sgd", 4, 64, dp_shard=DP_SHARD, dp_replicate=2)]


@pytest.fixture(scope="module")
def real_peaks_hsdp(source: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    return _real(source, CASES_HSDP, tmp_path_factory.mktemp("gloo-pp-hsdp-ep"), dp_shard=DP_SHARD, dp_replicate=2)


@pytest.mark.parametrize("case", CASES_HSDP, ids=lambda case: case.name)
def test_every_rank_of_pp_x_hsdp_x_ep_against_a_real_gloo_run(source: str, real_peaks_hsdp: dict[str, list],
                                                              case: PipelineEpCase) -> None:
    _check(source, real_peaks_hsdp, case, dp_replicate=2, dp_shard=DP_SHARD)


#: pp x dp_shard x tp x ep (torchtitan's 4-D MoE layout, etp=1; ranks ((pp_rank x dp_shard + dp_shard_rank) x ep
#: + ep_rank) x tp + tp_rank), on the 8-expert Mixtral (4 experts would leave 1 per ep x tp rank, fewer than
#: dp_shard: refused): each stage's dense part under the tp plan, its experts over ep x tp, then FSDP2 as for
#: pp x dp_shard x ep. Measured (2026-12-07): ranks 0-7 1,857,488 B real and estimated; ranks 8-15 1,846,668 B real
#: and estimated, to the byte (1,847,180 real and 1,846,676 estimated before the fix at CASES_TP's comment).
CASES_4D = [PipelineEpCase("1f1b-sgd-4d", "1F1B", 2, "sgd", 4, 64, dp_shard=DP_SHARD, tp=TP)]


@pytest.fixture(scope="module")
def source_8(tmp_path_factory: pytest.TempPathFactory) -> str:
    return hf_config_source(tmp_path_factory.mktemp("tiny-mixtral-8"), TINY_MIXTRAL_8)


@pytest.fixture(scope="module")
def real_peaks_4d(source_8: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    return _real(source_8, CASES_4D, tmp_path_factory.mktemp("gloo-pp-dp-tp-ep"), dp_shard=DP_SHARD, tp=TP)


@pytest.mark.parametrize("case", CASES_4D, ids=lambda case: case.name)
def test_every_rank_of_pp_x_dp_shard_x_tp_x_ep_against_a_real_gloo_run(source_8: str, real_peaks_4d: dict[str, list],
                                                                       case: PipelineEpCase) -> None:
    _check(source_8, real_peaks_4d, case, dp_shard=DP_SHARD, tp=TP)

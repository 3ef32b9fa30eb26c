"""memcalc's pp × tp × ep estimate under HSDP's dp_replicate without dp_shard (``--mesh
pp=2,dp_replicate=2,tp=2,ep=2``) on the CPU target against a real sixteen-process run over gloo
(tests/gloo_pipeline_ep.py), as torchtitan runs that mesh (etp=1; its ep of 4 borrows its dp_shard of 2
and the tp ranks): each stage's dense part under Mixtral's own tp plan on the tp pair, its experts over
the flattened ep × tp ranks by transformers' ``apply_expert_parallelism``, then ``apply_fsdp``: each
layer's experts an FSDP2 unit over the 2-D ``(dp_replicate, 1)`` mesh (a one-rank shard group: no
collective), every layer and the stage's root over ``(dp_replicate, ep)``, ``reshard_after_forward=False``
under the pipeline; the replicas' all-reduce runs in place after the last microbatch. The tiny Mixtral
of tests/test_ep.py (2 layers, 4 experts, top-2) in two stages of one layer, batch 4 · 64 tokens in 2
microbatches, 1F1B with SGD, balanced routing made real, every rank's peak read from the profiler.

Measured on torch 2.13 / transformers 5.24 (2026-12-07, ``OMP_NUM_THREADS=1``, 71 s at load 9-12), every
rank to the byte, real and estimated: ranks 0-7 (stage 0) 1,759,816 B, ranks 8-15 (stage 1) 1,660,488 B.
Without the stages' FSDP2 (pp × tp × ep's program) they would be 1,632,072 B and 1,532,616 B
(tests/test_gloo_pipeline_ep.py): the run tells the two apart.

With dp_shard too (``pp=2,dp_replicate=2,dp_shard=2,tp=2,ep=2``) it stays refused (strategy/pp.py): its
smallest real run is thirty-two processes, not run.
"""

from __future__ import annotations

import pytest
import torch as _torch
import torch.distributed as dist
from gloo_pipeline import check_every_rank, peaks_by_rank
from gloo_pipeline_ep import EP, PP, PipelineEpCase, run_cases
from support import hf_config_source
from test_ep import TINY_MIXTRAL

import memcalc
from memcalc.distributed.expert_parallel import expert_parallelism_available

pytest.importorskip("transformers")
pytestmark = [pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                 reason="pipeline parallelism needs torch >= 2.13's pipelining"),
              pytest.mark.skipif(not expert_parallelism_available(),
                                 reason="ep needs transformers' expert parallelism"),
              pytest.mark.slow]  # one spawn of sixteen processes

#: The runs agree to the byte; 0.1% is held, as tests/test_gloo_pipeline_ep.py holds.
TOLERANCE = 0.001
REPLICAS, TP = 2, 2
#: Ranks numbered ((pp_rank × dp_replicate + replica) × ep + ep_rank) × tp + tp_rank; measured: the module docstring.
CASES = [PipelineEpCase("1f1b-sgd-dpr-tp", "1F1B", 2, "sgd", 4, 64, dp_replicate=REPLICAS, tp=TP)]


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    source = hf_config_source(tmp_path_factory.mktemp("tiny-mixtral"), TINY_MIXTRAL)
    work_dir = tmp_path_factory.mktemp("gloo-pp-dpr-tp-ep")
    return source, run_cases(source, CASES, work_dir, dp_replicate=REPLICAS, tp=TP, timeout_s=2400.0)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_rank_of_pp_x_dp_replicate_x_tp_x_ep_against_a_real_gloo_run(
        real_peaks: tuple[str, dict[str, list]], case: PipelineEpCase) -> None:
    source, real = real_peaks
    setting = memcalc.Distributed(pp=PP, ep=EP, tp=TP, dp_replicate=REPLICAS, pp_schedule=case.schedule.lower(),
                                  microbatches=case.microbatches)
    report = memcalc.estimate(source, gpu="cpu", batch_size=case.batch, seq_len=case.seq_len,
                              optimizer=case.optimizer, loss="mean", distributed=setting)
    check_every_rank(case.name, real[case.name], peaks_by_rank(report, PP * REPLICAS * EP * TP), TOLERANCE)

"""memcalc's per-rank context-parallel (``cp``) and expert × context-parallel (``ep`` × ``cp``) estimates on
the CPU target, against real training steps of processes over gloo (tests/gloo_cp.py): torch's own ring
attention over the real cp group (the CPU flash op added to its handlers), torch's load balancer's
sequence shards, transformers' ``apply_expert_parallelism`` over torchtitan's ep (which borrows cp), FSDP2
as torchtitan's ``apply_fsdp`` wraps MoE models; every rank's peak read from the profiler.

The model: the tiny Mixtral of tests/test_ep.py (4 experts, top-2; 8 for dp_shard × ep × cp, so that each
of the 4 ep × cp ranks' 2 experts split over dp_shard=2), batch 4 · 64 tokens, SGD. Measured on torch 2.13
/ transformers 5.24 (2026-12-07), to the byte on the busiest ranks (cp rank 0; every rank but the last cp
rank takes torch's partial merge, whose torch.cat output the model's transpose then copies: +Nq·s per
attention layer, :mod:`memcalc.distributed.ring_attention`), the last cp rank 65,536 B below:

- cp=2 (2 processes): 4,206,312 B real (cp rank 0) and estimated; cp rank 1 4,140,776 B. Adam at batch
  2 · 16: 3,430,564 B real less Adam's step counters and estimated.
- cp=2 × ep=2 (4 processes: the 4 experts over the 4 ranks, one each): 3,070,608 B real (cp rank 0) and
  estimated; cp rank 1 3,005,072 B. At 66 tokens (2 · cp does not divide them: no load balancing, no
  partial merge) every rank 3,085,328 B real and estimated.
- dp_shard=2 × cp=2 × ep=2 (8 processes): 3,158,776 B real (cp rank 0) and estimated; cp rank 1 3,093,240 B.
- dp_replicate=2 × cp=2 × ep=2 (8 processes, HSDP): as cp=2 × ep=2, SGD and Adam (2 · 16), to the byte on cp rank 0.
- tp=2 × cp=2 × ep=2 (8 processes, 8 experts one per rank): 2,158,480 B real (cp rank 0, both tp ranks) and
  estimated, cp rank 1 2,125,712 B (the ring-output copy of its tp rank's heads: LAST_CP_RANK_LESS / tp); Adam
  at 2 · 16 1,217,436 B real less the step counters and estimated.
- 16 processes, two of dp_shard, dp_replicate, tp beside cp=2 × ep=2 (SGD), to the byte on cp rank 0:
  dp_replicate × tp 2,158,480 B; dp_shard × tp (16 experts) 2,154,232 B; dp_replicate × dp_shard 3,158,776 B.
- cp=2 × ep=2 at batch 2 · 16 (SGD and Adam), whose peak is in the last layer's ring backward at its partial
  step: to the byte since the ring backward is modelled step by step (the CPU flash backward's copy of the half
  chunk of grad_out, the contiguous half of logsumexp, the call's smaller blocks): Adam 1,498,940 B real less
  the step counters and estimated, SGD 989,372 B; under the old closed formula 492 B (0.03%) under.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gloo_cp import run_cp
from support import hf_config_source
from test_ep import EXPERT, TINY_MIXTRAL, TINY_MIXTRAL_8

import memcalc
from memcalc.core.report import RoleReport
from memcalc.distributed.expert_parallel import expert_parallelism_available

pytest.importorskip("transformers")

SGD: dict[str, Any] = dict(batch_size=4, seq_len=64, optimizer="sgd")
ADAM: dict[str, Any] = dict(batch_size=2, seq_len=16, optimizer="adam")
#: What the last cp rank holds less than the others (SGD case): the copy of the ring's output that the
#: model's transpose(1, 2).contiguous() makes on ranks that merge partially, 4 · 4 heads · 32 · 16 · 4 B per layer.
LAST_CP_RANK_LESS = 2 * (4 * 4 * 32 * 16 * 4)


def _compare(tmp_path: Path, config: dict[str, Any], kwargs: dict[str, Any], timeout_s: float = 300.0,
             **degrees: int) -> RoleReport:
    source = hf_config_source(tmp_path, config)
    report = memcalc.estimate(source, gpu="cpu", distributed=memcalc.Distributed(**degrees), **kwargs)
    (role,) = report.roles
    cp, ep, tp = degrees["cp"], degrees.get("ep", 1), degrees.get("tp", 1)
    data = degrees.get("dp_shard", 1) * degrees.get("dp_replicate", 1)
    assert role.ranks == tuple(range(cp * ep * tp * data))
    assert report.global_batch_size == data * ep * kwargs["batch_size"]  # the cp (and tp) ranks share a batch
    estimate = role.report.peak_requested
    peaks = run_cp(source, kwargs, tmp_path, cp=cp, ep=ep, dp_shard=degrees.get("dp_shard", 1),
                   dp_replicate=degrees.get("dp_replicate", 1), tp=tp, timeout_s=timeout_s)
    adam = kwargs["optimizer"] == "adam"
    for rank, peak in enumerate(peaks):
        real = peak.step_peak if adam else peak.peak  # less Adam's CPU step counters
        cp_rank = rank // tp % cp  # tp innermost, then cp
        if cp_rank == 0:  # cp rank 0: the rank memcalc traces
            assert estimate == real, f"rank {rank}: estimated {estimate:,} B vs real {real:,} B"
        elif kwargs["seq_len"] % (2 * cp):  # no load balancing: no partial merge, every rank alike
            assert real == estimate, f"rank {rank}: estimated {estimate:,} B vs real {real:,} B"
        elif kwargs == SGD:  # the last cp rank merges without partial updates: no copy of the ring's output, of
            # its tp rank's heads (at batch 2 · 16 the peak is in the ring's backward, whose steps differ by rank:
            # cp rank 0 only)
            busiest = peaks[rank - cp_rank * tp].peak
            assert real == busiest - LAST_CP_RANK_LESS // tp, f"rank {rank}: {real:,} B"
    return role


@pytest.mark.parametrize("kwargs", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.quick_cases("sgd")
def test_cp_matches_the_busiest_rank_of_a_real_gloo_run(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    _compare(tmp_path, TINY_MIXTRAL, kwargs, cp=2)


needs_ep = pytest.mark.skipif(not expert_parallelism_available(),
                              reason="ep needs transformers.distributed.expert_parallel")


@needs_ep
@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [SGD, {**SGD, "seq_len": 66}], ids=["balanced", "unbalanced"])
def test_ep_x_cp_matches_every_rank_of_a_real_gloo_run(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    # 66 tokens: 2 x cp = 4 does not divide them, so torch shards without load balancing (no partial merge)
    _compare(tmp_path, TINY_MIXTRAL, kwargs, cp=2, ep=2)


@needs_ep
@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [ADAM, {**ADAM, "optimizer": "sgd"}], ids=["adam", "sgd"])
def test_ep_x_cp_at_16_tokens_matches_the_busiest_rank_of_a_real_gloo_run(tmp_path: Path,
                                                                          kwargs: dict[str, Any]) -> None:
    # the peak in the last layer's ring backward, at its partial step (module docstring)
    _compare(tmp_path, TINY_MIXTRAL, kwargs, cp=2, ep=2)


@needs_ep
@pytest.mark.slow
def test_dp_shard_x_ep_x_cp_matches_every_rank_of_a_real_gloo_run(tmp_path: Path) -> None:
    _compare(tmp_path, TINY_MIXTRAL_8, SGD, timeout_s=900.0, dp_shard=2, cp=2, ep=2)


@needs_ep
@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [SGD, ADAM], ids=["sgd", "adam"])
def test_dp_replicate_x_ep_x_cp_matches_every_rank_of_a_real_gloo_run(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    # torchtitan's HSDP: FSDP2 over (dp_replicate, dp_shard_cp) and (dp_replicate, dp_shard_mod_ep), 8 processes
    _compare(tmp_path, TINY_MIXTRAL, kwargs, timeout_s=900.0, dp_replicate=2, cp=2, ep=2)


@needs_ep
@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [SGD, ADAM], ids=["sgd", "adam"])
def test_ep_x_cp_x_tp_matches_every_rank_of_a_real_gloo_run(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    # tp's plan on attention and the dense part, the 8 experts over ep x cp x tp = 8 ranks (one each), 8 processes
    role = _compare(tmp_path, TINY_MIXTRAL_8, kwargs, timeout_s=900.0, tp=2, cp=2, ep=2)
    # what a rank holds, by hand: as under dp_shard=2 x tp=2 x ep=2 (tests/test_ep.py), one expert per layer (8 over
    # 8 ranks here, 2 over 4 there halved by dp_shard's FSDP2) and the dense part's tp shards over 4 FSDP2 ranks
    # (dp_shard x ep x cp = 1 x 2 x 2 here, dp_shard x ep = 2 x 2 there)
    layer = (8 * 64 + 4 * 64 + 4 * 64 + 16 * 32) + 2 * 64 + 2 * 16 + EXPERT
    held = 2 * (32 * 64) + 2 * layer + 16
    assert held == 56_656 and role.report.textbook.parameter_bytes == 4 * held


#: 16 experts: under dp_shard x tp x cp x ep each of the ep x cp x tp = 8 ranks holds 2 experts of a layer, which
#: FSDP2 splits over dp_shard=2 on dim 0.
TINY_MIXTRAL_16: dict[str, Any] = {**TINY_MIXTRAL_8, "num_local_experts": 16}


@needs_ep
@pytest.mark.slow
@pytest.mark.parametrize("config, degrees", [
    (TINY_MIXTRAL_8, dict(dp_replicate=2, tp=2)), (TINY_MIXTRAL_16, dict(dp_shard=2, tp=2)),
    (TINY_MIXTRAL_8, dict(dp_replicate=2, dp_shard=2)),
], ids=["dp_replicate-tp", "dp_shard-tp", "dp_replicate-dp_shard"])
def test_ep_x_cp_with_two_more_dimensions_matches_every_rank_of_a_real_gloo_run(
        tmp_path: Path, config: dict[str, Any], degrees: dict[str, int]) -> None:
    # 16 processes each (the smallest meshes of these layouts): two of dp_shard, dp_replicate and tp beside ep x cp
    _compare(tmp_path, config, SGD, timeout_s=1200.0, cp=2, ep=2, **degrees)

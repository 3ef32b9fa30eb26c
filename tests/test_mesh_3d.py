"""The 3-D mesh: tensor parallelism inside pipeline stages (``--mesh pp=2,tp=2``, and
``dp_shard`` around it), checked here by hand-worked bytes and refusals; the real four- and
eight-process gloo runs are tests/test_gloo_pipeline_tp.py (slow). With context parallelism too
(``pp=2,cp=2,tp=2``, torchtitan's long-context layout) the real runs are tests/test_gloo_pipeline_cp.py."""

from __future__ import annotations

import pytest
import torch as _torch
from gloo_tp import LLAMA_SEQ, SMALL_LLAMA, small_llama

import memcalc
from memcalc.core.errors import InapplicableOptionError

pytestmark = pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                reason="pipeline parallelism needs torch >= 2.13's pipelining")

_OPTIONS = dict(seq_len=LLAMA_SEQ, batch_size=8, optimizer="adam", loss="mean", gpu="cpu",
                loop=memcalc.Loop(optimizer_impl="foreach"))


def _layer_elements(tp: int) -> int:
    """One layer of the small Llama on a tp rank under torchtitan's plan: q, k, v, o, gate, up and
    down sharded (d 128, KV 2 × 32 = 64, SwiGLU 344), the two norms replicated (sequence parallel)."""
    d, kv, f = SMALL_LLAMA.hidden_size, SMALL_LLAMA.num_kv_heads * SMALL_LLAMA.head_dim, SMALL_LLAMA.intermediate_size
    return (d * d + 2 * kv * d + d * d + 3 * d * f) // tp + 2 * d


def test_pp_x_tp_holds_its_stage_over_tp_by_hand():
    report = memcalc.estimate(small_llama, distributed=memcalc.Distributed(pp=2, tp=2, microbatches=4), **_OPTIONS)
    first, last = report.roles
    v, d = SMALL_LLAMA.vocab_size, SMALL_LLAMA.hidden_size
    # stage 0: the embedding's rows over tp (RowwiseParallel) + layer 0; stage 1: layer 1 + the final
    # norm (replicated) + the head's rows over tp (ColwiseParallel); fp32
    assert first.report.textbook.parameter_bytes == 4 * (v * d // 2 + _layer_elements(2)) == 619_520
    assert last.report.textbook.parameter_bytes == 4 * (_layer_elements(2) + d + v * d // 2) == 620_032
    # Adam: weights, gradients and two moments, at the optimizer step
    assert last.model_states == 4 * last.report.textbook.parameter_bytes
    # tp innermost: ranks 0-1 hold stage 0, 2-3 stage 1; each row says what each dimension shards
    assert (first.ranks, last.ranks) == ((0, 1), (2, 3))
    assert [s.describe() for s in first.sharding] == ["blocks /2 (pp)", "params, grads, optimizer /2 (tp)"]
    assert report.world_size == 4 and report.global_batch_size == 8


def test_the_3d_mesh_shards_each_stage_over_dp_shard_and_tp_by_hand():
    setting = memcalc.Distributed(pp=2, dp_shard=2, tp=2, microbatches=4)
    report = memcalc.estimate(small_llama, distributed=setting, **_OPTIONS)
    first, last = report.roles
    v, d = SMALL_LLAMA.vocab_size, SMALL_LLAMA.hidden_size
    # FSDP2 halves dim 0 of every local tp shard (every dimension here is even: no padding)
    assert first.report.textbook.parameter_bytes == 4 * (v * d // 2 + _layer_elements(2)) // 2 == 309_760
    assert last.report.textbook.parameter_bytes == 4 * (_layer_elements(2) + d + v * d // 2) // 2 == 310_016
    assert first.model_states == 4 * first.report.textbook.parameter_bytes
    # rank = (pp_rank × dp_shard + dp_shard_rank) × tp + tp_rank
    assert (first.ranks, last.ranks) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [s.describe() for s in first.sharding] == [
        "blocks /2 (pp)", "params, grads, optimizer /2 (tp)", "params, grads, optimizer, batch /2 (dp_shard)"]
    assert report.world_size == 8 and report.global_batch_size == 16


def test_what_pp_x_tp_does_not_model_is_refused_by_name():
    with pytest.raises(InapplicableOptionError, match="loss_parallel with pp=2 is not modelled yet"):
        memcalc.estimate(small_llama, distributed=memcalc.Distributed(pp=2, tp=2, loss_parallel=True), **_OPTIONS)
    # 344 (SwiGLU) over 8 ranks: 43 each, but 1000 (the vocabulary) over 8 is 125: even; the KV 64 over 3 is not
    with pytest.raises(InapplicableOptionError, match=r"splits .* unevenly"):
        memcalc.estimate(small_llama, distributed=memcalc.Distributed(pp=2, tp=3, microbatches=4), **_OPTIONS)


def test_pp_x_cp_x_tp_shards_each_stages_tp_shards_over_cp_by_hand():
    # torchtitan's long-context 4-D layout (dp_shard of one): tp's plan on each stage, FSDP2 over the cp ranks
    # (dp_shard_cp), the ring around each stage's attention; the real eight-process run:
    # tests/test_gloo_pipeline_cp.py (slow)
    setting = memcalc.Distributed(pp=2, cp=2, tp=2, microbatches=2)  # the smallest step: 2 microbatches of 1
    report = memcalc.estimate(small_llama, distributed=setting, **{**_OPTIONS, "batch_size": 2})
    first, last = report.roles
    v, d = SMALL_LLAMA.vocab_size, SMALL_LLAMA.hidden_size
    # FSDP2 over cp halves dim 0 of every local tp shard, as dp_shard does in the 3-D mesh (every dimension even)
    assert first.report.textbook.parameter_bytes == 4 * (v * d // 2 + _layer_elements(2)) // 2 == 309_760
    assert last.report.textbook.parameter_bytes == 4 * (_layer_elements(2) + d + v * d // 2) // 2 == 310_016
    assert last.model_states == 4 * last.report.textbook.parameter_bytes  # Adam: weights, grads, two moments
    # rank = (pp_rank × cp + cp_rank) × tp + tp_rank: torchtitan's (pp, dp_shard, cp, tp), tp innermost
    assert (first.ranks, last.ranks) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [s.describe() for s in first.sharding] == [
        "blocks /2 (pp)", "params, grads, optimizer /2 (cp)", "sequence /2 (cp)", "params, grads, optimizer /2 (tp)"]
    # the cp and tp ranks of a pipeline rank share its batch, each holding S/cp = 16 of the 32 tokens
    assert report.world_size == 8 and report.global_batch_size == 2
    assert f"context parallelism over 2 ranks: {LLAMA_SEQ // 2} of {LLAMA_SEQ} tokens" in " ".join(report.notes)

    # with dp_shard of one FSDP2's note names the cp ranks alone, as cp without a pipeline does (it once read
    # "dp_shard x cp = 1 x 2")
    assert not any("dp_shard x cp" in note for note in report.notes)
    assert any(note.startswith("FSDP2 of each pipeline stage over 2 ranks") for note in report.notes)

"""``pp`` on the device mesh: ``Distributed(pp=N, pp_schedule=..., microbatches=...)`` and
``--mesh pp=N`` reach the pipeline estimate (memcalc.distributed.pipeline, whose arithmetic is
tests/test_pipeline.py and whose real gloo comparison is tests/test_gloo_pipeline.py); the options
are refused where they would be ignored, and a pipeline composed with another dimension is
refused by name."""

from __future__ import annotations

import pytest
import torch as _torch
from click.testing import CliRunner
from gloo_pipeline import BATCH, POSITIONS, pipeline_model
from gloo_runs import FEATURES

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.pipeline import Pipeline, estimate_pipeline
from memcalc.fields import build_step

#: memcalc drives torch.distributed.pipelining's internals as torch 2.13 has them; an older torch
#: is refused by name (test_an_older_torch_is_refused_by_name)
pytestmark = pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                reason="pipeline parallelism needs torch >= 2.13's pipelining")

_OPTIONS = dict(input_shape=(POSITIONS, FEATURES), optimizer="adam", loss="mean", gpu="cpu",
                loop=memcalc.Loop(optimizer_impl="foreach"))


def test_the_mesh_estimate_is_the_pipelines_per_rank() -> None:
    setting = memcalc.Distributed(pp=2, pp_schedule="gpipe", microbatches=4)
    report = memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)
    direct = estimate_pipeline(build_step(pipeline_model, batch_size=BATCH, **_OPTIONS),
                               Pipeline(2, "gpipe", microbatches=4))
    assert [role.peak_allocated for role in report.roles] == [rank.peak for rank in direct.ranks]
    assert report.strategy == "mesh" and report.world_size == 2 and report.global_batch_size == BATCH
    data = report.to_dict()
    assert data["mesh"]["pp"] == 2 and data["roles"][0]["sharding"] == [
        {"states": ["blocks"], "dimension": "pp", "degree": 2}]
    assert report.bytes.peak_allocated == max(rank.peak for rank in direct.ranks)  # the busiest rank's
    assert "pipeline: gpipe, 2 pipeline ranks, 4 microbatches, schedule from the installed torch" in report.notes


def test_the_default_schedule_is_1f1b_with_a_microbatch_per_rank() -> None:
    setting = memcalc.Distributed(pp=2)
    assert setting.pp_schedule is None and setting.microbatches is None
    report = memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)
    assert report.notes[-1] == "pipeline: 1f1b, 2 pipeline ranks, 2 microbatches, schedule from the installed torch"


def test_pipeline_options_are_checked_and_refused_where_ignored() -> None:
    assert memcalc.Distributed(pp=2, pp_schedule="Interleaved1F1B").pp_schedule == "interleaved-1f1b"
    assert memcalc.Distributed(pp=2, pp_split=["blocks.2"]).pp_split == ("blocks.2",)
    with pytest.raises(InvalidInputError, match="microbatches"):
        memcalc.Distributed(pp=2, microbatches=0)
    with pytest.raises(InvalidInputError, match="pp_schedule"):
        memcalc.Distributed(pp=2, pp_schedule="zigzag")
    with pytest.raises(InapplicableOptionError, match=r"microbatches \(--microbatches\) applies only"):
        memcalc.Distributed("fsdp", world_size=2, microbatches=4)


def test_a_pipeline_composed_with_another_dimension_is_refused_by_name() -> None:
    for degrees, match in ((dict(ep=2), "ep=2: .* has no expert-parallel plan"),
                           (dict(cp=2, ep=2), "pp=2 with cp=2 and ep=2 is not modelled yet")):
        setting = memcalc.Distributed(pp=2, dp_shard=2, **degrees)
        with pytest.raises(InapplicableOptionError, match=match):
            memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)
    setting = memcalc.Distributed(pp=2, dp_shard=2, pp_schedule="zbv-zero-bubble")
    with pytest.raises(InapplicableOptionError, match="zbv-zero-bubble schedule is not modelled yet"):
        memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)


@pytest.mark.parametrize("degrees, options, error, match", [
    (dict(cp=2, dp_replicate=2), {}, InapplicableOptionError,
     r"pp=2 with cp=2 and dp_replicate=2 is not modelled yet: memcalc composes context parallelism inside pipeline "
     r"stages with dp_shard or tp only"),
    (dict(cp=2), dict(pp_schedule="interleaved-zero-bubble"), InapplicableOptionError,
     r"pp=2 with cp=2 under the interleaved-zero-bubble schedule is not modelled yet: each stage is FSDP2"),
    (dict(cp=2), dict(pp_schedule="zbv-zero-bubble"), InapplicableOptionError,
     r"pp=2 with cp=2 under the zbv-zero-bubble schedule"),
    (dict(cp=2), {}, InvalidInputError, r"cp=2 splits the sequence over 2 ranks: give its length"),
], ids=["dp_replicate", "interleaved-zero-bubble", "zbv", "no-seq-len"])
def test_what_pp_x_cp_refuses_is_named_before_any_trace(degrees, options, error, match) -> None:
    # refused before the model is traced (a quick check; the composition itself: tests/test_gloo_pipeline_cp.py)
    setting = memcalc.Distributed(pp=2, **degrees, **options)
    with pytest.raises(error, match=match):
        memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)


# BlockNet(d=64, 4 blocks) on a 2 x 2 mesh, by hand: FSDP2 shards dim 0 into ceil(rows / 2).
# A block: LayerNorm 2 x 64 -> 2 x 32, fc1 (256, 64) -> (128, 64) = 8,192 and its bias 128,
# fc2 (64, 256) -> (32, 256) = 8,192 and its bias 32: 16,608 elements. The input layer
# (64, 64) + 64 -> 2,048 + 32 = 2,080; the head (9, 64) + 9 -> 5 x 64 + 5 = 325 (padded).
_BLOCK, _INPUT, _HEAD = 32 + 32 + 8_192 + 128 + 8_192 + 32, 2_048 + 32, 5 * 64 + 5
#: fp32 shard bytes of each stage: the input layer and blocks 0-1; blocks 2-3 and the head.
STAGE_SHARDS = (4 * (_INPUT + 2 * _BLOCK), 4 * (2 * _BLOCK + _HEAD))


def test_pp_with_dp_shard_shards_each_stage_by_hand() -> None:
    assert STAGE_SHARDS == (141_184, 134_164)
    setting = memcalc.Distributed(pp=2, dp_shard=2, pp_schedule="1f1b", microbatches=4)
    report = memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)
    assert report.world_size == 4 and report.global_batch_size == 2 * BATCH
    assert [role.ranks for role in report.roles] == [(0, 1), (2, 3)]  # pp outermost, as torchtitan's mesh
    # at the optimizer step: the shards of the parameters, their gradients and Adam's two moments
    assert [role.model_states for role in report.roles] == [4 * b for b in STAGE_SHARDS]
    assert [s.dimension for s in report.roles[0].sharding] == ["pp", "dp_shard"]
    assert any("reshard_after_forward=False" in note for note in report.notes)
    # a stage holds its unsharded parameters and gradients from its first forward to the end of its
    # last backward (no reshard after forward or backward, no reduce-scatter before the last): at
    # the peak (a backward) the whole stage's parameters beside the shards, its whole gradients,
    # Adam's two moments of the shards. Whole: a block 33,216 parameters; stage 0 adds the input
    # layer's 4,160; stage 1 the head's 585, all-gathered padded to 10 rows (650).
    whole = (4 * (4_160 + 2 * 33_216), 4 * (2 * 33_216 + 585))
    padded = (whole[0], whole[1] + 4 * 65)
    for role, params, gathered, shard in zip(report.roles, whole, padded, STAGE_SHARDS, strict=True):
        at_peak = role.report.bytes
        assert role.report.peak_phase.value == "backward"
        assert (at_peak.parameters, at_peak.gradients, at_peak.optimizer_state) == (gathered + shard, params, 2 * shard)


def test_pp_with_hsdp_stages_by_hand() -> None:
    # dp_replicate around each stage's dp_shard group (HSDP, torchtitan's 2-D fully_shard): a rank holds
    # what it holds under pp=2 x dp_shard=2 (the replicas' all-reduce is in place), runs a batch of its
    # own, and is numbered pp, dp_replicate, dp_shard from the outside in
    options = dict(batch_size=BATCH, **_OPTIONS)
    hsdp = memcalc.estimate(pipeline_model, distributed=memcalc.Distributed(pp=2, dp_replicate=2, dp_shard=2,
                                                                            microbatches=4), **options)
    fsdp = memcalc.estimate(pipeline_model, distributed=memcalc.Distributed(pp=2, dp_shard=2, microbatches=4),
                            **options)
    assert hsdp.world_size == 8 and hsdp.global_batch_size == 4 * BATCH
    assert [role.ranks for role in hsdp.roles] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [role.model_states for role in hsdp.roles] == [4 * b for b in STAGE_SHARDS]
    assert [r.report.peak_requested for r in hsdp.roles] == [r.report.peak_requested for r in fsdp.roles]
    assert [s.describe() for s in hsdp.roles[0].sharding] == [
        "blocks /2 (pp)", "params, grads, optimizer, batch /2 (dp_shard)", "batch /2 (dp_replicate)"]
    assert any(note.startswith("HSDP: 2 replicas") for note in hsdp.notes)


def test_pp_with_dp_replicate_alone_is_refused_by_name() -> None:
    # DDP stages: torch's PipelineStage runs them (no_sync until the last backward), torchtitan does not
    setting = memcalc.Distributed(pp=2, dp_replicate=2)
    with pytest.raises(InapplicableOptionError, match=r"pp=2 with dp_replicate=2 alone \(DDP stages\)"):
        memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)
    setting = memcalc.Distributed(pp=2, dp_replicate=2, dp_shard=2, bucket_cap_mb=50)
    with pytest.raises(InapplicableOptionError, match="bucket_cap_mb and gradient_as_bucket_view are DDP's"):
        memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)


@pytest.mark.slow  # a transformer's two pipeline ranks, each through 4 microbatches: about 30 s
def test_pp_with_dp_shard_under_amp_sends_in_the_param_dtype() -> None:
    """FSDP2's MixedPrecisionPolicy runs a stage in bf16 without autocast: what stage 0 sends, and
    stage 1's stand-ins of the model's inputs, are bf16 (they were float32: llama-3-8b's stage 1
    then failed, a float32 query beside a bf16 value, and llama-tiny's receive buffers were twice
    what they are)."""
    setting = memcalc.Distributed(pp=2, dp_shard=2, pp_schedule="1f1b", microbatches=4)
    report = memcalc.estimate("torch:llama-tiny", batch_size=4, seq_len=32, gpu="h100-80gb", precision="amp-bf16",
                              distributed=setting)
    alone = memcalc.estimate("torch:llama-tiny", batch_size=4, seq_len=32, gpu="h100-80gb", precision="amp-bf16",
                             distributed=memcalc.Distributed(pp=2, pp_schedule="1f1b", microbatches=4))
    assert [r.ranks for r in report.roles] == [(0, 1), (2, 3)]
    # the fp32 shards, their fp32 gradients and Adam's moments: half the pipeline alone's model
    # states (its fp32 master weights and their state) on an even split of every parameter
    for sharded, whole in zip(report.roles, alone.roles, strict=True):
        assert sharded.model_states == pytest.approx(whole.model_states / 2, rel=1e-3)
        # the receive buffers (activations and their gradients, per microbatch): bf16, where the
        # pipeline alone under autocast sends the float32 residual stream
        assert 2 * sharded.communication == whole.communication > 0


@pytest.mark.slow  # a transformer's two pipeline ranks, each through 4 microbatches: about 30 s
def test_cli_mesh_pp(golden) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(main, ["torch:llama-tiny", "--batch", "4", "--seq-len", "32", "--gpu", "cpu",
                                       "--mesh", "pp=2", "--pp-schedule", "gpipe", "--microbatches", "4"])
    assert result.exit_code == 0, result.output
    golden(result.output)


def test_cli_refuses_pipeline_flags_without_pp() -> None:
    result = CliRunner().invoke(main, ["mlp", "--strategy", "fsdp", "--world-size", "2", "--microbatches", "4"])
    assert result.exit_code == 2
    assert "--microbatches applies only" in result.output

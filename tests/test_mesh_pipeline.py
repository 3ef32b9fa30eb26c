"""``pp`` on the device mesh: ``Distributed(pp=N, pp_schedule=..., microbatches=...)`` and
``--mesh pp=N`` reach the pipeline estimate (memcalc.distributed.pipeline, whose arithmetic is
tests/test_pipeline.py and whose real gloo comparison is tests/test_gloo_pipeline.py); the options
are refused where they would be ignored, and a pipeline composed with another dimension is
refused by name."""

from __future__ import annotations

import pytest
import torch as _torch

#: memcalc drives torch.distributed.pipelining's internals as torch 2.13 has them; an older torch
#: is refused by name (test_an_older_torch_is_refused_by_name)
pytestmark = pytest.mark.skipif(tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 13),
                                reason="pipeline parallelism needs torch >= 2.13's pipelining")
from click.testing import CliRunner
from gloo_pipeline import BATCH, POSITIONS, pipeline_model
from gloo_runs import FEATURES

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.pipeline import Pipeline, estimate_pipeline
from memcalc.fields import build_step

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
    setting = memcalc.Distributed(pp=2, dp_shard=2)
    with pytest.raises(InapplicableOptionError, match="pp composed with dp_shard is not modelled yet"):
        memcalc.estimate(pipeline_model, batch_size=BATCH, distributed=setting, **_OPTIONS)


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

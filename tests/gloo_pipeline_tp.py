"""Real pipeline × tensor-parallel training steps over gloo on the CPU: four processes on a
``(pp=2, tp=2)`` device mesh, the small Llama of tests/gloo_tp.py split into two stages, each
stage parallelized by torch's own ``parallelize_module`` over the ``tp`` sub-mesh with
torchtitan's Llama plan and wrapped in a ``PipelineStage`` over the ``pp`` sub-mesh's group, as
torchtitan composes them; the reference for memcalc's pp × tp estimate
(tests/test_gloo_pipeline_tp.py).

The stages are cut as torchtitan cuts them: a copy of the model with the other stage's layers
deleted and, outside the first stage, no embedding (outside the last, no final norm and head);
``parallelize_module`` skips the plan entries of what is gone. The stage's forward is the zoo
Llama's, minus the missing modules (the rotary tables for the whole sequence on every stage).
Each rank is measured as tests/gloo_pipeline.py measures a stage: a warm-up step, then two
iterations of ``schedule.step``, ``Adam(foreach=True).step()``, ``zero_grad`` under the profiler.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from gloo_pipeline import cut_stage, measure_schedule
from gloo_runs import RankPeak, run_on_ranks
from gloo_tp import LLAMA_SEQ, SMALL_LLAMA, small_llama
from torch import nn

#: The pipeline's batch (split into MICROBATCHES) and the mesh.
BATCH = 8
MICROBATCHES = 4
PP, TP = 2, 2


@dataclass(frozen=True)
class PipelineTpCase:
    """One real run: torch's schedule class name ("GPipe", "1F1B"); ``dp_shard`` > 1: the 3-D
    mesh ``(pp, dp_shard, tp)``, each stage ``fully_shard``-ed over its dp_shard ranks after
    tensor parallelism (every layer and the stage's root, ``reshard_after_forward=False``, as
    torchtitan wraps a stage under a pipeline)."""

    name: str
    schedule: str
    dp_shard: int = 1


class LlamaStage(nn.Module):
    """One stage of the zoo Llama, cut as torchtitan cuts it (what the stage does not hold is None
    or deleted); its forward is the zoo's ``LlamaForCausalLM.forward`` without them."""

    def __init__(self, model: nn.Module, index: int, stages: int) -> None:
        super().__init__()
        self.model = cut_stage(model, index, stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        cos, sin = inner.rotary_emb(h, LLAMA_SEQ)
        for layer in inner.layers:
            h = layer(h, cos, sin, None)
        if inner.norm is not None:
            h = self.model.lm_head(inner.norm(h))
        return h


def run_cases(cases: Sequence[PipelineTpCase], work_dir: Path, *, timeout_s: float = 300.0,
              dp_shard: int = 1) -> dict[str, list[RankPeak]]:
    """Run ``cases`` (all of ``dp_shard``) on PP × dp_shard × TP spawned processes over gloo; each
    case's peaks, by global rank.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    world = PP * dp_shard * TP
    return run_on_ranks(_run_case, cases, work_dir, world, timeout_s, what="gloo pp x tp runs")


def _run_case(case: PipelineTpCase, _rank: int, _world_size: int) -> RankPeak:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor.parallel import parallelize_module

    from memcalc.distributed.tp_plans import resolve_plan

    torch.manual_seed(0)
    model = small_llama()
    mesh = init_device_mesh("cpu", (PP, case.dp_shard, TP), mesh_dim_names=("pp", "dp_shard", "tp"))
    index = mesh["pp"].get_local_rank()
    plan = resolve_plan(model, None, "small llama")  # torchtitan's Llama plan, on the whole model
    stage_module = LlamaStage(model, index, PP)
    with warnings.catch_warnings():  # the entries of what the stage does not hold: skipped, as in torchtitan
        warnings.simplefilter("ignore")
        parallelize_module(stage_module.model, mesh["tp"], dict(plan.styles))
    if case.dp_shard > 1:  # torchtitan's order: FSDP2 over the tensor-parallel DTensors
        from torch.distributed.fsdp import fully_shard

        for layer in stage_module.model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"], reshard_after_forward=False)
        fully_shard(stage_module, mesh=mesh["dp_shard"], reshard_after_forward=False)
    stage = PipelineStage(stage_module, index, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = get_schedule_class(case.schedule)(stage, MICROBATCHES, loss_fn=lambda out, _target: out.mean())
    x = torch.randint(0, SMALL_LLAMA.vocab_size, (BATCH, LLAMA_SEQ)) if index == 0 else None
    return measure_schedule(schedule, [stage], stage_module, x, last=index == PP - 1, batch=BATCH,
                            name=case.name)

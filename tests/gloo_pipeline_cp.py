"""Real pipeline × context-parallel training steps over gloo on the CPU: four processes on a
``(pp=2, cp=2)`` device mesh (eight on ``(pp=2, dp_shard=2, cp=2)``), the small Llama of
tests/gloo_tp.py split into two stages as tests/gloo_pipeline_tp.py cuts them, each stage
``fully_shard``-ed over torchtitan's ``dp_shard_cp`` ranks (every layer and the stage's root,
``reshard_after_forward=False``, torchtitan's default under a pipeline) and wrapped in a
``PipelineStage`` over the ``pp`` sub-mesh's group; the reference for memcalc's pp × cp estimate
(tests/test_gloo_pipeline_cp.py).

The sequence as tests/gloo_cp.py shards it: torch's own ``_context_parallel_buffers`` with its
head-tail load balancer gives the first stage's ranks their shard of the token ids (a tensor of its
own: the loaded full batch is not kept), and torch's own dispatcher
(``_enable_context_parallel_dispatcher_impl``, what torchtitan's ``context_parallel`` enters around
``schedule.step``) runs every stage's ``F.scaled_dot_product_attention`` as torch's ring over the cp
group, the CPU flash op added to its handlers (:func:`gloo_cp.cpu_ring_handler`). A stage's rotary
tables are made for its ``S/cp`` local positions (torchtitan shards ``freqs_cis`` with the inputs:
the same bytes). Each rank is measured as tests/gloo_pipeline.py measures a stage.

With ``tp`` (eight processes on ``(pp=2, cp=2, tp=2)``, torchtitan's 4-D order with dp_shard of one) each
stage is first parallelized by torch's own ``parallelize_module`` over the ``tp`` sub-mesh with torchtitan's
Llama plan, as tests/gloo_pipeline_tp.py does, then ``fully_shard``-ed over ``dp_shard_cp``: the ring sees
each tp rank's local heads, and under sequence parallelism a stage sends its ``(b, S/(cp·tp), d)`` local
shard. Every tp rank of a cp rank builds the same token ids (one seed), so they share the cp shard.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from gloo_cp import cpu_ring_handler
from gloo_pipeline import measure_schedule
from gloo_pipeline_tp import LlamaStage
from gloo_runs import RankPeak, run_on_ranks
from gloo_tp import LLAMA_SEQ, SMALL_LLAMA, small_llama
from torch import nn

from models_zoo.llama import LlamaForCausalLM

aten = torch.ops.aten

#: The pipeline's batch (split into MICROBATCHES) and the mesh.
BATCH = 8
MICROBATCHES = 4
PP, CP = 2, 2


#: The interleaved schedule's Llama: SMALL_LLAMA with 4 layers, one a stage (rank r holds stages r and r + PP).
DEEP_LLAMA = replace(SMALL_LLAMA, num_layers=4)


def deep_llama() -> nn.Module:
    return LlamaForCausalLM(DEEP_LLAMA)


@dataclass(frozen=True)
class PipelineCpCase:
    """One real run: torch's schedule class name ("GPipe", "1F1B", "Interleaved1F1B": two stages a rank,
    of :func:`deep_llama`, torch's loop placement); ``dp_shard`` > 1: the mesh ``(pp, dp_shard, cp)``,
    FSDP2 over the flattened ``(dp_shard, cp)`` (torchtitan's ``dp_shard_cp``); ``tp`` > 1: the mesh
    ``(pp, dp_shard, cp, tp)``, torchtitan's Llama plan on each stage before FSDP2 (module docstring)."""

    name: str
    schedule: str
    dp_shard: int = 1
    stages_per_rank: int = 1
    tp: int = 1


class LlamaCpStage(LlamaStage):
    """A stage whose rotary tables cover the rank's ``S/cp`` positions (module docstring; not ``h``'s
    length, which sequence parallelism splits again over tp)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        cos, sin = inner.rotary_emb(h, LLAMA_SEQ // CP)
        for layer in inner.layers:
            h = layer(h, cos, sin, None)
        if inner.norm is not None:
            h = self.model.lm_head(inner.norm(h))
        return h


def run_cases(cases: Sequence[PipelineCpCase], work_dir: Path, *, timeout_s: float = 300.0,
              dp_shard: int = 1, tp: int = 1) -> dict[str, list[RankPeak]]:
    """Run ``cases`` (all of ``dp_shard`` and ``tp``) on PP × dp_shard × CP × tp spawned processes over
    gloo; each case's peaks, by global rank (torchtitan's order: pp outermost, then dp_shard, cp, tp).

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    assert all(case.dp_shard == dp_shard and case.tp == tp for case in cases), "one mesh per spawn"
    world = PP * dp_shard * CP * tp
    return run_on_ranks(_run_case, cases, work_dir, world, timeout_s, what="gloo pp x cp runs")


def _run_case(case: PipelineCpCase, _rank: int, _world_size: int) -> RankPeak:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    torch.manual_seed(0)
    model = small_llama() if case.stages_per_rank == 1 else deep_llama()
    mesh = init_device_mesh("cpu", (PP, case.dp_shard, CP, case.tp), mesh_dim_names=("pp", "dp_shard", "cp", "tp"))
    rank = mesh["pp"].get_local_rank()
    total = PP * case.stages_per_rank
    indices = [rank + k * PP for k in range(case.stages_per_rank)]
    modules = [LlamaCpStage(model, index, total) for index in indices]
    if case.tp > 1:  # torchtitan's order: tp's plan on each stage, then FSDP2 over its DTensors
        from torch.distributed.tensor.parallel import parallelize_module

        from memcalc.distributed.tp_plans import resolve_plan

        plan = resolve_plan(model, None, "small llama")  # torchtitan's Llama plan, on the whole (uncut) model
        for stage_module in modules:
            with warnings.catch_warnings():  # the entries of what the stage does not hold: skipped, as in torchtitan
                warnings.simplefilter("ignore")
                parallelize_module(stage_module.model, mesh["tp"], dict(plan.styles))
    every = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    for stage_module in modules:
        for layer in stage_module.model.model.layers:
            fully_shard(layer, mesh=every, reshard_after_forward=False)
        fully_shard(stage_module, mesh=every, reshard_after_forward=False)
    group = mesh["pp"].get_group()
    stages = [PipelineStage(m, i, total, torch.device("cpu"), group=group)
              for m, i in zip(modules, indices, strict=True)]
    schedule = get_schedule_class(case.schedule)(stages[0] if case.stages_per_rank == 1 else stages, MICROBATCHES,
                                                 loss_fn=lambda out, _target: out.mean())

    cp_mesh = mesh["cp"]
    balancer = ring._create_default_load_balancer(LLAMA_SEQ, CP, torch.device("cpu"))
    x = None
    if 0 in indices:  # the first stage's shard of the token ids, a tensor of its own (module docstring)
        tokens = torch.randint(0, SMALL_LLAMA.vocab_size, (BATCH, LLAMA_SEQ))
        (shard,) = ring._context_parallel_buffers(cp_mesh, [tokens], [1], balancer)
        x = shard.clone()
        del tokens, shard
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = cpu_ring_handler
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = cpu_ring_handler
    ring._cp_options.enable_load_balance = balancer is not None
    ring._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=cp_mesh)
    try:
        return measure_schedule(schedule, stages, nn.ModuleList(modules), x, last=total - 1 in indices, batch=BATCH,
                                name=case.name)
    finally:
        ring._disable_context_parallel_dispatcher_impl()

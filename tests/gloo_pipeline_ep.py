"""Real pipeline × expert-parallel training steps over gloo on the CPU: four processes on a
``(pp=2, ep=2, tp=1)`` device mesh, the tiny Mixtral of tests/test_ep.py split into two stages,
each stage's experts sharded by transformers' ``apply_expert_parallelism`` (``AllToAllEP``) over the
``ep`` sub-mesh and the stage wrapped in a ``PipelineStage`` over the ``pp`` sub-mesh's group, as
torchtitan composes them for its MoE models (split first, then each stage's module parallelized);
the reference for memcalc's pp × ep estimate (tests/test_gloo_pipeline_ep.py).

The stages are cut as torchtitan cuts them: a copy of the model with the other stage's layers
deleted and, outside the first stage, no embedding (outside the last, no final norm and head). The
stage's forward is transformers' ``MixtralModel.forward`` written out without what is gone: the
position ids and rotary tables for the whole sequence on every stage, no mask (sdpa's causal path,
which transformers' ``create_causal_mask`` takes without padding); the last stage's head runs once it has
returned, as ``MixtralForCausalLM.forward`` runs it (the position ids freed before it). The routing is made balanced for
real (tests/gloo_ep.py's ``route``). Each rank is measured as tests/gloo_pipeline.py measures a
stage: a warm-up step, then two iterations of ``schedule.step``, the optimizer's step and
``zero_grad`` under the profiler.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from gloo_ep import route
from gloo_pipeline import cut_stage, measure_schedule
from gloo_runs import RankPeak, run_on_ranks
from torch import nn

#: The mesh.
PP, EP = 2, 2


@dataclass(frozen=True)
class PipelineEpCase:
    """One real run: torch's schedule class name ("GPipe", "1F1B"), the microbatches, the
    optimizer ("sgd" or "adam", torch's default implementation on the CPU: for-loop), the batch and
    sequence length of memcalc's ``estimate``."""

    name: str
    schedule: str
    microbatches: int
    optimizer: str
    batch: int
    seq_len: int
    #: > 1: the ``(pp, dp_shard, ep, tp=1)`` mesh, each stage FSDP2-wrapped as torchtitan wraps an MoE
    #: stage (reshard_after_forward=False): each layer's experts over dp_shard (its ``dp_shard_mod_ep``),
    #: every layer and the stage's root over dp_shard × ep (its ``dp_shard_cp``)
    dp_shard: int = 1
    #: > 1: the ``(pp, dp_shard=1, ep, tp)`` mesh, each stage's dense part under Mixtral's own tp plan
    #: (torch's ``parallelize_module`` on ``tp``) and its experts over the flattened ``ep × tp`` ranks with
    #: ``tp`` as the batch-sharing group (transformers' ``ep_size = fsdp_size × tp_size``, torchtitan's etp=1)
    tp: int = 1
    #: > 1: HSDP stages, the ``(pp, dp_replicate, dp_shard, ep, tp)`` mesh, the same units ``fully_shard``-ed
    #: over the 2-D ``(dp_replicate, dp_shard)`` and ``(dp_replicate, dp_shard × ep)`` meshes, as torchtitan
    #: wraps them (its ``(dp_replicate, dp_shard_mod_ep)`` and ``(dp_replicate, dp_shard_cp)``); without
    #: dp_shard the same with a dp_shard dimension of 1 (torchtitan's ep borrows its dp_shard:
    #: ``dp_shard_mod_ep`` = 1, and it wraps every MoE stage)
    dp_replicate: int = 1


class MixtralStage(nn.Module):
    """One stage of a transformers Mixtral, cut as torchtitan cuts it."""

    def __init__(self, model: nn.Module, index: int, stages: int) -> None:
        super().__init__()
        self.model = cut_stage(model, index, stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._model_forward(x)
        # MixtralForCausalLM's head, after MixtralModel.forward has returned (its position ids freed)
        return self.model.lm_head(h) if self.model.lm_head is not None else h

    def _model_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``MixtralModel.forward`` without what the stage lacks, final norm included."""
        inner = self.model.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
        return inner.norm(h) if inner.norm is not None else h


def run_cases(source: str, cases: list[PipelineEpCase], work_dir: Path, *, dp_shard: int = 1, tp: int = 1,
              dp_replicate: int = 1, timeout_s: float = 600.0) -> dict[str, list[RankPeak]]:
    """Run ``cases`` (all of ``dp_replicate``, ``dp_shard`` and ``tp``) on PP × dp_replicate × dp_shard × EP ×
    tp spawned processes over gloo; each case's peaks, by global rank (``(((pp_rank × dp_replicate +
    dp_replicate_rank) × dp_shard + dp_shard_rank) × EP + ep_rank) × tp + tp_rank``).

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    world = PP * dp_replicate * dp_shard * EP * tp
    return run_on_ranks(partial(_run_case, source), cases, work_dir, world, timeout_s,
                        what="gloo pp x ep runs")


def _run_case(source: str, case: PipelineEpCase, _rank: int, _world_size: int) -> RankPeak:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from memcalc.fields import build_step
    from memcalc.measure.step import _prepare, _resolve

    torch.manual_seed(0)
    step = build_step(source, gpu="cpu", batch_size=case.batch, seq_len=case.seq_len)
    resolved = _resolve(step)
    model, inputs, _keep = _prepare(resolved, torch.device("cpu"), step)
    mesh = init_device_mesh("cpu", (PP, case.dp_replicate, case.dp_shard, EP, case.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "ep", "tp"))
    index = mesh["pp"].get_local_rank()
    plan = model._expand_parallel_plan(dict(model.ep_plan))  # on the whole model
    from memcalc.distributed.tp_plans import resolve_plan, stage_plan

    # on the whole model, as memcalc; ep rules take precedence (transformers drops tp rules on ep modules)
    tp_plan = resolve_plan(model, None, resolved.name, expert_parallel=True) if case.tp > 1 else None
    stage_module = MixtralStage(model, index, PP)
    del model
    names = {name for name, _ in stage_module.model.named_modules()}
    names |= {name for name, _ in stage_module.model.named_parameters()}
    held = {name: style for name, style in plan.items() if name in names}  # the stage's layers' entries
    experts_mesh = mesh["ep"]
    if tp_plan is not None:  # the model's own tp plan on the stage's modules, then the experts over ep x tp
        from torch.distributed.tensor.parallel import parallelize_module

        styles = stage_plan(tp_plan, stage_module.model).styles
        parallelize_module(stage_module.model, mesh["tp"], dict(styles))
        experts_mesh = mesh["ep", "tp"]._flatten("ep_tp")
    apply_expert_parallelism(stage_module.model, experts_mesh, mesh["tp"], held, ep_implementation="all_to_all")
    assert route(stage_module) > 0
    if case.dp_shard > 1 or case.dp_replicate > 1:  # torchtitan's apply_fsdp for MoE under a pipeline
        # (PipelineEpCase.dp_shard; with dp_replicate alone its ep borrows its dp_shard: a dp_shard dimension of 1)
        from torch.distributed.fsdp import fully_shard

        every = mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
        experts_fsdp = mesh["dp_shard"]
        if case.dp_replicate > 1:  # HSDP (PipelineEpCase.dp_replicate)
            experts_fsdp, every = mesh["dp_replicate", "dp_shard"], mesh["dp_replicate", "dp_shard_ep"]
        modules = dict(stage_module.model.named_modules())
        for name, style in held.items():
            if style == "ep_dispatch_experts":
                fully_shard(modules[name], mesh=experts_fsdp, reshard_after_forward=False)
        for layer in stage_module.model.model.layers:
            fully_shard(layer, mesh=every, reshard_after_forward=False)
        fully_shard(stage_module, mesh=every, reshard_after_forward=False)
    stage = PipelineStage(stage_module, index, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = get_schedule_class(case.schedule)(stage, case.microbatches, loss_fn=lambda out, _target: out.mean())
    x = inputs.args[0] if inputs.args else inputs.kwargs["input_ids"]
    # the warm-up step also makes the routing patterns; Adam's step counters are left out
    adam = case.optimizer == "adam"
    return measure_schedule(schedule, [stage], stage_module, x if index == 0 else None, last=index == PP - 1,
                            batch=case.batch, name=case.name,
                            optimizer=partial(torch.optim.Adam if adam else torch.optim.SGD, lr=1e-3),
                            counters_per_parameter=4 if adam else 0)

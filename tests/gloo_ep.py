"""Real expert-parallel training steps on processes over gloo, each rank's peak read from the
profiler: the reference for memcalc's per-rank ``ep`` estimate on the CPU target
(tests/test_gloo_ep.py).

Each rank builds the same tiny transformers MoE model with real weights (memcalc's own
preparation of the step, :mod:`memcalc.measure.step`, as ``--measure`` runs it on the CPU), applies
transformers' ``apply_expert_parallelism`` with its ``AllToAllEP`` over a real gloo
``(ep, tp=1)`` device mesh — the code memcalc runs over its fake process group — and runs memcalc's
step (two iterations, the model's own loss, Adam) under ``torch.profiler``, repeated until the
trace is complete, as tests/gloo_runs.py measures DDP and FSDP2.

The routing is made what memcalc assumes, for real: a forward hook on every router overwrites its
top-k indices in place (no allocation; the pattern is made in the warm-up step) so that pair
``p = token · k + slot`` goes to expert ``p mod spread``. ``spread = E`` sends every expert exactly
its share when ``E`` divides ``tokens · k`` (a token's ``k`` experts distinct while ``k <= E``): the
balanced routing; ``spread = E/ep`` sends every pair of every rank to rank 0's experts (while
``k <= E/ep``): the worst case, for rank 0.

With ``dp_shard`` above 1 the run composes FSDP2 with expert parallelism as torchtitan does for its
MoE models (``torchtitan/models/llama4/infra/parallelize.py``, ``apply_fsdp``): a ``(dp_shard, ep,
tp=1)`` mesh; the experts split over ``ep`` by transformers' ``apply_expert_parallelism`` and each
block's experts module ``fully_shard``-ed over the ``dp_shard`` sub-mesh (torchtitan's
``dp_shard_mod_ep``: the ranks that hold the same experts), then every block and the root over all
``dp_shard × ep`` ranks (torchtitan's ``dp_shard_cp``): the same units as memcalc's. With
``dp_replicate`` above 1 too, HSDP: the same units ``fully_shard``-ed over the 2-D meshes
``(dp_replicate, dp_shard)`` and ``(dp_replicate, dp_shard × ep)``, as torchtitan wraps them; with
``dp_replicate`` and no ``dp_shard`` the same, dp_shard's mesh dimension of size 1 (torchtitan's
``dp_shard_mod_ep`` of 1: it wraps every MoE model with ep in FSDP2).

With ``tp`` above 1 (tp × ep, no dp_shard): a ``(ep, tp)`` mesh, the model's own tensor-parallel plan
applied by torch's ``parallelize_module`` on the ``tp`` sub-mesh (as tests/gloo_tp.py does), then the
experts split by ``apply_expert_parallelism`` over all ``ep × tp`` ranks (the flattened mesh) with the
``tp`` sub-mesh as its batch-sharing group: transformers' ``ep_size = fsdp_size × tp_size``,
torchtitan's ``etp=1``. Every rank builds the same batch (the same seed), so the ranks of one tp group
hold one batch, as they must.

With ``dp_shard`` and ``tp`` both (dp_shard × tp × ep): the tp plan and the experts as just said, then FSDP2 as
above: each block's experts over ``dp_shard`` (torchtitan's ``dp_shard_mod_ep``), the rest over the flattened
``(dp_shard, ep)`` (its ``dp_shard_cp``), torchtitan's etp=1 layout (``ParallelDims``: its ``ep`` mesh the
flattened ``(dp_shard_in_ep, tp)``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gloo_runs import RankPeak, measure_model_step, spawn_ranks
from torch import nn


def run_ep(source: str, kwargs: dict[str, Any], work_dir: Path, *, world_size: int = 2, spread: int | None = None,
           dp_shard: int = 1, dp_replicate: int = 1, tp: int = 1, timeout_s: float = 300.0) -> list[RankPeak]:
    """The step of ``memcalc.estimate(source, **kwargs)`` run for real on ``world_size`` ranks
    with the experts split over them, pairs routed to ``spread`` experts (None: all; module
    docstring); each rank's peak.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    spawn_ranks(_worker, world_size, (source, kwargs, spread, dp_shard, dp_replicate, tp, str(work_dir)), timeout_s)
    return [RankPeak(**json.loads((work_dir / f"ep-rank{rank}.json").read_text())) for rank in range(world_size)]


def _worker(rank: int, world_size: int, port: int, source: str, kwargs: dict[str, Any], spread: int | None,
            dp_shard: int, dp_replicate: int, tp: int, work_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = _run(source, kwargs, world_size, spread, dp_shard, dp_replicate, tp)
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"ep-rank{rank}.json").write_text(json.dumps(result.__dict__))


def route(model: nn.Module, spread: int | None = None) -> int:
    """Make every router of ``model`` send pair ``token · k + slot`` to expert ``(token · k + slot) mod
    spread`` (None: E; module docstring); returns the routers hooked."""
    hooked = 0
    for module in model.modules():
        top_k, experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
        if type(module).__name__.endswith("TopKRouter") and isinstance(top_k, int) and isinstance(experts, int):
            patterns: dict[tuple[int, ...], torch.Tensor] = {}  # made in the warm-up step, not the measured one

            def hook(_module: nn.Module, _args: Any, output: Any, experts: int = spread or experts,
                     patterns: dict[tuple[int, ...], torch.Tensor] = patterns) -> None:
                indices = output[-1]
                shape = tuple(indices.shape)
                if shape not in patterns:
                    patterns[shape] = torch.arange(indices.numel()).remainder_(experts).view(shape)
                # .data: topk's backward saved these indices; its version counter is left alone
                indices.data.copy_(patterns[shape])

            module.register_forward_hook(hook)
            hooked += 1
    return hooked


def _run(source: str, kwargs: dict[str, Any], world_size: int, spread: int | None, dp_shard: int,
         dp_replicate: int, tp: int = 1) -> RankPeak:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from memcalc.fields import build_step
    from memcalc.measure.step import _config, _prepare, _resolve

    torch.manual_seed(0)
    step = build_step(source, gpu="cpu", **kwargs)
    resolved = _resolve(step)
    module, inputs, _keep = _prepare(resolved, torch.device("cpu"), step)
    ep = world_size // (dp_replicate * dp_shard * tp)
    mesh = init_device_mesh("cpu", (dp_replicate, dp_shard, ep, tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "ep", "tp"))
    plan = module._expand_parallel_plan(dict(module.ep_plan))
    experts_mesh = mesh["ep"]
    if tp > 1:  # the model's own tp plan on tp, then the experts over ep x tp (module docstring)
        from torch.distributed.tensor.parallel import parallelize_module

        from memcalc.distributed.tp_plans import resolve_plan

        tp_plan = resolve_plan(module, None, resolved.name, expert_parallel=True)  # ep rules take precedence
        parallelize_module(module, mesh["tp"], dict(tp_plan.styles))
        experts_mesh = mesh["ep", "tp"]._flatten("ep_tp")
    apply_expert_parallelism(module, experts_mesh, mesh["tp"], plan, ep_implementation="all_to_all")
    if dp_shard > 1 or dp_replicate > 1:  # torchtitan's apply_fsdp for MoE (module docstring)
        from torch.distributed.fsdp import fully_shard

        every = mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
        experts_mesh = mesh["dp_shard"]
        if dp_replicate > 1:  # HSDP: torchtitan's 2-D (dp_replicate, dp_shard_mod_ep) and (dp_replicate, dp_shard_cp)
            experts_mesh, every = mesh["dp_replicate", "dp_shard"], mesh["dp_replicate", "dp_shard_ep"]
        modules = dict(module.named_modules())
        for name, style in plan.items():
            if style == "ep_dispatch_experts":
                fully_shard(modules[name], mesh=experts_mesh)
        for block in modules[resolved.block_containers[0]]:
            fully_shard(block, mesh=every)
        fully_shard(module, mesh=every)
    assert route(module, spread) > 0
    return measure_model_step(module, inputs, _config(resolved, step, torch.device("cpu")))

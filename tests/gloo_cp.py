"""Real context-parallel training steps (``cp``, with ``ep``, ``dp_shard``, ``dp_replicate`` and ``tp``) on processes
over gloo, each rank's peak read from the profiler: the reference for memcalc's per-rank cp and
ep × cp estimates on the CPU target (tests/test_gloo_cp.py).

Each rank builds the same tiny transformers MoE model with real weights (memcalc's own preparation of
the step, :mod:`memcalc.measure.step`), on torchtitan's mesh for MoE with cp (``ParallelDims``,
``_build_mesh_with_ep``): ``(dp_shard_mod_ep, dp_shard_in_ep, cp)``, which memcalc spells
``(dp_shard, ep, cp)``; torchtitan's ep is the flattened ``(dp_shard_in_ep, cp)``. The experts are
split over that ep by transformers' ``apply_expert_parallelism`` (its ``AllToAllEP``, as
tests/gloo_ep.py), each block's experts ``fully_shard``-ed over ``dp_shard_mod_ep`` and every block and
the root over the flattened ``(dp_shard_mod_ep, dp_shard_in_ep, cp)`` (torchtitan's ``dp_shard_cp``;
its ``apply_fsdp`` for MoE). Without ep, every block and the root over ``(dp_shard, cp)``. With
``dp_replicate`` (HSDP) the same units over the 2-D ``(dp_replicate, dp_shard_cp)`` and ``(dp_replicate,
dp_shard_mod_ep)`` meshes. With ``tp`` (innermost) the model's own tp plan first, by torch's
``parallelize_module`` on the tp sub-mesh (as tests/gloo_ep.py), and the experts over the flattened
``(ep, cp, tp)`` with tp as their batch-sharing group: torchtitan's rule ``ep = dp_shard_in_ep × cp × tp``
(its etp=1); every rank builds the same batch, so the tp ranks share one, as they must.

The sequence: torch's own ``_context_parallel_buffers`` shards the token ids and labels with its
head-tail load balancer (as ``context_parallel`` does before it resizes the buffers in place; here
each rank's shard is a tensor of its own, the loaded full batch not kept: memcalc does not model it),
then torch's own dispatcher (``_enable_context_parallel_dispatcher_impl``, what ``context_parallel``
enters) patches ``F.scaled_dot_product_attention`` for every step. The one addition: torch's handlers
cover the CUDA SDPA ops only, so the CPU flash op and its backward are added to ``custom_ops``
(:func:`cpu_ring_handler`), run by torch's own ``_templated_ring_attention`` and
``_templated_ring_attention_backward`` over the real gloo cp group, as its flash handler runs the
CUDA op. The routing is made balanced for real (tests/gloo_ep.py's ``route``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gloo_ep import route
from gloo_runs import RankPeak, measure_model_step, spawn_ranks

aten = torch.ops.aten


def run_cp(source: str, kwargs: dict[str, Any], work_dir: Path, *, cp: int, ep: int = 1, dp_shard: int = 1,
           dp_replicate: int = 1, tp: int = 1, timeout_s: float = 300.0) -> list[RankPeak]:
    """The step of ``memcalc.estimate(source, **kwargs)`` run for real on ``dp_replicate · dp_shard · ep ·
    cp · tp`` ranks (module docstring; tp innermost, then cp); each rank's peak.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    world = dp_replicate * dp_shard * ep * cp * tp
    spawn_ranks(_worker, world, (source, kwargs, (dp_replicate, dp_shard, ep, cp, tp), str(work_dir)), timeout_s)
    return [RankPeak(**json.loads((work_dir / f"cp-rank{rank}.json").read_text())) for rank in range(world)]


def _worker(rank: int, world_size: int, port: int, source: str, kwargs: dict[str, Any],
            degrees: tuple[int, int, int, int, int], work_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = _run(source, kwargs, *degrees)
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"cp-rank{rank}.json").write_text(json.dumps(result.__dict__))


def _cpu_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
               dropout_p: float = 0.0, scale: float | None = None, **_kwargs: Any) -> tuple[torch.Tensor, ...]:
    result: tuple[torch.Tensor, ...] = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale)
    return result


def _cpu_flash_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool = False, dropout_p: float = 0.0,
                        scale: float | None = None, **_kwargs: Any) -> tuple[torch.Tensor, ...]:
    result: tuple[torch.Tensor, ...] = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)
    return result


def cpu_ring_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """torch's ``_sdpa_handler`` for the CPU flash op and its backward: the local tensors through torch's
    ring (``_templated_ring_attention`` / ``_backward``, seq dim 2) over the cp mesh's group, every
    output sharded on the sequence like the inputs (``Shard(2)``, the CP sharding rule of the CUDA ops)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    tensors = [a for a in args if isinstance(a, DTensor)]
    mesh = tensors[0].device_mesh
    local = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
    cp = mesh.size()
    group = mesh.get_group()
    scale = kwargs.get("scale")
    if op_call == aten._scaled_dot_product_flash_attention_for_cpu.default:
        query, key, value, *rest = local
        dropout_p = rest[0] if rest else 0.0
        is_causal = rest[1] if len(rest) > 1 else False
        results = ring._templated_ring_attention(group, 2, _cpu_flash, query, key, value, is_causal=is_causal,
                                                 dropout_p=dropout_p, scale=scale)
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = local[:8]
        results = ring._templated_ring_attention_backward(
            group, 2, _cpu_flash_backward, grad_out, "grad_out", query, key, value, out, logsumexp,
            is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def spec(tensor: torch.Tensor) -> DTensorSpec:
        shape = list(tensor.shape)
        shape[2] *= cp
        return DTensorSpec(mesh, (Shard(2),), TensorMeta(torch.Size(shape), tensor.stride(), tensor.dtype))

    return DTensor._op_dispatcher.wrap(tuple(results), tuple(spec(t) for t in results))


def _run(source: str, kwargs: dict[str, Any], dp_replicate: int, dp_shard: int, ep: int, cp: int,
         tp: int) -> RankPeak:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    from memcalc.engine.model import ModelInputs
    from memcalc.fields import build_step
    from memcalc.measure.step import _config, _prepare, _resolve

    torch.manual_seed(0)
    step = build_step(source, gpu="cpu", **kwargs)
    resolved = _resolve(step)
    module, inputs, _keep = _prepare(resolved, torch.device("cpu"), step)
    mesh = init_device_mesh("cpu", (dp_replicate, dp_shard, ep, cp, tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "ep", "cp", "tp"))
    modules = dict(module.named_modules())
    mesh["dp_shard", "ep", "cp"]._flatten("dp_shard_cp")
    # HSDP: torchtitan's 2-D (dp_replicate, dp_shard_cp) and (dp_replicate, dp_shard_mod_ep) meshes
    every = mesh["dp_replicate", "dp_shard_cp"] if dp_replicate > 1 else mesh["dp_shard_cp"]
    experts_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    if tp > 1:  # the model's own tp plan on tp (ep rules first), as tests/gloo_ep.py
        from torch.distributed.tensor.parallel import parallelize_module

        from memcalc.distributed.tp_plans import resolve_plan

        tp_plan = resolve_plan(module, None, resolved.name, expert_parallel=ep > 1)
        parallelize_module(module, mesh["tp"], dict(tp_plan.styles))
    if ep > 1:  # the experts over torchtitan's ep = (dp_shard_in_ep, cp, tp) (etp=1), then its apply_fsdp for MoE
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        plan = module._expand_parallel_plan(dict(module.ep_plan))
        apply_expert_parallelism(module, mesh["ep", "cp", "tp"]._flatten("ep_cp_tp"), mesh["tp"], plan,
                                 ep_implementation="all_to_all")
        for name, style in plan.items():
            if style == "ep_dispatch_experts":
                fully_shard(modules[name], mesh=experts_mesh)
        assert route(module) > 0
    for block in modules[resolved.block_containers[0]]:
        fully_shard(block, mesh=every)
    fully_shard(module, mesh=every)

    # the sequence shards of torch's own load balancer, each a tensor of its own (module docstring)
    cp_mesh = mesh["cp"]
    tensors = [*inputs.args, *inputs.kwargs.values()]
    assert all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors), "token ids and labels: (B, S)"
    balancer = ring._create_default_load_balancer(int(tensors[0].shape[1]), cp, torch.device("cpu"))
    shards = [shard.clone() for shard in ring._context_parallel_buffers(cp_mesh, tensors, [1] * len(tensors),
                                                                          balancer)]
    inputs = ModelInputs(shards[:len(inputs.args)], dict(zip(inputs.kwargs, shards[len(inputs.args):], strict=True)))
    del tensors, shards

    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = cpu_ring_handler
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = cpu_ring_handler
    ring._cp_options.enable_load_balance = balancer is not None
    ring._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=cp_mesh)
    try:
        return measure_model_step(module, inputs, _config(resolved, step, torch.device("cpu")))
    finally:
        ring._disable_context_parallel_dispatcher_impl()


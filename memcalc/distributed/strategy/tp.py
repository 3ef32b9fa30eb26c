"""``tp``: tensor (and sequence) parallelism by torch's own ``parallelize_module`` over a fake
process group (:class:`~memcalc.distributed.tensor_parallel.TensorParallel`): each rank holds its
shards of the planned modules' parameters, gradients and optimizer state, the replicated rest
whole, and the buffers of DTensor's collectives. Checked to the byte against real two-process
gloo runs (tests/test_gloo_tp.py).

Every tp rank runs the same batch. Shards follow ``torch.chunk``: rank 0 holds the largest, so
it is traced; when a planned dimension (or the sequence, under sequence parallelism) does not
divide by the degree, the last rank holds less and is traced as a role of its own. The ranks
between hold at most rank 0's shards (``torch.chunk``'s sizes never grow) and are counted with it.

With another mesh dimension (FSDP2 over the tp sub-mesh's DTensors, torchtitan's 2-D
composition) tp is refused by name: that composition is not modelled yet, and tracing one of
them alone would be a silent wrong answer.
"""

from __future__ import annotations

from dataclasses import replace

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from memcalc.core.errors import InapplicableOptionError
from memcalc.core.report import Shard
from memcalc.distributed.strategy.base import MODEL_STATES, Plan, RankStrategy, Role, every_rank, register, sharding
from memcalc.distributed.tensor_parallel import tensor_parallel
from memcalc.distributed.tp_plans import planned_modules, resolve_plan
from memcalc.engine.optimizers import resolve_impl
from memcalc.engine.options import Step

__all__ = ("TensorParallelDimension",)


@register()
class TensorParallelDimension(RankStrategy):
    """Planned modules' parameters, gradients and optimizer state sharded over the tp ranks."""

    name = "tp"
    mesh_dimension = "tp"
    planned = False  # its activation collectives are not in plan's cost model yet
    options = frozenset({"tp_plan", "loss_parallel"})

    def plan(self, plan: Plan, step: Step) -> Plan:
        mesh = self.distributed.mesh
        others = sorted(set(mesh.used) - {"tp"}) if mesh is not None else []
        if others:
            listed = ", ".join(f"{name}={mesh.used[name]}" for name in others) if mesh is not None else ""
            raise InapplicableOptionError(
                f"tp={self.degree} with {listed} is not modelled yet: torchtitan's composition (FSDP2 fully_shard "
                f"over the tp sub-mesh's DTensor parameters) is not traced by memcalc, and tracing one dimension "
                f"alone would understate a rank",
                hint=f"Estimate tp={self.degree} alone (--mesh tp={self.degree}), or the data-parallel dimensions "
                     f"without tp.")
        plan = every_rank(plan, self.distributed)
        n = self.degree
        strings = dict(self.distributed.tp_plan) if self.distributed.tp_plan is not None else None
        loss_parallel = self.distributed.loss_parallel
        impl = resolve_impl(step.optimizer, step.loop.optimizer_impl, cuda=step.emulate_cuda)
        shard = Shard(MODEL_STATES, self.name, n)
        roles: list[Role] = []
        notes: list[str] = []
        for role in plan.roles:
            uneven = self._uneven(step, role.batch, strings, loss_parallel)
            traced = (0, n - 1) if uneven else (0,)
            for rank in traced:
                members = tuple(r for r in role.ranks if (r % n == n - 1) == (rank == n - 1)) if uneven else role.ranks
                name = role.name if not uneven else f"{role.name}, tp rank {rank}"
                roles.append(replace(role, name=name, ranks=members,
                                     program=tensor_parallel(n, strings, rank=rank, optimizer_impl=impl,
                                                             loss_parallel=loss_parallel),
                                     sharding=sharding(role.sharding, shard)))
            if uneven and n > 2:
                notes.append(f"an uneven tensor-parallel split: tp ranks 1 to {n - 2} hold at most rank 0's shards "
                             f"(torch.chunk) and are counted as rank 0")
        return replace(plan, roles=tuple(roles), notes=(*plan.notes, *notes))

    def _uneven(self, step: Step, batch: int, strings: dict[str, str] | None, loss_parallel: bool) -> bool:
        """Whether the ranks' shards differ in shape: a dimension a planned style shards that does
        not divide by the degree (conservatively: any parameter dimension of a planned module),
        or the sequence under a style that shards it."""
        resolved = step.resolved(batch_size=batch)
        module = resolved.module
        tp_plan = resolve_plan(module, strings, resolved.name, loss_parallel=loss_parallel)
        n = self.degree
        for m in planned_modules(module, tp_plan):
            for parameter in m.parameters(recurse=False):
                if any(size % n for size in parameter.shape[:2]):
                    return True
        sequence = any(isinstance(style, SequenceParallel)
                       or (isinstance(style, (ColwiseParallel, RowwiseParallel))
                           and any(getattr(layout, "dim", None) == 1
                                   for layout in (*_layouts(style, "input_layouts"),
                                                  *_layouts(style, "output_layouts"))))
                       for style in tp_plan.styles.values())
        if sequence:
            tensors = [t for t in resolved.inputs if hasattr(t, "shape") and len(t.shape) > 1]
            return any(t.shape[1] % n for t in tensors)
        return False


def _layouts(style: object, attribute: str) -> tuple[object, ...]:
    value = getattr(style, attribute, ())
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)

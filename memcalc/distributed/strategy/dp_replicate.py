"""``dp_replicate`` (``--strategy ddp``): ``DistributedDataParallel``, one process per GPU, each
with the whole model, its gradients and optimizer state, its share of the batch, and the
gradient buckets (:class:`~memcalc.distributed.ddp.DdpProgram`)."""

from __future__ import annotations

from dataclasses import replace

from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.precision import Precision
from memcalc.core.report import Shard
from memcalc.distributed.ddp import DdpProgram
from memcalc.distributed.program import RankProgram
from memcalc.distributed.strategy.base import Plan, RankStrategy, every_rank, register, sharding
from memcalc.distributed.vocabulary import Strategy
from memcalc.engine.model import ResolvedModel
from memcalc.engine.options import Step

__all__ = ("DpReplicate",)

_MIB = 1024 * 1024


@register(Strategy.DDP)
class DpReplicate(RankStrategy):
    """Every rank a replica; gradients all-reduced through DDP's buckets."""

    name = "dp_replicate"
    mesh_dimension = "dp_replicate"
    options = frozenset({"bucket_cap_mb", "gradient_as_bucket_view"})

    def plan(self, plan: Plan, step: Step) -> Plan:
        mesh = self.distributed.mesh
        if mesh is not None and mesh.dp_shard > 1:
            raise InapplicableOptionError(
                f"dp_replicate={mesh.dp_replicate} with dp_shard={mesh.dp_shard} (HSDP: FSDP2 on a 2-D mesh, "
                f"sharded within dp_shard, replicated across dp_replicate) is not modelled yet",
                hint="Estimate dp_shard alone (the parameters, gradients and optimizer state per rank are HSDP's; "
                     "its gradient all-reduce across the replicas is not counted), or dp_replicate alone (DDP).")
        plan = every_rank(plan, self.distributed)
        cap_mb = self.distributed.bucket_cap_mb
        view = self.distributed.gradient_as_bucket_view
        training = step.mode is Mode.TRAIN

        def ddp(_resolved: ResolvedModel) -> RankProgram:
            return DdpProgram(int(cap_mb * _MIB), view, training)

        batch = Shard(("batch",), self.name, self.degree)
        roles = tuple(replace(role, program=ddp, sharding=sharding(role.sharding, batch)) for role in plan.roles)
        note = (f"DDP gradient buckets of {cap_mb:g} MiB, gradient_as_bucket_view={view}"
                + ("" if view else ": the buckets are a second copy of the gradients"))
        return replace(plan, roles=roles, notes=(*plan.notes, note))

    def prepare(self, resolved: ResolvedModel, trace_precision: Precision) -> ResolvedModel:
        if not any(p.requires_grad for p in resolved.module.parameters()):
            # DistributedDataParallel.__init__ raises the same (_log_and_throw, RuntimeError)
            raise InapplicableOptionError(
                "DistributedDataParallel refuses a module none of whose parameters requires a gradient: "
                "nothing would train",
                hint="Freeze fewer parameters, or estimate the step on one GPU (leave out --strategy).")
        return resolved

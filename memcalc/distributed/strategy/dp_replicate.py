"""``dp_replicate`` (``--strategy ddp``): ``DistributedDataParallel``, one process per GPU, each
with the whole model, its gradients and optimizer state, its share of the batch, and the
gradient buckets (:class:`~memcalc.distributed.ddp.DdpProgram`). With ``dp_shard`` it is HSDP:
FSDP2 ``fully_shard`` on a 2-D mesh, sharded within ``dp_shard`` and replicated across
``dp_replicate`` (checked against a real 4-process gloo run, tests/test_gloo_runs.py).

With ``ep`` (and ``tp``) but no ``dp_shard`` it is HSDP too, as torchtitan runs that mesh: its ep borrows its
dp_shard (``dp_shard_mod_ep`` = 1) and it ``fully_shard``-s every MoE model with ep, so the dense part
is sharded over the ep ranks and each block's experts over a one-rank shard group, replicated across
``dp_replicate`` (:meth:`DpReplicate._moe_hsdp`; a real 4-process gloo run, tests/test_gloo_ep.py)."""

from __future__ import annotations

from dataclasses import replace

from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.precision import Precision
from memcalc.core.report import Shard
from memcalc.distributed.collectives import Collective, ModelFacts, group_span, ring_bytes
from memcalc.distributed.ddp import DdpProgram, trainer_finds_unused
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.program import RankProgram
from memcalc.distributed.strategy.base import Plan, RankStrategy, every_rank, register, sharding
from memcalc.distributed.strategy.dp_shard import fsdp_program, stacked
from memcalc.distributed.vocabulary import DEFAULT_BUCKET_CAP_MB, Strategy
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step

__all__ = ("DpReplicate",)

_MIB = 1024 * 1024


@register(Strategy.DDP)
class DpReplicate(RankStrategy):
    """Every rank a replica; gradients all-reduced through DDP's buckets."""

    name = "dp_replicate"
    mesh_dimension = "dp_replicate"
    options = frozenset({"bucket_cap_mb", "gradient_as_bucket_view"})

    @classmethod
    def collectives(cls, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
        """An all-reduce (reduce-scatter then all-gather: twice a ring's bytes) of the gradients
        every backward: DDP's whole gradients, or under HSDP each replica's shard of them (1 /
        dp_shard; under ep 1 / (dp_shard × ep × cp): FSDP2 shards the dense part over all three and
        the experts are split over ep × cp (× tp) before it), of a rank's tensor-parallel shard.
        memcalc's loops do not use ``no_sync``, so it runs every micro-batch; under a pipeline once
        per step, after the last microbatch: torch's ``PipelineStage`` turns an FSDP2 stage's
        gradient sync off until then (``set_requires_gradient_sync``), and HSDP's all-reduce runs
        with its reduce-scatter."""
        r, span = mesh.dp_replicate, group_span(mesh, "dp_replicate")
        if r == 1:
            return ()
        size = facts.trainable * facts.reduce_bytes / (mesh.dp_shard * mesh.tp * mesh.pp)
        if mesh.ep > 1:  # FSDP2 over dp_shard x cp x ep (the dense part) and the experts split over ep x cp (x tp)
            size /= mesh.ep * mesh.cp
        what = "all-reduce of gradients" + (" (HSDP: each replica's shard)" if mesh.dp_shard > 1 or mesh.ep > 1 else "")
        if mesh.pp > 1:
            return (Collective(cls.name, what + " (after the last microbatch)", 2 * ring_bytes(size, r), span),)
        return (Collective(cls.name, what, 2 * ring_bytes(size, r) * micro_batches, span, micro_batches),)

    def plan(self, plan: Plan, step: Step) -> Plan:
        mesh = self.distributed.mesh
        # HSDP around FSDP2 over tensor or expert parallelism (tp's and ep's own checks refuse them
        # without dp_shard)
        composes = {"dp_replicate", "dp_shard", "tp", "ep"} | ({"cp"} if mesh is not None and mesh.ep > 1 else set())
        others = sorted(set(mesh.used) - composes) if mesh is not None else []
        if others:
            raise InapplicableOptionError(
                f"dp_replicate={self.degree} with {', '.join(others)} is not modelled yet",
                hint="Estimate the mesh without dp_replicate (the per-rank memory of dp_shard with the others).")
        plan = every_rank(plan, self.distributed)
        batch = Shard(("batch",), self.name, self.degree)
        if mesh is not None and (mesh.dp_shard > 1 or (mesh.ep > 1 and mesh.cp > 1)):
            return self._hsdp(plan, batch)  # under ep x cp, ep's program holds FSDP2 over dp_shard x ep x cp
        if self._moe_fsdp:
            return self._moe_hsdp(plan, batch, step)
        cap_mb = self.distributed.bucket_cap_mb
        view = self.distributed.gradient_as_bucket_view
        training = step.mode is Mode.TRAIN

        trainer = step.loop.preset is not None and step.loop.preset.is_trainer  # the Trainer's DDP kwargs (TRL's too)

        def ddp(resolved: ResolvedModel) -> RankProgram:
            finds_unused = trainer and trainer_finds_unused(resolved.trained_model, step)
            return DdpProgram(int(cap_mb * _MIB), view, training, find_unused_parameters=finds_unused,
                              wrapped=resolved.trained_root)

        roles = tuple(replace(role, program=ddp, sharding=sharding(role.sharding, batch)) for role in plan.roles)
        note = (f"DDP gradient buckets of {cap_mb:g} MiB, gradient_as_bucket_view={view}"
                + ("" if view else ": the buckets are a second copy of the gradients"))
        return replace(plan, roles=roles, notes=(*plan.notes, note))

    @property
    def _moe_fsdp(self) -> bool:
        """Whether this is ep's HSDP without dp_shard or cp (the module docstring), whose FSDP2 program
        this strategy adds itself (under ep x cp, ep's program holds it: torchtitan's FSDP2 is on with cp)."""
        mesh = self.distributed.mesh
        return mesh is not None and mesh.ep > 1 and mesh.dp_shard == 1 and mesh.cp == 1

    def trace_precision(self, precision: Precision) -> Precision:
        """FSDP2's mixed precision under ep's HSDP (as dp_shard's); DDP's autocast otherwise."""
        return Precision.FP32 if self._moe_fsdp and precision.is_amp else precision

    def _moe_hsdp(self, plan: Plan, batch: Shard, step: Step) -> Plan:
        """HSDP around expert parallelism without dp_shard, as torchtitan runs ``--mesh
        dp_replicate=R,ep=E`` (its ``dp_replicate=R, dp_shard=E, ep=E``: ``dp_shard_mod_ep`` is 1,
        and ``apply_fsdp`` wraps MoE models whenever ep is on): FSDP2 over the ``E`` ep ranks for
        every block and the root (``(dp_replicate, dp_shard_cp)``), each block's experts over a
        one-rank shard group (``(dp_replicate, dp_shard_mod_ep)``), stacked on ep's program; the
        replicas' all-reduce in place (:meth:`_hsdp`)."""
        self._refuse_bucket_options()
        mesh = self.distributed.mesh
        ep, tp = (mesh.ep, mesh.tp) if mesh is not None else (1, 1)
        # under tp x ep (etp=1) the experts are split over ep x tp ranks before FSDP2
        fsdp, notes = fsdp_program(self.distributed.sharding, step, ep, experts_degree=1, ep=ep, owners=ep * tp)
        assert all(role.program is not None for role in plan.roles), "ep applies before dp_replicate"
        roles = tuple(replace(role, program=stacked(role.program, fsdp), sharding=sharding(role.sharding, batch))
                      for role in plan.roles if role.program is not None)
        note = (f"HSDP around expert parallelism, as torchtitan runs it without dp_shard (its ep borrows its "
                f"dp_shard: dp_shard_mod_ep = 1): every block and the root FSDP2-sharded over the {ep} ep ranks "
                f"(torchtitan's (dp_replicate, dp_shard_cp) mesh), each block's experts over a one-rank shard "
                f"group (its (dp_replicate, dp_shard_mod_ep) mesh: no collective); {self.degree} replicas, each "
                f"unit's sharded gradients all-reduced across them in place")
        return replace(plan, roles=roles, notes=(*plan.notes, note, *notes))

    def _refuse_bucket_options(self) -> None:
        if self.distributed.bucket_cap_mb != DEFAULT_BUCKET_CAP_MB or self.distributed.gradient_as_bucket_view:
            raise InapplicableOptionError(
                "bucket_cap_mb and gradient_as_bucket_view are DDP's; under HSDP (dp_replicate with dp_shard, or "
                "with ep) FSDP2 all-reduces its own reduce-scatter outputs and would ignore them",
                hint="Leave them out (--bucket-cap-mb, --gradient-as-bucket-view).")

    def _hsdp(self, plan: Plan, batch: Shard) -> Plan:
        """HSDP: FSDP2 on a 2-D mesh, which dp_shard's program already runs over its dp_shard
        ranks (under ep x cp, ep's over dp_shard x ep x cp, with or without dp_shard). The replicas
        all-reduce each unit's reduce-scatter output in place (``foreach_reduce``:
        ``dist.all_reduce(reduce_output, group=all_reduce_group)``), and the buffer FSDP2 holds across
        units for it (``_all_reduce_state``) is that output, whose views are the sharded gradients:
        no memory of its own on a rank."""
        self._refuse_bucket_options()
        assert all(role.program is not None for role in plan.roles), "dp_shard applies before dp_replicate"
        roles = tuple(replace(role, sharding=sharding(role.sharding, batch)) for role in plan.roles)
        mesh = self.distributed.mesh
        group = "dp_shard x ep x cp" if mesh is not None and mesh.ep > 1 and mesh.cp > 1 else "dp_shard"
        note = (f"HSDP: {self.degree} replicas of the {group} group; each unit's sharded gradients are all-reduced "
                f"across them in place")
        return replace(plan, roles=roles, notes=(*plan.notes, note))

    def prepare(self, resolved: ResolvedModel, trace_precision: Precision) -> ResolvedModel:
        if not any(p.requires_grad for p in resolved.module.parameters()):
            # DistributedDataParallel.__init__ raises the same (_log_and_throw, RuntimeError)
            raise InapplicableOptionError(
                "DistributedDataParallel refuses a module none of whose parameters requires a gradient: "
                "nothing would train",
                hint="Freeze fewer parameters, or estimate the step on one GPU (leave out --strategy).")
        return resolved

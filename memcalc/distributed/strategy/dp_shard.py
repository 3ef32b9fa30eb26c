"""``dp_shard`` (``--strategy fsdp``): FSDP2 ``fully_shard`` on every block and on the root
(:class:`~memcalc.distributed.fsdp.ShardedProgram`; under the Trainer's loop and TRL's, and any loop an
accelerate config launches (:attr:`~memcalc.engine.step_spec.Step.accelerate_prepared`), the units accelerate's
``fsdp2_prepare_model`` makes: :mod:`memcalc.distributed.accelerate_fsdp`): each rank holds 1/N of the parameters,
gradients and optimizer state, plus the all-gather and reduce-scatter buffers of the units in
flight. Under ``amp-bf16`` / ``amp-fp16`` it is ``MixedPrecisionPolicy(param_dtype=16-bit,
reduce_dtype=float32)`` (torchtitan's): the gathered parameters are 16-bit and the model computes in them
without autocast; under the Trainer's loop and TRL's, and an accelerate config's, accelerate's (``reduce_dtype``
16-bit too, the trainable parameters float32 masters, no autocast: docs/many-gpus.md, "The Trainer's loop"). After
tensor parallelism (``--mesh dp_shard=N,tp=M``) its program is stacked on tp's: FSDP2 shards each rank's
local DTensor shard, as torchtitan's ``fully_shard`` over the dp_shard sub-mesh does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.finetune import FineTune
from memcalc.core.precision import Precision
from memcalc.core.report import Shard
from memcalc.distributed.accelerate_fsdp import accelerate_units
from memcalc.distributed.collectives import Collective, ModelFacts, group_span, ring_bytes
from memcalc.distributed.fsdp import ShardedProgram, fsdp_units
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.program import RankProgram, StackedProgram
from memcalc.distributed.strategy.base import MODEL_STATES, Plan, RankStrategy, every_rank, register, sharding
from memcalc.distributed.vocabulary import FsdpSharding, Strategy
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step

__all__ = ("DpShard", "fsdp_collectives", "fsdp_program", "stacked")


@register(Strategy.FSDP)
class DpShard(RankStrategy):
    """Parameters, gradients and optimizer state sharded over the ranks (FSDP2)."""

    name = "dp_shard"
    mesh_dimension = "dp_shard"
    options = frozenset({"sharding"})

    @classmethod
    def collectives(cls, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
        """FULL_SHARD, per micro-batch (FSDP2 reshards after forward and reduce-scatters every
        backward unless told not to): the parameters all-gathered in the forward and again in the
        backward, the gradients reduce-scattered. A rank gathers its own tensor-parallel shard of
        its own stage's parameters (1 / (tp × pp) of them); under a pipeline once per step
        (``reshard_after_forward=False``, gradients reduced after the last microbatch). With
        ``cp`` the group is ``dp_shard × cp`` (torchtitan's dp_shard_cp mesh: FSDP2 over both)."""
        return fsdp_collectives(cls.name, mesh, facts, micro_batches)

    def trace_precision(self, precision: Precision) -> Precision:
        """FSDP's mixed precision keeps the model's parameters (and inputs, buffers) as they are and
        casts what it gathers (and the root's inputs): the program does that, without autocast."""
        return Precision.FP32 if precision.is_amp else precision

    def refuse_finetune(self, finetune: FineTune) -> None:
        if finetune.quant is None:
            return
        raise InapplicableOptionError(
            f"--quant {finetune.quant.value} is not estimated under --strategy fsdp: sharding a bitsandbytes base "
            f"needs bnb_4bit_quant_storage (the packed weights stored in a float dtype so that fully_shard can split "
            f"them, the quantization statistics left whole), which memcalc does not model",
            hint="Use --strategy ddp for QLoRA on several GPUs, or leave out --quant (FSDP with --lora or --freeze "
                 "is estimated).")

    def plan(self, plan: Plan, step: Step) -> Plan:
        plan = every_rank(plan, self.distributed)
        shard = Shard((*MODEL_STATES, "batch"), self.name, self.degree)
        mesh = self.distributed.mesh
        if mesh is not None and mesh.cp > 1:
            # cp applied first and wrapped FSDP2 over dp_shard x cp itself (torchtitan's dp_shard_cp mesh)
            roles = tuple(replace(role, sharding=sharding(role.sharding, shard)) for role in plan.roles)
            return replace(plan, roles=roles)
        ep = 1 if mesh is None else mesh.ep
        # under tp x ep the experts go over ep x tp ranks (etp=1): each holds 1/(ep·tp) of them
        owners = ep * (mesh.tp if mesh is not None and ep > 1 else 1)
        fsdp, notes = fsdp_program(self.distributed.sharding, step, self.degree * ep,
                                   experts_degree=self.degree if ep > 1 else None, ep=ep, owners=owners)
        roles = tuple(replace(role, program=fsdp if role.program is None else stacked(role.program, fsdp),
                              sharding=sharding(role.sharding, shard)) for role in plan.roles)
        if any(role.program is not None for role in plan.roles):
            shards = "expert-parallel" if ep > 1 else "tensor-parallel"
            notes[0] += f" of each rank's {shards} DTensor shards (dim 0 of the local shard)"
        return replace(plan, roles=roles, notes=(*plan.notes, *notes))


def fsdp_collectives(name: str, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
    """FSDP2's collectives over ``dp_shard × cp`` ranks (:meth:`DpShard.collectives`), named
    ``name`` (the dimension that wraps FSDP2: cp's file does without dp_shard)."""
    n, span = mesh.dp_shard * mesh.cp, group_span(mesh, "dp_shard")  # dp_shard's span counts the inner cp
    if mesh.ep > 1 and facts.expert_parameters:
        return _moe_fsdp_collectives(name, mesh, facts, micro_batches)
    if n == 1:
        return ()
    owned = mesh.tp * mesh.pp
    gather = ring_bytes(facts.parameters * facts.gather_bytes / owned, n)
    reduce = ring_bytes(facts.trainable * facts.reduce_bytes / owned, n)
    if mesh.pp > 1:
        return (Collective(name, "all-gather of parameters (once: kept over the microbatches)", gather, span),
                Collective(name, "reduce-scatter of gradients (after the last microbatch)", reduce, span))
    return (Collective(name, "all-gather of parameters (forward and backward)",
                       2 * gather * micro_batches, span, 2 * micro_batches),
            Collective(name, "reduce-scatter of gradients", reduce * micro_batches, span, micro_batches))


def _moe_fsdp_collectives(name: str, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
    """FSDP2 as torchtitan shards a mixture of experts under ep (:func:`fsdp_program` with
    ``experts_degree``): the dense parameters over ``dp_shard × cp × ep`` (its ``dp_shard_cp``
    mesh), each block's experts — a rank's ``1 / (ep × cp × tp)`` of them — over the ``dp_shard``
    ranks that hold the same experts (``dp_shard_mod_ep``: none with dp_shard = 1). The group spans
    the ``dp_shard × cp × ep × tp`` consecutive GPUs either way (the experts' every ``cp × ep × tp``-th)."""
    span, pp = group_span(mesh, "dp_shard"), mesh.pp
    dense_n, experts_n = mesh.dp_shard * mesh.cp * mesh.ep, mesh.dp_shard
    owners = mesh.ep * mesh.cp * mesh.tp
    dense_gather = ring_bytes((facts.parameters - facts.expert_parameters) * facts.gather_bytes / (mesh.tp * pp),
                              dense_n)
    dense_reduce = ring_bytes((facts.trainable - facts.expert_trainable) * facts.reduce_bytes / (mesh.tp * pp),
                              dense_n)
    gather = ring_bytes(facts.expert_parameters * facts.gather_bytes / (owners * pp), experts_n)
    reduce = ring_bytes(facts.expert_trainable * facts.reduce_bytes / (owners * pp), experts_n)
    if pp > 1:
        out = [Collective(name, "all-gather of parameters (dense; once: kept over the microbatches)", dense_gather,
                          span),
               Collective(name, "reduce-scatter of gradients (dense; after the last microbatch)", dense_reduce, span)]
        if experts_n > 1:
            out += [Collective(name, "all-gather of experts (once: kept over the microbatches)", gather, span),
                    Collective(name, "reduce-scatter of experts' gradients (after the last microbatch)", reduce, span)]
        return tuple(out)
    out = [Collective(name, "all-gather of parameters (dense; forward and backward)", 2 * dense_gather * micro_batches,
                      span, 2 * micro_batches),
           Collective(name, "reduce-scatter of gradients (dense)", dense_reduce * micro_batches, span, micro_batches)]
    if experts_n > 1:
        out += [Collective(name, "all-gather of experts (forward and backward)", 2 * gather * micro_batches, span,
                           2 * micro_batches),
                Collective(name, "reduce-scatter of experts' gradients", reduce * micro_batches, span, micro_batches)]
    return tuple(out)


def fsdp_program(sharding_: FsdpSharding, step: Step, n: int, pipelined: bool = False,
                 experts_degree: int | None = None, ep: int = 1,
                 experts: Callable[[ResolvedModel], list[str]] | None = None, owners: int | None = None,
                 ) -> tuple[Callable[[ResolvedModel], RankProgram], list[str]]:
    """The FSDP2 program over ``n`` ranks (a builder per role's model) and its notes: dp_shard's,
    and context parallelism's, which shards the parameters over dp_shard x cp as torchtitan does.
    ``pipelined``: each pipeline stage's, as torchtitan wraps it (``reshard_after_forward=False``,
    its default under a pipeline) and torch's ``PipelineStage`` runs it (gradients accumulated
    unsharded over the microbatches, synced once at the end). ``experts_degree``: under expert
    parallelism (``ep`` ways), each block's experts module a unit of its own sharded over that many
    ranks (torchtitan's ``apply_fsdp`` for MoE: ``fully_shard(experts, mesh=dp_shard_mod_ep)``);
    ``experts``: the paths of those modules in a role's model (None: from the model's own plan; a
    pipeline stage's come from the plan resolved on the whole model); ``owners``: the ranks the
    experts are split over before FSDP2 (None: ``ep``; ``ep × tp`` under etp=1)."""
    precision = step.precision
    mixed = precision.is_amp
    low = precision.compute_dtype
    reshard = sharding_ is FsdpSharding.FULL_SHARD and not pipelined
    training = step.mode is Mode.TRAIN
    cpu = not step.emulate_cuda
    shape = (f" of each pipeline stage over {n} ranks, reshard_after_forward=False (torchtitan's default under "
             f"pp): its unsharded parameters and gradients kept over the microbatches, reduce-scattered after the "
             f"last" if pipelined else f" {sharding_.value.upper()} over {n} ranks")
    # the Trainer's loop, its own or a TRL trainer's, or any loop an accelerate config launches: the trained
    # model sharded by accelerate's fsdp2_prepare_model (a TRL reference by prepare_fsdp, on its root alone)
    trainer = step.loop.preset is not None and step.loop.preset.is_trainer
    accelerate = (trainer or step.accelerate_prepared) and experts_degree is None and not pipelined
    # accelerate's FSDP plugin reduces in the 16-bit dtype too (FullyShardedDataParallelPlugin.set_mixed_precision)
    reduce = (low if accelerate else torch.float32) if mixed else None
    notes = [f"FSDP2{shape}" + (_policy_note(low, reduce, accelerate) if reduce is not None else "")]
    if precision is Precision.AMP_FP16:
        notes.append("fp16 under FSDP needs ShardedGradScaler; its (small) buffers are not modelled")
    if accelerate:
        whose = "the Trainer" if trainer else "accelerator.prepare"
        notes.append(f"FSDP2 units as accelerate's fsdp2_prepare_model makes them for {whose}: each layer, "
                     f"the input embeddings (untied), the final norm with the head (reshard_after_forward=False), "
                     f"where the model has them, the root")

    def fsdp(resolved: ResolvedModel) -> RankProgram:
        inner = (None if experts_degree is None
                 else _experts_units(resolved, experts_degree, ep, experts, owners or ep))
        if accelerate:
            units = accelerate_units(resolved.module, resolved.block_containers, resolved.separate_models,
                                     resolved.trained_root)
        else:
            units = fsdp_units(resolved.module, resolved.block_containers, resolved.separate_models,
                               resolved.trained_root, inner)
        return ShardedProgram(units, n, style="fsdp2", reshard_after_forward=reshard,
                              sharded_dtype=torch.float32 if mixed else None,
                              gather_dtype=low if mixed else None,
                              reduce_dtype=reduce, training=training, cpu=cpu,
                              accumulate=pipelined)

    return fsdp, notes


def _policy_note(low: torch.dtype, reduce: torch.dtype, accelerate: bool) -> str:
    """The note on FSDP2's mixed precision: torchtitan's policy (a float32 reduce), or accelerate's."""
    policy = f"; MixedPrecisionPolicy(param_dtype={_dtype(low)}, reduce_dtype={_dtype(reduce)})"
    if not accelerate:
        return f"{policy}: the model computes in {_dtype(low)} without autocast"
    return (f"{policy}, as accelerate's FSDP plugin sets it from the mixed precision: the trainable parameters "
            f"upcast to float32 masters (fsdp2_prepare_model), the model computing in {_dtype(low)} without "
            f"autocast (accelerate's FSDP2 prepare wraps no forward in it)")


def _experts_units(resolved: ResolvedModel, degree: int, ep: int,
                   experts: Callable[[ResolvedModel], list[str]] | None = None, owners: int | None = None,
                   ) -> dict[str, int]:
    """Each expert-parallel experts module of ``resolved`` sharded over ``degree`` ranks, the
    experts split over ``owners`` ranks before (None: ``ep``).

    Raises:
        InapplicableOptionError: more ranks than local experts: torchtitan then shards the
            experts on dim 1 (``_experts_shard_placement_fn``), which memcalc does not model.
    """
    from memcalc.distributed.expert_parallel import expert_modules

    paths = expert_modules(resolved.module, ep, resolved.name) if experts is None else experts(resolved)
    split = owners or ep
    ranks = f"ep={ep}" if split == ep else f"ep x tp = {split} ranks"
    for path in paths:
        count = getattr(resolved.module.get_submodule(path), "num_experts", None)
        if isinstance(count, int) and degree > count // split:
            raise InapplicableOptionError(
                f"dp_shard={degree} with {ranks}: each ep rank holds {count // split} experts of {path}, fewer than "
                f"the dp_shard ranks, and torchtitan then shards them on dim 1 (Shard(1)), which memcalc does not "
                f"model",
                hint=f"Give a dp_shard of at most {count // split} with {ranks}, or a larger ep.")
    return {path: degree for path in paths}


def stacked(inner: Callable[[ResolvedModel], RankProgram],
             fsdp: Callable[[ResolvedModel], RankProgram]) -> Callable[[ResolvedModel], RankProgram]:
    """FSDP2 over the program a dimension before it gave the role (tensor parallelism's
    ``parallelize_module``), as torchtitan applies ``fully_shard`` after it."""

    def program(resolved: ResolvedModel) -> RankProgram:
        return StackedProgram(inner(resolved), fsdp(resolved))

    return program


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

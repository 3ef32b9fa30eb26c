"""``tp``: tensor (and sequence) parallelism by torch's own ``parallelize_module`` over a fake
process group (:class:`~memcalc.distributed.tensor_parallel.TensorParallel`): each rank holds its
shards of the planned modules' parameters, gradients and optimizer state, the replicated rest
whole, and the buffers of DTensor's collectives. Checked to the byte against real two-process
gloo runs (tests/test_gloo_tp.py).

Every tp rank runs the same batch. Shards follow ``torch.chunk``: rank 0 holds the largest, so
it is traced; when a planned dimension (or the sequence, under sequence parallelism) does not
divide by the degree, the last rank holds less and is traced as a role of its own. The ranks
between hold at most rank 0's shards (``torch.chunk``'s sizes never grow) and are counted with it.

With ``dp_shard`` (and HSDP's ``dp_replicate`` around it) tp composes as torchtitan composes it:
``parallelize_module`` on the tp sub-mesh, then FSDP2 over the dp_shard sub-mesh of the resulting
DTensor parameters (:class:`~memcalc.distributed.program.StackedProgram`; dp_shard's file stacks
its program on this one): FSDP2 shards each rank's local tp shard on dim 0 and all-gathers it
back, so a rank holds 1/(dp_shard·tp) of the planned parameters. Checked against real 4-process
gloo runs on a 2×2 mesh (tests/test_gloo_fsdp_tp.py). Inside pipeline stages (``pp``, which runs
the whole step) the pipeline applies it (:mod:`memcalc.distributed.tp_stages`). With ``cp`` the
ring goes around this program and FSDP2 over dp_shard × cp (cp's file). With ep (alone) ep's
program runs this plan on its tp sub-mesh (tp × ep, ep's file), and with dp_shard too FSDP2 over
that (dp_shard × tp × ep, torchtitan's etp=1 MoE layout; HSDP around it); with ep × cp (and one of
dp_shard or dp_replicate, or neither) the experts go over ep × cp × tp ranks and the ring around it all. With
dp_replicate alone tp is refused by name: tracing one dimension alone would understate a rank.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.core.errors import InapplicableOptionError
from memcalc.core.report import Shard
from memcalc.distributed.collectives import Collective, ModelFacts, group_span, ring_bytes
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.strategy.base import MODEL_STATES, Plan, RankStrategy, Role, every_rank, register, sharding
from memcalc.distributed.tensor_parallel import tensor_parallel
from memcalc.distributed.tp_plans import planned_modules, resolve_plan
from memcalc.distributed.tp_traffic import Kind, Transfer
from memcalc.engine.optimizers import resolve_impl
from memcalc.engine.step_spec import Step

__all__ = ("TensorParallelDimension",)


@register()
class TensorParallelDimension(RankStrategy):
    """Planned modules' parameters, gradients and optimizer state sharded over the tp ranks."""

    name = "tp"
    mesh_dimension = "tp"
    options = frozenset({"tp_plan", "loss_parallel"})

    @classmethod
    def plan_degrees(cls, facts: ModelFacts, gpus: int) -> tuple[int, ...]:
        """Divisors of ``gpus`` that divide the attention and KV heads (each rank its whole heads)."""
        if facts.heads is None or facts.kv_heads is None or facts.hidden is None:
            return (1,)
        return tuple(d for d in range(1, gpus + 1)
                     if gpus % d == 0 and facts.heads % d == 0 and facts.kv_heads % d == 0)

    @classmethod
    def collectives(cls, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
        """torchtitan's Llama plan with sequence parallelism, per micro-batch of ``facts.tokens``
        tokens (an activation ``A = tokens × hidden × activation_bytes``): each block all-gathers
        ``A`` before attention and before the MLP and reduce-scatters ``A`` after each (forward:
        2 + 2), and the backward does the same in reverse (2 + 2), the recomputed forward again
        under full checkpointing; the embedding reduce-scatters ``A`` (its backward all-gathers it),
        the final norm's output is all-gathered for the head (reduce-scattered back), and without
        ``loss_parallel`` the logits ``tokens × vocab`` are all-gathered. Each a ring over ``tp``.
        Exposed: every block waits on them (no async tensor parallelism).

        Where plan read the plan the trace runs (``facts.tp_traffic``, under ep ``tp_traffic_ep``:
        a Hugging Face plan, :mod:`memcalc.distributed.tp_traffic`), its collectives instead
        (:meth:`_planned`): under tp × ep the experts keep no tp rule, so none is counted for them."""
        n = mesh.tp
        if n == 1 or facts.hidden is None or not facts.tokens:
            return ()
        traffic = facts.tp_traffic_ep if mesh.ep > 1 else facts.tp_traffic
        if traffic is not None:
            return cls._planned(mesh, facts, traffic, micro_batches)
        span = group_span(mesh, "tp")
        layers = -(-(facts.layers or 0) // mesh.pp)  # the busiest stage's blocks
        activation = ring_bytes(facts.tokens * facts.hidden * facts.activation_bytes, n)
        per_block = 8 + (4 if facts.recompute else 0)
        out = [Collective(cls.name, "all-gather and reduce-scatter of block activations (sequence parallel)",
                          per_block * layers * activation * micro_batches, span, per_block * layers * micro_batches,
                          overlapped=False)]
        if facts.vocab is not None:
            logits = ring_bytes(facts.tokens * facts.vocab * facts.activation_bytes, n)
            out.append(Collective(cls.name, "embedding, head input and logits (all-gather / reduce-scatter)",
                                  (4 * activation + logits) * micro_batches, span, 5 * micro_batches,
                                  overlapped=False))
        return tuple(out)

    @classmethod
    def _planned(cls, mesh: Mesh, facts: ModelFacts, traffic: tuple[Transfer, ...],
                 micro_batches: int) -> tuple[Collective, ...]:
        """The plan's collectives per optimizer step, one :class:`Collective` per kind and pass: the
        busiest stage's ``⌈layers / pp⌉`` blocks (the first ones) and the blocks outside them (its
        embedding and head, counted on it as the closed formula counts them), a recomputed block's
        forward collectives again (:meth:`ModelFacts.recomputes`), each whole tensor ``tokens ×
        elements per token`` (in the residual stream's dtype or the compute dtype) a ring over tp.
        Exposed, as the closed formula's."""
        n, span = mesh.tp, group_span(mesh, "tp")
        stage = -(-(facts.layers or 0) // mesh.pp)
        stream = facts.stream_bytes_under(mesh)
        sums: dict[tuple[Kind, bool], list[float]] = {}
        for t in traffic:
            if t.block is not None and t.block >= stage:
                continue
            calls = 1 + (not t.backward and t.recomputed and t.block is not None and facts.recomputes(t.block))
            element = stream if t.stream else facts.activation_bytes
            size = ring_bytes(facts.tokens * t.elements * element, n) * (2 if t.kind is Kind.ALL_REDUCE else 1)
            total = sums.setdefault((t.kind, t.backward), [0.0, 0])
            total[0] += calls * size * micro_batches
            total[1] += calls * micro_batches
        return tuple(Collective(cls.name, f"{kind.value} of activations ({'backward' if backward else 'forward'}; "
                                          f"the model's own plan)", received, span, int(count), overlapped=False)
                     for (kind, backward), (received, count) in sums.items())

    def plan(self, plan: Plan, step: Step) -> Plan:
        self._refuse_others()
        plan = every_rank(plan, self.distributed)
        n = self.degree
        strings = dict(self.distributed.tp_plan) if self.distributed.tp_plan is not None else None
        loss_parallel = self.distributed.loss_parallel
        # under FSDP2 every parameter becomes a DTensor (the ones the plan leaves plain, on the dp_shard
        # mesh): foreach and fused optimizers step them all, so nothing is refused
        mesh = self.distributed.mesh
        composed = mesh is not None and (mesh.dp_shard > 1 or mesh.cp > 1)  # cp shards with FSDP2 too
        impl = None if composed else resolve_impl(step.optimizer, step.loop.optimizer_impl, cuda=step.emulate_cuda)
        shard = Shard(MODEL_STATES, self.name, n)
        roles: list[Role] = []
        notes: list[str] = []
        for role in plan.roles:
            uneven = self._uneven(step, role.batch, strings, loss_parallel)
            if uneven and mesh is not None and mesh.ep > 1:
                raise InapplicableOptionError(
                    f"tp={n} with ep={mesh.ep}: the tensor-parallel split is uneven (a planned dimension or the "
                    f"sequence does not divide by {n}), which memcalc traces on tp's own ranks only",
                    hint=f"Give a tp degree that divides the planned dimensions and the sequence, or estimate tp={n} "
                         f"without ep.")
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

    def _refuse_others(self) -> None:
        """Refuse the dimensions tp does not compose with yet: all but dp_shard and cp, and HSDP's
        dp_replicate around dp_shard; beside ep (tp × ep), all others, and beside ep × cp, all others
        and dp_shard with dp_replicate."""
        mesh = self.distributed.mesh
        if mesh is None:
            return
        if mesh.ep > 1:  # tp x ep: ep's program runs this plan on its tp sub-mesh (ep's file); FSDP2 over it
            composes = {"tp", "ep", "dp_shard", "dp_replicate"} | ({"cp"} if mesh.cp > 1 else set())
            if mesh.cp > 1 and mesh.dp_shard > 1 and mesh.dp_replicate > 1:  # 32 processes at the smallest, not run
                composes -= {"dp_shard", "dp_replicate"}
        else:
            composes = {"tp", "cp", "dp_shard", "dp_replicate"} if mesh.dp_shard > 1 else {"tp", "cp"}
        others = sorted(set(mesh.used) - composes)
        if not others:
            return
        listed = ", ".join(f"{name}={mesh.used[name]}" for name in others)
        if mesh.ep > 1 and mesh.cp > 1:
            raise InapplicableOptionError(
                f"tp={self.degree} with ep={mesh.ep}, cp={mesh.cp} and {listed} is not modelled yet: memcalc composes "
                f"tensor parallelism with ep x cp (the experts over ep x cp x tp ranks) and one of dp_shard or "
                f"dp_replicate (each checked on 16 processes); with both the layout (32 processes at the smallest) "
                f"has not been checked against a real run",
                hint=f"Estimate --mesh dp_shard=N,tp={self.degree},cp={mesh.cp},ep={mesh.ep} or "
                     f"dp_replicate=N,tp={self.degree},cp={mesh.cp},ep={mesh.ep}.")
        if mesh.ep > 1:
            raise InapplicableOptionError(
                f"tp={self.degree} with ep={mesh.ep} and {listed} is not modelled yet: memcalc composes tensor "
                f"parallelism with expert parallelism (tp x ep, the experts over ep x tp ranks) and FSDP2 or HSDP "
                f"around them (dp_shard, dp_replicate) only",
                hint=f"Estimate --mesh tp={self.degree},ep={mesh.ep} or dp_shard=N,tp={self.degree},ep={mesh.ep}, or "
                     f"tp={self.degree} with dp_shard and cp without ep.")
        raise InapplicableOptionError(
            f"tp={self.degree} with {listed} is not modelled yet: memcalc composes tensor parallelism with FSDP2 "
            f"(dp_shard, and HSDP's dp_replicate around it) and context parallelism (cp) only, and tracing one "
            f"dimension alone would understate a rank",
            hint=f"Estimate tp={self.degree} alone or with dp_shard and cp (--mesh dp_shard=N,cp=C,tp={self.degree}).")

    def _uneven(self, step: Step, batch: int, strings: dict[str, str] | None, loss_parallel: bool) -> bool:
        """Whether the ranks' shards differ in shape: a dimension a planned style shards that does
        not divide by the degree (conservatively: any parameter dimension of a planned module),
        or the sequence under a style that shards it."""
        mesh = self.distributed.mesh
        if mesh is not None and mesh.cp > 1 and step.seq_len is not None and step.seq_len % mesh.cp == 0:
            step = replace(step, seq_len=step.seq_len // mesh.cp)  # each rank's share of the sequence (cp)
        resolved = step.resolved(batch_size=batch)
        module = resolved.module
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
        tp_plan = resolve_plan(module, strings, resolved.name, loss_parallel=loss_parallel,
                               expert_parallel=mesh is not None and mesh.ep > 1)
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

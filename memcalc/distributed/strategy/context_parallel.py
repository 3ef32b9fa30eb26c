"""``cp``: context parallelism as torchtitan runs it — ``context_parallel(mesh,
buffers=[inputs, labels, freqs_cis], buffer_seq_dims=[1, 1, 0])`` around the step
(torch 2.13 ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``).

Each rank holds ``S/cp`` tokens of every sample (the head-tail load balancer,
``_HeadTailLoadBalancer``, when ``S`` divides by ``2·cp``: chunks ``r`` and ``2·cp-1-r``; plain
chunks otherwise — the same bytes either way), so every activation is that of a ``S/cp``-token
step, and ring attention (:mod:`memcalc.distributed.ring_attention`) adds its all-gathered K/V and
merge buffers around each attention call. The parameters are replicated across ``cp`` for the
model's compute, but torchtitan shards them with FSDP2 over ``dp_shard × cp`` (``parallel_dims``:
``fsdp_enabled`` is ``dp_shard_enabled or cp_enabled``, the ``dp_shard_cp`` mesh), so this
dimension wraps FSDP2 over that many ranks itself, and ``dp_shard`` only adds its batch share.
After ``tp`` (torchtitan's order) FSDP2 is stacked on tp's program and the ring sees each tp rank's
local ``H/tp`` heads.

With ``ep`` (ep × cp) ep builds the program (torchtitan's ep borrows cp; ep's file); this
dimension gives each role its ``S/cp`` tokens and its shards. Checked against real gloo steps
(tests/test_gloo_cp.py: torch's ring with the CPU flash op added to its handlers) and torch's ring
run alone (tests/test_context_parallel.py). Not modelled: the full batch each rank loads before
``context_parallel`` shards it (``buffer.resize_(shard.shape)`` keeps the storage).
``memcalc plan`` searches it: :meth:`ContextParallel.collectives` is the ring's traffic as torch
exchanges it (each attention call's K/V all-gathered in forward and again in backward, the float32
dK/dV sent on after every backward step) beside FSDP2 over ``dp_shard × cp``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.report import Shard
from memcalc.distributed.collectives import Collective, ModelFacts, group_span
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.program import RankProgram, StackedProgram
from memcalc.distributed.ring_attention import RingAttentionProgram
from memcalc.distributed.strategy.base import MODEL_STATES, Plan, every_rank, register, sharding
from memcalc.distributed.strategy.dp_shard import DpShard, fsdp_collectives, fsdp_program
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step

__all__ = ("BACKWARD_PER_FORWARD", "ContextParallel")

#: FLOPs of a flash attention backward per forward FLOP: 5 matmuls (QKᵀ recomputed, dV, dP, dQ, dK) to
#: the forward's 2 (torch/utils/flop_counter.py, ``sdpa_backward_flop_count``).
BACKWARD_PER_FORWARD = 2.5
#: ``_ContextParallelOptions.convert_to_f32``: the dK/dV accumulators, and so their sends, in float32.
_GRAD_KV_ITEMSIZE = 4


@register()
class ContextParallel(DpShard):
    """The sequence split over the ranks, attention as a ring; FSDP2 over dp_shard × cp (so its
    precision and its refusals are FSDP2's, inherited)."""

    name = "cp"
    mesh_dimension = "cp"
    options = frozenset({"sharding"})

    @classmethod
    def plan_degrees(cls, facts: ModelFacts, gpus: int) -> tuple[int, ...]:
        """Divisors of ``gpus`` for a transformer (its ring's traffic needs the heads); 1 otherwise.
        ``memcalc plan`` skips, by name, those whose ``2 × cp`` does not divide the sequence."""
        if facts.heads is None or facts.kv_heads is None or facts.hidden is None or facts.layers is None:
            return (1,)
        return super().plan_degrees(facts, gpus)

    @classmethod
    def collectives(cls, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
        """Per attention call (``layers / pp`` per micro-batch, the forward twice under full
        checkpointing), torch's ring (``_templated_ring_attention`` and its backward, torch's
        default ``rotate_method=ALL_GATHER``) moves, with ``KV = 2 × tokens × kv_heads / tp ×
        head_dim`` elements of one rank's K and V: in forward, one all-gather of the K/V shards
        (``(cp − 1) × KV`` received), issued at step 0 and waited at step 1, so beside step 0's
        attention; in backward the same all-gather again, and after each of the ``cp`` steps the
        float32 dK/dV (``KV × 4`` bytes) sent to the next rank (``_AllToAllRotater``), waited after
        the next step's attention (the last one, after the loop, at once: exposed). One step's
        attention: ``2 × tokens × S/cp × heads / tp × head_dim`` FLOPs (the causal diagonal, or
        the balancer's half chunks: the same), its backward 2.5 ×, at ``attention_flops_per_second``.
        Beside them FSDP2 over ``dp_shard × cp`` (dp_shard's file counts it when dp_shard > 1)."""
        fsdp = fsdp_collectives(cls.name, mesh, facts, micro_batches) if mesh.dp_shard == 1 else ()
        cp = mesh.cp
        if (cp == 1 or not facts.tokens or facts.hidden is None or facts.heads is None or facts.kv_heads is None
                or facts.layers is None):
            return fsdp
        head_dim = facts.hidden / facts.heads
        kv = 2 * facts.tokens * facts.kv_heads / mesh.tp * head_dim
        calls = -(-facts.layers // mesh.pp) * micro_batches  # the busiest stage's attention calls
        forwards = 2 * calls if facts.recompute else calls
        rate = facts.attention_flops_per_second
        step = 2 * facts.tokens * facts.seq_len * facts.heads / mesh.tp * head_dim / rate if rate else 0.0
        span = group_span(mesh, "cp")
        gathered = (cp - 1) * kv * facts.activation_bytes
        grads = kv * _GRAD_KV_ITEMSIZE
        return (*fsdp,
                Collective(cls.name, "ring: all-gather of K and V (forward, beside each call's first step)",
                           gathered * forwards, span, forwards, beside=step),
                Collective(cls.name, "ring: all-gather of K and V (backward, beside each call's first step)",
                           gathered * calls, span, calls, beside=BACKWARD_PER_FORWARD * step),
                Collective(cls.name, "ring: float32 dK and dV to the next rank (backward, beside the next step)",
                           (cp - 1) * grads * calls, span, (cp - 1) * calls, beside=BACKWARD_PER_FORWARD * step),
                Collective(cls.name, "ring: float32 dK and dV home (backward, after the last step: waited at once)",
                           grads * calls, span, calls, overlapped=False))

    def plan(self, plan: Plan, step: Step) -> Plan:
        cp = self.degree
        seq_len = self.local_seq_len(step)
        plan = every_rank(plan, self.distributed)
        mesh = self.distributed.mesh
        dp_shard = 1 if mesh is None else mesh.dp_shard
        balanced = step.seq_len is not None and step.seq_len % (2 * cp) == 0
        if mesh is not None and mesh.ep > 1:  # ep x cp: ep builds the rank's program, the ring around it (ep's file)
            return self._beside_experts(plan, seq_len, balanced, step)
        fsdp, notes = fsdp_program(self.distributed.sharding, step, dp_shard * cp)


        def ringed(inner: Callable[[ResolvedModel], RankProgram] | None) -> Callable[[ResolvedModel], RankProgram]:
            def ring(resolved: ResolvedModel) -> RankProgram:
                # after tp (torchtitan's order): FSDP2 over its DTensors, the ring around both
                sharded = fsdp(resolved) if inner is None else StackedProgram(inner(resolved), fsdp(resolved))
                return RingAttentionProgram(cp, sharded, load_balanced=balanced, cpu=not step.emulate_cuda)

            return ring

        if dp_shard > 1:
            notes[0] += f" (dp_shard x cp = {dp_shard} x {cp}: torchtitan's dp_shard_cp mesh)"
        notes = [*notes, self.note(seq_len, balanced, step)]
        shards = (Shard(MODEL_STATES, self.name, cp), Shard(("sequence",), self.name, cp))
        roles = tuple(replace(role, program=ringed(role.program), seq_len=seq_len,
                              sharding=sharding(role.sharding, *shards)) for role in plan.roles)
        if any(role.program is not None for role in plan.roles):
            notes[0] += " of each rank's tensor-parallel DTensor shards (dim 0 of the local shard)"
        return replace(plan, roles=roles, notes=(*plan.notes, *notes))

    def note(self, seq_len: int, balanced: bool, step: Step) -> str:
        """What a report says of the ring: each rank's tokens, the balancer, the K/V all-gather."""
        return (f"context parallelism over {self.degree} ranks: {seq_len} of {step.seq_len} tokens per sample per "
                f"rank " + ("(head-tail load balancing)" if balanced else "(contiguous chunks: no load balancing, "
                                                                          "as torch does when 2 x cp does not divide "
                                                                          "the sequence)")
                + "; ring attention all-gathers K/V (rotate_method=allgather), merges in float32")

    def _beside_experts(self, plan: Plan, seq_len: int, balanced: bool, step: Step) -> Plan:
        """ep × cp: each rank's share of the sequence and cp's shards; the program (the ring around
        expert parallelism and FSDP2) is ep's, which applies next (torchtitan's ep borrows cp)."""
        shards = (Shard(MODEL_STATES, self.name, self.degree), Shard(("sequence",), self.name, self.degree))
        roles = tuple(replace(role, seq_len=seq_len, sharding=sharding(role.sharding, *shards)) for role in plan.roles)
        return replace(plan, roles=roles, notes=(*plan.notes, self.note(seq_len, balanced, step)))

    def local_seq_len(self, step: Step) -> int:
        """``S/cp``: the tokens per sample of one rank.

        Raises:
            InvalidInputError: no ``--seq-len``, or one ``cp`` does not divide.
            InapplicableOptionError: the user's own inputs (``inputs=``), which memcalc cannot shard.
        """
        cp = self.degree
        if step.inputs is not None:
            raise InapplicableOptionError(
                f"cp={cp} shards the inputs along the sequence; memcalc shards the token batch it builds, not "
                f"inputs= given", hint="Give batch_size and seq_len instead of inputs.")
        if step.seq_len is None:
            raise InvalidInputError(f"cp={cp} splits the sequence over {cp} ranks: give its length",
                                    hint=f"e.g. --seq-len {8192}")
        if step.seq_len % cp:
            raise InvalidInputError(
                f"cp={cp} does not divide the sequence of {step.seq_len} tokens: every rank holds an equal share",
                hint=f"give a --seq-len that is a multiple of {2 * cp} (head-tail load balancing needs 2 x cp)")
        return step.seq_len // cp

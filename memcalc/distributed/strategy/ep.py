"""``ep``: expert parallelism as transformers runs it — the model's own ``ep_plan``
(``base_model_ep_plan``: ``grouped_gemm`` on the experts' weights, ``ep_dispatch_experts`` on the
experts module) applied by transformers' ``apply_expert_parallelism`` with its ``AllToAllEP``
(transformers 5.24 ``distributed/expert_parallel.py``) to the meta model over a fake process group,
the step traced on rank 0.

What a rank holds: ``E/ep`` of the ``E`` experts of every MoE layer (``MoEParamShard``: ``Shard(0)``
DTensors), their gradients and optimizer state; the dense rest (attention, router, norms,
embeddings) whole. What it allocates to move tokens, per MoE layer (``AllToAllEP``, ``T`` tokens,
top-``k``): the ``T·k`` rows it sends (``hidden_states[order // k]``), the rows it receives
(``all_to_all_single_autograd``), its experts' activations on those rows, the ``T·k`` result rows
coming back, and the same again in backward. The split sizes are read to the host (``.tolist()``):
memcalc answers from the routing assumption (:func:`dispatch_rows`, stated in the report): balanced
by default; a capacity factor or the worst case on request (:mod:`memcalc.distributed.expert_parallel`).

Every ep rank runs a batch of its own (the dense part is data parallel over them, as in
transformers with ``tp_size=1``), so the global batch counts the ep ranks. With ``dp_shard``
(torchtitan's MoE FSDP) dp_shard's FSDP2 is stacked on this program: each block's experts sharded
over dp_shard (``dp_shard_mod_ep``), the dense part over dp_shard × ep (``dp_shard_cp``); a real
four-process gloo run agrees to the byte. Under ``pp`` the pipeline applies it inside every stage
(:mod:`memcalc.distributed.ep_stages`). With ``tp`` (``tp·ep`` ranks): tp's plan on each tp group
(one batch per group), the experts over all ``ep·tp`` ranks, each tp rank dispatching ``1/tp`` of its
group's tokens: transformers' ``ep_size = fsdp_size × tp_size``, torchtitan's ``etp=1``
(:func:`expert_tensor_parallel`; real four-process gloo runs agree to the byte), and with dp_shard
too dp_shard's FSDP2 around both (torchtitan's etp=1 layout; 8 and, with HSDP, 16 processes, to the
byte). The dense gradients' synchronisation over ep is not modelled without FSDP2 (stated). With
dp_replicate and no dp_shard (tp or not), torchtitan's HSDP (dp_replicate's file). With cp, torchtitan's
ep borrows cp (and tp): the experts over ep x cp (x tp) ranks, each dispatching its S/cp tokens (1/tp
under tp), FSDP2 over dp_shard x ep x cp (HSDP with dp_replicate), the ring around it all; with up to two
of dp_shard, dp_replicate, tp real 4- to 16-process gloo runs agree to the byte; all three, or pp, refused."""

from __future__ import annotations

import math
from dataclasses import replace

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.core.precision import Precision
from memcalc.core.report import Shard
from memcalc.distributed.collectives import Collective, ModelFacts, group_span, ring_bytes
from memcalc.distributed.expert_parallel import (
    ExpertParallel,
    dispatch_rows,
    expert_modules,
    expert_parallelism_available,
    expert_tensor_parallel,
    routing_text,
)
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.program import RankProgram, StackedProgram
from memcalc.distributed.ring_attention import RingAttentionProgram
from memcalc.distributed.strategy.base import Plan, RankStrategy, every_rank, register, sharding
from memcalc.distributed.strategy.dp_shard import fsdp_collectives, fsdp_program
from memcalc.distributed.vocabulary import Routing
from memcalc.engine.model import ResolvedModel
from memcalc.engine.optimizers import resolve_impl
from memcalc.engine.step_spec import Step
from memcalc.stacks.transformers.reads import routing_notes

__all__ = ("ExpertParallelDimension",)

#: Bytes of one split count: ``AllToAllEP`` counts the pairs per expert in ``torch.long``.
_SPLIT_COUNT_BYTES = 8
#: Bytes of a routing weight: Mixtral's router (transformers 5.25) takes the softmax in float32 and
#: keeps it, so the combine's product with them is float32 under any precision (a traced bf16 tp × ep
#: step all-gathers float32 rows over tp). Qwen3-MoE's casts them to the router's dtype, which ModelFacts
#: does not carry; its own tp plan is refused today (``replicated_with_grad_allreduce``), so tp × ep never
#: meets it.
_ROUTING_WEIGHT_BYTES = 4


@register()
class ExpertParallelDimension(RankStrategy):
    """Experts sharded over the ep ranks, tokens dispatched to them by all-to-all."""

    name = "ep"
    mesh_dimension = "ep"
    options = frozenset({"routing", "capacity_factor"})

    @classmethod
    def plan_degrees(cls, facts: ModelFacts, gpus: int) -> tuple[int, ...]:
        """Divisors of ``gpus`` that divide the experts of a mixture of experts; 1 for a model
        without experts (``memcalc plan`` checks that ``ep × cp × tp`` divides them too)."""
        if facts.experts is None:
            return (1,)
        return tuple(d for d in super().plan_degrees(facts, gpus) if facts.experts % d == 0)

    @classmethod
    def collectives(cls, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
        """Per MoE layer (``moe_layers / pp`` per micro-batch), ``AllToAllEP``'s collectives over
        the ``ep × cp × tp`` ranks that hold the experts (torchtitan's ep group: the ``cp × ep × tp``
        consecutive GPUs), as transformers 5.25 runs them (``distributed/expert_parallel.py``):

        - the split counts (one ``int64`` a global expert, ``all_to_all_single`` in place) and the
          routed rows: the dispatch receives the rows the other ranks route to this rank's
          experts, the combine this rank's own rows back from them, each row ``hidden`` elements
          of the residual stream (:meth:`ModelFacts.stream_bytes_under`: float32 under autocast
          alone, FSDP2's bf16 ``param_dtype`` where it runs the model, as traced); the backward
          runs both row all-to-alls again (each one's gradient, the other way), and a recomputed
          block (full, selective-op, ``every:N``'s) its forward's three
          (:meth:`ModelFacts.recomputes`). The rows are what the estimate's
          program answers the split sizes with (:func:`dispatch_rows`, balanced routing: plan's
          default) for the ``tokens / tp`` tokens a rank dispatches (``tokens``: micro-batch ×
          ``S / cp``), less its rows to itself, which cross no link;
        - under tp, over the tp ranks that share a batch: the combine's output all-gathered
          (``Shard(0) -> Replicate``: the group's ``tokens × hidden``, float32, the product with
          the router's float32 weights), which a recomputed block does not re-run (torch's
          checkpoint stops early: the MoE layer ends the block); in backward the gradients of the
          rows and of the routing weights (``tokens × top_k`` float32) all-gathered back from
          ``Replicate -> Shard(0)``.

        Exposed: each layer's experts wait on the dispatch, its output on the combine (``AllToAllEP``
        overlaps neither). With dp_replicate and neither dp_shard nor cp, FSDP2 over the ep ranks
        (dp_replicate's HSDP): its all-gathers and reduce-scatters here."""
        fsdp = (fsdp_collectives(cls.name, mesh, facts, micro_batches)
                if mesh.dp_shard == 1 and mesh.cp == 1 and mesh.dp_replicate > 1 else ())
        if facts.experts is None or facts.top_k is None or not facts.tokens or facts.hidden is None:
            return fsdp
        owners = mesh.ep * mesh.cp * mesh.tp
        send, receive = dispatch_rows(facts.tokens // mesh.tp, facts.top_k, facts.experts, owners, 0,
                                      Routing.BALANCED)
        stream = facts.stream_bytes_under(mesh)
        row = facts.hidden * stream
        layer = (sum(receive) - receive[0] + sum(send) - send[0]) * row  # dispatch and combine, from the others
        calls = -(-facts.moe_layers // mesh.pp) * micro_batches  # the busiest stage's MoE layers
        forwards = calls + -(-facts.recomputed_moe_layers // mesh.pp) * micro_batches
        span = group_span(mesh, "cp")  # cp, ep and tp: consecutive GPUs (LAYOUT)
        counts = ring_bytes(facts.experts * _SPLIT_COUNT_BYTES, owners)
        out = [*fsdp,
               Collective(cls.name, "all-to-all of the split counts (forward)", counts * forwards, span, forwards,
                          overlapped=False),
               Collective(cls.name, "all-to-all of routed tokens (dispatch and combine, forward)", layer * forwards,
                          span, 2 * forwards, overlapped=False),
               Collective(cls.name, "all-to-all of routed tokens' gradients (backward)", layer * calls, span,
                          2 * calls, overlapped=False)]
        if mesh.tp > 1:
            tp_span = group_span(mesh, "tp")
            combined = ring_bytes(facts.tokens * facts.hidden * max(stream, _ROUTING_WEIGHT_BYTES), mesh.tp)
            gradients = ring_bytes(facts.tokens * (facts.hidden * stream + facts.top_k * _ROUTING_WEIGHT_BYTES),
                                   mesh.tp)
            out += [Collective(cls.name, "all-gather of the combined tokens over tp (forward)", combined * calls,
                               tp_span, calls, overlapped=False),
                    Collective(cls.name, "all-gather of routed tokens' and routing weights' gradients over tp "
                                         "(backward)", gradients * calls, tp_span, 2 * calls, overlapped=False)]
        return tuple(out)

    def refuse_finetune(self, finetune: FineTune) -> None:
        if finetune.is_empty:
            return
        raise InapplicableOptionError(
            "ep with --lora, --freeze or --quant is not estimated: transformers shards the experts' weights as "
            "DTensors, which memcalc models for full training only",
            hint="Estimate full training under ep, or the fine-tuning without ep.")

    def prepare(self, resolved: ResolvedModel, trace_precision: Precision) -> ResolvedModel:
        """The model's single-GPU routing note (balanced) left out where ep assumes another: the
        plan's note states the routing of the step."""
        if self.distributed.routing is Routing.BALANCED:
            return resolved
        stale = set(routing_notes(resolved.module))
        return replace(resolved, notes=tuple(note for note in resolved.notes if note not in stale))

    def plan(self, plan: Plan, step: Step) -> Plan:
        mesh = self.distributed.mesh
        self._refuse_others()
        composed = mesh is not None and mesh.dp_shard > 1
        hsdp = mesh is not None and mesh.dp_shard == 1 and mesh.dp_replicate > 1  # FSDP2 over ep (dp_replicate's)
        if not expert_parallelism_available():
            raise InapplicableOptionError(
                f"ep={self.degree} runs transformers' own expert parallelism (transformers.distributed."
                f"expert_parallel), which the installed transformers {_transformers_version()} does not have",
                hint="Install a transformers that has it (5.24 does), or estimate without ep.")
        plan = every_rank(plan, self.distributed)
        routing, factor = self.distributed.routing, self.distributed.capacity_factor
        n = self.degree
        tp = 1 if mesh is None else mesh.tp
        strings = dict(self.distributed.tp_plan) if self.distributed.tp_plan is not None else None
        # under FSDP2 every parameter becomes a DTensor: foreach and fused optimizers step them all (tp's file)
        impl = (resolve_impl(step.optimizer, step.loop.optimizer_impl, cuda=step.emulate_cuda)
                if tp > 1 and not (composed or hsdp) else None)

        def program(resolved: ResolvedModel) -> RankProgram:
            if tp > 1:  # tp's plan on the dense part, the experts over ep x tp (etp=1)
                return expert_tensor_parallel(n, tp, strings, routing=routing, capacity_factor=factor,
                                              model_name=resolved.name, optimizer_impl=impl)
            return ExpertParallel(n, routing=routing, capacity_factor=factor, model_name=resolved.name)

        if mesh is not None and mesh.cp > 1:  # ep x cp: torchtitan's ep borrows cp
            return self._with_context_parallel(plan, step, mesh)
        shards: tuple[Shard, ...]
        if tp > 1 and (composed or hsdp) and mesh is not None:  # FSDP2 around tp x ep (torchtitan's etp=1 layout)
            shards = (Shard(("experts", "dense model states", "batch"), self.name, n),)
            dense = (f"the dense part under tp's plan over the {tp} tp ranks that share a batch and sharded by FSDP2 "
                     f"over dp_shard x ep = {mesh.dp_shard * n} ranks (torchtitan's dp_shard_cp mesh); each block's "
                     f"experts over all ep x tp = {n * tp} ranks (etp=1: torchtitan's ep of {n * tp} borrows tp and "
                     f"{n} of its dp_shard of {mesh.dp_shard * n}), each rank's share sharded by FSDP2 over the "
                     f"{mesh.dp_shard} dp_shard ranks that hold the same experts (its dp_shard_mod_ep mesh)")
        elif tp > 1:
            shards = (Shard(("experts",), self.name, n), Shard(("batch",), self.name, n))
            dense = (f"the dense part under tp's plan over the {tp} tp ranks that share a batch; each block's experts "
                     f"over all ep x tp = {n * tp} ranks, as transformers "
                     f"composes tp_size with ep_size = fsdp_size x tp_size and torchtitan with etp=1: each tp "
                     f"rank dispatches 1/{tp} of its group's tokens and all-gathers the results over tp; the dense "
                     f"gradients' synchronisation over the ep ranks is not modelled")
        elif hsdp:  # dp_replicate's FSDP2 shards the dense part over the ep ranks (its file)
            shards = (Shard(("experts", "dense model states", "batch"), self.name, n),)
            dense = "the dense part sharded by FSDP2 over the ep ranks (dp_replicate's HSDP, as torchtitan runs it)"
        elif composed:  # dp_shard's FSDP2 shards the dense part over these ranks too
            shards = (Shard(("experts", "dense model states", "batch"), self.name, n),)
            dense = (f"the dense part sharded by FSDP2 over dp_shard x ep = {mesh.dp_shard * n} ranks (torchtitan's "
                     f"dp_shard_cp mesh), each block's experts over the {mesh.dp_shard} dp_shard ranks that hold the "
                     f"same experts (its dp_shard_mod_ep mesh)" if mesh is not None else "")
        else:
            shards = (Shard(("experts",), self.name, n), Shard(("batch",), self.name, n))
            dense = "the dense part whole; the dense gradients' synchronisation over the ep ranks is not modelled"
        roles = tuple(replace(role, program=program, sharding=sharding(role.sharding, *shards)) for role in plan.roles)
        notes = (f"expert parallelism over {n} ranks: each holds 1/{n * tp} of every MoE layer's experts (their "
                 f"gradients and optimizer state) and a batch of its own; tokens move by all-to-all under "
                 f"{routing_text(routing, factor)}; rank 0 traced (it holds the most, if any differ); {dense}",)
        return replace(plan, roles=roles, notes=(*plan.notes, *notes))

    def _with_context_parallel(self, plan: Plan, step: Step, mesh: Mesh) -> Plan:
        """ep × cp (cp's file set each role's ``S/cp`` tokens and its shards): torchtitan's MoE layout
        with cp (``ParallelDims._build_mesh_with_ep``): its ep of ``ep · cp`` ranks borrows cp (memcalc's
        ep is its ``dp_shard_in_ep``), so each block's experts go over all ``ep · cp`` ranks, each rank
        dispatching its own ``B · S/cp`` tokens; FSDP2 shards each block's experts over the dp_shard ranks
        that hold the same experts (``dp_shard_mod_ep``) and the rest over ``dp_shard · ep · cp``
        (``dp_shard_cp``); the ring goes around both, on the rank's sequence shard."""
        n, cp, dp_shard, tp = self.degree, mesh.cp, mesh.dp_shard, mesh.tp
        owners = n * cp
        routing, factor = self.distributed.routing, self.distributed.capacity_factor
        fsdp, fsdp_notes = fsdp_program(self.distributed.sharding, step, dp_shard * owners, experts_degree=dp_shard,
                                        ep=owners, owners=owners * tp)
        balanced = step.seq_len is not None and step.seq_len % (2 * cp) == 0
        strings = dict(self.distributed.tp_plan) if self.distributed.tp_plan is not None else None

        def program(resolved: ResolvedModel) -> RankProgram:
            _refuse_uneven_experts(resolved, n, cp, dp_shard, tp)
            experts: RankProgram
            if tp > 1:  # tp's plan on the dense part, the experts over ep x cp x tp (torchtitan's etp=1)
                experts = expert_tensor_parallel(owners, tp, strings, routing=routing, capacity_factor=factor,
                                                 model_name=resolved.name)
            else:
                experts = ExpertParallel(owners, routing=routing, capacity_factor=factor, model_name=resolved.name)
            return RingAttentionProgram(cp, StackedProgram(experts, fsdp(resolved)), load_balanced=balanced,
                                        cpu=not step.emulate_cuda)

        shards = (Shard(("experts", "dense model states", "batch"), self.name, n),)
        roles = tuple(replace(role, program=program, sharding=sharding(role.sharding, *shards)) for role in plan.roles)
        fsdp_notes.insert(1, f"FSDP2 of each rank's expert-parallel DTensor shards: the dense part over dp_shard x "
                             f"ep x cp = {dp_shard} x {n} x {cp} ranks (torchtitan's dp_shard_cp mesh), each block's "
                             f"experts over the {dp_shard} dp_shard rank(s) that hold the same experts (its "
                             f"dp_shard_mod_ep mesh)")
        tokens = step.seq_len // cp if step.seq_len else "?"
        if tp > 1:
            split = (f"ep x cp x tp = {owners * tp} ranks (torchtitan's ep of {owners * tp} borrows cp={cp}, tp={tp} "
                     f"(its etp=1 rule) and ep={n} of its dp_shard)")
            sent = f"1/{tp} of its tp group's {tokens} tokens per sample"
            dense = (f"; the dense part under tp's plan over the {tp} tp ranks, which share a batch and a sequence "
                     f"shard, the ring over each tp rank's heads")
        else:
            split = f"ep x cp = {owners} ranks (torchtitan's ep of {owners} borrows cp={cp} and ep={n} of its dp_shard)"
            sent, dense = f"its own {tokens} tokens per sample", ""
        sharers = f"{cp} cp ranks" if tp == 1 else f"cp x tp = {cp * tp} ranks"
        notes = (f"expert parallelism over {split}: each holds 1/{owners * tp} of every MoE layer's experts (their "
                 f"gradients and optimizer state) and dispatches {sent} by all-to-all under "
                 f"{routing_text(routing, factor)}; the {sharers} share a batch, each ep rank has its own; rank 0 "
                 f"traced (it holds the most, if any differ){dense}", *fsdp_notes)
        return replace(plan, roles=roles, notes=(*plan.notes, *notes))

    def _refuse_others(self) -> None:
        """Refuse the dimensions ep does not compose with yet. pp applies ep itself; dp_replicate
        alone is torchtitan's HSDP with a one-rank experts shard group (dp_replicate's file); around
        dp_shard it is HSDP over ep's FSDP2 (torchtitan's (dp_replicate, dp_shard_mod_ep) and
        (dp_replicate, dp_shard_cp) meshes); tp beside it is tp × ep (etp=1), with dp_shard's FSDP2 around
        both or alone."""
        mesh = self.distributed.mesh
        if mesh is None:
            return
        if mesh.cp > 1:
            self._refuse_beside_context_parallel(mesh)
            return
        # without dp_shard, dp_replicate is HSDP with a one-rank experts shard group (dp_replicate's file)
        allowed = {"ep", "tp", "dp_shard", "dp_replicate"}
        others = sorted(set(mesh.used) - allowed)
        if others:
            listed = ", ".join(f"{name}={mesh.used[name]}" for name in others)
            raise InapplicableOptionError(
                f"ep={self.degree} with {listed} is not modelled yet: memcalc composes expert parallelism with "
                f"FSDP2 (dp_shard), with tensor parallelism (tp, and FSDP2 around both) and with pipeline stages "
                f"(pp), as torchtitan shards its MoE models",
                hint=f"Estimate ep={self.degree} alone, with dp_shard (--mesh dp_shard=N,ep={self.degree}), with tp "
                     f"(--mesh tp=T,ep={self.degree} or dp_shard=N,tp=T,ep={self.degree}) or with pp "
                     f"(--mesh pp=N,ep={self.degree}).")


    def _refuse_beside_context_parallel(self, mesh: Mesh) -> None:
        """ep × cp composes with dp_shard, dp_replicate (torchtitan's HSDP around both FSDP2 meshes)
        and tp (the experts over ep x cp x tp ranks, torchtitan's etp=1 rule), any two of them at
        once, each layout checked against a real 4- to 16-process gloo run (tests/test_gloo_cp.py); all
        three together (32 processes, not run here) and pp (all of it inside each stage) are refused by
        name (tp's own check refuses the first before this one runs)."""
        beside: dict[str, int] = {name: mesh.used[name] for name in ("dp_shard", "dp_replicate", "tp")
                                  if name in mesh.used}
        others = {name: degree for name, degree in mesh.used.items()
                  if name not in ("ep", "cp", "dp_shard", "dp_replicate", "tp")}
        if not others and len(beside) <= 2:
            return
        listed = ", ".join(f"{name}={degree}" for name, degree in {**beside, **others}.items())
        reasons = [f"{name} would run the ring and the experts' all-to-all inside every pipeline stage, not modelled"
                   if name == "pp" else f"{name} is not modelled with it" for name in others]
        if len(beside) > 2:
            reasons.append(f"{', '.join(beside)} all together under ep x cp make a layout of "
                           f"{mesh.ep * mesh.cp * math.prod(beside.values())} ranks not checked against a real run")
        raise InapplicableOptionError(
            f"ep={self.degree} with cp={mesh.cp} and {listed} is not modelled yet: memcalc composes expert parallelism "
            f"with context parallelism and at most two of dp_shard (FSDP2), dp_replicate (HSDP) and tp, as "
            f"torchtitan lays them out; {'; '.join(reasons)}",
            hint=f"Estimate --mesh cp={mesh.cp},ep={self.degree} with at most two of dp_shard=N, dp_replicate=N and "
                 f"tp=T.")


def _refuse_uneven_experts(resolved: ResolvedModel, ep: int, cp: int, dp_shard: int, tp: int = 1) -> None:
    """Refuse ep × cp (× tp) ranks that do not divide every MoE layer's experts (transformers' own
    check), and more dp_shard ranks than each holds (FSDP2's ``Shard(1)``, dp_shard's check), both named
    in memcalc's terms: torchtitan's ep of ``ep · cp`` ranks borrows cp (and tp, under its etp=1)."""
    owners = ep * cp * tp
    ranks = f"ep x cp = {owners}" if tp == 1 else f"ep x cp x tp = {owners}"
    for path in expert_modules(resolved.module, owners, resolved.name):
        count = getattr(resolved.module.get_submodule(path), "num_experts", None)
        if not isinstance(count, int):
            continue
        if count % owners:
            raise InvalidInputError(
                f"ep={ep} with cp={cp}{f' and tp={tp}' if tp > 1 else ''} splits the experts over {ranks} ranks "
                f"(torchtitan's ep borrows cp{' and tp' if tp > 1 else ''}), which do not divide the {count} "
                f"experts of {path} in {resolved.name}",
                hint=f"give an ep whose product with cp{' and tp' if tp > 1 else ''} divides the number of experts")
        if dp_shard > count // owners:
            raise InapplicableOptionError(
                f"dp_shard={dp_shard} with ep={ep} and cp={cp}{f' and tp={tp}' if tp > 1 else ''}: each of the "
                f"{ranks} ranks holds {count // owners} experts of {path}, fewer than the dp_shard ranks, and "
                f"torchtitan then shards them on dim 1 (Shard(1)), which memcalc does not model",
                hint=f"Give a dp_shard of at most {count // owners}, or an ep x cp that leaves each rank more experts.")


def _transformers_version() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # not installed: the refusal says so
        return "(not installed)"

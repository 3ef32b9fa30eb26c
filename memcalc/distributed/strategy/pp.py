"""``pp``: pipeline parallelism, each pipeline rank estimated by running torch's own
``PipelineStage`` and schedule (:mod:`memcalc.distributed.pipeline`) on the meta model over a
fake process group: the microbatches in flight, the receive buffers, the gradients accumulated
over the microbatches and the optimizer step after the last. Every pipeline rank is a role
(the first holds the embedding, the last the head and the loss), the busiest one reported.

A pipeline rank does not run one traced step but a schedule, so this dimension estimates the
whole step itself (``whole_step``). It composes with ``dp_shard`` as torchtitan does: each
stage's module ``fully_shard``-ed over the dp_shard sub-mesh (every block and the stage's root),
``reshard_after_forward=False`` (torchtitan's default under a pipeline), and torch's
``PipelineStage`` syncing once in ``perform_reduce_grad``: a stage holds its unsharded parameters and
gradients from its first forward to its last backward (GPipe, 1F1B, Interleaved1F1B; the zero-bubble
and V schedules with dp_shard refused by name). A stage's dp_shard ranks share one trace, numbered
pp outermost (torchtitan's mesh order). With ``dp_replicate`` too the stages are HSDP (the
replicas' all-reduce in place); without dp_shard, ep or cp (DDP stages) it is refused by name.

With ``cp`` (``pp=P,cp=C``, and dp_shard, tp or both: torchtitan's long-context layout) each stage runs at ``S/cp``
tokens: tp's plan, FSDP2 over dp_shard × cp, torch's ring around its attention (``RingAttentionProgram``).

With ``ep`` (``--mesh pp=P,ep=E``, and dp_shard around it as torchtitan shards MoE stages, HSDP's
dp_replicate around that; dp_replicate alone is HSDP over the ep ranks, torchtitan's ep borrowing its
dp_shard) each stage's experts are sharded over the ep ranks (:mod:`memcalc.distributed.ep_stages`).

With ``tp`` (``--mesh pp=P,tp=T``, and dp_shard around it: the 3-D mesh) each stage's module is
parallelized by torch's own ``parallelize_module`` over the tp sub-mesh before FSDP2 wraps it
(:mod:`memcalc.distributed.tp_stages`): a pipeline rank's tp and dp_shard ranks share its trace,
numbered ``rank = (pp_rank × dp_shard + dp_shard_rank) × tp + tp_rank``. With ``tp`` and ``ep`` both,
each stage's experts go over the pipeline rank's ep × tp ranks (``StageExpertTensorParallel``), and
with dp_shard FSDP2 wraps the stage around that (torchtitan's 4-D MoE layout, etp=1), with dp_replicate
alone HSDP around it (checked on sixteen processes); with both it is refused (never checked: thirty-two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from memcalc.core.errors import InapplicableOptionError
from memcalc.core.loop import OptimizerImpl
from memcalc.core.report import MemoryReport, Shard
from memcalc.distributed.collectives import Collective, ModelFacts, group_span
from memcalc.distributed.ep_stages import StageExpertParallel, StageExpertTensorParallel, replicated_expert_notes
from memcalc.distributed.expert_parallel import expert_notes, expert_parallelism_available
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.pipeline import InnerParallel, Pipeline, estimate_pipeline, stage_mesh
from memcalc.distributed.pipeline_schedules import PipelineSchedule
from memcalc.distributed.program import RankProgram, StackedProgram
from memcalc.distributed.ring_attention import RingAttentionProgram
from memcalc.distributed.strategy.base import MODEL_STATES, Plan, RankStrategy, Setting, register
from memcalc.distributed.strategy.context_parallel import ContextParallel
from memcalc.distributed.strategy.dp_shard import DpShard, fsdp_program
from memcalc.distributed.tp_stages import StageTensorParallel
from memcalc.distributed.vocabulary import DEFAULT_BUCKET_CAP_MB
from memcalc.engine.model import ResolvedModel
from memcalc.engine.optimizers import resolve_impl
from memcalc.engine.run import CostRecorderFactory
from memcalc.engine.step_spec import Step

__all__ = ("PipelineParallel",)

#: The schedules whose FSDP2 stages agree with real gloo runs (tests/test_gloo_pipeline.py).
_WITH_DP_SHARD = (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B)


@register()
class PipelineParallel(RankStrategy):
    """The model split into stages over ``pp`` ranks, run under a pipeline schedule."""

    name = "pp"
    mesh_dimension = "pp"
    options = frozenset({"pp_schedule", "microbatches", "pp_split"})
    whole_step = True
    composes_with = frozenset({"dp_shard", "tp", "dp_replicate", "ep", "cp"})

    def __init__(self, distributed: Setting, degree: int) -> None:
        super().__init__(distributed, degree)
        mesh = distributed.mesh
        self.replicas = self._replicas(1 if mesh is None else mesh.dp_shard, 1 if mesh is None else mesh.ep,
                                       1 if mesh is None else mesh.cp)  # refused when made: plan asks
        if mesh is not None and mesh.cp > 1:
            self._refuse_beside_context_parallel(mesh)  # refused when made too, so plan's refusal finds it

    @classmethod
    def plan_degrees(cls, facts: ModelFacts, gpus: int) -> tuple[int, ...]:
        """Divisors of ``gpus`` up to the blocks (each stage at least one block); 1 for a model
        without blocks."""
        layers = facts.layers or 1
        return tuple(d for d in range(1, min(gpus, layers) + 1) if gpus % d == 0)

    @classmethod
    def collectives(cls, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
        """Each microbatch's activation ``tokens × hidden × activation_bytes`` received from the
        previous stage in the forward and its gradient from the next in the backward, once per
        stage a rank holds. The pipeline is as fast as its slowest link: the whole pp group's
        span. Overlapped: a steady-state schedule sends one microbatch while computing another."""
        if mesh.pp == 1 or facts.hidden is None or not facts.tokens:
            return ()
        size = facts.tokens * facts.hidden * facts.activation_bytes
        count = 2 * micro_batches * facts.stages_per_rank
        return (Collective(cls.name, "send/recv of stage activations and their gradients", size * count,
                           group_span(mesh, "pp"), count),)

    @property
    def pipeline(self) -> Pipeline:
        """The pipeline of this setting (schedule 1F1B and one microbatch per rank by default)."""
        setting = self.distributed
        schedule = setting.pp_schedule
        return Pipeline(self.degree, schedule if schedule is not None else "1f1b",
                        microbatches=setting.microbatches, split_points=setting.pp_split)

    def plan(self, plan: Plan, step: Step) -> Plan:
        """Not used: a pipeline estimates its whole step (:meth:`estimate`)."""
        raise NotImplementedError("a pipeline estimates its whole step (whole_step)")

    def estimate(self, step: Step, batch: int, costs: CostRecorderFactory | None) -> MemoryReport:
        pipeline = self.pipeline
        mesh = self.distributed.mesh
        dp_shard = 1 if mesh is None else mesh.dp_shard
        tp = 1 if mesh is None else mesh.tp
        replicas = self.replicas
        program = None
        precision = None
        fsdp_notes: list[str] = []
        shard: tuple[Shard, ...] = (Shard(("blocks",), self.name, self.degree),)
        ep = 1 if mesh is None else mesh.ep
        cp = 1 if mesh is None else mesh.cp
        ring = None if cp == 1 else self._context_parallel(cp, pipeline)
        experts = None if ep == 1 else self._expert_parallel(ep, tp, replicas, dp_shard)
        # FSDP2 wraps each stage under dp_shard (or cp: torchtitan's dp_shard_cp), and under ep with dp_replicate
        # alone: torchtitan's ep borrows its dp_shard (dp_shard_mod_ep = 1) and wraps every MoE stage, HSDP over the
        # replicas
        fsdp_stages = dp_shard > 1 or cp > 1 or (experts is not None and replicas > 1)
        if fsdp_stages:
            sharder = DpShard(self.distributed, dp_shard)
            sharder.refuse_finetune(step.finetune)
            if pipeline.schedule_kind not in _WITH_DP_SHARD:
                fsdp_mesh = (f"pp={self.degree},dp_shard={dp_shard}" if dp_shard > 1
                             else f"pp={self.degree},cp={cp}" if cp > 1
                             else f"pp={self.degree},dp_replicate={replicas},ep={ep}")
                raise InapplicableOptionError(
                    f"--mesh {fsdp_mesh} under the {pipeline.schedule_kind.value} schedule is "
                    f"not modelled yet: FSDP2 stages are checked against real runs under "
                    f"{', '.join(s.value for s in _WITH_DP_SHARD)} only (the zero-bubble and V schedules split "
                    f"each backward in two)",
                    hint="Use --pp-schedule 1f1b, gpipe or interleaved-1f1b with dp_shard.")
            if experts is None:  # under cp over dp_shard x cp (torchtitan's dp_shard_cp)
                program, fsdp_notes = fsdp_program(self.distributed.sharding, step, dp_shard * cp, pipelined=True)
            else:  # torchtitan's MoE FSDP per stage: the experts over dp_shard, the dense part over dp_shard x ep
                program, fsdp_notes = fsdp_program(self.distributed.sharding, step, dp_shard * ep, pipelined=True,
                                                   experts_degree=dp_shard, ep=ep, experts=experts.experts_paths,
                                                   owners=ep * tp)
            precision = sharder.trace_precision(step.precision)
            if dp_shard > 1:
                shard = (*shard, Shard((*MODEL_STATES, "batch"), "dp_shard", dp_shard))
            if replicas > 1:
                shard = (*shard, Shard(("batch",), "dp_replicate", replicas))
                group = "dp_shard" if dp_shard > 1 else "ep"
                meshes = ("the 2-D (dp_replicate, dp_shard) mesh" if experts is None else
                          "the 2-D (dp_replicate, dp_shard) mesh for the experts and (dp_replicate, dp_shard x ep) "
                          "for the rest" if dp_shard > 1 else
                          "(dp_replicate, a one-rank shard group) for the experts and (dp_replicate, ep) for the "
                          "rest: torchtitan's (dp_replicate, dp_shard_mod_ep = 1) and (dp_replicate, dp_shard_cp)")
                fsdp_notes.append(f"HSDP: {replicas} replicas of each stage's {group} group (fully_shard over "
                                  f"{meshes}, as torchtitan wraps its stages); the sharded gradients all-reduced "
                                  f"across them in place after the last microbatch")
        inner: InnerParallel | None = None
        if experts is not None:
            inner = experts if tp == 1 else StageExpertTensorParallel(experts, self._tp_strings(),
                                                                      optimizer_impl=self._tp_impl(step, fsdp_stages))
            program = _with_tp(inner, program)
            states = ("experts", "dense model states", "batch") if fsdp_stages else ("experts", "batch")
            shard = (*shard[:1], Shard(states, "ep", ep), *shard[1:])
            fsdp_notes.append(expert_notes(ep, experts.routing, experts.capacity_factor, dp_shard, tp)
                              if dp_shard > 1 or not fsdp_stages else
                              replicated_expert_notes(ep, experts.routing, experts.capacity_factor, tp))
        if tp > 1:
            if experts is None:
                inner = self._tensor_parallel(step, tp, fsdp_stages)
                program = _with_tp(inner, program)
            shard = (*shard[:1], Shard(MODEL_STATES, "tp", tp), *shard[1:])
        width = 1 if inner is None else inner.degree
        stage_step = replace(step, batch_size=batch)
        if ring is not None:  # each stage's program: the ring around FSDP2 over dp_shard x cp, at S/cp tokens
            assert program is not None
            program, stage_step = _ringed(ring, program, step), replace(stage_step, seq_len=ring.local_seq_len(step))
            shard = (*shard[:1], Shard(MODEL_STATES, "cp", cp), Shard(("sequence",), "cp", cp), *shard[1:])
            if dp_shard > 1:  # as the cp file says it: with dp_shard of one, FSDP2's note names the cp ranks
                fsdp_notes[0] += f" (dp_shard x cp = {dp_shard} x {cp}: torchtitan's dp_shard_cp mesh)"
            fsdp_notes.append(ring.note(stage_step.seq_len or 0, _balanced(step, cp), step))
        estimate = estimate_pipeline(stage_step, pipeline, costs=costs,
                                     stage_program=program, trace_precision=precision, inner=inner)
        report = estimate.as_report()
        # every pipeline rank runs the whole batch, microbatch by microbatch (a later stage's own report counts the
        # microbatch its stand-in input was built at); its dp_replicate, dp_shard, cp and tp (or ep) ranks share its
        # trace, numbered as torchtitan's mesh (pp, dp_replicate, dp_shard, cp, tp)
        roles = tuple(replace(role, sharding=shard, batch_size=batch,
                              ranks=tuple((((r * replicas + p) * dp_shard + d) * cp + c) * width + t for r in role.ranks
                                          for p in range(replicas) for d in range(dp_shard) for c in range(cp)
                                          for t in range(width)))
                      for role in report.roles)
        notes = (*report.notes, f"pipeline: {pipeline.describe()}, schedule from the installed torch", *fsdp_notes)
        return replace(report, distribution=replace(report.distribution, roles=roles), notes=notes,
                       step=replace(report.step, batch_size=batch))

    def _replicas(self, dp_shard: int, ep: int, cp: int) -> int:
        """The dp_replicate degree: HSDP around each stage's FSDP2, as torchtitan runs it (with ep
        and no dp_shard, FSDP2 over the ep ranks: torchtitan's ep borrows its dp_shard).

        Raises:
            InapplicableOptionError: dp_replicate without dp_shard or ep (DDP stages: torch's
                ``PipelineStage`` runs them, torchtitan does not, memcalc does not model them), or
                DDP's bucket options, which FSDP2 would ignore.
        """
        mesh = self.distributed.mesh
        replicas = 1 if mesh is None else mesh.dp_replicate
        if replicas == 1:
            return 1
        if dp_shard == 1 and ep == 1 and cp == 1:  # (with cp: refused in estimate, by name)
            raise InapplicableOptionError(
                f"pp={self.degree} with dp_replicate={replicas} alone (DDP stages) is not modelled yet: torch's "
                f"PipelineStage runs a DistributedDataParallel stage under no_sync until its last backward, which "
                f"memcalc does not trace; torchtitan replicates pipeline stages only as HSDP (with dp_shard)",
                hint=f"Give dp_shard too (--mesh pp={self.degree},dp_replicate={replicas},dp_shard=N: HSDP stages), "
                     f"or estimate the pipeline without dp_replicate.")
        setting = self.distributed
        if setting.bucket_cap_mb != DEFAULT_BUCKET_CAP_MB or setting.gradient_as_bucket_view:
            raise InapplicableOptionError(
                "bucket_cap_mb and gradient_as_bucket_view are DDP's; under HSDP (dp_replicate with dp_shard or ep) "
                "FSDP2 all-reduces its own reduce-scatter outputs and would ignore them",
                hint="Leave them out (--bucket-cap-mb, --gradient-as-bucket-view).")
        return replicas

    def _expert_parallel(self, ep: int, tp: int, replicas: int, dp_shard: int) -> StageExpertParallel:
        """ep inside every stage (:mod:`memcalc.distributed.ep_stages`), with tp's ranks borrowed for
        the experts (etp=1), refusing what is not modelled there: tp × ep with dp_replicate and dp_shard
        both, whose smallest real check is thirty-two processes (pp, dp_replicate, dp_shard, tp and ep of
        2), never run. Without dp_shard it is checked (sixteen processes:
        tests/test_gloo_pipeline_ep_tp_replicate.py).

        Raises:
            InapplicableOptionError: that mesh, or a transformers without expert parallelism.
        """
        if tp > 1 and replicas > 1 and dp_shard > 1:
            raise InapplicableOptionError(
                f"pp={self.degree} with ep={ep} and tp={tp} and dp_replicate={replicas} and dp_shard={dp_shard} is "
                f"not modelled yet: each stage would be pp x dp_shard x tp x ep's program with HSDP around it, as "
                f"torchtitan runs it, but memcalc checks every pipelined mesh against a real gloo run and this "
                f"one's smallest (pp=2 x dp_replicate=2 x dp_shard=2 x tp=2 x ep=2) takes thirty-two processes, "
                f"not run; without dp_shard (sixteen) it is checked",
                hint=f"Estimate --mesh pp={self.degree},dp_shard={dp_shard},tp={tp},ep={ep} (dp_replicate's "
                     f"all-reduce is in place around it), or pp={self.degree},dp_replicate={replicas},tp={tp},"
                     f"ep={ep} without dp_shard.")
        if not expert_parallelism_available():
            raise InapplicableOptionError(
                f"ep={ep} runs transformers' own expert parallelism (transformers.distributed.expert_parallel), "
                f"which the installed transformers does not have",
                hint="Install a transformers that has it (5.24 does), or estimate without ep.")
        setting = self.distributed
        if tp > 1:
            self._refuse_loss_parallel()
        return StageExpertParallel(ep * tp, setting.routing, setting.capacity_factor, tp=tp)

    def _refuse_beside_context_parallel(self, mesh: Mesh) -> None:
        """Refuse what cp inside pipeline stages is not checked with: ep and dp_replicate. Checked against
        real gloo runs (tests/test_gloo_pipeline_cp.py): pp × cp, pp × dp_shard × cp, pp × cp × tp and
        pp × dp_shard × cp × tp (sixteen processes).

        Raises:
            InapplicableOptionError: cp with ep or dp_replicate, named.
        """
        cp = mesh.cp
        others = {"ep": mesh.ep, "dp_replicate": mesh.dp_replicate}
        listed = ", ".join(f"{name}={degree}" for name, degree in others.items() if degree > 1)
        if listed:
            # without cp: dp_replicate needs dp_shard (or ep) beside it in a pipeline (HSDP stages)
            alone = listed.replace(", ", ",") + (",dp_shard=N" if mesh.dp_replicate > 1 and mesh.ep == 1 else "")
            raise InapplicableOptionError(
                f"pp={self.degree} with cp={cp} and {listed} is not modelled yet: memcalc composes context "
                f"parallelism inside pipeline stages with dp_shard or tp only (checked against real gloo runs of "
                f"torch's schedules with its ring attention: pp x cp, with dp_shard, tp or both)",
                hint=f"Estimate --mesh pp={self.degree},cp={cp} (dp_shard=N, tp=T or both beside it), or "
                     f"pp={self.degree},{alone} without cp.")

    def _context_parallel(self, cp: int, pipeline: Pipeline) -> ContextParallel:
        """cp inside every stage, as torchtitan runs it: each stage's attention a ring over the cp
        group (of each tp rank's local heads, after tp's plan), the microbatch's sequence sharded over
        it, FSDP2 over dp_shard x cp. Checked against real gloo runs (tests/test_gloo_pipeline_cp.py)
        under GPipe, 1F1B and Interleaved1F1B; the meshes it is not checked with are refused when the
        strategy is made (:meth:`_refuse_beside_context_parallel`).

        Raises:
            InapplicableOptionError: a zero-bubble or V schedule.
        """
        if pipeline.schedule_kind not in _WITH_DP_SHARD:
            raise InapplicableOptionError(
                f"pp={self.degree} with cp={cp} under the {pipeline.schedule_kind.value} schedule is not modelled "
                f"yet: each stage is FSDP2 over dp_shard x cp, whose stages are checked against real runs under "
                f"{', '.join(s.value for s in _WITH_DP_SHARD)} only (the zero-bubble and V schedules split each "
                f"backward in two)",
                hint=f"Use --pp-schedule {', '.join(s.value for s in _WITH_DP_SHARD)} with cp.")
        return ContextParallel(self.distributed, cp)

    def _tp_strings(self) -> dict[str, str] | None:
        plan = self.distributed.tp_plan
        return dict(plan) if plan is not None else None

    def _tp_impl(self, step: Step, fsdp: bool) -> OptimizerImpl | None:
        """The optimizer's implementation tp checks its plan against; None under FSDP2 (``fsdp``), where
        every parameter is a DTensor and foreach and fused optimizers step them all."""
        return None if fsdp else resolve_impl(step.optimizer, step.loop.optimizer_impl, cuda=step.emulate_cuda)

    def _refuse_loss_parallel(self) -> None:
        if self.distributed.loss_parallel:
            raise InapplicableOptionError(
                f"loss_parallel with pp={self.degree} is not modelled yet: the last stage's loss over sharded "
                f"logits is not traced inside a pipeline schedule",
                hint="Leave out --loss-parallel: the last stage gathers the logits.")

    def _tensor_parallel(self, step: Step, tp: int, fsdp: bool) -> StageTensorParallel:
        """tp inside every stage: the user's plan (or the model's), refusing what is not modelled there;
        ``fsdp``: FSDP2 wraps each stage (dp_shard or cp), so every parameter is a DTensor."""
        self._refuse_loss_parallel()
        return StageTensorParallel(tp, self._tp_strings(), lambda: stage_mesh("tp"),
                                   optimizer_impl=self._tp_impl(step, fsdp))


def _balanced(step: Step, cp: int) -> bool:
    """torch's head-tail load balancing: on when ``2·cp`` divides the sequence."""
    return step.seq_len is not None and step.seq_len % (2 * cp) == 0


def _ringed(ring: ContextParallel, fsdp: Callable[[ResolvedModel], RankProgram],
            step: Step) -> Callable[[ResolvedModel], RankProgram]:
    """Each stage's program: FSDP2 over dp_shard x cp, ring attention around it (the ring's patch
    of ``F.scaled_dot_product_attention`` is the process's: a rank's first stage makes it, and it
    rings the calls of every stage the rank holds)."""

    def program(stage: ResolvedModel) -> RankProgram:
        return RingAttentionProgram(ring.degree, fsdp(stage), load_balanced=_balanced(step, ring.degree),
                                    cpu=not step.emulate_cuda)

    return program


def _with_tp(inner: InnerParallel,
             fsdp: Callable[[ResolvedModel], RankProgram] | None) -> Callable[[ResolvedModel], RankProgram]:
    """Each stage's program: tensor parallelism, then FSDP2 over its DTensors (torchtitan's order)."""

    def program(stage: ResolvedModel) -> RankProgram:
        tp = inner.program(stage)
        return tp if fsdp is None else StackedProgram(tp, fsdp(stage))

    return program

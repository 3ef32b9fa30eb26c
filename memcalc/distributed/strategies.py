r"""Per-GPU memory under a multi-GPU strategy: one estimate per *role*.

A role is a distinct kind of GPU — every rank of DDP, FSDP and ZeRO holds the same;
DataParallel's output device holds more than its other devices. The setting's strategy objects
(:mod:`memcalc.distributed.strategy`: one per mesh dimension, or DataParallel's, or ZeRO's)
make the roles — which ranks, at what batch, under which rank program, sharded how — and say
the precision the ranks trace at and the fine-tuning they refuse. Each role's step is then
traced like a single-GPU step (:func:`memcalc.targets.backend.trace_step`) at the rank's batch,
with its rank program (:mod:`memcalc.distributed.program` and its siblings) allocating and
freeing what PyTorch or DeepSpeed would around the model. Ranks with the same role share one
trace. The report is the busiest role's, with every role in ``roles``. Fine-tuning
(``--freeze``, ``--lora``; ``--quant`` under DDP) is applied to each role's model before its
program wraps it.

What each strategy holds per GPU, how faithful each program is (DDP and FSDP2 agree to the
byte with the real classes run on the CPU), the ZeRO memory table and the batch conventions
are written up in docs/architecture.md, "Multi-GPU strategies".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.precision import Precision
from memcalc.core.report import Distribution, MemoryReport, RoleReport, busiest_role
from memcalc.distributed.ddp import trainer_finds_unused
from memcalc.distributed.depth_step import RoleTrace, cut_blocks, extrapolated_depth, traced_by_depth
from memcalc.distributed.program import model_states_at_step
from memcalc.distributed.setting import Distributed
from memcalc.distributed.strategy.base import Plan, RankStrategy, Role
from memcalc.distributed.strategy.catalogue import strategies_for
from memcalc.distributed.vocabulary import Strategy
from memcalc.engine.model import ResolvedModel
from memcalc.engine.optimizers import Optimizer, spec_for
from memcalc.engine.run import CostRecorderFactory, Replayed, build_report, replay_step
from memcalc.engine.step_spec import Step
from memcalc.stacks.float8 import apply_float8
from memcalc.stacks.kbit import kbit_checkpointing
from memcalc.stacks.peft import apply_finetune, step_precision
from memcalc.targets.backend import trace_step

__all__ = ("estimate_per_rank", "refuse_reentrant", "refuse_unused_reentrant")


# ============================================================================================
# The estimate
# ============================================================================================


def estimate_per_rank(step: Step, distributed: Distributed,
                      costs: CostRecorderFactory | None = None) -> MemoryReport:
    """One estimate per GPU role; the report of the busiest, with every role in ``roles``.
    ``costs``: the recorder of each role's kernels, when a step time is wanted
    (:func:`~memcalc.engine.run.trace_model`)."""
    strategies = strategies_for(distributed)
    for strategy in strategies:
        strategy.refuse_finetune(step.finetune)
    name = distributed.strategy.value
    if step.mode is Mode.GENERATE:  # the rank programs wrap a training or forward step
        raise InapplicableOptionError(f"mode generate is estimated on one GPU; --strategy {name} "
                                      f"is not modelled for a generation",
                                      hint="Leave out --strategy.")
    if step.parameter_dtype is not step.precision.parameter_dtype:
        raise InapplicableOptionError(
            f"weight_dtype (--weight-dtype) is not estimated under --strategy {name}: FSDP's "
            f"MixedPrecisionPolicy and DeepSpeed's 16-bit modes decide the parameters' dtype there, from --precision",
            hint="Leave out weight_dtype, or estimate one GPU (leave out --strategy).")
    inputs = step.inputs
    if inputs is not None and distributed.batch_is_global:
        raise InvalidInputError("inputs= are one GPU's inputs; batch_is_global needs batch_size instead")
    if inputs is not None:
        batch = step.resolved(batch_size=None).batch_size
    else:
        batch = 1 if step.batch_size is None else step.batch_size
        if batch < 1:
            raise InvalidInputError(f"batch size must be at least 1, got {batch}")
    _refuse_compile(step, strategies)
    whole = [strategy for strategy in strategies if strategy.whole_step]
    if whole:
        return _whole_step(whole[0], strategies, step, distributed, batch, costs)
    plan = Plan(roles=(), batch=batch, global_batch=distributed.global_batch(batch))
    trace_precision = step.precision
    for strategy in strategies:
        plan = strategy.plan(plan, step)
        trace_precision = strategy.trace_precision(trace_precision)
    results: list[RoleReport] = []
    for role in plan.roles:
        assert role.program is not None, f"no strategy gave {role.name!r} a rank program"
        role_step = step if role.seq_len is None else replace(step, seq_len=role.seq_len)

        def trace_with(resolved: ResolvedModel, role: Role = role, role_step: Step = role_step) -> RoleTrace:
            """The role's traced step on ``resolved``."""
            assert role.program is not None
            program = role.program(resolved)
            spec = step.optimizer if role.optimizer else spec_for(Optimizer.NONE)
            precision = step_precision(resolved, step.finetune, trace_precision, step.mode)  # a QLoRA recipe's
            kbit_step = _kbit_checkpointing(resolved, role_step, distributed)
            refuse_unused_reentrant(resolved, kbit_step, distributed)
            traced_step = replace(kbit_step, precision=precision, optimizer=program.optimizer_spec(spec),
                                  loss_fn=role.loss_fn or step.loss_fn)
            traced = trace_step(resolved, traced_step, hooks=program, costs=costs)
            if role.loss_text is not None:
                traced.loss = role.loss_text
            traced.notes.extend([*plan.notes, *program.notes, *kbit_step.notes[len(role_step.notes):]])
            return RoleTrace(traced, frozenset(program.communication))

        def model_at(depth: int | None, role: Role = role, role_step: Step = role_step) -> ResolvedModel:
            return _role_model(role, role_step, step, inputs, strategies, trace_precision, depth)

        resolved = model_at(None)
        depth = extrapolated_depth(resolved, step) if _by_depth(distributed) else None
        composed = None if depth is None else traced_by_depth(lambda n: trace_with(model_at(n)), depth,
                                                               resolved.block_containers)
        traced, communication = composed if composed is not None else trace_with(resolved)
        replayed = replay_step(traced, step)  # one replay: the report's, and the buffers alive at its peak
        report = build_report(resolved, traced, step, role=role.name, replayed=replayed)  # its timeline names the role
        results.append(RoleReport(
            name=role.name, ranks=role.ranks, batch_size=resolved.batch_size,
            model_states=model_states_at_step(traced, communication),
            communication=_alive_at_peak(replayed, traced.trace.nbytes, communication), report=report,
            sharding=role.sharding))
    busiest = busiest_role(tuple(results))
    assert busiest is not None
    mesh = None if distributed.mesh is None else distributed.mesh.degrees
    return replace(busiest.report, distribution=Distribution(
        strategy=distributed.strategy.value, world_size=distributed.world_size,
        global_batch_size=plan.global_batch, roles=tuple(results), mesh=mesh))




#: The strategies whose rank programs follow torch's reentrant checkpoint (``use_reentrant=True``),
#: each checked against the real thing: DDP and FSDP2 against two-process gloo runs, with the
#: checkpoint inside the block's hooks (transformers' layers) and outside them (memcalc's wrapped
#: blocks) (tests/test_reentrant_ddp.py); ZeRO-3 against DeepSpeed's own hooks (tests/test_reentrant_zero3.py).
_REENTRANT_CHECKED = (Strategy.DDP, Strategy.FSDP, Strategy.ZERO3)


def refuse_reentrant(distributed: Distributed) -> None:
    """Refuse reentrant checkpointing under a strategy it was not checked under: the others run
    collectives or schedules (tensor, context, expert parallelism, pipelines, ZeRO-1/2's
    partitioned gradients, HSDP's mesh) whose interplay with the checkpoint's inner backward no real
    run here has compared."""
    if distributed.strategy in _REENTRANT_CHECKED:
        return
    checked = ", ".join(s.value for s in _REENTRANT_CHECKED)
    raise InapplicableOptionError(f"reentrant checkpointing (use_reentrant=True) under --strategy "
                                  f"{distributed.strategy.value} is not modelled: it is checked on one GPU and "
                                  f"under {checked} only",
                                  hint="Use the non-reentrant checkpoint there (use_reentrant=False, "
                                       f"--checkpoint full), or estimate one GPU or {checked}.")


def _kbit_checkpointing(resolved: ResolvedModel, step: Step, distributed: Distributed) -> Step:
    """``step`` with the checkpoint kind PEFT's ``prepare_model_for_kbit_training`` set up on the
    role's model (:func:`memcalc.stacks.kbit.kbit_checkpointing`: reentrant in QLoRA's own loop), as on
    one GPU; refused where reentrance is not checked."""
    made = kbit_checkpointing(resolved.module, step)
    if made.checkpoint.reentrant and not step.checkpoint.reentrant:
        refuse_reentrant(distributed)
    return made


def refuse_unused_reentrant(resolved: ResolvedModel, step: Step, distributed: Distributed) -> None:
    """Refuse the Trainer's DDP with ``find_unused_parameters=True`` around the reentrant checkpoint:
    the real run fails there. The Trainer (transformers 5.25, ``_build_accelerator_args``) passes
    ``ddp_find_unused_parameters``, or when unset True for a model that is not a ``PreTrainedModel``
    (a ``PeftModel`` among them: LoRA) and ``not is_activation_checkpointing`` for one that is. The
    parameters a reentrant block uses are unreachable from the output (its forward ran under
    ``no_grad``), so DDP marks them unused, then sees their gradients in the recomputation: "Expected
    to mark a variable ready only once" (two gloo ranks, tests/test_reentrant_gloo_options.py, where
    ``find_unused_parameters`` and ``static_graph`` otherwise change no byte)."""
    preset = step.loop.preset
    if not (distributed.strategy is Strategy.DDP and step.checkpoint.reentrant and preset is not None
            and preset.is_trainer and step.trainer_args is not None):
        return
    if not trainer_finds_unused(resolved.trained_model, step):
        return
    given = step.trainer_args.ddp_find_unused_parameters
    peft = step.finetune.lora is not None  # the Trainer is handed the PeftModel
    why = ("ddp_find_unused_parameters=True" if given else
           "ddp_find_unused_parameters is unset, so the Trainer passes find_unused_parameters=True for a model "
           f"that is not a PreTrainedModel ({'a PeftModel' if peft else 'a plain torch module'})")
    raise InapplicableOptionError(f"loop {step.loop.name} under --strategy ddp with reentrant checkpointing fails in "
                                  f"the real run: {why}, and DistributedDataParallel(find_unused_parameters=True) "
                                  f"marks the reentrant blocks' parameters unused, then sees their gradients "
                                  f"(torch: 'Expected to mark a variable ready only once')",
                                  hint="Set ddp_find_unused_parameters=False in the TrainingArguments (torch's notes "
                                       "ask for it with the reentrant checkpoint), or use_reentrant=False.")


#: Meshes whose rank programs a deep model's step is composed under from shallow ones
#: (:mod:`memcalc.distributed.depth_step`): FSDP2 or HSDP (FSDP2 replicated over ``dp_replicate``),
#: alone or over tensor parallelism, and context parallelism's ring around FSDP2 over ``dp_shard ×
#: cp`` (or the cp ranks alone), with tensor parallelism or without (dp_replicate with cp is not
#: modelled). Tensor parallelism alone is left out: its optimizer all-reduces the replicated
#: parameters' Partial gradients in nested groups the composition does not place, and its check
#: would decline after three shallow traces. Each composition is still checked against a traced
#: 4-block step before it is used (tests/test_depth_step.py: cp cases byte for byte).
_BY_DEPTH = (*(frozenset(dims) | replicate for dims in ({"dp_shard"}, {"dp_shard", "tp"})
               for replicate in (frozenset(), frozenset({"dp_replicate"}))),
             *(frozenset(dims) for dims in ({"cp"}, {"cp", "tp"}, {"dp_shard", "cp"}, {"dp_shard", "cp", "tp"})))


def _by_depth(distributed: Distributed) -> bool:
    mesh = distributed.mesh
    return mesh is not None and frozenset(mesh.used) in _BY_DEPTH


def _role_model(role: Role, role_step: Step, step: Step, inputs: object, strategies: list[RankStrategy],
                trace_precision: Precision, depth: int | None) -> ResolvedModel:
    """The role's model as its rank program wraps it; ``depth``: cut to that many blocks per container."""
    resolved = role_step.resolved(batch_size=None if inputs is not None else role.batch)
    if depth is not None:
        cut_blocks(resolved, depth)
    resolved = apply_finetune(resolved, step.finetune, precision=step.precision, mode=step.mode,
                              checkpoint=bool(step.checkpoint))
    resolved = apply_float8(resolved, step.float8)
    precision = step_precision(resolved, step.finetune, trace_precision, step.mode)  # a QLoRA recipe's
    if step.loop.preset is not None and step.loop.preset.is_trl:  # TRL's trainer at the rank's precision
        from memcalc.stacks.trl.step import trl_model  # TRL's stack only for its loops (issue 36)

        resolved = trl_model(resolved, replace(role_step, precision=precision))
    for strategy in strategies:
        resolved = strategy.prepare(resolved, trace_precision)
    return resolved


#: Dimensions whose rank program runs around blocks compiled one by one (DDP's ``replicate``
#: and FSDP2's ``fully_shard`` hooks stay eager around them, as in torchtitan's apply_compile).
_COMPILED_WITH = frozenset({"dp_replicate", "dp_shard"})


def _refuse_compile(step: Step, strategies: list[RankStrategy]) -> None:
    """A compiled step, and torchao's float8 Linear layers, are modelled under DDP and FSDP2 only
    (each block compiled on its own; float8 weights all-gathered in FSDP2's param_dtype and cast
    by torchao in each forward, torchtitan's default)."""
    if step.float8 is not None and step.float8.fsdp_all_gather and not any(s.name == "dp_shard" for s in strategies):
        raise InapplicableOptionError(
            "float8 (--float8) with enable_fsdp_float8_all_gather (--float8-all-gather) is FSDP2's float8 all-gather; "
            "the strategy shards no parameters (no dp_shard)",
            hint="Use --strategy fsdp (or a mesh with dp_shard), or leave out the float8 all-gather.")
    others = [s.name for s in strategies if s.name not in _COMPILED_WITH]
    if not others:
        return
    if step.compile:
        raise InapplicableOptionError(
            f"compile (--compile) under {', '.join(others)} is not modelled: memcalc compiles each block under "
            f"DDP (dp_replicate) and FSDP2 (dp_shard) only",
            hint="Leave out --compile to estimate the strategy eager, or use --strategy ddp or fsdp.")
    if step.float8 is not None:
        raise InapplicableOptionError(
            f"float8 (--float8) under {', '.join(others)} is not modelled: memcalc traces torchao's float8 Linear "
            f"layers under DDP (dp_replicate) and FSDP2 (dp_shard) only",
            hint="Leave out --float8, or use --strategy ddp or fsdp.")


def _whole_step(strategy: RankStrategy, strategies: list[RankStrategy], step: Step, distributed: Distributed,
                batch: int, costs: CostRecorderFactory | None) -> MemoryReport:
    """The estimate of a dimension that runs the whole step itself (a pipeline), alone on the mesh."""
    others = [s.name for s in strategies if s is not strategy and s.name not in strategy.composes_with]
    if others:
        assert distributed.mesh is not None
        raise InapplicableOptionError(
            f"the mesh {distributed.mesh.describe()}: {strategy.name} composed with {', '.join(others)} is not "
            f"modelled yet (each pipeline rank is estimated with torch's own schedule"
            + (f"; it composes with {', '.join(sorted(strategy.composes_with))} only)" if strategy.composes_with
               else ")"),
            hint=f"Estimate the pipeline alone (--mesh {strategy.name}={strategy.degree})"
                 + "".join(f" or with {d} (--mesh {strategy.name}={strategy.degree},{d}=N)"
                           for d in sorted(strategy.composes_with)) + ".")
    report = strategy.estimate(step, distributed.per_rank_batch(batch), costs)
    mesh = None if distributed.mesh is None else distributed.mesh.degrees
    return replace(report, distribution=replace(
        report.distribution, strategy=distributed.strategy.value, world_size=distributed.world_size,
        global_batch_size=distributed.global_batch(batch), mesh=mesh))


def _alive_at_peak(replayed: Replayed, nbytes: list[int], uids: set[int]) -> int:
    """Bytes of the storages ``uids`` alive at the replayed peak allocated."""
    if not uids:
        return 0
    program = replayed.program
    n = program.num_storages
    alive = 0
    for event in program.events[: max(replayed.whole.peak_index, 0) + 1]:
        uid = (event if event >= 0 else ~event) % n
        if uid in uids:
            alive += nbytes[uid] if event >= 0 else -nbytes[uid]
    return alive

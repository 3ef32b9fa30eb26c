r"""Per-GPU memory under DataParallel, DDP, FSDP and DeepSpeed ZeRO: the *roles* of each
strategy and one estimate per role.

A role is a distinct kind of GPU — every rank of DDP, FSDP and ZeRO holds the same;
DataParallel's output device holds more than its other devices. Each role's step is traced
like a single-GPU step (:func:`memcalc.targets.backend.trace_step`) at the rank's batch, with the
strategy's rank program (:mod:`memcalc.distributed.program` and its siblings) allocating and
freeing what PyTorch or DeepSpeed would around the model. The report is the busiest role's,
with every role in ``roles``. Fine-tuning (``--freeze``, ``--lora``; ``--quant`` under DDP)
is applied to each role's model before its program wraps it (:func:`refuse_finetune` says
what is not modelled).

What each strategy holds per GPU, how faithful each program is (DDP and FSDP2 agree to the
byte with the real classes run on the CPU), the ZeRO memory table and the batch conventions
are written up in docs/architecture.md, "Multi-GPU strategies".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.core.losses import LossFn
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport, RoleReport
from memcalc.core.units import format_bytes
from memcalc.distributed.ddp import DdpProgram
from memcalc.distributed.dp import DataParallelOutputDevice, DataParallelReplica
from memcalc.distributed.fsdp import ShardedProgram, fsdp_units, module_units
from memcalc.distributed.options import DEEPSPEED_REDUCE_BUCKET_SIZE, Distributed, FsdpSharding, Strategy, dp_chunks
from memcalc.distributed.program import RankProgram
from memcalc.distributed.zero import ZeroProgram
from memcalc.engine import allocator
from memcalc.engine.model import ResolvedModel
from memcalc.engine.optimizers import Optimizer, spec_for
from memcalc.engine.options import Step
from memcalc.engine.prepare import KEEP_DTYPE
from memcalc.engine.run import CostRecorderFactory, TracedStep, build_report
from memcalc.engine.timeline import allocator_events
from memcalc.stacks.peft import apply_finetune, step_precision
from memcalc.targets.backend import trace_step

__all__ = ("estimate_per_rank", "refuse_finetune")

_MIB = 1024 * 1024


# ============================================================================================
# The roles of a strategy and their programs
# ============================================================================================


@dataclass(frozen=True)
class _Role:
    name: str
    ranks: tuple[int, ...]
    batch: int
    program: Callable[[ResolvedModel], RankProgram]
    optimizer: bool = True  # False: this GPU runs no optimizer (DataParallel's other devices)
    loss_fn: LossFn | None = None
    loss_text: str | None = None


def _roles(dist: Distributed, batch: int, options: Step) -> tuple[list[_Role], int, list[str]]:
    """The roles, the global batch, and notes that apply to every role."""
    training = options.mode is Mode.TRAIN
    n = dist.world_size
    every = tuple(range(n))
    notes: list[str] = []
    strategy = dist.strategy
    if strategy is Strategy.DP:
        global_batch = batch if dist.batch_is_global else batch * n
        chunks = dp_chunks(global_batch, n)
        primary = dist.device_ids[0]
        roles = [_Role(f"output device (cuda:{primary})", (primary,), chunks[0],
                       lambda r: DataParallelOutputDevice(chunks, training))]
        others = dist.device_ids[1:len(chunks)]
        if others:
            roles.append(_Role("other devices", tuple(others), max(chunks[1:]),
                               lambda r: DataParallelReplica(training), optimizer=False,
                               loss_fn=_sent_output, loss_text=f"computed on cuda:{primary}"))
        idle = dist.device_ids[len(chunks):]
        if idle:
            notes.append(f"the batch of {global_batch} fills only {len(chunks)} of {n} devices: "
                         f"cuda:{', cuda:'.join(map(str, idle))} get no chunk (torch.chunk)")
        notes.append("DataParallel replicas of the parameters and buffers are counted as alive for the whole "
                     "forward and backward (they are broadcast at each forward)")
        return roles, global_batch, notes
    per_rank = dist.per_rank_batch(batch)
    global_batch = per_rank * n
    if strategy is Strategy.DDP:
        cap = int(dist.bucket_cap_mb * _MIB)
        view = dist.gradient_as_bucket_view
        notes.append(f"DDP gradient buckets of {dist.bucket_cap_mb:g} MiB, gradient_as_bucket_view={view}"
                     + ("" if view else ": the buckets are a second copy of the gradients"))
        return [_Role("every rank", every, per_rank, lambda r: DdpProgram(cap, view, training))], global_batch, notes
    if strategy is Strategy.FSDP:
        mixed = options.precision.is_amp
        low = options.precision.compute_dtype
        reshard = dist.sharding is FsdpSharding.FULL_SHARD
        notes.append(f"FSDP2 {dist.sharding.value.upper()} over {n} ranks"
                     + (f"; MixedPrecisionPolicy(param_dtype={_dtype(low)}, reduce_dtype=float32): the model "
                        f"computes in {_dtype(low)} without autocast" if mixed else ""))
        if options.precision is Precision.AMP_FP16:
            notes.append("fp16 under FSDP needs ShardedGradScaler; its (small) buffers are not modelled")

        def fsdp(resolved: ResolvedModel) -> RankProgram:
            containers = resolved.block_containers
            units = fsdp_units(resolved.module, containers)
            return ShardedProgram(units, n, style="fsdp2", reshard_after_forward=reshard,
                                  sharded_dtype=torch.float32 if mixed else None,
                                  gather_dtype=low if mixed else None,
                                  reduce_dtype=torch.float32 if mixed else None, training=training,
                                  cpu=not options.emulate_cuda)

        return [_Role("every rank", every, per_rank, fsdp)], global_batch, notes
    stage = strategy.zero_stage
    assert stage is not None
    bucket = dist.reduce_bucket_size
    sixteen = options.precision is not Precision.FP32
    itemsize = 2 if sixteen else 4
    notes.append(f"DeepSpeed ZeRO-{stage} over {n} ranks"
                 + (f": the model in {_dtype(options.precision.compute_dtype)}, fp32 master partition"
                    if sixteen else ": fp32 model, fp32 master partition"))
    if training:
        notes.append(f"DeepSpeed's reduce bucket: {format_bytes(bucket * itemsize)} (reduce_bucket_size "
                     f"{bucket:,} elements; DeepSpeed's default is {DEEPSPEED_REDUCE_BUCKET_SIZE:,})")
    if stage == 3:
        notes.append("ZeRO-3 gathers one module at a time and prefetches the next; stage3_prefetch_bucket_size, "
                     "max_live_parameters, max_reuse_distance and param_persistence_threshold are not modelled")

    def zero(resolved: ResolvedModel) -> RankProgram:
        sharded = None
        if stage == 3:
            sharded = ShardedProgram(module_units(resolved.module), n, style="deepspeed", reshard_after_forward=True,
                                     sharded_dtype=None, gather_dtype=None, reduce_dtype=None, training=training,
                                     reduce_bucket_size=bucket)
        return ZeroProgram(stage, n, bucket, training, sharded=sharded)

    return [_Role("every rank", every, per_rank, zero)], global_batch, notes


def _sent_output(output: torch.Tensor) -> torch.Tensor:
    return output  # DataParallelReplica made the output a scalar standing for the sent tensors


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _trace_precision(strategy: Strategy, precision: Precision) -> Precision:
    """The precision the traced step runs at. DeepSpeed runs the model itself in 16-bit; FSDP's
    mixed precision keeps the model's parameters (and inputs, buffers) as they are and casts
    what it gathers (and the root's inputs): the program does that, without autocast."""
    if strategy is Strategy.FSDP and precision.is_amp:
        return Precision.FP32
    if strategy.zero_stage is not None and precision is not Precision.FP32:
        return Precision.BF16 if precision.uses_bf16 else Precision.FP16
    return precision


# ============================================================================================
# Fine-tuning under a strategy
# ============================================================================================


def refuse_finetune(strategy: Strategy, finetune: FineTune) -> None:
    """Refuse the fine-tuning options a strategy's rank program does not model faithfully.

    Frozen parameters and LoRA adapters are applied to each role's model before its program
    wraps it, as real code calls ``peft.get_peft_model`` before ``DistributedDataParallel``,
    ``fully_shard`` or ``deepspeed.initialize``. A quantized base is left to DDP, whose
    replicas hold the model as it is.

    Raises:
        InapplicableOptionError: any fine-tuning option under ``dp``; ``--quant`` under
            ``fsdp`` or ``zero*``.
    """
    if finetune.is_empty:
        return
    name = strategy.value
    if strategy is Strategy.DP:
        # Broadcast.forward marks the replicas of frozen parameters non-differentiable, and an
        # autograd Function receives zeros for those outputs (materialize_grads), which
        # Broadcast.backward reduces with the real gradients (torch/nn/parallel/_functions.py)
        raise InapplicableOptionError(
            "fine-tuning options (--freeze, --lora, --quant) are not estimated under --strategy dp: DataParallel "
            "gives every frozen parameter's replica a zero gradient in backward and reduces them onto the output "
            "device (torch.nn.parallel Broadcast/ReduceAddCoalesced), which memcalc does not model",
            hint="Use --strategy ddp (PyTorch recommends it over DataParallel), or leave out --strategy.")
    if finetune.quant is None or strategy is Strategy.DDP:
        return
    quant = finetune.quant.value
    if strategy is Strategy.FSDP:
        raise InapplicableOptionError(
            f"--quant {quant} is not estimated under --strategy fsdp: sharding a bitsandbytes base needs "
            f"bnb_4bit_quant_storage (the packed weights stored in a float dtype so that fully_shard can split "
            f"them, the quantization statistics left whole), which memcalc does not model",
            hint="Use --strategy ddp for QLoRA on several GPUs, or leave out --quant (FSDP with --lora or --freeze "
                 "is estimated).")
    raise InapplicableOptionError(
        f"--quant {quant} is not estimated under --strategy {name}: DeepSpeed's handling of a bitsandbytes base "
        f"(its 16-bit cast of the model, ZeRO-3's partitioning through bnb_4bit_quant_storage) is not modelled",
        hint=f"Use --strategy ddp for QLoRA on several GPUs, or leave out --quant (--strategy {name} with --lora "
             f"or --freeze is estimated).")


def _finetuned(resolved: ResolvedModel, strategy: Strategy, options: Step,
               trace_precision: Precision) -> ResolvedModel:
    """One role's model with the fine-tuning applied, ready for its program to wrap."""
    resolved = apply_finetune(resolved, options.finetune, precision=options.precision, mode=options.mode,
                              checkpoint=bool(options.checkpoint))
    module = resolved.module
    if strategy is Strategy.DDP and not any(p.requires_grad for p in module.parameters()):
        # DistributedDataParallel.__init__ raises the same (_log_and_throw, RuntimeError)
        raise InapplicableOptionError(
            "DistributedDataParallel refuses a module none of whose parameters requires a gradient: "
            "nothing would train",
            hint="Freeze fewer parameters, or estimate the step on one GPU (leave out --strategy).")
    kept = [p for p in module.parameters() if hasattr(p, KEEP_DTYPE)]
    if strategy.zero_stage is not None and trace_precision.parameter_dtype is not torch.float32 and kept:
        # DeepSpeed's engine casts the whole module to 16-bit (_configure_distributed_model:
        # module.half() / module.bfloat16()), PEFT's float32 adapters included
        for p in kept:
            delattr(p, KEEP_DTYPE)
        note = f"DeepSpeed casts the whole model to {_dtype(trace_precision.parameter_dtype)}, the LoRA adapters too"
        resolved = replace(resolved, notes=(*resolved.notes, note))
    return resolved


# ============================================================================================
# The estimate
# ============================================================================================


def estimate_per_rank(step: Step, distributed: Distributed,
                      costs: CostRecorderFactory | None = None) -> MemoryReport:
    """One estimate per GPU role; the report of the busiest, with every role in ``roles``.
    ``costs``: the recorder of each role's kernels, when a step time is wanted
    (:func:`~memcalc.engine.run.trace_model`)."""
    refuse_finetune(distributed.strategy, step.finetune)
    if step.mode is Mode.GENERATE:  # the rank programs wrap a training or forward step
        raise InapplicableOptionError(f"mode generate is estimated on one GPU; --strategy {distributed.strategy.value} "
                                      f"is not modelled for a generation",
                                      hint="Leave out --strategy.")
    if step.parameter_dtype is not step.precision.parameter_dtype:
        raise InapplicableOptionError(
            f"weight_dtype (--weight-dtype) is not estimated under --strategy {distributed.strategy.value}: FSDP's "
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
    roles, global_batch, notes = _roles(distributed, batch, step)
    trace_precision = _trace_precision(distributed.strategy, step.precision)
    if trace_precision is not step.precision and distributed.strategy.zero_stage is not None \
            and not step.precision.is_amp:
        notes.append("DeepSpeed keeps fp32 master weights in its fp16/bf16 modes too")
    results: list[RoleReport] = []
    for role in roles:
        resolved = step.resolved(batch_size=None if inputs is not None else role.batch)
        resolved = _finetuned(resolved, distributed.strategy, step, trace_precision)
        program = role.program(resolved)
        spec = step.optimizer if role.optimizer else spec_for(Optimizer.NONE)
        precision = step_precision(resolved, step.finetune, trace_precision, step.mode)  # a QLoRA recipe's
        traced_options = replace(step, precision=precision, optimizer=program.optimizer_spec(spec),
                                 loss_fn=role.loss_fn or step.loss_fn)
        traced = trace_step(resolved, traced_options, hooks=program, costs=costs)
        if role.loss_text is not None:
            traced.loss = role.loss_text
        traced.notes.extend([*notes, *program.notes])
        report = build_report(resolved, traced, step, role=role.name)  # its timeline names the role
        results.append(RoleReport(
            name=role.name, ranks=role.ranks, batch_size=resolved.batch_size,
            model_states=_model_states(traced, program.communication),
            communication=_alive_at_peak(traced, program.communication, step.allocator_settings), report=report))
    busiest = replace(results[0].report, roles=tuple(results)).busiest_role
    assert busiest is not None
    return replace(busiest.report, strategy=distributed.strategy.value, world_size=distributed.world_size,
                   global_batch_size=global_batch, roles=tuple(results))


_MODEL_STATES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


def _model_states(traced: TracedStep, communication: set[int]) -> int:
    """Parameters + gradients + optimizer state (not collective buffers) alive during the
    optimizer step — their largest sum between ``step()`` starting and ``zero_grad()`` (or,
    without an optimizer, at ``zero_grad()``; in eval, at the end)."""
    trace = traced.trace
    categories = traced.categories

    def counted(uid: int) -> bool:
        return categories[uid] in _MODEL_STATES and uid not in communication

    alive = sum(trace.nbytes[u] for u in trace.preexisting if counted(u))
    end = trace.phase_starts.get(Phase.ZERO_GRAD, len(trace.events))
    start = trace.phase_starts.get(Phase.OPTIMIZER, end)
    best = 0
    for index, event in enumerate(trace.events[:end]):
        if index >= start:
            best = max(best, alive)
        uid = event if event >= 0 else ~event
        if counted(uid):
            alive += trace.nbytes[uid] if event >= 0 else -trace.nbytes[uid]
    return max(best, alive)


def _alive_at_peak(traced: TracedStep, uids: set[int], settings: AllocConf | None = None) -> int:
    """Bytes of the storages ``uids`` alive at the replayed peak allocated."""
    if not uids:
        return 0
    program = traced.program()
    nbytes = traced.trace.nbytes
    stats = allocator.replay(allocator_events(program, nbytes), settings=settings,
                             host=not traced.options.emulate_cuda)
    n = program.num_storages
    alive = 0
    for event in program.events[: max(stats.peak_index, 0) + 1]:
        uid = (event if event >= 0 else ~event) % n
        if uid in uids:
            alive += nbytes[uid] if event >= 0 else -nbytes[uid]
    return alive

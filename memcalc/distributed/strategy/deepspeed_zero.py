"""``zero1`` / ``zero2`` / ``zero3``: DeepSpeed ZeRO over its flat data-parallel group
(:class:`~memcalc.distributed.zero.ZeroProgram`; ZeRO-3's gathered modules through
:class:`~memcalc.distributed.fsdp.ShardedProgram` in DeepSpeed's style). Not a torch device
mesh. The model runs in 16-bit under a 16-bit precision and the optimizer steps an fp32 master
partition; the memory table is in docs/architecture.md, "Multi-GPU strategies"."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.finetune import FineTune
from memcalc.core.precision import Precision
from memcalc.core.report import Shard
from memcalc.core.units import format_bytes
from memcalc.distributed.fsdp import ShardedProgram, module_units
from memcalc.distributed.program import RankProgram
from memcalc.distributed.strategy.base import Plan, RankStrategy, every_rank, register, sharding
from memcalc.distributed.vocabulary import DEEPSPEED_REDUCE_BUCKET_SIZE, Strategy, ZeroStage3
from memcalc.distributed.zero import ZeroProgram
from memcalc.engine.model import ResolvedModel
from memcalc.engine.prepare import KEEP_DTYPE
from memcalc.engine.step_spec import Step
from memcalc.stacks.trl.grpo import GrpoStepModule
from memcalc.stacks.trl.step import TrlStepModule

__all__ = ("DeepSpeedZero",)

#: What each stage partitions over the ranks (the ZeRO paper's P_os, P_os+g, P_os+g+p).
_PARTITIONED = {1: ("optimizer_state",), 2: ("gradients", "optimizer_state"),
                3: ("parameters", "gradients", "optimizer_state")}


@register(Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)
class DeepSpeedZero(RankStrategy):
    """DeepSpeed ZeRO stage 1, 2 or 3."""

    name = "zero"
    options = frozenset({"reduce_bucket_size", "overlap_comm", "offload_optimizer", "stage3"})

    @property
    def stage(self) -> int:
        """1, 2 or 3."""
        stage = self.distributed.strategy.zero_stage
        assert stage is not None
        return stage

    def trace_precision(self, precision: Precision) -> Precision:
        """DeepSpeed runs the model itself in 16-bit (fp16 or bf16), keeping fp32 master weights."""
        if precision is Precision.FP32:
            return precision
        return Precision.BF16 if precision.uses_bf16 else Precision.FP16

    def refuse_finetune(self, finetune: FineTune) -> None:
        if finetune.quant is None:
            return
        name = self.distributed.strategy.value
        raise InapplicableOptionError(
            f"--quant {finetune.quant.value} is not estimated under --strategy {name}: DeepSpeed's handling of a "
            f"bitsandbytes base (its 16-bit cast of the model, ZeRO-3's partitioning through "
            f"bnb_4bit_quant_storage) is not modelled",
            hint=f"Use --strategy ddp for QLoRA on several GPUs, or leave out --quant (--strategy {name} with "
                 f"--lora or --freeze is estimated).")

    def prepare(self, resolved: ResolvedModel, trace_precision: Precision) -> ResolvedModel:
        kept = [p for p in resolved.module.parameters() if hasattr(p, KEEP_DTYPE)]
        if trace_precision.parameter_dtype is torch.float32 or not kept:
            return resolved
        # DeepSpeed's engine casts the whole module to 16-bit (_configure_distributed_model:
        # module.half() / module.bfloat16()), PEFT's float32 adapters included
        for p in kept:
            delattr(p, KEEP_DTYPE)
        note = f"DeepSpeed casts the whole model to {_dtype(trace_precision.parameter_dtype)}, the LoRA adapters too"
        return replace(resolved, notes=(*resolved.notes, note))

    def plan(self, plan: Plan, step: Step) -> Plan:
        plan = every_rank(plan, self.distributed)
        stage, n = self.stage, self.degree
        bucket = self.distributed.reduce_bucket_size
        overlap, offload = self.distributed.overlap_comm, self.distributed.offload_optimizer
        precision = step.precision
        sixteen = precision is not Precision.FP32
        training = step.mode is Mode.TRAIN
        if stage == 3 and overlap:
            raise InapplicableOptionError(
                "overlap_comm is modelled for ZeRO stages 1 and 2; ZeRO-3's (its double buffers) is not modelled yet",
                hint="Estimate ZeRO-3 without it, or stage 2 with it.")
        stage3 = self.distributed.stage3
        generation = _grpo_generation(step, stage3 or ZeroStage3()) if stage == 3 else None
        master = "fp32 master partition" + (" on the host" if offload and training else "")
        notes = [f"DeepSpeed ZeRO-{stage} over {n} ranks"
                 + (f": the model in {_dtype(precision.compute_dtype)}, {master}" if sixteen
                    else f": fp32 model, {master}")]
        if training:
            notes.append(f"DeepSpeed's reduce bucket: {format_bytes(bucket * (2 if sixteen else 4))} "
                         f"(reduce_bucket_size {bucket:,} elements; DeepSpeed's default is "
                         f"{DEEPSPEED_REDUCE_BUCKET_SIZE:,})" + (", twice: overlap_comm" if overlap else ""))
        if training and offload:
            notes.append("offload_optimizer to the CPU: the fp32 master partition, the optimizer state and the "
                         "gradient partition are in host memory, and the optimizer steps there (not counted here)")
        if stage3 is not None:
            notes.append(_stage3_note(stage3, training))
        if generation is not None:
            notes.append(generation)

        def zero(resolved: ResolvedModel) -> RankProgram:
            sharded = None
            if stage == 3:
                engines = _engines(resolved)
                units = [u for path in engines for u in module_units(resolved.module.get_submodule(path), path)]
                sharded = ShardedProgram(units, n, style="deepspeed",
                                         reshard_after_forward=True, sharded_dtype=None, gather_dtype=None,
                                         reduce_dtype=None, training=training, reduce_bucket_size=bucket,
                                         stage3=stage3, host_gradients=offload, engines=engines)
                if isinstance(resolved.module, (TrlStepModule, GrpoStepModule)):  # TRL's fused LM head gathers
                    resolved.module.zero3_gather = sharded.gathered_parameters  # the head itself
                if isinstance(resolved.module, GrpoStepModule):  # unwrap_model_for_generation's gathering
                    resolved.module.zero3_generation = functools.partial(sharded.gathered_for_generation, "policy")
            return ZeroProgram(stage, n, bucket, training, sharded=sharded, overlap_comm=overlap,
                               offload_optimizer=offload)

        label = self.distributed.strategy.value
        shard = Shard((*_PARTITIONED[stage], "batch"), label, n)
        roles = tuple(replace(role, program=zero, sharding=sharding(role.sharding, shard)) for role in plan.roles)
        return replace(plan, roles=roles, notes=(*plan.notes, *notes))


def _engines(resolved: ResolvedModel) -> tuple[str, ...]:
    """The modules DeepSpeed wraps in an engine each: the model; under a TRL trainer the policy (the
    trainer's engine) and the frozen reference, which TRL's ``prepare_deepspeed`` wraps in a second
    engine of the same stage-3 config in eval mode, with no optimizer (``DeepSpeedZeRoOffload``: its own
    coordinator, persistent parameters and prefetch; no gradient partition, no reduce bucket). The
    wrapper whose forward is TRL's ``compute_loss`` is no module of DeepSpeed's."""
    if isinstance(resolved.module, (TrlStepModule, GrpoStepModule)):
        return ("policy", *resolved.separate_models)
    return ("",)


def _grpo_generation(step: Step, stage3: ZeroStage3) -> str | None:
    """GRPO's generation without ``ds3_gather_for_generation`` records the generation's module order as
    the trace (DeepSpeed's per-module gathers; the LM head a module there). The training forward follows
    it and, prefetching, all-gathers the head asynchronously (INFLIGHT) just before TRL's fused head reads
    its weight; ``maybe_gather_lm_head_ctx`` takes INFLIGHT for not gathered and its ``GatheredParameters``
    then fails on exit: "Cannot partition a param in flight" (real DeepSpeed 0.19.8 and TRL 1.16 on the
    CPU, in the first step: tests/data/deepspeed_zero3_grpo.json). Refused, naming both ways out; else
    the note that says how generate() gathers (None: no GRPO step)."""
    record = step.trainer_args
    settings = record.trl if record is not None else None
    if settings is None or settings.trainer != "grpo":
        return None
    if settings.get("ds3_gather_for_generation", True):
        return ("GRPO's generate() runs with every parameter of the policy gathered (ds3_gather_for_generation), "
                "and the trace is recorded again after it")
    if stage3.prefetch_bucket_size <= 0:
        return "GRPO's generate() gathers module by module (ds3_gather_for_generation false)"
    raise InapplicableOptionError(
        "loop trl-grpo with ds3_gather_for_generation=False under ZeRO-3 with prefetching "
        f"(stage3_prefetch_bucket_size {stage3.prefetch_bucket_size:,}) fails in real DeepSpeed 0.19.8 with TRL 1.16: "
        "the training forward prefetches the LM head that generate() called as a module, and TRL's fused head "
        "then partitions it in flight (AssertionError: Cannot partition a param in flight)",
        hint="Leave ds3_gather_for_generation at its default (True), or set stage3_prefetch_bucket_size 0.")


def _stage3_note(stage3: ZeroStage3, training: bool) -> str:
    """What ZeRO-3's parameter settings made of the step."""
    parts = [f"ZeRO-3 gathers each module's parameters as DeepSpeed's coordinator does: parameters of at most "
             f"{stage3.param_persistence_threshold:,} elements stay whole (stage3_param_persistence_threshold)"]
    if stage3.model_persistence_threshold != ZeroStage3.model_persistence_threshold:
        parts.append(f"{stage3.model_persistence_threshold:,} persistent elements at most")
    parts.append(f"prefetch {stage3.prefetch_bucket_size:,} elements ahead, {stage3.max_live_parameters:,} live at "
                 f"most, kept when reused within {stage3.max_reuse_distance:,}")
    if training:
        parts.append("the first step records the module order (no prefetch), the second is traced too")
    if stage3.offload_param:
        parts.append("offload_param: the 16-bit partitions are in host memory (not counted here)")
    return "; ".join(parts)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

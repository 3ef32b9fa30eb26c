"""The estimate of one step, on one GPU or under a multi-GPU strategy.

:func:`run_estimate` takes the :class:`~memcalc.engine.step_spec.Step` the API built once; the
batch search (:mod:`memcalc.search`) varies its batch size, capacity, optimizer and precision
with :func:`dataclasses.replace` and calls it again; on one GPU, :func:`trace_estimate` stops
at the trace, for the batches it judges by replays and does not report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memcalc.core.categories import Mode
from memcalc.core.checkpointing import CheckpointKind
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport
from memcalc.core.throughput import DeviceRates, StepFlops, StepTime
from memcalc.distributed.checkpoint_auto import choose_checkpointing
from memcalc.distributed.setting import Distributed
from memcalc.distributed.strategies import estimate_per_rank, refuse_reentrant
from memcalc.distributed.vocabulary import Strategy
from memcalc.engine.collector import collector_paused
from memcalc.engine.model import ResolvedModel
from memcalc.engine.run import CostRecorderFactory, TracedStep, build_report
from memcalc.engine.step_spec import Step
from memcalc.stacks.float8 import apply_float8
from memcalc.stacks.kbit import kbit_checkpointing
from memcalc.stacks.liger import apply_liger
from memcalc.stacks.peft import apply_finetune, step_precision
from memcalc.targets.backend import trace_step

__all__ = ("CostsOnRequest", "TracedEstimate", "run_estimate", "trace_estimate")

#: One GPU, no strategy.
SINGLE = Distributed()


@collector_paused()
def run_estimate(step: Step, distributed: Distributed = SINGLE,
                 on_trace: Callable[[TracedStep], None] | None = None) -> MemoryReport:
    """Estimate ``step``.

    Args:
        step: the step, as the API built it. Its ``model`` is resolved anew for each estimate
            (a meta twin is cheap, and a strategy resolves each role at its own batch).
        distributed: the multi-GPU setting (one GPU by default).
        on_trace: single GPU only: called with the raw traced step before the report is
            made (the batch search replays the same step at other batch sizes with it).

    Returns:
        The report; under a strategy, that of the busiest GPU with every role in ``roles``.
    """
    if step.checkpoint.kind is CheckpointKind.AUTO:
        if on_trace is not None:  # the batch search replays one setting's trace at other batches
            raise _auto_per_trace()
        return choose_checkpointing(step, lambda trial: run_estimate(trial, distributed))
    _check(step, distributed)
    step = _trl_checkpointing(step, distributed)
    # every kernel's FLOPs and bytes, recorded only when a time is asked for (CostsOnRequest otherwise)
    costs = _cost_recorder() if step.record_costs else None
    if not distributed.is_single:  # each role's model is fine-tuned there, before its program wraps it
        report = estimate_per_rank(step, distributed, costs=costs)
        return report if step.record_costs else report.with_costs(CostsOnRequest(step, distributed))
    traced = _trace_single(step, costs)
    if on_trace is not None:
        on_trace(traced.traced)
    return traced.report()


@dataclass(frozen=True)
class TracedEstimate:
    """A one-GPU step traced and not yet reported: the batch search judges most of the batches
    it traces by a replay of the trace alone and reports only the one it answers (a report — its
    replays, breakdown, module rows and textbook — is about a third of an estimate)."""

    resolved: ResolvedModel
    traced: TracedStep
    #: the step as traced (its precision resolved against the fine-tuning)
    step: Step

    def report(self) -> MemoryReport:
        """The estimate's report, as :func:`run_estimate` returns it."""
        report = build_report(self.resolved, self.traced, self.step)
        return report if self.step.record_costs else report.with_costs(CostsOnRequest(self.step, SINGLE))


@collector_paused()
def trace_estimate(step: Step) -> TracedEstimate:
    """:func:`run_estimate` on one GPU up to its trace, its checks included (not ``checkpoint
    auto``, which chooses among several traces); ``.report()`` finishes it."""
    if step.checkpoint.kind is CheckpointKind.AUTO:
        raise _auto_per_trace()
    _check(step, SINGLE)
    return _trace_single(step, _cost_recorder() if step.record_costs else None)


def _auto_per_trace() -> InapplicableOptionError:
    return InapplicableOptionError(
        "checkpoint auto (--checkpoint auto) chooses a setting per step; memcalc fit on one GPU replays one "
        "setting's trace at other batch sizes, so it does not choose per batch yet",
        hint="Fit each setting (--checkpoint every:N, selective-op, full), or estimate one batch with "
             "--checkpoint auto.")


def _check(step: Step, distributed: Distributed) -> None:
    """Refuse, by name, the options this setting does not model."""
    if not distributed.is_single and step.loop.preset is not None and step.loop.preset.is_trainer:
        _check_trainer_strategy(step, distributed)
    elif step.accelerate_prepared and distributed.strategy is Strategy.FSDP and step.precision is Precision.AMP_FP16:
        raise InapplicableOptionError(f"loop {step.loop.name} under an accelerate config's FSDP2 with mixed_precision "
                                      f"fp16 is not modelled: accelerate runs FSDP2 with MixedPrecisionPolicy("
                                      f"param_dtype and reduce_dtype float16) and torch's GradScaler "
                                      f"(get_fsdp2_grad_scaler) over the sharded gradients, which no real run here "
                                      f"checks (accelerate refuses fp16 on the CPU)",
                                      hint="Estimate it with mixed_precision: bf16, or under MULTI_GPU with fp16.")
    if step.checkpoint.reentrant and not distributed.is_single:
        refuse_reentrant(distributed)  # the strategies it is checked under: memcalc.distributed.strategies
    if distributed.is_single and step.float8 is not None and step.float8.all_gather:
        raise InapplicableOptionError("float8_all_gather (--float8-all-gather) is FSDP2's float8 all-gather; one GPU "
                                      "all-gathers nothing",
                                      hint="Add --strategy fsdp --world-size N, or leave out --float8-all-gather.")
    if step.liger and (not distributed.is_single or (step.loop.preset is not None and step.loop.preset.is_trl)):
        raise InapplicableOptionError("liger (--liger) is estimated on one GPU with memcalc's or the Trainer's loop; "
                                      "under --strategy or a TRL loop it is not modelled yet",
                                      hint="Leave out --strategy (or the TRL loop) to estimate Liger's kernels.")
    if step.liger and step.mode is not Mode.TRAIN:  # said before the model is built
        raise InapplicableOptionError(f"liger (--liger) models Liger's training kernels; the mode is {step.mode.value}")


def _trace_single(step: Step, costs: CostRecorderFactory | None) -> TracedEstimate:
    resolved = step.resolved()
    resolved = apply_finetune(resolved, step.finetune, precision=step.precision, mode=step.mode,
                              checkpoint=bool(step.checkpoint))
    resolved = apply_float8(resolved, step.float8)
    step = replace(step, precision=step_precision(resolved, step.finetune, step.precision, step.mode))
    step = kbit_checkpointing(resolved.module, step)  # the kind PEFT set up for QLoRA, where the loop keeps it
    if step.liger:
        resolved = with_liger(resolved, step)
    if step.loop.preset is not None and step.loop.preset.is_trl:
        from memcalc.stacks.trl.step import trl_model  # TRL's stack only for its loops (issue 36)

        resolved = trl_model(resolved, step)
    return TracedEstimate(resolved, trace_step(resolved, step, costs=costs), step)


#: The strategies the Trainer's loop (its own, TRL's trainers') is estimated under: accelerate's
#: MULTI_GPU (DDP), FSDP (FSDP2 over one dimension) and DEEPSPEED (ZeRO).
_TRAINER_STRATEGIES = frozenset({Strategy.DDP, Strategy.FSDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3})


def _check_trainer_strategy(step: Step, distributed: Distributed) -> None:
    """The Trainer's loop runs under accelerate's data parallelism: DDP, FSDP2 and ZeRO; the other
    mesh dimensions are not modelled. Its step under each is the one-GPU step's, around the
    strategy's rank program (docs/many-gpus.md, "The Trainer's loop"). TRL's trainers too (the
    reference sharded on its root alone, as ``prepare_fsdp`` does; GRPO's generation through the model
    ``unwrap_model_for_generation`` yields, under FSDP2 the sharded policy gathering its units per
    forward; under ZeRO-3 as ``ds3_gather_for_generation`` says)."""
    if (step.loop.name == "trl-grpo" and distributed.strategy is Strategy.FSDP and step.finetune is not None
            and step.finetune.lora is not None):
        raise InapplicableOptionError("loop trl-grpo with LoRA under --strategy fsdp is not modelled: "
                                      "PeftModel.generate runs the base model's forward, outside the hooks of FSDP2's "
                                      "root (the PeftModel), whose parameters are then sharded",
                                      hint="Estimate it under ddp, zero1 or zero2, or without LoRA under fsdp.")
    if distributed.strategy is Strategy.FSDP and step.precision.is_amp:
        _check_accelerate_amp(step)
    mesh = dict(step.trainer_args.mesh) if step.trainer_args is not None else {}
    who = ("TRL's trainers are" if step.loop.preset is not None and step.loop.preset.is_trl
           else "the Trainer's loop is")
    if distributed.strategy not in _TRAINER_STRATEGIES and mesh:
        raise InapplicableOptionError(f"loop {step.loop.name} with its config's parallelism_config "
                                      f"({', '.join(f'{k}_size={v}' for k, v in mesh.items())}) is not modelled: "
                                      f"{who} estimated under accelerate's DDP, FSDP2 over one "
                                      f"dimension and ZeRO, not HSDP, tensor or context parallelism",
                                      hint="Give dp_shard_size alone (FSDP2) or dp_replicate_size alone (DDP).")
    if distributed.strategy not in _TRAINER_STRATEGIES:
        raise InapplicableOptionError(f"loop {step.loop.name} under --strategy {distributed.strategy.value} is not "
                                      f"modelled: {who} estimated under ddp, fsdp, zero1, zero2 and zero3 "
                                      f"(accelerate's MULTI_GPU, FSDP and DEEPSPEED)",
                                      hint="Give --strategy ddp, fsdp or zero1/2/3.")


def _check_accelerate_amp(step: Step) -> None:
    """The Trainer's loop and TRL's under accelerate's FSDP2 with amp (``bf16`` / ``fp16``): accelerate's
    ``_prepare_fsdp2`` wraps no forward in autocast; the FSDP plugin's ``MixedPrecisionPolicy`` casts
    (param_dtype and reduce_dtype both 16-bit, over float32 masters), which memcalc's FSDP2 program runs
    (:func:`memcalc.distributed.strategy.dp_shard.fsdp_program`). Refused: fp16, whose ``GradScaler``
    (``get_fsdp2_grad_scaler``) unscales sharded gradients and whose reduce-scatter pre- and post-divides,
    with no real run to check them against (accelerate refuses fp16 on the CPU); GRPO, whose scoring and
    training forwards open ``accelerator.autocast()`` themselves over FSDP2's 16-bit parameters while its
    generation runs without."""
    if step.precision is Precision.AMP_FP16:
        raise InapplicableOptionError(f"loop {step.loop.name} under --strategy fsdp with precision amp-fp16 "
                                      f"(fp16=True) is not modelled: accelerate runs FSDP2 with MixedPrecisionPolicy("
                                      f"param_dtype and reduce_dtype float16) and torch's GradScaler "
                                      f"(get_fsdp2_grad_scaler) over the sharded gradients, which no real run here "
                                      f"checks (accelerate refuses fp16 on the CPU)",
                                      hint="Estimate it with bf16=True (amp-bf16), or under --strategy ddp with fp16.")
    if step.loop.name == "trl-grpo":
        raise InapplicableOptionError(f"loop trl-grpo under --strategy fsdp with precision {step.precision.value} is "
                                      f"not modelled: GRPOTrainer opens accelerator.autocast() around its scoring and "
                                      f"training forwards over FSDP2's 16-bit gathered parameters, and generates "
                                      f"through the FSDP2 policy without it",
                                      hint="Estimate GRPO under fsdp at fp32 (bf16=False), or under ddp or zero1/2/3 "
                                           "with bf16.")


def _trl_checkpointing(step: Step, distributed: Distributed) -> Step:
    """``step`` with the checkpointing TRL's trainers run: reentrant for a PEFT model with gradient
    checkpointing under DeepSpeed ZeRO-3 (``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer`` and
    ``GRPOTrainer`` set ``use_reentrant=True`` there, over the user's value: "PEFT + DeepSpeed ZeRO-3
    requires reentrant checkpointing", trl#2514), refusing a selective policy as TRL does."""
    if not (step.loop.preset is not None and step.loop.preset.is_trl and distributed.strategy is Strategy.ZERO3
            and step.finetune is not None and step.finetune.lora is not None and step.checkpoint):
        return step
    if step.checkpoint.kind not in (CheckpointKind.FULL, CheckpointKind.EVERY):
        raise InapplicableOptionError(f"loop {step.loop.name} with LoRA under --strategy zero3 checkpoints with "
                                      f"reentrance (TRL forces use_reentrant=True there), which takes no selective "
                                      f"policy; checkpoint {step.checkpoint.label} is one",
                                      hint="Give --checkpoint full (or every:N), or leave out --lora.")
    if step.checkpoint.reentrant:
        return step
    return replace(step, checkpoint=replace(step.checkpoint, reentrant=True),
                   notes=(*step.notes, f"loop {step.loop.name}: TRL checkpoints a PEFT model with reentrance under "
                                       f"DeepSpeed ZeRO-3 (use_reentrant=True forced over the config's)"))


class CostsOnRequest:
    """A report's FLOPs and step times when its kernels' costs were not recorded
    (``step.record_costs`` off, as for every estimate that asks for no time): the first
    request traces the estimate again, recording them, and keeps that report. A step time
    asked for after the fact costs one more trace; an estimate never timed costs nothing."""

    def __init__(self, step: Step, distributed: Distributed) -> None:
        self._step = step
        self._distributed = distributed
        self._recorded: MemoryReport | None = None

    def _report(self) -> MemoryReport:
        if self._recorded is None:
            self._recorded = run_estimate(replace(self._step, record_costs=True), self._distributed)
        return self._recorded

    def flops(self) -> StepFlops:
        """The step's FLOPs per phase, module and op."""
        return self._report().flops()

    def time(self, rates: DeviceRates) -> StepTime:
        """The step's time on the GPU of ``rates``."""
        return self._report().time_on(rates)


def _cost_recorder() -> CostRecorderFactory:
    """The FLOPs-and-bytes recorder, imported only for a timed step: it loads torch's FLOP formulas
    (torch.utils.flop_counter), which an estimate of memory alone never reads."""
    from memcalc.timing.flops import OpCostRecorder

    return OpCostRecorder


def with_liger(resolved: ResolvedModel, step: Step) -> ResolvedModel:
    """``resolved`` with Liger's kernels patched in (:func:`memcalc.stacks.liger.apply_liger`), for
    a training step; the note says they are modelled from Liger's code."""
    cuda = step.emulate_cuda
    note = apply_liger(resolved.module, sm_count=step.gpu.sm_count if cuda else 1,
                       addmm_out_dtype=cuda and step.gpu.compute_capability[0] >= 8, name=resolved.name)
    return replace(resolved, notes=(*resolved.notes, note))

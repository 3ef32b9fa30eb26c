"""The one description of the step: :class:`Step`, frozen, every value already converted.

A user's values (strings from the command line, objects from Python) are converted into a
:class:`Step` exactly once, by the table of :mod:`memcalc.fields` that both the API and the
CLI read. Every layer below takes the :class:`Step` as it is: the engine traces it, the CUDA
and CPU targets model it, a strategy traces it per GPU role, the batch search varies it with
:func:`dataclasses.replace`, and ``--measure`` runs it for real. None of them converts again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from types import EllipsisType
from typing import Any

import torch

from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Mode
from memcalc.core.checkpointing import OFF, Checkpointing
from memcalc.core.errors import InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.core.float8 import Float8
from memcalc.core.gpu import CPU_PROFILE, GENERIC, GpuProfile
from memcalc.core.loop import Loop
from memcalc.core.losses import LossChoice, LossFn
from memcalc.core.precision import Precision, WeightDtype
from memcalc.core.stack import Stack
from memcalc.core.trainer import TrainerArguments
from memcalc.engine.model import InputsLike, ModelResolver, ResolvedModel
from memcalc.engine.optimizers import DEFAULT_OPTIMIZER, OptimizerSpec, spec_for

__all__ = ("Step", "Target")


class Target(str, enum.Enum):
    """What the simulation is faithful to: a CUDA GPU (the default) or the CPU (used to compare
    with a real CPU run: no CUDA kernel emulation, no CUDA workspaces)."""

    CUDA = "cuda"
    CPU = "cpu"


@dataclass(frozen=True)
class Step:
    """One step of one model on one GPU (or the CPU), as enums, numbers and objects.

    Build it from a user's values with :func:`memcalc.fields.build_step` (which validates each
    value and their combinations); below the API it is only read, or varied with
    :func:`dataclasses.replace`.

    Attributes:
        model: what the user named (a zoo name, a source string, a module or a factory),
            resolved anew for each estimate; None when the caller resolved it itself.
        batch_size, input_shape, seq_len, inputs: the batch (None: the model's default).
        optimizer: the optimizer, by its spec (``none``: no optimizer step).
        mode: train, eval or inference.
        loss, loss_fn: a loss by name (None: the model's own), or the user's own function.
        precision: fp32, autocast mixed precision (``amp-*``) or pure half precision.
        weight_dtype: the dtype the parameters are stored in (None: the precision's).
        gpu, gpu_named: the GPU's profile, and whether it was named (False: the generic one).
        target: CUDA, or this machine's CPU.
        checkpoint: activation checkpointing: off, every block, every Nth block, or a selective
            policy (torchtitan's op list or the user's) inside every block.
        accum_steps: micro-batches per optimizer step.
        liger: Liger kernels on a Hugging Face causal LM (:mod:`memcalc.stacks.liger`).
        compile: the model's forward compiled by ``torch.compile`` (Inductor): AOTAutograd's
            partitioner decides what is saved for backward, Inductor's fused kernels and memory
            planning what is allocated (:mod:`memcalc.engine.compiled`).
        float8: torchao's float8 training of the Linear layers (a recipe, or the user's
            ``Float8LinearConfig``; :mod:`memcalc.stacks.float8`); None: off.
        float8_all_gather: the user's switch for FSDP2's float8 all-gather, already folded into
            ``float8`` (:meth:`~memcalc.core.float8.Float8.with_all_gather`).
        kv_cache: tokens generated with a static KV cache (inference only).
        capacity: bytes the caching allocator may reserve (None: no limit).
        loop, stack, finetune: the training loop, the torch/CUDA versions (resolved: concrete
            versions), frozen parameters, adapters and a quantized base.
        trainer_args: what the Hugging Face Trainer's arguments set (the user's, or the
            installed defaults for the trainer loop), already laid into the options above;
            None for another loop.
        record_costs: record every kernel's FLOPs and bytes while tracing, for a step time
            (:mod:`memcalc.timing.flops`): only when a time is asked for, since it adds 10–26%
            to an estimate. The memory figures do not depend on it.
        alloc_conf: the CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) its
            replays model.
        accelerate_prepared: the loop runs the model ``Accelerator.prepare`` returned, as an
            accelerate config says accelerate launches it (set from the config, not a user's
            option): under FSDP2 ``fsdp2_prepare_model``'s units and policy, under DDP or on one GPU
            with amp the forward's 16-bit outputs copied to float32 (``convert_outputs_to_fp32``).
        notes: what building the step found out (the local GPU it stands for), shown first
            among the report's notes.
        resolver: resolves ``model`` at a batch (:meth:`resolved`); the API sets it, so that the
            estimate, the strategies, the searches and the measurement resolve the model the
            same way without importing the resolver (``memcalc.sources``).
    """

    model: Any = None
    batch_size: int | None = None
    input_shape: tuple[int, ...] | None = None
    seq_len: int | None = None
    inputs: InputsLike | None = None
    optimizer: OptimizerSpec = field(default_factory=lambda: spec_for(DEFAULT_OPTIMIZER))
    mode: Mode = Mode.TRAIN
    loss: LossChoice | None = None
    loss_fn: LossFn | None = None
    precision: Precision = Precision.FP32
    weight_dtype: WeightDtype | None = None
    gpu: GpuProfile = GENERIC
    gpu_named: bool = False
    target: Target = Target.CUDA
    checkpoint: Checkpointing = OFF
    compile: bool = False
    float8: Float8 | None = None
    float8_all_gather: bool = False
    liger: bool = False
    accum_steps: int = 1
    kv_cache: int | None = None
    capacity: int | None = None
    loop: Loop = field(default_factory=Loop)
    stack: Stack = field(default_factory=Stack)
    finetune: FineTune = field(default_factory=FineTune)
    trainer_args: TrainerArguments | None = None
    #: Tokens ``generate()`` makes after the prompt (mode generate only; None otherwise).
    new_tokens: int | None = None
    record_costs: bool = False
    alloc_conf: AllocConf = field(default_factory=AllocConf)
    accelerate_prepared: bool = False
    notes: tuple[str, ...] = ()
    resolver: ModelResolver | None = field(default=None, compare=False, repr=False)

    @property
    def optimizer_key(self) -> str:
        """The optimizer's name (a built-in's :class:`~memcalc.engine.optimizers.Optimizer` member)."""
        return self.optimizer.key

    @property
    def allocator_settings(self) -> AllocConf | None:
        """The caching allocator's settings the replays model: ``alloc_conf`` on a CUDA target
        (None: the defaults, or the CPU target, whose allocator has none)."""
        return self.alloc_conf if self.emulate_cuda and not self.alloc_conf.is_default else None

    @property
    def emulate_cuda(self) -> bool:
        """Whether the step is simulated as a CUDA GPU runs it (else as the CPU does)."""
        return self.target is Target.CUDA

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype the parameters and buffers are stored in: ``weight_dtype``, else float32
        master weights under autocast and the model's dtype under pure fp16/bf16."""
        return self.precision.parameter_dtype if self.weight_dtype is None else self.weight_dtype.dtype

    def resolved(self, batch_size: int | EllipsisType | None = ...) -> ResolvedModel:
        """The step's model and inputs on meta, built anew (a fine-tune changes the module in
        place, so a resolved model serves one trace).

        Args:
            batch_size: samples per step; ``...``: the step's own; None: taken from ``inputs``.

        Raises:
            InvalidInputError: a step made without the API has no resolver.
        """
        if self.resolver is None:
            raise InvalidInputError("this Step has no model resolver: build it with memcalc.fields.build_step()")
        return self.resolver(self.model, batch_size=self.batch_size if batch_size is ... else batch_size,
                             input_shape=self.input_shape, seq_len=self.seq_len, inputs=self.inputs)

    @property
    def trains_own_loss(self) -> bool:
        """A training step whose loss the user did not choose: the model computes its own (a
        Hugging Face head from the labels it is given), for the estimate and the measurement
        alike."""
        return self.mode is Mode.TRAIN and self.loss is None and self.loss_fn is None

    def on_cpu(self) -> Step:
        """The same step as this machine's CPU runs it (the CPU profile, no capacity): the
        estimate a real CPU run is compared with."""
        return replace(self, gpu=CPU_PROFILE, gpu_named=False, target=Target.CPU, capacity=None)

    def precision_warning(self) -> str | None:
        """A bf16 step on a GPU without native bf16 (V100, T4): PyTorch emulates many bf16 ops
        slowly and the fused attention kernels refuse bf16 there."""
        if self.precision.uses_bf16 and not self.gpu.supports_bf16:
            return (f"{self.gpu.name} (sm{self.gpu.compute_capability[0]}{self.gpu.compute_capability[1]}) has no "
                    f"native bf16: PyTorch falls back to slow emulated kernels and the math attention path; "
                    f"use amp-fp16 or fp16 on this GPU")
        return None


"""Everything that describes the step being estimated, converted once from user strings at
the API boundary (``EstimateOptions.create``) so the engine only sees enums and numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memcalc.core.categories import Mode
from memcalc.core.choices import parse_choice
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.core.gpu import GENERIC, GpuProfile
from memcalc.core.loop import Loop
from memcalc.core.losses import LossChoice, LossFn
from memcalc.core.precision import Precision
from memcalc.core.stack import Stack
from memcalc.engine.optimizers import Optimizer, OptimizerSpec, spec_for

__all__ = ("EstimateOptions", "Target")



class Target:
    """What the simulation is faithful to: a CUDA GPU (the default) or the CPU (used to compare
    with a real CPU run: no CUDA kernel emulation, no CUDA workspaces)."""

    CUDA = "cuda"
    CPU = "cpu"


@dataclass(frozen=True)
class EstimateOptions:
    """The step being estimated, as enums and numbers (build it with :meth:`create`)."""

    optimizer: OptimizerSpec
    mode: Mode
    precision: Precision
    gpu: GpuProfile
    gpu_named: bool  # False when the generic default profile is used
    loss: LossChoice | None
    loss_fn: LossFn | None
    accum_steps: int
    checkpoint: bool
    kv_cache: int | None  # tokens to generate with a KV cache (inference only)
    target: str
    loop: Loop = field(default_factory=Loop)
    stack: Stack = field(default_factory=Stack)
    finetune: FineTune = field(default_factory=FineTune)
    #: Tokens ``generate()`` makes after the prompt (mode generate only; None otherwise).
    new_tokens: int | None = None
    #: Record every kernel's FLOPs and bytes while tracing (memcalc.engine.flops), for a step
    #: time: only when a time is asked for, since it adds 10–26% to an estimate. The memory
    #: figures do not depend on it.
    record_costs: bool = False

    @classmethod
    def create(cls, *, optimizer: Any = "adam", mode: Any = "train", precision: Any = "fp32",
               gpu: GpuProfile | None = None,
               loss: Any = None, loss_fn: LossFn | None = None, accum_steps: int = 1, checkpoint: bool = False,
               kv_cache: int | None = None, target: str = Target.CUDA, loop: Any = None,
               stack: Stack | None = None, finetune: FineTune | None = None,
               new_tokens: int | None = None) -> EstimateOptions:
        """Validate and convert the user's values (strings or enums).

        Args:
            optimizer: an :class:`Optimizer` or its name (``"adam"``, ``"sgd"``, ...).
            mode: ``"train"``, ``"eval"`` or ``"inference"`` (or a :class:`Mode`).
            precision: a :class:`Precision` or its name (``"fp32"``, ``"amp-bf16"``, ...).
            gpu: the GPU's profile (names are looked up at the API boundary); None: the generic one.
            loss: a :class:`LossChoice` or its name; None: the model's own.
            loss_fn: a user loss, the model's output in, a scalar out (overrides ``loss``).
            accum_steps: gradient-accumulation micro-batches per optimizer step (training).
            checkpoint: activation checkpointing of the model's blocks (training).
            kv_cache: tokens to generate with a static KV cache (inference only).
            target: :attr:`Target.CUDA` or :attr:`Target.CPU`.
            loop: a :class:`~memcalc.core.loop.Loop`, a preset name or a loop function (None: minimal).
            stack: the torch/CUDA versions assumed (None: the installed torch).
            finetune: frozen parameters, adapters, a quantized base (None: everything trains).
            new_tokens: mode generate: the tokens ``generate()`` makes after the prompt (``max_new_tokens``).

        Returns:
            The options.

        Raises:
            InvalidInputError: an unknown name or an inconsistent combination.
        """
        mode_ = parse_choice(Mode, mode, "mode")
        precision_ = parse_choice(Precision, precision, "precision")
        try:
            spec = spec_for(optimizer)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        if gpu is not None and not isinstance(gpu, GpuProfile):
            # names are looked up in the catalogue at the API boundary (memcalc.api)
            raise InvalidInputError(f"gpu must be a GpuProfile here, got {type(gpu).__name__} {gpu!r}")
        profile, named = (GENERIC, False) if gpu is None else (gpu, gpu is not GENERIC)
        if not _is_int(accum_steps) or accum_steps < 1:
            raise InvalidInputError(f"accum_steps (--accum-steps) must be an integer ≥ 1, got {accum_steps!r}")
        if kv_cache is not None and (not _is_int(kv_cache) or kv_cache < 0):
            raise InvalidInputError(f"kv_cache (--kv-cache) is a number of tokens to generate, ≥ 0; got {kv_cache!r}",
                                    hint="e.g. --mode inference --kv-cache 256")
        _check_generation(mode_, new_tokens, kv_cache)
        if kv_cache is not None and mode_ is not Mode.INFERENCE:
            # eval runs the forward under no_grad without a cache: the tokens would be ignored
            raise InapplicableOptionError(f"kv_cache (--kv-cache) needs mode inference; the mode is {mode_.value}",
                                          hint="e.g. --mode inference --kv-cache 256")
        if not isinstance(checkpoint, bool):
            raise InvalidInputError(f"checkpoint must be True or False, got {checkpoint!r}")
        if mode_ is not Mode.TRAIN and (accum_steps > 1 or checkpoint):
            what = ("gradient accumulation (accum_steps, --accum-steps)" if accum_steps > 1
                    else "activation checkpointing (checkpoint, --checkpoint)")
            raise InapplicableOptionError(f"{what} applies to training (mode train); the mode is {mode_.value}")
        if target not in (Target.CUDA, Target.CPU):
            raise InvalidInputError(f"unknown target {target!r}")
        loop_ = Loop.of(loop)
        if not loop_.is_default and mode_ is not Mode.TRAIN:
            raise InapplicableOptionError(f"a training loop (loop, --loop, --keep-grads) applies to mode train; "
                                          f"the mode is {mode_.value}")
        if stack is not None and not isinstance(stack, Stack):
            raise InvalidInputError(f"stack must be a memcalc.Stack(...), got {type(stack).__name__}",
                                    hint='e.g. stack=memcalc.Stack(torch="2.4", cuda="12.1")')
        if finetune is not None and not isinstance(finetune, FineTune):
            raise InvalidInputError(f"finetune must be a memcalc.FineTune(...), got {type(finetune).__name__}",
                                    hint='e.g. finetune=memcalc.FineTune(lora=memcalc.LoRA(16), quant="nf4")')
        return cls(optimizer=spec, mode=mode_, precision=precision_, gpu=profile, gpu_named=named,
                   loss=None if loss is None else parse_choice(LossChoice, loss, "loss"), loss_fn=loss_fn,
                   accum_steps=int(accum_steps), checkpoint=bool(checkpoint), kv_cache=kv_cache, target=target,
                   loop=loop_, stack=stack or Stack(), finetune=finetune or FineTune(), new_tokens=new_tokens)

    @property
    def optimizer_key(self) -> Optimizer:
        """The optimizer's name, as an enum."""
        return self.optimizer.key

    @property
    def emulate_cuda(self) -> bool:
        """Whether the step is simulated as a CUDA GPU runs it (else as the CPU does)."""
        return self.target == Target.CUDA

    def precision_warning(self) -> str | None:
        """A bf16 step on a GPU without native bf16 (V100, T4): PyTorch emulates many bf16 ops
        slowly and the fused attention kernels refuse bf16 there."""
        if self.precision.uses_bf16 and not self.gpu.supports_bf16:
            return (f"{self.gpu.name} (sm{self.gpu.compute_capability[0]}{self.gpu.compute_capability[1]}) has no "
                    f"native bf16: PyTorch falls back to slow emulated kernels and the math attention path; "
                    f"use amp-fp16 or fp16 on this GPU")
        return None


def _check_generation(mode: Mode, new_tokens: int | None, kv_cache: int | None) -> None:
    """``new_tokens`` goes with mode generate, and mode generate with it; generate() keeps its
    own cache, so a static one (``kv_cache``) does not apply to it."""
    if mode is Mode.GENERATE and new_tokens is None:
        raise InvalidInputError("mode generate needs the number of tokens to generate (new_tokens, --new-tokens)",
                                hint="e.g. --mode generate --seq-len 512 --new-tokens 128: a 512-token prompt, "
                                     "128 new tokens")
    if new_tokens is not None and (not _is_int(new_tokens) or new_tokens < 1):
        raise InvalidInputError(f"new_tokens (--new-tokens) is a number of tokens to generate, ≥ 1; got {new_tokens!r}")
    if kv_cache is not None and mode is Mode.GENERATE:
        raise InapplicableOptionError(
            "kv_cache (--kv-cache) is the static cache of one inference forward; mode generate follows the cache "
            "generate() keeps itself (a DynamicCache growing by one token per step)",
            hint="Drop --kv-cache: --new-tokens says how many tokens generate() makes.")
    if new_tokens is not None and mode is not Mode.GENERATE:
        raise InapplicableOptionError(f"new_tokens (--new-tokens) needs mode generate; the mode is {mode.value}",
                                      hint="e.g. --mode generate --new-tokens 128")


def _is_int(value: object) -> bool:
    """An ``int`` proper: ``True`` and ``2.0`` are not counts."""
    return isinstance(value, int) and not isinstance(value, bool)

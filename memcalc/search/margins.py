"""The fit's margin, from the estimate's measured error against real GPU runs.

A batch fits when its step, replayed through the allocator model, fits the budget *C* less a
margin *m*·*C* (:mod:`memcalc.search.fit`). The margin holds back what the estimate is measured
to miss, per class of step — model family, precision, checkpointing, training or not — on the
H100 suite of 2026-11-25 (``tests/data/gpu/2026-11-25-h100/suite-gpu.jsonl``, 51 configs):

    m = max(FLOOR, α + β / C)

* **α, relative**: the largest under-estimate of *peak allocated* among the class's configs
  whose real peak is at least 1 GiB. It is the part that grows with the batch (activations,
  their workspaces), so it is held back in proportion to the budget.
* **β, absolute**: the largest under-estimate of *peak reserved*, in bytes, among the family's
  configs (any precision): what the allocator model and the estimate's own stream miss
  together — cuDNN's workspaces, whose sizes the rules do not follow exactly, and the
  fragmentation they leave (``tests/test_real_snapshots.py``: the model itself makes every real
  cudaMalloc when given a real stream). Under a capacity the allocator releases its cache and
  retries, which the search replays, so this unconstrained shortfall is an upper figure. A
  budget smaller than the run β was measured on holds back β's share of that run instead
  (ResNet-18's 2.56 GiB of a 9.80 GiB run: 26% of a smaller budget).
* **FLOOR**: what no measurement here can size — another CUDA stream's pool, a driver that
  moves the context, a library version's kernels — held at the 3% the estimate is held to on
  reserved memory (issue 25). Small-run errors (under 1 GiB) are not scaled: their bytes are in β.

A class without data takes the worst α of the same family and mode, else of every family in
that mode; a family without data (a user's own model, an MLP) the worst β of all. Only an
under-estimate counts: where memcalc over-estimates, the margin is the floor.

The errors are *today's* estimates against the suite's recorded measurements, not the estimates
the suite recorded: fixes since (the loss's log-probs under autocast, cuBLAS's workspace under
inference_mode, the reductions' staging buffers) changed them — GPT-2 under autocast went from 6.1%
over to 0.05% under, checkpointed llama-tiny under autocast from 10.7% over to 0.09% under, ViT-B/16
in bf16 from 3.1% under to 0.3%. ``benchmarks/replay_suite.py`` re-estimates every
config for the H100 and the run's torch/CUDA, and ``tests/test_margins.py`` derives the tables
below from it, failing when an estimate's change moves them; from ``fit-checks.jsonl`` (and the
batches between its last run and first failure, measured on 2026-11-26) it checks that no answer
passes the largest batch that ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memcalc.core.categories import Mode
from memcalc.core.precision import Precision
from memcalc.core.units import format_bytes

__all__ = (
    "ALLOCATED_UNDERESTIMATE",
    "FAMILY_PREFIXES",
    "FLOOR",
    "MAX_MARGIN",
    "MEASURED_ON",
    "RESERVED_SHORTFALL",
    "MeasuredMargin",
    "StepClass",
    "measured_margin",
    "model_family",
    "step_class",
)

#: The least margin, whatever the data says (see the module docstring).
FLOOR = 0.03
#: The most a measured margin holds back (see :func:`measured_margin`).
MAX_MARGIN = 0.5
#: Where the tables were measured.
MEASURED_ON = "H100 80GB, torch 2.11 + CUDA 13.0, 2026-11-25 (tests/data/gpu/2026-11-25-h100/suite-gpu.jsonl)"

#: The zoo's spelling of its plain-torch models (``models_zoo.TORCH_PREFIX``; the search does not
#: import the zoo): the suite's models, measured before the zoo's names built transformers' models.
_PLAIN_TORCH = "torch:"
#: Model families by name prefix (lower case), as the suite's models fall into them.
FAMILY_PREFIXES: dict[str, tuple[str, ...]] = {
    "cnn": ("resnet", "wide_resnet", "resnext", "vgg", "mobilenet", "efficientnet", "densenet", "convnext", "regnet",
            "alexnet", "squeezenet", "shufflenet", "inception", "googlenet", "mnasnet"),
    "unet": ("unet",),
    "transformer": ("vit", "deit", "swin", "bert", "roberta", "distilbert", "gpt", "llama", "mistral", "gemma", "qwen",
                    "phi", "opt", "t5", "bart", "falcon"),
}


@dataclass(frozen=True)
class StepClass:
    """What the margin is keyed by: family, precision kind (``fp32``, ``amp``, ``half``: weights
    in bf16/fp16), checkpointing, and whether the step trains."""

    family: str
    precision: str
    checkpoint: bool
    training: bool

    def describe(self) -> str:
        """``"cnn, fp32, training"``."""
        parts = [self.family, self.precision, *(("checkpointed",) if self.checkpoint else ()),
                 "training" if self.training else "eval/inference"]
        return ", ".join(parts)


#: α per class: (under-estimate of peak allocated, the config it was measured on).
ALLOCATED_UNDERESTIMATE: dict[StepClass, tuple[float, str]] = {
    StepClass("cnn", "amp", False, True): (0.0030, "resnet50 b64 sgd-momentum train precision=amp-bf16"),
    StepClass("cnn", "fp32", False, False): (0.0, "resnet50 b64 none eval"),
    StepClass("cnn", "fp32", False, True): (0.0073, "resnet18 b64 sgd train"),
    StepClass("cnn", "fp32", True, True): (0.0, "resnet50 b64 sgd train checkpoint=True"),
    StepClass("cnn", "half", False, True): (0.0019, "resnet50 b64 sgd-momentum train precision=bf16"),
    StepClass("transformer", "amp", False, True): (0.0005, "gpt2 seq 1024 b8 adamw train precision=amp-fp16"),
    StepClass("transformer", "amp", True, True): (
        0.0009, "llama-tiny seq 512 b8 adamw train precision=amp-bf16 checkpoint=True"),
    StepClass("transformer", "fp32", False, False): (0.0155, "gpt2 seq 1024 b8 none eval"),
    StepClass("transformer", "fp32", False, True): (0.0003, "bert-base seq 512 b8 sgd-momentum train"),
    StepClass("transformer", "half", False, False): (0.0, "llama-tiny seq 512 b8 none inference precision=bf16"),
    StepClass("transformer", "half", False, True): (0.0030, "vit_b_16 b32 adamw train precision=bf16"),
    StepClass("unet", "fp32", False, True): (0.0186, "unet b2 sgd train"),
}

#: β per family: (under-estimate of peak reserved in bytes, the measured peak reserved of that
#: run, the config it was measured on).
RESERVED_SHORTFALL: dict[str, tuple[int, int, str]] = {
    "cnn": (2_747_269_120, 10_521_411_584, "resnet18 b256 sgd train"),  # 10,034 MiB measured, 7,414 estimated
    # 578 vs 470 MiB: the run held 66 MiB of an earlier config's workspaces (tests/test_gpu_snapshots.py)
    "transformer": (113_246_208, 606_076_928, "llama-tiny seq 512 b8 none inference precision=bf16"),
    "unet": (398_458_880, 5_377_097_728, "unet b2 sgd train"),  # 5,128 vs 4,748 MiB
}


@dataclass(frozen=True)
class MeasuredMargin:
    """A margin and how it was derived from the data (see the module docstring)."""

    fraction: float
    step_class: StepClass
    allocated: float  # α
    allocated_from: str
    reserved: int  # β, bytes
    reserved_from: str
    capacity: int

    def explain(self) -> str:
        """One sentence: the class, α and β with their configs, the sum and the floor."""
        total = self.allocated + self.reserved / self.capacity
        used = "the floor" if total < FLOOR else "at most half the budget" if total > MAX_MARGIN else "the sum"
        return (f"measured for {self.step_class.describe()} steps on an {MEASURED_ON.split(',')[0]}: "
                f"peak allocated under-estimated by up to {self.allocated:.2%} ({self.allocated_from}), "
                f"peak reserved by up to {format_bytes(self.reserved)} ({self.reserved_from}); "
                f"{self.allocated:.2%} + {format_bytes(self.reserved)} / {format_bytes(self.capacity)} "
                f"= {total:.2%}, floor {FLOOR:.0%}: {used}")


def model_family(model: object) -> str:
    """The family of a model named as in the zoo (``"resnet50"``: ``"cnn"``; its plain-torch
    spelling ``"torch:gpt2"`` alike), else ``"other"``."""
    if not isinstance(model, str):
        return "other"
    name = model.lower().removeprefix(_PLAIN_TORCH).rsplit("/", 1)[-1]
    for family, prefixes in FAMILY_PREFIXES.items():
        if name.startswith(prefixes):
            return family
    return "other"


def step_class(model: object, precision: Precision, checkpoint: bool, mode: Mode) -> StepClass:
    """The class of a step, for :func:`measured_margin`."""
    kind = "amp" if precision.is_amp else "fp32" if precision is Precision.FP32 else "half"
    return StepClass(model_family(model), kind, checkpoint, mode is Mode.TRAIN)


def measured_margin(step: StepClass, capacity: int) -> MeasuredMargin:
    """The margin for ``step`` under a budget of ``capacity`` bytes (see the module docstring)."""
    allocated, allocated_from = _allocated(step)
    # a family not measured: the largest share of its run any family's shortfall took
    shortfall, run, reserved_from = RESERVED_SHORTFALL.get(step.family) or max(
        RESERVED_SHORTFALL.values(), key=lambda row: row[0] / row[1])
    # a budget smaller than the run it was measured on holds back the same share of itself
    reserved = shortfall if capacity >= run else math.ceil(shortfall * capacity / run)
    # to a tenth of a percent, upwards; at most half the budget (a β larger than the budget
    # itself says the family's data came from far larger steps than this budget allows)
    fraction = min(max(FLOOR, math.ceil((allocated + reserved / capacity) * 1000) / 1000), MAX_MARGIN)
    return MeasuredMargin(fraction, step, allocated, allocated_from, reserved, reserved_from, capacity)


def _allocated(step: StepClass) -> tuple[float, str]:
    """α of ``step``'s class, else the worst of its family and mode, else of its mode."""
    exact = ALLOCATED_UNDERESTIMATE.get(step)
    if exact is not None:
        return exact
    same_family = [v for k, v in ALLOCATED_UNDERESTIMATE.items() if k.family == step.family
                   and k.training == step.training]
    same_mode = [v for k, v in ALLOCATED_UNDERESTIMATE.items() if k.training == step.training]
    return max(same_family or same_mode or list(ALLOCATED_UNDERESTIMATE.values()))

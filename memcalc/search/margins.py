"""The fit's margin, from the estimate's measured error against real GPU runs.

A batch fits when its step, replayed through the allocator model, fits the budget *C* less a
margin *m*·*C* (:mod:`memcalc.search.fit`). The margin holds back what the estimate is measured
to miss, per class of step (model family, precision, checkpointing, training or not) and per
model where the model itself was measured:

    m = max(FLOOR, α + ρ + β / C)

* **α, relative**: the largest under-estimate of *peak allocated* among the class's configs
  whose real peak is at least 1 GiB: the part that grows with the batch.
* **ρ, relative**: the under-estimate of *peak reserved*, as a share of the real one, on the
  model's largest run of at least 1 GiB: the allocator's fragmentation of the estimate's stream
  where it differs from the real one. A model not measured takes the worst ρ of its family, a
  family not measured the worst of all.
* **β, absolute**: the largest under-estimate of peak reserved, in bytes, among the family's runs
  under 1 GiB, where fixed costs dominate. A budget smaller than the run β was measured on holds
  back β's share of that run instead; a family without data takes the largest share.
* **FLOOR**: what no measurement here can size (an unknown library's stream pool, a driver that
  moves the context), held at the 3% the estimate is held to on reserved memory (issue 25).

Only an under-estimate counts. The tables are data: ``margins.json`` beside this module,
WRITTEN BY ``scripts/derive_margins.py`` from today's estimates of the H100 suite of 2026-11-25
against its recorded measurements (its ``provenance`` says which); ``tests/test_margins.py``
re-derives them and fails when an estimate's change moves them. docs/notes/margins.md keeps the
reasoning behind each term and the history of the figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from memcalc.core.categories import Mode
from memcalc.core.precision import Precision
from memcalc.core.units import format_bytes

__all__ = (
    "ALLOCATED_UNDERESTIMATE",
    "CPU_MARGIN",
    "CPU_MARGIN_BASIS",
    "FAMILY_PREFIXES",
    "FLOOR",
    "MARGINS_FILE",
    "MAX_MARGIN",
    "MEASURED_ON",
    "PROVENANCE",
    "RESERVED_FIXED",
    "RESERVED_SHARE",
    "MeasuredMargin",
    "StepClass",
    "measured_margin",
    "model_family",
    "model_name",
    "step_class",
)

#: The least margin, whatever the data says (see the module docstring).
FLOOR = 0.03
#: The CPU target's margin (``gpu="cpu"``): the CPU estimate against real CPU steps under the
#: profiler (README, "Accuracy", the CPU table: median 0.00%, worst 0.96%, memory inside oneDNN's
#: convolutions), rounded up; no caching allocator, so nothing reserved to hold back for.
CPU_MARGIN = 0.01
CPU_MARGIN_BASIS = ("measured for the CPU target under torch.profiler: worst 0.96% (README \"Accuracy\"), "
                    "rounded up; the CPU allocator reserves nothing beyond what it hands out")
#: The most a measured margin holds back (see :func:`measured_margin`).
MAX_MARGIN = 0.5

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
    in bf16/fp16), checkpointing, and whether the step trains; ``model``, the zoo name of the model
    (``""`` for one given as an object), keys ρ where that model was measured."""

    family: str
    precision: str
    checkpoint: bool
    training: bool
    model: str = ""

    def describe(self) -> str:
        """``"cnn, fp32, training"``."""
        parts = [self.family, self.precision, *(("checkpointed",) if self.checkpoint else ()),
                 "training" if self.training else "eval/inference"]
        return ", ".join(parts)

    @property
    def kind(self) -> StepClass:
        """The class without its model: α's key."""
        return replace(self, model="")


#: The data file, beside this module, that ``scripts/derive_margins.py`` writes.
MARGINS_FILE = "margins.json"
_DATA: dict[str, Any] = json.loads(resources.files(__package__).joinpath(MARGINS_FILE).read_text(encoding="utf-8"))
#: Which script wrote the tables, from which inputs, when.
PROVENANCE: dict[str, Any] = dict(_DATA["provenance"])
#: Where the tables were measured.
MEASURED_ON: str = str(_DATA["measured_on"])
#: α per class: (under-estimate of peak allocated, the config it was measured on).
ALLOCATED_UNDERESTIMATE: dict[StepClass, tuple[float, str]] = {
    StepClass(str(row["family"]), str(row["precision"]), bool(row["checkpoint"]), bool(row["training"])):
        (float(row["alpha"]), str(row["config"]))
    for row in _DATA["allocated_underestimate"]}
#: ρ per model: (under-estimate of peak reserved as a share of the real one, on the model's
#: largest run whose real peak allocated is at least 1 GiB; the config).
RESERVED_SHARE: dict[str, tuple[float, str]] = {
    str(model): (float(row["rho"]), str(row["config"])) for model, row in _DATA["reserved_share"].items()}
#: β per family: (under-estimate of peak reserved in bytes among its runs whose real peak
#: allocated is under 1 GiB, the measured peak reserved of that run, the config). Both are
#: workspaces an earlier config's warm-up left allocated (tests/test_gpu_snapshots.py): the
#: CNNs' 64 MiB, and 66 of llama-tiny inference's 108 MiB.
RESERVED_FIXED: dict[str, tuple[int, int, str]] = {
    str(family): (int(row["shortfall"]), int(row["run"]), str(row["config"]))
    for family, row in _DATA["reserved_fixed"].items()}


@dataclass(frozen=True)
class MeasuredMargin:
    """A margin and how it was derived from the data (see the module docstring)."""

    fraction: float
    step_class: StepClass
    allocated: float  # α
    allocated_from: str
    reserved_share: float  # ρ
    reserved_share_from: str
    reserved_fixed: int  # β, bytes
    reserved_fixed_from: str
    capacity: int

    def explain(self) -> str:
        """One sentence: the class, α, ρ and β with their configs, the sum and the floor."""
        total = self.allocated + self.reserved_share + self.reserved_fixed / self.capacity
        used = "the floor" if total < FLOOR else "at most half the budget" if total > MAX_MARGIN else "the sum"
        return (f"measured for {self.step_class.describe()} steps on an {MEASURED_ON.split(',')[0]}: "
                f"peak allocated under-estimated by up to {self.allocated:.2%} ({self.allocated_from}), "
                f"peak reserved by {self.reserved_share:.2%} of the run ({self.reserved_share_from}) "
                f"and on small runs by up to {format_bytes(self.reserved_fixed)} ({self.reserved_fixed_from}); "
                f"{self.allocated:.2%} + {self.reserved_share:.2%} + {format_bytes(self.reserved_fixed)} / "
                f"{format_bytes(self.capacity)} = {total:.2%}, floor {FLOOR:.0%}: {used}")


def model_name(model: object) -> str:
    """The zoo name a model's margin is looked up by (``"torch:gpt2"`` and ``"org/gpt2"`` are
    ``"gpt2"``), else ``""``."""
    if not isinstance(model, str):
        return ""
    return model.lower().removeprefix(_PLAIN_TORCH).rsplit("/", 1)[-1]


def model_family(model: object) -> str:
    """The family of a model named as in the zoo (``"resnet50"``: ``"cnn"``; its plain-torch
    spelling ``"torch:gpt2"`` alike), else ``"other"``."""
    name = model_name(model)
    for family, prefixes in FAMILY_PREFIXES.items():
        if name and name.startswith(prefixes):
            return family
    return "other"


def step_class(model: object, precision: Precision, checkpoint: bool, mode: Mode) -> StepClass:
    """The class of a step, for :func:`measured_margin`."""
    kind = "amp" if precision.is_amp else "fp32" if precision is Precision.FP32 else "half"
    return StepClass(model_family(model), kind, checkpoint, mode is Mode.TRAIN, model_name(model))


def measured_margin(step: StepClass, capacity: int) -> MeasuredMargin:
    """The margin for ``step`` under a budget of ``capacity`` bytes (see the module docstring)."""
    allocated, allocated_from = _allocated(step.kind)
    share, share_from = _reserved_share(step)
    # a family not measured: the largest share of its run any family's β took
    shortfall, run, fixed_from = RESERVED_FIXED.get(step.family) or max(
        RESERVED_FIXED.values(), key=lambda row: row[0] / row[1])
    # a budget smaller than the run it was measured on holds back the same share of itself
    fixed = shortfall if capacity >= run else math.ceil(shortfall * capacity / run)
    # to a tenth of a percent, upwards; at most half the budget (a β larger than the budget
    # itself says the family's data came from far larger steps than this budget allows)
    fraction = min(max(FLOOR, math.ceil((allocated + share + fixed / capacity) * 1000) / 1000), MAX_MARGIN)
    return MeasuredMargin(fraction, step, allocated, allocated_from, share, share_from, fixed, fixed_from, capacity)


def _reserved_share(step: StepClass) -> tuple[float, str]:
    """ρ of ``step``'s model, else the worst of its family, else of every model."""
    exact = RESERVED_SHARE.get(step.model)
    if exact is not None:
        return exact
    same_family = [v for k, v in RESERVED_SHARE.items() if model_family(k) == step.family]
    return max(same_family or list(RESERVED_SHARE.values()))


def _allocated(step: StepClass) -> tuple[float, str]:
    """α of ``step``'s class, else the worst of its family and mode, else of its mode."""
    exact = ALLOCATED_UNDERESTIMATE.get(step)
    if exact is not None:
        return exact
    same_family = [v for k, v in ALLOCATED_UNDERESTIMATE.items() if k.family == step.family
                   and k.training == step.training]
    same_mode = [v for k, v in ALLOCATED_UNDERESTIMATE.items() if k.training == step.training]
    return max(same_family or same_mode or list(ALLOCATED_UNDERESTIMATE.values()))

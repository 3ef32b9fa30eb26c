"""The step-time model fitted to real kernels: how its coefficients are derived from a GPU's
profile and step times, and how well they hold.

The model (:class:`~memcalc.core.throughput.DeviceRates`, timed by
:meth:`memcalc.engine.flops.StepCosts.time`): each traced kernel of op class ``k`` takes

    t = ideal / efficiency[k] + kernel_seconds[k] + gap

where ``ideal`` is its roofline time at 100% of the GPU's datasheet peak (the larger of FLOPs ÷
peak of its math mode and bytes ÷ bandwidth). ``efficiency[k]`` is what a large kernel of the
class reaches; ``kernel_seconds[k]`` is the fixed time each kernel takes besides, so that a small
kernel's efficiency, ``ideal / (ideal / efficiency + kernel_seconds)``, falls with its size;
``gap`` is the idle time between kernels (launch latency and eager PyTorch's host-side
dispatch). The dtype enters through the math mode's peak (bf16 tensor cores, TF32, fp32) and two
classes the measurements separated: normalisations and GEMMs whose dimensions defeat cuBLAS's
aligned kernels (:class:`~memcalc.core.throughput.OpClass`).

Fitting (:func:`fit`), from two files of one GPU run (``tests/data/gpu/2026-11-25-h100/``):
``profile.json`` gives, per config, the self CUDA time of every aten op, which
:func:`~memcalc.engine.flops.op_class_of` sorts into classes. One efficiency per class and one
fixed time per kernel, shared by all classes, are the non-negative least-squares solution of
``measured[class] = Σ ideal / efficiency[class] + kernel_seconds × kernels[class]`` over every
(profiled config, class) pair, each residual relative to its config's kernel time. (A fixed time
per class was tried: with six to eight points a class, it traded efficiency for fixed time, a
normalisation's 275 µs a kernel, and predicted resnet50 at batch 256 43% short.) ``times.jsonl``
gives the real step; ``gap`` is then the least-squares fit of ``step = Σ kernel times + gap ×
kernels``, each step's residual relative to it. ``spread`` is the largest relative error left on
the timed configs: the ± shown with every time.

The coefficients hold for the GPU they were measured on; :mod:`memcalc.cuda.gpus.performance`
applies them to the other GPUs of the catalogue with those GPUs' datasheet peaks (the same
fraction of a different peak): an assumption, said so beside every time.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memcalc.core.throughput import OpClass, StepTime
from memcalc.engine.flops import op_class_of

__all__ = (
    "ClassFeatures",
    "FitResult",
    "MeasuredConfig",
    "fit",
    "ideal_overrides",
    "load_measurements",
    "predict",
)

#: Classes whose measured time the profile gives as one sum: the profiler names the aten op
#: (``aten::mm``), not whether cuBLAS chose an aligned kernel for it.
_GROUPS: tuple[tuple[OpClass, ...], ...] = (
    (OpClass.MATMUL, OpClass.MATMUL_UNALIGNED), (OpClass.CONV,), (OpClass.ATTENTION,), (OpClass.NORMALIZATION,),
    (OpClass.MEMORY,), (OpClass.MULTI_TENSOR,),
)
#: Efficiency of a class no profiled config ran (none in the fit's data), so that a time is
#: still given: the fitted memory-bound efficiency is the nearest kind of kernel.
_FALLBACK = OpClass.MEMORY


@dataclass(frozen=True)
class MeasuredConfig:
    """One measured config: the options of its estimate, the real step's median seconds
    (``times.jsonl``; None when only profiled) and its kernels' self CUDA seconds per step by
    class (``profile.json``; empty when only timed)."""

    model: str
    batch: int
    seq: int | None
    optimizer: str
    precision: str
    checkpoint: bool = False
    step_seconds: float | None = None
    kernel_seconds: tuple[tuple[OpClass, float], ...] = ()
    predicted_before: float | None = None  # memcalc's prediction recorded beside the measurement

    @property
    def name(self) -> str:
        """``resnet50 b64 sgd-momentum amp-bf16`` (``+ checkpoint`` when checkpointed)."""
        seq = f" s{self.seq}" if self.seq else ""
        return (f"{self.model} b{self.batch}{seq} {self.optimizer} {self.precision}"
                f"{' + checkpoint' if self.checkpoint else ''}")

    def estimate_kwargs(self, gpu: str = "h100-80gb") -> dict[str, Any]:
        """The keyword arguments of :func:`memcalc.estimate` that reproduce the measured step
        (costs recorded: ``time=True``)."""
        return {"batch_size": self.batch, "seq_len": self.seq, "optimizer": self.optimizer,
                "precision": self.precision, "checkpoint": self.checkpoint, "gpu": gpu, "time": True}

    def kernel_total(self) -> float:
        """Seconds of all profiled kernels in one step."""
        return sum(s for _, s in self.kernel_seconds)


def _key(record: Mapping[str, Any]) -> tuple[object, ...]:
    return (record["model"], record["batch"], record.get("seq"), record["opt"], record.get("precision", "fp32"),
            bool(record.get("checkpoint", False)))


def load_measurements(folder: Path, times_file: str = "times.jsonl") -> tuple[MeasuredConfig, ...]:
    """The configs of a GPU run's ``times.jsonl`` (or ``times_file``) and ``profile.json``
    (either may be absent), merged by their options, timed ones first in file order.

    The profile holds ``steps`` steps of each config; its self CUDA times are divided by it.
    """
    found: dict[tuple[object, ...], dict[str, Any]] = {}
    times = folder / times_file
    if times.exists():
        for line in times.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                found[_key(record)] = {"record": record, "step": float(record["measured_s"]),
                                       "before": record.get("predicted_s")}
    profile = folder / "profile.json"
    if profile.exists():
        for entry in json.loads(profile.read_text())["configs"]:
            per_class: dict[OpClass, float] = {}
            for op in entry["aten_ops"]:
                op_class = op_class_of(op["op"])
                per_class[op_class] = per_class.get(op_class, 0.0) + op["self_cuda_us"] / 1e6 / entry["steps"]
            slot = found.setdefault(_key(entry["config"]), {"record": entry["config"]})
            slot["kernels"] = tuple(sorted(per_class.items(), key=lambda item: list(OpClass).index(item[0])))
    return tuple(MeasuredConfig(
        model=s["record"]["model"], batch=s["record"]["batch"], seq=s["record"].get("seq"),
        optimizer=s["record"]["opt"], precision=s["record"].get("precision", "fp32"),
        checkpoint=bool(s["record"].get("checkpoint", False)), step_seconds=s.get("step"),
        kernel_seconds=s.get("kernels", ()), predicted_before=s.get("before")) for s in found.values())


@dataclass(frozen=True)
class ClassFeatures:
    """What the fit needs of memcalc's traced step: per class, the kernels' roofline seconds at
    100% of the peaks (:func:`ideal_overrides`) and how many kernels it launches."""

    ideal: tuple[tuple[OpClass, float], ...]
    kernels: tuple[tuple[OpClass, int], ...]

    @classmethod
    def of(cls, ideal_time: StepTime) -> ClassFeatures:
        """From a step timed with :func:`ideal_overrides`."""
        return cls(ideal=tuple((c.op_class, c.seconds) for c in ideal_time.classes),
                   kernels=tuple((c.op_class, c.kernels) for c in ideal_time.classes))

    def ideal_of(self, op_class: OpClass) -> float:
        """Roofline seconds of one class at 100% of peak (0 when it ran no kernel)."""
        return dict(self.ideal).get(op_class, 0.0)

    def kernels_of(self, op_class: OpClass) -> int:
        """Kernels of one class."""
        return dict(self.kernels).get(op_class, 0)

    @property
    def total_kernels(self) -> int:
        """Kernels of the whole step."""
        return sum(n for _, n in self.kernels)


def ideal_overrides() -> dict[str, Any]:
    """Keyword arguments of :func:`memcalc.step_time` that time every kernel at 100% of the
    peaks, with no fixed time and no gap: the ``ideal`` of the module docstring."""
    return {"efficiency": dict.fromkeys(OpClass, 1.0), "kernel_seconds": dict.fromkeys(OpClass, 0.0),
            "launch_overhead": 0.0}


@dataclass(frozen=True)
class FitResult:
    """The fitted coefficients (see the module docstring), and the configs they were fitted to."""

    efficiency: tuple[tuple[OpClass, float], ...]
    kernel_seconds: tuple[tuple[OpClass, float], ...]
    gap_seconds: float
    spread: float  # largest relative error on the timed configs it was fitted to
    fitted_on: tuple[str, ...] = field(default=())

    def efficiency_map(self) -> dict[OpClass, float]:
        """Efficiency per class."""
        return dict(self.efficiency)

    def kernel_seconds_map(self) -> dict[OpClass, float]:
        """Fixed seconds per kernel per class."""
        return dict(self.kernel_seconds)


def _nnls(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Non-negative least squares by trying every set of free unknowns (fewer than ten)."""
    best, best_cost = np.zeros(a.shape[1]), float(np.sum(b**2))
    for size in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), size):
            columns = list(free)
            solution, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(a.shape[1])
            x[columns] = solution
            cost = float(np.sum((a @ x - b) ** 2))
            if cost < best_cost:
                best, best_cost = x, cost
    return best


def predict(result: FitResult, features: ClassFeatures) -> float:
    """The step's seconds by the model with ``result``'s coefficients (what
    :meth:`~memcalc.engine.flops.StepCosts.time` computes kernel by kernel, summed by class)."""
    efficiency, fixed = result.efficiency_map(), result.kernel_seconds_map()
    total = 0.0
    for op_class, ideal in features.ideal:
        total += ideal / efficiency[op_class] + features.kernels_of(op_class) * fixed.get(op_class, 0.0)
    return total + result.gap_seconds * features.total_kernels


def fit(configs: Sequence[MeasuredConfig], features: Callable[[MeasuredConfig], ClassFeatures]) -> FitResult:
    """Fit the model's coefficients to ``configs`` (module docstring).

    Args:
        configs: measured configs; the profiled ones fit the kernels, the timed ones the gap and
            the spread.
        features: memcalc's ideal per-class seconds and kernels of a config's traced step.

    Returns:
        The coefficients (``kernel_seconds`` the same for every class); a class no profiled
        config ran gets the memory-bound class's efficiency.
    """
    profiled = [c for c in configs if c.kernel_seconds]
    feats = {c.name: features(c) for c in configs}
    classes = [c for group in _GROUPS for c in group
               if any(feats[p.name].ideal_of(c) for p in profiled)]
    rows, targets = [], []
    for config in profiled:
        f = feats[config.name]
        weight = 1.0 / config.kernel_total()  # each config's residual relative to its kernel time
        for group in _GROUPS:
            measured = sum(s for c, s in config.kernel_seconds if c in group)
            row = [f.ideal_of(c) * weight if c in group else 0.0 for c in classes]
            row.append(sum(f.kernels_of(c) for c in group) * weight)
            if any(row) or measured:
                rows.append(row)
                targets.append(measured * weight)
    solution = _nnls(np.array(rows), np.array(targets))
    efficiency = {c: min(1.0, 1.0 / v) if v > 0 else 1.0 for c, v in zip(classes, solution[:-1], strict=True)}
    fixed = dict.fromkeys(OpClass, float(solution[-1]))
    for op_class in OpClass:
        efficiency.setdefault(op_class, efficiency.get(_FALLBACK, 1.0))
    partial = FitResult(tuple((c, efficiency[c]) for c in OpClass), tuple((c, fixed[c]) for c in OpClass), 0.0, 0.0)
    timed = [c for c in configs if c.step_seconds]
    gap = _fit_gap(partial, timed, feats)
    result = FitResult(partial.efficiency, partial.kernel_seconds, gap, 0.0, tuple(c.name for c in configs))
    errors = [abs(predict(result, feats[c.name]) / c.step_seconds - 1) for c in timed if c.step_seconds]
    return FitResult(result.efficiency, result.kernel_seconds, gap, max(errors, default=0.0), result.fitted_on)


def _fit_gap(partial: FitResult, timed: Iterable[MeasuredConfig], feats: Mapping[str, ClassFeatures]) -> float:
    """The gap per kernel minimising the relative squared error of the timed steps (≥ 0)."""
    numerator = denominator = 0.0
    for config in timed:
        assert config.step_seconds is not None
        f = feats[config.name]
        kernels = predict(partial, f)
        x = f.total_kernels / config.step_seconds
        numerator += x * (1 - kernels / config.step_seconds)
        denominator += x * x
    return max(0.0, numerator / denominator) if denominator else 0.0

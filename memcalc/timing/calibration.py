"""The step-time model fitted to real kernels: how its coefficients are derived from a GPU's
profile and step times, and how well they hold.

The model (:class:`~memcalc.core.throughput.DeviceRates`, timed by
:meth:`memcalc.timing.flops.StepCosts.time`): each traced kernel of op class ``k`` takes

    t = ideal / efficiency[k] + kernel_seconds[k] + gap

and the step the sum of its kernels' ``t``, or ``host × kernels`` when that is longer (a
host-bound step). ``ideal`` is the kernel's roofline time at the GPU's datasheet peak;
``efficiency[k]`` is what a large kernel of the class reaches; ``kernel_seconds`` the fixed
time of each kernel; ``gap`` the idle time between kernels.

Fitting (:func:`fit`): one H200 run's ``profile.json`` (self CUDA time of every aten op) and
``times.jsonl`` (the real steps), in ``tests/data/gpu/2026-11-26-h200-profile/``, by
non-negative least squares relative to each config. ``spread`` is the largest error left on the
timed configs, so that the ± shown with every time covers each of them.

The coefficients hold for the GPU they were measured on; :mod:`memcalc.timing.performance`
applies them to the other GPUs with their datasheet peaks, an assumption said beside every
time. For a GPU whose own steps were measured, :func:`fit_bandwidth` fits one factor on its
datasheet bandwidth, and :func:`leave_one_out_bandwidth` says how it predicts a step it was not
fitted to.

The derivation, what was tried and how it held on an H100: docs/notes/step-time-calibration.md.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memcalc.core.throughput import OpClass, StepTime
from memcalc.timing.flops import op_class_of

__all__ = (
    "BandwidthFit",
    "ClassFeatures",
    "FitResult",
    "MeasuredConfig",
    "fit",
    "fit_bandwidth",
    "ideal_overrides",
    "leave_one_out_bandwidth",
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
    peaks (the datasheet's bandwidth), with no fixed time and no gap: the ``ideal`` of the module
    docstring."""
    return {"efficiency": dict.fromkeys(OpClass, 1.0), "kernel_seconds": dict.fromkeys(OpClass, 0.0),
            "launch_overhead": 0.0, "host_seconds": 0.0, "bandwidth_scale": 1.0}


@dataclass(frozen=True)
class FitResult:
    """The fitted coefficients (see the module docstring), and the configs they were fitted to."""

    efficiency: tuple[tuple[OpClass, float], ...]
    kernel_seconds: tuple[tuple[OpClass, float], ...]
    gap_seconds: float
    spread: float  # largest |measured / predicted - 1| on the timed configs it was fitted to
    fitted_on: tuple[str, ...] = field(default=())
    host_seconds: float = 0.0  # the host's seconds per kernel: the floor of a host-bound step

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
    :meth:`~memcalc.timing.flops.StepCosts.time` computes kernel by kernel, summed by class)."""
    total = _kernel_seconds(result, features) + result.gap_seconds * features.total_kernels
    return max(total, result.host_seconds * features.total_kernels)


def _kernel_seconds(result: FitResult, features: ClassFeatures) -> float:
    """The kernels' own seconds (no gap, no host floor)."""
    efficiency, fixed = result.efficiency_map(), result.kernel_seconds_map()
    return sum(ideal / efficiency[op_class] + features.kernels_of(op_class) * fixed.get(op_class, 0.0)
               for op_class, ideal in features.ideal)


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
    best: FitResult | None = None
    best_cost = float("inf")
    for host_bound in _host_bound_candidates(partial, timed, feats):
        gap = _fit_gap(partial, [c for c in timed if c not in host_bound], feats)
        host = _fit_host(host_bound, feats)
        candidate = FitResult(partial.efficiency, partial.kernel_seconds, gap, 0.0, tuple(c.name for c in configs),
                              host)
        cost = sum((predict(candidate, feats[c.name]) / c.step_seconds - 1) ** 2 for c in timed if c.step_seconds)
        if cost < best_cost - 1e-15:
            best, best_cost = candidate, cost
    assert best is not None
    # relative to the prediction, so that prediction × (1 ± spread) covers every timed step
    errors = [abs(c.step_seconds / predict(best, feats[c.name]) - 1) for c in timed if c.step_seconds]
    return FitResult(best.efficiency, best.kernel_seconds, best.gap_seconds, max(errors, default=0.0),
                     best.fitted_on, best.host_seconds)


def _host_bound_candidates(partial: FitResult, timed: Sequence[MeasuredConfig],
                           feats: Mapping[str, ClassFeatures]) -> list[list[MeasuredConfig]]:
    """The sets of host-bound steps worth trying: a step is host-bound when ``host - gap`` exceeds
    its kernels' seconds per kernel, so the candidates are the ``m`` steps with the fewest
    kernel seconds per kernel, ``m`` = 0 (none host-bound) to all."""
    order = sorted(timed, key=lambda c: _kernel_seconds(partial, feats[c.name]) / max(feats[c.name].total_kernels, 1))
    return [order[:m] for m in range(len(order) + 1)]


def _fit_host(host_bound: Iterable[MeasuredConfig], feats: Mapping[str, ClassFeatures]) -> float:
    """The host's seconds per kernel minimising the relative squared error of the host-bound
    steps, ``step = host × kernels`` (0 when none)."""
    x = [feats[c.name].total_kernels / c.step_seconds for c in host_bound if c.step_seconds]
    return sum(x) / sum(v * v for v in x) if x else 0.0


def _fit_gap(partial: FitResult, timed: Iterable[MeasuredConfig], feats: Mapping[str, ClassFeatures]) -> float:
    """The gap per kernel minimising the relative squared error of the GPU-bound timed steps (≥ 0)."""
    numerator = denominator = 0.0
    for config in timed:
        assert config.step_seconds is not None
        f = feats[config.name]
        kernels = predict(partial, f)
        x = f.total_kernels / config.step_seconds
        numerator += x * (1 - kernels / config.step_seconds)
        denominator += x * x
    return max(0.0, numerator / denominator) if denominator else 0.0


#: Where :func:`fit_bandwidth` looks for the factor: a GPU whose kernels reach a quarter of its
#: datasheet bandwidth's share on the fitted GPU, up to four times it.
_SCALE_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class BandwidthFit:
    """A GPU's bandwidth factor fitted to its measured steps (:func:`fit_bandwidth`): ``scale``
    multiplies its datasheet bandwidth; ``ratios`` are predicted / measured of the steps it was
    fitted to, in their order, with it."""

    scale: float
    ratios: tuple[float, ...]


def _ratios(result: FitResult, configs: Sequence[MeasuredConfig],
            features_at: Callable[[MeasuredConfig, float], ClassFeatures], scale: float) -> list[float]:
    return [predict(result, features_at(c, scale)) / c.step_seconds for c in configs if c.step_seconds]


def fit_bandwidth(result: FitResult, configs: Sequence[MeasuredConfig],
                  features_at: Callable[[MeasuredConfig, float], ClassFeatures]) -> BandwidthFit:
    """The factor on a GPU's datasheet bandwidth that makes ``result`` (fitted on another GPU)
    best predict ``configs``' measured steps on it (module docstring).

    Args:
        result: the coefficients fitted on the profiled GPU.
        configs: steps measured on this GPU (only their ``step_seconds`` are used).
        features_at: a config's per-class ideal seconds and kernels on this GPU, its datasheet
            bandwidth times the given factor.

    Returns:
        The factor minimising the sum of ``(predicted / measured - 1)²``, and those ratios.

    Raises:
        ValueError: no config has a measured step.
    """
    timed = [c for c in configs if c.step_seconds]
    if not timed:
        raise ValueError("no measured step to fit a bandwidth factor to")

    def cost(log_scale: float) -> float:
        return sum((r - 1) ** 2 for r in _ratios(result, timed, features_at, math.exp(log_scale)))

    # golden-section search on log(scale): the error is unimodal in it (a step's time falls
    # monotonically as its bandwidth grows)
    low, high = math.log(_SCALE_RANGE[0]), math.log(_SCALE_RANGE[1])
    golden = (math.sqrt(5) - 1) / 2
    a, b = high - golden * (high - low), low + golden * (high - low)
    cost_a, cost_b = cost(a), cost(b)
    while high - low > 1e-5:
        if cost_a <= cost_b:
            high, b, cost_b = b, a, cost_a
            a = high - golden * (high - low)
            cost_a = cost(a)
        else:
            low, a, cost_a = a, b, cost_b
            b = low + golden * (high - low)
            cost_b = cost(b)
    scale = math.exp((low + high) / 2)
    return BandwidthFit(scale, tuple(_ratios(result, timed, features_at, scale)))


def leave_one_out_bandwidth(result: FitResult, configs: Sequence[MeasuredConfig],
                            features_at: Callable[[MeasuredConfig, float], ClassFeatures]) -> tuple[float, ...]:
    """Predicted / measured of each timed config by a bandwidth factor fitted to the others
    (:func:`fit_bandwidth`), in their order: how the fitted factor predicts a step it has not seen."""
    timed = [c for c in configs if c.step_seconds]
    held: list[float] = []
    for config in timed:
        scale = fit_bandwidth(result, [c for c in timed if c is not config], features_at).scale
        held.extend(_ratios(result, [config], features_at, scale))
    return tuple(held)

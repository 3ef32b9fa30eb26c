"""The step-time model against the real H100 steps it was fitted to (tests/data/gpu/2026-11-25-h100/),
the fit's arithmetic on a made-up GPU, and the classes the fit relies on."""

from __future__ import annotations

import functools
import statistics
import warnings
from pathlib import Path

import pytest

import memcalc
from memcalc.core.throughput import OpClass
from memcalc.cuda.gpus import fitted
from memcalc.cuda.gpus.calibration import (
    ClassFeatures,
    MeasuredConfig,
    fit,
    ideal_overrides,
    load_measurements,
    predict,
)
from memcalc.engine.flops import op_class_of

DATA = Path(__file__).parent / "data" / "gpu" / "2026-11-25-h100"
CONFIGS = load_measurements(DATA)
TIMED = [c for c in CONFIGS if c.step_seconds]
#: The issue's acceptance bound: every measured step within ±20%.
TOLERANCE = 0.20


@functools.cache
def _report(config: MeasuredConfig) -> memcalc.MemoryReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return memcalc.estimate(config.model, **config.estimate_kwargs())


def _features(config: MeasuredConfig) -> ClassFeatures:
    return ClassFeatures.of(memcalc.step_time(_report(config), **ideal_overrides()))


def test_the_shared_data_has_eight_timed_and_eight_profiled_steps() -> None:
    assert len(TIMED) == 8
    assert sum(1 for c in CONFIGS if c.kernel_seconds) == 8
    assert tuple(c.name for c in TIMED) == fitted.TIMED


@pytest.mark.parametrize("config", TIMED, ids=lambda c: c.name)
def test_step_time_within_20_percent_of_the_measured_step(config: MeasuredConfig) -> None:
    time = _report(config).time
    assert time is not None
    assert config.step_seconds is not None and config.predicted_before is not None
    assert abs(time.seconds / config.step_seconds - 1) <= TOLERANCE
    # the interval said beside it covers the measurement (the spread is the largest error of the fit)
    assert time.low <= config.step_seconds * (1 + 1e-9) and config.step_seconds <= time.high * (1 + 1e-9)
    # before the fit, the roofline was 2.2-4.2x too optimistic on every one of them
    assert config.predicted_before / config.step_seconds < 0.5


def test_committed_coefficients_are_those_the_data_gives() -> None:
    result = fit(CONFIGS, _features)
    for op_class, efficiency in result.efficiency:
        assert fitted.EFFICIENCY[op_class] == pytest.approx(efficiency, rel=1e-3)
    for op_class, seconds in result.kernel_seconds:
        assert fitted.KERNEL_SECONDS[op_class] == pytest.approx(seconds, rel=1e-3)
    assert pytest.approx(result.gap_seconds, rel=1e-3) == fitted.GAP_SECONDS
    assert pytest.approx(result.spread, rel=1e-3) == fitted.SPREAD
    assert fitted.SPREAD <= TOLERANCE
    # the same steps measured on another H100: predicted / measured, median (what the output says)
    again = [c for c in load_measurements(DATA.parent / "2026-11-26-steps", "h100-times.jsonl") if c.step_seconds]
    ratios = sorted(predict(result, _features(c)) / c.step_seconds for c in again if c.step_seconds)
    assert pytest.approx(statistics.median(ratios), rel=1e-3) == fitted.RECHECK_RATIO
    assert pytest.approx((ratios[0], ratios[-1]), rel=1e-3) == fitted.RECHECK_RANGE


def test_fit_recovers_known_coefficients() -> None:
    # a made-up GPU: matmuls at 50% with 10 µs per kernel, memory-bound at 80% with 10 µs, gap 5 µs
    def features(config: MeasuredConfig) -> ClassFeatures:
        scale = config.batch
        return ClassFeatures(ideal=((OpClass.MATMUL, 0.010 * scale), (OpClass.MEMORY, 0.004 * scale)),
                             kernels=((OpClass.MATMUL, 100 + 10 * scale), (OpClass.MEMORY, 400)))

    def measured(batch: int) -> MeasuredConfig:
        matmul = 0.010 * batch / 0.5 + (100 + 10 * batch) * 10e-6
        memory = 0.004 * batch / 0.8 + 400 * 10e-6
        kernels = 500 + 10 * batch
        return MeasuredConfig("m", batch, None, "sgd", "fp32", step_seconds=matmul + memory + kernels * 5e-6,
                              kernel_seconds=((OpClass.MATMUL, matmul), (OpClass.MEMORY, memory)))

    configs = [measured(b) for b in (1, 2, 4, 8)]
    result = fit(configs, features)
    assert result.efficiency_map()[OpClass.MATMUL] == pytest.approx(0.5, rel=1e-6)
    assert result.efficiency_map()[OpClass.MEMORY] == pytest.approx(0.8, rel=1e-6)
    assert result.kernel_seconds_map()[OpClass.MATMUL] == pytest.approx(10e-6, rel=1e-6)
    assert result.gap_seconds == pytest.approx(5e-6, rel=1e-6)
    assert result.spread == pytest.approx(0.0, abs=1e-9)
    # t = ideal / efficiency + kernels × (fixed + gap), batch 1: 0.02 + 0.005 + 510 × 15 µs
    assert predict(result, features(configs[0])) == pytest.approx(0.010 / 0.5 + 0.004 / 0.8 + 510 * 15e-6)


@pytest.mark.parametrize(("name", "op_class"), [
    ("aten::mm", OpClass.MATMUL), ("aten::_cudnn_attention_backward", OpClass.ATTENTION),
    ("aten::native_batch_norm_backward", OpClass.NORMALIZATION), ("aten::native_layer_norm", OpClass.NORMALIZATION),
    ("aten::_foreach_addcdiv_", OpClass.MULTI_TENSOR), ("aten::_conv_depthwise2d", OpClass.CONV),
    ("aten::copy_", OpClass.MEMORY), ("convolution_backward.default", OpClass.CONV),
])
def test_profiled_op_names_sort_into_the_traced_classes(name: str, op_class: OpClass) -> None:
    assert op_class_of(name) is op_class


def test_gpt2_head_is_an_unaligned_gemm() -> None:
    # 50,257 × 2 bytes is not a multiple of 16: the head's forward and its two backward GEMMs
    # run cuBLAS's align1 kernels (profile.json: cutlass_75_..._align1, 3 per step)
    report = memcalc.estimate("gpt2", batch_size=1, seq_len=64, precision="amp-bf16", gpu="h100-80gb", time=True)
    assert report.time is not None
    unaligned = next(c for c in report.time.classes if c.op_class is OpClass.MATMUL_UNALIGNED)
    assert unaligned.kernels == 3
    assert unaligned.flops == 3 * 2 * 64 * 768 * 50257


AGAIN = DATA.parent / "2026-11-26-steps"


@pytest.mark.xfail(strict=True, reason="the H100 of 2026-11-25 that the model is fitted to ran these steps 2.0-2.2x "
                   "slower than the H100 of 2026-11-26 (tests/data/gpu/2026-11-26-steps/README.md): the model is "
                   "about 2x pessimistic on the second one until it is refitted")
def test_step_time_within_20_percent_of_the_same_steps_on_another_h100() -> None:
    again = [c for c in load_measurements(AGAIN, "h100-times.jsonl") if c.step_seconds]
    assert len(again) == len(TIMED)
    ratios = []
    for config in again:
        time = _report(config).time
        assert time is not None and config.step_seconds is not None
        ratios.append(time.seconds / config.step_seconds)
    assert all(abs(r - 1) <= TOLERANCE for r in ratios), ratios

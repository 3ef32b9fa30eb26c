"""The step-time model against real steps: the healthy H200 it is fitted to
(tests/data/gpu/2026-11-26-h200-profile/), a healthy H100 whose steps check the datasheet scaling
and then fit its bandwidth factor alone (tests/data/gpu/2026-11-26-steps/h100-times.jsonl), why the
first fit's H100 (tests/data/gpu/2026-11-25-h100/) is left out, the fit's arithmetic on a made-up
GPU, and the classes the fit relies on."""

from __future__ import annotations

import functools
import statistics
import warnings
from pathlib import Path

import pytest

import memcalc
from memcalc.core.throughput import OpClass
from memcalc.targets.cuda.gpus.catalogue import get_gpu
from memcalc.timing import fitted
from memcalc.timing.calibration import (
    ClassFeatures,
    FitResult,
    MeasuredConfig,
    fit,
    fit_bandwidth,
    ideal_overrides,
    leave_one_out_bandwidth,
    load_measurements,
    predict,
)
from memcalc.timing.flops import op_class_of
from memcalc.timing.performance import device_rates
from models_zoo import plain_torch

GPU_DATA = Path(__file__).parent / "data" / "gpu"
DATA = GPU_DATA / "2026-11-26-h200-profile"
CONFIGS = load_measurements(DATA)
TIMED = [c for c in CONFIGS if c.step_seconds]
#: A healthy H100's steps of 2026-11-26: they check the datasheet scaling, and fit the H100's bandwidth factor.
H100_STEPS = [c for c in load_measurements(GPU_DATA / "2026-11-26-steps", "h100-times.jsonl") if c.step_seconds]
#: The first fit's data, left out (test_the_first_h100_ran_its_kernels_at_half_speed).
EXCLUDED = load_measurements(GPU_DATA / "2026-11-25-h100")
#: The issue's acceptance bound: every measured step within ±20%.
TOLERANCE = 0.20


@functools.cache
def _report(config: MeasuredConfig, gpu: str = "h200") -> memcalc.MemoryReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the steps were measured with the zoo's plain-torch models (torch:NAME)
        return memcalc.estimate(plain_torch(config.model), **config.estimate_kwargs(gpu))


def _features(config: MeasuredConfig) -> ClassFeatures:
    return ClassFeatures.of(memcalc.step_time(_report(config), **ideal_overrides()))


def _h100_features(config: MeasuredConfig, bandwidth_scale: float = 1.0) -> ClassFeatures:
    overrides = {**ideal_overrides(), "bandwidth_scale": bandwidth_scale}
    return ClassFeatures.of(memcalc.step_time(_report(config, "h100-80gb"), **overrides))


def test_the_shared_data_has_twelve_timed_and_eight_profiled_steps() -> None:
    assert len(TIMED) == 12
    assert sum(1 for c in CONFIGS if c.kernel_seconds) == 8
    assert tuple(c.name for c in TIMED) == fitted.TIMED
    assert fitted.GPU == "h200" and fitted.DEVICE == "NVIDIA H200"
    assert len(H100_STEPS) == 8 == fitted.RECHECK_STEPS


@pytest.mark.parametrize("config", TIMED, ids=lambda c: c.name)
@pytest.mark.quick_cases("gpt2 b8 s1024 adamw amp-bf16")  # each case estimates a real-size model
def test_step_time_within_20_percent_of_the_measured_h200_step(config: MeasuredConfig) -> None:
    time = _report(config).time
    assert time is not None
    assert config.step_seconds is not None
    assert abs(time.seconds / config.step_seconds - 1) <= TOLERANCE
    # the interval said beside it covers the measurement (the spread is the largest error of the fit)
    assert time.low <= config.step_seconds * (1 + 1e-9) and config.step_seconds <= time.high * (1 + 1e-9)


#: The one healthy-H100 step the datasheet scaling alone misses by more than 20%: resnet50 in float32 spends a
#: third of its H200 kernels in batch norm, which the model times by bandwidth (3.35 TB/s on the H100 against 4.8
#: on the H200, 1.43x); the H100 ran the step only 1.16x slower than the H200 (37.9 against 32.7 ms).
_SCALING_MISSES = {"resnet50 b64 adam fp32"}


@pytest.mark.parametrize("config", H100_STEPS, ids=lambda c: c.name)
@pytest.mark.slow  # eight real-size models estimated on an H100
def test_step_time_within_20_percent_of_a_healthy_h100_step(config: MeasuredConfig) -> None:
    # the H200's coefficients with the H100's bandwidth factor fitted to these eight steps (the default on an H100)
    time = _report(config, "h100-80gb").time
    assert time is not None and config.step_seconds is not None
    assert abs(time.seconds / config.step_seconds - 1) <= TOLERANCE
    # scaled by the datasheet alone, the check that led to the factor: 7-27% pessimistic, one step beyond 20%
    datasheet = memcalc.step_time(_report(config, "h100-80gb"), bandwidth_scale=1.0).seconds / config.step_seconds
    assert datasheet > 1.0 and (datasheet > 1 + TOLERANCE) == (config.name in _SCALING_MISSES)


@pytest.mark.slow  # eight real-size models estimated on an H100, the factor fitted eight times
def test_each_h100_step_left_out_of_the_bandwidth_fit_is_within_20_percent() -> None:
    # held out: each step predicted by the factor fitted to the seven others
    held_out = leave_one_out_bandwidth(fitted_result(), H100_STEPS, _h100_features)
    assert len(held_out) == 8 and all(abs(r - 1) <= TOLERANCE for r in held_out)
    assert (min(held_out), max(held_out)) == pytest.approx(fitted.MEASURED_HELD_OUT_RANGE, rel=1e-3)


def fitted_result() -> FitResult:
    """The committed coefficients as a :class:`FitResult` (what :func:`predict` takes)."""
    return FitResult(tuple(fitted.EFFICIENCY.items()), tuple(fitted.KERNEL_SECONDS.items()), fitted.GAP_SECONDS,
                     fitted.SPREAD, fitted.TIMED, fitted.HOST_SECONDS)


@pytest.mark.slow  # the fit's 20 real-size estimates
def test_committed_coefficients_are_those_the_data_gives() -> None:
    result = fit(CONFIGS, _features)
    for op_class, efficiency in result.efficiency:
        assert fitted.EFFICIENCY[op_class] == pytest.approx(efficiency, rel=1e-3)
    for op_class, seconds in result.kernel_seconds:
        assert fitted.KERNEL_SECONDS[op_class] == pytest.approx(seconds, rel=1e-3)
    assert pytest.approx(result.gap_seconds, rel=1e-3) == fitted.GAP_SECONDS
    assert pytest.approx(result.host_seconds, rel=1e-3) == fitted.HOST_SECONDS
    assert pytest.approx(result.spread, rel=1e-3) == fitted.SPREAD
    # the spread is the largest error relative to the prediction: the widest ± the timed steps need
    widest = max(abs(c.step_seconds / predict(result, _features(c)) - 1) for c in TIMED if c.step_seconds)
    assert widest == pytest.approx(fitted.SPREAD, rel=1e-3)
    # the healthy H100's steps: predicted / measured, median and range (what the output says)
    ratios = sorted(predict(result, _h100_features(c)) / c.step_seconds for c in H100_STEPS if c.step_seconds)
    assert pytest.approx(statistics.median(ratios), rel=1e-3) == fitted.RECHECK_RATIO
    assert pytest.approx((ratios[0], ratios[-1]), rel=1e-3) == fitted.RECHECK_RANGE
    # then the H100's bandwidth factor fitted to the same steps, and its ratios
    bandwidth = fit_bandwidth(result, H100_STEPS, _h100_features)
    assert {"h100-80gb": pytest.approx(bandwidth.scale, rel=1e-3)} == fitted.MEASURED_BANDWIDTH
    assert fitted.MEASURED_STEPS == len(bandwidth.ratios) == 8
    assert (min(bandwidth.ratios), max(bandwidth.ratios)) == pytest.approx(fitted.MEASURED_RANGE, rel=1e-3)


def test_the_first_h100_ran_its_kernels_at_half_speed() -> None:
    # Why tests/data/gpu/2026-11-25-h100/ is not fitted: per config profiled on both, its kernels add up to about
    # twice the H200's kernels of the same step, and to about twice the whole step (kernels and gaps) of the
    # healthy H100 of 2026-11-26, the same GPU model and torch. The H200's kernels add up to its unprofiled step
    # within 1-4%: its steps are GPU-bound, so the kernels are what differ.
    h200 = {c.name: c for c in CONFIGS}
    h100 = {c.name: c for c in H100_STEPS}
    both = [c for c in EXCLUDED if c.kernel_seconds and c.name in h200 and h200[c.name].kernel_seconds]
    assert len(both) == 6
    for config in both:
        first = config.kernel_total()
        healthy = h100[config.name].step_seconds
        fitted_step = h200[config.name].step_seconds
        assert healthy is not None and fitted_step is not None
        assert 2.0 <= first / h200[config.name].kernel_total() <= 2.4, config.name
        assert 1.85 <= first / healthy <= 2.05, config.name
        assert 0.96 <= h200[config.name].kernel_total() / fitted_step <= 0.99, config.name
    assert fitted.DEVICE != "NVIDIA H100 80GB HBM3"  # and the committed model is not the one fitted to it


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
    report = memcalc.estimate("torch:gpt2", batch_size=1, seq_len=64, precision="amp-bf16", gpu="h100-80gb", time=True)
    assert report.time is not None
    unaligned = next(c for c in report.time.classes if c.op_class is OpClass.MATMUL_UNALIGNED)
    assert unaligned.kernels == 3
    assert unaligned.flops == 3 * 2 * 64 * 768 * 50257


def test_fit_bandwidth_recovers_a_known_factor() -> None:
    # the made-up GPU of test_fit_recovers_known_coefficients, fitted; another GPU runs the same steps with its
    # memory-bound kernels 1.5x as fast as its datasheet bandwidth gives (ideal memory seconds / 1.5)
    result = FitResult(((OpClass.MATMUL, 0.5), (OpClass.MEMORY, 0.8)), ((OpClass.MATMUL, 10e-6),
                                                                       (OpClass.MEMORY, 10e-6)), 5e-6, 0.0)

    def features_at(config: MeasuredConfig, scale: float) -> ClassFeatures:
        ideal = ((OpClass.MATMUL, 0.010 * config.batch), (OpClass.MEMORY, 0.004 * config.batch / scale))
        return ClassFeatures(ideal=ideal, kernels=((OpClass.MATMUL, 100), (OpClass.MEMORY, 400)))

    def measured(batch: int) -> MeasuredConfig:
        # 0.02 s of matmuls, memory at 1.5x: 0.004 / 1.5 / 0.8, 500 kernels × (10 + 5) µs
        step = (0.010 / 0.5 + 0.004 / 1.5 / 0.8) * batch + 500 * 15e-6
        return MeasuredConfig("m", batch, None, "sgd", "fp32", step_seconds=step)

    configs = [measured(b) for b in (1, 2, 4)]
    found = fit_bandwidth(result, configs, features_at)
    assert found.scale == pytest.approx(1.5, rel=1e-4)
    assert found.ratios == pytest.approx((1.0, 1.0, 1.0), rel=1e-5)
    # each left out: the two others give the same factor, so it predicts the third exactly
    assert leave_one_out_bandwidth(result, configs, features_at) == pytest.approx((1.0, 1.0, 1.0), rel=1e-5)
    with pytest.raises(ValueError, match="no measured step"):
        fit_bandwidth(result, [MeasuredConfig("m", 1, None, "sgd", "fp32")], features_at)


def test_a_measured_bandwidth_factor_times_the_h100_and_can_be_overridden() -> None:
    # the fitted factor multiplies the H100's datasheet bandwidth; other GPUs keep theirs; 1.0 restores it
    h100 = get_gpu("h100-80gb")
    assert device_rates(h100).bandwidth == pytest.approx(3350e9 * fitted.MEASURED_BANDWIDTH["h100-80gb"])
    assert device_rates(h100, bandwidth_scale=1.0).bandwidth == 3350e9
    assert device_rates(get_gpu("a100-80gb")).bandwidth == 2039e9
    assert device_rates(h100, bandwidth_scale=1.0).spread == 0.0  # the caller's coefficients: no fitted spread
    assert "its bandwidth term fitted to 8 of its own steps" in device_rates(h100).basis
    # the peaks line says the bandwidth is not the datasheet's alone
    scale = fitted.MEASURED_BANDWIDTH["h100-80gb"]
    assert device_rates(h100).source.endswith(f"3.35 TB/s; the bandwidth term times {scale:.4g} (fitted to its 8 "
                                              f"measured steps)")
    assert device_rates(h100, bandwidth_scale=1.5).source.endswith("times 1.5 (given)")
    assert device_rates(h100, bandwidth_scale=1.0).source.endswith("3.35 TB/s")
    with pytest.raises(memcalc.InvalidInputError, match="bandwidth_scale must be positive"):
        device_rates(h100, bandwidth_scale=0.0)


def test_fit_recovers_a_host_bound_floor() -> None:
    # the made-up GPU above at batch / 64, with a host that needs 40 µs per kernel: batches 1 and 2 are host-bound
    # (510 kernels × 40 µs = 20.4 ms against 8.0 ms of kernels and gaps), 128 and 256 GPU-bound
    # (batch 128: 53.8 + 14.0 ms of kernels + 1,780 × 5 µs of gaps = 76.7 ms > 1,780 × 40 µs = 71.2 ms)
    def features(config: MeasuredConfig) -> ClassFeatures:
        scale = config.batch / 64
        return ClassFeatures(ideal=((OpClass.MATMUL, 0.010 * scale), (OpClass.MEMORY, 0.004 * scale)),
                             kernels=((OpClass.MATMUL, 100 + 10 * config.batch), (OpClass.MEMORY, 400)))

    def measured(batch: int) -> MeasuredConfig:
        matmul = 0.010 * batch / 64 / 0.5 + (100 + 10 * batch) * 10e-6
        memory = 0.004 * batch / 64 / 0.8 + 400 * 10e-6
        kernels = 500 + 10 * batch
        step = max(matmul + memory + kernels * 5e-6, kernels * 40e-6)
        return MeasuredConfig("m", batch, None, "sgd", "fp32", step_seconds=step,
                              kernel_seconds=((OpClass.MATMUL, matmul), (OpClass.MEMORY, memory)))

    configs = [measured(b) for b in (1, 2, 128, 256)]
    result = fit(configs, features)
    assert result.gap_seconds == pytest.approx(5e-6, rel=1e-6)
    assert result.host_seconds == pytest.approx(40e-6, rel=1e-6)
    assert result.spread == pytest.approx(0.0, abs=1e-9)
    assert predict(result, features(configs[0])) == pytest.approx(510 * 40e-6)

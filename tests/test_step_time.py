"""Step time from a roofline per kernel (memcalc.timing.flops.StepCosts, memcalc.step_time):
the arithmetic by hand on made-up kernels, the GPUs' figures, the report and its JSON, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Phase
from memcalc.core.errors import InvalidInputError
from memcalc.core.throughput import DataLoaderSetup, DeviceRates, OpClass, StepFlops, StepTime
from memcalc.targets.cuda.gpus.catalogue import catalogue, get_gpu
from memcalc.timing import fitted
from memcalc.timing.flops import OpCost, StepCosts, multi_tensor_launches
from memcalc.timing.performance import (
    EFFICIENCY,
    HOST_SECONDS,
    PERFORMANCE,
    device_rates,
    loader_advice,
    step_time,
    with_time,
)

RATES = DeviceRates(
    gpu="test", peaks=(("fp32", 10e12), ("tf32", 100e12), ("bf16", 200e12)), bandwidth=1e12,
    efficiency=((OpClass.MATMUL, 0.5), (OpClass.CONV, 0.5), (OpClass.ATTENTION, 0.25), (OpClass.MEMORY, 0.8),
                (OpClass.MULTI_TENSOR, 0.5)),
    launch_overhead=1e-6)


def cost(phase: Phase, op_class: OpClass, dtype: str, flops: int, nbytes: int, launches: int = 1,
         recompute: bool = False) -> OpCost:
    return OpCost(phase, recompute, "m", "op", op_class, dtype, flops, nbytes, launches, False)


def test_roofline_by_hand() -> None:
    records = [
        # bf16 GEMM: 1e12 FLOP / (200e12 · 0.5) = 10 ms; 1e9 B / (1e12 · 0.5) = 2 ms → compute-bound, 10 ms
        cost(Phase.FORWARD, OpClass.MATMUL, "bfloat16", 10**12, 10**9),
        # fp32 GEMM (TF32 off for matmul, PyTorch's default): 1e11 / (10e12 · 0.5) = 20 ms
        cost(Phase.BACKWARD, OpClass.MATMUL, "float32", 10**11, 10**6),
        # fp32 conv runs on TF32 tensor cores: 1e11 / (100e12 · 0.5) = 2 ms
        cost(Phase.BACKWARD, OpClass.CONV, "float32", 10**11, 10**6),
        # elementwise: 8e8 B / (1e12 · 0.8) = 1 ms
        cost(Phase.BACKWARD, OpClass.MEMORY, "", 0, 8 * 10**8),
        # recomputed GEMM, memory-bound: 1e6 / (200e12 · 0.5) = 10 ns < 4e8 / (1e12 · 0.5) = 0.8 ms
        cost(Phase.BACKWARD, OpClass.MATMUL, "bfloat16", 10**6, 4 * 10**8, recompute=True),
        # optimizer: 3 launches, 6e8 B / (1e12 · 0.5) = 1.2 ms
        cost(Phase.OPTIMIZER, OpClass.MULTI_TENSOR, "", 0, 6 * 10**8, launches=3),
    ]
    time = StepCosts(records, samples=32, tokens=None).time(RATES)
    busy = 10e-3 + 20e-3 + 2e-3 + 1e-3 + 0.8e-3 + 1.2e-3
    launches = 8 * 1e-6
    assert time.seconds == pytest.approx(busy + launches)
    assert time.launch_seconds == pytest.approx(launches)
    assert time.phase_seconds("forward") == pytest.approx(10e-3 + 1e-6)
    assert time.phase_seconds("backward") == pytest.approx(23e-3 + 3e-6)
    assert time.phase_seconds("recompute") == pytest.approx(0.8e-3 + 1e-6)
    assert time.phase_seconds("optimizer") == pytest.approx(1.2e-3 + 3e-6)
    assert time.samples_per_second == pytest.approx(32 / time.seconds)
    assert time.tokens_per_second is None
    matmul = next(c for c in time.classes if c.op_class is OpClass.MATMUL)
    assert matmul.compute_bound_seconds == pytest.approx(30e-3)  # the recomputed GEMM was memory-bound
    assert sum(c.seconds for c in time.classes) == pytest.approx(time.seconds)
    # a host that needs 5 ms per kernel: 8 kernels × 5 ms = 40 ms > 35.008 ms of kernels and gaps, so the
    # step is host-bound; the GPU's idle time is booked as gaps, the phases stretched in proportion
    slow_host = dataclasses.replace(RATES, host_seconds=5e-3)
    bound = StepCosts(records, samples=32, tokens=None).time(slow_host)
    assert bound.seconds == pytest.approx(8 * 5e-3)
    assert bound.launch_seconds == pytest.approx(launches + 8 * 5e-3 - (busy + launches))
    assert bound.phase_seconds("forward") == pytest.approx((10e-3 + 1e-6) * 40e-3 / (busy + launches))
    assert sum(c.seconds for c in bound.classes) == pytest.approx(bound.seconds)
    # a faster host leaves the GPU-bound step as it was
    fast_host = dataclasses.replace(RATES, host_seconds=4e-3)
    assert StepCosts(records, samples=32, tokens=None).time(fast_host).seconds == pytest.approx(busy + launches)


def test_math_modes() -> None:
    assert RATES.peak(OpClass.MATMUL, "float32") == ("fp32", 10e12)  # allow_tf32 is False for matmuls
    assert RATES.peak(OpClass.CONV, "float32") == ("tf32", 100e12)  # and True for cuDNN convolutions
    assert RATES.peak(OpClass.MATMUL, "bfloat16") == ("bf16", 200e12)
    assert RATES.peak(OpClass.MATMUL, "float16") == ("fp32", 10e12)  # no fp16 figure: the next one down
    v100 = device_rates(get_gpu("v100-16gb"))
    assert v100.peak(OpClass.CONV, "float32") == ("fp32", 15.7e12)  # no TF32 before Ampere
    assert v100.peak(OpClass.MATMUL, "bfloat16") == ("fp32", 15.7e12)  # no bf16 tensor cores on sm70
    assert v100.peak(OpClass.MATMUL, "float16") == ("fp16", 125e12)


def test_every_catalogue_gpu_but_the_a10g_has_sourced_figures() -> None:
    keys = {gpu.key for gpu in catalogue()}
    assert set(PERFORMANCE) <= keys
    assert keys - set(PERFORMANCE) == {"a10g"}  # no NVIDIA datasheet of its own (performance.py says why)
    for key, figures in PERFORMANCE.items():
        assert figures.source and figures.bandwidth > 0, key
        peaks = dict(figures.peaks)
        assert peaks["fp32"] < peaks["fp16"], key  # tensor cores beat CUDA cores on every one of them


def test_the_a100_datasheet_figures() -> None:
    a100 = PERFORMANCE["a100-40gb"]
    assert dict(a100.peaks) == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert a100.bandwidth == 1555e9
    assert PERFORMANCE["a100-80gb"].bandwidth == 2039e9
    assert dict(PERFORMANCE["h100-80gb"].peaks)["bf16"] == 989.5e12 and PERFORMANCE["h100-80gb"].bandwidth == 3350e9


def mlp_report(**options: object) -> memcalc.MemoryReport:
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return memcalc.estimate(model, inputs=torch.randn(64, 256), **{"gpu": "a100-80gb", **options})  # type: ignore[arg-type]


def test_step_time_of_a_report() -> None:
    report = mlp_report()
    time = step_time(report)
    assert time.gpu == "a100-80gb"
    assert time.samples == 64
    assert time.seconds == pytest.approx(sum(p.seconds for p in time.phases))
    assert [p.phase for p in time.phases] == ["forward", "loss", "backward", "optimizer"]
    assert time.flops == report.flops()
    assert dict(time.assumptions)["efficiency: matmul"] == EFFICIENCY[OpClass.MATMUL]
    # a step this small is host-bound: the host's time per kernel × its kernels
    kernels = sum(c.kernels for c in time.classes)
    assert time.seconds == pytest.approx(kernels * HOST_SECONDS)
    # without the host floor, faster GPUs take less time; assumed efficiencies can be replaced
    a100, h100, t4 = (step_time(mlp_report(gpu=g), host_seconds=0.0).seconds for g in ("a100-80gb", "h100-80gb", "t4"))
    assert h100 < a100 < t4 and a100 < time.seconds
    better = step_time(report, efficiency=dict.fromkeys(OpClass, 1.0), launch_overhead=0.0, host_seconds=0.0)
    assert better.seconds < a100 and better.launch_seconds == 0


def test_accumulation_counts_every_micro_batch() -> None:
    # GPU-bound (no host floor): a step this small is host-bound, which would stretch its phases
    one, four = (step_time(mlp_report(accum_steps=n), host_seconds=0.0) for n in (1, 4))
    assert four.samples == 4 * one.samples
    assert four.flops.phase("forward") == 4 * one.flops.phase("forward")
    assert four.phase_seconds("optimizer") == pytest.approx(one.phase_seconds("optimizer"))  # one step
    assert four.samples_per_second > one.samples_per_second  # the optimizer step is shared


def test_tokens_of_a_token_model() -> None:
    time = step_time(memcalc.estimate("gpt2", batch_size=2, seq_len=64, gpu="a100-80gb", precision="amp-bf16"))
    assert time.tokens == 2 * 64
    assert time.tokens_per_second == pytest.approx(128 / time.seconds)


def test_checkpointing_costs_a_recomputation() -> None:
    plain, checkpointed = (step_time(memcalc.estimate("gpt2", batch_size=2, seq_len=64, gpu="a100-80gb",
                                                      checkpoint=on)) for on in (False, True))
    assert plain.flops.phase("recompute") == 0 < checkpointed.flops.phase("recompute") < plain.flops.phase("forward")
    assert checkpointed.seconds > plain.seconds


@pytest.mark.parametrize("gpu", [None, "a10g", memcalc.CPU])
def test_no_time_without_sourced_figures(gpu: str | None) -> None:
    report = mlp_report(gpu=gpu)
    with pytest.raises(InvalidInputError, match="cannot time the step"):
        step_time(report)


def test_json_gains_time_only_when_computed() -> None:
    report = mlp_report()
    assert "time" not in report.to_dict()
    timed = with_time(report)
    data = timed.to_dict()
    assert {k: v for k, v in data.items() if k != "time"} == report.to_dict()
    assert data["time"]["samples_per_second"] == pytest.approx(64 / data["time"]["seconds"])
    assert json.loads(json.dumps(data))["time"]["flops"]["total"] == report.flops().total


def test_cli_time_text_and_json() -> None:
    runner = CliRunner()
    text = runner.invoke(main, ["resnet18", "--batch", "4", "--gpu", "a100-80gb", "--time"])
    assert text.exit_code == 0, text.output
    assert "step time on NVIDIA A100-SXM4-80GB" in text.output and "samples/s" in text.output
    # the interval and what it rests on, beside the time: fitted on the H200, the A100 scaled from its datasheet
    assert f"±{fitted.SPREAD:.0%} on the {len(fitted.TIMED)} steps it was fitted to, on an NVIDIA H200" in text.output
    assert "a100-80gb scaled from its datasheet peaks, an assumption" in text.output
    # with how that scaling held on a healthy H100's steps, measured, not fitted
    low, high = fitted.RECHECK_RANGE
    assert (f"on {fitted.RECHECK_STEPS} steps of an h100-80gb, predicted / measured {low:.2f}-{high:.2f}"
            in text.output)
    assert "upper bound" not in text.output  # the caveat of the first fit (a half-speed H100) is gone
    # on the H100, whose own steps were measured, its bandwidth term is fitted to them, and the output says so
    h100 = runner.invoke(main, ["resnet18", "--batch", "4", "--gpu", "h100-80gb", "--time"])
    low, high = fitted.MEASURED_RANGE
    held_low, held_high = fitted.MEASURED_HELD_OUT_RANGE
    assert (f"h100-80gb scaled from its datasheet peaks, its bandwidth term fitted to {fitted.MEASURED_STEPS} of its "
            f"own steps (its memory-bound kernels reach {fitted.MEASURED_BANDWIDTH['h100-80gb']:.2f}x the NVIDIA "
            f"H200's fraction of the datasheet bandwidth; predicted / measured {low:.2f}-{high:.2f}, each left out "
            f"of the fit {held_low:.2f}-{held_high:.2f})") in " ".join(h100.output.split())
    data = json.loads(runner.invoke(main, ["resnet18", "--batch", "4", "--gpu", "a100-80gb", "--time",
                                           "--format", "json"]).output)
    assert data["time"]["samples"] == 4 and data["time"]["gpu"] == "a100-80gb"
    # seconds × (1 ± spread)
    assert data["time"]["spread"] == fitted.SPREAD
    assert data["time"]["seconds_low"] == pytest.approx(data["time"]["seconds"] * (1 - fitted.SPREAD))
    assert data["time"]["seconds_high"] == pytest.approx(data["time"]["seconds"] * (1 + fitted.SPREAD))
    assert "scaled from its datasheet" in data["time"]["basis"]
    untimed = json.loads(runner.invoke(main, ["resnet18", "--batch", "4", "--gpu", "a100-80gb",
                                              "--format", "json"]).output)
    assert "time" not in untimed


def test_cli_time_needs_a_gpu_before_estimating() -> None:
    result = CliRunner().invoke(main, ["resnet18", "--batch", "4", "--time"])
    assert result.exit_code == 2
    assert "no GPU was named" in result.output


@pytest.mark.slow  # a timed fit and a timed sweep
def test_fit_and_sweep_time_options() -> None:
    runner = CliRunner()
    fit = runner.invoke(main, ["fit", "resnet18", "--input-shape", "3,64,64", "--gpu", "t4", "--time"])
    assert fit.exit_code == 0, fit.output
    assert "step time on Tesla T4" in fit.output
    sweep = runner.invoke(main, ["sweep", "gpt2", "--seq-len", "32", "--batch", "1,4", "--gpu", "t4", "--time"])
    assert sweep.exit_code == 0, sweep.output
    header = next(line for line in sweep.output.splitlines() if line.lstrip().startswith("batch"))
    assert header.split()[-3:] == ["time", "samples/s", "tokens/s"]


@pytest.mark.slow  # fastest_setting's search over micro-batches and checkpointing
def test_fastest_setting_reaches_the_target_batch() -> None:
    from memcalc.api import fastest_setting

    choice = fastest_setting("gpt2", seq_len=64, gpu="t4", precision="amp-fp16", target_batch=384)
    assert {c.samples_per_step for c in choice.candidates} == {384}
    assert {c.checkpoint for c in choice.candidates} == {False, True}  # gpt2's blocks can be checkpointed
    assert choice.best.samples_per_second == max(c.samples_per_second for c in choice.candidates)
    for candidate in choice.candidates:
        assert candidate.report.fits  # under the budget less the margin
        time = candidate.report.time
        assert time is not None
        # estimated with min(a, 2) micro-batches; timed as a micro-batches and one optimizer step
        traced = min(candidate.accum_steps, 2)
        assert candidate.report.accum_steps == traced
        once = time.phase_seconds("optimizer") + time.phase_seconds("zero_grad")
        assert candidate.seconds == pytest.approx((time.seconds - once) / traced * candidate.accum_steps + once)
    accumulating = [c for c in choice.candidates if c.accum_steps > 1]
    assert accumulating and all(c.micro_batch * c.accum_steps == 384 for c in accumulating)


def test_fastest_setting_of_a_model_without_blocks_leaves_checkpointing_out() -> None:
    from memcalc.api import fastest_setting

    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    choice = fastest_setting(model, input_shape=(3, 128, 128), gpu="t4")
    assert {c.checkpoint for c in choice.candidates} == {False}
    assert any(reason.startswith("checkpointing:") for reason in choice.left_out)
    assert choice.best.accum_steps == 1


@pytest.mark.slow  # fit --objective throughput twice: about 25 s
def test_cli_fit_objective_throughput() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["fit", "gpt2", "--seq-len", "64", "--gpu", "t4", "--precision", "amp-fp16",
                                  "--objective", "throughput", "--target-batch", "384"])
    assert result.exit_code == 0, result.output
    assert "fastest: micro-batch" in result.output and "why: " in result.output
    data = json.loads(runner.invoke(main, ["fit", "gpt2", "--seq-len", "64", "--gpu", "t4", "--precision",
                                           "amp-fp16", "--objective", "throughput", "--target-batch", "384",
                                           "--format", "json"]).output)
    assert data["best"]["samples_per_step"] == 384
    assert data["best"]["samples_per_second"] == max(c["samples_per_second"] for c in data["candidates"])


def test_cli_target_batch_needs_the_throughput_objective() -> None:
    refused = CliRunner().invoke(main, ["fit", "gpt2", "--gpu", "t4", "--target-batch", "64"])
    assert refused.exit_code == 2 and "--objective throughput" in refused.output


def a_step(samples: int = 64, seconds: float = 0.032) -> StepTime:
    """A step of 64 samples in 32 ms: the GPU consumes 2,000 samples/s."""
    flops = StepFlops(total=0, phases=())
    return StepTime(gpu="test", seconds=seconds, samples=samples, tokens=None, phases=(), classes=(),
                            flops=flops, launch_seconds=0.0, assumptions=())


def test_loader_memory_and_pace_by_hand() -> None:
    from memcalc.core.throughput import advise_loader

    setup = DataLoaderSetup(num_workers=8, pin_memory=True, sample_bytes=1000, sample_load_ms=5)
    advice = advise_loader(a_step(), setup, batch_size=64, sample_bytes=1)
    # batch 64 × 1,000 B = 64,000 B; 8 workers × prefetch 2 = 16 batches in shared memory: 1,024,000 B;
    # pinned: 17 batches (16 in flight, 1 in use), each rounded up to 65,536 B (a power of two)
    assert advice.batches_in_flight == 16
    assert advice.shared_memory_bytes == 1_024_000
    assert advice.pinned_bytes == 17 * 65_536
    assert advice.host_bytes == 1_024_000 + 17 * 65_536
    # 2,000 samples/s over 8 workers: each makes one every 8 / 2,000 s = 4 ms; at 5 ms they make
    # 8 / 0.005 = 1,600 samples/s: the loader is the bottleneck, the GPU idle 20%; 2,000 × 0.005 = 10 workers
    assert advice.worker_ms_per_sample == pytest.approx(4.0)
    assert advice.loader_samples_per_second == pytest.approx(1600)
    assert advice.loader_bound and advice.gpu_idle == pytest.approx(0.2)
    assert advice.workers_needed == 10
    enough = advise_loader(a_step(), replace_setup(setup, num_workers=10), batch_size=64, sample_bytes=1)
    assert enough.loader_bound is False and enough.samples_per_second == pytest.approx(2000)


def replace_setup(setup: DataLoaderSetup, **changes: object) -> DataLoaderSetup:
    from dataclasses import replace

    return replace(setup, **changes)  # type: ignore[arg-type]


def test_loading_in_the_main_process_adds_to_the_step() -> None:
    from memcalc.core.throughput import advise_loader

    # num_workers=0: 64 samples × 0.25 ms = 16 ms of loading, then the 32 ms step: 64 / 0.048 s
    advice = advise_loader(a_step(), DataLoaderSetup(sample_load_ms=0.25), batch_size=64, sample_bytes=500)
    assert advice.samples_per_second == pytest.approx(64 / 0.048)
    assert advice.loader_bound and advice.gpu_idle == pytest.approx(1 / 3)
    assert advice.workers_needed == 1  # 2,000 × 0.00025 = 0.5: one worker overlaps it all
    assert advice.host_bytes == 64 * 500 and advice.pinned_bytes == 0
    assert advise_loader(a_step(), DataLoaderSetup(), batch_size=64, sample_bytes=500).loader_bound is None


def test_data_loader_spec() -> None:
    setup = DataLoaderSetup.parse("workers=8, prefetch_factor=4,pin=yes,sample-bytes=1KiB", sample_load_ms=3)
    assert setup == DataLoaderSetup(num_workers=8, prefetch_factor=4, pin_memory=True, sample_bytes=1024,
                                            sample_load_ms=3)
    assert DataLoaderSetup.parse("") == DataLoaderSetup()
    for bad in ("threads=4", "workers=many", "pin=maybe", "workers=-1"):
        with pytest.raises(InvalidInputError):
            DataLoaderSetup.parse(bad)


def test_cli_data_loader() -> None:
    runner = CliRunner()
    args = ["resnet18", "--batch", "32", "--gpu", "a100-80gb", "--data-loader", "workers=2,pin=yes",
            "--sample-load-ms", "20"]
    text = runner.invoke(main, args)
    assert text.exit_code == 0, text.output
    assert "THE LOADER IS THE BOTTLENECK" in text.output and "step time on" in text.output
    data = json.loads(runner.invoke(main, [*args, "--format", "json"]).output)
    loader = data["data_loader"]
    assert loader["loader_bound"] is True and loader["loader_samples_per_second"] == pytest.approx(100)  # 2 / 0.02 s
    assert loader["workers_needed"] == math.ceil(data["time"]["samples_per_second"] * 0.02)
    assert loader["sample_bytes"] == 3 * 224 * 224 * 4 + 8  # an image and its int64 class index


def test_loader_advice_defaults_to_the_input_bytes() -> None:
    report = mlp_report()  # inputs (64, 256) fp32; cross-entropy's targets, one int64 class index each
    advice = loader_advice(report)
    assert advice.sample_bytes == 256 * 4 + 8
    assert advice.gpu_samples_per_second == pytest.approx(step_time(report).samples_per_second)


def test_a_foreach_kernels_record_grows_with_the_depth_as_its_tensor_lists_do() -> None:
    """Depth composition (memcalc.distributed.depth_compose) extends a kernel's record over every
    block, one layer's difference at a time: a foreach kernel over the parameters of ``n`` layers
    (each a 100-chunk weight and a bias) and two others, 4 tensor lists (at most 36 tensors a
    launch, 320 chunks). Its launches are not affine in ``n`` (ceilings), its tensors and chunks are:
    53 layers give 108 tensors (3 launches' worth) and 3 + 101 × 53 = 5,356 chunks, 17 launches
    (⌈5356 / 320⌉), as multi_tensor_launches counts the 53-layer list itself."""
    base, layer = [1000, 70000], [65536 * 100, 10]

    def record(layers: int) -> OpCost:
        numels = base + layer * layers
        tensors, chunks = sum(1 for n in numels if n), sum(-(-n // 65536) for n in numels)
        return OpCost(Phase.OPTIMIZER, False, "", "_foreach_add_.List", OpClass.MULTI_TENSOR, "", 0,
                      sum(numels) * 2 * 3, multi_tensor_launches(numels, 4), False, tensors=tensors, chunks=chunks,
                      lists=4)

    grown = record(3).extended(record(2), 50)
    assert grown == record(53)
    assert grown is not None and (grown.tensors, grown.chunks, grown.launches) == (108, 5356, 17)
    assert record(3)._replace(op="_foreach_mul_.List").extended(record(2), 50) is None  # another kernel

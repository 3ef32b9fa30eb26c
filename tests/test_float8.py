"""Float8 training (issue 34, item 3): torchao's own ``convert_to_float8_training`` applied to the
meta model and traced. Checked by hand-worked bytes from torchao's code (torchao 0.18,
``float8_linear.py``, ``float8_scaling_utils.py``, ``float8_ops.py``), and against real CPU steps
of torchao's ``emulate=True`` configuration, whose casts and saved tensors are the same code and
whose matmuls run on the CPU."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from click.testing import CliRunner
from torch import nn

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Phase
from memcalc.core.float8 import Float8, parse_float8
from memcalc.engine.trace import StepTrace
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu
from memcalc.sources.resolve import resolve
from memcalc.stacks.float8 import apply_float8

ao = pytest.importorskip("torchao.float8", reason="float8 training needs torchao (pip install 'memcalc[float8]')")
from memcalc.engine.run import trace_model  # noqa: E402  # after the skip: the tests below need torchao

M, K, N = 256, 4096, 4096  # tokens, in_features, out_features of one Linear(4096, 4096)
BF16, FP8, FP32 = 2, 1, 4  # bytes per element


def _births(recipe: str) -> tuple[Counter[tuple[str, str, int]], StepTrace]:
    """(phase, op, bytes) of every storage one training step of a bias-free Float8Linear(4096, 4096)
    makes, on an H100, bf16, batch of 256 rows, SGD, mean loss."""
    step = build_step(nn.Linear(K, N, bias=False), batch_size=M, input_shape=(K,), precision="bf16",
                      optimizer="sgd", loss="mean", gpu="h100-80gb", float8=recipe)
    resolved = apply_float8(resolve(step.model, batch_size=M, input_shape=(K,)), step.float8)
    trace = trace_model(resolved, step).trace
    made = Counter((trace.phase[u].value, trace.op[u].removeprefix("aten.").removesuffix(".default"), trace.nbytes[u])
                   for u in range(trace.num_storages) if u not in trace.preexisting)
    return made, trace


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_linear_casts_and_multiplies_as_torchao_does(recipe: str) -> None:
    made, _ = _births(recipe)
    # the weight cast (hp_tensor_to_float8_dynamic): weight.to(float32) · scale, clamp, .to(e4m3):
    # N·K·4 B float32 copies and an N·K·1 B float8 weight, in the forward and again in the
    # backward (torchao saves the bf16 weight and re-casts it: force_recompute_fp8_weight_in_bwd's way)
    for phase in ("forward", "backward"):
        assert made[(phase, "_to_copy", N * K * FP32)] == 1
        assert made[(phase, "clamp", N * K * FP32)] == 1
        assert made[(phase, "_to_copy", N * K * FP8)] == 1
        assert made[(phase, "abs", N * K * BF16)] == 1  # the amax's abs()
    # the forward casts the input once (M·K·1 B); the backward casts grad_output twice (for
    # grad_input and for grad_weight, M·N·1 B each) and the saved bf16 input once more (M·K·1 B)
    assert made[("forward", "_to_copy", M * K * FP8)] == 1
    assert made[("backward", "_to_copy", M * K * FP8)] == 3
    # torch._scaled_mm: the bf16 output M·N·2 B in the forward; grad_input (M·K·2 B) and
    # grad_weight (N·K·2 B) in the backward
    assert made[("forward", "_scaled_mm", M * N * BF16)] == 1
    assert made[("backward", "_scaled_mm", M * K * BF16)] == 1
    assert made[("backward", "_scaled_mm", N * K * BF16)] == 1
    # float8_ops.preprocess_addmm makes operands row-major / column-major for _scaled_mm: the
    # float8 weight for grad_input (N·K·1 B), grad_output.t() and the input for grad_weight (M·N, M·K)
    assert made[("backward", "contiguous", N * K * FP8)] == 1
    assert made[("backward", "contiguous", M * K * FP8)] == 2
    if recipe == "tensorwise":  # one float32 scale per tensor
        assert made[("forward", "_to_copy", FP32)] == 2  # input's and weight's scales
    else:  # one per row of the input (M × 1) and per column of weight.t() (1 × N), rounded to powers of 2
        assert made[("forward", "_to_copy", M * FP32)] == 1
        assert made[("forward", "_to_copy", N * FP32)] == 1
        assert made[("forward", "exp2", M * FP32)] == 1


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_nothing_float8_outlives_the_forward(recipe: str) -> None:
    # matmul_with_hp_or_float8_args.forward: ctx.save_for_backward(input_hp, weight_hp_t) — the
    # bf16 input and a view of the weight, both pre-existing here: at the loss, the only activation
    # alive is the forward's output, M·N·2 B, as for a bf16 nn.Linear
    _, trace = _births(recipe)
    alive: set[int] = set()
    for event in trace.events[:trace.phase_starts[Phase.LOSS]]:
        alive.add(event) if event >= 0 else alive.discard(~event)
    assert sorted(trace.nbytes[u] for u in alive) == [M * N * BF16]


def test_float8_step_peak_by_hand() -> None:
    options: dict[str, Any] = dict(batch_size=M, input_shape=(K,), precision="bf16", optimizer="sgd", loss="mean",
                                   gpu="h100-80gb")
    bf16 = memcalc.estimate(nn.Linear(K, N, bias=False), **options).peak_requested
    f8 = memcalc.estimate(nn.Linear(K, N, bias=False), float8="tensorwise", **options).peak_requested
    workspaces = 2 * 32 * 2**20  # H100 (sm90): two cuBLAS workspaces of 32 MiB; _scaled_mm's cuBLASLt shares them
    x_out_grad = 3 * M * K * BF16  # the input, the forward's output and its gradient (mean's backward)
    scalars = 2 + 2  # the loss and its ones_like gradient (bf16)
    # bf16: the weight and its gradient (the grad_weight mm) at the backward's peak
    assert bf16 == 2 * N * K * BF16 + workspaces + x_out_grad + scalars
    # float8 (2nd iteration's backward, re-casting the weight for grad_input): the weight, its float32
    # ``x.to(float32) * scale`` and ``clamp`` (the to(float32) copy already freed), the float8 weight
    # being made, the float8 grad_output cast (M·N·1) and two float32 scales (4 B) — 7·N·K + M·N + 8 B more
    # than bf16's weight gradient, which comes later, once the casts are freed
    casts = 2 * N * K * FP32 + N * K * FP8 + M * N * FP8 + 2 * FP32
    assert f8 == N * K * BF16 + casts + workspaces + x_out_grad + scalars
    assert f8 - bf16 == 7 * N * K + M * N + 8  # 118,489,096 B


# --------------------------------------------------------------------------------------------
# Real CPU steps: torchao's emulate=True runs the same casts with plain float32 matmuls
# --------------------------------------------------------------------------------------------


def _emulated(recipe: str) -> Any:
    return dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 512, bias=False))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.quick_cases("tensorwise")  # a real CPU step under the profiler (about 5 s)
def test_emulated_float8_matches_a_real_cpu_step(recipe: str) -> None:
    options: dict[str, Any] = dict(batch_size=64, input_shape=(1024,), precision="bf16", optimizer="sgd",
                                   loss="mean", float8=_emulated(recipe))
    estimate = memcalc.estimate(_mlp(), gpu="cpu", **options).peak_requested
    real = measure_cpu(build_step(_mlp(), **options)).peak_allocated
    assert real is not None
    assert abs(estimate - real) <= 0.01 * real  # measured: equal to the byte (15,335,436 B tensorwise)


def test_force_recompute_fp8_weight_in_bwd_changes_nothing_in_torchao_0_18() -> None:
    # deprecated in torchao 0.18 (config.py warns, pytorch/ao#2251): matmul_with_hp_or_float8_args
    # always saves the bf16 weight and re-casts it in the backward, with or without the flag
    options: dict[str, Any] = dict(batch_size=M, input_shape=(K,), precision="bf16", optimizer="sgd", loss="mean",
                                   gpu="h100-80gb")
    forced = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name("tensorwise"),
                                 force_recompute_fp8_weight_in_bwd=True)
    default = memcalc.estimate(nn.Linear(K, N, bias=False), float8="tensorwise", **options)
    assert memcalc.estimate(nn.Linear(K, N, bias=False), float8=forced, **options).peak_requested == \
        default.peak_requested


LLAMA: dict[str, Any] = dict(batch_size=2, seq_len=128, optimizer="sgd", precision="bf16")


@pytest.mark.slow  # two estimates of llama-tiny on an H100 (about 30 s)
def test_llama_float8_peaks_at_the_lm_head_weight_cast() -> None:
    bf16 = memcalc.estimate("llama-tiny", gpu="h100-80gb", **LLAMA)
    f8 = memcalc.estimate("llama-tiny", gpu="h100-80gb", float8="tensorwise", **LLAMA)
    # bf16 peaks late in the backward, with the layers' gradients; float8 at the start of the
    # backward, where the lm_head (32000 × 512) re-casts its weight with every activation still
    # alive: two float32 copies (65,536,000 B each) and the float8 weight (16,384,000 B). Measured:
    # 337,385,736 B → 411,113,744 B (+73,728,008 B), less than those casts (147,456,000 B) since the
    # bf16 peak's gradients are not yet made at the float8 one
    assert bf16.peak_requested == 337_385_736 and f8.peak_requested == 411_113_744
    assert f8.peak_module == "lm_head" and f8.peak_phase is Phase.BACKWARD
    vocab, hidden = 32000, 512
    assert 0 < f8.peak_requested - bf16.peak_requested < 2 * vocab * hidden * FP32 + vocab * hidden * FP8


@pytest.mark.slow  # real CPU steps of llama-tiny under the profiler (about 5 min each here)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_llama_matches_a_real_cpu_step(recipe: str) -> None:
    options: dict[str, Any] = dict(LLAMA, float8=_emulated(recipe))
    estimate = memcalc.estimate("llama-tiny", gpu="cpu", **options).peak_requested
    real = measure_cpu(build_step("llama-tiny", **options)).peak_allocated
    assert real is not None
    assert abs(estimate - real) <= 0.01 * real  # measured: equal to the byte (393,156,752 B tensorwise)


# --------------------------------------------------------------------------------------------
# The setting and its refusals
# --------------------------------------------------------------------------------------------


def test_float8_spellings() -> None:
    assert parse_float8(" RowWise ") == Float8("rowwise")
    assert parse_float8(None) is None and parse_float8("off") is None
    config = ao.Float8LinearConfig()
    assert parse_float8(config) == Float8("config", config)
    with pytest.raises(memcalc.InvalidInputError, match="tensorwise, rowwise"):
        parse_float8("blockwise")


@pytest.mark.parametrize(("options", "match"), [
    (dict(gpu="a100-80gb"), "sm89 and newer.*sm80"),
    (dict(), "sm89 and newer"),  # the generic sm80-class GPU
    (dict(gpu="cpu"), "CPU target"),
    (dict(gpu="h100-80gb", compile=True), "compile"),
    (dict(gpu="h100-80gb", distributed=memcalc.Distributed("zero3", world_size=2)), r"DDP .* and FSDP2 .* only"),
])
def test_float8_is_refused_where_it_is_not_modelled(options: dict[str, Any], match: str) -> None:
    with pytest.raises(memcalc.MemcalcError, match=match):
        memcalc.estimate("llama-tiny", batch_size=2, seq_len=64, precision="bf16", float8="rowwise", **options)


@pytest.mark.parametrize(("options", "match"), [
    (dict(float8="rowwise", distributed=memcalc.Distributed("fsdp", world_size=2)), "tensorwise scaling only"),
    (dict(float8=None, distributed=memcalc.Distributed("fsdp", world_size=2)), "float8 .--float8. is off"),
    (dict(float8="tensorwise"), "one GPU all-gathers nothing"),
    (dict(float8="tensorwise", distributed=memcalc.Distributed("ddp", world_size=2)), "no dp_shard"),
])
def test_float8_all_gather_is_refused_where_fsdp2_does_not_gather(options: dict[str, Any], match: str) -> None:
    # torchao's enable_fsdp_float8_all_gather: tensorwise scales only (Float8LinearConfig.__post_init__ asserts it),
    # and FSDP2's all-gather extension alone uses it
    with pytest.raises(memcalc.MemcalcError, match=match):
        memcalc.estimate("llama-tiny", batch_size=2, seq_len=64, precision="bf16", gpu="h100-80gb",
                         float8_all_gather=True, **options)


def test_float8_all_gather_switch_is_torchaos_config_flag() -> None:
    # --float8-all-gather on the tensorwise recipe is torchao's own enable_fsdp_float8_all_gather=True
    fsdp = memcalc.Distributed("fsdp", world_size=2)
    common: dict[str, Any] = dict(batch_size=2, seq_len=64, precision="amp-bf16", gpu="h100-80gb", distributed=fsdp)
    switch = memcalc.estimate("llama-tiny", float8="tensorwise", float8_all_gather=True, **common)
    config = ao.Float8LinearConfig.from_recipe_name("tensorwise")
    flagged = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    given = memcalc.estimate("llama-tiny", float8=flagged, **common)
    plain = memcalc.estimate("llama-tiny", float8="tensorwise", **common)
    assert switch.peak_requested == given.peak_requested != plain.peak_requested
    assert any("float8 all-gather" in note for note in switch.notes)


def test_cli_float8_names_the_recipe_and_refuses_an_old_gpu() -> None:
    common = ["llama-tiny", "--batch", "2", "--seq-len", "64", "--precision", "bf16", "--optim", "sgd"]
    result = CliRunner().invoke(main, [*common, "--float8", "rowwise", "--gpu", "h100-80gb"])
    assert result.exit_code == 0, result.output
    assert "rowwise recipe" in result.output
    refused = CliRunner().invoke(main, [*common, "--float8", "rowwise", "--gpu", "a100-80gb"])
    assert refused.exit_code == 2 and "sm89" in refused.output

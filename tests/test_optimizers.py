"""Optimizers and their implementations (memcalc.engine.optimizers, memcalc.stacks.bitsandbytes.adamw).

Three layers, as everywhere: what the installed torch really picks and allocates (real CPU
steps under the profiler, torch's own dispatch), arithmetic worked out here from torch's and
bitsandbytes' source, and the report's fields and lines.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.profiler import ProfilerActivity, profile

import memcalc
from memcalc.cli import main
from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.loop import OptimizerImpl
from memcalc.engine.optimizers import OPTIMIZERS, Optimizer, resolve_impl, spec_for
from memcalc.engine.step import StepConfig, run_step
from memcalc.fields import build_step
from memcalc.report.render import render_report
from memcalc.sources.resolve import resolve
from memcalc.stacks.bitsandbytes.adamw import PAGED_MIN_NUMEL
from memcalc.targets.backend import trace_step
from memcalc.targets.cpu.scalars import WRAPPED_NUMBER

# The bar for the real CPU step; on torch 2.13 these agree within 40 B (the for-loop's
# and foreach's CPU step counters, 4 B per parameter, which the estimate leaves out).
TOLERANCE = 0.01

# One Linear(1024, 1024): weight W bytes, all parameters P bytes (weight + bias), fp32.
W = 1024 * 1024 * 4  # 4,194,304
P = W + 1024 * 4  # 4,198,400


def _impl(name: str) -> memcalc.Loop:
    return memcalc.Loop(optimizer_impl=name)


# ============================================================================================
# auto: what the installed torch picks
# ============================================================================================


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "sgd-nesterov", "adam", "adamw", "rmsprop", "adagrad"])
def test_auto_is_foreach_on_cuda_and_the_for_loop_on_the_cpu(optimizer):
    spec = spec_for(optimizer)
    assert resolve_impl(spec, OptimizerImpl.AUTO, cuda=True) is OptimizerImpl.FOREACH
    assert resolve_impl(spec, OptimizerImpl.AUTO, cuda=False) is OptimizerImpl.FOR_LOOP


def test_torchs_own_device_lists_say_so():
    # _default_to_fused_or_foreach(use_fused=False): foreach iff every parameter's device is in
    # this list; fused is never the default (torch/optim/adam.py, sgd.py, ... "bake-in time")
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    assert "cuda" in _get_foreach_kernels_supported_devices()
    assert "cpu" not in _get_foreach_kernels_supported_devices()
    assert _default_to_fused_or_foreach([torch.zeros(2)], differentiable=False, use_fused=False) == (False, False)


@pytest.mark.parametrize("optimizer, module, functions", [
    ("adam", "torch.optim.adam", ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam")),
    ("adafactor", "torch.optim._adafactor", ("_single_tensor_adafactor", "_multi_tensor_adafactor", None)),
])
def test_auto_on_the_cpu_is_what_a_real_cpu_step_runs(monkeypatch, optimizer, module, functions):
    # torch's default (neither foreach nor fused given) on real CPU parameters, spied on
    module = importlib.import_module(module)
    ran = []
    for impl, name in zip((OptimizerImpl.FOR_LOOP, OptimizerImpl.FOREACH, OptimizerImpl.FUSED), functions, strict=True):
        if name is not None:
            original = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _o=original, _i=impl, **k: (ran.append(_i), _o(*a, **k)))
    layer = nn.Linear(8, 8)
    layer(torch.randn(2, 8)).sum().backward()
    getattr(torch.optim, spec_for(optimizer).torch_class)(layer.parameters()).step()
    assert ran == [resolve_impl(spec_for(optimizer), OptimizerImpl.AUTO, cuda=False)]


def test_adafactor_and_bitsandbytes_defaults():
    # Adafactor: the for-loop on every device unless foreach=True (torch/optim/_adafactor.py docstring)
    assert resolve_impl(spec_for("adafactor"), OptimizerImpl.AUTO, cuda=True) is OptimizerImpl.FOR_LOOP
    for name in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"):
        assert resolve_impl(spec_for(name), OptimizerImpl.AUTO, cuda=True) is OptimizerImpl.FUSED


def test_the_report_says_which_implementation_ran():
    cuda = memcalc.estimate("mlp", batch_size=4)
    cpu = memcalc.estimate("mlp", batch_size=4, gpu="cpu")
    assert (cuda.optimizer_impl, cpu.optimizer_impl) == ("foreach", "for-loop")
    assert cuda.to_dict()["optimizer_impl"] == "foreach"
    assert "optimizer adam (foreach)" in render_report(cuda)
    assert memcalc.estimate("mlp", batch_size=4, mode="eval").optimizer_impl == ""


# ============================================================================================
# Against the real CPU step, in each implementation
# ============================================================================================


class _Tower(nn.Module):
    """Parameters of several shapes and sizes: an embedding, norms, two MLP blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(2))
        self.head = nn.Linear(128, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=1))


def _tower_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 1000, (8, 32)),)


def _real_cpu_peak(model, optimizer: str, impl: str, **source) -> int:
    """Two real iterations of memcalc's step program on the CPU, in implementation ``impl``,
    under ``torch.profiler``: the running sum of its [memory] events on top of the storages that
    existed before (parameters, buffers, inputs)."""
    resolved = resolve(model, **source)
    module, inputs = resolved.build_real(torch.device("cpu"))
    config = StepConfig(mode=Mode.TRAIN, optimizer=spec_for(optimizer), optimizer_impl=OptimizerImpl(impl),
                        iterations=2, loss=resolved.loss)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*module.parameters(), *module.buffers(), *inputs]}
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(module, inputs, config)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return sum(storages.values()) + peak


_MODELS = {
    "mlp": dict(model="mlp", batch_size=16),
    "tower": dict(model=_Tower, inputs=_tower_inputs()),
}


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("model", list(_MODELS))
@pytest.mark.quick_cases("mlp-fused-adam")
def test_estimate_matches_the_real_cpu_step(model, impl, optimizer):
    # fused on the CPU: torch has had fused Adam/AdamW CPU kernels since 2.4 (the real run below
    # is one); on meta it runs through memcalc.engine.optimizers.fused_kernels_on_meta
    source = _MODELS[model]
    estimate = memcalc.estimate(**source, optimizer=optimizer, gpu="cpu", loop=_impl(impl))
    assert estimate.optimizer_impl == impl
    real = _real_cpu_peak(optimizer=optimizer, impl=impl, **source)
    error = (estimate.peak_requested - real) / real
    assert abs(error) <= TOLERANCE, f"{model} {optimizer} {impl}: {estimate.peak_requested:,} vs real {real:,}"


@pytest.mark.slow  # real CPU steps of six optimizer implementations
def test_the_real_cpu_comparison_tells_the_implementations_apart():
    # the bar is narrower than what the implementation moves, so the test above can fail
    peaks = {impl: _real_cpu_peak("mlp", "adam", impl, batch_size=16) for impl in ("for-loop", "foreach", "fused")}
    assert peaks["for-loop"] > peaks["foreach"] * (1 + TOLERANCE)
    assert peaks["foreach"] > peaks["fused"] * (1 + TOLERANCE)


@pytest.mark.parametrize("optimizer, impl", [("sgd-nesterov", "for-loop"), ("sgd-nesterov", "foreach"),
                                             ("sgd-nesterov", "fused"), ("adagrad", "fused"),
                                             ("adafactor", "for-loop"), ("adafactor", "foreach")])
@pytest.mark.quick_cases("sgd-nesterov-fused")
def test_new_optimizers_and_fused_kernels_without_meta_kernels_match_the_real_cpu_step(optimizer, impl):
    # fused SGD and Adagrad: torch has no meta kernel for _fused_sgd_ / _fused_adagrad_;
    # Adafactor reads .item() of meta tensors to size its step
    estimate = memcalc.estimate("mlp", batch_size=16, optimizer=optimizer, gpu="cpu", loop=_impl(impl))
    real = _real_cpu_peak("mlp", optimizer, impl, batch_size=16)
    assert abs(estimate.peak_requested - real) / real <= TOLERANCE


# ============================================================================================
# Step temporaries by hand: one Linear(1024, 1024), Adam, CPU target, batch 2, loss mean
# ============================================================================================


def _linear_adam(impl: str, **kw):
    return memcalc.estimate(lambda: nn.Linear(1024, 1024), batch_size=2, input_shape=(1024,), loss="mean",
                            optimizer="adam", gpu="cpu", loop=_impl(impl), **kw)


def test_step_temporaries_by_hand():
    # In the optimizer step the input (2·1024·4 B), parameters P, gradients P and both moments
    # 2P are alive; what each implementation adds (torch/optim/adam.py, torch 2.13):
    #   for-loop, _single_tensor_adam: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`
    #     — sqrt() and its quotient are alive together for the weight: 2W, and beside them the
    #     CPU's wrapped float (8 B) and its float32 cast (4 B) (memcalc.targets.cpu.scalars);
    #   foreach, _multi_tensor_adam: `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`,
    #     then _foreach_div_, _foreach_add_, _foreach_addcdiv_ in place: P, every parameter at once,
    #     and the CPU's wrapped float of _foreach_div_ (tensor by tensor) beside them;
    #   fused, _fused_adam: one in-place torch._fused_adam_: nothing.
    # So for a single large layer foreach holds *less* than the for-loop (P < 2W); with many
    # layers of similar size it holds more (all parameters against the two largest copies).
    base = 2 * 1024 * 4 + 4 * P
    for_loop, foreach = _linear_adam("for-loop"), _linear_adam("foreach")
    assert for_loop.peak_phase is foreach.peak_phase is Phase.OPTIMIZER
    wrapped = 8 + 4
    assert for_loop.peak_requested == base + 2 * W + wrapped == 25_190_412
    assert foreach.peak_requested == base + P + wrapped == 21_000_204
    assert foreach.peak_requested - for_loop.peak_requested == P - 2 * W
    assert (for_loop.bytes.workspace, foreach.bytes.workspace) == (2 * W + wrapped, P + wrapped)


def test_fused_step_has_no_temporaries():
    traced = trace_step(resolve(lambda: nn.Linear(1024, 1024), batch_size=2, input_shape=(1024,)),
                        build_step(optimizer="adam", gpu="cpu", loss="mean", loop=_impl("fused")))
    born_in_step = {(c, traced.trace.op[u] if c is Category.WORKSPACE else "") for u, c in enumerate(traced.categories)
                    if traced.trace.phase[u] is Phase.OPTIMIZER and traced.trace.nbytes[u]}
    # the moments and the step counters, and the int the counters are incremented by
    # (torch._foreach_add_(device_state_steps, 1)), which the CPU wraps as a tensor (8 + 4 B)
    assert born_in_step == {(Category.OPTIMIZER_STATE, ""),
                            (Category.WORKSPACE, f"{WRAPPED_NUMBER} aten._foreach_add_.Scalar")}
    # the step holds input + 4P + two 4-byte counters = 16,801,800 B, no longer the peak: the
    # second iteration's backward (the moments alive, the gradients being made) is above it
    fused = _linear_adam("fused")
    assert fused.peak_phase is Phase.BACKWARD and fused.peak_requested > 2 * 1024 * 4 + 4 * P + 8


def test_fused_step_counters_are_device_tensors_and_the_others_cpu_scalars():
    # adam.py Adam._init_group: `step` is torch.zeros((), float32, device=p.device) when fused
    # (or capturable), else torch.tensor(0.0) on the CPU — not GPU memory
    fused = memcalc.estimate(lambda: nn.Linear(1024, 1024), batch_size=2, input_shape=(1024,), loss="mean",
                             optimizer="adam", loop=_impl("fused"), gpu="h100-80gb")
    foreach = memcalc.estimate(lambda: nn.Linear(1024, 1024), batch_size=2, input_shape=(1024,), loss="mean",
                               optimizer="adam", loop=_impl("foreach"), gpu="h100-80gb")
    assert fused.bytes.optimizer_state == 2 * P + 2 * 4
    assert foreach.bytes.optimizer_state == 2 * P


def test_fused_on_meta_leaves_torch_as_it_was():
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    memcalc.estimate("mlp", batch_size=2, optimizer="sgd-momentum", loop=_impl("fused"))
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_sgd_", "Meta")
    assert "meta" not in importlib.import_module("torch.optim.optimizer")._get_fused_kernels_supported_devices()
    assert "meta" not in _get_fused_kernels_supported_devices()
    p = nn.Parameter(torch.empty(4, device="meta"))
    p.grad = torch.empty(4, device="meta")
    with pytest.raises(RuntimeError, match="supported devices"):
        torch.optim.Adam([p], fused=True).step()
    with pytest.raises(NotImplementedError):
        torch.ops.aten._fused_sgd_([p], [p.grad], [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                                   nesterov=False, maximize=False, is_first_step=False)


# ============================================================================================
# Refusals
# ============================================================================================


@pytest.mark.parametrize("optimizer", ["rmsprop", "adafactor"])
def test_fused_is_refused_where_torch_has_none(optimizer):
    with pytest.raises(InapplicableOptionError, match="adam, adamw, adagrad") as info:
        memcalc.estimate("mlp", batch_size=2, optimizer=optimizer, loop=_impl("fused"))
    assert f"optimizer {optimizer} has no fused implementation" in str(info.value)
    fused = {name for name, s in OPTIMIZERS.items() if OptimizerImpl.FUSED in s.impls and s.torch_class}
    assert fused == {"sgd", "sgd-momentum", "sgd-nesterov", "adam", "adamw", "adagrad"}


def test_bitsandbytes_has_only_its_fused_kernel():
    with pytest.raises(InapplicableOptionError, match="bitsandbytes runs its own fused kernel"):
        memcalc.estimate("mlp", batch_size=2, optimizer="adamw-8bit", loop=_impl("foreach"))


def test_adafactor_needs_torch_2_5(monkeypatch):
    monkeypatch.delattr(torch.optim, "Adafactor")
    with pytest.raises(InapplicableOptionError, match=r"needs torch.optim.Adafactor, added in torch 2.5"):
        memcalc.estimate("mlp", batch_size=2, optimizer="adafactor")


def test_cli_refuses_fused_rmsprop_and_lists_the_new_optimizers():
    result = CliRunner().invoke(main, ["mlp", "-b", "2", "--optim", "rmsprop", "--optim-impl", "fused"])
    assert result.exit_code == 2 and "fused=True is offered by torch" in result.output
    for name in ("sgd-nesterov", "adafactor", "adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"):
        result = CliRunner().invoke(main, ["mlp", "-b", "2", "--optim", name, "--depth", "0"])
        assert result.exit_code == 0, result.output


# ============================================================================================
# sgd-nesterov and adafactor
# ============================================================================================


def test_sgd_nesterov_is_torchs_sgd_with_nesterov_momentum():
    optimizer = spec_for("sgd-nesterov").build([nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.SGD)
    assert (optimizer.defaults["momentum"], optimizer.defaults["nesterov"]) == (0.9, True)
    assert spec_for(Optimizer.SGD_NESTEROV).textbook_multiplier == 3


def test_adafactor_state_is_factored_by_hand_and_by_torch():
    # mlp: a matrix keeps a row vector (out features) and a column vector (in features), a bias
    # a full copy (torch/optim/_adafactor.py Adafactor._init_group), fp32:
    #   fc 784→1024: (1024 + 784)·4 + bias 1024·4; 1024→1024: 2048·4 + 1024·4; 1024→10: 1034·4 + 10·4
    by_hand = (1808 + 1024 + 2048 + 1024 + 1034 + 10) * 4
    assert by_hand == 27_792
    import models_zoo

    model = models_zoo.get("mlp").build()
    model(torch.randn(2, 784)).sum().backward()
    optimizer = spec_for("adafactor").build(model.parameters(), OptimizerImpl.FOR_LOOP)
    optimizer.step()
    real = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    assert real == by_hand
    r = memcalc.estimate("mlp", batch_size=8, optimizer="adafactor")
    assert r.bytes.optimizer_state == by_hand
    assert r.textbook.multiplier == 2 and r.textbook.state_bytes == by_hand
    assert "not a full copy" in r.textbook.terms


# ============================================================================================
# bitsandbytes: 8-bit and paged AdamW
# ============================================================================================


def _state_bytes(factory, optimizer: str, **kw) -> int:
    traced = trace_step(resolve(factory, batch_size=2, input_shape=(factory().in_features,)),
                        build_step(optimizer=optimizer, loss="mean", **kw))
    return sum(traced.trace.nbytes[u] for u, c in enumerate(traced.categories) if c is Category.OPTIMIZER_STATE)


def test_8bit_state_of_a_4096_layer_by_hand():
    # numel 16,777,216 ≥ min_8bit_size: uint8 state1/state2 of numel bytes each, float32
    # absmax1/absmax2 of ceil(numel / 256) = 65,536 entries each, and the two 256-entry float32
    # quantization maps, once per optimizer (bitsandbytes/optim/optimizer.py Optimizer2State.init_state)
    weight_only = 2 * 16_777_216 + 2 * 65_536 * 4 + 2 * 256 * 4
    assert _state_bytes(lambda: nn.Linear(4096, 4096, bias=False), "adamw-8bit") == weight_only == 34_080_768
    # the bias has 4,096 elements: not under min_8bit_size (`p.numel() < 4096`), so 8-bit too:
    # 2·4,096 B + 2·16 absmax entries
    assert _state_bytes(lambda: nn.Linear(4096, 4096), "adamw-8bit") == weight_only + 2 * 4096 + 2 * 16 * 4


def test_8bit_state_of_a_layer_under_min_8bit_size_is_32_bit():
    # weight 512 and bias 16 elements < 4,096: float32 state1 and state2, no quantization maps
    assert _state_bytes(lambda: nn.Linear(32, 16), "adamw-8bit") == 2 * (512 + 16) * 4 == 4_224


def test_8bit_report_and_textbook():
    r = memcalc.estimate(lambda: nn.Linear(4096, 4096, bias=False), batch_size=2, input_shape=(4096,),
                         optimizer="adamw-8bit", loss="mean")
    assert r.optimizer_impl == "fused" and r.paged_optimizer_state == 0
    assert r.bytes.optimizer_state == 34_080_768  # the whole state is alive at the peak (iteration 2)
    assert r.textbook.multiplier == 2 and r.textbook.state_bytes == 2 * 16_777_216
    assert "× 2 + 32.00 MiB (weights + grads + 2 × 1-byte moments)" in render_report(r)


def _paged(optimizer: str, **kw):
    return memcalc.estimate(lambda: nn.Linear(4096, 4096), batch_size=2, input_shape=(4096,), optimizer=optimizer,
                            loss="mean", **kw)


def test_paged_states_are_reported_apart_and_not_in_the_peak():
    paged, plain = _paged("paged-adamw-8bit"), _paged("adamw-8bit")
    # state1/state2 of the weight (numel ≥ 1e5, Optimizer8bit.get_state_buffer) are in unified
    # memory; its absmax, the qmaps and the bias's states (4,096 < 1e5) stay in the allocator
    assert paged.paged_optimizer_state == 2 * 16_777_216
    assert paged.bytes.optimizer_state == 2 * 65_536 * 4 + 2 * 256 * 4 + 2 * 4096 + 2 * 16 * 4 == 534_656
    assert paged.peak_phase is plain.peak_phase and paged.peak_iteration == plain.peak_iteration == 2
    assert plain.peak_requested - paged.peak_requested == 2 * 16_777_216
    assert sum(paged.bytes.category(c) for c in Category) <= paged.bytes.peak_allocated
    assert paged.to_dict()["paged_optimizer_state"] == 33_554_432
    assert "paged optimizer state: 32.00 MiB in CUDA unified memory" in render_report(paged)
    assert "paged optimizer state" not in render_report(plain)


def test_paged_32bit_states():
    r = _paged("paged-adamw-32bit")
    assert r.paged_optimizer_state == 2 * 16_777_216 * 4  # float32 state1/state2 of the weight
    assert r.bytes.optimizer_state == 2 * 4096 * 4  # the bias's, under 1e5 elements: not paged


def test_paged_threshold_is_bitsandbytes_1e5_elements():
    assert PAGED_MIN_NUMEL == 100_000
    above = memcalc.estimate(lambda: nn.Linear(256, 512, bias=False), batch_size=2, input_shape=(256,),
                             optimizer="paged-adamw-8bit", loss="mean")
    below = memcalc.estimate(lambda: nn.Linear(256, 256, bias=False), batch_size=2, input_shape=(256,),
                             optimizer="paged-adamw-8bit", loss="mean")
    assert above.paged_optimizer_state == 2 * 131_072
    assert below.paged_optimizer_state == 0 and below.bytes.optimizer_state == 2 * 65_536 + 2 * 256 * 4 * 2


def test_paged_states_count_normally_on_the_cpu_target():
    # bitsandbytes falls back to ordinary buffers on the CPU ("Paged optimizers are not supported on CPU")
    r = _paged("paged-adamw-8bit", gpu="cpu")
    assert r.paged_optimizer_state == 0
    assert r.bytes.optimizer_state == 534_656 + 2 * 16_777_216


# ============================================================================================
# The ZeRO wrapper builds its inner optimizer in the chosen implementation
# ============================================================================================


@pytest.mark.parametrize("optimizer, impl", [("adam", "fused"), ("adam", "for-loop"), ("paged-adamw-8bit", "auto")])
def test_zero_wraps_every_implementation(optimizer, impl):
    r = memcalc.estimate("mlp", batch_size=8, optimizer=optimizer, loop=_impl(impl),
                         distributed=memcalc.Distributed("zero2", world_size=2))
    assert r.optimizer_impl == ("fused" if impl == "auto" else impl)
    assert r.bytes.optimizer_state > 0
    if optimizer.startswith("paged"):
        # the fp32 master partition (1,863,690 / 2 elements, padded to a multiple of 4) is paged
        assert r.paged_optimizer_state == 2 * 931_846

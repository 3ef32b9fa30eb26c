"""The estimator's arithmetic, worked out by hand in each test."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memcalc
from memcalc.core.categories import Category, Mode, Phase
from memcalc.fields import build_step

MiB = 2**20


def _round512(n: int) -> int:
    return -(-n // 512) * 512


def test_fc_worked_example_components_exact():
    # Design brief: Linear(32, 16, bias=False), batch 100, fp32, eval, no optimizer.
    #   input  100·32·4 = 12,800 B;  weight 32·16·4 = 2,048 B;  output 100·16·4 = 6,400 B
    #   sum = 21,248 B = 20.75 KiB before rounding.
    r = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none")
    assert r.bytes.inputs == 12_800
    assert r.bytes.parameters == 2_048
    assert r.bytes.activations == 6_400
    assert r.bytes.gradients == r.bytes.optimizer_state == r.bytes.buffers == 0
    # On a CUDA GPU the first matmul also creates cuBLAS's workspace through the caching
    # allocator: 4096 KiB·2 + 16 KiB·8 = 8,519,680 B (default CUBLAS_WORKSPACE_CONFIG, non-Hopper).
    assert r.bytes.workspace == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert r.peak_requested == 21_248 + 8_519_680
    # CUDA counts each storage as a block rounded up to 512 B:
    #   12,800 = 25·512 stays;  2,048 = 4·512 stays;  6,400 → 13·512 = 6,656;  total 21,504 B
    #   (8,519,680 = 16,640·512 stays).
    assert r.bytes.peak_allocated == _round512(12_800) + _round512(2_048) + _round512(6_400) + 8_519_680
    assert r.bytes.rounding == r.bytes.peak_allocated - 21_248 - 8_519_680 == 256
    assert r.peak_phase is Phase.FORWARD


def test_fc_worked_example_without_cuda_workspaces():
    # target="cpu": the article's arithmetic alone, 21,248 B = 20.75 KiB.
    r = memcalc.estimate("fc-32-16", batch_size=100, mode="eval", optimizer="none", gpu="cpu")
    assert r.bytes.workspace == 0
    assert r.peak_requested == 21_248


def test_categories_plus_rounding_sum_to_peak():
    r = memcalc.estimate("resnet18", batch_size=4, input_shape=(3, 64, 64), optimizer="adam")
    total = sum(r.bytes.category(c) for c in Category) + r.bytes.rounding
    assert total == r.bytes.peak_allocated
    assert r.bytes.rounding >= 0


def test_parameter_bytes_and_count_are_the_models():
    # mlp: 784·1024+1024 + 1024·1024+1024 + 1024·10+10 = 1,863,690 params · 4 B = 7,454,760 B
    r = memcalc.estimate("mlp", batch_size=8, optimizer="sgd")
    assert r.parameters == 1_863_690
    assert r.bytes.parameters == 1_863_690 * 4


@pytest.mark.parametrize("optimizer, state_multiple", [
    ("sgd", 0), ("sgd-momentum", 1), ("adam", 2), ("adamw", 2), ("rmsprop", 1), ("adagrad", 1)])
def test_optimizer_state_multiple_of_parameter_bytes(optimizer, state_multiple):
    # Only float parameters: momentum keeps 1 buffer per weight, Adam 2 (exp_avg, exp_avg_sq);
    # the step counters live on the CPU (capturable=False) and are not GPU memory.
    r = memcalc.estimate("mlp", batch_size=8, optimizer=optimizer)
    param_bytes = 1_863_690 * 4
    state = _state_bytes_after_real_step(optimizer)
    assert state == state_multiple * param_bytes  # the real torch.optim on CPU agrees...
    # ...and memcalc derives the same from the symbolic run (state is alive at the peak
    # whenever the peak is in the second iteration or the optimizer step).
    traced_state = _symbolic_state_bytes(optimizer)
    assert traced_state == state
    assert r.bytes.optimizer_state == state  # and the report's breakdown at the peak says it


def _state_bytes_after_real_step(optimizer: str) -> int:
    """Sum over optimizer.state after one real CPU step of the same model."""
    import models_zoo
    from memcalc.engine.optimizers import spec_for

    torch.manual_seed(0)
    model = models_zoo.get("mlp").build()
    model(torch.randn(8, 784)).sum().backward()
    opt = spec_for(optimizer).build(model.parameters())
    opt.step()
    seen = {}
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0:
                seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(seen.values())


def _symbolic_state_bytes(optimizer: str) -> int:
    from memcalc.sources.resolve import resolve
    from memcalc.targets.backend import trace_step as trace_model

    traced = trace_model(resolve("mlp", batch_size=8), build_step(optimizer=optimizer))
    return sum(traced.trace.nbytes[u] for u, c in enumerate(traced.categories) if c is Category.OPTIMIZER_STATE)


def test_adam_state_counted_in_steady_state():
    # With activations much larger than the weights (batch 256), the peak is in backward. The
    # second iteration holds Adam's two moments (2 × parameter bytes) there, the first does not.
    r = memcalc.estimate("resnet18", batch_size=256, input_shape=(3, 64, 64), optimizer="adam")
    assert r.peak_iteration == 2 and r.peak_phase is Phase.BACKWARD
    assert r.bytes.optimizer_state == 2 * r.bytes.parameters
    assert r.bytes.peak_allocated > r.first_iteration_peak


def test_small_batch_adam_peaks_in_the_optimizer_step():
    # With tiny activations the step itself is the peak: weights + grads + 2 moments + the
    # foreach temporaries (sqrt(exp_avg_sq) for every parameter at once) ≈ 5 × parameters.
    r = memcalc.estimate("resnet18", batch_size=2, input_shape=(3, 32, 32), optimizer="adam")
    assert r.peak_phase is Phase.OPTIMIZER
    assert r.bytes.gradients == r.bytes.parameters
    assert r.bytes.optimizer_state == 2 * r.bytes.parameters
    assert r.bytes.workspace >= r.bytes.parameters


def test_sgd_without_state_peaks_in_first_iteration_shape():
    r = memcalc.estimate("resnet18", batch_size=8, input_shape=(3, 64, 64), optimizer="sgd")
    assert r.bytes.optimizer_state == 0
    # Without state the two iterations are the same program: same peak.
    assert r.bytes.peak_allocated == r.first_iteration_peak


def test_eval_mode_keeps_no_activations_for_backward():
    train = memcalc.estimate("mlp", batch_size=512, optimizer="none")
    ev = memcalc.estimate("mlp", batch_size=512, mode="eval")
    assert ev.mode is Mode.EVAL
    assert ev.bytes.gradients == 0 and ev.bytes.optimizer_state == 0
    # eval peak: params + input + at most two live activations (layer input and output)
    # + the forward cuBLAS workspace:
    # 7,454,760 + 512·784·4 + 512·1024·4·2 + 8,519,680 = 7,454,760 + 1,605,632 + 4,194,304 + 8,519,680
    assert ev.peak_requested <= 7_454_760 + 1_605_632 + 4_194_304 + 8_519_680
    assert ev.bytes.peak_allocated < train.bytes.peak_allocated


def test_mlp_saved_activations_by_hand():
    # Train, SGD, batch 64, what is alive when backward starts (autograd's saved tensors):
    #   Flatten: a view of the input (an input, not an activation)
    #   Linear1 (addmm) saves its input and weight; its output h1 is only read by ReLU1
    #   ReLU1 saves its result r1 (64·1024·4 = 262,144 B); h1 dies            → 262,144
    #   Linear2 saves r1 (same storage); ReLU2 saves r2; h2 dies              → 262,144
    #   Linear3 saves r2; logits (64·10·4 = 2,560 B) are held by the loop     →   2,560
    #   cross_entropy: log_softmax saves its result (2,560 B), nll_loss its
    #   total_weight (4 B scalar), and the loss itself (4 B)                  →   2,568
    #   total                                                                  = 529,416 B
    r = memcalc.estimate("mlp", batch_size=64, optimizer="sgd")
    assert r.textbook.activation_bytes == 262_144 * 2 + 2_560 + 2_560 + 4 + 4
    assert r.textbook.multiplier == 2
    # the rule counts the input batch too: 64·784·4 B of inputs + 64·8 B of int64 targets
    assert r.textbook.input_bytes == 64 * 784 * 4 + 64 * 8
    assert r.textbook.total == r.bytes.parameters * 2 + r.textbook.input_bytes + r.textbook.activation_bytes


def test_textbook_multipliers():
    from memcalc.engine.optimizers import Optimizer, spec_for

    assert spec_for(Optimizer.SGD).textbook_multiplier == 2
    assert spec_for(Optimizer.SGD_MOMENTUM).textbook_multiplier == 3
    assert spec_for(Optimizer.ADAM).textbook_multiplier == 4
    assert spec_for(Optimizer.ADAMW).textbook_multiplier == 4


def test_peak_module_is_a_leaf_path():
    r = memcalc.estimate("resnet50", batch_size=16, input_shape=(3, 64, 64), optimizer="sgd")
    assert r.peak_phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.LOSS)
    if r.peak_phase in (Phase.FORWARD, Phase.BACKWARD):
        named = dict(memcalc.sources.resolve.resolve("resnet50", batch_size=1).module.named_modules())
        assert r.peak_module in named


def test_module_table_rows_and_depth():
    r = memcalc.estimate("resnet18", batch_size=2, input_shape=(3, 64, 64), optimizer="sgd")
    names = [row.name for row in r.modules_within(1)]
    assert names[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert names[-1] == "fc"
    fc = r.modules_within(1)[-1]
    assert fc.parameters == 512 * 1000 + 1000 and fc.output_shape == (2, 1000)
    assert "layer1.0" not in names and "layer1.0" in [row.name for row in r.modules_within(2)]
    assert "layer1.0.conv1" in [row.name for row in r.modules]  # every depth is kept


def test_to_dict_is_exactly_the_contract():
    d = memcalc.estimate("mlp", batch_size=4).to_dict()
    assert set(d) == {"model", "batch_size", "optimizer", "mode", "precision", "gpu", "parameters", "peak_phase",
                      "peak_module", "attention_backend", "fits", "loop", "keep_grads", "optimizer_impl",
                      "torch_version", "cuda_version", "trainable_parameters", "paged_optimizer_state", "bytes"}
    assert set(d["bytes"]) == {"parameters", "buffers", "inputs", "gradients", "optimizer_state", "activations",
                               "workspace", "kv_cache", "peak_allocated", "peak_reserved",
                               "peak_reserved_unconstrained", "cuda_context"}
    assert d["precision"] == "fp32" and d["gpu"] == "generic" and d["fits"] is None
    assert d["attention_backend"] is None  # an MLP has no attention
    assert all(isinstance(v, int) for v in d["bytes"].values())
    assert d["model"] == "mlp" and d["batch_size"] == 4 and d["optimizer"] == "adam" and d["mode"] == "train"


def test_report_is_frozen():
    r = memcalc.estimate("fc-32-16", batch_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.batch_size = 2  # type: ignore[misc]


def test_capacity_fits_and_headroom():
    r = memcalc.estimate("mlp", batch_size=64)
    roomy = memcalc.estimate("mlp", batch_size=64, capacity=r.peak_reserved + 4 * MiB)
    assert roomy.fits is True and roomy.headroom == roomy.capacity - roomy.bytes.peak_allocated
    tight = memcalc.estimate("mlp", batch_size=64, capacity=r.bytes.peak_allocated // 2)
    assert tight.fits is False and tight.headroom < 0
    assert r.fits is None and r.headroom is None

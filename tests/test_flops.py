"""FLOPs and bytes counted per op while the step is traced (memcalc.timing.flops), against
counts worked out by hand in each test, against torch's own FlopCounterMode on a real CPU step,
and against fvcore where it is installed.

Convention (torch.utils.flop_counter): a multiply-add is 2 FLOPs; a Linear of a (B, in) input
to `out` features is 2·B·in·out forward; its backward is the same again for the weight's
gradient and again for the input's, when the input needs one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import memcalc
from memcalc.core.loop import OptimizerImpl
from memcalc.timing.flops import multi_tensor_launches


def two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))


def test_linear_forward_and_backward_hand_count() -> None:
    # batch 100: layer 0 is 32 → 64, layer 1 is 64 → 16
    #   forward:  0: 2·100·32·64 = 409,600   1: 2·100·64·16 = 204,800
    #   backward: 1: grad input 204,800 + grad weight 204,800 (its input, layer 0's output, needs a gradient)
    #             0: grad weight 409,600 only (the batch needs no gradient)
    flops = memcalc.estimate(two_linears(), inputs=torch.randn(100, 32), loss="mean", optimizer="sgd",
                             gpu="a100-80gb").flops()
    assert flops.phase("forward") == 409_600 + 204_800
    assert flops.phase("backward") == 2 * 204_800 + 409_600
    assert flops.phase("loss") == flops.phase("optimizer") == flops.phase("recompute") == 0
    assert flops.total == 614_400 + 819_200
    assert flops.module("0") == 2 * 409_600  # forward + grad weight
    assert flops.module("1") == 3 * 204_800  # forward + grad input + grad weight
    assert dict(flops.ops) == {"mm.default": 819_200, "addmm.default": 614_400}


def test_flops_do_not_depend_on_precision_or_optimizer() -> None:
    counts = {memcalc.estimate(two_linears(), inputs=torch.randn(100, 32), loss="mean", optimizer=optim,
                               precision=precision, gpu="a100-80gb").flops().total
              for precision in ("fp32", "amp-bf16", "bf16") for optim in ("sgd", "adam")}
    assert counts == {614_400 + 819_200}


def test_conv2d_hand_count() -> None:
    # batch 4, 16×16, 3×3 kernels, padding 1 (output 16×16): a conv is 2·B·Cout·H·W·(Cin·3·3)
    #   conv 0 (3 → 8):  2·4·8·16·16·27 = 442,368   conv 1 (8 → 4): 2·4·4·16·16·72 = 589,824
    #   backward: conv 1's grad input and grad weight cost a forward each; conv 0's grad weight only
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1, bias=False))
    flops = memcalc.estimate(model, inputs=torch.randn(4, 3, 16, 16), loss="mean", optimizer="sgd",
                             gpu="a100-80gb").flops()
    assert flops.phase("forward") == 442_368 + 589_824
    assert flops.phase("backward") == 442_368 + 2 * 589_824
    assert flops.module("0") == 2 * 442_368
    assert flops.module("1") == 3 * 589_824
    assert set(dict(flops.ops)) == {"convolution.default", "convolution_backward.default"}


class SelfAttention(nn.Module):
    def __init__(self, embed: int = 64, heads: int = 4, causal: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(embed, 3 * embed, bias=False)
        self.heads, self.causal = heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, embed = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, embed // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


# B 2, heads 4, length 128, head dim 16: QKᵀ and PV are 2·B·H·L·L·D each, so the forward is
# 4·B·H·L²·D = 8,388,608; the backward recomputes QKᵀ and has four more products:
# 10·B·H·L²·D = 20,971,520 (torch.utils.flop_counter.sdpa_backward_flop_count).
ATTENTION_FORWARD = 4 * 2 * 4 * 128 * 128 * 16
ATTENTION_BACKWARD = 10 * 2 * 4 * 128 * 128 * 16


@pytest.mark.parametrize(("precision", "kernel"), [("fp32", "efficient"), ("amp-bf16", "flash")])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_hand_count(precision: str, kernel: str, causal: bool) -> None:
    report = memcalc.estimate(SelfAttention(causal=causal), inputs=torch.randn(2, 128, 64), loss="mean",
                              optimizer="sgd", precision=precision, gpu="a100-80gb")
    assert report.attention_backend == kernel
    ops = dict(report.flops().ops)
    # a fused kernel skips the masked blocks of a causal mask: half the square
    share = 2 if causal else 1
    assert ops[f"_scaled_dot_product_{kernel}_attention.default"] == ATTENTION_FORWARD // share
    assert ops[f"_scaled_dot_product_{kernel}_attention_backward.default"] == ATTENTION_BACKWARD // share
    # the projection: forward 2·(2·128)·64·192 = 6,291,456; backward its weight's gradient only
    assert ops["mm.default"] == 2 * 6_291_456


def test_cpu_flash_attention_is_counted_with_the_same_formula() -> None:
    # The CPU target runs SDPA as the CPU's own flash kernel, which torch's registry has no
    # formula for; memcalc counts it with the CUDA flash kernel's (same q, k, v arguments).
    report = memcalc.estimate(SelfAttention(), inputs=torch.randn(2, 128, 64), loss="mean", optimizer="sgd",
                              gpu=memcalc.CPU)
    ops = dict(report.flops().ops)
    assert ops["_scaled_dot_product_flash_attention_for_cpu.default"] == ATTENTION_FORWARD
    assert ops["_scaled_dot_product_flash_attention_for_cpu_backward.default"] == ATTENTION_BACKWARD
    assert report.flops().uncounted == ()


class CheckpointedMiddle(nn.Module):
    def __init__(self, activation: bool = False, checkpointed: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        self.activation, self.checkpointed = activation, checkpointed

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        h = self.b(h)
        return torch.tanh(h) if self.activation else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        middle: torch.Tensor = checkpoint(self.middle, h, use_reentrant=False) if self.checkpointed else self.middle(h)
        return self.c(middle)  # type: ignore[no-any-return]  # nn.Module.__call__ is untyped


def test_recomputation_is_counted_apart_from_backward() -> None:
    # b's forward, 2·100·64·64 = 819,200, runs again in backward to recreate tanh's saved output;
    # nothing else changes.
    checkpointed, unchanged = (
        memcalc.estimate(CheckpointedMiddle(activation=True, checkpointed=on), inputs=torch.randn(100, 32), loss="mean",
                         optimizer="sgd", gpu="a100-80gb").flops() for on in (True, False))
    assert checkpointed.phase("recompute") == 819_200
    for phase in ("forward", "backward", "optimizer"):
        assert checkpointed.phase(phase) == unchanged.phase(phase)
    # attributed to the module whose gradient arrived last, c (memcalc.engine.trace.ModuleTracker)
    assert checkpointed.module("c") == unchanged.module("c") + 819_200


def test_recomputation_stopped_before_the_product_counts_nothing() -> None:
    # Without the activation, b's matmul saves only its inputs, which autograd packs before the
    # kernel runs: checkpoint's early stop ends the recomputation there, and the product never
    # runs again (torch/utils/checkpoint.py, _StopRecomputationError). b's own backward follows.
    flops = memcalc.estimate(CheckpointedMiddle(), inputs=torch.randn(100, 32), loss="mean", optimizer="sgd",
                             gpu="a100-80gb").flops()
    assert flops.phase("recompute") == 0
    assert flops.phase("backward") == 2 * 204_800 + 2 * 819_200 + 409_600


def test_optimizer_bytes_hand_count_and_state_creation_left_out() -> None:
    # foreach Adam (torch/optim/adam.py, _multi_tensor_adam) per step: lerp_(m, g) 3P, mul_(v) 2P,
    # addcmul_(v, g, g) 4P, sqrt(v) 2P, div_ 2P, add_(eps) 2P, addcdiv_(p, m, denom) 4P = 19P bytes,
    # P the parameters' bytes. The first step's zeros_like (creating m and v) is not a steady step's.
    model = two_linears()
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    report = memcalc.estimate(model, inputs=torch.randn(100, 32), loss="mean", optimizer="adam", gpu="a100-80gb",
                              loop=memcalc.Loop(optimizer_impl=OptimizerImpl.FOREACH))
    optimizer = next(p for p in report.flops().phases if p.phase == "optimizer")
    assert optimizer.flops == 0
    assert optimizer.bytes_moved == 19 * param_bytes
    assert optimizer.kernels == 7  # one multi_tensor_apply launch each: 4 tensors, few elements


def test_linear_forward_bytes_hand_count() -> None:
    # addmm(bias, x, Wᵀ) reads bias 16·4, x 100·32·4, W 32·16·4 and writes 100·16·4 bytes
    report = memcalc.estimate(nn.Linear(32, 16), inputs=torch.randn(100, 32), mode="eval", gpu="a100-80gb")
    forward = next(p for p in report.flops().phases if p.phase == "forward")
    assert forward.bytes_moved == 4 * (16 + 100 * 32 + 32 * 16 + 100 * 16)
    assert forward.kernels == 1


def test_multi_tensor_launches_follow_multi_tensor_apply() -> None:
    # MultiTensorApply.cuh: depth_to_max_tensors = {110, 64, 48, 36, 30}, 320 blocks of 65,536 elements
    assert multi_tensor_launches([10] * 200, 2) == 4  # ⌈200 / 64⌉ tensors
    assert multi_tensor_launches([10] * 200, 1) == 2  # ⌈200 / 110⌉
    assert multi_tensor_launches([65_536 * 700], 4) == 3  # ⌈700 chunks / 320⌉
    assert multi_tensor_launches([0, 0], 3) == 0


def real_training_flops(model: nn.Module, batch: torch.Tensor) -> int:
    """What torch's FlopCounterMode counts for a real forward and backward on the CPU."""
    with FlopCounterMode(display=False) as counter:
        model(batch).mean().backward()
    return int(counter.get_total_flops())


@pytest.mark.parametrize("make, shape", [
    (two_linears, (100, 32)),
    (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2)), (4, 3, 16, 16)),
])
def test_counts_agree_with_torch_flop_counter_on_a_real_cpu_step(make: Callable[[], nn.Module],
                                                                shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = make()
    batch = torch.randn(*shape)
    estimated = memcalc.estimate(model, inputs=batch, loss="mean", optimizer="sgd", gpu="a100-80gb").flops()
    assert estimated.phase("forward") + estimated.phase("backward") == real_training_flops(model, batch)


def test_fvcore_counts_half_of_memcalc_forward() -> None:
    """Runs where fvcore is installed (it is not a dependency): its FlopCountAnalysis traces a
    real CPU forward with torch.jit and counts a multiply-add as one FLOP."""
    fvcore_nn = pytest.importorskip("fvcore.nn")
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16 * 16, 10)).eval()
    batch = torch.randn(4, 3, 16, 16)
    analysis = fvcore_nn.FlopCountAnalysis(model, batch)
    analysis.unsupported_ops_warnings(False)
    estimated = memcalc.estimate(model, inputs=batch, mode="eval", gpu="a100-80gb").flops()
    assert estimated.total == 2 * analysis.total()


class Composites(nn.Module):
    """Ops that inference mode hands to the tracer undecomposed: conv2d, conv_transpose2d,
    linear, matmul, einsum, and dropout (the input itself, in eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.up = nn.Conv2d(3, 8, 3), nn.ConvTranspose2d(8, 8, 2)
        self.fc, self.drop = nn.Linear(8, 4), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.up(self.conv(x))).mean((2, 3))
        square = torch.ones(4, 4, device=h.device)
        return torch.matmul(self.fc(h), square) + torch.einsum("bi,ij->bj", h, torch.ones(8, 4, device=h.device))


def test_inference_mode_composites_count_as_their_decomposition() -> None:
    batch = torch.randn(2, 3, 16, 16)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        Composites().eval()(batch)
    counts = {mode: memcalc.estimate(Composites(), inputs=batch, gpu="h100", mode=mode).flops()
              for mode in ("inference", "eval")}
    assert counts["inference"].total == counts["eval"].total == counter.get_total_flops()
    assert "conv2d.default" in dict(counts["inference"].ops)  # seen undecomposed, counted all the same
    assert counts["inference"].phases[0].kernels == counts["eval"].phases[0].kernels  # dropout is no kernel


def test_a_loop_traced_whole_counts_its_first_iteration() -> None:
    # A loop preset run as written traces two optimizer steps; the step's FLOPs are one step's.
    counts = [memcalc.estimate(two_linears(), inputs=torch.randn(100, 32), optimizer="sgd", gpu="a100-80gb",
                               loop=loop).flops() for loop in (None, "tutorial")]
    assert counts[0].total == counts[1].total == 614_400 + 819_200
    assert counts[0].phases == counts[1].phases

"""Liger kernels (issue 35, item 2), modelled from Liger-Kernel's code (memcalc/stacks/liger.py):
Liger runs on Triton only, so nothing here runs Liger itself. The checks are the source's
formulas worked by hand (the fused linear cross-entropy's chunk and its buffers; what RMSNorm
and SwiGLU save for the backward, read by torch's own saved-tensor hooks on the CPU), the
logits never made whole on a transformers Llama, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memcalc
from memcalc.core.errors import InapplicableOptionError
from memcalc.fields import build_step
from memcalc.stacks.liger import (
    LigerFusedLinearCrossEntropy,
    LigerRMSNormFunction,
    LigerSiLUMulFunction,
    flce_chunk_size,
)


def test_chunk_size_from_the_source():
    # ops/fused_linear_cross_entropy.py's own example: BT = 4096*4, V = 32000, H = 4096 ->
    # inc_factor = cdiv(32000, 4096) = 8, chunk_size = next_power_of_2(cdiv(16384, 8)) = 2048
    assert flce_chunk_size(4096 * 4, 4096, 32000) == 2048
    # 96 tokens, H 64, V 1000: inc_factor 16, cdiv(96, 16) = 6 -> 8
    assert flce_chunk_size(96, 64, 1000) == 8
    # fewer tokens than inc_factor: one token a chunk
    assert flce_chunk_size(5, 64, 1000) == 1


class _Head(nn.Module):
    """A projection, then Liger's fused LM head and loss (V 1000, H 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)
        self.weight = nn.Parameter(torch.empty(1000, 64))

    def forward(self, inp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return LigerFusedLinearCrossEntropy.apply(self.proj(inp), self.weight, target, False)


def test_fused_linear_cross_entropy_peak_by_hand():
    tokens = 96
    inputs = {"inp": torch.empty(tokens, 64, device="meta"),
              "target": torch.zeros(tokens, dtype=torch.long, device="meta")}
    # gpu="cpu": no cuBLAS workspace and no 512-byte rounding; SGD: no optimizer state
    r = memcalc.estimate(_Head, inputs=inputs, loss="mean", optimizer="sgd", gpu="cpu")
    params = (1000 * 64 + 64 * 64) * 4
    batch = tokens * 64 * 4 + tokens * 8
    chunk = flce_chunk_size(tokens, 64, 1000)  # 8
    # in the forward's chunk loop: x (the projection's output), grad_input (BT x H), grad_weight
    # (V x H), loss_1d (BT, fp32), one logits chunk (chunk x V) and mm(grad_logits.t(), x_chunk)
    # (V x H) before it is added into grad_weight — never the (BT x V) logits
    inside = tokens * 64 * 4 * 2 + 1000 * 64 * 4 + tokens * 4 + chunk * 1000 * 4 + 1000 * 64 * 4
    assert r.peak_requested == params + batch + inside == 891_264
    assert r.peak_phase.value == "forward"


def _saved_bytes(fn, *args) -> int:
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn.apply(*args)
    return sum(saved)


def test_rms_norm_and_swiglu_save_what_liger_saves():
    rows, hidden, inter = 12, 16, 40
    x = torch.randn(3, 4, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(hidden, dtype=torch.bfloat16, requires_grad=True)
    # ops/rms_norm.py: save_for_backward(X, W, RSTD); RSTD fp32 per row (casting mode llama)
    assert _saved_bytes(LigerRMSNormFunction, x, w, 132) == rows * hidden * 2 + hidden * 2 + rows * 4
    a = torch.randn(rows, inter, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(rows, inter, dtype=torch.bfloat16, requires_grad=True)
    # ops/swiglu.py: save_for_backward(a, b); transformers' act_fn(gate) * up also keeps silu(gate)
    assert _saved_bytes(LigerSiLUMulFunction, a, b) == 2 * rows * inter * 2


def test_rms_norm_backward_workspace_is_sm_count_rows():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = LigerRMSNormFunction.apply(x, w, 132)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == (16,) and x.grad is not None


def test_llama_never_makes_the_whole_logits():
    kw = dict(seq_len=512, batch_size=4, precision="amp-bf16", gpu="h100-80gb")
    own = memcalc.estimate("llama-tiny", **kw)
    liger = memcalc.estimate("llama-tiny", liger=True, **kw)
    tokens, vocab = 4 * 512, 32000
    # the model's own loss upcasts the (tokens x vocab) logits to fp32; Liger makes one chunk of them
    assert own.peak_requested - liger.peak_requested > tokens * vocab * 4
    assert any("modelled from Liger-Kernel's code" in note for note in liger.notes)


def test_training_arguments_use_liger_kernel():
    step = build_step("llama-tiny", seq_len=64, trainer_args={"use_liger_kernel": True})
    assert step.liger
    with pytest.raises(InapplicableOptionError, match="liger_kernel_config"):
        build_step("llama-tiny", seq_len=64, trainer_args={"use_liger_kernel": True,
                                                           "liger_kernel_config": {"rope": False}})


@pytest.mark.parametrize("kw, message", [
    (dict(model="gpt2"), "gpt2 is gpt2"),
    (dict(model="llama-tiny", mode="eval"), "the mode is eval"),
    (dict(model="llama-tiny", distributed=memcalc.Distributed("ddp", world_size=2)), "under --strategy"),
])
def test_liger_where_it_is_not_modelled_is_refused(kw, message):
    model = kw.pop("model")
    with pytest.raises(InapplicableOptionError, match=message):
        memcalc.estimate(model, seq_len=64, batch_size=1, liger=True, **kw)


def test_autocast_does_not_cache_a_view_of_a_parameter():
    # Liger's x_chunk @ weight.t() runs under no_grad inside its autograd.Function, where weight.t()
    # is a leaf that requires grad but a view: autocast_mode.cpp's cached_cast does not cache it
    # (!arg.is_view()), so each chunk's bf16 copy of the weight is freed after its matmul. memcalc's
    # emulation cached it by id and kept one copy per chunk (12 here) to the end of the forward.
    tokens = 96
    inputs = {"inp": torch.empty(tokens, 64, device="meta"),
              "target": torch.zeros(tokens, dtype=torch.long, device="meta")}
    r = memcalc.estimate(_Head, inputs=inputs, loss="mean", optimizer="sgd", gpu="h100-80gb", precision="amp-bf16")
    casts = [a for a in r.timeline().largest_at_peak if a.op == "aten._to_copy.default" and a.nbytes == 1000 * 64 * 2]
    # the cached cast of the weight itself (logits_chunk @ weight) and at most the current chunk's
    assert 1 <= len(casts) <= 2

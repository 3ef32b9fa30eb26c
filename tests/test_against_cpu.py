"""The simulation against what PyTorch really allocates: the same step program run for real
on the CPU, every allocation recorded by ``torch.profiler(profile_memory=True)``, plus the
storages that existed before the step.

The comparison uses the simulation's *unrounded* peak (the CPU allocator does not round to
512 B). Models are built from ops without hidden CPU workspaces; where a model is outside
that, the test says why.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memcalc
from memcalc.fields import build_step
from memcalc.measure.step import measure_cpu

# The bar is 2 %; on torch 2.13 these cases agree to the byte or within ~100 B (CPU
# scalars such as the optimizers' step counters, which a GPU would not hold either), so we
# hold a tighter 0.5 % to catch regressions.
TOLERANCE = 0.005


class GeluMLP(nn.Module):
    def __init__(self, d: int = 256, hidden: int = 1024, classes: int = 10, p: float = 0.1):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.drop(self.act(self.fc1(self.norm(x))))
        x = self.drop(self.act(self.fc2(x)))
        return self.fc3(x)


class ExplicitAttention(nn.Module):
    """Attention written as matmul + softmax (no SDPA kernel whose CPU/CUDA choice differs)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        y = F.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = ExplicitAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyEncoderLM(nn.Module):
    """Embedding → 2 encoder blocks → LM head tied to the embedding."""

    def __init__(self, vocab: int = 1000, d: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(EncoderBlock(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class EmbeddingBagClassifier(nn.Module):
    def __init__(self, vocab: int = 5000, d: int = 64, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, classes)

    def forward(self, ids):
        return self.fc(self.embed(ids).mean(dim=1))


def _lm_loss(output):
    # next-token loss with fixed targets, the same for the real and the symbolic run
    targets = torch.zeros(output.shape[:-1], dtype=torch.long, device=output.device)
    return F.cross_entropy(output.flatten(0, -2), targets.flatten())


CASES = {
    "gelu-mlp-sgd": dict(model=GeluMLP, batch=64, input_shape=(256,), optimizer="sgd"),
    "gelu-mlp-adam": dict(model=GeluMLP, batch=64, input_shape=(256,), optimizer="adam"),
    "gelu-mlp-eval": dict(model=GeluMLP, batch=256, input_shape=(256,), optimizer="none", mode="eval"),
    "zoo-mlp-momentum": dict(model="mlp", batch=128, optimizer="sgd-momentum"),
    "encoder-lm-adamw": dict(model=TinyEncoderLM, batch=8, inputs=lambda b: (torch.randint(0, 1000, (b, 64)),),
                             optimizer="adamw", loss_fn=_lm_loss),
    "embedding-rmsprop": dict(model=EmbeddingBagClassifier, batch=32,
                              inputs=lambda b: (torch.randint(0, 5000, (b, 20)),), optimizer="rmsprop"),
    "embedding-adagrad": dict(model=EmbeddingBagClassifier, batch=32,
                              inputs=lambda b: (torch.randint(0, 5000, (b, 20)),), optimizer="adagrad"),
}


def _measure_and_estimate(case):
    model = case["model"]
    kwargs = dict(batch_size=case["batch"], input_shape=case.get("input_shape"))
    if "inputs" in case:
        kwargs = dict(inputs=case["inputs"](case["batch"]))
    mode = case.get("mode", "train")
    loss_fn = case.get("loss_fn")
    # target="cpu": no CUDA kernel emulation, no CUDA workspaces — the CPU runs CPU kernels
    estimate = memcalc.estimate(model, optimizer=case["optimizer"], mode=mode, loss=loss_fn, gpu="cpu",
                                **kwargs)
    torch.manual_seed(0)
    measured = measure_cpu(build_step(model, optimizer=case["optimizer"], mode=mode, loss=loss_fn, **kwargs))
    return estimate, measured.peak_allocated


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.quick_cases("embedding-rmsprop")
def test_simulated_peak_matches_real_cpu_step(name):
    estimate, measured = _measure_and_estimate(CASES[name])
    error = (estimate.peak_requested - measured) / measured
    assert abs(error) <= TOLERANCE, (
        f"{name}: simulated {estimate.peak_requested:,} B vs real CPU {measured:,} B ({error:+.2%})")


@pytest.mark.slow
def test_conv_net_differs_on_cpu_for_a_known_reason():
    # Convolutions are outside the 2 % bar on CPU: oneDNN/MKL-DNN convolution kernels allocate
    # their own workspaces (reordered weights, im2col buffers) that no meta kernel shows — and
    # they differ from cuDNN's on a GPU anyway. The simulation is a lower bound here.
    estimate, measured = _measure_and_estimate(dict(model="resnet18", batch=2, input_shape=(3, 64, 64),
                                                    optimizer="sgd"))
    # measured on torch 2.13: -0.34 % (-0.27 % while the simulation also added autograd's
    # gradient sums out of place, as the tracer's dispatch mode makes it; see memcalc.targets.cpu.kernels)
    assert estimate.peak_requested <= measured * 1.02
    assert estimate.unsupported_ops  # and the report says convolution is approximated

"""Storage semantics: tied weights once, in-place ops allocate nothing, views share, dict
outputs, and a user's module left exactly as it was."""

from __future__ import annotations

import torch
from torch import nn

import memcalc
from memcalc.core.categories import Category
from memcalc.fields import build_step
from memcalc.sources.resolve import meta_twin, resolve
from memcalc.targets.backend import trace_step as trace_model


class TiedLM(nn.Module):
    def __init__(self, vocab=1000, d=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_tied_weights_counted_once():
    # 1000·64 params = 64,000 → 256,000 B once, not twice.
    r = memcalc.estimate(TiedLM(), inputs=torch.zeros(2, 8, dtype=torch.long), optimizer="sgd")
    assert r.parameters == 64_000
    assert r.bytes.parameters == 256_000


class InplaceNet(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.fc = nn.Linear(512, 512)
        self.relu = nn.ReLU(inplace=inplace)

    def forward(self, x):
        return self.relu(self.fc(x))


def _storages_born_in_forward(model, batch=64):
    # target="cpu": tensors only, without the synthetic CUDA workspaces
    traced = trace_model(resolve(model, batch_size=batch, input_shape=(512,)),
                         build_step(optimizer="none", mode="eval", gpu="cpu"))
    trace = traced.trace
    return [trace.nbytes[u] for u in range(trace.num_storages) if trace.phase[u].value == "forward"]


def test_inplace_relu_allocates_nothing():
    # Linear: one 64·512·4 = 131,072 B output; ReLU(inplace=True) writes into it,
    # ReLU(inplace=False) allocates a second one.
    assert _storages_born_in_forward(InplaceNet(inplace=True)) == [131_072]
    assert _storages_born_in_forward(InplaceNet(inplace=False)) == [131_072, 131_072]


class ViewNet(nn.Module):
    def forward(self, x):
        y = x * 2  # one new storage (B·4·4·4 bytes)
        return y.view(-1, 16).t().contiguous().view(-1)  # view, view, a copy, a view of the copy


def test_views_share_storage_and_copies_do_not():
    traced = trace_model(resolve(ViewNet(), batch_size=8, input_shape=(4, 4)),
                         build_step(optimizer="none", mode="eval"))
    trace = traced.trace
    born = [trace.nbytes[u] for u in range(trace.num_storages) if trace.phase[u].value == "forward"]
    # x*2: 8·16·4 = 512 B; view and t() share it; contiguous() of the transpose copies: 512 B
    assert born == [512, 512]


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        return {"logits": self.a(x), "aux": self.b(x)}


def test_dict_outputs_use_logits_for_cross_entropy():
    r = memcalc.estimate(DictNet(), batch_size=4, input_shape=(16,), optimizer="sgd", loss="cross-entropy")
    assert r.loss == "cross-entropy"
    # only head "a" gets gradients through cross-entropy on "logits": b's grads never exist
    assert r.bytes.gradients <= (16 * 4 + 4) * 4


def test_dict_outputs_mean_reaches_every_output():
    traced = trace_model(resolve(DictNet(), batch_size=4, input_shape=(16,)), build_step(optimizer="sgd", loss="mean"))
    grads = sum(traced.trace.nbytes[u] for u, c in enumerate(traced.categories) if c is Category.GRADIENTS)
    assert grads == (16 * 4 + 4 + 16 * 8 + 8) * 4  # every parameter got a gradient


def test_tuple_outputs_handled():
    class TupleNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            return y, y.relu()

    # auto loss reads the first tensor, (B, 8): a classifier → cross-entropy
    traced = trace_model(resolve(TupleNet(), batch_size=2, input_shape=(8,)), build_step(optimizer="adam"))
    grads = sum(traced.trace.nbytes[u] for u, c in enumerate(traced.categories) if c is Category.GRADIENTS)
    assert traced.loss == "cross-entropy" and grads == (8 * 8 + 8) * 4
    r = memcalc.estimate(TupleNet(), batch_size=2, input_shape=(8,), optimizer="adam", loss="mean")
    assert r.loss == "mean" and r.bytes.peak_allocated > 0


def test_user_module_with_real_weights_left_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    model.eval()
    pointers = [p.data_ptr() for p in model.parameters()] + [b.data_ptr() for b in model.buffers()]
    snapshot = [t.clone() for t in model.state_dict().values()]
    memcalc.estimate(model, batch_size=16, input_shape=(64,), optimizer="adam")
    assert not model.training  # train/eval mode as it was
    assert [p.data_ptr() for p in model.parameters()] + [b.data_ptr() for b in model.buffers()] == pointers
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(snapshot, model.state_dict().values(), strict=True))
    assert not model._forward_hooks and not model[0]._forward_pre_hooks  # hooks removed


def test_meta_twin_copies_no_data_and_keeps_ties():
    model = TiedLM()
    twin = meta_twin(model)
    assert all(p.device.type == "meta" for p in twin.parameters())
    assert twin.head.weight is twin.embed.weight
    assert model.embed.weight.device.type == "cpu"


def test_loss_fn_is_used():
    calls = []

    def loss_fn(output):
        calls.append(tuple(output.shape))
        return (output ** 2).sum()

    memcalc.estimate("mlp", batch_size=4, loss=loss_fn, optimizer="sgd")
    assert calls == [(4, 10)]


def test_factory_is_built_on_meta():
    built = []

    def factory():
        m = nn.Linear(4096, 4096)
        built.append(m.weight.device.type)
        return m

    r = memcalc.estimate(factory, batch_size=2, input_shape=(4096,), optimizer="sgd")
    assert built == ["meta"]
    assert r.parameters == 4096 * 4096 + 4096

"""The model zoo: every entry builds on meta, has its reference parameter count, and runs.

Parameter counts are hard-coded here from the reference implementations (torchvision, the
Hugging Face hub checkpoints) or derived by closed-form formula (U-Net, LSTM LM), so a
registry typo cannot make a test pass by reading its own answer back.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import memcalc
import models_zoo
from models_zoo import InputKind, LossKind

# --------------------------------------------------------------------------- reference counts


def unet_parameters(n_channels: int = 3, n_classes: int = 2) -> int:
    """milesial/Pytorch-UNet, bilinear=False.

    DoubleConv(i, o): two bias-free 3x3 convs (9*i*o + 9*o*o) and two BatchNorms (2*o each).
    Up(i, o): ConvTranspose2d(i, i//2, 2) with bias (4*i*(i//2) + i//2), then DoubleConv(i, o).
    OutConv: 1x1 conv with bias (64*n_classes + n_classes).
    """

    def double_conv(i: int, o: int) -> int:
        return 9 * i * o + 9 * o * o + 4 * o

    def up(i: int, o: int) -> int:
        return 4 * i * (i // 2) + i // 2 + double_conv(i, o)

    encoder = double_conv(n_channels, 64) + sum(double_conv(c, 2 * c) for c in (64, 128, 256, 512))
    decoder = sum(up(c, c // 2) for c in (1024, 512, 256, 128))
    return encoder + decoder + 64 * n_classes + n_classes


def lstm_lm_parameters(vocab: int = 10000, hidden: int = 650, layers: int = 2) -> int:
    """Embedding (V*H) + per layer 4 gates x (W_ih H*H + W_hh H*H + b_ih H + b_hh H) + decoder (H*V + V)."""
    lstm = layers * 4 * (2 * hidden * hidden + 2 * hidden)
    return vocab * hidden + lstm + hidden * vocab + vocab


EXPECTED_PARAMETERS = {
    "vgg11": 132_863_336,
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "mobilenet_v2": 3_504_872,
    "mobilenet_v3_large": 5_483_032,
    "efficientnet_b0": 5_288_548,
    "densenet121": 7_978_856,
    "vit_b_16": 86_567_656,
    "vit_l_16": 304_326_632,
    "bert-base": 109_482_240,
    "bert-large": 335_141_888,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    # memcalc's own config: d 512, 8 layers, 8 heads / 2 KV heads (head 64), SwiGLU 1376, vocab 32000.
    "llama-tiny": 2 * 32000 * 512 + 8 * (2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1376 + 2 * 512) + 512,
    "unet": unet_parameters(),
    "lstm-lm": lstm_lm_parameters(),
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
}

ALL_ENTRIES = models_zoo.entries()
ENTRY_IDS = [e.name for e in ALL_ENTRIES]


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() already dedups tied weights


def build_meta(name: str, shape: tuple[int, ...] | None = None) -> nn.Module:
    with torch.device("meta"):
        return models_zoo.get(name).build(shape)


def expected_output_shapes(entry: models_zoo.ZooEntry, batch: int) -> list[tuple[int, ...]] | None:
    shape = entry.default_shape
    if entry.loss is LossKind.LM_CROSS_ENTROPY:
        return [(batch, shape[0], entry.vocab_size)]
    special = {
        "unet": [(batch, 2, *shape[1:])],
        "mlp": [(batch, 10)],
        "fc-32-16": [(batch, 16)],
        "bert-base": [(batch, shape[0], 768), (batch, 768)],
        "bert-large": [(batch, shape[0], 1024), (batch, 1024)],
    }
    if entry.name in special:
        return special[entry.name]
    if entry.input_kind is InputKind.IMAGE and entry.loss is LossKind.CROSS_ENTROPY:
        return [(batch, 1000)]  # ImageNet classifiers
    return None  # an entry this file does not know yet: only the batch dimension is checked


def test_expected_entries_are_registered():
    missing = sorted(set(EXPECTED_PARAMETERS) - set(models_zoo.names()))
    assert not missing


def test_formula_counts_match_the_stated_numbers():
    assert unet_parameters() == 31_037_698
    assert lstm_lm_parameters() == 19_780_400
    assert EXPECTED_PARAMETERS["llama-tiny"] == 54_927_872


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMETERS))
def test_reference_count_is_the_hard_coded_one(name):
    assert models_zoo.get(name).reference_parameters == EXPECTED_PARAMETERS[name]


@pytest.mark.slow  # the whole zoo, or real CPU steps
@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=ENTRY_IDS)
def test_meta_build_matches_reference_count(entry):
    start = time.perf_counter()
    with torch.device("meta"):
        model = entry.build()
    assert time.perf_counter() - start < 20, "a meta build should take seconds, not allocate"
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.is_meta for t in tensors), "building under torch.device('meta') must not allocate"
    assert entry.reference_parameters is not None
    assert n_parameters(model) == entry.reference_parameters
    if entry.name in EXPECTED_PARAMETERS:
        assert n_parameters(model) == EXPECTED_PARAMETERS[entry.name]


@pytest.mark.slow  # the whole zoo, or real CPU steps
@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=ENTRY_IDS)
def test_meta_training_step_shapes(entry):
    """Batch 2 at the default input: right output shapes, and backward reaches every parameter."""
    with torch.device("meta"):
        model = entry.build()
    model.train()
    out = model(*entry.example_inputs(2, device="meta"))
    outs = list(out) if isinstance(out, tuple) else [out]
    expected = expected_output_shapes(entry, 2)
    if expected is None:
        assert all(o.shape[0] == 2 for o in outs)
    else:
        assert [tuple(o.shape) for o in outs] == expected
    sum(o.float().mean() for o in outs).backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


@pytest.mark.parametrize("entry", ALL_ENTRIES, ids=ENTRY_IDS)
def test_example_inputs(entry):
    (x,) = entry.example_inputs(3)
    assert tuple(x.shape) == (3, *entry.default_shape)
    if entry.input_kind is InputKind.TOKENS:
        assert x.dtype == torch.int64
        assert 0 <= int(x.min()) and int(x.max()) < entry.vocab_size
    else:
        assert x.is_floating_point()
    (xm,) = entry.example_inputs(3, device="meta")
    assert xm.is_meta and xm.shape == x.shape


def test_block_containers_resolve_to_module_lists():
    for entry in ALL_ENTRIES:
        model = build_meta(entry.name)
        for path in entry.block_containers:
            container = model.get_submodule(path)
            assert len(list(container.children())) > 1, (entry.name, path)


@pytest.mark.parametrize(
    "name, path",
    [
        ("vgg16", "classifier.6"),
        ("mobilenet_v2", "features.17.conv.2"),
        ("mobilenet_v3_large", "features.4.block.2.fc1"),
        ("efficientnet_b0", "features.3.0.stochastic_depth"),
        ("densenet121", "features.denseblock3.denselayer24.conv2"),
        ("vit_b_16", "encoder.layers.encoder_layer_11.self_attention.out_proj"),
        ("bert-base", "encoder.layer.11.attention.self.query"),
        ("bert-base", "encoder.layer.11.output.LayerNorm"),
        ("gpt2", "transformer.h.11.mlp.c_proj"),
        ("llama-2-70b", "model.layers.79.self_attn.k_proj"),
        ("llama-2-70b", "model.layers.79.post_attention_layernorm"),
        ("unet", "up4.conv.double_conv.3"),
    ],
)
def test_reference_module_names(name, path):
    build_meta(name).get_submodule(path)


def test_vit_attention_has_multihead_attention_parameters():
    attn = build_meta("vit_b_16").encoder.layers.encoder_layer_0.self_attention
    assert tuple(attn.in_proj_weight.shape) == (3 * 768, 768)
    assert tuple(attn.in_proj_bias.shape) == (3 * 768,)
    assert tuple(attn.out_proj.weight.shape) == (768, 768)


def test_vit_position_table_follows_input_size():
    model = build_meta("vit_b_16", (3, 384, 384))
    assert tuple(model.encoder.pos_embedding.shape) == (1, 577, 768)
    assert tuple(model(torch.empty(2, 3, 384, 384, device="meta")).shape) == (2, 1000)
    wide = build_meta("vit_l_16", (3, 224, 320))
    assert wide.encoder.pos_embedding.shape[1] == 14 * 20 + 1


def test_gpt2_lm_head_is_tied():
    model = build_meta("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert n_parameters(model) == EXPECTED_PARAMETERS["gpt2"]  # the tied matrix counted once


def test_gpt2_position_table_grows_only_past_1024():
    assert build_meta("gpt2").transformer.wpe.num_embeddings == 1024
    assert build_meta("gpt2", (512,)).transformer.wpe.num_embeddings == 1024
    longer = build_meta("gpt2", (2048,))
    assert longer.transformer.wpe.num_embeddings == 2048
    x = torch.empty(1, 2048, dtype=torch.int64, device="meta")
    assert tuple(longer(x).shape) == (1, 2048, 50257)


def test_llama_70b_grouped_query_attention_shapes():
    attn = build_meta("llama-2-70b").model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (64, 8, 128)
    assert tuple(attn.k_proj.weight.shape) == (1024, 8192)


def test_llama_lm_head_is_untied():
    model = build_meta("llama-2-7b")
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_unet_odd_input_size_on_meta():
    model = build_meta("unet", (3, 37, 45))
    assert tuple(model(torch.empty(2, 3, 37, 45, device="meta")).shape) == (2, 2, 37, 45)


# --------------------------------------------------------------------------- real CPU runs


@pytest.mark.parametrize(
    "name, shape, batch",
    [
        ("mlp", None, 4),
        ("mobilenet_v2", (3, 64, 64), 1),
        ("llama-tiny", (16,), 2),
        ("lstm-lm", (12,), 2),
        ("unet", (3, 36, 36), 1),
    ],
)
@pytest.mark.slow  # the whole zoo, or real CPU steps
def test_real_cpu_training_step(name, shape, batch):
    torch.manual_seed(0)
    entry = models_zoo.get(name)
    model = entry.build(shape)
    out = model(*entry.example_inputs(batch, shape))
    if entry.loss is LossKind.LM_CROSS_ENTROPY:
        assert tuple(out.shape) == (batch, (shape or entry.default_shape)[0], entry.vocab_size)
    out.float().mean().backward()
    assert torch.isfinite(out).all()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow  # the whole zoo, or real CPU steps
def test_real_cpu_gpt2_forward():
    torch.manual_seed(0)
    entry = models_zoo.get("gpt2")
    model = entry.build((8,)).eval()
    with torch.no_grad():
        logits = model(*entry.example_inputs(1, (8,)))
    assert tuple(logits.shape) == (1, 8, 50257)
    assert torch.isfinite(logits).all()


def test_densenet_checkpointing_recomputes_each_layer_with_its_own_inputs():
    # each dense layer reads the features so far; under checkpointing it is recomputed in
    # backward and must see the same list as in forward (not the grown one)
    plain = memcalc.estimate("densenet121", batch_size=2, input_shape=(3, 64, 64), optimizer="sgd")
    ckpt = memcalc.estimate("densenet121", batch_size=2, input_shape=(3, 64, 64), optimizer="sgd", checkpoint=True)
    assert ckpt.bytes.activations < plain.bytes.activations

"""The model zoo: every entry builds on meta, has its reference parameter count, and runs.

Parameter counts are hard-coded here from the reference implementations (torchvision, the
Hugging Face hub checkpoints) or derived by closed-form formula (U-Net, LSTM LM), so a
registry typo cannot make a test pass by reading its own answer back.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import memcalc
import models_zoo
from models_zoo import InputKind, LossKind
from models_zoo.gemma2 import Gemma2Config, Gemma2ForCausalLM
from models_zoo.gemma2 import parameter_count as gemma2_parameter_count
from models_zoo.llama import LlamaConfig, LlamaForCausalLM
from models_zoo.llm_blocks import causal_mask, eager_attention, eager_float_mask, repeat_kv

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
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    # 2·128256·16384 (embedding, head) + 126 layers × (2·16384² + 2·16384·1024 + 3·16384·53248 + 2·16384) + 16384
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
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

#: The entries the zoo defines in plain torch (the mixture-of-experts ones are transformers' models
#: only: tests/test_moe.py).
ALL_ENTRIES = [e for e in models_zoo.entries() if e.has_plain_torch]
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
    with torch.device("meta"):
        model = entry.build()
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


@pytest.mark.slow  # builds every zoo model
def test_block_containers_resolve_to_module_lists():
    for entry in ALL_ENTRIES:
        model = build_meta(entry.name)
        for path in entry.block_containers:
            container = model.get_submodule(path)
            assert len(list(container.children())) > 1, (entry.name, path)


# the quick suite: one name per builder and architecture (issue 36 item 7); the full suite runs all
@pytest.mark.quick_cases(
    "vgg16-classifier.6", "mobilenet_v2-features.17.conv.2", "mobilenet_v3_large-features.4.block.2.fc1",
    "efficientnet_b0-features.3.0.stochastic_depth", "densenet121-features.denseblock3.denselayer24.conv2",
    "vit_b_16-encoder.layers.encoder_layer_11.self_attention.out_proj",
    "bert-base-encoder.layer.11.attention.self.query",
    "gpt2-transformer.h.11.mlp.c_proj", "llama-2-70b-model.layers.79.self_attn.k_proj",
    "mistral-7b-model.layers.31.self_attn.v_proj", "qwen2.5-7b-model.layers.27.self_attn.q_proj",
    "gemma-2-2b-model.layers.25.pre_feedforward_layernorm", "unet-up4.conv.double_conv.3")
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
        ("llama-3-70b", "model.layers.79.mlp.down_proj"),
        ("mistral-7b", "model.layers.31.self_attn.v_proj"),
        ("qwen2.5-7b", "model.layers.27.self_attn.q_proj"),
        ("gemma-2-2b", "model.layers.25.pre_feedforward_layernorm"),
        ("gemma-2-9b", "model.layers.41.post_feedforward_layernorm"),
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


def test_llama_3_mistral_qwen_shapes():
    attn = build_meta("llama-3-70b").model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (64, 8, 128)
    assert build_meta("llama-3-8b").model.embed_tokens.num_embeddings == 128256
    mistral = build_meta("mistral-7b")
    assert mistral.model.sliding_window == 4096
    assert mistral.lm_head.weight is not mistral.model.embed_tokens.weight
    qwen = build_meta("qwen2.5-7b").model.layers[0].self_attn
    # Qwen2: q/k/v with bias (28 and 4 heads of 128), o_proj without
    assert [tuple(m.bias.shape) for m in (qwen.q_proj, qwen.k_proj, qwen.v_proj)] == [(3584,), (512,), (512,)]
    assert qwen.o_proj.bias is None
    assert build_meta("qwen2.5-7b").model.sliding_window is None  # use_sliding_window: false


# quick: one Llama 3 entry (llama-3-70b differs from llama-3-8b in its numbers only, and builds 80
# layers), the Llama 2 entry with grouped heads and every other family; the full suite runs all
@pytest.mark.quick_cases("llama-3-8b-True", "mistral-7b-True", "qwen2.5-7b-True", "llama-2-70b-False",
                         "llama-tiny-False")
@pytest.mark.parametrize("name, gqa", [("llama-3-8b", True), ("llama-3-70b", True), ("mistral-7b", True),
                                       ("qwen2.5-7b", True), ("llama-2-70b", False), ("llama-tiny", False)])
def test_grouped_query_attention_follows_its_transformers_version(name, gqa):
    # transformers 5.x passes enable_gqa=True to SDPA; the Llama 2 entries keep 4.x's repeat_kv
    assert build_meta(name).config.sdpa_enable_gqa is gqa


class _RecordSdpa(TorchFunctionMode):
    """Records what each F.scaled_dot_product_attention call receives."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask")
            self.calls.append({"key": tuple(args[1].shape), "mask": None if mask is None else tuple(mask.shape),
                               "enable_gqa": kwargs.get("enable_gqa", False), "is_causal": kwargs.get("is_causal")})
        return func(*args, **kwargs)


# d 64, 2 layers, 4 heads / 2 KV heads (head 16), window 8
_SMALL = LlamaConfig(64, 2, 4, 2, 128, vocab_size=100, sliding_window=8, sdpa_enable_gqa=True)


@pytest.mark.parametrize("cfg, seq_len, expected", [
    # below the window: no mask, is_causal, the 2 KV heads handed over as they are
    (_SMALL, 7, {"key": (3, 2, 7, 16), "mask": None, "enable_gqa": True, "is_causal": True}),
    # from the window on (even at ==): HF's boolean mask, and having a mask, K/V repeated to 4 heads
    (_SMALL, 8, {"key": (3, 4, 8, 16), "mask": (3, 1, 8, 8), "enable_gqa": False, "is_causal": False}),
    (_SMALL, 20, {"key": (3, 4, 20, 16), "mask": (3, 1, 20, 20), "enable_gqa": False, "is_causal": False}),
    # no window (Llama 3, Qwen2.5): never a mask
    (replace(_SMALL, sliding_window=None), 20, {"key": (3, 2, 20, 16), "mask": None, "enable_gqa": True,
                                                "is_causal": True}),
    # transformers 4.x (Llama 2 entries): repeat_kv, is_causal
    (replace(_SMALL, sliding_window=None, sdpa_enable_gqa=False), 20,
     {"key": (3, 4, 20, 16), "mask": None, "enable_gqa": False, "is_causal": True}),
])
def test_sdpa_calls_match_hugging_face(cfg, seq_len, expected):
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    recorder = _RecordSdpa()
    with recorder:
        model(torch.zeros(3, seq_len, dtype=torch.int64, device="meta"))
    assert recorder.calls == [expected] * cfg.num_layers


def test_sliding_window_mask_is_hugging_faces_example():
    # masking_utils.sdpa_mask's docstring, sliding_window=3, 5 tokens: each query sees itself and 2 before
    allowed = causal_mask(2, 5, torch.device("cpu"), sliding_window=3)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],
                             [0, 1, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert allowed.shape == (2, 1, 5, 5) and allowed.stride(0) == 0  # one (1, 1, T, T) expanded over the batch
    assert torch.equal(allowed[1, 0], expected)
    assert torch.equal(causal_mask(1, 5, torch.device("cpu"))[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    additive = eager_float_mask(allowed, torch.bfloat16)
    assert additive.dtype == torch.bfloat16 and additive.shape == (2, 1, 5, 5) and additive.stride(0) != 0
    assert torch.equal(additive[0, 0] == 0, expected)
    assert float(additive[0, 0, 0, 1]) == torch.finfo(torch.bfloat16).min


def test_eager_attention_equals_sdpa_without_softcap():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    mask = eager_float_mask(causal_mask(2, 6, q.device), q.dtype)
    eager = eager_attention(q, k, v, 2, mask, scaling=8 ** -0.5, softcap=None, dropout_p=0.0, training=True)
    reference = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    assert torch.allclose(eager, reference.transpose(1, 2))
    capped = eager_attention(q, k, v, 2, mask, scaling=8 ** -0.5, softcap=1e-3, dropout_p=0.0, training=True)
    assert not torch.allclose(capped, eager)  # a cap this small flattens the scores: uniform over the past


@pytest.mark.slow  # the whole zoo, or real CPU steps
def test_real_cpu_mistral_window_that_hides_nothing_changes_nothing():
    # at seq_len == window the mask path runs (mask + repeat_kv) but masks only the future
    torch.manual_seed(0)
    windowed = LlamaForCausalLM(replace(_SMALL, sliding_window=10))
    plain = LlamaForCausalLM(replace(_SMALL, sliding_window=None))
    plain.load_state_dict(windowed.state_dict())
    ids = torch.randint(0, 100, (2, 10))
    assert torch.allclose(windowed(ids), plain(ids), atol=1e-6)
    shorter = LlamaForCausalLM(replace(_SMALL, sliding_window=4))
    shorter.load_state_dict(windowed.state_dict())
    assert torch.allclose(shorter(ids)[:, :4], plain(ids)[:, :4], atol=1e-6)
    assert not torch.allclose(shorter(ids)[:, 4:], plain(ids)[:, 4:], atol=1e-3)


def test_gemma_2_layout():
    model = build_meta("gemma-2-2b")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, counted once
    assert [layer.sliding for layer in model.model.layers[:4]] == [True, False, True, False]  # HF layer_types
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (8, 4, 256)
    assert tuple(attn.q_proj.weight.shape) == (2048, 2304)  # 8 heads × 256 > hidden 2304
    assert attn.scaling == 256 ** -0.5 and attn.softcap == 50.0
    assert model.final_logit_softcapping == 30.0 and model.model.embed_scale == 48.0  # sqrt(2304)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.act_fn, nn.GELU) and layer.mlp.act_fn.approximate == "tanh"
    assert build_meta("gemma-2-9b").model.layers[0].self_attn.scaling == 256 ** -0.5


@pytest.mark.slow  # the whole zoo, or real CPU steps
def test_real_cpu_gemma_2_step():
    torch.manual_seed(0)
    cfg = Gemma2Config(64, 3, 4, 2, 128, head_dim=32, vocab_size=100, sliding_window=4, query_pre_attn_scalar=32)
    model = Gemma2ForCausalLM(cfg)
    for p in model.parameters():  # Gemma's norms start at 0 (scale 1): move everything off its init
        nn.init.normal_(p, std=2.0)
    logits = model(torch.randint(0, 100, (2, 9)))
    assert tuple(logits.shape) == (2, 9, 100)
    assert logits.abs().max() <= 30.0  # final soft-cap: 30 · tanh(·)
    logits.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert gemma2_parameter_count(cfg) == n_parameters(model)


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


@pytest.mark.slow  # a checkpointed DenseNet traced
def test_densenet_checkpointing_recomputes_each_layer_with_its_own_inputs():
    # each dense layer reads the features so far; under checkpointing it is recomputed in
    # backward and must see the same list as in forward (not the grown one)
    plain = memcalc.estimate("densenet121", batch_size=2, input_shape=(3, 64, 64), optimizer="sgd")
    ckpt = memcalc.estimate("densenet121", batch_size=2, input_shape=(3, 64, 64), optimizer="sgd", checkpoint=True)
    assert ckpt.bytes.activations < plain.bytes.activations

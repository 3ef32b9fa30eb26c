"""The QLoRA model before its first step, memcalc's meta model against the real one: a bf16
checkpoint loaded by ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True,
...))``, ``prepare_model_for_kbit_training`` and ``get_peft_model``, run for real on the CPU.

Compared tensor by tensor: the storage bitsandbytes gives each 4-bit layer (the packed weight
and its ``QuantState``), and every other parameter's shape, dtype and ``requires_grad`` after
PEFT's preparation (its float32 casts) — the bytes that are alive before the step begins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_harness import MISTRAL_VOCAB, Recipe, llama_config, model_bytes, real_model, storage_bytes, write_config
from support import skip_module_without

from memcalc.core.categories import Mode
from memcalc.core.finetune import FineTune, LoRA
from memcalc.core.precision import Precision
from memcalc.sources.resolve import resolve
from memcalc.stacks.bitsandbytes.quantized_base import QuantizedLinear
from memcalc.stacks.peft import apply_finetune

pytest.importorskip("transformers")
skip_module_without("peft", "bitsandbytes")  # imported by the tests, not at collection (every xdist worker)
pytestmark = pytest.mark.slow  # a checkpoint saved and loaded back: 2–3 s a case

_CONFIG = llama_config(MISTRAL_VOCAB, hidden=256)
_PEFT_PREFIX = "base_model.model."


def _models(tmp_path: Path, double_quant: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The real QLoRA model and memcalc's, both from the same config (bf16 weights, nf4, r=16)."""
    real = real_model(Recipe(_CONFIG, weights=torch.bfloat16, qlora=True, lora=16, double_quant=double_quant))
    resolved = resolve(write_config(tmp_path, _CONFIG), batch_size=1, seq_len=16)
    finetune = FineTune(lora=LoRA(16), quant="nf4", double_quant=double_quant)
    meta = apply_finetune(resolved, finetune, precision=Precision.BF16, mode=Mode.TRAIN).module
    return real, meta


def _layer_name(name: str) -> str:
    """A layer's name in the model PEFT wraps (the real one is a PeftModel, memcalc traces its base)."""
    return name.removeprefix(_PEFT_PREFIX).removesuffix(".base_layer")


def _real_4bit_storage(layer: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A ``Linear4bit``'s packed weight and the tensors of its ``QuantState``, by memcalc's names."""
    state = layer.weight.quant_state
    found = {"weight": layer.weight, "weight_absmax": state.absmax, "weight_quant_map": state.code}
    if state.nested:
        found |= {"weight_nested_absmax": state.state2.absmax, "weight_nested_quant_map": state.state2.code,
                  "weight_offset": state.offset}
    return {k: (tuple(t.shape), t.dtype) for k, t in found.items()}


@pytest.mark.parametrize("double_quant", [False, True])
def test_4bit_layouts_equal_from_pretrained(tmp_path: Path, double_quant: bool) -> None:
    real, meta = _models(tmp_path, double_quant)
    real_layers = {_layer_name(n): _real_4bit_storage(m) for n, m in real.named_modules()
                   if type(m).__name__ == "Linear4bit"}
    meta_layers = {_layer_name(n): {t.name: (t.shape, t.dtype) for t in m.layout} for n, m in meta.named_modules()
                   if isinstance(m, QuantizedLinear)}
    assert len(real_layers) == 14  # 2 layers × 7 projections; lm_head left alone
    assert meta_layers == real_layers


def test_parameters_after_prepare_model_for_kbit_training(tmp_path: Path) -> None:
    real, meta = _models(tmp_path, double_quant=True)

    def described(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
        quantized = {_layer_name(n) for n, m in model.named_modules()
                     if type(m).__name__ == "Linear4bit" or isinstance(m, QuantizedLinear)}
        return {_layer_name(n.removesuffix(".weight")) + ".weight" * n.endswith(".weight"):
                (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()
                if _layer_name(n.rsplit(".", 1)[0]) not in quantized}

    real_params = described(real)
    # PEFT cast the embeddings, the LM head and the norms from bf16 to float32; the adapters train
    assert real_params["model.embed_tokens.weight"] == ((MISTRAL_VOCAB, 256), torch.float32, False)
    assert real_params["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == ((16, 256), torch.float32, True)
    assert described(meta) == real_params
    meta_bytes = storage_bytes([*meta.parameters(), *meta.buffers()])
    assert meta_bytes == model_bytes(real)  # what is alive when the step begins, to the byte


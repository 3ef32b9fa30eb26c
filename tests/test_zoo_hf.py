"""The zoo's language models are transformers' models where transformers is installed (issue 24,
item 7): each entry's released config (plain data in ``models_zoo``) builds the class its
``architectures`` names, through the path ``hf:`` models take — so PEFT's default LoRA targets, the
model's own loss and transformers' attention are the library's. ``torch:NAME`` keeps the zoo's
plain-torch definition, which the real GPU measurements were made with, and is the fallback when
transformers is missing."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import memcalc
import models_zoo
from memcalc.cli import main
from memcalc.core.errors import UnknownModelError
from memcalc.sources.resolve import resolve
from models_zoo.gpt2 import GPT2LMHeadModel
from models_zoo.llama import LlamaForCausalLM

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).parent / "fixtures" / "hf_configs"
#: The language models with a plain-torch twin; the mixture-of-experts ones, transformers' only
#: (``models_zoo.moe``), are tests/test_moe.py's.
HF_ENTRIES = [e for e in models_zoo.entries() if e.hf is not None and e.has_plain_torch]
#: The entries whose per-entry checks run in the quick loop: the smallest of each family (one
#: architecture class and config layout each; a test checks that they cover every family). The
#: other sizes differ in their numbers only, and run in the full suite (issue 36 item 7).
QUICK_ENTRIES = ("gpt2", "llama-tiny", "mistral-7b", "qwen2.5-7b", "gemma-2-2b", "bert-base")


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_every_language_model_of_the_zoo_has_a_released_config() -> None:
    families = {e.family for e in HF_ENTRIES}
    assert families == {"llama", "mistral", "qwen2", "gemma2", "gpt2", "bert"}
    assert len(HF_ENTRIES) == 17  # llama-3.1-405b joined (issue 33)
    assert {models_zoo.get(name).family for name in QUICK_ENTRIES} == families  # the quick loop's, one each
    transformers_only = {e.family for e in models_zoo.entries() if e.hf is not None and not e.has_plain_torch}
    assert transformers_only == {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"}
    # the others reproduce torchvision or papers, not a Hugging Face checkpoint
    assert models_zoo.get("resnet50").hf is None and models_zoo.get("vit_b_16").hf is None


@pytest.mark.quick_cases(*QUICK_ENTRIES)
@pytest.mark.parametrize("entry", HF_ENTRIES, ids=lambda e: e.name)
def test_the_zoo_name_builds_transformers_model_with_the_released_count(entry: models_zoo.ZooEntry) -> None:
    assert entry.hf is not None
    resolved = resolve(entry.name, batch_size=1, seq_len=8)
    module = resolved.module
    assert type(module).__name__ == entry.hf.architecture
    assert type(module).__module__.startswith("transformers.")
    assert all(p.is_meta for p in module.parameters())
    assert _count(module) == entry.hf_parameters
    # the released count: the zoo's own for every decoder; BERT's checkpoint names the masked-LM head
    if entry.family != "bert":
        assert entry.hf_parameters == entry.reference_parameters
    else:
        d, vocab = module.config.hidden_size, module.config.vocab_size
        assert entry.hf_parameters == entry.reference_parameters + 2 * d + vocab
    assert resolved.labels is not None  # trained with the model's own loss, labels in the batch
    # the same repeated blocks (--checkpoint, FSDP units), under the head's prefix (BertForMaskedLM.bert)
    (blocks,) = resolved.block_containers
    assert blocks.endswith(entry.block_containers[0])
    assert len(module.get_submodule(blocks)) == module.config.num_hidden_layers
    assert resolved.decoder is entry.decoder
    assert resolved.notes[0].startswith(f"{entry.name} is transformers' {entry.hf.architecture}, built from the "
                                        f"released config of {entry.hf.repo}")
    # the plain-torch definition keeps its own count under its explicit name
    plain = resolve(f"torch:{entry.name}", batch_size=1, seq_len=8)
    assert plain.name == f"torch:{entry.name}"
    assert not type(plain.module).__module__.startswith("transformers.")
    assert _count(plain.module) == entry.reference_parameters


@pytest.mark.quick_cases(*QUICK_ENTRIES)
@pytest.mark.parametrize("entry", HF_ENTRIES, ids=lambda e: e.name)
def test_the_released_config_runs_what_an_hf_config_file_runs(entry: models_zoo.ZooEntry, tmp_path: Path) -> None:
    # the same values written as a config.json: the same class, attention and parameters as hf:FILE
    assert entry.hf is not None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(entry.hf.values)))
    ours = resolve(entry.name, batch_size=1, seq_len=8).module
    theirs = resolve(f"hf:{path}", batch_size=1, seq_len=8).module
    assert type(ours) is type(theirs)
    assert ours.config._attn_implementation == theirs.config._attn_implementation
    assert _count(ours) == _count(theirs)


def test_llama_3_8b_equals_its_released_config_json() -> None:
    # tests/fixtures/hf_configs/meta-llama-3-8b.json is the checkpoint's config.json as downloaded
    # from the Hub: the zoo's values build the same step, to the byte
    kw = dict(batch_size=1, seq_len=256, optimizer="adamw", precision="amp-bf16", gpu="h100-80gb")
    zoo = memcalc.estimate("llama-3-8b", **kw)
    hub = memcalc.estimate(f"hf:{CONFIGS / 'meta-llama-3-8b.json'}", **kw)
    assert zoo.parameters == hub.parameters == 8_030_261_248
    assert zoo.bytes.peak_allocated == hub.bytes.peak_allocated
    assert zoo.peak_reserved == hub.peak_reserved


def test_the_zoo_keeps_its_default_sequence_length() -> None:
    # hf: models default to 512 tokens; the zoo's names to the length of their entry
    assert resolve("llama-3-8b", batch_size=1).inputs[0].shape == (1, 8192)
    assert resolve("gpt2", batch_size=1).inputs[0].shape == (1, 1024)


def test_a_longer_sequence_grows_gpt2s_position_table_as_the_plain_torch_one() -> None:
    hf = resolve("gpt2", batch_size=1, seq_len=2048)
    plain = resolve("torch:gpt2", batch_size=1, seq_len=2048)
    assert hf.module.transformer.wpe.num_embeddings == plain.module.transformer.wpe.num_embeddings == 2048
    grown = 124_439_808 + (2048 - 1024) * 768
    assert _count(hf.module) == _count(plain.module) == grown
    assert any(f"this model has {grown:,} parameters, not the released 124,439,808" in n for n in hf.notes)


def test_torch_prefix_names_the_plain_torch_model() -> None:
    assert isinstance(resolve("torch:llama-tiny", batch_size=1, seq_len=8).module, LlamaForCausalLM)
    assert isinstance(resolve("torch:GPT2", batch_size=1, seq_len=8).module, GPT2LMHeadModel)  # forgiving spelling
    # a model without a Hugging Face config is the same either way
    assert _count(resolve("torch:resnet50", batch_size=1).module) == 25_557_032
    assert models_zoo.plain_torch("GPT2") == "torch:gpt2" and models_zoo.plain_torch("hf:gpt2") == "hf:gpt2"
    assert models_zoo.plain_torch("resnet50") == "resnet50"  # plain torch already: the name is unchanged
    with pytest.raises(UnknownModelError) as caught:
        resolve("torch:llama-tinny", batch_size=1)
    assert "torch:llama-tiny" in str(caught.value.hint)


def test_without_transformers_the_zoo_name_is_the_plain_torch_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # find_spec → None, import → ImportError
    resolved = resolve("llama-tiny", batch_size=1, seq_len=8)
    assert isinstance(resolved.module, LlamaForCausalLM)
    assert resolved.name == "llama-tiny" and resolved.labels is None
    assert resolved.notes[-1].startswith("transformers is not installed: llama-tiny is memcalc's plain-torch "
                                         "definition of LlamaForCausalLM")


def test_the_plain_torch_estimates_are_unchanged_by_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch:NAME is what NAME was before transformers' models: the fallback and the prefix agree
    kw = dict(batch_size=2, seq_len=64, optimizer="adamw", precision="amp-bf16", gpu="h100-80gb")
    prefixed = memcalc.estimate("torch:llama-tiny", **kw)
    monkeypatch.setitem(sys.modules, "transformers", None)
    fallback = memcalc.estimate("llama-tiny", **kw)
    assert prefixed.bytes.peak_allocated == fallback.bytes.peak_allocated
    assert prefixed.peak_reserved == fallback.peak_reserved


def test_lora_on_a_zoo_llm_takes_pefts_default_targets() -> None:
    report = memcalc.estimate("llama-tiny", batch_size=1, seq_len=16, finetune=memcalc.FineTune(lora=memcalc.LoRA(8)))
    lora = next(n for n in report.notes if n.startswith("LoRA r=8"))
    # q_proj and v_proj of 8 layers: (512·8 + 8·512) + (512·8 + 8·128)
    assert lora.startswith("LoRA r=8 on q_proj, v_proj (PEFT's default for llama): 106,496 trainable")
    assert 8 * ((512 * 8 + 8 * 512) + (512 * 8 + 8 * 128)) == 106_496


def test_the_issues_qlora_command_runs() -> None:
    # issue 24, item 7: this exited 2 ("PEFT has no default LoRA targets for LlamaForCausalLM")
    result = CliRunner().invoke(main, ["llama-3-8b", "--seq-len", "2048", "--batch", "1", "--lora", "16", "--quant",
                                       "nf4", "--double-quant", "--precision", "bf16", "--checkpoint", "--gpu",
                                       "rtx-4090", "--depth", "0"])
    assert result.exit_code == 0, result.output
    assert "loss the model's own (output.loss)" in result.output
    assert "LoRA r=16 on q_proj, v_proj (PEFT's default for llama): 6,815,744 trainable" in result.output
    assert "fits in 23.08 GiB (NVIDIA GeForce RTX 4090): yes" in result.output
    # transformers' notice that its checkpointed layers drop their cache is what memcalc asked for: not shown
    assert "[transformers]" not in result.output
    assert logging.getLogger("transformers.modeling_layers").level == logging.NOTSET  # restored


def test_checkpointing_switches_transformers_layers_on_as_gradient_checkpointing_enable_does() -> None:
    # transformers' layers checkpoint themselves and then write no KV cache in the recomputed forward
    # (GradientCheckpointingLayer drops use_cache / cache), as a real gradient_checkpointing_enable()
    # run does: under memcalc's own loss, the peak is the plain-torch model's but for transformers' rotary
    # inv_freq buffer (256 B) and its small per-forward tensors (4 KiB). Wrapped from outside instead,
    # the recomputation wrote the cache again and its autograd history kept every layer's recomputed
    # tensors alive to the end of backward, where the peak moved (705 MiB more with LoRA on all seven
    # Linear layers).
    lora = memcalc.LoRA(16, targets=("q_proj", "down_proj"))
    kw = dict(batch_size=1, seq_len=512, optimizer="adamw", precision="bf16", gpu="a100-80gb", checkpoint=True,
              loss="lm-cross-entropy", finetune=memcalc.FineTune(lora=lora))
    hf = memcalc.estimate("llama-3-8b", **kw)
    plain = memcalc.estimate("torch:llama-3-8b", **kw)
    assert "activation checkpointing on 32 blocks (model.layers)" in hf.notes
    assert hf.bytes.buffers - plain.bytes.buffers == 256  # inv_freq: 64 float32 values
    assert 0 <= hf.bytes.peak_allocated - plain.bytes.peak_allocated <= 8 << 10
    assert hf.peak_location == plain.peak_location == "backward, loss (before any module's backward)"

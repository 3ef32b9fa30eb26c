"""``--attn eager|sdpa|flash_attention_2`` for hf: models (memcalc.stacks.transformers.attention).

Worked numbers use the tiny Llama of tests/fixtures/hf_configs (hidden 64, 4 heads of 16,
2 layers) at batch 1 and 256 tokens: one layer's attention probabilities are
B·H·T² = 1·4·256² = 262,144 elements, 1 MiB in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.report import MemoryReport
from memcalc.sources.resolve import resolve
from memcalc.stacks.transformers.attention import MEMCALC_FA2, flash_attention_2_forward
from memcalc.stacks.transformers.hub import HuggingFace, with_attention

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).parent / "fixtures" / "hf_configs"
TINY_GQA = CONFIGS / "tiny-llama.json"  # 4 query heads, 2 k/v heads
B, H, T = 1, 4, 256


@pytest.fixture(scope="module")
def tiny_mha(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with as many k/v heads as query heads (no GQA)."""
    config = json.loads(TINY_GQA.read_text())
    config["num_key_value_heads"] = config["num_attention_heads"]
    path = tmp_path_factory.mktemp("configs") / "tiny-llama-mha.json"
    path.write_text(json.dumps(config))
    return path


def _estimate(path: Path, attn: str | None, precision: str = "fp32") -> MemoryReport:
    return memcalc.estimate(HuggingFace(str(path), attn=attn), batch_size=B, seq_len=T, precision=precision)


def _attention_note(report: MemoryReport) -> str:
    notes = [n for n in report.notes if n.startswith("attention: ")]
    assert len(notes) == 1, report.notes
    return notes[0]


def test_eager_keeps_the_attention_probabilities_sdpa_does_not(tiny_mha: Path) -> None:
    eager = _estimate(tiny_mha, "eager")
    sdpa = _estimate(tiny_mha, "sdpa")
    probabilities = B * H * T * T * 4  # one layer's softmax(QKᵀ), float32: 1 MiB
    assert eager.bytes.peak_allocated - sdpa.bytes.peak_allocated >= probabilities
    assert eager.attention_backend is None and _attention_note(eager).startswith("attention: eager (asked")
    assert sdpa.attention_backend == "efficient"  # fp32 on the default sm80 profile: CUTLASS mem-efficient
    assert _attention_note(sdpa).startswith("attention: sdpa (asked")


def test_the_default_is_what_transformers_picks(tiny_mha: Path) -> None:
    default = _estimate(tiny_mha, None)
    assert _attention_note(default) == ("attention: sdpa (transformers' default for this model): "
                                        "scaled_dot_product_attention, the kernel CUDA would choose")
    assert default.bytes.peak_allocated == _estimate(tiny_mha, "sdpa").bytes.peak_allocated


def test_flash_attention_2_is_pytorchs_flash_kernel(tiny_mha: Path) -> None:
    # without GQA, sdpa in bf16 on sm80 runs PyTorch's flash kernel: the same op, the same bytes
    flash2 = _estimate(tiny_mha, "flash_attention_2", "amp-bf16")
    sdpa = _estimate(tiny_mha, "sdpa", "amp-bf16")
    assert sdpa.attention_backend == "flash"
    assert flash2.bytes.peak_allocated == sdpa.bytes.peak_allocated
    assert _attention_note(flash2).startswith("attention: flash_attention_2 (asked with --attn): flash-attn's kernel")


def test_flash_attention_2_never_exceeds_sdpa_math_or_eager() -> None:
    # With grouped k/v, transformers passes enable_gqa=True and memcalc's sdpa emulation runs the
    # math path on meta (the full attention matrix); flash-attn takes the grouped k/v as they are.
    flash2 = _estimate(TINY_GQA, "flash_attention_2", "amp-bf16")
    sdpa = _estimate(TINY_GQA, "sdpa", "amp-bf16")
    eager = _estimate(TINY_GQA, "eager", "amp-bf16")
    assert flash2.bytes.peak_allocated <= sdpa.bytes.peak_allocated
    assert flash2.bytes.peak_allocated < eager.bytes.peak_allocated
    assert flash2.attention_backend is None  # no scaled_dot_product_attention call: the note says which


def test_flash_attention_2_saves_what_flash_attn_saves() -> None:
    # flash-attn: ctx.save_for_backward(q, k, v, out_padded, softmax_lse (B, H, T) fp32, rng_state)
    b, h, h_kv, t, d = 2, 4, 2, 8, 16
    q = torch.empty(b, h, t, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(b, h_kv, t, d, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    out, weights = flash_attention_2_forward(SimpleNamespace(is_causal=True), q, k, v, None)
    assert weights is None and out.shape == (b, t, h, d)  # flash-attn's (B, T, H, D)
    node = out.grad_fn.next_functions[0][0]
    assert type(node).__name__ == "ScaledDotProductFlashAttentionBackward0"
    assert node._saved_query.shape == (b, h, t, d)
    assert node._saved_key.shape == node._saved_value.shape == (b, h_kv, t, d)  # k/v not repeated
    assert node._saved_output.shape == (b, h, t, d)
    assert node._saved_logsumexp.shape == (b, h, t) and node._saved_logsumexp.dtype == torch.float32


def test_flash_attention_2_refuses_float32(tiny_mha: Path) -> None:
    with pytest.raises(InvalidInputError, match="fp16 or bf16 only") as caught:
        _estimate(tiny_mha, "flash_attention_2", "fp32")
    assert "--precision amp-bf16" in (caught.value.hint or "")


# quick: every implementation on the tiny Llama, and the 8B checkpoint's config under one (the
# implementation is chosen the same way for both configs; the 8B one builds 32 layers); the full
# suite runs all eight
@pytest.mark.quick_cases("tiny-llama.json-None", "tiny-llama.json-eager", "tiny-llama.json-sdpa",
                         "tiny-llama.json-flash_attention_2", "meta-llama-3-8b.json-sdpa")
@pytest.mark.parametrize("attn", [None, "eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize("config", ["tiny-llama.json", "meta-llama-3-8b.json"])
def test_parameters_equal_transformers_own_model(config: str, attn: str | None) -> None:
    path = CONFIGS / config
    resolved = resolve(HuggingFace(str(path), attn=attn), batch_size=1, seq_len=16)
    implementation = {None: None, "flash_attention_2": MEMCALC_FA2}.get(attn, attn)
    kwargs = {} if implementation is None else {"attn_implementation": implementation}
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(path)),
                                                               **kwargs)
    assert theirs.config._attn_implementation == resolved.module.config._attn_implementation
    assert sum(p.numel() for p in resolved.module.parameters()) == sum(p.numel() for p in theirs.parameters())


def test_attn_applies_to_hf_models_only() -> None:
    assert with_attention("resnet50", None) == "resnet50"
    assert with_attention("hf:org/name@v1", "eager") == HuggingFace("org/name", "v1", "eager")
    with pytest.raises(InapplicableOptionError, match="applies to Hugging Face models only"):
        with_attention("resnet50", "eager")
    with pytest.raises(InvalidInputError, match="unknown attention implementation 'flash'"):
        HuggingFace("llama", attn="flash")


def test_command_line_attn(tiny_mha: Path) -> None:
    runner = CliRunner()
    eager = runner.invoke(main, [f"hf:{tiny_mha}", "--seq-len", "256", "--attn", "eager", "--depth", "0"])
    assert eager.exit_code == 0, eager.output
    assert "note: attention: eager (asked with --attn)" in eager.output
    refused = runner.invoke(main, ["mlp", "--attn", "sdpa"])
    assert refused.exit_code == 2 and "error: --attn sdpa applies to Hugging Face models only" in refused.output
    bad = runner.invoke(main, [f"hf:{tiny_mha}", "--attn", "flash"])
    assert bad.exit_code == 2 and "Invalid value for '--attn'" in bad.output


def test_sweep_and_fit_take_attn(tiny_mha: Path) -> None:
    runner = CliRunner()
    sweep = runner.invoke(main, ["sweep", f"hf:{tiny_mha}", "-b", "1", "--seq-len", "256", "--attn", "eager",
                                 "--format", "json"])
    assert sweep.exit_code == 0, sweep.output
    eager_peak = _estimate(tiny_mha, "eager").bytes.peak_allocated
    assert json.loads(sweep.output)[0]["report"]["bytes"]["peak_allocated"] == eager_peak
    fit = runner.invoke(main, ["fit", "mlp", "--budget", "1GiB", "--attn", "eager"])
    assert fit.exit_code == 2 and "applies to Hugging Face models only" in fit.output

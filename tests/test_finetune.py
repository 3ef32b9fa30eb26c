"""Fine-tuning: frozen parameters, LoRA with the real PEFT, and a quantized base emulated as
bitsandbytes stores and computes it (memcalc.stacks.peft, memcalc.stacks.bitsandbytes).

Byte counts are worked out in the tests from bitsandbytes' formulas (cited in
memcalc/stacks/bitsandbytes/quantized_base.py); parameter counts are compared with PEFT's own objects.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support import SMALL_LLAMA, hf_config_source, skip_module_without
from torch import nn

import memcalc
from memcalc import FineTune, LoRA
from memcalc.cli import main
from memcalc.core.categories import Phase
from memcalc.core.errors import InapplicableOptionError, InvalidInputError, MissingPackageError, RefusedStepError
from memcalc.core.finetune import Quant
from memcalc.core.precision import Precision
from memcalc.engine.run import TracedStep
from memcalc.estimation import run_estimate
from memcalc.fields import build_step
from memcalc.sources.resolve import resolve
from memcalc.stacks.bitsandbytes.quantized_base import layout_4bit, layout_int8, modules_to_not_convert

# PEFT and transformers are imported by the tests that use them (support.skip_module_without)
skip_module_without("peft", "transformers")

#: Meta-Llama-3-8B's dimensions (its config.json).
LLAMA_3_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
K, N = 4096, 4096  # the hand-computed layer: Linear(4096, 4096)


def _peft_counts(model: nn.Module, config: object) -> tuple[int, int]:
    import peft

    with torch.device("meta"):
        wrapped = peft.get_peft_model(model, config)
    trainable, total = wrapped.get_nb_trainable_parameters()
    return int(trainable), int(total)


def _three_layers() -> nn.Module:
    # a trainable projection, the layer to quantize (frozen), a head (the last module: unquantized)
    return nn.Sequential(nn.Linear(64, K), nn.Linear(K, N, bias=False), nn.Linear(N, 8))


# ---- frozen parameters ---------------------------------------------------------------------
def test_frozen_half_has_no_gradient_and_no_optimizer_state():
    def two_halves() -> nn.Module:
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))

    full = memcalc.estimate(two_halves, batch_size=4, input_shape=(1024,), optimizer="adam")
    half = memcalc.estimate(two_halves, batch_size=4, input_shape=(1024,), optimizer="adam",
                            finetune=FineTune(freeze=("0.*",)))
    per_half = 1024 * 1024 + 1024  # weight + bias of one Linear
    # both peak in the optimizer step, every gradient and both Adam moments alive
    assert full.peak_phase is Phase.OPTIMIZER and half.peak_phase is Phase.OPTIMIZER
    assert half.parameters == full.parameters == 2 * per_half
    assert half.trainable_parameters == per_half
    assert half.bytes.parameters == 4 * 2 * per_half  # fp32, frozen or not
    assert half.bytes.gradients == 4 * per_half  # the trainable half's .grad only
    assert half.bytes.optimizer_state == 2 * 4 * per_half  # exp_avg + exp_avg_sq of the trainable half
    assert full.bytes.gradients == 4 * 2 * per_half
    assert any("frozen by --freeze '0.*': 1,049,600 parameters in 2 tensors" in n for n in half.notes)


def test_freeze_everything_is_refused_as_torch_refuses_it():
    # nothing trains: torch.optim.Adam([]) refuses, and so does backward() without an optimizer
    # (the refusals' own tests: tests/test_hostile_modules.py)
    with pytest.raises(RefusedStepError, match="optimizer got an empty parameter list"):
        memcalc.estimate("mlp", batch_size=8, finetune=FineTune(freeze=("*",)))
    assert memcalc.estimate("mlp", batch_size=8, mode="eval", optimizer="none",
                            finetune=FineTune(freeze=("*",))).parameters == 1_863_690  # a forward only: estimated


def test_freeze_pattern_matching_nothing_names_parameters():
    with pytest.raises(InvalidInputError) as caught:
        memcalc.estimate("llama-tiny", batch_size=1, seq_len=16, finetune=FineTune(freeze=("*.nothing.*",)))
    assert "'*.nothing.*' matches no parameter" in str(caught.value)
    assert "model.embed_tokens.weight" in (caught.value.hint or "")


# ---- LoRA with PEFT ------------------------------------------------------------------------
@pytest.mark.parametrize("quant", [None, "nf4", "int8"])
def test_lora_counts_equal_peft_on_a_hugging_face_llama(tmp_path: Path, quant: str | None):
    # on a quantized base too: PEFT counts a bitsandbytes 4-bit weight as numel × 2 and its
    # statistics not at all, which gives the unquantized model's count
    report = memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=16,
                              finetune=FineTune(lora=LoRA(8), quant=quant))
    import peft
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA))
    trainable, total = _peft_counts(model, peft.LoraConfig(r=8))
    assert (report.trainable_parameters, report.parameters) == (trainable, total)
    # PEFT's default for llama adapts q_proj (64 → 64) and v_proj (64 → 2·16): r·(in + out) each, 2 layers
    assert trainable == 2 * (8 * (64 + 64) + 8 * (64 + 32)) == 3584
    assert any(n.startswith("LoRA r=8 on q_proj, v_proj (PEFT's default for llama): 3,584 trainable of")
               for n in report.notes)


def test_lora_counts_on_zoo_llama_tiny_with_explicit_targets():
    targets = ("q_proj", "v_proj", "down_proj")
    report = memcalc.estimate("llama-tiny", batch_size=1, seq_len=16,
                              finetune=FineTune(lora=LoRA(4, targets=targets)))
    base = resolve("llama-tiny", batch_size=1, seq_len=16).module
    by_hand = sum(4 * (m.in_features + m.out_features) for name, m in base.named_modules()
                  if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    import peft
    trainable, total = _peft_counts(base, peft.LoraConfig(r=4, target_modules=list(targets)))
    assert report.trainable_parameters == trainable == by_hand
    assert report.parameters == total


def test_lora_without_targets_on_a_non_hugging_face_model_lists_its_linear_layers():
    with pytest.raises(InvalidInputError) as caught:
        # the zoo's plain-torch llama-tiny: "llama-tiny" alone is transformers' model, PEFT's default applies
        memcalc.estimate("torch:llama-tiny", batch_size=1, seq_len=16, finetune=FineTune(lora=LoRA(8)))
    assert "PEFT has no default LoRA targets" in str(caught.value)
    assert "--lora-targets" in (caught.value.hint or "") and "q_proj, k_proj, v_proj" in (caught.value.hint or "")


def test_lora_targets_matching_nothing():
    with pytest.raises(InvalidInputError, match="matches no layer"):
        memcalc.estimate("llama-tiny", batch_size=1, seq_len=16, finetune=FineTune(lora=LoRA(8, targets=("qq",))))


def test_lora_without_peft_asks_for_the_hf_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft → ImportError
    with pytest.raises(MissingPackageError) as caught:
        memcalc.estimate("llama-tiny", batch_size=1, seq_len=16, finetune=FineTune(lora=LoRA(8, targets=("q_proj",))))
    assert "pip install 'memcalc[hf]'" in (caught.value.hint or "")


def test_lora_dropout_keeps_a_dropped_copy_and_its_mask():
    def one_layer() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def saved(dropout: float) -> int:
        report = memcalc.estimate(one_layer, batch_size=32, input_shape=(256,),
                                  finetune=FineTune(lora=LoRA(8, dropout=dropout, targets=("0", "2"))))
        assert report.textbook is not None
        return report.textbook.activation_bytes

    # each lora_A reads dropout(x): a float32 copy of its input (32 × 256) kept for lora_A's weight
    # gradient; layer 2's input requires grad (through layer 0's adapter), so CUDA's 1-byte mask is
    # kept too; the model's input does not, and layer 0's dropout keeps no mask
    assert saved(0.1) - saved(0.0) == 32 * 256 * 4 + 32 * 256 * (4 + 1)


def test_lora_adapters_stay_float32_in_a_pure_bf16_model(tmp_path: Path):
    report = memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=16, precision="bf16",
                              finetune=FineTune(lora=LoRA(8)))
    # PEFT's autocast_adapter_dtype keeps the adapters float32: their gradients too, Adam's moments too
    assert report.bytes.optimizer_state == 2 * 4 * 3584
    frozen = report.parameters - 3584
    assert report.bytes.parameters == 2 * frozen + 4 * 3584


# ---- the quantized base: storage -----------------------------------------------------------
def test_4bit_weight_bytes_of_a_4096_square_layer():
    n = K * N  # 16,777,216 weights
    terms = {t.name: t.nbytes for t in layout_4bit(N, K, double_quant=False)}
    assert terms == {
        "weight": n // 2,  # two 4-bit values a byte: 8,388,608 B, stored (n/2, 1) uint8
        "weight_absmax": (n // 64) * 4,  # one float32 absmax per 64-element block: 262,144 × 4 B
        "weight_quant_map": 16 * 4,  # the nf4/fp4 code table, 16 float32
    }
    assert terms["weight"] == 8_388_608 and terms["weight_absmax"] == 1_048_576
    nested = {t.name: t.nbytes for t in layout_4bit(N, K, double_quant=True)}
    assert nested == {
        "weight": 8_388_608,
        "weight_absmax": 262_144,  # the absmax quantized to uint8, one byte per block
        "weight_nested_absmax": 1_024 * 4,  # float32 per 256 absmax: ceil(262,144 / 256) = 1,024
        "weight_nested_quant_map": 256 * 4,  # the dynamic 8-bit code table, 256 float32
        "weight_offset": 4,  # the absmax mean subtracted before quantizing, float32
        "weight_quant_map": 16 * 4,
    }
    assert layout_4bit(3, 7, double_quant=False)[0].shape == (11, 1)  # (21 + 1) // 2: an odd count rounds up


def test_int8_weight_bytes_of_a_4096_square_layer():
    terms = {t.name: t.nbytes for t in layout_int8(N, K)}
    assert terms == {"weight": K * N, "SCB": N * 4}  # int8 CB, one float32 scale per output row


@pytest.mark.parametrize("quant, double, layer_bytes", [
    ("nf4", False, 8_388_608 + 1_048_576 + 64),
    ("fp4", True, 8_388_608 + 262_144 + 4_096 + 1_024 + 4 + 64),
    ("int8", False, 16_777_216 + 16_384),
])
def test_quantized_parameter_bytes_in_an_estimate(quant: str, double: bool, layer_bytes: int):
    finetune = FineTune(freeze=("1.*",), quant=quant, double_quant=double)
    report = memcalc.estimate(_three_layers, batch_size=2, input_shape=(8, 64), precision="amp-bf16",
                              finetune=finetune)
    others = 4 * (64 * K + K) + 4 * (N * 8 + 8)  # the trainable projection and the head, float32
    assert report.bytes.parameters == others + layer_bytes
    assert report.parameters == 64 * K + K + K * N + N * 8 + 8  # the quantized weight counts its 16.8M
    fp16 = memcalc.estimate(_three_layers, batch_size=2, input_shape=(8, 64), precision="fp16",
                            finetune=FineTune(freeze=("1.*",)))
    assert report.bytes.parameters - others < fp16.bytes.parameters / 2


def test_lm_head_and_embeddings_stay_unquantized_as_transformers_leaves_them(tmp_path: Path):
    import transformers
    from transformers.quantizers.base import get_keys_to_not_convert

    for tied in (False, True):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL_LLAMA,
                                                                               "tie_word_embeddings": tied}))
        assert modules_to_not_convert(model) == sorted(get_keys_to_not_convert(model))
    report = memcalc.estimate(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=16,
                              finetune=FineTune(lora=LoRA(8), quant="nf4"))
    note = next(n for n in report.notes if n.startswith("nf4 weights"))
    assert "for 14 Linear layers" in note  # 2 layers × (q, k, v, o, gate, up, down)
    assert "embeddings and lm_head unquantized" in note


def test_quant_in_training_quantizes_frozen_layers_only():
    with pytest.raises(InvalidInputError, match="found no Linear layer to quantize"):
        memcalc.estimate(_three_layers, batch_size=2, input_shape=(8, 64), finetune=FineTune(quant="nf4"))
    report = memcalc.estimate(_three_layers, batch_size=2, input_shape=(8, 64), mode="eval", optimizer="none",
                              finetune=FineTune(quant="nf4"))  # eval: every eligible layer
    # all three: the last parameter is the head's bias, and transformers' key "2.bias" names no module
    assert any(n.startswith("nf4 weights: ") and "for 3 Linear layers" in n for n in report.notes)


def test_quant_statistics_stay_float32_in_a_pure_bf16_model():
    report = memcalc.estimate(_three_layers, batch_size=2, input_shape=(8, 64), precision="bf16",
                              finetune=FineTune(freeze=("1.*",), quant="nf4"))
    others = 2 * (64 * K + K) + 2 * (N * 8 + 8)
    assert report.bytes.parameters == others + 8_388_608 + 1_048_576 + 64


# ---- QLoRA's preparation (memcalc.stacks.kbit; checked against the real one in tests/hf_reference) ----
def test_qlora_on_a_hugging_face_model_runs_prepare_model_for_kbit_training(tmp_path: Path):
    source = hf_config_source(tmp_path, SMALL_LLAMA)
    kwargs = dict(batch_size=1, seq_len=16, optimizer="adamw", finetune=FineTune(lora=LoRA(8), quant="nf4"))
    loaded_bf16 = memcalc.estimate(source, precision="bf16", **kwargs)
    loaded_fp32 = memcalc.estimate(source, precision="amp-bf16", **kwargs)
    # PEFT casts every bf16 parameter left unquantized to float32: embeddings and LM head (1000 × 64 each),
    # 2 × 2 layer norms and the final norm (64 each): 128,320 values, 250.62 KiB in bf16
    unquantized = 2 * 1000 * 64 + 5 * 64
    note = next(n for n in loaded_bf16.notes if n.startswith("prepare_model_for_kbit_training"))
    assert "7 parameter tensors left unquantized cast from bf16 to float32 (250.62 KiB → 501.25 KiB)" in note
    assert "the step runs as amp-bf16" in note and "add --checkpoint" in note
    # then a bf16 load is a float32 one, and Trainer's bf16=True is autocast over it
    assert loaded_bf16.precision is Precision.AMP_BF16
    assert loaded_bf16.bytes.parameters == loaded_fp32.bytes.parameters
    assert loaded_bf16.bytes.peak_allocated == loaded_fp32.bytes.peak_allocated
    # (out, in) of each layer's q, k, v, o (2 key-value heads of 16), gate, up, down; adapters on q and v, r=8
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]
    quantized = 2 * sum(t.nbytes for out, inp in shapes for t in layout_4bit(out, inp, double_quant=False))
    adapters = 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    assert loaded_bf16.bytes.parameters == 4 * unquantized + quantized + 4 * adapters
    plain_lora = memcalc.estimate(source, precision="bf16", **(kwargs | dict(finetune=FineTune(lora=LoRA(8)))))
    assert plain_lora.precision is Precision.BF16  # no quantized base: nothing to prepare


def test_qlora_on_a_plain_torch_model_is_not_prepared():
    # prepare_model_for_kbit_training "only works for transformers models": the zoo's Llama keeps its bf16
    finetune = FineTune(lora=LoRA(8, targets=("q_proj", "v_proj")), quant="nf4")
    report = memcalc.estimate("torch:llama-tiny", batch_size=1, seq_len=16, precision="bf16", finetune=finetune)
    assert report.precision is Precision.BF16
    assert not any(n.startswith("prepare_model_for_kbit_training") for n in report.notes)


def test_qlora_with_checkpointing_makes_the_input_embeddings_require_grad(tmp_path: Path):
    from memcalc.core.categories import Mode
    from memcalc.core.precision import Precision
    from memcalc.stacks.peft import apply_finetune

    resolved = resolve(hf_config_source(tmp_path, SMALL_LLAMA), batch_size=1, seq_len=16)
    module = apply_finetune(resolved, FineTune(lora=LoRA(8), quant="nf4"), precision=Precision.BF16,
                            mode=Mode.TRAIN, checkpoint=True).module
    embeddings = module.get_input_embeddings()
    assert embeddings.weight.dtype is torch.float32 and not embeddings.weight.requires_grad
    out = embeddings(torch.zeros(1, 4, dtype=torch.long, device="meta"))
    assert out.requires_grad  # transformers' enable_input_require_grads hook, as PEFT installs it


# ---- the quantized base: the step ----------------------------------------------------------
def _trace(finetune: FineTune, precision: str) -> TracedStep:
    # input (2, 1024, 64): 2,048 rows reach the quantized layer, past gemm_4bit's fused-kernel range
    step = build_step(_three_layers, batch_size=2, input_shape=(1024, 64), precision=precision, finetune=finetune)
    traced: list[TracedStep] = []
    run_estimate(step, on_trace=traced.append)
    return traced[0]


def _born(traced: TracedStep, phase: Phase, module: str = "1") -> list[tuple[int, str]]:
    trace = traced.trace
    return [(trace.nbytes[u], trace.op[u]) for u in range(trace.num_storages)
            if trace.phase[u] is phase and trace.module[u] == module and trace.op[u]]


@pytest.mark.parametrize("precision, itemsize", [("amp-bf16", 2), ("fp32", 4)])
def test_4bit_weight_is_dequantized_in_forward_and_backward(precision: str, itemsize: int):
    finetune = FineTune(freeze=("1.*",), quant="nf4", double_quant=True)
    traced = _trace(finetune, precision)
    dequantized = K * N * itemsize  # the whole weight in the compute dtype
    absmax = K * N // 64 * 4  # the nested absmax rebuilt in float32, one per 64-element block
    forward = [nbytes for nbytes, _ in _born(traced, Phase.FORWARD)]
    backward = [nbytes for nbytes, _ in _born(traced, Phase.BACKWARD)]
    # forward: _dequant_linear_fallback rebuilds the absmax (empty_like, then + offset: two float32
    # copies), dequantizes, and F.linear writes the output (2 × 1024 rows × N)
    assert sorted(forward) == sorted([absmax, absmax, dequantized, 2 * 1024 * N * itemsize])
    # backward: dequantize_4bit rebuilds the absmax once and dequantizes again; the matmul gives
    # grad_input (2 × 1024 rows × K)
    assert sorted(backward) == sorted([absmax, dequantized, 2 * 1024 * K * itemsize])
    report = memcalc.estimate(_three_layers, batch_size=2, input_shape=(1024, 64), precision=precision,
                              finetune=finetune)
    assert report.bytes.peak_allocated >= report.bytes.parameters + K * N * itemsize


def test_4bit_without_double_quant_rebuilds_no_absmax():
    traced = _trace(FineTune(freeze=("1.*",), quant="nf4"), "amp-bf16")
    float32_absmax = K * N // 64 * 4
    assert all(nbytes != float32_absmax for nbytes, _ in _born(traced, Phase.FORWARD) + _born(traced, Phase.BACKWARD))


def test_int8_step_allocates_what_matmul8bitlt_does():
    traced = _trace(FineTune(freeze=("1.*",), quant="int8"), "amp-bf16")
    m = 2 * 1024  # rows: the input reshaped to 2-D; it arrives in bfloat16 (the autocast output of layer 0)
    forward = sorted(_born(traced, Phase.FORWARD))
    assert forward == sorted([
        (m * K * 2, "aten._to_copy.default"),  # A.to(torch.float16)
        (m * 4, "aten.empty.memory_format"),  # row_stats: float32 per row
        (m * K, "aten.empty.memory_format"),  # out_row: the int8 input
        (m * K * 2, "aten.abs.default"),  # A.abs() >= 6.0 (llm_int8_threshold): the outlier test
        (m * K, "aten.ge.Scalar"),
        (1, "aten.any.default"),
        (m * N * 4, "aten.empty.memory_format"),  # int8_linear_matmul's int32 result
        (m * N * 2, "aten.empty.memory_format"),  # int8_mm_dequant's float16 result
        (m * N * 2, "aten._to_copy.default"),  # .to(A.dtype): bfloat16
        (0, "aten.new_empty.default"),  # subA without outlier columns
    ])
    backward = _born(traced, Phase.BACKWARD)
    assert (K * N * 2, "aten._to_copy.default") in backward  # CB.to(dtype_A, copy=True): the weight in bf16
    assert (N * 4, "aten.mul.Tensor") in backward  # SCB.unsqueeze(1).mul(1 / 127)


# ---- where it applies ----------------------------------------------------------------------
def test_ddp_refuses_a_model_that_trains_nothing():
    # as DistributedDataParallel itself does; what else stays refused under a strategy, and the
    # agreement with real DDP / fully_shard runs, is tests/test_strategies_finetune.py's
    with pytest.raises(InapplicableOptionError, match="none of whose parameters requires a gradient"):
        memcalc.estimate("mlp", batch_size=8, distributed=memcalc.Distributed("ddp", world_size=2),
                         finetune=FineTune(freeze=("*",)))


def test_cli_shows_trainable_parameters_as_peft_does(tmp_path: Path):
    model = hf_config_source(tmp_path, SMALL_LLAMA)
    result = CliRunner().invoke(main, [model, "--lora", "8", "--seq-len", "16", "--batch", "1"])
    assert result.exit_code == 0, result.output
    report = memcalc.estimate(model, batch_size=1, seq_len=16, finetune=FineTune(lora=LoRA(8)))
    share = 100 * 3584 / report.parameters
    assert f"trainable parameters: 3,584 of {report.parameters:,} ({share:.4f}%)" in result.output
    data = json.loads(CliRunner().invoke(main, [model, "--lora", "8", "--seq-len", "16", "--batch", "1",
                                                "--format", "json"]).output)
    assert data["trainable_parameters"] == 3584


def test_cli_refuses_to_measure_a_quantized_base():
    result = CliRunner().invoke(main, ["llama-tiny", "--lora", "8", "--lora-targets", "q_proj", "--quant", "nf4",
                                       "--measure"])
    assert result.exit_code == 2
    assert "--measure cannot run --quant nf4" in result.output and "bitsandbytes" in result.output


def test_quant_enum_values_match_the_cli():
    assert [q.value for q in Quant] == ["nf4", "fp4", "int8"]


_CHILD = textwrap.dedent("""
    import resource, subprocess, sys, time
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memcalc", *sys.argv[1:]], capture_output=True, text=True)
    wall = time.perf_counter() - start
    print(done.returncode, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    sys.stderr.write(done.stdout + done.stderr)
""")


@pytest.mark.slow  # a Llama-3-8B-sized model: about 5 s
def test_qlora_on_an_8b_llama_answers_in_small_memory(tmp_path: Path):
    args = [hf_config_source(tmp_path, LLAMA_3_8B), "--lora", "16", "--quant", "nf4", "--double-quant",
            "--precision", "amp-bf16", "--seq-len", "2048", "--batch", "4"]
    # Its speed (the "under 5 s") is benchmarks/finetune_speed.py's business, not a test's.
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=300)
    code, _wall, rss = out.stdout.split()
    assert code == "0", out.stderr
    assert int(rss) < 1.5 * 2**30, f"peak RSS {int(rss) / 2**30:.2f} GiB"  # the command's own process
    assert "LoRA r=16 on q_proj, v_proj (PEFT's default for llama): 6,815,744 trainable of 8,037,076,992" in out.stderr
    assert "for 224 Linear layers" in out.stderr  # 32 layers × 7 projections; lm_head left alone

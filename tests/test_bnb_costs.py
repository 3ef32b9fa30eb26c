"""Step-time costs of the bitsandbytes kernels memcalc emulates (memcalc.stacks.bitsandbytes.quantized_base's
dequantization and int8 matmul, memcalc.stacks.bitsandbytes.adamw's update kernels): the bytes each
kernel moves, worked out by hand, against what ``memcalc.step_time`` counts per op class and phase.

A quantized layer is compared with the same layer unquantized: what the two steps share (the
matmul on the dequantized weight reads as many bytes as on the bf16 weight) cancels, and the
difference is the dequantization kernels alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memcalc
from memcalc import FineTune, LoRA
from memcalc.core.checkpointing import Checkpointing, CheckpointKind
from memcalc.core.report import MemoryReport
from memcalc.core.throughput import ClassTime, OpClass, StepTime
from memcalc.engine.kernel_ops import KERNEL_COSTS, KernelCost
from memcalc.engine.rules import DuplicateRuleError
from memcalc.stacks.bitsandbytes.adamw import UPDATE_KERNELS
from memcalc.stacks.bitsandbytes.quantized_base import KERNELS
from memcalc.timing.performance import EFFICIENCY, KERNEL_SECONDS, LAUNCH_OVERHEAD, PERFORMANCE

GPU = "a100-80gb"
N = 4096 * 4096  # elements of the weight: 16,777,216
PACKED = N // 2  # nf4: two 4-bit values a byte (uint8 ((n + 1) // 2, 1))
BLOCKS = N // 64  # one absmax per block of 64 (quantize_4bit's default blocksize): 262,144
NESTED_BLOCKS = BLOCKS // 256  # double quantization: one float32 absmax per 256 absmax: 1,024
BF16 = 2


def _two_layers() -> nn.Module:
    # transformers leaves the module of the last parameter unquantized (get_keys_to_not_convert,
    # "1.weight" → "1"; a last bias would not match): the head stays, the 4096 × 4096 layer is quantized
    return nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 16, bias=False))


def _inference(batch: int, quant: str | None = None, double_quant: bool = False) -> StepTime:
    finetune = FineTune(quant=quant, double_quant=double_quant) if quant else None
    report = memcalc.estimate(_two_layers, batch_size=batch, input_shape=(4096,), mode="inference",
                              precision="bf16", gpu=GPU, finetune=finetune)
    # GPU-bound (no host floor): a step of two layers is host-bound, which would stretch the by-hand kernel times
    return memcalc.step_time(report, host_seconds=0.0)


def _of(time: StepTime, op_class: OpClass) -> ClassTime:
    """The step's kernels of ``op_class`` (none: zero kernels, FLOPs, bytes and seconds)."""
    return next((c for c in time.classes if c.op_class is op_class),
                ClassTime(op_class, 0, 0, 0, 0.0, 0.0, EFFICIENCY[op_class]))


def _memory_seconds(nbytes: int) -> float:
    """The roofline's time of memory-bound kernels moving ``nbytes`` on the A100 80GB."""
    return nbytes / (PERFORMANCE[GPU].bandwidth * EFFICIENCY[OpClass.MEMORY])


# ============================================================================================
# 4-bit: dequantize, then the matmul (8 rows > 4: _dequant_linear_fallback)
# ============================================================================================


def test_nf4_dequantization_bytes_by_hand() -> None:
    plain, nf4 = _inference(8), _inference(8, "nf4")
    # kDequantizeBlockwise<bf16, ..., NF4>: reads the packed weight (8,388,608 B) and the float32
    # absmax (262,144 × 4 = 1,048,576 B), writes the bf16 weight (33,554,432 B)
    dequantize = PACKED + BLOCKS * 4 + N * BF16
    assert dequantize == 42_991_616
    memory, memory_plain = _of(nf4, OpClass.MEMORY), _of(plain, OpClass.MEMORY)
    assert memory.bytes_moved - memory_plain.bytes_moved == dequantize
    assert memory.kernels - memory_plain.kernels == 1
    # F.linear on the dequantized weight moves what it moves on the bf16 weight
    assert _of(nf4, OpClass.MATMUL) == _of(plain, OpClass.MATMUL)
    assert nf4.phase_seconds("forward") - plain.phase_seconds("forward") == pytest.approx(
        _memory_seconds(dequantize) + KERNEL_SECONDS[OpClass.MEMORY] + LAUNCH_OVERHEAD)


def test_nf4_double_quant_dequantization_bytes_by_hand() -> None:
    plain, nf4 = _inference(8), _inference(8, "nf4", double_quant=True)
    # three kernels (_dequant_linear_fallback):
    # kDequantizeBlockwise<float, ..., General8bit>: reads the uint8 absmax (262,144 B), the nested
    # float32 absmax (1,024 × 4 B) and the 256-entry float32 code (1,024 B), writes the float32 absmax
    nested = BLOCKS + NESTED_BLOCKS * 4 + 256 * 4 + BLOCKS * 4
    # absmax_dq + absmax_offset: reads the float32 absmax and the scalar offset, writes a new one
    offset = BLOCKS * 4 + 4 + BLOCKS * 4
    # kDequantizeBlockwise<bf16, ..., NF4>: the packed weight and the float32 absmax → the bf16 weight
    dequantize = PACKED + BLOCKS * 4 + N * BF16
    assert (nested, offset, dequantize) == (1_315_840, 2_097_156, 42_991_616)
    memory, memory_plain = _of(nf4, OpClass.MEMORY), _of(plain, OpClass.MEMORY)
    assert memory.bytes_moved - memory_plain.bytes_moved == nested + offset + dequantize == 46_404_612
    assert memory.kernels - memory_plain.kernels == 3
    assert _of(nf4, OpClass.MATMUL) == _of(plain, OpClass.MATMUL)


def test_nf4_fused_gemm_reads_the_packed_weight() -> None:
    # 2 rows ≤ 4: the fused cgemm_4bit kernel, same FLOPs as the bf16 matmul; it reads the packed
    # weight and the absmax where the bf16 matmul reads the 2-byte weight, and dequantizes nothing
    plain, nf4 = _inference(2), _inference(2, "nf4")
    matmul, matmul_plain = _of(nf4, OpClass.MATMUL), _of(plain, OpClass.MATMUL)
    assert matmul.flops == matmul_plain.flops == 2 * 2 * N + 2 * 2 * 4096 * 16  # the head's GEMM too
    assert matmul.kernels == matmul_plain.kernels
    assert matmul.bytes_moved - matmul_plain.bytes_moved == PACKED + BLOCKS * 4 - N * BF16 == -24_117_248
    assert _of(nf4, OpClass.MEMORY) == _of(plain, OpClass.MEMORY)


def test_int8_gemm_is_timed_by_its_bytes_and_its_flops_reported_uncounted() -> None:
    plain, int8 = _inference(8), _inference(8, "int8")
    # cuBLASLt's int8 GEMM reads the int8 input (8 × 4096) and weight (n), writes int32 (8 × 4096 × 4);
    # the bf16 linear it replaces read the input, the weight and the bias, and wrote bf16
    int8_gemm = 8 * 4096 + N + 8 * 4096 * 4
    bf16_linear = 8 * 4096 * BF16 + N * BF16 + 4096 * BF16 + 8 * 4096 * BF16
    matmul, matmul_plain = _of(int8, OpClass.MATMUL), _of(plain, OpClass.MATMUL)
    assert matmul.bytes_moved - matmul_plain.bytes_moved == int8_gemm - bf16_linear == -16_752_640
    assert matmul_plain.flops - matmul.flops == 2 * 8 * N  # no int8 peak: uncounted, not guessed
    assert int8.flops.uncounted == (("int8_linear_matmul.out", 1),)


# ============================================================================================
# The optimizer: one kernel per parameter
# ============================================================================================


def _optimizer_phase(optimizer: str) -> tuple[int, int]:
    report = memcalc.estimate(lambda: nn.Linear(4096, 4096, bias=False), batch_size=2, input_shape=(4096,),
                              optimizer=optimizer, loss="mean", gpu=GPU)
    phase = next(p for p in memcalc.step_time(report).phases if p.phase == "optimizer")
    return phase.kernels, phase.bytes_moved


def test_8bit_adamw_step_bytes_by_hand() -> None:
    # kOptimizerStatic8bit2StateBlockwise on a float32 (4096, 4096) parameter: reads g and p
    # (4n each), the uint8 state1 and state2 (n each), absmax1 and absmax2 (ceil(n / 256) = 65,536
    # float32 each) and the two 256-entry float32 qmaps; writes p, both states and both absmax
    absmax = (N // 256) * 4
    read = 4 * N + 4 * N + N + N + 2 * absmax + 2 * 256 * 4
    written = 4 * N + N + N + 2 * absmax
    assert read + written == 269_486_080
    assert _optimizer_phase("adamw-8bit") == (1, read + written)


def test_32bit_paged_adamw_step_bytes_by_hand() -> None:
    # kOptimizer32bit2State: reads g, p and the float32 state1, state2 (4n each), writes p and both
    # states (paged or not, the kernel moves the same bytes)
    assert _optimizer_phase("paged-adamw-32bit") == (1, 4 * N * 4 + 4 * N * 3)


# ============================================================================================
# The whole step and the registry
# ============================================================================================


def _tiny(quant: str | None) -> MemoryReport:
    # the zoo's plain-torch llama-tiny, trained with memcalc's loss (its own phase, counted below)
    return memcalc.estimate("torch:llama-tiny", batch_size=4, seq_len=512, precision="bf16", gpu=GPU,
                            finetune=FineTune(lora=LoRA(8, targets=("q_proj", "v_proj", "gate_proj")), quant=quant))


@pytest.mark.slow  # two timed estimates of llama-tiny at 512 tokens, LoRA and QLoRA
def test_qlora_step_is_slower_than_lora() -> None:
    lora, qlora = _tiny(None), _tiny("nf4")
    assert qlora.peak_requested < lora.peak_requested  # the quantized base is smaller...
    lora_time, qlora_time = (memcalc.step_time(r, host_seconds=0.0) for r in (lora, qlora))  # GPU-bound
    assert qlora_time.seconds > lora_time.seconds  # ...and dequantizing it takes time
    # one dequantization per quantized layer in forward, and one in backward for each layer whose
    # input needs a gradient (MatMul4Bit.backward: needs_input_grad[0]): all but the first block's
    # q_proj, k_proj, v_proj, whose input comes from the frozen embedding through a frozen norm
    layers = int(next(n for n in qlora.notes if n.startswith("nf4 weights")).split(" for ")[1].split()[0])
    assert layers == 56  # 8 blocks × 7 Linear layers; embeddings and lm_head stay
    extra = {p.phase: p.kernels for p in qlora_time.phases}
    for p in lora_time.phases:
        extra[p.phase] -= p.kernels
    assert extra == {"forward": layers, "loss": 0, "backward": layers - 3, "optimizer": 0}
    assert _of(qlora_time, OpClass.MATMUL) == _of(lora_time, OpClass.MATMUL)


@pytest.mark.parametrize("schema", [*KERNELS, *UPDATE_KERNELS])
def test_every_emulated_kernel_has_a_cost_rule(schema: str) -> None:
    name, _, overload = schema.split("(", 1)[0].partition(".")
    op = getattr(getattr(torch.ops.memcalc, name), overload or "default")
    assert op in KERNEL_COSTS


def test_a_second_cost_rule_for_a_kernel_is_refused() -> None:
    def again(args: tuple[object, ...], kwargs: dict[str, object], out: object) -> KernelCost:
        return KernelCost(OpClass.MEMORY, 0, 0)

    with pytest.raises(DuplicateRuleError, match="dequantize_4bit"):
        KERNEL_COSTS.register(torch.ops.memcalc.dequantize_4bit.out)(again)


@pytest.mark.slow  # two timed, checkpointed estimates, LoRA and QLoRA
def test_recomputation_inside_quantized_layers_is_booked_as_recompute() -> None:
    # Checkpointing recomputes each block's forward in backward under enable_grad, but
    # MatMul4Bit.forward (an autograd Function) runs with grad mode off: its F.linear on the
    # dequantized weight must still count as recomputation, not backward. The base's FLOPs are the
    # same quantized or not, so every phase's FLOPs must be too. Both reentrant: the kind QLoRA's own
    # loop takes from prepare_model_for_kbit_training with peft 0.21 (tests/test_kbit_reentrant.py), which recomputes
    # the whole block where the non-reentrant checkpoint stops early.
    reentrant = Checkpointing(CheckpointKind.FULL, reentrant=True)

    def flops(quant: str | None) -> dict[str, int]:
        report = memcalc.estimate("llama-tiny", batch_size=1, seq_len=128, precision="bf16", gpu=GPU,
                                  checkpoint=reentrant,
                                  finetune=FineTune(lora=LoRA(8, targets=("q_proj", "v_proj")), quant=quant),
                                  time=True)
        assert report.time is not None
        return {p.phase: p.flops for p in report.time.flops.phases}

    plain, nf4 = flops(None), flops("nf4")
    assert nf4 == plain
    # the recomputation is the forward of the checkpointed blocks: all of the forward but the head's
    # GEMM (2 × 128 tokens × hidden × vocab), which is outside the blocks
    assert 0 < plain["recompute"] < plain["forward"]

"""A quantized base (QLoRA): the frozen ``nn.Linear`` weights stored as bitsandbytes stores
them, emulated on meta tensors without importing bitsandbytes.

Why emulate: bitsandbytes needs a GPU; memcalc needs only what it allocates, and when.
Transcribed from bitsandbytes 0.50.1, and transformers 5's choice of layers.

- Storage (:func:`layout_4bit`, :func:`layout_int8`): 4-bit packs two values a byte, plus one
  float32 absmax per block of 64 and a 16-entry code table; double quantization stores the
  absmax as uint8 with a nested state; 8-bit keeps an int8 weight and one float32 scale per row.
  Each buffer is a separate CUDA allocation, so each is its own frozen parameter here, carrying
  :data:`~memcalc.engine.run.LOGICAL_NUMEL` and :data:`~memcalc.engine.prepare.KEEP_DTYPE`.
- The step (:class:`_MatMul4Bit`, :class:`_MatMul8bitLt`): the weight dequantized whole in the
  forward (beyond the fused kernel's few rows; memcalc assumes the fallback, the larger memory)
  and again in the backward; no weight gradient, the base is frozen.
- Which layers (:func:`modules_to_not_convert`): exactly ``nn.Linear`` (or GPT-2's ``Conv1D``)
  but transformers' ``get_keys_to_not_convert`` (the LM head) and ``_keep_in_fp32_modules``.
- The kernels (:data:`KERNELS`): ``memcalc::`` operators with bitsandbytes' schemas, whose meta
  kernels allocate nothing; :data:`memcalc.engine.kernel_ops.KERNEL_COSTS` gives their bytes.

The emulated module subclasses ``nn.Linear``, so that PEFT's default LoRA dispatch wraps it.

The sources buffer by buffer and kernel by kernel, and what is not modelled (int8 outlier
columns, PEFT's ``lora.bnb`` clone): docs/notes/bitsandbytes-quantized-base.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from memcalc.core.errors import InvalidInputError
from memcalc.core.finetune import Quant
from memcalc.core.throughput import OpClass
from memcalc.core.units import format_bytes
from memcalc.engine.kernel_ops import KERNEL_COSTS, KernelCost, define_kernels, device_bytes
from memcalc.engine.prepare import KEEP_DTYPE
from memcalc.engine.run import LOGICAL_NUMEL

__all__ = (
    "BLOCKSIZE",
    "INT8_THRESHOLD",
    "KERNELS",
    "NESTED_BLOCKSIZE",
    "QuantSummary",
    "QuantizedLinear",
    "StorageTerm",
    "layout_4bit",
    "layout_int8",
    "modules_to_not_convert",
    "quantize_linears",
)

#: The bitsandbytes release transcribed.
BNB_VERSION = "0.50.1"
#: Elements per absmax block of a 4-bit weight (``quantize_4bit`` / ``Params4bit``: None → 64).
BLOCKSIZE = 64
#: Elements per block when the absmax is quantized again (``quantize_4bit``, ``compress_statistics``).
NESTED_BLOCKSIZE = 256
#: Entries of the nf4/fp4 code table (``get_4bit_type``), float32.
CODE_4BIT_ENTRIES = 16
#: Entries of the dynamic 8-bit code table of the nested state (``create_dynamic_map``), float32.
DYNAMIC_CODE_ENTRIES = 256
#: transformers' ``BitsAndBytesConfig(llm_int8_threshold=6.0)``: LLM.int8()'s outlier threshold.
INT8_THRESHOLD = 6.0
#: ``gemm_4bit`` runs its fused kernel up to this many rows (``_GEMM_4BIT_CUSTOM_FLOOR_M``).
GEMM_4BIT_FUSED_MAX_M = 4
#: ... and dequantizes from this many rows on (``_gemm_4bit_custom_max_m`` on CUDA); between: see the docstring.
GEMM_4BIT_FALLBACK_FROM_M = 1536 + 1


# ---- bitsandbytes' kernels as operators ---------------------------------------------------
#: The ``memcalc::`` operators standing for bitsandbytes' CUDA kernels (module docstring). Their
#: schemas: bitsandbytes 0.50.1's (``bitsandbytes/_ops.py``), as ``.out`` overloads where
#: bitsandbytes' op allocates its output itself (gemm_4bit, int8_vectorwise_quant, int8_mm_dequant),
#: no defaults (the rules read the arguments by position).
KERNELS = (
    "dequantize_blockwise.out(Tensor A, Tensor absmax, Tensor code, int blocksize, ScalarType dtype, "
    "Tensor(a!) out) -> ()",
    "dequantize_4bit.out(Tensor A, Tensor absmax, int blocksize, str quant_type, int[] shape, ScalarType dtype, "
    "Tensor(a!) out) -> ()",
    "gemm_4bit.out(Tensor A, Tensor B, int[] shapeB, Tensor absmax, int blocksize, str quant_type, Tensor? bias, "
    "Tensor? absmax_8bit, Tensor? absmax_code, Tensor? absmax_offset, Tensor(a!) out) -> ()",
    "int8_vectorwise_quant.out(Tensor A, float threshold, Tensor(a!) out_row, Tensor(b!) row_stats) -> ()",
    "int8_linear_matmul.out(Tensor A, Tensor B, Tensor(a!) out) -> ()",
    "int8_mm_dequant.out(Tensor A, Tensor row_stats, Tensor col_stats, Tensor? bias, Tensor(a!) out) -> ()",
)


_ops = define_kernels(KERNELS)


@KERNEL_COSTS.register(_ops.dequantize_blockwise.out)
def _dequantize_blockwise_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """``kDequantizeBlockwise<float, 512, 64, 8, General8bit>`` (csrc/kernels.cu; double
    quantization's absmax): each byte of ``A`` is looked up in ``code``
    (``__ldg(&code[qvals[j]])``) and scaled by its block's ``absmax``, stored to ``out``."""
    A, absmax, code, _blocksize, _dtype, out = args
    return KernelCost(OpClass.MEMORY, device_bytes(A, absmax, code), device_bytes(out))


@KERNEL_COSTS.register(_ops.dequantize_4bit.out)
def _dequantize_4bit_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """``kDequantizeBlockwise<T, 512, 64, 8, NF4|FP4>`` (csrc/kernels.cu, ``dequantize_4bit``):
    reads the packed weight and the float32 absmax, writes the weight in ``dtype``. The 16-entry
    code is not read: ``dDequantizeNF4`` / ``dDequantizeFP4Tree`` hold it in registers, and
    ``_dequantize_4bit_impl`` passes ``None`` for it."""
    A, absmax, _blocksize, _quant_type, _shape, _dtype, out = args
    return KernelCost(OpClass.MEMORY, device_bytes(A, absmax), device_bytes(out))


@KERNEL_COSTS.register(_ops.gemm_4bit.out)
def _gemm_4bit_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """The fused ``cgemm_4bit_*`` kernel (``_gemm_4bit_kernel_impl``, csrc/gemm_4bit.cu): each
    output element a dot product over ``K`` of the input and the weight dequantized in registers;
    reads the input, the packed weight, its statistics and the bias, writes the output."""
    A, B, shapeB, absmax, _blocksize, _quant_type, bias, absmax_8bit, absmax_code, absmax_offset, out = args
    rows = A.numel() // A.shape[-1]
    return KernelCost(OpClass.MATMUL, device_bytes(A, B, absmax, bias, absmax_8bit, absmax_code, absmax_offset),
                      device_bytes(out), flops=2 * rows * shapeB[0] * shapeB[1], dtype=A.dtype)


@KERNEL_COSTS.register(_ops.int8_vectorwise_quant.out)
def _int8_vectorwise_quant_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """``kInt8VectorQuant<half, 1024, ...>`` (csrc/kernels.cu): reads the float16 input, writes
    its int8 copy and one float32 scale per row."""
    A, _threshold, out_row, row_stats = args
    return KernelCost(OpClass.MEMORY, device_bytes(A), device_bytes(out_row, row_stats))


@KERNEL_COSTS.register(_ops.int8_linear_matmul.out)
def _int8_linear_matmul_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """cuBLASLt's int8 GEMM (``cigemmlt_32``, ``_int8_linear_matmul_impl``): reads both int8
    operands, writes the int32 product. Its FLOPs are uncounted: the roofline knows no int8
    tensor-core peak, so it is timed by its bytes."""
    A, B, out = args
    return KernelCost(OpClass.MATMUL, device_bytes(A, B), device_bytes(out), uncounted=True)


@KERNEL_COSTS.register(_ops.int8_mm_dequant.out)
def _int8_mm_dequant_cost(args: tuple[Any, ...], _kwargs: dict[str, Any], _out: Any) -> KernelCost:
    """``kdequant_mm_int32_fp16`` (csrc/kernels.cu): reads the int32 product, the row and column
    scales and a float16 bias (the only one it fuses), writes the float16 result."""
    A, row_stats, col_stats, bias, out = args
    return KernelCost(OpClass.MEMORY, device_bytes(A, row_stats, col_stats, bias), device_bytes(out))


@dataclass(frozen=True)
class StorageTerm:
    """One buffer bitsandbytes allocates for a quantized weight."""

    name: str  # the parameter's name in the emulated module (bnb's state-dict key, "." → "_")
    shape: tuple[int, ...]
    dtype: torch.dtype
    logical: int = 0  # parameters it stands for (the weight's n; statistics 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (before the allocator's rounding)."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def layout_4bit(out_features: int, in_features: int, *, double_quant: bool) -> tuple[StorageTerm, ...]:
    """The buffers of one 4-bit ``Linear(in_features, out_features)`` (module docstring)."""
    n = out_features * in_features
    blocks = -(n // -BLOCKSIZE)
    terms = [StorageTerm("weight", ((n + 1) // 2, 1), torch.uint8, logical=n)]
    if double_quant:
        terms += [
            StorageTerm("weight_absmax", (blocks,), torch.uint8),
            StorageTerm("weight_nested_absmax", (-(blocks // -NESTED_BLOCKSIZE),), torch.float32),
            StorageTerm("weight_nested_quant_map", (DYNAMIC_CODE_ENTRIES,), torch.float32),
            StorageTerm("weight_offset", (), torch.float32),
        ]
    else:
        terms.append(StorageTerm("weight_absmax", (blocks,), torch.float32))
    terms.append(StorageTerm("weight_quant_map", (CODE_4BIT_ENTRIES,), torch.float32))
    return tuple(terms)


def layout_int8(out_features: int, in_features: int) -> tuple[StorageTerm, ...]:
    """The buffers of one int8 ``Linear(in_features, out_features)``: ``CB`` and ``SCB``."""
    return (StorageTerm("weight", (out_features, in_features), torch.int8, logical=out_features * in_features),
            StorageTerm("SCB", (out_features,), torch.float32))


class QuantizedLinear(nn.Linear):
    """A frozen ``Linear`` whose weight is stored as bitsandbytes stores it, on meta.

    An ``nn.Linear`` to PEFT (module docstring) without nn.Linear's float weight: ``weight`` is
    the packed data (4-bit: uint8 ``(n/2, 1)``, as ``Linear4bit.weight``; int8: ``(out, in)``),
    and the quantization statistics are frozen parameters beside it.
    """

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None, quant: Quant, *,
                 double_quant: bool, compute_dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)  # not nn.Linear's: it would make a float weight
        self.in_features = in_features
        self.out_features = out_features
        self.quant = quant
        self.double_quant = double_quant
        self.compute_dtype = compute_dtype
        self.layout = (layout_int8(out_features, in_features) if quant is Quant.INT8
                       else layout_4bit(out_features, in_features, double_quant=double_quant))
        for term in self.layout:
            param = nn.Parameter(torch.empty(term.shape, dtype=term.dtype, device=device), requires_grad=False)
            setattr(param, LOGICAL_NUMEL, term.logical)
            if param.is_floating_point():
                setattr(param, KEEP_DTYPE, term.dtype)
            self.register_parameter(term.name, param)
        if bias is not None:
            bias.requires_grad_(False)  # replace_with_bnb_linear: new_module.requires_grad_(False)
        self.register_parameter("bias", bias)

    @property
    def storage_bytes(self) -> int:
        """Bytes of the quantized weight and its statistics (the bias apart)."""
        return sum(term.nbytes for term in self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is Quant.INT8:
            # Linear8bitLt.forward: no compute dtype; the bias follows the input's dtype
            bias = None if self.bias is None else self.bias.to(x.dtype)
            out: torch.Tensor = _MatMul8bitLt.apply(  # type: ignore[no-untyped-call]  # Function.apply is untyped
                x, self.weight, self.get_parameter("SCB"), bias, INT8_THRESHOLD)
            return out
        # Linear4bit.forward: x.to(compute_dtype), bias.to(compute_dtype), matmul_4bit(...).to(inp_dtype)
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        spec = _Spec4bit(self.out_features, self.in_features, self.double_quant, self.compute_dtype, self.quant.value)
        nested = self.double_quant
        state = _State4bit(self.weight, self.get_parameter("weight_absmax"),
                           self.get_parameter("weight_nested_absmax") if nested else None,
                           self.get_parameter("weight_nested_quant_map") if nested else None,
                           self.get_parameter("weight_offset") if nested else None)
        result: torch.Tensor = _MatMul4Bit.apply(x, bias, spec, state)  # type: ignore[no-untyped-call]
        return result.to(inp_dtype)

    def extra_repr(self) -> str:
        kind = self.quant.value + (", double_quant" if self.double_quant else "")
        return f"{super().extra_repr()}, {kind}, compute_dtype={self.compute_dtype}"


@dataclass(frozen=True)
class _Spec4bit:
    """What a 4-bit ``QuantState`` says of the weight: ``shape`` (out, in), nesting, dtype, type."""

    out_features: int
    in_features: int
    nested: bool
    dtype: torch.dtype  # quant_state.dtype: the weights' dtype when quantized (taken = compute dtype)
    quant_type: str  # "nf4" or "fp4"

    @property
    def blocks(self) -> int:
        return -(self.out_features * self.in_features // -BLOCKSIZE)


class _State4bit(NamedTuple):
    """The stored tensors a 4-bit ``QuantState`` points to (the module's frozen parameters)."""

    weight: torch.Tensor  # packed, uint8
    absmax: torch.Tensor  # float32; uint8 when nested
    nested_absmax: torch.Tensor | None  # state2.absmax, float32
    nested_code: torch.Tensor | None  # state2.code: the dynamic map, float32
    offset: torch.Tensor | None  # quant_state.offset, a float32 scalar


def _absmax_f32(spec: _Spec4bit, device: torch.device) -> torch.Tensor:
    """The per-block absmax rebuilt in float32 from its uint8 copy (double quantization)."""
    return torch.empty((spec.blocks,), dtype=torch.float32, device=device)


def _dequantize_nested_absmax(state: _State4bit, out: torch.Tensor) -> torch.Tensor:
    """``dequantize_blockwise`` of the uint8 absmax into ``out`` (float32), with the nested
    state; returns the offset still to be added (``quant_state.offset``)."""
    assert state.offset is not None, "a nested QuantState has an offset"
    _ops.dequantize_blockwise.out(state.absmax, state.nested_absmax, state.nested_code, NESTED_BLOCKSIZE,
                                  torch.float32, out)
    return state.offset


class _MatMul4Bit(torch.autograd.Function):
    """``MatMul4Bit`` with ``gemm_4bit``'s CUDA dispatch: bitsandbytes' allocations made as it
    makes them (``torch.empty`` of their sizes), its kernels run as :data:`KERNELS` ops writing
    into them."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, bias: torch.Tensor | None, spec: _Spec4bit,
                state: _State4bit) -> torch.Tensor:
        ctx.spec, ctx.state = spec, state
        rows = A.numel() // A.shape[-1]
        shape = [spec.out_features, spec.in_features]
        if rows <= GEMM_4BIT_FUSED_MAX_M:  # _gemm_4bit_kernel_impl: the output alone
            A = A.contiguous()
            out = torch.empty((*A.shape[:-1], spec.out_features), dtype=A.dtype, device=A.device)
            # MatMul4Bit.forward, nested: absmax=state2.absmax, absmax_8bit=quant_state.absmax, code, offset
            absmax, nested = ((state.nested_absmax, (state.absmax, state.nested_code, state.offset)) if spec.nested
                              else (state.absmax, (None, None, None)))
            _ops.gemm_4bit.out(A, state.weight, shape, absmax, BLOCKSIZE, spec.quant_type, bias, *nested, out)
            return out
        # _dequant_linear_fallback (taken for 5–1536 rows as well: module docstring)
        absmax, absmax_dq = state.absmax, None
        if spec.nested:
            absmax_dq = _absmax_f32(spec, A.device)  # empty_like(absmax_8bit, dtype=float32)
            offset = _dequantize_nested_absmax(state, absmax_dq)
            absmax = absmax_dq + offset  # absmax_dq + absmax_offset
        B_dq = torch.empty(shape, dtype=A.dtype, device=A.device)
        _ops.dequantize_4bit.out(state.weight, absmax, BLOCKSIZE, spec.quant_type, shape, A.dtype, B_dq)
        output = F.linear(A, B_dq, bias)
        del B_dq, absmax, absmax_dq
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        spec: _Spec4bit = ctx.spec
        state: _State4bit = ctx.state
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        # functional.dequantize_4bit: the nested absmax in float32 (dequantize_blockwise, += offset)
        absmax = state.absmax
        if spec.nested:
            absmax = _absmax_f32(spec, grad_output.device)  # the dequantize_blockwise op's empty_like(A, float32)
            absmax.add_(_dequantize_nested_absmax(state, absmax))  # absmax += quant_state.offset
        shape = [spec.out_features, spec.in_features]
        weight = torch.empty(shape, dtype=spec.dtype, device=grad_output.device)  # dequantize_4bit's out
        _ops.dequantize_4bit.out(state.weight, absmax, BLOCKSIZE, spec.quant_type, shape, spec.dtype, weight)
        del absmax  # a local of dequantize_4bit: gone when it returns
        grad_A = torch.matmul(grad_output, weight.to(grad_output.dtype))
        return grad_A, None, None, None


class _MatMul8bitLt(torch.autograd.Function):
    """``MatMul8bitLt`` (fast path: a frozen int8 weight): ``int8_vectorwise_quant`` and
    ``int8_scaled_mm``'s allocations made as bitsandbytes makes them, its kernels run as
    :data:`KERNELS` ops writing into them."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, CB: torch.Tensor, SCB: torch.Tensor, bias: torch.Tensor | None,
                threshold: float) -> torch.Tensor:
        input_shape = A.shape
        if A.dim() == 3:
            A = A.reshape(-1, A.shape[-1])
        CA, SCA = _int8_vectorwise_quant(A.to(torch.float16), threshold)
        rows, out_features = A.shape[0], CB.shape[0]
        # int8_scaled_mm → int8_linear_matmul (int32) → int8_mm_dequant (float16, bias, .to(dtype))
        out_i32 = torch.empty((rows, out_features), dtype=torch.int32, device=A.device)
        _ops.int8_linear_matmul.out(CA, CB, out_i32)
        out16 = torch.empty((rows, out_features), dtype=torch.float16, device=A.device)
        fused_bias = bias if bias is not None and bias.dtype == torch.float16 else None  # only fp16 is fused
        _ops.int8_mm_dequant.out(out_i32, SCA, SCB, fused_bias, out16)
        if bias is not None and bias.dtype != torch.float16:
            out16.add_(bias)
        output = out16.to(A.dtype)
        del out_i32, out16, CA, SCA
        subA = A.new_empty(0) if threshold > 0 else None  # int8_mixed_scaled_mm without outlier columns
        ctx.tensors = (None, subA, A)  # as MatMul8bitLt keeps them: the input lives until backward
        ctx.int8 = (CB, SCB)
        ctx.grad_shape, ctx.dtype_A = input_shape, A.dtype
        return output.reshape(*input_shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        CB, SCB = ctx.int8
        if grad_output.dim() == 3:
            grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        weight = CB.to(ctx.dtype_A, copy=True).mul_(SCB.unsqueeze(1).mul(1.0 / 127.0))
        grad_A = torch.matmul(grad_output.to(ctx.dtype_A), weight).view(ctx.grad_shape)
        return grad_A, None, None, None, None


def _int8_vectorwise_quant(A: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel of ``bitsandbytes::int8_vectorwise_quant``: row scales and the int8
    copy, then (threshold > 0) the outlier mask ``A.abs() >= threshold`` and its ``any()``, then
    the quantization kernel (``lib.cint8_vector_quant``)."""
    rows = A.numel() // A.shape[-1]
    row_stats = torch.empty((rows,), dtype=torch.float32, device=A.device)
    out_row = torch.empty(A.shape, dtype=torch.int8, device=A.device)
    if threshold > 0.0:
        outliers = A.abs() >= threshold
        outliers.any()  # its value picks the outlier columns: none taken on meta (module docstring)
        del outliers
    _ops.int8_vectorwise_quant.out(A, threshold, out_row, row_stats)
    return out_row, row_stats


# ---- which layers ------------------------------------------------------------------------
def modules_to_not_convert(model: nn.Module) -> list[str]:
    """transformers' ``get_keys_to_not_convert`` (``quantizers/base.py``) plus
    ``_keep_in_fp32_modules``: tied weights, the last parameter's module and the output
    embeddings, by name (a parameter's ``.weight`` suffix removed)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    keys = {n for group in names.values() if len(group) > 1 for n in group}  # tied weights
    params = list(model.named_parameters())
    if params:
        keys.add(params[-1][0])
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if isinstance(output, nn.Module):
        keys.update(name for name, sub in model.named_modules() if sub is output)
    skip = [k.removesuffix(".weight") for k in keys]
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    return sorted(set(skip))


def should_convert(name: str, patterns: Iterable[str]) -> bool:
    """transformers' ``should_convert_module`` (``quantizers/quantizers_utils.py``): a pattern
    matches from the start up to a module boundary (as a regex), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in patterns)


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a module transformers converts: exactly ``nn.Linear``, or GPT-2's ``Conv1D``
    (weight ``(in, out)``), recognised by name so that transformers need not be imported."""
    if type(module) is nn.Linear:
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        return int(weight.shape[0]), int(weight.shape[1])
    return None


@dataclass(frozen=True)
class QuantSummary:
    """What :func:`quantize_linears` did."""

    quant: Quant
    double_quant: bool
    compute_dtype: torch.dtype
    layers: int
    storage_bytes: int  # quantized weights and their statistics
    kept: tuple[str, ...]  # layers transformers leaves unquantized (the LM head), and embeddings
    trainable: tuple[str, ...]  # Linear layers left in full precision because they train

    @property
    def note(self) -> str:
        """The report's note."""
        what = f"{self.quant.value} weights" + (" with double quantization" if self.double_quant else "")
        how = ("int8 matmuls; dequantized to the input's dtype for backward" if self.quant is Quant.INT8
               else f"dequantized to {str(self.compute_dtype).removeprefix('torch.')} for each matmul")
        note = (f"{what}: {format_bytes(self.storage_bytes)} for {self.layers:,} Linear "
                f"layer{'s' if self.layers != 1 else ''} (bitsandbytes {BNB_VERSION}'s layout, {how})")
        if self.kept:
            note += f"; {' and '.join(_collapse(list(self.kept)))} unquantized, as transformers leaves them"
        if self.trainable:
            note += f"; in full precision because they train: {', '.join(_collapse(list(self.trainable)))}"
        return note


def quantize_linears(model: nn.Module, quant: Quant, *, double_quant: bool, compute_dtype: torch.dtype,
                     select: Callable[[str, nn.Module], bool] = lambda name, module: True) -> QuantSummary:
    """Replace, in place, the Linear layers transformers would quantize by :class:`QuantizedLinear`.

    Args:
        model: the model, on meta.
        quant: nf4, fp4 or int8.
        double_quant: 4-bit: quantize the absmax again.
        compute_dtype: the dtype 4-bit weights are dequantized to (``bnb_4bit_compute_dtype``).
        select: ``(name, module) → bool``: of the convertible layers, those to quantize.

    Returns:
        The number of layers and bytes, and the Linear layers left alone.

    Raises:
        InvalidInputError: no layer to quantize.
    """
    skip = modules_to_not_convert(model)
    converted: list[tuple[str, QuantizedLinear]] = []
    kept = ["embeddings"] if any(isinstance(m, nn.Embedding) for m in model.modules()) else []
    trainable: list[str] = []
    for name, module in list(model.named_modules()):
        shape = _linear_shape(module)
        if shape is None:
            continue
        if not should_convert(name, skip):
            kept.append(name)
            continue
        if not select(name, module):
            trainable.append(name)
            continue
        bias = module.bias if isinstance(module.bias, nn.Parameter) else None
        device = next(module.parameters()).device
        layer = QuantizedLinear(*shape, bias, quant, double_quant=double_quant, compute_dtype=compute_dtype,
                                device=device)
        model.set_submodule(name, layer)
        converted.append((name, layer))
    if not converted:
        left = [*kept, *trainable]
        raise InvalidInputError(
            f"--quant {quant.value} found no Linear layer to quantize"
            + (f" (left alone: {', '.join(_collapse(left))})" if left else ""),
            hint="bitsandbytes quantizes nn.Linear layers (not embeddings, not the LM head); in training, the "
                 "frozen ones: add --lora RANK, or --freeze the layers to quantize.")
    return QuantSummary(quant, double_quant, compute_dtype, len(converted),
                        sum(layer.storage_bytes for _, layer in converted), tuple(kept), tuple(trainable))


def _collapse(names: list[str]) -> list[str]:
    """Layer names for a note: many (``model.layers.0.mlp.gate_proj``, ...) become one entry
    that counts them and names their leaves."""
    if len(names) <= 3:
        return names
    leaves = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
    return [f"{len(names)} layers ({', '.join(leaves[:4])}{', ...' if len(leaves) > 4 else ''})"]

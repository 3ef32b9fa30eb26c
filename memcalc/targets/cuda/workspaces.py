"""Kernel workspaces: memory CUDA libraries take through the caching allocator that no meta
kernel shows. Rules registered per aten op (:data:`WORKSPACE_RULES`, a
:class:`~memcalc.engine.rules.RuleRegistry` keyed by ``OpOverload``) run after each op and add
synthetic allocations to the trace:

- cuBLAS: one workspace per handle and stream, allocated at the first cuBLAS call and kept
  (``aten/src/ATen/cuda/CublasHandlePool.cpp``); the autograd engine runs backward on its own
  device thread, whose handle gets a workspace of its own at its first matmul — so a training
  step holds one for the forward and one for the backward (:mod:`memcalc.targets.cuda.cublas` documents
  the source). Size: the GPU profile's, honouring ``CUBLAS_WORKSPACE_CONFIG``.
- cuDNN convolutions: a temporary per call, sized by :func:`memcalc.targets.cuda.cudnn.conv_workspace_bytes`
  (a rule read off real calls in H100 snapshots; the batch changes which engine runs, so the
  bytes are a :class:`~memcalc.targets.cuda.cudnn.ConvWorkspaceRule` of the shapes).
- fused attention: the temporaries the flash / memory-efficient / cuDNN kernels allocate
  inside their forward and backward (:func:`memcalc.targets.cuda.attention_memory.forward_temporaries`,
  :func:`memcalc.targets.cuda.attention_memory.backward_temporaries`).
- reductions: the global-memory staging buffer and semaphores of ``gpu_reduce_kernel`` when it
  splits each output over several thread blocks (:func:`memcalc.targets.cuda.reduce.reduction_scratch`,
  transcribed from ``Reduce.cuh``): the sums of bias gradients over many rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch._ops import OpOverload

from memcalc.core.categories import Category
from memcalc.core.gpu import GpuProfile
from memcalc.engine.rules import RuleRegistry
from memcalc.engine.trace import ShapeSized, StorageTracer
from memcalc.targets.convolution_args import convolution_args, convolution_backward_args
from memcalc.targets.cuda.attention_memory import Buffer, backward_temporaries, forward_temporaries
from memcalc.targets.cuda.cublas import cublas_workspace_bytes, cublas_workspaces_in_training_step
from memcalc.targets.cuda.cudnn import ConvDirection, ConvWorkspaceRule
from memcalc.targets.cuda.reduce import reduction_scratch
from memcalc.targets.cuda.sdpa import AttentionBackend, SdpaCall
from memcalc.targets.versions import TARGET_TORCH_VERSION

__all__ = ("CUBLAS_OPS", "WORKSPACE_RULES", "ReductionScratchRule", "WorkspaceModel", "WorkspaceRule",
           "warm_process")

aten = torch.ops.aten

#: A workspace rule: ``(model, op, args, kwargs, output)``, called after ``op`` ran.
WorkspaceRule = Callable[["WorkspaceModel", OpOverload, tuple[Any, ...], dict[str, Any], Any], None]
#: The workspace rules, one per aten op that has one.
WORKSPACE_RULES: RuleRegistry[WorkspaceRule] = RuleRegistry("kernel workspace")

# aten ops that run through cuBLAS (linear → addmm/mm, matmul → mm/bmm, attention math → bmm).
# Under ``torch.inference_mode()`` the CompositeImplicitAutograd ops ``linear`` and ``matmul``
# reach the dispatch mode whole (no autograd key decomposes them above it: checked on torch
# 2.13 meta tensors), yet on CUDA they still run ``at::native::linear`` / ``matmul`` → addmm /
# mm / bmm through cuBLAS — an inference step's first matmul allocates the forward handle's
# workspace as a training step's does. ``_scaled_mm`` (float8 matmuls, torchao's Float8Linear) runs
# cuBLASLt (aten/src/ATen/native/cuda/Blas.cpp ``_scaled_mm_out_cuda`` → ``at::cuda::blas::scaled_gemm``),
# whose workspace is the cuBLAS one since 2.11 (memcalc.targets.cuda.cublas). A compiled step's
# matmuls are Inductor's extern kernels, which write into buffers its wrapper allocated
# (``extern_kernels.mm(a, b, out=buf)``): the ``.out`` overloads, through the same cuBLAS calls.
CUBLAS_OPS: tuple[OpOverload, ...] = (
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
    aten.addmv.default, aten.mv.default, aten.dot.default, aten.vdot.default, aten._addmm_activation.default,
    aten.addmm_.default, aten.baddbmm_.default, aten.linear.default, aten.matmul.default,
    aten._scaled_mm.default,
    aten.mm.out, aten.addmm.out, aten.bmm.out, aten.baddbmm.out,
)

_ATTENTION_FORWARD: dict[OpOverload, AttentionBackend] = {
    aten._scaled_dot_product_flash_attention.default: AttentionBackend.FLASH,
    aten._scaled_dot_product_efficient_attention.default: AttentionBackend.EFFICIENT,
    aten._scaled_dot_product_cudnn_attention.default: AttentionBackend.CUDNN,
}
_ATTENTION_BACKWARD: dict[OpOverload, AttentionBackend] = {
    aten._scaled_dot_product_flash_attention_backward.default: AttentionBackend.FLASH,
    aten._scaled_dot_product_efficient_attention_backward.default: AttentionBackend.EFFICIENT,
    aten._scaled_dot_product_cudnn_attention_backward.default: AttentionBackend.CUDNN,
}



class _Temporaries(Protocol):
    """:func:`forward_temporaries` or :func:`backward_temporaries`: the GPU's own SM count is given."""

    def __call__(self, call: SdpaCall, backend: AttentionBackend, compute_capability: tuple[int, int], *,
                 sm_count: int) -> list[Buffer]: ...

    def __hash__(self) -> int: ...  # a module's function: a key of _scratch_bytes


@dataclass(frozen=True)
class ReductionScratchRule:
    """The bytes of one of a reduction launch's two temporaries (``part``: ``"staging"`` or
    ``"semaphores"``) from the input's shape and strides (``ndim`` of each, in one tuple), for
    the trace's :class:`~memcalc.engine.trace.ShapeSized`: equal rules for the same launch site."""

    ndim: int
    dims: tuple[int, ...]
    dtype: torch.dtype
    compute_capability: tuple[int, int]
    sm_count: int
    part: str

    def __call__(self, arguments: tuple[int, ...]) -> int:
        shape, strides = arguments[:self.ndim], arguments[self.ndim:]
        scratch = _reduction_scratch(shape, strides, self.dims, self.dtype, self.compute_capability, self.sm_count)
        return scratch.staging if self.part == "staging" else scratch.semaphores


#: :func:`~memcalc.targets.cuda.reduce.reduction_scratch`, remembered: both parts of a launch, the
#: tracer's check of each and every replay of a batch-affine family ask for the same launches.
_reduction_scratch = functools.lru_cache(maxsize=1 << 16)(reduction_scratch)


@functools.lru_cache(maxsize=1 << 12)
def _reduction_rules(ndim: int, dims: tuple[int, ...], dtype: torch.dtype, compute_capability: tuple[int, int],
                     sm_count: int) -> tuple[ReductionScratchRule, ReductionScratchRule]:
    """A reduction launch's two rules (staging, then semaphores), made once per launch site: the
    backward of every linear layer reduces its bias gradient the same way."""
    return (ReductionScratchRule(ndim, dims, dtype, compute_capability, sm_count, "staging"),
            ReductionScratchRule(ndim, dims, dtype, compute_capability, sm_count, "semaphores"))


@functools.lru_cache(maxsize=1 << 12)
def _scratch_bytes(which: _Temporaries, call: SdpaCall, backend: AttentionBackend, compute_capability: tuple[int, int],
                   sm_count: int) -> tuple[int, ...]:
    """The bytes of each buffer of a fused attention call's scratch, remembered: a function of the
    call's shapes and the GPU, asked once per layer and again by every estimate of a search."""
    return tuple(buffer.nbytes for buffer in which(call, backend, compute_capability, sm_count=sm_count))


#: The bytes of workspaces a warm-up left allocated in the process (:func:`warm_process`).
_WARM_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("memcalc_warm_workspace_bytes", default=0)
#: A cuBLASLt workspace, as the measured processes held them beside the cuBLAS handles' (1 MiB each).
CUBLASLT_WARM_BLOCK = 1 << 20


@contextlib.contextmanager
def warm_process(workspace_bytes: int) -> Iterator[None]:
    """Estimate steps as a process that already holds ``workspace_bytes`` of library workspaces
    from earlier work (a warm-up, an earlier configuration), as a measurement may have been taken:
    the cuBLAS handles' workspaces first (the forward thread's, then autograd's), then 1 MiB
    cuBLASLt ones, allocated before the step in segments of their own. A handle that already has
    its workspace allocates none in the step.

    Not what a user's fresh training process does (memcalc's default): it is how an estimate is
    compared with a recorded run whose process was warm (``benchmarks/replay_suite.py
    --as-measured``, whose records say what their warm-up left allocated)."""
    if workspace_bytes < 0:
        raise ValueError(f"workspace_bytes must be ≥ 0, got {workspace_bytes}")
    token = _WARM_BYTES.set(workspace_bytes)
    try:
        yield
    finally:
        _WARM_BYTES.reset(token)


def _warm_blocks(nbytes: int, cublas_bytes: int) -> list[tuple[str, int]]:
    """What a warm process holds (:func:`warm_process`): (handle, bytes) per allocation — the
    ``"forward"`` and ``"backward"`` cuBLAS handles' workspaces while ``nbytes`` covers them, then
    ``"cublasLt"`` blocks of at most 1 MiB."""
    blocks = []
    for handle in ("forward", "backward"):
        if 0 < cublas_bytes <= nbytes:
            blocks.append((handle, cublas_bytes))
            nbytes -= cublas_bytes
    while nbytes > 0:
        blocks.append(("cublasLt", min(nbytes, CUBLASLT_WARM_BLOCK)))
        nbytes -= CUBLASLT_WARM_BLOCK
    return blocks


class WorkspaceModel:
    """The workspaces of one traced step on ``gpu`` under torch ``torch_version``: :meth:`after_op`
    runs the rule of each op."""

    def __init__(self, gpu: GpuProfile, *, training: bool, torch_version: str = TARGET_TORCH_VERSION) -> None:
        self.gpu = gpu
        self.training = training
        self.torch_version = torch_version
        self.cublas_bytes = cublas_workspace_bytes(gpu)
        self.cublas_handles = cublas_workspaces_in_training_step(torch_version)
        self.tracer: StorageTracer | None = None
        self.cublas_phases: set[str] = set()  # "forward" / "backward" handles that have a workspace
        self.conv_calls = 0
        self.conv_workspace_peak = 0
        # a warm process (warm_process): its handles already hold their workspaces
        self.warm_blocks = _warm_blocks(_WARM_BYTES.get(), self.cublas_bytes)
        self.cublas_phases.update(handle for handle, _ in self.warm_blocks if handle in ("forward", "backward"))

    def attach(self, tracer: StorageTracer) -> None:
        self.tracer = tracer
        for handle, nbytes in self.warm_blocks:
            what = "cuBLASLt workspace" if handle == "cublasLt" else f"cuBLAS workspace ({handle} handle)"
            tracer.synthetic(nbytes, Category.WORKSPACE, persistent=True, preexisting=True,
                             label=f"synthetic: {what}, left by an earlier warm-up")

    def after_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        rule = WORKSPACE_RULES.get(func)
        if rule is not None:
            rule(self, func, args, kwargs, out)

    def add_temporary(self, nbytes: int, what: str) -> None:
        """A workspace the kernel frees when it returns; ``what`` names it in the timeline."""
        assert self.tracer is not None
        self.tracer.synthetic(nbytes, Category.WORKSPACE, persistent=False, label=f"synthetic: {what}")

    # ---- cuDNN convolution ------------------------------------------------------------------
    def conv(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, stride: Sequence[int],
             groups: int, direction: ConvDirection) -> None:
        """One cuDNN convolution call: its workspace, freed when it returns. Recorded even at
        0 B: which engine runs (and whether it wants a workspace) can change with the batch,
        and the step's events must not."""
        assert self.tracer is not None
        rule = ConvWorkspaceRule(x.dim(), x.dtype, tuple(int(s) for s in stride), int(groups), direction,
                                 self.gpu.compute_capability, self.gpu.sm_count)
        arguments = tuple(int(n) for t in (x, w, y) for n in t.shape)
        nbytes = rule(arguments)
        self.conv_calls += 1
        self.conv_workspace_peak = max(self.conv_workspace_peak, nbytes)
        self.tracer.synthetic(nbytes, Category.WORKSPACE, persistent=False,
                              label=f"synthetic: cuDNN convolution workspace ({direction.value})",
                              sized=ShapeSized(rule, arguments))

    # ---- reductions -------------------------------------------------------------------------
    def reduction(self, x: torch.Tensor, dims: Sequence[int]) -> None:
        """One ``gpu_reduce_kernel`` launch over ``dims`` of ``x``: its staging buffer and
        semaphores, both taken before the kernel runs and freed when it returns (Reduce.cuh,
        ``launch_reduce_kernel``), after the op's output.

        Both are recorded even when the launch needs none (0 B, which the allocator never
        sees): whether it does depends on the batch, and the step's events must not."""
        if not x.is_floating_point() or x.dim() == 0:
            return
        assert self.tracer is not None
        arguments = (*(int(n) for n in x.shape), *(int(n) for n in x.stride()))
        uids = []
        for rule in _reduction_rules(x.dim(), tuple(int(d) for d in dims), x.dtype, self.gpu.compute_capability,
                                     self.gpu.sm_count):
            uids.append(self.tracer.synthetic(rule(arguments), Category.WORKSPACE, persistent=True,
                                              label=f"synthetic: reduction {rule.part} (gpu_reduce_kernel)",
                                              sized=ShapeSized(rule, arguments)))
        for uid in reversed(uids):
            self.tracer.release(uid)

    # ---- fused attention --------------------------------------------------------------------
    def attention_temporaries(self, which: _Temporaries, backend: AttentionBackend, args: tuple[Any, ...],
                              requires_grad: bool | None = None) -> None:
        """The scratch of one fused attention call (q, k, v first in ``args``)."""
        q, k, v = args[0], args[1], args[2]
        if q.dim() != 4:
            return
        call = SdpaCall(
            batch=int(q.shape[0]), heads_q=int(q.shape[1]), heads_kv=int(k.shape[1]), seq_q=int(q.shape[2]),
            seq_kv=int(k.shape[2]), head_dim=int(q.shape[3]), head_dim_v=int(v.shape[3]), dtype=q.dtype,
            has_mask=False, dropout_p=0.0, is_causal=False,
            requires_grad=bool(requires_grad) if requires_grad is not None else self.training)
        for nbytes in _scratch_bytes(which, call, backend, tuple(self.gpu.compute_capability), self.gpu.sm_count):
            if nbytes:
                self.add_temporary(nbytes, f"{backend.value} attention scratch")

    def notes(self) -> list[str]:
        lines = []
        if self.cublas_phases:
            handles = f"{', '.join(sorted(self.cublas_phases))} handle{'s' if len(self.cublas_phases) > 1 else ''}"
            lines.append(f"cuBLAS workspace: {len(self.cublas_phases)} × {self.cublas_bytes:,} B ({handles})")
        if self.conv_calls:
            lines.append(f"cuDNN convolution workspace: modelled per call ({self.conv_calls} calls, largest "
                         f"{self.conv_workspace_peak:,} B) — a rule measured on an H100, "
                         "see memcalc.targets.cuda.cudnn.conv_workspace_bytes")
        return lines


# ---- cuBLAS ---------------------------------------------------------------------------------
@WORKSPACE_RULES.register(*CUBLAS_OPS)
def cublas_workspace(model: WorkspaceModel, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                     out: Any) -> None:
    """The first cuBLAS call of a handle (forward thread, autograd's thread) allocates its
    workspace, kept for the life of the process."""
    assert model.tracer is not None
    handle = "backward" if model.tracer.modules.in_backward else "forward"
    if handle in model.cublas_phases or model.cublas_bytes <= 0:
        return
    if handle == "backward" and model.cublas_handles < 2:
        return
    model.cublas_phases.add(handle)
    model.tracer.synthetic(model.cublas_bytes, Category.WORKSPACE, persistent=True,
                           label=f"synthetic: cuBLAS workspace ({handle} handle)")


# ---- cuDNN convolution ----------------------------------------------------------------------
@WORKSPACE_RULES.register(aten.convolution.default)
def conv_forward(model: WorkspaceModel, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
    """``convolution``: cuDNN's forward, or its backward-data kernel for a transposed one."""
    conv = convolution_args(args, kwargs)
    # a transposed convolution runs cuDNN's backward-data kernel
    direction = ConvDirection.BACKWARD_DATA if conv.transposed else ConvDirection.FORWARD
    model.conv(conv.input, conv.weight, out, conv.stride, conv.groups, direction)


@WORKSPACE_RULES.register(aten.convolution_backward.default)
def conv_backward(model: WorkspaceModel, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                  out: Any) -> None:
    """``convolution_backward``: one cuDNN call per gradient its output mask asks for."""
    conv = convolution_backward_args(args, kwargs)
    grad_out, x, w, stride, groups, mask = (conv.grad_output, conv.input, conv.weight, conv.stride, conv.groups,
                                            conv.output_mask)
    if mask[0]:
        # a transposed convolution's input gradient is cuDNN's forward
        # (cudnn_convolution_transpose_backward_input calls raw_cudnn_convolution_forward_out)
        model.conv(x, w, grad_out, stride, groups,
                   ConvDirection.FORWARD if conv.transposed else ConvDirection.BACKWARD_DATA)
    if mask[1]:
        model.conv(x, w, grad_out, stride, groups, ConvDirection.BACKWARD_FILTER)
    if len(mask) > 2 and mask[2]:
        # the bias gradient: at::native::convolution_backward sums grad_output over every
        # dimension but the channels (ConvUtils.h, a gpu_reduce_kernel launch of its own)
        model.reduction(grad_out, [d for d in range(grad_out.dim()) if d != 1])


# ---- fused attention ------------------------------------------------------------------------
@WORKSPACE_RULES.register(*_ATTENTION_FORWARD)
def attention_forward(model: WorkspaceModel, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                      out: Any) -> None:
    """The scratch of a fused attention forward."""
    model.attention_temporaries(forward_temporaries, _ATTENTION_FORWARD[op], args)


@WORKSPACE_RULES.register(*_ATTENTION_BACKWARD)
def attention_backward(model: WorkspaceModel, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                       out: Any) -> None:
    """The scratch of a fused attention backward."""
    # backward signatures start with grad_out, then query, key, value
    model.attention_temporaries(backward_temporaries, _ATTENTION_BACKWARD[op], args[1:], requires_grad=True)


# ---- reductions -----------------------------------------------------------------------------
@WORKSPACE_RULES.register(aten.sum.dim_IntList, aten.mean.dim)
def reduction(model: WorkspaceModel, op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
              out: Any) -> None:
    """``sum`` / ``mean`` over dimensions (a bias gradient: ``grad.sum(0)`` in AddmmBackward):
    the global-reduction scratch of its ``gpu_reduce_kernel`` launch."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    model.reduction(args[0], () if dims is None else tuple(int(d) for d in dims))

"""Kernel workspaces: memory CUDA libraries take through the caching allocator that no meta
kernel shows. Rules keyed by aten op name (a plain dict, as in fvcore's handles) run after
each op and add synthetic allocations to the trace:

- cuBLAS: one workspace per handle and stream, allocated at the first cuBLAS call and kept
  (``aten/src/ATen/cuda/CublasHandlePool.cpp``); the autograd engine runs backward on its own
  device thread, whose handle gets a workspace of its own at its first matmul — so a training
  step holds one for the forward and one for the backward (:mod:`memcalc.kernels` documents
  the source). Size: the GPU profile's, honouring ``CUBLAS_WORKSPACE_CONFIG``.
- cuDNN convolutions: a temporary per call, sized by :func:`memcalc.cuda.kernels.conv_workspace_bytes`
  (a documented model, not a measurement).
- fused attention: the temporaries the flash / memory-efficient / cuDNN kernels allocate
  inside their forward and backward (:func:`memcalc.cuda.kernels.forward_temporaries`,
  :func:`memcalc.cuda.kernels.backward_temporaries`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from memcalc.cuda import kernels
from memcalc.core.categories import Category
from memcalc.cuda.gpus.catalogue import GpuProfile, cublas_workspace_bytes
from memcalc.engine.trace import StorageTracer

__all__ = ("WorkspaceModel", "CUBLAS_OPS")

# aten ops that run through cuBLAS (linear → addmm/mm, matmul → mm/bmm, attention math → bmm).
CUBLAS_OPS = frozenset({
    "mm.default", "addmm.default", "bmm.default", "baddbmm.default", "addbmm.default", "addmv.default",
    "mv.default", "dot.default", "vdot.default", "_addmm_activation.default", "addmm_.default", "baddbmm_.default",
})

_ATTENTION_FORWARD = {
    "_scaled_dot_product_flash_attention.default": kernels.AttentionBackend.FLASH,
    "_scaled_dot_product_efficient_attention.default": kernels.AttentionBackend.EFFICIENT,
    "_scaled_dot_product_cudnn_attention.default": kernels.AttentionBackend.CUDNN,
}
_ATTENTION_BACKWARD = {
    "_scaled_dot_product_flash_attention_backward.default": kernels.AttentionBackend.FLASH,
    "_scaled_dot_product_efficient_attention_backward.default": kernels.AttentionBackend.EFFICIENT,
    "_scaled_dot_product_cudnn_attention_backward.default": kernels.AttentionBackend.CUDNN,
}


class WorkspaceModel:
    def __init__(self, gpu: GpuProfile, *, training: bool):
        self.gpu = gpu
        self.training = training
        self.cublas_bytes = cublas_workspace_bytes(gpu)
        self.tracer: StorageTracer | None = None
        self._cublas_phases: set[str] = set()  # "forward" / "backward" handles that have a workspace
        self.conv_calls = 0
        self.conv_workspace_peak = 0
        self._rules: dict[str, Callable[[str, tuple, dict, Any], None]] = {
            **{name: self._cublas for name in CUBLAS_OPS},
            "convolution.default": self._conv_forward,
            "convolution_backward.default": self._conv_backward,
            **{name: self._attention_forward for name in _ATTENTION_FORWARD},
            **{name: self._attention_backward for name in _ATTENTION_BACKWARD},
        }

    def attach(self, tracer: StorageTracer) -> None:
        self.tracer = tracer

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        rule = self._rules.get(func.__name__)
        if rule is not None:
            rule(func.__name__, args, kwargs, out)

    # ---- cuBLAS -----------------------------------------------------------------------------
    def _cublas(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        assert self.tracer is not None
        handle = "backward" if self.tracer.modules.in_backward else "forward"
        if handle in self._cublas_phases or self.cublas_bytes <= 0:
            return
        if handle == "backward" and kernels.CUBLAS_WORKSPACES_PER_TRAINING_STEP < 2:
            return
        self._cublas_phases.add(handle)
        self.tracer.synthetic(self.cublas_bytes, Category.WORKSPACE, persistent=True)

    # ---- cuDNN convolution ------------------------------------------------------------------
    def _conv_forward(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        x, w = args[0], args[1]
        stride, padding, dilation, transposed, _, groups = args[3:9]
        if transposed:
            direction = "backward_data"  # a transposed convolution runs cuDNN's backward-data kernel
        else:
            direction = "forward"
        self._conv(x, w, out, stride, padding, dilation, groups, direction)

    def _conv_backward(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        grad_out, x, w = args[0], args[1], args[2]
        stride, padding, dilation, _transposed, _, groups, mask = args[4:11]
        if mask[0]:
            self._conv(x, w, grad_out, stride, padding, dilation, groups, "backward_data")
        if mask[1]:
            self._conv(x, w, grad_out, stride, padding, dilation, groups, "backward_filter")

    def _conv(self, x, w, y, stride, padding, dilation, groups, direction: str) -> None:
        assert self.tracer is not None
        nbytes = kernels.conv_workspace_bytes(
            tuple(x.shape), tuple(w.shape), tuple(y.shape), x.dtype, tuple(stride), tuple(padding),
            tuple(dilation), int(groups), direction, self.gpu.compute_capability)
        self.conv_calls += 1
        if nbytes > 0:
            self.conv_workspace_peak = max(self.conv_workspace_peak, nbytes)
            self.tracer.synthetic(nbytes, Category.WORKSPACE, persistent=False)

    # ---- fused attention --------------------------------------------------------------------
    def _attention_forward(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        self._attention_temporaries(kernels.forward_temporaries, _ATTENTION_FORWARD[name], args, kwargs)

    def _attention_backward(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        # backward signatures start with grad_out, then query, key, value
        self._attention_temporaries(kernels.backward_temporaries, _ATTENTION_BACKWARD[name], args[1:], kwargs,
                                    requires_grad=True)

    def _attention_temporaries(self, which, backend, args: tuple, kwargs: dict, requires_grad: bool | None = None) -> None:
        assert self.tracer is not None
        q, k, v = args[0], args[1], args[2]
        if q.dim() != 4:
            return
        call = kernels.SdpaCall(
            batch=int(q.shape[0]), heads_q=int(q.shape[1]), heads_kv=int(k.shape[1]), seq_q=int(q.shape[2]),
            seq_kv=int(k.shape[2]), head_dim=int(q.shape[3]), head_dim_v=int(v.shape[3]), dtype=q.dtype,
            has_mask=False, dropout_p=0.0, is_causal=False,
            requires_grad=bool(requires_grad) if requires_grad is not None else self.training)
        for buffer in which(call, backend, self.gpu.compute_capability):
            nbytes = math.prod(buffer.shape) * torch.empty((), dtype=buffer.dtype).element_size()
            if nbytes:
                self.tracer.synthetic(nbytes, Category.WORKSPACE, persistent=False)

    def notes(self) -> list[str]:
        lines = []
        if self._cublas_phases:
            lines.append(f"cuBLAS workspace: {len(self._cublas_phases)} × {self.cublas_bytes:,} B "
                         f"({', '.join(sorted(self._cublas_phases))} handle{'s' if len(self._cublas_phases) > 1 else ''})")
        if self.conv_calls:
            lines.append(f"cuDNN convolution workspace: modelled per call ({self.conv_calls} calls, largest "
                         f"{self.conv_workspace_peak:,} B) — an assumption, see memcalc.cuda.kernels.conv_workspace_bytes")
        return lines

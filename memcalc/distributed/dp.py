"""``nn.DataParallel``: the output device (``device_ids[0]``), which holds the module,
gathers the outputs and runs the optimizer, and the replicas on the other devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from memcalc.core.categories import Category
from memcalc.distributed.program import RankProgram, coalesced_chunks, map_output
from memcalc.engine.trace import StorageTracer, tensors_of

__all__ = (
    "COALESCE_BUFFER_BYTES",
    "DataParallelOutputDevice",
    "DataParallelReplica",
)

# torch.nn.parallel.comm.broadcast_coalesced / reduce_add_coalesced: buffer_size=10485760,
# the flat chunk DataParallel broadcasts parameters in and reduces gradients in.
COALESCE_BUFFER_BYTES = 10 * 1024 * 1024


def _model_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class DataParallelOutputDevice(RankProgram):
    """``device_ids[0]`` under ``nn.DataParallel``: the module's own parameters (replica 0
    shares them), its chunk of the batch, and the extra work of the output device —

    * the source of every forward's broadcast (flattened in ``COALESCE_BUFFER_BYTES`` chunks);
    * ``gather``: the outputs of all replicas concatenated into one full-batch output here,
      the loss and its targets on the full batch;
    * the gradient reduction (``ReduceAddCoalesced``, at the end of backward): replica 0's
      gradients, a flat chunk of them, and the summed gradients (flat chunks whose views
      become ``.grad``) exist together until replica 0's are released;
    * the optimizer, which only this device runs.
    """

    def __init__(self, chunk_sizes: Sequence[int], training: bool):
        super().__init__()
        self.chunk_sizes = list(chunk_sizes)
        self.training = training

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        model_bytes = _model_bytes(module)
        self._handles.append(module.register_forward_pre_hook(
            lambda _m, _a: self._transient(min(COALESCE_BUFFER_BYTES, model_bytes))))
        self._handles.append(module.register_forward_hook(self._gather))
        params = [p for p in module.parameters() if p.requires_grad]
        if self.training and params:
            self._at_backward(module, None, lambda: self._reduce(params))
            for p in params:  # what autograd accumulates here is replica 0's gradient
                hook = p.register_post_accumulate_grad_hook(self._mark_gradient)  # type: ignore[no-untyped-call]
                self._handles.append(hook)

    def _gather(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        total = sum(self.chunk_sizes)

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0:  # DataParallel gathers scalars into a vector
                tensor = tensor.unsqueeze(0)
                shape = (len(self.chunk_sizes),)
            else:
                shape = (total, *tensor.shape[1:])
            gathered = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            gathered.narrow(0, 0, tensor.shape[0]).copy_(tensor)  # the other chunks arrive by copy
            return gathered

        return map_output(output, gather)

    def _mark_gradient(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._tracer.track(param.grad, Category.GRADIENTS)

    def _reduce(self, params: Sequence[nn.Parameter]) -> None:
        with_grad = [p for p in params if p.grad is not None]
        reduced: list[tuple[nn.Parameter, torch.Tensor]] = []
        for chunk in _param_chunks(with_grad, COALESCE_BUFFER_BYTES):
            numel = sum(p.numel() for p in chunk)
            dtype = _grad(chunk[0]).dtype
            replica = self._buffer(numel, dtype, Category.WORKSPACE)  # _flatten_dense_tensors(replica 0's)
            flat = torch.empty(numel, dtype=dtype, device="meta")  # reduce_add's result, beside it
            self._tracer.track(flat, Category.GRADIENTS)
            del replica
            offset = 0
            for p in chunk:
                reduced.append((p, flat.narrow(0, offset, p.numel()).view_as(p)))
                offset += p.numel()
            del flat
        for p, grad in reduced:
            p.grad = grad  # replica 0's gradient is released, the summed one kept


class DataParallelReplica(RankProgram):
    """Any other device under ``nn.DataParallel``: a replica of the parameters and buffers
    (broadcast at every forward; registered as present throughout the step), its chunk of
    the batch, no loss (its output is sent to the output device, and the gradient of that
    output comes back as a new tensor), the replica's gradients until they are reduced onto
    the output device (flattened in chunks), and no optimizer."""

    def __init__(self, training: bool):
        super().__init__()
        self.training = training

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        self._handles.append(module.register_forward_hook(self._send))
        params = [p for p in module.parameters() if p.requires_grad]
        if self.training and params:
            self._at_backward(module, None, lambda: self._flatten_for_reduce(params))

    @staticmethod
    def _send(_module: nn.Module, _args: Any, output: Any) -> Any:
        floating = [t for t in tensors_of(output) if t.is_floating_point() and t.requires_grad]
        return _SendToOutputDevice.apply(*floating) if floating else output  # type: ignore[no-untyped-call]

    def _flatten_for_reduce(self, params: Sequence[nn.Parameter]) -> None:
        for chunk in coalesced_chunks([p.grad for p in params if p.grad is not None], COALESCE_BUFFER_BYTES):
            self._transient(chunk)


class _SendToOutputDevice(torch.autograd.Function):
    """Stands for a replica's output leaving for the output device: a scalar the loss can
    use; backward returns the gradient that ``Gather.backward`` sends back, a new tensor."""

    @staticmethod
    def forward(ctx: Any, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype) for t in outputs]
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in ctx.shapes)


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def _param_chunks(params: Sequence[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > limit or _grad(p).dtype != _grad(current[0]).dtype):
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        chunks.append(current)
    return chunks

"""Real measurement of the same step the estimator simulates — our accuracy is measured,
never assumed.

CUDA: build the real model on the GPU, warm the cuBLAS handle (its workspace is allocated
through the caching allocator at the first matmul and stays), ``reset_peak_memory_stats``,
run the step program (two iterations, as the estimate does), read ``max_memory_allocated``
and ``max_memory_reserved``. An OOM is a result ("measured: OOM"), not a crash.

CPU (no GPU here): ``torch.profiler`` with ``profile_memory=True`` records every CPU
allocation and free with its size, in order; their running sum on top of the storages that
existed before the step (parameters, buffers, inputs) is the real peak. CPU kernels have
their own workspaces (MKL-DNN convolutions, the CPU flash-attention kernel), so CPU figures
compare cleanly with the estimate only for models built from ops without hidden workspaces.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Sequence

import torch
from torch import nn

from .categories import Mode
from .losses import LossChoice
from .models import ResolvedModel, resolve
from .optimizers import Optimizer, spec_for
from .report import Measurement, MemoryReport
from .step import run_step

__all__ = ("measure", "measure_cpu", "measure_cuda", "attach_measurement", "storage_bytes")


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _step(module: nn.Module, inputs, optimizer: Optimizer | str, mode: Mode | str, loss) -> None:
    run_step(module, inputs, mode=Mode(mode), optimizer=spec_for(optimizer),
             loss=loss if loss is not None else LossChoice.AUTO, iterations=2)


def measure_cpu(resolved: ResolvedModel, *, optimizer: Optimizer | str, mode: Mode | str,
                loss: Any = None) -> Measurement:
    """Peak CPU bytes of the real step, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    module, inputs = resolved.build_real(torch.device("cpu"))
    loss = loss if loss is not None else resolved.loss
    before = storage_bytes([*module.parameters(), *module.buffers(), *inputs])
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(module, inputs, optimizer, mode, loss)
    peak = before + _profiler_peak(prof)
    return Measurement(device="cpu (torch.profiler)", peak_allocated=peak,
                       note="CPU measurement: CPU kernels' own workspaces differ from CUDA's")


def _profiler_peak(prof: Any) -> int:
    """The highest running sum of the profiler's [memory] events, in time order."""
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        deltas = [(e.start_ns(), e.nbytes()) for e in events]
    except AttributeError:  # older/newer torch: the public (aggregated) view
        deltas = [(e.time_range.start, e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]"]
    current = peak = 0
    for _, delta in sorted(deltas, key=lambda d: d[0]):
        current += delta
        peak = max(peak, current)
    return peak


def measure_cuda(resolved: ResolvedModel, *, optimizer: Optimizer | str, mode: Mode | str,
                 loss: Any = None, device: torch.device | None = None) -> Measurement:
    """``max_memory_allocated`` / ``max_memory_reserved`` of the real step on a GPU."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    loss = loss if loss is not None else resolved.loss
    module = inputs = None
    try:
        gc.collect()
        torch.cuda.empty_cache()
        _warm_cublas(device)
        workspace = torch.cuda.memory_allocated(device)
        module, inputs = resolved.build_real(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(module, inputs, optimizer, mode, loss)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        return Measurement(device=f"cuda: {name}", peak_allocated=peak, peak_reserved=reserved,
                           note=f"includes {workspace:,} B allocated by the cuBLAS/cuDNN warm-up")
    except torch.cuda.OutOfMemoryError as exc:
        return Measurement(device=f"cuda: {name}", peak_allocated=None, oom=True, note=str(exc).split("\n")[0])
    finally:
        del module, inputs
        gc.collect()
        torch.cuda.empty_cache()


def _warm_cublas(device: torch.device) -> None:
    """Create the cuBLAS handle (and its workspace) before the measurement, as any real
    training process has done by its second step."""
    a = torch.ones(64, 64, device=device)
    (a @ a).sum().item()
    del a


def measure(model: Any, *, batch_size: int | None = None, input_shape: Sequence[int] | None = None,
            seq_len: int | None = None, inputs=None, optimizer: Optimizer | str = Optimizer.ADAM,
            mode: Mode | str = Mode.TRAIN, loss: Any = None, device: str | None = None) -> Measurement:
    """Measure the real step: on CUDA when available (or ``device="cuda..."``), else on CPU."""
    resolved = resolve(model, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len, inputs=inputs)
    use_cuda = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    if use_cuda:
        return measure_cuda(resolved, optimizer=optimizer, mode=mode, loss=loss,
                            device=torch.device(device) if device else None)
    return measure_cpu(resolved, optimizer=optimizer, mode=mode, loss=loss)


def attach_measurement(report: MemoryReport, model: Any, **kwargs: Any) -> MemoryReport:
    """``report`` with a real measurement of the same configuration attached.

    A CUDA measurement is compared with ``peak_allocated`` (512-byte blocks, as CUDA counts);
    a CPU one with the unrounded simulated peak, as the CPU allocator does not round.
    """
    measured = measure(model, **kwargs)
    compared = report.bytes.peak_allocated if measured.device.startswith("cuda") else report.peak_requested
    return dataclasses.replace(report, measurement=dataclasses.replace(measured, compared_with=compared))


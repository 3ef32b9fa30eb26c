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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from memcalc.api import CPU, estimate, make_request
from memcalc.core.report import Measurement, MemoryReport
from memcalc.engine.model import ResolvedModel
from memcalc.engine.options import EstimateOptions, Target
from memcalc.engine.prepare import kv_cache_bytes, prepare_step
from memcalc.engine.step import Scaler, StepConfig, run_step
from memcalc.sources.resolve import resolve

__all__ = ("attach_measurement", "measure", "measure_cpu", "measure_cuda", "storage_bytes")


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _prepare(resolved: ResolvedModel, device: torch.device,
             options: EstimateOptions) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """The real model and inputs with the same transforms the estimate applies, and a KV
    cache of the estimated size when one is asked for (the zoo's models have no cache of their
    own: a buffer of the same size stands for it)."""
    module, inputs = resolved.build_real(device)
    inputs, _ = prepare_step(module, inputs, precision=options.precision, checkpoint=options.checkpoint,
                             containers=resolved.block_containers, model_name=resolved.name)
    keep: list[torch.Tensor] = []
    if options.kv_cache is not None:
        nbytes = kv_cache_bytes(module, inputs, options.precision, options.kv_cache)
        keep.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
    return module, inputs, keep


def _config(resolved: ResolvedModel, options: EstimateOptions, device: torch.device) -> StepConfig:
    """The step program with real autocast and a real GradScaler (on CUDA)."""
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext
    scaler: Callable[[], Scaler] | None = None
    if options.precision.is_amp:
        dtype = options.precision.compute_dtype
        autocast = lambda: torch.autocast(device.type, dtype=dtype)
        if options.precision.uses_grad_scaler and device.type == "cuda":
            scaler = lambda: torch.amp.GradScaler("cuda")
    return StepConfig(mode=options.mode, optimizer=options.optimizer,
                      loss=options.loss if options.loss is not None else resolved.loss, loss_fn=options.loss_fn,
                      iterations=2, accum_steps=options.accum_steps, autocast=autocast, scaler_factory=scaler)


def measure_cpu(resolved: ResolvedModel, options: EstimateOptions | None = None, **option_values: Any) -> Measurement:
    """Peak CPU bytes of the real step, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    options = options or EstimateOptions.create(target=Target.CPU, **option_values)
    device = torch.device("cpu")
    module, inputs, _kv = _prepare(resolved, device, options)
    config = _config(resolved, options, device)
    before = storage_bytes([*module.parameters(), *module.buffers(), *inputs])
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(module, inputs, config)
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


def measure_cuda(resolved: ResolvedModel, options: EstimateOptions | None = None, *,
                 device: torch.device | None = None, **option_values: Any) -> Measurement:
    """``max_memory_allocated`` / ``max_memory_reserved`` of the real step on a GPU."""
    options = options or EstimateOptions.create(**option_values)
    device = device or torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    module = inputs = None
    try:
        gc.collect()
        torch.cuda.empty_cache()
        _warm_cublas(device)
        workspace = torch.cuda.memory_allocated(device)
        module, inputs, _kv = _prepare(resolved, device, options)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step(module, inputs, _config(resolved, options, device))
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
            seq_len: int | None = None, inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
            device: str | None = None, **option_values: Any) -> Measurement:
    """Measure the real step: on CUDA when available (or ``device="cuda..."``), else on CPU.
    ``option_values`` are :func:`memcalc.estimate`'s step options (optimizer, mode, precision...)."""
    request = make_request(model, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len, inputs=inputs,
                           **option_values)
    resolved = resolve(model, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len, inputs=inputs)
    use_cuda = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    if use_cuda:
        return measure_cuda(resolved, request.options, device=torch.device(device) if device else None)
    return measure_cpu(resolved, dataclasses.replace(request.options, target=Target.CPU))


def attach_measurement(report: MemoryReport, model: Any, **kwargs: Any) -> MemoryReport:
    """``report`` with a real measurement of the same configuration attached.

    A CUDA measurement is compared with ``peak_allocated`` (as CUDA counts it). A CPU one is
    compared with a CPU-faithful re-estimate (no CUDA kernel emulation, no CUDA workspaces,
    unrounded), since the CPU runs CPU kernels and its allocator does not round.
    """
    measured = measure(model, **kwargs)
    if measured.device.startswith("cuda"):
        compared = report.bytes.peak_allocated
    else:
        option_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        compared = estimate(model, **{**option_kwargs, "gpu": CPU}).peak_requested
    return dataclasses.replace(report, measurement=dataclasses.replace(measured, compared_with=compared))

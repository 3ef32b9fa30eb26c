"""Real measurement of the same step the estimator simulates — our accuracy is measured,
never assumed.

CUDA: free the cuBLAS workspaces earlier steps of the process left (each handle's is allocated
through the caching allocator at its first matmul and stays, so a process that measured a
training step before an inference one would count the backward thread's), build the real model
on the GPU, under amp-fp16 let the GradScaler back off to a scale its gradients fit (warm-up
runs), free the segments the build left cached (``empty_cache``: the step's reserved memory, not
the build's) and the warm-ups' workspaces, ``reset_peak_memory_stats``,
run the step program (two iterations, as the estimate does; or the chosen loop as written,
:mod:`memcalc.engine.loops`), read ``max_memory_allocated`` and ``max_memory_reserved``. With
``snapshot``, the caching allocator's history is recorded over the step alone (from the reset of
the peaks to the end of the step) and written as a ``torch.cuda.memory._snapshot()`` pickle:
what ``memcalc compare`` sets beside the estimate. An
OOM is a result ("measured: OOM"), not a crash. The optimizer runs in the implementation the
estimate resolved for the device (``resolve_impl``). Frozen parameters and LoRA adapters are
applied to the real model by the estimate's own code (:mod:`memcalc.stacks.peft`); a
quantized base is not measured (bitsandbytes' kernels are emulated, never run).

CPU (no GPU here): ``torch.profiler`` with ``profile_memory=True`` records every CPU
allocation and free with its size, in order; their running sum on top of the storages that
existed before the step (parameters, buffers, inputs) is the real peak. It is compared with
memcalc's estimate for this CPU (``gpu="cpu"``, :mod:`memcalc.targets.cpu.kernels`): the attention and
LSTM kernels the CPU runs and what they allocate inside, no CUDA workspaces, unrounded. The
note of the comparison names each op whose CPU memory that estimate does not follow (oneDNN's
convolutions, for one). Kineto's "profiler_start/stop" lines to the process's stderr are
silenced.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from memcalc.api import estimate_step
from memcalc.core.alloc_conf import alloc_conf_from_environment
from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError
from memcalc.core.output import check_writable, write_atomically
from memcalc.core.report import Measurement, MemoryReport
from memcalc.engine.compiled import compile_forward, warm_up
from memcalc.engine.loops import run_loop
from memcalc.engine.model import ModelInputs, ResolvedModel
from memcalc.engine.prepare import kv_cache_bytes, kv_prompt, prepare_step
from memcalc.engine.run import step_config
from memcalc.engine.step import Scaler, StepConfig, run_step
from memcalc.engine.step_spec import Step
from memcalc.stacks.float8 import float8_module
from memcalc.stacks.peft import finetune_module
from memcalc.targets.cpu.kernels import NOT_FOLLOWED

__all__ = ("RESERVED_SHOWN", "SNAPSHOT_ENTRIES", "allocator_settings_note", "attach_measurement", "cpu_comparison_note",
           "measure", "measure_cpu", "measure_cuda", "measured_device", "storage_bytes")


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _resolve(step: Step) -> ResolvedModel:
    """The step's model and inputs, resolved as the estimate resolves them (on meta)."""
    return step.resolved()


def _prepare(resolved: ResolvedModel, device: torch.device,
             step: Step) -> tuple[torch.nn.Module, ModelInputs, list[torch.Tensor]]:
    """The real model and inputs with the same transforms the estimate applies, and a KV
    cache of the estimated size when one is asked for: a transformers model's own StaticCache
    of that length, passed to its forward as the estimate passes it; for a model with no cache of
    its own (the zoo's plain-torch ones) a buffer of the same size stands for it.

    The fine-tuning is the estimate's too (:func:`~memcalc.stacks.peft.finetune_module`,
    in the estimate's order: adapters and freezing before the precision cast, which keeps the
    adapters' dtype), so frozen parameters get no gradient and no optimizer state here either.

    Raises:
        InvalidInputError: a quantized base (``finetune.quant``): memcalc emulates bitsandbytes'
            storage on meta tensors without running its kernels.
    """
    module, inputs = resolved.build_real(device)
    if not step.finetune.is_empty:
        module, _notes = finetune_module(module, step.finetune, precision=step.precision, mode=step.mode)
    if step.float8 is not None:  # torchao's conversion, as the estimate applies it
        module, _notes, _wrapper = float8_module(module, step.float8)
    inputs = resolved.step_inputs(inputs, own_loss=step.trains_own_loss)
    inputs, _ = prepare_step(module, inputs, step, containers=resolved.block_containers, model_name=resolved.name,
                             own_checkpointing=resolved.checkpointing)
    if step.compile or resolved.compiled:  # the real stack, compiled (kernels built) before the step is measured
        compile_forward(module, "inductor")
        warm_up(module, inputs, train=step.mode is Mode.TRAIN)
    keep: list[torch.Tensor] = []
    if step.kv_cache is not None:
        nbytes = kv_cache_bytes(module, inputs, step.precision, step.kv_cache, model_name=resolved.name,
                                decoder=resolved.decoder)
        if resolved.static_cache is not None:  # the model's own cache, filled by its forward, as estimated
            _batch, prompt = kv_prompt(inputs) or (0, 0)
            keywords, _tensors = resolved.static_cache(module, prompt + step.kv_cache)
            inputs = ModelInputs(inputs.args, {**inputs.kwargs, **keywords})
        else:
            keep.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
    return module, inputs, keep


def _config(resolved: ResolvedModel, step: Step, device: torch.device) -> StepConfig:
    """The engine's configuration of the step (:func:`memcalc.engine.run.step_config`), run for
    real: under ``torch.autocast``, with torch's GradScaler (on CUDA), for the two iterations
    the estimate covers."""
    autocast: Callable[[], AbstractContextManager[Any]] | None = None
    scaler: Callable[[], Scaler] | None = None
    if step.precision.is_amp:
        dtype = step.precision.compute_dtype
        autocast = lambda: torch.autocast(device.type, dtype=dtype)
        if step.precision.uses_grad_scaler and device.type == "cuda":
            scaler = lambda: torch.amp.GradScaler("cuda")
    return step_config(resolved, step, autocast=autocast, scaler=scaler, cuda=device.type == "cuda", iterations=2)


def _run(module: torch.nn.Module, inputs: ModelInputs, config: StepConfig, step: Step,
         traced_loop: bool) -> None:
    """The step the estimate traced: memcalc's loop (two iterations), or the chosen loop as
    written (:func:`memcalc.engine.loops.run_loop`), on real tensors."""
    if traced_loop:
        run_loop(module, inputs, config, step.loop)
    else:
        run_step(module, inputs, config)


def _existing(module: torch.nn.Module, inputs: ModelInputs, traced_loop: bool) -> list[torch.Tensor]:
    """The tensors there before the step: parameters, buffers and — for memcalc's loop, which
    reuses them — the inputs (another loop's batches are copies made as it draws them)."""
    return [*module.parameters(), *module.buffers(), *(() if traced_loop else inputs)]


def measure_cpu(step: Step, *, traced_loop: bool | None = None) -> Measurement:
    """Peak CPU bytes of the real step, from the profiler's allocation events.

    Args:
        step: the step (its model is built for real on the CPU).
        traced_loop: run ``step.loop`` as written even when it is the default one (as
            :func:`memcalc.engine.run.trace_model` does with the same flag); None: unless it is.

    Returns:
        The measurement (its note says what to compare it with).
    """
    from torch.profiler import ProfilerActivity, profile

    as_written = not step.loop.is_default if traced_loop is None else traced_loop
    device = torch.device("cpu")
    resolved = _resolve(step)
    module, inputs, _kv = _prepare(resolved, device, step)
    config = _config(resolved, step, device)
    before = storage_bytes(_existing(module, inputs, as_written))
    gc.collect()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _kineto_lines_silenced():
        prof.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
    try:
        _run(module, inputs, config, step, as_written)
    finally:
        with _kineto_lines_silenced():
            prof.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # untyped in torch
    peak = before + _profiler_peak(prof)
    return Measurement(device="cpu (torch.profiler)", peak_allocated=peak, note=_CPU_NOTE)


#: A CPU measurement's note until it is compared with an estimate for this CPU.
_CPU_NOTE = "CPU run; compare it with memcalc's estimate for this CPU (gpu=\"cpu\")"


@contextmanager
def _kineto_lines_silenced() -> Iterator[None]:
    """Kineto writes "USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start" (and
    ``profiler_stop``) to file descriptor 2 when the profiler starts and stops, past Python's
    ``sys.stderr``: point descriptor 2 at /dev/null for those two calls only, so that nothing
    the step itself prints is lost."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


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


#: How many allocator events a real snapshot keeps (``_record_memory_history``'s ring buffer):
#: a step of a 7B model makes some tens of thousands; the oldest are dropped past this.
SNAPSHOT_ENTRIES = 1_000_000


def measure_cuda(step: Step, *, device: torch.device | None = None, snapshot: str | None = None,
                 force: bool = False) -> Measurement:
    """``max_memory_allocated`` / ``max_memory_reserved`` of the real step on a GPU (``device``;
    None: torch's current one), as a fresh process runs it: with the cuBLAS workspaces its own
    matmuls allocate, none left by earlier steps. ``snapshot``: a path to write the step's
    allocator history to (``torch.cuda.memory._dump_snapshot``), recorded from the reset of the
    peaks to the end of the step (``force``: replacing the file there; else it is refused)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    module = inputs = None
    recording = False
    try:
        gc.collect()
        _clear_cublas_workspaces()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        resolved = _resolve(step)
        module, inputs, _kv = _prepare(resolved, device, step)
        traced_loop = not step.loop.is_default
        config, warmups = _steady_scaler(module, inputs, _config(resolved, step, device), step, traced_loop)
        torch.cuda.synchronize(device)
        _clear_cublas_workspaces()
        built_cache = _free_build_cache(device)
        if snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
            recording = True
        torch.cuda.reset_peak_memory_stats(device)
        _run(module, inputs, config, step, traced_loop)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        notes = [f"cuBLAS workspaces of earlier steps freed first (the step allocates its own, as in a fresh "
                 f"process; {before:,} B were allocated before the model was built)",
                 f"{RESERVED_SHOWN} ({built_cache:,} B cached by the build freed first)"]
        if snapshot is not None:
            _write_snapshot(snapshot, force=force)
            notes.append(f"the step's allocator history written to {snapshot} (memcalc compare {snapshot} MODEL "
                         "with this estimate's options sets it beside the estimate)")
        if (settings := allocator_settings_note(step)) is not None:
            notes.append(settings)
        if warmups:
            notes.append(f"GradScaler warmed up over {warmups} run{'s' if warmups > 1 else ''} until no "
                         "optimizer step was skipped (the steady state the estimate models)")
        return Measurement(device=f"cuda: {name}", peak_allocated=peak, peak_reserved=reserved, note="; ".join(notes))
    except torch.cuda.OutOfMemoryError as exc:
        note = str(exc).split("\n")[0]
        if recording and snapshot is not None:  # what led up to the OOM: what debugging one wants to see
            _write_snapshot(snapshot, force=force)
            note += f"; the step's allocator history up to the OOM written to {snapshot}"
        return Measurement(device=f"cuda: {name}", peak_allocated=None, oom=True, note=note)
    finally:
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)
        del module, inputs
        gc.collect()
        torch.cuda.empty_cache()


def allocator_settings_note(step: Step) -> str | None:
    """A note when the estimate modelled other allocator settings than this process runs under:
    PyTorch read ``PYTORCH_CUDA_ALLOC_CONF`` when it started, so ``--alloc-conf`` does not reach
    the real step (None when they agree)."""
    process = alloc_conf_from_environment()
    if step.alloc_conf.describe() == process.describe():
        return None
    return (f"the real step ran under this process's allocator settings ({process.describe() or 'the defaults'}), "
            f"not the estimate's ({step.alloc_conf.describe() or 'the defaults'}): set PYTORCH_CUDA_ALLOC_CONF "
            f"before starting Python to measure under them")


def _write_snapshot(path: str, *, force: bool) -> None:
    """``torch.cuda.memory._dump_snapshot(path)``: the allocator history recorded so far, as the
    pickle ``memcalc compare`` and https://pytorch.org/memory_viz read; whole or not at all."""
    dump: Callable[[str], None] = torch.cuda.memory._dump_snapshot
    write_atomically(Path(path), "snapshot", lambda temporary: dump(str(temporary)), force=force)


#: Warm-up runs at most for an amp-fp16 step's GradScaler to settle. Its scale starts at 2**16 and
#: halves at each iteration whose gradients overflow (torch/amp/grad_scaler.py, ``update``), so
#: 24 runs of two iterations each reach 2**-32.
SCALER_WARMUPS = 24


def _steady_scaler(module: torch.nn.Module, inputs: ModelInputs, config: StepConfig, step: Step,
                   traced_loop: bool) -> tuple[StepConfig, int]:
    """The step's configuration with one GradScaler for all runs, settled by warm-up runs; and
    how many it took (0 without a scaler).

    A fresh ``GradScaler`` starts at a scale of 2**16, where fp16 gradients often overflow: its
    ``step`` then skips ``optimizer.step()``, and a measured step allocates no optimizer state
    (the H100 suite's ResNet-50 amp-fp16 run had no momentum buffers: +3.1%). A training run
    spends its first iterations backing off and then steps every time; that steady state is what
    memcalc estimates, so the measurement runs until a run skips nothing (the scale did not
    fall), with the gradients of the warm-ups dropped, and measures the next run with the same
    scaler."""
    scaler = config.scaler_factory() if config.scaler_factory is not None else None
    if not isinstance(scaler, torch.amp.GradScaler):  # none (or not torch's: it has no scale to read)
        return config, 0
    shared = dataclasses.replace(config, scaler_factory=lambda: scaler)
    runs = 0
    while runs < SCALER_WARMUPS:
        scale = scaler.get_scale()
        _run(module, inputs, shared, step, traced_loop)
        runs += 1
        for parameter in module.parameters():
            parameter.grad = None
        if scaler.get_scale() >= scale:
            break
    gc.collect()
    return shared, runs


#: What a CUDA measurement's ``peak_reserved`` is, said in its note.
RESERVED_SHOWN = "reserved: the step's peak, the model build's cached segments freed before it (empty_cache)"


def _free_build_cache(device: torch.device) -> int:
    """Return to CUDA the segments the model's build left cached, and say how many bytes.

    Building a model on the GPU allocates and frees temporaries (initialisers, a cast from fp32
    to bf16 frees the fp32 copy), whose segments the caching allocator keeps. Left there, they
    count in ``max_memory_reserved`` after ``reset_peak_memory_stats`` — the peak restarts from
    the reserved bytes of now — and a 7B model built in fp32 and cast to bf16 then shows about
    twice the step's reserved memory. The estimate models the step alone (parameters allocated
    once, in order), so the measurement frees that cache first (``empty_cache`` releases only
    segments with no live block: the parameters' own stay)."""
    gc.collect()
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved(device)


def _clear_cublas_workspaces() -> None:
    """Free the cuBLAS (and cuBLASLt) workspaces of every handle and stream
    (``at::cuda::clearCublasWorkspaces``, which torch's own tests and CUDA graph trees call): a
    step measured after others then allocates the workspaces it needs itself, at its first
    matmul in forward and in backward, as the estimate models them."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def measured_device() -> str | None:
    """``"cuda:N"``, torch's current CUDA device — where :func:`measure` runs the step when no
    device is named — or None without a usable CUDA GPU (it measures on the CPU then).

    An estimate to compare with that measurement should be for this GPU
    (``estimate(gpu="cuda:N")``): the generic profile would model other kernels. Asking
    initialises CUDA, as the measurement will.
    """
    if not torch.cuda.is_available():
        return None
    return f"cuda:{torch.cuda.current_device()}"


def measure(step: Step, *, device: str | None = None, snapshot: str | None = None,
            force: bool = False) -> Measurement:
    """Measure the real step: on ``device`` (``"cuda:N"``) when given, else on the CPU for a step
    estimated for the CPU target (``gpu="cpu"``: its figure is the CPU's, on a GPU machine too),
    else on CUDA when available, else on the CPU (as this machine's CPU runs the step:
    :meth:`Step.on_cpu`).
    ``snapshot``: on CUDA, also write the step's allocator history there (:func:`measure_cuda`),
    replacing an existing file only with ``force``; the path is checked before the step runs.

    Raises:
        InapplicableOptionError: mode generate; or a snapshot asked of a CPU measurement.
        OutputExistsError: ``snapshot`` exists and ``force`` is False.
        PlotPathError: ``snapshot`` cannot be written (a missing or read-only folder).
    """
    if step.mode is Mode.GENERATE:
        raise InapplicableOptionError(
            "measuring mode generate is not implemented: the measurement runs memcalc's step program, and a "
            "generate() call's end depends on the tokens it draws",
            hint="Compare with a real model.generate(...) under torch.cuda.max_memory_allocated() or the CPU "
                 "profiler (tests/hf_reference/test_generate.py does the latter).")
    if snapshot is not None:
        check_writable(Path(snapshot), "snapshot", force=force)
    use_cuda = (device or "").startswith("cuda") or (
        device is None and step.emulate_cuda and torch.cuda.is_available())
    if use_cuda:
        return measure_cuda(step, device=torch.device(device) if device else None, snapshot=snapshot, force=force)
    if snapshot is not None:
        raise InapplicableOptionError(
            "a real memory snapshot is the CUDA caching allocator's history: this measurement runs on the CPU "
            "(no CUDA GPU here)",
            hint="Leave out the snapshot to measure on the CPU, or run on a machine with a CUDA GPU.")
    return measure_cpu(step.on_cpu())


def attach_measurement(report: MemoryReport, step: Step, *, device: str | None = None,
                       snapshot: str | None = None, force: bool = False) -> MemoryReport:
    """``report`` (the estimate of ``step``) with a real measurement of the same step attached
    (``snapshot``: on CUDA, the step's allocator history written there too, replacing a file
    only with ``force``: :func:`measure`).

    A CUDA measurement is compared with ``peak_allocated`` (as CUDA counts it). A CPU one is
    compared with the estimate for this CPU (its own kernels, no CUDA workspaces, unrounded:
    the CPU allocator does not round), and its note names the ops that estimate cannot follow.
    """
    measured = measure(step, device=device, snapshot=snapshot, force=force)
    if measured.device.startswith("cuda"):
        compared = report.bytes.peak_allocated
    else:  # the CPU target's report is already that estimate
        cpu_report = report if report.gpu.is_cpu else estimate_step(dataclasses.replace(step.on_cpu(),
                                                                                         record_costs=False))
        compared = cpu_report.bytes.peak_allocated
        measured = dataclasses.replace(measured, note=cpu_comparison_note(cpu_report))
    return dataclasses.replace(report, measurement=dataclasses.replace(measured, compared_with=compared))


def cpu_comparison_note(cpu_report: MemoryReport) -> str:
    """What a CPU measurement is compared with, and each op whose CPU memory ``cpu_report``
    (an estimate with ``gpu="cpu"``) does not follow, by name and count."""
    unfollowed = [f"{op} ×{n} (memory inside the kernel, not modelled)" for op, n in cpu_report.unsupported_ops]
    unfollowed += [line.removeprefix(NOT_FOLLOWED).strip() for line in cpu_report.notes
                   if line.startswith(NOT_FOLLOWED)]
    note = "compared with the estimate for this CPU: its own kernels, no CUDA workspaces, unrounded"
    if unfollowed:
        note += f"; {NOT_FOLLOWED} " + "; ".join(unfollowed)
    return note

"""How fast each catalogue GPU computes and moves bytes, and the step time of a report on it.

:data:`PERFORMANCE` holds, per catalogue key, the dense peak FLOP/s of each math mode and the
memory bandwidth, each naming the NVIDIA document it is read from: the ``performance`` of each
GPU's record (``memcalc/targets/cuda/gpus/gpus.toml``). NVIDIA's datasheets print the
tensor-core figures "with sparsity" (2:4 structured sparsity, twice the dense rate); training
runs dense, so those are halved there.
The GeForce figures are the "FP32 accumulate" column of the architecture whitepapers: PyTorch's
half and bfloat16 GEMMs accumulate in float32 (``CUBLAS_COMPUTE_32F`` in
aten/src/ATen/cuda/CUDABlas.cpp, ``gemm_internal_cublas<at::Half>``), which GeForce cards run at
half the FP16-accumulate rate.

The efficiency of each op class, the fixed time per kernel, the gap between kernels and the
host's time per kernel (:data:`EFFICIENCY`, :data:`KERNEL_SECONDS`, :data:`LAUNCH_OVERHEAD`,
:data:`HOST_SECONDS`) are fitted to an H200's profiled kernels and real step times
(:mod:`memcalc.timing.calibration`). On another GPU the same fractions apply to that GPU's
datasheet peaks: an assumption, stated with every time (:func:`basis`) with how it held on a
healthy H100, as is the spread the fit leaves on the steps it was fitted to. Where a GPU's own
steps were measured (:data:`MEASURED_BANDWIDTH`: the H100 80GB), its bandwidth term is fitted to
them instead: datasheet scaling timed the H100's memory-bound kernels 1.43x the H200's (their
bandwidths' ratio), and its real steps ran only 1.08-1.16x the H200's.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.core.categories import Mode
from memcalc.core.errors import InvalidInputError, internal_errors_named
from memcalc.core.gpu import GENERIC, GpuPerformance, GpuProfile
from memcalc.core.report import MemoryReport
from memcalc.core.throughput import DataLoaderSetup, DeviceRates, LoaderAdvice, OpClass, StepTime, advise_loader
from memcalc.targets.cuda.gpus.catalogue import get_gpu, records
from memcalc.timing import fitted

__all__ = (
    "EFFICIENCY",
    "FITTED_GPU",
    "HOST_SECONDS",
    "KERNEL_SECONDS",
    "LAUNCH_OVERHEAD",
    "MEASURED_BANDWIDTH",
    "PERFORMANCE",
    "GpuPerformance",
    "basis",
    "check_timeable",
    "check_timeable_mode",
    "device_rates",
    "loader_advice",
    "step_time",
    "with_time",
)


#: Per catalogue key, the GPU's peaks and bandwidth: a view of the catalogue's records
#: (``memcalc/targets/cuda/gpus/gpus.toml``); a GPU whose record gives no figures is absent.
PERFORMANCE: dict[str, GpuPerformance] = {
    r.key: r.performance for r in records() if r.performance is not None}

#: Efficiency per op class (fraction of the binding datasheet peak a large kernel reaches),
#: fitted to the H200's kernels (:mod:`memcalc.timing.fitted`, written by
#: ``scripts/fit_step_time.py``).
EFFICIENCY: dict[OpClass, float] = dict(fitted.EFFICIENCY)
#: Seconds each kernel of a class takes besides its roofline time (fitted likewise).
KERNEL_SECONDS: dict[OpClass, float] = dict(fitted.KERNEL_SECONDS)
#: Seconds between kernels: the launch and eager PyTorch's host-side dispatch (fitted likewise).
LAUNCH_OVERHEAD: float = fitted.GAP_SECONDS
#: The host's seconds per kernel (eager dispatch), the floor of a host-bound step (fitted likewise).
HOST_SECONDS: float = fitted.HOST_SECONDS
#: The GPU the coefficients were measured on.
FITTED_GPU = fitted.GPU
#: Per catalogue key, the factor on the datasheet bandwidth fitted to that GPU's own measured
#: steps (fitted likewise; a GPU absent here is scaled by its datasheet alone).
MEASURED_BANDWIDTH: dict[str, float] = dict(fitted.MEASURED_BANDWIDTH)


def basis(gpu_key: str) -> str:
    """What a time on ``gpu_key`` rests on, said beside it."""
    fitted_on = (f"±{fitted.SPREAD:.0%} on the {len(fitted.TIMED)} steps it was fitted to, on an "
                 f"{fitted.DEVICE} with torch {fitted.TORCH}")
    if gpu_key == FITTED_GPU:
        return fitted_on
    if gpu_key in MEASURED_BANDWIDTH:
        low, high = fitted.MEASURED_RANGE
        held_low, held_high = fitted.MEASURED_HELD_OUT_RANGE
        return (f"{fitted_on}; {gpu_key} scaled from its datasheet peaks, its bandwidth term fitted to "
                f"{fitted.MEASURED_STEPS} of its own steps (its memory-bound kernels reach "
                f"{MEASURED_BANDWIDTH[gpu_key]:.2f}x the {fitted.DEVICE}'s fraction of the datasheet bandwidth; "
                f"predicted / measured {low:.2f}-{high:.2f}, each left out of the fit {held_low:.2f}-{held_high:.2f})")
    low, high = fitted.RECHECK_RANGE
    return (f"{fitted_on}; {gpu_key} scaled from its datasheet peaks, an assumption (on {fitted.RECHECK_STEPS} "
            f"steps of an {fitted.RECHECK_GPU}, predicted / measured {low:.2f}-{high:.2f})")


def device_rates(gpu: GpuProfile, *, efficiency: dict[OpClass, float] | None = None,
                 launch_overhead: float | None = None,
                 kernel_seconds: dict[OpClass, float] | None = None,
                 host_seconds: float | None = None, bandwidth_scale: float | None = None) -> DeviceRates:
    """What the roofline needs about ``gpu``: its peaks and bandwidth from :data:`PERFORMANCE`
    (the bandwidth times its :data:`MEASURED_BANDWIDTH` factor, or ``bandwidth_scale``) with the
    fitted (or the given) efficiencies, seconds per kernel and launch overhead.

    Raises:
        InvalidInputError: no figures for this GPU (the generic profile, a GPU without a source).
    """
    figures = PERFORMANCE.get(gpu.key)
    if figures is None:
        known = ", ".join(PERFORMANCE)
        why = ("no GPU was named: a step time needs a GPU's peak FLOP/s and memory bandwidth" if gpu.key == "generic"
               else f"memcalc has no sourced peak FLOP/s and bandwidth for {gpu.name}")
        raise InvalidInputError(f"cannot time the step: {why}", hint=f"Estimate for one of: {known} (--gpu NAME).")
    if bandwidth_scale is not None and not bandwidth_scale > 0:
        raise InvalidInputError(f"bandwidth_scale must be positive, got {bandwidth_scale}")
    chosen = {**EFFICIENCY, **(efficiency or {})}
    fixed = {**KERNEL_SECONDS, **(kernel_seconds or {})}
    overridden = any(v is not None for v in (efficiency, launch_overhead, kernel_seconds, host_seconds,
                                             bandwidth_scale))
    scale = MEASURED_BANDWIDTH.get(gpu.key, 1.0) if bandwidth_scale is None else bandwidth_scale
    source = figures.source
    if scale != 1.0:
        given = "given" if bandwidth_scale is not None else f"fitted to its {fitted.MEASURED_STEPS} measured steps"
        source += f"; the bandwidth term times {scale:.4g} ({given})"
    return DeviceRates(gpu=gpu.key, peaks=figures.peaks, bandwidth=figures.bandwidth * scale,
                       efficiency=tuple((c, chosen[c]) for c in OpClass),
                       launch_overhead=LAUNCH_OVERHEAD if launch_overhead is None else launch_overhead,
                       source=source, kernel_seconds=tuple((c, fixed[c]) for c in OpClass),
                       spread=0.0 if overridden else fitted.SPREAD,
                       basis="coefficients given by the caller" if overridden else basis(gpu.key),
                       host_seconds=HOST_SECONDS if host_seconds is None else host_seconds)


def check_timeable(gpu: str | GpuProfile | None) -> None:
    """Refuse, before any estimate, a step that could not be timed: no GPU named (or the CPU
    target, ``"cpu"``) or a GPU without sourced figures.

    Raises:
        InvalidInputError: what is missing and which GPUs can be timed.
    """
    if gpu is None or (isinstance(gpu, str) and gpu.strip().lower() == "cpu"):
        gpu = GENERIC  # refused below, naming the GPUs that can be timed
    device_rates(get_gpu(gpu) if isinstance(gpu, str) else gpu)


def check_timeable_mode(mode: Mode) -> None:
    """Refuse to time a generation: the roofline's phases and its tokens per step are those of
    one training or forward step, not of a prefill and its decode steps.

    Raises:
        InvalidInputError: mode generate.
    """
    if mode is Mode.GENERATE:
        raise InvalidInputError("the time of a generation (mode generate) is not modelled: the step-time model "
                                "times one training or forward step",
                                hint="Leave out --time; time one decode step as a forward (mode inference) instead.")


@internal_errors_named("in step_time")
def step_time(report: MemoryReport, *, efficiency: dict[OpClass, float] | None = None,
              launch_overhead: float | None = None, kernel_seconds: dict[OpClass, float] | None = None,
              host_seconds: float | None = None, bandwidth_scale: float | None = None) -> StepTime:
    """The time of the report's step on the report's GPU, from a roofline per traced kernel.

    Each kernel takes the larger of FLOPs ÷ (its math mode's peak × its class's efficiency) and
    bytes moved ÷ (bandwidth × efficiency), plus its class's fixed seconds per kernel and the
    gap between kernels; the step is their sum (one stream), or the host's time per kernel × the
    kernels when that is longer (a host-bound step). The coefficients are fitted to an H200
    (:mod:`memcalc.timing.calibration`); the time carries the spread of that fit. A GPU whose own
    steps were measured (:data:`MEASURED_BANDWIDTH`) has its bandwidth term fitted to them.
    Under a multi-GPU strategy: the busiest GPU's step, without its communication.

    Args:
        report: what :func:`memcalc.estimate` returned for a named GPU (``gpu="a100-80gb"``).
        efficiency: override the fitted efficiency of some op classes (fractions of peak).
        launch_overhead: override the fitted gap between kernels (seconds per kernel).
        kernel_seconds: override the fitted fixed seconds per kernel of some op classes.
        host_seconds: override the fitted host seconds per kernel (0: never host-bound).
        bandwidth_scale: override the factor on the GPU's datasheet bandwidth (1.0: the datasheet's;
            default: the one fitted to its measured steps, else 1.0).

    Returns:
        The :class:`~memcalc.core.throughput.StepTime`: seconds, samples/s, tokens/s, per phase
        and per op class, with the assumptions it rests on.

    Raises:
        InvalidInputError: the report has no named GPU with known figures, or no traced step.
    """
    check_timeable_mode(report.mode)
    if not report.gpu_named:
        device_rates(GENERIC)  # raises, naming the GPUs that can be timed
    rates = device_rates(report.gpu, efficiency=efficiency, launch_overhead=launch_overhead,
                         kernel_seconds=kernel_seconds, host_seconds=host_seconds, bandwidth_scale=bandwidth_scale)
    try:
        return report.time_on(rates)
    except ValueError as exc:
        raise InvalidInputError(f"cannot time the step: {exc}") from None


def with_time(report: MemoryReport, *, efficiency: dict[OpClass, float] | None = None,
              launch_overhead: float | None = None, kernel_seconds: dict[OpClass, float] | None = None,
              host_seconds: float | None = None, bandwidth_scale: float | None = None) -> MemoryReport:
    """``report`` with its :attr:`~memcalc.core.report.MemoryReport.time` filled in (its JSON
    then gains a ``"time"`` key) and a note for each op whose FLOPs could not be counted; the
    arguments as for :func:`step_time`."""
    time = step_time(report, efficiency=efficiency, launch_overhead=launch_overhead, kernel_seconds=kernel_seconds,
                     host_seconds=host_seconds, bandwidth_scale=bandwidth_scale)
    notes = report.notes + tuple(n for n in time.flops.failure_notes() if n not in report.notes)
    return replace(report, time=time, notes=notes)


def loader_advice(report: MemoryReport, setup: DataLoaderSetup | None = None) -> LoaderAdvice:
    """Whether a DataLoader keeps the GPU fed at the report's step time, and the host memory it
    holds (:func:`memcalc.core.throughput.advise_loader`).

    Args:
        report: an estimate for a GPU with figures (its ``time`` is used when set, else computed).
        setup: the loader (None: ``DataLoader``'s defaults, no workers); its ``sample_bytes``
            defaults to the estimate's input batch (and targets) per sample, as the GPU sees it.

    Returns:
        The advice: host memory, the pace each worker must keep, and, given a measured load time
        per sample, the workers needed and whether the loader is the bottleneck.

    Raises:
        InvalidInputError: the step cannot be timed (see :func:`step_time`).
    """
    time = report.time if report.time is not None else step_time(report)
    inputs = report.textbook.input_bytes if report.textbook is not None else report.bytes.inputs
    return advise_loader(time, setup or DataLoaderSetup(), batch_size=report.batch_size,
                         sample_bytes=max(1, inputs // max(report.batch_size, 1)))

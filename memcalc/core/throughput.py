"""The vocabulary of step time: FLOPs counted per op while the step is traced
(:class:`StepFlops`), what a roofline needs to know about a GPU (:class:`DeviceRates`), and the
time it predicts (:class:`StepTime`).

The counting lives in :mod:`memcalc.timing.flops`, the GPUs' peaks in
:mod:`memcalc.timing.performance`; these are frozen records with ``to_dict()``, like the rest
of the report. FLOPs follow ``torch.utils.flop_counter``'s convention: one multiply-add is two
FLOPs, and only the ops with a formula there (matrix products, convolutions, attention) count;
every other op is timed by the bytes it moves (see :class:`StepTime`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Protocol

from memcalc.core.errors import InvalidInputError
from memcalc.core.units import parse_bytes

__all__ = (
    "PHASES",
    "ClassTime",
    "CostSource",
    "DataLoaderSetup",
    "DeviceRates",
    "LoaderAdvice",
    "OpClass",
    "PhaseCost",
    "StepFlops",
    "StepTime",
    "advise_loader",
)


class OpClass(str, enum.Enum):
    """What bounds a kernel, and so which efficiency factor applies to it."""

    MATMUL = "matmul"  # mm, addmm, bmm, baddbmm, _scaled_mm (cuBLAS)
    # a GEMM with a dimension that is not a multiple of 16 bytes (GPT-2's 50,257-word vocabulary):
    # cuBLAS can only use its "align1" kernels, an order of magnitude slower (profile.json, gpt2)
    MATMUL_UNALIGNED = "matmul-unaligned"
    CONV = "conv"  # convolution and its backward (cuDNN)
    ATTENTION = "attention"  # fused SDPA kernels (flash, memory-efficient, cuDNN), forward and backward
    # batch, layer, group and RMS norm, forward and backward: memory-bound in their bytes, but
    # their reductions run far below the bandwidth (30 of the 60 ms of resnet50's bf16 step)
    NORMALIZATION = "normalization"
    MEMORY = "memory-bound"  # elementwise, reductions, copies: no FLOP formula
    MULTI_TENSOR = "multi-tensor"  # torch.optim's foreach / fused kernels (multi_tensor_apply)


#: The phases of :class:`StepFlops` and :class:`StepTime`, in step order. ``recompute`` is the
#: part of backward that re-runs checkpointed forwards (activation checkpointing).
PHASES = ("forward", "loss", "backward", "recompute", "optimizer", "zero_grad")


@dataclass(frozen=True)
class PhaseCost:
    """One phase of the step: FLOPs, bytes its kernels move, kernels launched, and (in a
    :class:`StepTime`) the seconds the roofline gives it."""

    phase: str
    flops: int
    bytes_moved: int
    kernels: int
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of one phase."""
        return {"phase": self.phase, "flops": self.flops, "bytes_moved": self.bytes_moved, "kernels": self.kernels,
                "seconds": self.seconds}


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step (all micro-batches of an accumulation step, one optimizer step),
    counted per aten op as the step was traced.

    ``phases``: one entry per phase that ran (:data:`PHASES` order); ``backward`` excludes the
    recomputation of checkpointed blocks, which is ``recompute``. ``modules``: FLOPs of each
    module with its submodules (forward, recomputation and the backward attributed to it), in
    the order the forward first ran them; backward and recomputation belong to the module whose
    output gradient arrived last (:class:`memcalc.engine.trace.ModuleTracker`), which, under
    block checkpointing, is a module of the block being recomputed. ``ops``: FLOPs per aten op, largest first.
    ``uncounted``: ops that do a matrix product's arithmetic but have no FLOP formula here (an
    RNN kernel, a quantized matmul, another library's kernel), with their call counts: the
    total misses their FLOPs, and their time is their bytes'. Ops that
    run only at the first optimizer step (creating the optimizer state) are left out: the
    figures are those of a step in the steady state. ``failed``: ops whose FLOPs or bytes could
    not be worked out because a formula raised (torch's own formula of an older release, say),
    with the error: their FLOPs are left out of the total, never guessed, and the memory
    estimate does not depend on them.
    """

    total: int
    phases: tuple[PhaseCost, ...]
    modules: tuple[tuple[str, int], ...] = ()
    ops: tuple[tuple[str, int], ...] = ()
    uncounted: tuple[tuple[str, int], ...] = ()
    failed: tuple[tuple[str, str], ...] = ()

    def phase(self, name: str) -> int:
        """FLOPs of one phase (``"forward"``, ``"backward"``, ``"recompute"``, ...); 0 if it did not run."""
        return next((p.flops for p in self.phases if p.phase == name), 0)

    def module(self, name: str) -> int:
        """FLOPs of one module and its submodules (0 for a module that computed nothing)."""
        return next((f for m, f in self.modules if m == name), 0)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: total, per phase, per module, per op."""
        return {"total": self.total, "phases": {p.phase: p.flops for p in self.phases},
                "modules": dict(self.modules), "ops": dict(self.ops), "uncounted": dict(self.uncounted),
                "failed": dict(self.failed)}

    def failure_notes(self) -> tuple[str, ...]:
        """One report note per op in :attr:`failed`: which op, and what its formula raised."""
        return tuple(f"FLOPs of {op} are not counted (its formula failed: {error}); the memory figures do not "
                     f"depend on them" for op, error in self.failed)


@dataclass(frozen=True)
class DeviceRates:
    """What the roofline needs to know about one GPU.

    ``peaks``: dense FLOP/s by math mode (``"fp32"``: CUDA cores; ``"tf32"``, ``"fp16"``,
    ``"bf16"``, ``"fp8"``: tensor cores), a mode the GPU lacks left out. ``bandwidth``: device
    memory bytes/s. ``efficiency``: the fraction of the binding peak each op class reaches on a
    large problem; ``kernel_seconds``: the fixed time each kernel of a class takes besides (its
    ramp-up and tail: why a small kernel is far from peak); ``launch_overhead``: the gap each
    kernel adds between kernels (the launch and eager PyTorch's host-side dispatch). All three are
    fitted to real kernels (:mod:`memcalc.timing.calibration`). ``host_seconds``: the host's
    time per kernel (eager PyTorch's dispatch of the op that launches it), fitted likewise: a step
    is never shorter than its kernels × this, since a GPU that finishes first waits on the host
    (small steps are host-bound). ``spread``: the relative error
    the fit leaves on the steps it was fitted to (the ± of the time), and ``basis``: what the
    figures rest on, said beside the time. ``tf32_conv`` / ``tf32_matmul``:
    whether float32 convolutions / matrix products run on TF32 tensor cores (PyTorch's defaults:
    ``torch.backends.cudnn.allow_tf32 = True``, ``torch.backends.cuda.matmul.allow_tf32 =
    False``).
    """

    gpu: str
    peaks: tuple[tuple[str, float], ...]
    bandwidth: float
    efficiency: tuple[tuple[OpClass, float], ...]
    launch_overhead: float
    tf32_conv: bool = True
    tf32_matmul: bool = False
    source: str = ""
    kernel_seconds: tuple[tuple[OpClass, float], ...] = ()
    spread: float = 0.0
    basis: str = ""
    host_seconds: float = 0.0

    def peak(self, op_class: OpClass, dtype: str) -> tuple[str, float]:
        """The math mode a kernel of ``op_class`` on ``dtype`` (``"float32"``, ``"bfloat16"``,
        ...) runs in, and its dense peak FLOP/s. A mode the GPU lacks falls back to the next
        one that runs it (bf16 without bf16 tensor cores: fp32, as PyTorch does on sm70/sm75)."""
        peaks = dict(self.peaks)
        wanted: tuple[str, ...]
        if dtype.startswith("float8"):
            wanted = ("fp8", "fp16", "fp32")
        elif dtype == "float16":
            wanted = ("fp16", "fp32")
        elif dtype == "bfloat16":
            wanted = ("bf16", "fp32")
        elif (op_class is OpClass.CONV and self.tf32_conv) or (
                op_class in (OpClass.MATMUL, OpClass.MATMUL_UNALIGNED) and self.tf32_matmul):
            wanted = ("tf32", "fp32")
        else:
            wanted = ("fp32",)
        for mode in wanted:
            if mode in peaks:
                return mode, peaks[mode]
        return "fp32", peaks.get("fp32", 0.0)

    def efficiency_of(self, op_class: OpClass) -> float:
        """The efficiency factor of ``op_class`` (see the class docstring)."""
        return dict(self.efficiency)[op_class]

    def kernel_seconds_of(self, op_class: OpClass) -> float:
        """The fixed seconds each kernel of ``op_class`` takes besides its roofline time (0 when not given)."""
        return dict(self.kernel_seconds).get(op_class, 0.0)


@dataclass(frozen=True)
class ClassTime:
    """Where the time goes, by op class: kernels, FLOPs, bytes, the seconds the roofline gives
    them, how many of those seconds were bound by compute, and the efficiency assumed."""

    op_class: OpClass
    kernels: int
    flops: int
    bytes_moved: int
    seconds: float
    compute_bound_seconds: float
    efficiency: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of one op class."""
        return {"class": self.op_class.value, "kernels": self.kernels, "flops": self.flops,
                "bytes_moved": self.bytes_moved, "seconds": self.seconds,
                "compute_bound_seconds": self.compute_bound_seconds, "efficiency": self.efficiency}


@dataclass(frozen=True)
class StepTime:
    """The step's time on one GPU from a roofline per op: each kernel takes the larger of its
    compute time (FLOPs ÷ (the peak of its math mode × its class's efficiency)) and its memory
    time (bytes read and written ÷ (bandwidth × efficiency)), plus its class's fixed time per
    kernel and the gap between kernels (:class:`DeviceRates`).

    ``spread``: the relative error the step-time model leaves on the measured steps it was fitted
    to, so that the time is ``seconds × (1 ± spread)`` on such a step (:attr:`low`,
    :attr:`high`); ``basis``: what the figure rests on (the GPU it was fitted on, and how other
    GPUs are scaled), said beside it.

    ``samples`` per step is ``batch × accumulation steps``; ``tokens`` is that times the
    sequence length for a model taking token ids (None otherwise). ``assumptions`` are the
    efficiency factors and the launch overhead the figure rests on, labelled so in the output.
    One GPU's step: under a multi-GPU strategy the busiest GPU's, communication not timed.
    """

    gpu: str
    seconds: float
    samples: int
    tokens: int | None
    phases: tuple[PhaseCost, ...]
    classes: tuple[ClassTime, ...]
    flops: StepFlops
    launch_seconds: float
    assumptions: tuple[tuple[str, float], ...]
    source: str = ""
    spread: float = 0.0
    basis: str = ""

    @property
    def low(self) -> float:
        """The low end of the interval: ``seconds × (1 - spread)``."""
        return self.seconds * (1 - self.spread)

    @property
    def high(self) -> float:
        """The high end of the interval: ``seconds × (1 + spread)``."""
        return self.seconds * (1 + self.spread)

    @property
    def samples_per_second(self) -> float:
        """Samples per second at this step time."""
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens per second (None for a model that does not take token ids)."""
        return None if self.tokens is None else (self.tokens / self.seconds if self.seconds else 0.0)

    @property
    def flops_per_second(self) -> float:
        """The FLOP rate this time implies (counted FLOPs ÷ seconds)."""
        return self.flops.total / self.seconds if self.seconds else 0.0

    def phase_seconds(self, name: str) -> float:
        """Seconds of one phase (0 if it did not run)."""
        return next((p.seconds for p in self.phases if p.phase == name), 0.0)

    def to_dict(self) -> dict[str, Any]:
        """The JSON ``time`` object (added to a report's JSON only when a time was computed)."""
        return {"gpu": self.gpu, "seconds": self.seconds, "samples": self.samples, "tokens": self.tokens,
                "samples_per_second": self.samples_per_second, "tokens_per_second": self.tokens_per_second,
                "flops_per_second": self.flops_per_second, "launch_seconds": self.launch_seconds,
                "phases": [p.to_dict() for p in self.phases], "classes": [c.to_dict() for c in self.classes],
                "flops": self.flops.to_dict(), "assumptions": dict(self.assumptions), "source": self.source,
                "spread": self.spread, "seconds_low": self.low, "seconds_high": self.high, "basis": self.basis}


class CostSource(Protocol):
    """What a report keeps to compute its FLOPs and time when asked
    (:class:`memcalc.timing.flops.StepCosts`)."""

    def flops(self) -> StepFlops:
        """The step's FLOPs per phase, module and op."""

    def time(self, rates: DeviceRates) -> StepTime:
        """The step's time on the GPU of ``rates``."""



#: ``DataLoader(prefetch_factor=None)`` with workers: 2 batches per worker in flight
#: (torch/utils/data/dataloader.py, ``DataLoader.__init__``; ``_try_put_index`` keeps at most
#: ``prefetch_factor × num_workers`` batches outstanding).
DEFAULT_PREFETCH_FACTOR = 2
_LOADER_KEYS = {"workers": "num_workers", "num_workers": "num_workers", "prefetch": "prefetch_factor",
                "prefetch_factor": "prefetch_factor", "pin": "pin_memory", "pin_memory": "pin_memory",
                "sample_bytes": "sample_bytes"}


@dataclass(frozen=True)
class DataLoaderSetup:
    """The user's ``torch.utils.data.DataLoader``: workers, prefetch per worker, pinned memory,
    the bytes of one sample as the loader yields it (None: the estimate's input bytes per
    sample) and, when measured, the time one worker takes to load a sample."""

    num_workers: int = 0
    prefetch_factor: int = DEFAULT_PREFETCH_FACTOR
    pin_memory: bool = False
    sample_bytes: int | None = None
    sample_load_ms: float | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.prefetch_factor < 1:
            raise InvalidInputError(f"a DataLoader needs num_workers ≥ 0 and prefetch_factor ≥ 1, got "
                                    f"{self.num_workers} and {self.prefetch_factor}")
        if (self.sample_bytes is not None and self.sample_bytes < 1) or (
                self.sample_load_ms is not None and not self.sample_load_ms > 0):
            raise InvalidInputError("the sample's bytes and its load time must be positive")

    @classmethod
    def parse(cls, spec: str, *, sample_load_ms: float | None = None) -> DataLoaderSetup:
        """``"workers=8,prefetch=2,pin=yes,sample-bytes=600KiB"`` (keys may be DataLoader's own
        names: ``num_workers``, ``prefetch_factor``, ``pin_memory``); an empty spec: the defaults.

        Raises:
            InvalidInputError: an unknown key or a value that is not one.
        """
        values: dict[str, Any] = {"sample_load_ms": sample_load_ms}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, text = item.partition("=")
            field_name = _LOADER_KEYS.get(key.strip().lower().replace("-", "_"))
            if field_name is None or not text.strip():
                raise InvalidInputError(f"{item!r} is not a DataLoader setting",
                                        hint="e.g. workers=8,prefetch=2,pin=yes,sample-bytes=600KiB")
            values[field_name] = _loader_value(field_name, text.strip())
        return cls(**values)


def _loader_value(name: str, text: str) -> int | bool:
    if name == "pin_memory":
        if text.lower() not in ("yes", "no", "true", "false", "1", "0", "on", "off"):
            raise InvalidInputError(f"pin={text!r}: say yes or no")
        return text.lower() in ("yes", "true", "1", "on")
    if name == "sample_bytes":
        return parse_bytes(text)
    try:
        return int(text)
    except ValueError:
        raise InvalidInputError(f"{name}={text!r} is not a whole number") from None


@dataclass(frozen=True)
class LoaderAdvice:
    """What the DataLoader of :class:`DataLoaderSetup` holds in host memory and whether it keeps
    the GPU fed at the step's time (see :func:`advise_loader`)."""

    setup: DataLoaderSetup
    batch_size: int
    sample_bytes: int
    batches_in_flight: int  # prefetch_factor × num_workers (0 without workers)
    shared_memory_bytes: int  # batches the workers made, waiting in shared memory
    pinned_bytes: int  # pinned host buffers (pin_memory), each rounded up to a power of two
    host_bytes: int  # the loader's host memory at most: shared + pinned + the batch in use
    gpu_samples_per_second: float  # what the GPU consumes at the step time
    worker_ms_per_sample: float | None  # each worker must produce a sample every this many ms
    loader_samples_per_second: float | None  # given a load time: what the loader delivers
    workers_needed: int | None  # given a load time: the fewest workers that keep the GPU fed
    samples_per_second: float | None  # given a load time: the rate of GPU and loader together

    @property
    def loader_bound(self) -> bool | None:
        """True when the loader, not the GPU, sets the pace (None without a load time)."""
        if self.samples_per_second is None:
            return None
        return self.samples_per_second < self.gpu_samples_per_second * (1 - 1e-9)

    @property
    def gpu_idle(self) -> float | None:
        """The fraction of the time the GPU waits for data (None without a load time)."""
        if self.samples_per_second is None or not self.gpu_samples_per_second:
            return None
        return max(0.0, 1 - self.samples_per_second / self.gpu_samples_per_second)

    def to_dict(self) -> dict[str, Any]:
        """The JSON ``data_loader`` object."""
        return {"num_workers": self.setup.num_workers, "prefetch_factor": self.setup.prefetch_factor,
                "pin_memory": self.setup.pin_memory, "sample_load_ms": self.setup.sample_load_ms,
                "sample_bytes": self.sample_bytes, "batch_size": self.batch_size,
                "batches_in_flight": self.batches_in_flight, "shared_memory_bytes": self.shared_memory_bytes,
                "pinned_bytes": self.pinned_bytes, "host_bytes": self.host_bytes,
                "gpu_samples_per_second": self.gpu_samples_per_second,
                "worker_ms_per_sample": self.worker_ms_per_sample,
                "loader_samples_per_second": self.loader_samples_per_second, "workers_needed": self.workers_needed,
                "samples_per_second": self.samples_per_second, "loader_bound": self.loader_bound,
                "gpu_idle": self.gpu_idle}


def advise_loader(time: StepTime, setup: DataLoaderSetup, *, batch_size: int, sample_bytes: int) -> LoaderAdvice:
    """The DataLoader's host memory and pace against the GPU's.

    Host memory (upper bounds): with workers, ``prefetch_factor × num_workers`` batches in
    flight, made by the workers and waiting in shared memory; with ``pin_memory``, the pin
    thread copies each into pinned memory from PyTorch's CachingHostAllocator, which rounds
    every block up to a power of two and keeps it cached (ATen/core/CachingHostAllocator.h,
    ``allocate``: "Round up the allocation to the nearest power of two"): the batches in flight
    and the one in use. Pace: the GPU consumes ``samples / step time``; ``num_workers``
    workers each load a batch sample by sample, together ``num_workers / load time`` samples a
    second, overlapped with the step; without workers the main process loads each batch
    between steps, in series with it.

    Args:
        time: the step's time (its samples and seconds).
        setup: the loader.
        batch_size: samples per batch the loader yields (the micro-batch).
        sample_bytes: one sample's bytes when ``setup`` does not say.

    Returns:
        The advice.
    """
    sample = setup.sample_bytes if setup.sample_bytes is not None else sample_bytes
    batch_bytes = sample * batch_size
    workers = setup.num_workers
    in_flight = workers * setup.prefetch_factor
    pinned = (in_flight + 1) * (1 << max(batch_bytes - 1, 0).bit_length()) if setup.pin_memory else 0
    shared = in_flight * batch_bytes
    gpu_rate = time.samples_per_second
    worker_ms = workers / gpu_rate * 1e3 if workers and gpu_rate else None
    loader_rate = needed = combined = None
    if setup.sample_load_ms is not None:
        load = setup.sample_load_ms / 1e3
        needed = max(1, math.ceil(gpu_rate * load - 1e-9))
        if workers:
            loader_rate = workers / load
            combined = min(gpu_rate, loader_rate)
        else:  # the main process loads, then the GPU steps: the two times add up
            loader_rate = 1 / load
            combined = time.samples / (time.seconds + time.samples * load)
    return LoaderAdvice(setup=setup, batch_size=batch_size, sample_bytes=sample, batches_in_flight=in_flight,
                        shared_memory_bytes=shared, pinned_bytes=pinned,
                        host_bytes=shared + (pinned if setup.pin_memory else batch_bytes),
                        gpu_samples_per_second=gpu_rate, worker_ms_per_sample=worker_ms,
                        loader_samples_per_second=loader_rate, workers_needed=needed, samples_per_second=combined)

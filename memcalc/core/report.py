"""The report an estimate returns: frozen dataclasses, and ``to_dict()`` for the JSON contract.

The JSON contract (docs/json-output.md) is exactly::

    {"model", "batch_size", "optimizer", "mode", "precision", "gpu", "parameters",
     "peak_phase", "peak_module", "attention_backend", "fits", "loop", "keep_grads",
     "optimizer_impl", "torch_version", "cuda_version", "trainable_parameters",
     "paged_optimizer_state",
     "bytes": {"parameters", "buffers", "inputs", "gradients", "optimizer_state",
               "activations", "workspace", "kv_cache", "peak_allocated", "peak_reserved",
               "peak_reserved_unconstrained", "cuda_context"}}

A multi-GPU strategy describes the busiest GPU role in the same fields and adds ``strategy``,
``world_size``, ``global_batch_size`` and ``roles`` (a mesh: ``mesh``, and each role's
``sharding``). A step time adds ``time``; a generation ``new_tokens`` and ``peak_step``; a GRPO
step ``phase_peaks``; allocator settings ``alloc_conf``; a step short for fragmentation alone
``fits_with_expandable_segments``. Otherwise the JSON is exactly the above. Each added key with
its shape: docs/notes/report-json.md.

Category bytes are what the tensors alive at the peak asked for (``nbytes``); the peak is what
the CUDA caching allocator counts (each block rounded up to 512 B), so the categories plus
``rounding`` add up to ``peak_allocated``. ``peak_reserved`` is the allocator's segments at
their peak under the capacity when there is one (above it when ``fits`` is false);
``peak_reserved_unconstrained`` is the same replay with no limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar, overload

from memcalc.core.categories import Category, Mode, Phase
from memcalc.core.gpu import GENERIC, GpuProfile
from memcalc.core.precision import Precision
from memcalc.core.throughput import CostSource, DeviceRates, StepFlops, StepTime
from memcalc.core.timeline import Timeline

__all__ = ("ByteBreakdown", "Distribution", "Generation", "Measurement", "MemoryReport", "ModuleRow", "OnRequest",
           "RoleReport", "Shard", "StepDescription", "Textbook", "TimelineSource", "busiest_role")


@dataclass(frozen=True)
class ByteBreakdown:
    """Bytes per category alive at the peak, and the peak allocated itself."""

    parameters: int
    buffers: int
    inputs: int
    gradients: int
    optimizer_state: int
    activations: int
    workspace: int
    peak_allocated: int
    kv_cache: int = 0

    @property
    def rounding(self) -> int:
        """Bytes the allocator adds at the peak: 512-byte rounding, and large blocks whose
        remainder (≤ 1 MiB) is too small to split off and so counts as allocated."""
        return self.peak_allocated - sum(self.category(c) for c in Category)

    def category(self, category: Category) -> int:
        """The bytes of one category."""
        return int(getattr(self, category.value))

    def to_dict(self) -> dict[str, int]:
        """Category name → bytes, plus ``peak_allocated`` (the JSON ``bytes`` object)."""
        return {c.value: self.category(c) for c in Category} | {"peak_allocated": self.peak_allocated}


@dataclass(frozen=True)
class ModuleRow:
    """One module of the per-module table.

    ``activation_bytes``: in train mode, activation bytes born during the module's forward
    (its submodules included) still alive when the forward ended — what its backward keeps;
    in eval and inference mode, the most activation bytes born during its forward alive at one
    moment (its high-water: each is freed soon after its consumer runs, so the sum of everything
    it allocated would be no memory that was ever resident, and could exceed the peak).
    Kernel workspaces (cuBLAS, cuDNN: category ``workspace``) are never counted here: they
    belong to the library handle or the call, not to what the module keeps.
    """

    name: str
    type: str
    depth: int
    parameters: int
    output_shape: tuple[int, ...]
    activation_bytes: int


@dataclass(frozen=True)
class Textbook:
    """The rule of thumb: parameter bytes × optimizer multiplier + the input batch + activations.

    It is the articles' arithmetic (e.g. one fully connected layer, batch 100, 32 → 16, fp32:
    4 × (100·32 + 32·16 + 100·16) = 21,248 B: inputs + weights + outputs). ``activation_bytes``
    are, in train mode, the activations saved for backward (alive when backward starts); in
    eval and inference mode, the activations alive at the simulated peak. Temporaries and
    kernel workspaces are never part of the rule.

    Frozen parameters (fine-tuning: ``--freeze``, the base under LoRA, a quantized base) have
    no gradient and no optimizer state, so they count once: only the trainable parameters take
    the multiplier. Multiplying all of them would put QLoRA's 4-bit base × 4 in the rule.
    """

    parameter_bytes: int  # every parameter, trainable and frozen (tied weights once)
    multiplier: int  # 1 outside training: weights only
    terms: str  # e.g. "weights + grads + 2 moments"
    activation_bytes: int
    input_bytes: int = 0  # the input batch and its targets
    # optimizer state that is no multiple of the parameter bytes: 8-bit Adam's 1-byte moments,
    # Adafactor's factored (row and column) second moments; over the trainable parameters
    state_bytes: int = 0
    # the part of ``parameter_bytes`` that does not train (0 outside training: all count once)
    frozen_parameter_bytes: int = 0

    @property
    def trainable_parameter_bytes(self) -> int:
        """The parameter bytes that take the multiplier: ``parameter_bytes − frozen_parameter_bytes``."""
        return self.parameter_bytes - self.frozen_parameter_bytes

    @property
    def total(self) -> int:
        """The textbook estimate: trainable parameter bytes × multiplier + frozen parameter bytes
        + optimizer state bytes outside the multiplier + input bytes + activation bytes."""
        return (self.trainable_parameter_bytes * self.multiplier + self.frozen_parameter_bytes + self.state_bytes
                + self.input_bytes + self.activation_bytes)

    def gap(self, peak: int) -> float | None:
        """How far ``peak`` is above the rule of thumb, as a fraction of it: ``(peak − total) /
        total`` (+0.25: the simulated peak is 25% above the rule; −0.1: 10% below). None when
        the rule counts nothing."""
        return (peak - self.total) / self.total if self.total else None


@dataclass(frozen=True)
class Measurement:
    """A real run of the same step: CUDA (``max_memory_allocated``) or CPU (profiler)."""

    device: str  # e.g. "cuda: NVIDIA H100 80GB HBM3" or "cpu (torch.profiler)"
    peak_allocated: int | None  # None when the run went out of memory
    peak_reserved: int | None = None
    oom: bool = False
    note: str = ""
    compared_with: int | None = None  # the estimate this measurement is compared with

    def relative_error(self, estimate: int | None = None) -> float | None:
        """(estimate − measured) / measured; ``estimate`` defaults to ``compared_with``."""
        estimate = self.compared_with if estimate is None else estimate
        if not self.peak_allocated or estimate is None:
            return None
        return (estimate - self.peak_allocated) / self.peak_allocated


class TimelineSource(Protocol):
    """What a report keeps to replay its step into a timeline when asked
    (``memcalc.engine.run``'s builder: the trace, its program and the allocator settings)."""

    def timeline(self) -> Timeline:
        """The step's timeline: built on the first call (one more replay), then kept."""


@dataclass(frozen=True)
class OnRequest:
    """What a report computes only when asked, each from the traced step it keeps: the timeline
    (one more replay) and the FLOPs and bytes per kernel (the step time). None: the report was
    built by hand, or from a step that recorded nothing. Kept out of equality and ``to_dict()``."""

    timeline: TimelineSource | None = None
    costs: CostSource | None = None


@dataclass(frozen=True)
class StepDescription:
    """The step that was simulated, as resolved: the model, the batch, the optimizer and the
    settings the estimate ran under (each as the JSON contract and the tables spell it)."""

    model: str
    batch_size: int
    optimizer: str
    mode: Mode
    precision: Precision = Precision.FP32
    gpu: GpuProfile = GENERIC
    gpu_named: bool = False  # False: the generic default profile was assumed
    capacity: int | None = None  # bytes the allocator may reserve, when a budget/GPU was given
    input_description: str = ""
    loss: str = ""
    accum_steps: int = 1
    checkpoint: bool = False
    # The checkpointing the step ran, as Checkpointing.label spells it ("off", "full", "every:2",
    # "selective-op", "policy NAME"; ", reentrant" appended): under checkpoint auto, the setting it chose.
    checkpointing: str = "off"
    # The loop and stack the step was estimated for (memcalc.core.loop, memcalc.core.stack).
    loop: str = "minimal"  # a preset's name, or the user's loop function's qualified name
    keep_grads: bool = False  # zero_grad(set_to_none=False): gradients allocated throughout
    optimizer_impl: str = ""  # for-loop, foreach or fused, as resolved ("" without an optimizer)
    torch_version: str = ""  # the PyTorch whose kernel facts were used ("X.Y")
    cuda_version: str = ""  # the CUDA runtime assumed for the context ("X.Y")
    # The caching allocator's settings modelled (PYTORCH_CUDA_ALLOC_CONF, in PyTorch's spelling)
    # and where they came from; "" for the defaults (JSON "alloc_conf" only then).
    alloc_conf: str = ""
    alloc_conf_source: str = ""


@dataclass(frozen=True)
class Distribution:
    """How the step is spread over GPUs (memcalc.distributed): the report's own fields describe
    the busiest of ``roles``. A single GPU: ``strategy`` ``"single"``, no roles."""

    strategy: str = "single"
    world_size: int = 1
    global_batch_size: int | None = None  # samples per step over all GPUs (None: single GPU)
    roles: tuple[RoleReport, ...] = ()
    #: The device mesh's degrees (torchtitan's names), when the strategy runs on one; None otherwise.
    mesh: dict[str, int] | None = None


@dataclass(frozen=True)
class Generation:
    """What a step that generates adds. Mode generate: the tokens ``generate()`` makes after the
    prompt and the decode step of the peak (0: the prefill). A training step that generates (loop
    trl-grpo): the peak of its generation (``generate()`` and the scoring of the completions) and
    of its training (forward, loss, backward, optimizer). None where the step does neither."""

    new_tokens: int | None = None
    peak_step: int | None = None
    generation_peak: int | None = None
    training_peak: int | None = None

    @property
    def peaks_in(self) -> str | None:
        """``"generation"`` or ``"training"``: the part of a generating training step whose peak
        is the step's; None for any other step."""
        if self.generation_peak is None or self.training_peak is None:
            return None
        return "generation" if self.generation_peak > self.training_peak else "training"


_T = TypeVar("_T")


class _Of(Generic[_T]):
    """A read-only attribute of the report that is a field of one of its nested records
    (``report.batch_size`` is ``report.step.batch_size``): the flat names the API has always had."""

    def __init__(self, record: str) -> None:
        self._record = record
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self.__doc__ = f"``{self._record}.{name}``, read-only."

    @overload
    def __get__(self, report: None, owner: type) -> _Of[_T]: ...

    @overload
    def __get__(self, report: object, owner: type) -> _T: ...

    def __get__(self, report: object | None, owner: type) -> _T | _Of[_T]:
        if report is None:
            return self
        value: _T = getattr(getattr(report, self._record), self._name)
        return value


@dataclass(frozen=True)
class MemoryReport:
    """Everything an estimate found: the peak and its breakdown, where it happens, and the
    step that was simulated (the JSON contract is in the module docstring).

    What the estimate found is in the report's own fields; the step it describes is in ``step``
    (:class:`StepDescription`), the GPUs it is spread over in ``distribution``, what a generating
    step adds in ``generation``, and what is computed only when asked in ``on_request``. Each
    field of those records is also a read-only attribute of the report (``report.batch_size``
    is ``report.step.batch_size``). Renderers (:mod:`memcalc.report`) only read it.
    """

    step: StepDescription
    parameters: int  # count, tied weights once
    peak_phase: Phase
    peak_module: str  # "" when the peak happens outside any submodule (e.g. optimizer)
    bytes: ByteBreakdown
    peak_iteration: int = 1  # 2 when the steady state (optimizer state present) is higher
    textbook: Textbook | None = None
    modules: tuple[ModuleRow, ...] = ()  # every submodule, at every depth (see modules_within)
    first_iteration_peak: int = 0
    peak_requested: int = 0  # the same simulation without the allocator's rounding (CPU comparisons)
    # Segments the caching allocator holds at its peak: under ``capacity`` when there is one
    # (the replay that decides ``fits``), else with no limit (see the module docstring).
    peak_reserved: int = 0
    fits: bool | None = None  # replayed under ``capacity`` without an OOM (None: no capacity)
    reserved_within_capacity: int | None = None  # peak reserved in that replay (= peak_reserved)
    peak_reserved_unconstrained: int = 0  # peak reserved replayed with no limit
    # A step that does not fit for fragmentation alone (peak allocated under the capacity), on
    # segments that do not expand: the peak reserved under the capacity replayed again with
    # expandable_segments:True when it then fits, -1 when it does not; None: not asked.
    reserved_if_expandable: int | None = None
    # ops whose memory inside the kernel is approximated, with their calls: CUDA's cuDNN convolutions; the
    # CPU's that oneDNN (or, in float32, any backend) runs, not the Slow2d ones its rule follows
    unsupported_ops: tuple[tuple[str, int], ...] = ()
    measurement: Measurement | None = None
    notes: tuple[str, ...] = field(default=())
    attention_backend: str | None = None  # the backend of most attention calls; None: no attention
    attention_calls: tuple[tuple[str, int], ...] = ()  # every backend used, with its call count
    trainable_parameters: int | None = None  # parameters with requires_grad (None: not training)
    paged_optimizer_state: int = 0  # optimizer state in unified memory (paged optimizers), not in the peak
    # The step's time on the report's GPU, when asked for (memcalc.step_time; JSON "time" only then).
    time: StepTime | None = None
    distribution: Distribution = field(default_factory=Distribution)
    generation: Generation = field(default_factory=Generation)
    # The timeline and the step's costs, computed when asked (set by memcalc.engine.run.build_report
    # and memcalc.estimation): kept out of equality and repr, so that reports compare as before.
    on_request: OnRequest = field(default_factory=OnRequest, compare=False, repr=False)

    # The flat names of the nested records' fields, read-only (see the class docstring).
    model = _Of[str]("step")
    batch_size = _Of[int]("step")
    optimizer = _Of[str]("step")
    mode = _Of[Mode]("step")
    precision = _Of[Precision]("step")
    gpu = _Of[GpuProfile]("step")
    gpu_named = _Of[bool]("step")
    capacity = _Of[int | None]("step")
    input_description = _Of[str]("step")
    loss = _Of[str]("step")
    accum_steps = _Of[int]("step")
    checkpoint = _Of[bool]("step")
    checkpointing = _Of[str]("step")
    loop = _Of[str]("step")
    keep_grads = _Of[bool]("step")
    optimizer_impl = _Of[str]("step")
    torch_version = _Of[str]("step")
    cuda_version = _Of[str]("step")
    alloc_conf = _Of[str]("step")
    alloc_conf_source = _Of[str]("step")
    strategy = _Of[str]("distribution")
    world_size = _Of[int]("distribution")
    global_batch_size = _Of[int | None]("distribution")
    roles = _Of["tuple[RoleReport, ...]"]("distribution")
    mesh = _Of[dict[str, int] | None]("distribution")
    new_tokens = _Of[int | None]("generation")
    peak_step = _Of[int | None]("generation")
    generation_peak = _Of[int | None]("generation")
    training_peak = _Of[int | None]("generation")

    def with_costs(self, costs: CostSource) -> MemoryReport:
        """The same report, its FLOPs and step time computed from ``costs`` when asked."""
        return replace(self, on_request=replace(self.on_request, costs=costs))

    def without_trace(self) -> MemoryReport:
        """The same report (equal, the same ``to_dict()``) without the traced step it keeps for
        :meth:`timeline`, :meth:`flops` and :meth:`time_on`, in its roles' reports too.

        A search that keeps a report per configuration (``memcalc plan``) keeps only what it
        reads: a traced step of an 80-layer model holds its events, storages and kernel records,
        tens of MiB each, hundreds under a pipeline's ranks, which add up over a search's traces.
        """
        roles = tuple(replace(role, report=role.report.without_trace()) for role in self.roles)
        return replace(self, on_request=OnRequest(), distribution=replace(self.distribution, roles=roles))

    def timeline(self) -> Timeline:
        """The memory of every event of the simulated step (both iterations of a training
        step): bytes per category, allocated and reserved after each event, phases, the
        largest storages at the peak, and the allocator's actions (for
        :func:`memcalc.measure.snapshot_export.write_snapshot`). Computed when first asked (one more
        replay of the step), then kept. Under a multi-GPU strategy: the busiest role's; each
        ``roles[i].report.timeline()`` is that role's.

        Returns:
            The :class:`~memcalc.core.timeline.Timeline`; its ``peak_index`` is this report's
            peak and ``max(allocated) == bytes.peak_allocated``.

        Raises:
            ValueError: the report was not made by an estimate (built by hand).
        """
        if self.on_request.timeline is None:
            raise ValueError("this report has no step to replay: only reports made by an estimate have a timeline")
        return self.on_request.timeline.timeline()

    def flops(self) -> StepFlops:
        """The FLOPs of the simulated step, counted per aten op: per phase (backward's
        recomputation of checkpointed blocks apart), per module and per op. Computed when first
        asked, then kept. Under a multi-GPU strategy: the busiest role's, per GPU.

        Raises:
            ValueError: the report was not made by an estimate (built by hand).
        """
        if self.on_request.costs is None:
            raise ValueError("this report has no traced step: only reports made by an estimate count FLOPs")
        return self.on_request.costs.flops()

    def time_on(self, rates: DeviceRates) -> StepTime:
        """The step's time on the GPU whose peaks are ``rates``, from a roofline per traced
        kernel (:func:`memcalc.step_time` gives ``rates`` for the report's catalogue GPU).

        Raises:
            ValueError: the report was not made by an estimate (built by hand).
        """
        if self.on_request.costs is None:
            raise ValueError("this report has no traced step: only reports made by an estimate have a step time")
        return self.on_request.costs.time(rates)

    def modules_within(self, depth: int) -> tuple[ModuleRow, ...]:
        """The per-module rows down to ``depth`` (1: the model's direct children)."""
        return tuple(m for m in self.modules if m.depth <= depth)

    @property
    def busiest_role(self) -> RoleReport | None:
        """The GPU role that runs out of memory first (multi-GPU): one that does not fit,
        else the highest peak allocated (then reserved). None for a single GPU."""
        return busiest_role(self.roles)

    @property
    def cuda_context(self) -> int:
        """The CUDA context (and libraries) of the GPU: never in max_memory_allocated, but it
        is on the device, so it counts toward an OOM (an assumption per GPU: memcalc.targets.cuda.gpus.catalogue)."""
        return self.gpu.cuda_context

    @property
    def device_total(self) -> int:
        """What the device would really use: peak reserved (under the capacity, when there
        is one) + the CUDA context."""
        return self.peak_reserved + self.cuda_context

    @property
    def headroom(self) -> int | None:
        """Bytes left under ``capacity`` at the peak: ``capacity − peak allocated`` when the
        step fits (reserved-but-free cache can be reclaimed), negative by the shortfall when
        it does not. None without a capacity."""
        if self.capacity is None:
            return None
        return self.capacity - self.bytes.peak_allocated

    @property
    def peak_location(self) -> str:
        """``"backward, layer4.2.conv3"`` — where the peak happens."""
        where = self.peak_module or {
            Phase.OPTIMIZER: "optimizer.step()",
            Phase.ZERO_GRAD: "zero_grad()",
            Phase.LOSS: "loss",
            Phase.BACKWARD: "loss (before any module's backward)",
        }.get(self.peak_phase, "top level")
        if self.peak_phase is Phase.DECODE and self.peak_step is not None:
            return f"decode step {self.peak_step} of {(self.new_tokens or 1) - 1}, {where}"
        return f"{self.peak_phase.value}, {where}"

    @property
    def peaks_in(self) -> str | None:
        """``"generation"`` or ``"training"``: the part of a generating training step (loop
        trl-grpo) whose peak is the step's; None for any other step."""
        return self.generation.peaks_in

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (see the module docstring); integers are bytes."""
        data = self._single_gpu_dict()
        if self.roles:
            data |= {"strategy": self.strategy, "world_size": self.world_size,
                     "global_batch_size": self.global_batch_size, "roles": [r.to_dict() for r in self.roles]}
            if self.mesh is not None:
                data["mesh"] = dict(self.mesh)
        if self.time is not None:
            data["time"] = self.time.to_dict()
        if self.new_tokens is not None:
            data |= {"new_tokens": self.new_tokens, "peak_step": self.peak_step}
        if self.generation_peak is not None:
            data["phase_peaks"] = {"generation": self.generation_peak, "training": self.training_peak,
                                   "peaks_in": self.peaks_in}
        if self.alloc_conf:
            data["alloc_conf"] = self.alloc_conf
        if self.checkpointing != "off":  # what ran; under checkpoint auto, the setting it chose
            data["checkpointing"] = self.checkpointing
        if self.reserved_if_expandable is not None:
            data["fits_with_expandable_segments"] = self.reserved_if_expandable >= 0
        return data

    def _single_gpu_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "mode": self.mode.value,
            "precision": self.precision.value,
            "gpu": self.gpu.key,
            "parameters": self.parameters,
            "peak_phase": self.peak_phase.value,
            "peak_module": self.peak_module,
            "attention_backend": self.attention_backend,
            "fits": self.fits,
            "loop": self.loop,
            "keep_grads": self.keep_grads,
            "optimizer_impl": self.optimizer_impl,
            "torch_version": self.torch_version,
            "cuda_version": self.cuda_version,
            "trainable_parameters": self.trainable_parameters,
            "paged_optimizer_state": self.paged_optimizer_state,
            "bytes": self.bytes.to_dict() | {"peak_reserved": self.peak_reserved,
                                             "peak_reserved_unconstrained": self.peak_reserved_unconstrained,
                                             "cuda_context": self.cuda_context},
        }


def busiest_role(roles: tuple[RoleReport, ...]) -> RoleReport | None:
    """The GPU role that runs out of memory first: one that does not fit, else the highest peak
    allocated (then reserved). None without roles (a single GPU)."""
    if not roles:
        return None
    failing = [r for r in roles if r.report.fits is False]
    return max(failing or roles, key=lambda r: (r.peak_allocated, r.report.peak_reserved))


#: The per-rank table's short names of what a mesh dimension divides.
_SHORT_STATES = {"parameters": "params", "gradients": "grads", "optimizer_state": "optimizer"}


@dataclass(frozen=True)
class Shard:
    """What one dimension of the mesh divides on a rank: ``states`` (``"parameters"``,
    ``"gradients"``, ``"optimizer_state"``, ``"batch"``) each hold ``1/degree`` of the whole
    there (``params /8 (dp_shard)``)."""

    states: tuple[str, ...]
    dimension: str
    degree: int

    def describe(self) -> str:
        """``params, grads, optimizer /8 (dp_shard)``."""
        return f"{', '.join(_SHORT_STATES.get(s, s) for s in self.states)} /{self.degree} ({self.dimension})"

    def to_dict(self) -> dict[str, Any]:
        """An entry of a role's JSON ``sharding`` list."""
        return {"states": list(self.states), "dimension": self.dimension, "degree": self.degree}


@dataclass(frozen=True)
class RoleReport:
    """One kind of GPU in a multi-GPU step: every rank of DDP/FSDP/ZeRO, or DataParallel's
    output device and its other devices. ``report`` is that GPU's full single-GPU report.

    ``model_states``: parameters + gradients + optimizer state (fp32 master weights included)
    the GPU holds at the optimizer step — what DeepSpeed's estimators count. ``communication``:
    bytes at the peak in buffers that exist only for the collectives (DDP buckets that are not
    the gradients, all-gathered parameters, all-gather / reduce-scatter / reduce buffers); they
    are also counted in their category of ``bytes``.
    """

    name: str
    ranks: tuple[int, ...]
    batch_size: int  # samples this GPU runs through the model
    model_states: int
    communication: int
    report: MemoryReport
    #: What each mesh dimension divides on this rank; None where the GPUs are not ranks of a
    #: process group (DataParallel), and so the JSON has no ``sharding``.
    sharding: tuple[Shard, ...] | None = None

    @property
    def bytes(self) -> ByteBreakdown:
        """This role's breakdown at its peak."""
        return self.report.bytes

    @property
    def peak_allocated(self) -> int:
        """This role's peak allocated bytes."""
        return self.report.bytes.peak_allocated

    def to_dict(self) -> dict[str, Any]:
        """The role's entry of the JSON ``roles`` list."""
        r = self.report
        return {"name": self.name, "ranks": list(self.ranks), "batch_size": self.batch_size,
                "peak_allocated": r.bytes.peak_allocated, "peak_reserved": r.peak_reserved,
                "peak_phase": r.peak_phase.value, "peak_module": r.peak_module, "fits": r.fits,
                "model_states": self.model_states, "communication": self.communication,
                "bytes": r.bytes.to_dict()} | ({} if self.sharding is None
                                              else {"sharding": [s.to_dict() for s in self.sharding]})

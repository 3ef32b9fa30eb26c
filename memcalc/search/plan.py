"""``memcalc plan``: which device mesh, pipeline schedule, micro-batch and checkpointing to train
a model with on N GPUs (docs/many-gpus.md).

The space: every mesh of the modelled, ``planned`` dimensions' degrees over N GPUs (tp within a
node; cp where ``2 × cp`` divides the sequence, as torch's load balancer needs; ep for a mixture of
experts only, as :func:`_expert_meshes` says), less those
:func:`refusal` — the one predicate — says memcalc cannot estimate (counted,
named, and searched the day a dimension's file accepts it; pp × tp without dp_shard under a
foreach or fused optimizer, which torch refuses: :mod:`memcalc.search.plan_refusals`); per mesh
each checkpointing (off, selective-op, full; or ``auto``) and each micro-batch (``global batch = micro-batch ×
data-parallel size × accumulation``), or under a pipeline each schedule (GPipe, 1F1B, interleaved
1F1B) and ``pp`` to ``4 × pp`` microbatches.

Its time (:func:`step_seconds`): the busiest rank's roofline (:func:`step_time` of its trace; a
pipeline rank's runs its whole schedule) plus the bubble (``pp − 1`` microbatches over the stages
per rank) and the collective cost model (:mod:`memcalc.distributed.collectives`): overlapped
collectives hide behind compute, exposed ones (tensor parallelism's, the ring's beyond each call) add.

Pruning (:mod:`memcalc.search.plan_bounds`), before any trace: a configuration whose model states
and kept activations (lower bounds) exceed the GPU is dropped; every other gets a lower bound on
its seconds (matmul FLOPs at peak, the bubble, the collectives) and they are traced best bound
first (those without a pipeline, whose traces are cheap, before the pipelines) until the ``top``
found beat the next bound. Traces, fitting or not, tighten the bounds of the rest
(:class:`_Timings`: its kin's compute; others' through the seconds per matmul FLOP, the bubble
with them). Before a pipeline's trace, a probe: its tp, checkpointing and micro-batch traced
without a pipeline over every GPU (:func:`_probe`), whose seconds per FLOP may rule it out. What
does not fit rules out its kin with less sharding, less checkpointing and a larger micro-batch:
so the most sharded of a kin's meshes is traced first, and a traced peak, scaled down, rules out
its family's smaller micro-batches (:mod:`memcalc.search.plan_peaks`). Meshes that differ only
in the number of ``dp_replicate`` replicas (two or more) share a trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memcalc.core.checkpointing import AUTO, FULL, OFF, Checkpointing, CheckpointKind, parse_checkpointing
from memcalc.core.errors import InvalidInputError, MemcalcError
from memcalc.core.report import MemoryReport
from memcalc.core.throughput import OpClass, StepTime
from memcalc.distributed.collectives import LAYOUT, Collective, ModelFacts, Network
from memcalc.distributed.expert_parallel import expert_modules, expert_parallelism_available
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.pipeline import PipelineOverCapacity, stop_at_unfit_rank
from memcalc.distributed.pipeline_schedules import PipelineSchedule
from memcalc.distributed.setting import Distributed
from memcalc.distributed.strategy.base import Plan
from memcalc.distributed.strategy.catalogue import APPLICATION_ORDER, dimensions, strategies_for
from memcalc.distributed.tp_plans import resolve_plan
from memcalc.distributed.tp_traffic import plan_traffic
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step
from memcalc.estimation import run_estimate
from memcalc.search.plan_bounds import (
    activations_floor,
    compute_floor,
    in_flight,
    logits_bytes,
    off_saved,
    peak_flops,
    selective_saved,
    states_floor,
)
from memcalc.search.plan_peaks import Peaks
from memcalc.search.plan_refusals import plain_beside_dtensors
from memcalc.timing.performance import step_time

__all__ = ("CHECKPOINTS", "SCHEDULES", "PlanCandidate", "PlanResult", "collectives_of", "find_plan", "meshes_over",
           "model_facts", "refusal", "step_seconds")

#: The checkpointing tried, from the most memory to the least (and the fastest to the slowest).
CHECKPOINTS = (OFF, Checkpointing(CheckpointKind.SELECTIVE_OP), FULL)
#: The pipeline schedules tried (those whose FSDP2 stages memcalc checks against real runs).
SCHEDULES = (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B)
#: Phases that run once per optimizer step, whatever the accumulation.
_ONCE_PER_STEP = ("optimizer", "zero_grad")


@dataclass(frozen=True)
class PlanCandidate:
    """One configuration, estimated: its mesh, pipeline schedule (None: no pipeline), micro-batch,
    micro-batches per step (accumulation, or a pipeline's microbatches) and checkpointing, its
    busiest rank's report, and its time per optimizer step. The report is without its traced step
    (:meth:`MemoryReport.without_trace`: the search keeps one per trace): its timeline and FLOPs
    come from estimating the configuration itself (``memcalc MODEL --mesh ...``); its time is kept."""

    mesh: Mesh
    checkpoint: Checkpointing
    micro_batch: int
    accum_steps: int
    report: MemoryReport
    compute_seconds: float
    collectives: tuple[Collective, ...]
    comm_seconds: float
    exposed_seconds: float
    seconds: float
    tokens_per_step: int | None
    schedule: PipelineSchedule | None = None
    bubble_seconds: float = 0.0
    checkpoint_label: str = ""
    once_seconds: float = 0.0  # the optimizer step's and zero_grad's part of compute_seconds

    @property
    def tokens_per_second(self) -> float | None:
        return None if self.tokens_per_step is None else self.tokens_per_step / self.seconds

    @property
    def label(self) -> str:
        """The checkpointing as chosen (``auto → full``)."""
        return self.checkpoint_label or self.checkpoint.label

    def to_dict(self, network: Network) -> dict[str, Any]:
        report = self.report
        return {"mesh": self.mesh.used or {"dp_shard": 1}, "micro_batch": self.micro_batch,
                "accum_steps": self.accum_steps, "pp_schedule": None if self.schedule is None else self.schedule.value,
                "checkpoint": self.label,
                "peak_allocated": report.bytes.peak_allocated, "peak_reserved": report.peak_reserved,
                "capacity": report.capacity, "headroom": report.headroom, "busiest_rank": _busiest(report),
                "step_seconds": self.seconds, "compute_seconds": self.compute_seconds,
                "bubble_seconds": self.bubble_seconds, "communication_seconds": self.comm_seconds,
                "exposed_communication_seconds": self.exposed_seconds,
                "tokens_per_second": self.tokens_per_second,
                "collectives": [c.to_dict(network) for c in self.collectives]}


def _busiest(report: MemoryReport) -> str | None:
    role = report.busiest_role
    return None if role is None else role.name


@dataclass(frozen=True)
class PlanResult:
    """The best configurations, fastest first, and what was searched and pruned."""

    best: tuple[PlanCandidate, ...]
    gpus: int
    global_batch: int
    network: Network
    searched: tuple[str, ...]
    not_searched: tuple[str, ...]
    #: why each of :attr:`not_searched` was left out, in its order ("the model has no experts"):
    #: a dimension left out for the request's own shape is not one memcalc cannot model
    not_searched_why: tuple[str, ...]
    meshes: tuple[Mesh, ...]
    configurations: int
    estimates: int
    pruned: tuple[str, ...]
    assumptions: tuple[str, ...]
    unsupported: int = 0
    bounded: int = 0
    reused: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc plan --format json`` contract (docs/many-gpus.md)."""
        return {"gpus": self.gpus, "global_batch": self.global_batch, "network": self.network.to_dict(),
                "dimensions_searched": list(self.searched), "dimensions_not_searched": list(self.not_searched),
                "why_not_searched": dict(zip(self.not_searched, self.not_searched_why, strict=True)),
                "meshes": [m.describe() for m in self.meshes], "unsupported_meshes": self.unsupported,
                "configurations": self.configurations, "estimates": self.estimates,
                "pruned_by_bounds": self.bounded, "traces_reused": self.reused,
                "pruned": list(self.pruned), "assumptions": list(self.assumptions),
                "best": [c.to_dict(self.network) for c in self.best]}


def model_facts(step: Step) -> ModelFacts:
    """The parameter counts, communicated dtypes and transformer shape of ``step``'s model (one
    meta build). Under autocast FSDP gathers 16-bit parameters and reduces float32 gradients
    (torchtitan's ``MixedPrecisionPolicy``); otherwise both move in the stored dtype."""
    resolved = step.resolved(1)
    module = resolved.module
    seen: dict[int, torch.nn.Parameter] = {id(p): p for p in module.parameters()}
    parameters = sum(p.numel() for p in seen.values())
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    precision = step.precision
    stored_bytes = precision.parameter_dtype.itemsize
    gather = precision.compute_dtype.itemsize if precision.is_amp else stored_bytes
    config = getattr(module, "config", None)

    def attribute(*names: str) -> int | None:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        return None

    top_k = attribute("num_experts_per_tok", "experts_per_token")
    blocks = [f"{path}.{child}" for path in resolved.block_containers
              for child, _ in module.get_submodule(path).named_children()]
    experts = _experts_of(module, resolved.name, top_k, blocks)
    experts.update(_tp_traffic(resolved, blocks, expert_parallel=bool(experts)))
    hidden = attribute("hidden_size", "n_embd", "d_model")
    return ModelFacts(parameters=parameters, trainable=trainable, gather_bytes=gather, stream_bytes=stored_bytes,
                      reduce_bytes=4 if precision.is_amp else stored_bytes,
                      layers=attribute("num_hidden_layers", "n_layer", "num_layers"),
                      heads=attribute("num_attention_heads", "n_head"),
                      kv_heads=attribute("num_key_value_heads", "num_attention_heads", "n_head"),
                      hidden=hidden, vocab=attribute("vocab_size"),
                      intermediate=_narrowest_mlp(attribute("intermediate_size", "n_inner", "ffn_dim"),
                                                  attribute("moe_intermediate_size"), top_k, hidden, experts),
                      activation_bytes=precision.compute_dtype.itemsize, **experts)


def _narrowest_mlp(dense: int | None, expert_width: int | None, top_k: int | None, hidden: int | None,
                   experts: dict[str, Any]) -> int | None:
    """The MLP width plan's activation floor counts a block with (:class:`ModelFacts`'
    ``intermediate``): the config's dense width, or, for a mixture of experts, ``top_k`` times an
    expert's width where that is narrower. Qwen-MoE and DeepSeek configs keep a dense
    ``intermediate_size`` beside ``moe_intermediate_size``, which every sparse layer ignores: counted
    as the dense width, a tiny Qwen3-MoE (``intermediate_size`` 8,192, experts of 32, top-2) had a
    floor of 560 MB against a traced peak of 182 MB, pruning what fits. An expert's width is the
    config's, else its parameters' (``3 · hidden · width`` an expert, a SwiGLU's gate, up and down;
    a two-matrix expert reads narrower, which keeps the floor a floor). Shared experts are left out
    (a floor too)."""
    widths = [dense] if dense else []
    if top_k and expert_width:
        widths.append(top_k * expert_width)
    if top_k and hidden and experts.get("expert_parameters") and experts.get("moe_layers"):
        per_expert = experts["expert_parameters"] // (experts["moe_layers"] * experts["experts"] * 3 * hidden)
        if per_expert:
            widths.append(top_k * per_expert)
    return min(widths) if widths else None


def _tp_traffic(resolved: ResolvedModel, blocks: list[str], *, expert_parallel: bool) -> dict[str, Any]:
    """The collectives the plan the trace runs makes (:func:`resolve_plan`: the model's own, else
    torchtitan's for the zoo's Llama family), without ep and, for a mixture of experts
    (``expert_parallel``), under it: :class:`ModelFacts`' ``tp_traffic`` and ``tp_traffic_ep``, each
    None where no plan resolves or its styles are not ones :func:`plan_traffic` reads (torchtitan's
    sequence-parallel plan: tp's closed formula is that plan's). A Hugging Face plan's all-reduces are
    not the closed formula's all-gathers and reduce-scatters: a traced llama-tiny at tp=2 runs 58
    all-reduces and one all-gather where the formula counted 64 + 5 (docs/many-gpus.md)."""
    out: dict[str, Any] = {}
    for key, under_ep in (("tp_traffic", False), ("tp_traffic_ep", True))[:2 if expert_parallel else 1]:
        try:
            plan = resolve_plan(resolved.module, None, resolved.name, expert_parallel=under_ep)
        except MemcalcError:  # no plan, or one with styles torch has none for: tp is refused there
            out[key] = None
            continue
        out[key] = plan_traffic(resolved.module, plan, blocks)
    return out


def _experts_of(module: torch.nn.Module, name: str, top_k: int | None, blocks: list[str]) -> dict[str, Any]:
    """The mixture of experts' facts (:class:`ModelFacts`) of ``module``: the modules its own
    expert-parallel plan dispatches tokens to (what ``ep`` shards, :func:`expert_modules`), their
    experts and parameters, and which of ``blocks`` hold them; none for a model without such a
    plan, or where the installed transformers has no expert parallelism (``ep`` then offers degree
    1 only)."""
    if top_k is None or not expert_parallelism_available():
        return {}
    try:
        paths = expert_modules(module, 1, name)
    except MemcalcError:  # no expert-parallel plan: not a mixture of experts ep can shard
        return {}
    counts = {getattr(module.get_submodule(p), "num_experts", None) for p in paths}
    if not paths or len(counts) != 1 or not isinstance(next(iter(counts)), int):
        return {}
    seen = {id(p): p for path in paths for p in module.get_submodule(path).parameters()}
    return {"experts": next(iter(counts)), "top_k": top_k, "moe_layers": len(paths),
            "moe_blocks": tuple(i for i, block in enumerate(blocks) if any(p.startswith(f"{block}.") for p in paths)),
            "expert_parameters": sum(p.numel() for p in seen.values()),
            "expert_trainable": sum(p.numel() for p in seen.values() if p.requires_grad)}


def meshes_over(gpus: int, facts: ModelFacts) -> list[Mesh]:
    """Every mesh of the modelled dimensions' offered degrees whose world size is ``gpus``."""
    known = dimensions()
    names = [name for name in LAYOUT if name in known and known[name].planned]
    options = [known[name].plan_degrees(facts, gpus) for name in names]
    out: list[Mesh] = []

    def walk(index: int, left: int, chosen: dict[str, int]) -> None:
        if index == len(names):
            if left == 1:
                out.append(Mesh(**chosen))
            return
        for degree in options[index]:
            if left % degree == 0:
                walk(index + 1, left // degree, {**chosen, names[index]: degree})

    walk(0, gpus, {})
    return out


def collectives_of(mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
    """Every collective one rank runs per optimizer step, dimension by dimension."""
    known = dimensions()
    return tuple(c for name in APPLICATION_ORDER if name in known and mesh.degrees[name] > 1
                 for c in known[name].collectives(mesh, facts, micro_batches))


def refusal(step: Step, mesh: Mesh, resolved: ResolvedModel | None = None) -> str | None:
    """Why memcalc cannot estimate ``mesh`` (a composition not modelled yet, such as pp × tp
    today), found without a trace: the setting's own checks, a whole-step dimension's
    ``composes_with``, and the others' role planning. None: supported. The one predicate plan asks.
    ``resolved``: the step's model already built (read only; else built here: a 70B meta model
    takes seconds, and plan asks of every mesh)."""
    if mesh.world_size == 1:
        return None
    try:
        distributed = Distributed(mesh=mesh)
        strategies = strategies_for(distributed)
        whole = [s for s in strategies if s.whole_step]
        if whole:
            others = sorted(s.name for s in strategies if s is not whole[0] and s.name not in whole[0].composes_with)
            if others:
                return f"not modelled yet ({whole[0].name} with {', '.join(others)})"
            if mesh.tp > 1:  # tensor parallelism inside the stages needs a plan of the model's own
                resolved = resolved or step.resolved(batch_size=1)
                resolve_plan(resolved.module, None, resolved.name, expert_parallel=mesh.ep > 1)
                mixed = plain_beside_dtensors(step, mesh, resolved)
                if mixed is not None:
                    return f"refused ({mixed})"
            return None
        plan = Plan(roles=(), batch=1, global_batch=mesh.dp_replicate * mesh.dp_shard)
        for strategy in strategies:
            plan = strategy.plan(plan, step)
    except MemcalcError as exc:
        return f"not modelled yet ({str(exc).splitlines()[0]})"
    return None


def step_seconds(compute: float, bubble: float, collectives: tuple[Collective, ...], network: Network,
                 layers: int | None) -> tuple[float, float, float]:
    """The communication's seconds, the part not overlapped, and the step's seconds: overlapped
    collectives hide behind ``compute + bubble``; exposed ones, and the first all-gather's share
    of one block (``1 / (layers + 1)`` of one forward all-gather, which FSDP cannot prefetch), add."""
    comm = sum(c.seconds(network) for c in collectives)
    alone = sum(c.exposed_seconds(network) for c in collectives)
    hidden = comm - alone
    first = [c for c in collectives if c.what.startswith("all-gather of parameters")]
    share = first[0].seconds(network) / first[0].count / ((layers or 0) + 1) if first else 0.0
    exposed = alone + share
    return comm, exposed, max(compute + bubble, hidden) + exposed


@dataclass(frozen=True)
class _Config:
    mesh: Mesh
    ckpt: int
    micro: int
    accum: int
    schedule: PipelineSchedule | None
    flops: float = 0.0  # the matmul FLOPs' seconds at the GPU's peak
    flops_at: tuple[float, ...] = ()  # and those under each checkpointing searched (by index)
    floor: float = 0.0  # the compute's lower bound: ``flops``, or what traced configurations say
    bubble: float = 0.0  # the bubble's lower bound (from the FLOPs)
    hidden: float = 0.0  # seconds of overlapped collectives
    exposed: float = 0.0  # seconds of exposed collectives
    bound: float = 0.0

    def with_compute(self, compute: float, work: float = 0.0) -> float:
        """The step's lower bound with ``compute`` as the compute's and ``work`` as its part
        outside the optimizer step's (:func:`step_seconds`): the bubble is ``(pp − 1) / stages
        per rank`` microbatches of that work (:func:`_confirm`), at least the FLOPs' bubble."""
        bubble = max(self.bubble, work / self.accum * (self.mesh.pp - 1) / self.stages_per_rank)
        return max(compute + bubble, self.hidden) + self.exposed

    def kin(self) -> tuple[Any, ...]:
        """Configurations that run the same kernels per sample, but for data parallelism's split
        and the micro-batch and checkpointing (whose compute orders: module docstring)."""
        mesh = self.mesh
        return mesh.tp, mesh.pp, mesh.cp, mesh.ep, mesh.dp_replicate * mesh.dp_shard, self.schedule

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.schedule is None or self.schedule.single_stage else 2

    def family(self) -> tuple[Any, ...]:
        """Configurations whose memory orders by sharding, checkpointing and micro-batch."""
        return *self.kin(), self.accum > 1 and self.schedule is None

    def describe(self, checkpoints: tuple[Checkpointing, ...]) -> str:
        what = (f"{self.schedule.value}, {self.accum} microbatches of {self.micro}" if self.schedule is not None
                else f"micro-batch {self.micro}, accumulation {self.accum}")
        return f"{self.mesh.describe()}, {what}, checkpointing {checkpoints[self.ckpt].label}"


@dataclass
class _Search:
    step: Step
    facts: ModelFacts
    network: Network
    checkpoints: tuple[Checkpointing, ...]
    on_estimate: Callable[[str], None] | None
    estimates: int = 0
    reused: int = 0
    over: int = 0  # configurations whose memory bound exceeds the GPU
    pruned: list[str] = field(default_factory=list)
    # each report without its traced step (MemoryReport.without_trace): the search reads its bytes and time only,
    # and 72 kept traces of a 70B model with cp held 5.1 GiB (docs/many-gpus.md)
    reports: dict[tuple[Any, ...], MemoryReport] = field(default_factory=dict)
    # pipelines stopped early: (rank, peak allocated), not the exception, whose traceback holds the trace's frames
    unfit: dict[tuple[Any, ...], tuple[int, int]] = field(default_factory=dict)

    sequence: int = 1
    peak: float = 0.0  # the GPU's dense peak FLOP/s for the compute dtype (0: the step's GPU's, read when needed)
    selective: int | None = None  # elements per token a block saves under selective-op (plan_bounds)
    resolved: ResolvedModel | None = None  # the step's model, built once (read only)
    off: int | None = None  # and without checkpointing

    def flops_rate(self) -> float:
        """:attr:`peak`, read from the step's GPU the first time it is needed."""
        if not self.peak:
            self.peak = peak_flops(self.step)
        return self.peak

    def facts_for(self, config: _Config, chosen: Checkpointing | None = None) -> ModelFacts:
        """The facts with ``config``'s: one rank's tokens of a micro-batch (``S / cp`` per sample) and
        its checkpointing, or ``chosen``: what ``--checkpoint auto`` chose for it after its trace
        (before, ``auto`` re-runs no collective: a bound)."""
        seq_len = self.sequence // config.mesh.cp
        checkpoint = chosen if chosen is not None else self.checkpoints[config.ckpt]
        return replace(self.facts, tokens=config.micro * seq_len, seq_len=seq_len,
                       stages_per_rank=config.stages_per_rank, attention_flops_per_second=self.flops_rate(),
                       recompute=checkpoint.kind is CheckpointKind.FULL, checkpoint=checkpoint)

    @staticmethod
    def key(config: _Config) -> tuple[Any, ...]:
        """What names a distinct per-rank program (two or more replicas trace alike)."""
        mesh = config.mesh
        canonical = replace(mesh, dp_replicate=min(mesh.dp_replicate, 2))
        return canonical, config.ckpt, config.micro, config.accum, config.schedule

    def report(self, config: _Config) -> MemoryReport:
        """The busiest rank's timed estimate, one trace per distinct per-rank program.

        Raises:
            PipelineOverCapacity: a pipeline with a rank that does not fit, its other ranks not
                traced (:func:`stop_at_unfit_rank`): plan needs only that it does not fit.
        """
        mesh = config.mesh
        key = self.key(config)
        if key in self.unfit:
            self.reused += 1
            raise PipelineOverCapacity(*self.unfit[key])
        if key in self.reports:
            self.reused += 1
            return self.reports[key]
        if self.on_estimate is not None:
            self.on_estimate(config.describe(self.checkpoints))
        pipelined = config.schedule is not None
        step = replace(self.step, batch_size=config.micro * config.accum if pipelined else config.micro,
                       checkpoint=self.checkpoints[config.ckpt], accum_steps=1 if pipelined else min(config.accum, 2),
                       record_costs=True)
        distributed = (Distributed() if mesh.world_size == 1 else
                       Distributed(mesh=mesh, pp_schedule=config.schedule.value, microbatches=config.accum)
                       if config.schedule is not None else Distributed(mesh=mesh))
        self.estimates += 1
        try:
            with stop_at_unfit_rank():
                report = run_estimate(step, distributed)
        except PipelineOverCapacity as stop:
            self.unfit[key] = (stop.rank, stop.peak_allocated)
            raise
        report = replace(report, time=step_time(report)).without_trace()
        self.reports[key] = report
        return report


def _sequence(resolved: ResolvedModel) -> int:
    """Tokens per sample: the sequence length of a token model, else 1."""
    inputs = resolved.inputs
    shapes = [t.shape for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point()]
    return int(shapes[0][1]) if shapes else 1


#: From this many tokens a sample, plan searches context parallelism unless told not to. Below it a
#: ring only adds traffic to what FSDP2 and tp already fit (torchtitan's recipes turn cp on for long
#: context), and its meshes multiply a plan's traces: the 70B question at 8,192 tokens took 72 traces and
#: 507 CPU-s with cp searched, against 70–98 CPU-s without (docs/many-gpus.md). Its 5.1 GiB were the traced
#: steps plan kept beside its reports (hundreds of MiB a pipeline's), which it now lets go (_Search.reports).
LONG_CONTEXT = 16_384


def _searches_cp(asked: bool | None, sequence: int) -> bool:
    """Whether plan searches cp meshes: as asked, else from :data:`LONG_CONTEXT` tokens a sample."""
    return asked if asked is not None else sequence >= LONG_CONTEXT


def _why_no_cp(asked: bool | None, sequence: int, searched: str) -> str:
    """Why plan leaves cp out (:func:`_searches_cp` said no): ``--no-cp``, or a sequence under
    :data:`LONG_CONTEXT`; ``searched``: what ``--cp`` would search ("them": the meshes, "it": cp)."""
    return ("--no-cp" if asked is False else
            f"the sequence, {sequence:,} tokens, is under {LONG_CONTEXT:,}: --cp searches {searched}")


def _balanced_rings(meshes: list[Mesh], sequence: int) -> tuple[list[Mesh], list[str]]:
    """``meshes`` less those whose ``2 × cp`` does not divide the sequence, and a note per such cp:
    torch's head-tail load balancer splits each sample into ``2 × cp`` chunks for causal attention
    (without it the last rank computes every ring step whole; plan's ring traffic assumes it)."""
    unsplit = sorted({m.cp for m in meshes if m.cp > 1 and sequence % (2 * m.cp)})
    notes = [f"{sum(1 for m in meshes if m.cp == cp)} meshes with cp={cp}: not searched (2 x cp = {2 * cp} does "
             f"not divide the sequence of {sequence} tokens: torch's load balancer splits it into 2 x cp chunks)"
             for cp in unsplit]
    return [m for m in meshes if m.cp not in unsplit], notes


def _data_parallel(mesh: Mesh) -> int:
    """The ranks the global batch splits over: ``dp_replicate × dp_shard × ep`` (every ep rank runs a
    batch of its own: :attr:`memcalc.Distributed.data_parallel_size`)."""
    return mesh.dp_replicate * mesh.dp_shard * mesh.ep


def _searches_ep(asked: bool | None, facts: ModelFacts) -> bool:
    """Whether plan searches ep meshes: for a mixture of experts unless asked not to (a model
    without experts has no ep degree but 1: :meth:`ExpertParallelDimension.plan_degrees`)."""
    return facts.experts is not None and asked is not False


def _named(meshes: list[Mesh], most: int) -> str:
    """The first ``most`` of ``meshes`` for a pruned line, "; …" where more were left out."""
    return "; ".join(m.describe() for m in meshes[:most]) + ("; …" if len(meshes) > most else "")


def _expert_meshes(meshes: list[Mesh], facts: ModelFacts) -> tuple[list[Mesh], list[str]]:
    """``meshes`` less the ep meshes memcalc's ep program would refuse at trace time or does not
    model the step's communication of, and a note per reason: the experts split over ``ep × cp ×
    tp`` ranks (torchtitan's ep borrows cp and tp, etp=1) must divide them (transformers' check); FSDP2
    shards each rank's experts on dim 0 over dp_shard, so at most as many dp_shard ranks as a rank
    has experts (dp_shard's check: torchtitan's Shard(1) otherwise); and without FSDP2 (neither
    dp_shard nor dp_replicate's HSDP) the dense gradients' synchronisation over the ep ranks is not
    modelled (ep's file), so plan would time a step that leaves it out."""
    experts = facts.experts or 1
    uneven = [m for m in meshes if m.ep > 1 and experts % (m.ep * m.cp * m.tp)]
    crowded = [m for m in meshes if m.ep > 1 and m not in uneven and m.dp_shard > experts // (m.ep * m.cp * m.tp)]
    unsynced = [m for m in meshes if m.ep > 1 and m.dp_shard == 1 and m.dp_replicate == 1]
    notes = []
    if uneven:
        notes.append(f"{len(uneven)} meshes with ep: not searched (ep x cp x tp does not divide the {experts} experts: "
                     f"{_named(uneven, 4)})")
    if crowded:
        notes.append(f"{len(crowded)} meshes with ep: not searched (more dp_shard ranks than a rank's experts, which "
                     f"FSDP2 would shard on dim 1: {_named(crowded, 4)})")
    unsynced = [m for m in unsynced if m not in uneven and m not in crowded]
    if unsynced:
        notes.append(f"{len(unsynced)} meshes with ep and neither dp_shard nor dp_replicate: not searched (the dense "
                     f"gradients' synchronisation over the ep ranks is not modelled: "
                     f"{_named(unsynced, 4)})")
    dropped = {*uneven, *crowded, *unsynced}
    return [m for m in meshes if m not in dropped], notes


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _seconds(time: StepTime, traced: int, accum: int, cp: int = 1) -> tuple[float, float, float]:
    """The step's compute for ``accum`` micro-batches and one optimizer step, from a trace of
    ``traced`` micro-batches; one micro-batch's; the optimizer step's (and zero_grad's). Under
    ``cp`` the trace ran one of each attention call's ``cp`` ring steps (the causal diagonal):
    the other ``cp − 1`` (the balancer's half chunks: as many FLOPs each) are added at its time."""
    once = sum(p.seconds for p in time.phases if p.phase in _ONCE_PER_STEP)
    per = (time.seconds + _ring_steps(time, cp) - once) / traced
    return per * accum + once, per, once


def _ring_steps(time: StepTime, cp: int) -> float:
    """Seconds of the ``cp − 1`` ring steps a trace under ``cp`` did not run: as many again as its
    fused attention kernels' (forward, backward, recompute), each."""
    return (cp - 1) * sum(c.seconds for c in time.classes if c.op_class is OpClass.ATTENTION)


def _configs(search: _Search, meshes: list[Mesh], global_batch: int, peak: float) -> list[_Config]:
    """Every configuration of ``meshes``, each with the lower bound on its step's seconds."""
    out: list[_Config] = []
    sequence = search.sequence
    layers = search.facts.layers or 1
    for mesh in meshes:
        per_rank = global_batch // _data_parallel(mesh)
        shapes: list[tuple[PipelineSchedule | None, int, int]] = []
        if mesh.pp > 1:
            for kind in SCHEDULES:
                if not kind.single_stage and 2 * mesh.pp > layers:
                    continue  # two stages per rank need two blocks per rank
                shapes += [(kind, per_rank // m, m) for m in _divisors(per_rank) if mesh.pp <= m <= 4 * mesh.pp]
        else:
            shapes += [(None, micro, per_rank // micro) for micro in _divisors(per_rank)]
        states = states_floor(search.step, search.facts, mesh)
        for schedule, micro, accum in shapes:
            kept = in_flight(schedule, mesh.pp, search.facts.layers, accum)
            for ckpt, checkpoint in enumerate(search.checkpoints):
                config = _Config(mesh, ckpt, micro, accum, schedule)
                held = states + activations_floor(search.facts, mesh, micro * sequence, checkpoint, kept,
                                                  search.selective, search.off, logits_bytes(search.step.precision))
                if search.step.capacity and held > search.step.capacity:
                    search.over += 1
                    continue
                flops_at = tuple(compute_floor(search.facts, mesh, micro * accum * sequence, c, peak)
                                 for c in search.checkpoints)
                compute = flops_at[ckpt]
                bubble = compute / accum * (mesh.pp - 1) / config.stages_per_rank
                collectives = collectives_of(mesh, search.facts_for(config), accum)
                hidden = sum(c.seconds(search.network) - c.exposed_seconds(search.network) for c in collectives)
                exposed = step_seconds(0.0, 0.0, collectives, search.network, search.facts.layers)[1]
                config = replace(config, flops=compute, flops_at=flops_at, floor=compute, bubble=bubble, hidden=hidden,
                                 exposed=exposed)
                out.append(replace(config, bound=config.with_compute(compute)))
    return out


def find_plan(step: Step, gpus: int, global_batch: int, facts: ModelFacts, *, network: Network,
              top: int = 5, on_estimate: Callable[[str], None] | None = None,
              checkpoint: str = "search", context_parallel: bool | None = None,
              expert_parallel: bool | None = None) -> PlanResult:
    """The ``top`` fastest configurations of ``step`` on ``gpus`` GPUs that fit (see the module
    docstring). ``step`` names the GPU (its capacity and figures); its batch, checkpointing and
    accumulation are replaced. ``checkpoint``: ``search`` (off, selective-op and full), ``auto``
    (:mod:`memcalc.distributed.checkpoint_auto` chooses per configuration), or one setting's label.
    ``context_parallel``: search cp meshes (True), or not (False); None searches them from
    :data:`LONG_CONTEXT` tokens a sample on (:func:`_searches_cp`). ``expert_parallel``: search ep
    meshes of a mixture of experts (None or True), or not (False); a model without experts has none.

    Raises:
        InvalidInputError: no mesh splits ``global_batch`` evenly.
    """
    checkpoints = _checkpoints(checkpoint)
    meshes = [m for m in meshes_over(gpus, facts) if global_batch % _data_parallel(m) == 0]
    if not meshes:
        raise InvalidInputError(f"no mesh over {gpus} GPUs splits a global batch of {global_batch} evenly",
                                hint=f"give a global batch that is a multiple of {gpus}")
    resolved = step.resolved(1)  # built once: read by the bounds and by refusal
    module = resolved.module
    search = _Search(step, facts, network, checkpoints, on_estimate, sequence=_sequence(resolved), resolved=resolved,
                     selective=selective_saved(module), off=off_saved(module))
    wide = [m for m in meshes if m.tp > network.gpus_per_node]
    if wide:
        search.pruned.append(f"{len(wide)} meshes with tp beyond one node ({network.gpus_per_node} GPUs): not searched "
                             f"(each block would wait on the network)")
    meshes = [m for m in meshes if m.tp <= network.gpus_per_node]
    searches_cp = _searches_cp(context_parallel, search.sequence)
    if not searches_cp:
        ringed = [m for m in meshes if m.cp > 1]
        if ringed:
            search.pruned.append(f"{len(ringed)} meshes with cp: not searched "
                                 f"({_why_no_cp(context_parallel, search.sequence, 'them')})")
        meshes = [m for m in meshes if m.cp == 1]
    meshes, unsplit = _balanced_rings(meshes, search.sequence)
    search.pruned += unsplit
    searches_ep = _searches_ep(expert_parallel, facts)
    if not searches_ep:
        routed = [m for m in meshes if m.ep > 1]
        if routed:
            search.pruned.append(f"{len(routed)} meshes with ep: not searched (--no-ep)")
        meshes = [m for m in meshes if m.ep == 1]
    meshes, unrouted = _expert_meshes(meshes, facts)
    search.pruned += unrouted
    refused = {m: refusal(step, m, resolved) for m in meshes}
    unsupported = [m for m in meshes if refused[m] is not None]
    search.pruned += [f"{m.describe()}: {refused[m]}" for m in unsupported]
    # counted as not modelled: not those torch itself would refuse (named in pruned all the same)
    unmodelled = [m for m in unsupported if str(refused[m]).startswith("not modelled")]
    meshes = [m for m in meshes if refused[m] is None]
    capacity = step.capacity or 0
    heavy = [m for m in meshes if capacity and states_floor(step, facts, m) > capacity]
    if heavy:
        search.pruned.append(f"{len(heavy)} meshes whose model states alone exceed the GPU (at least "
                             f"{_gib(min(states_floor(step, facts, m) for m in heavy))}): not estimated "
                             f"({_named(heavy, 6)})")
    meshes = [m for m in meshes if m not in heavy]
    configs = _configs(search, meshes, global_batch, search.flops_rate())
    if not configs and not search.over and not heavy:
        raise InvalidInputError(f"no mesh over {gpus} GPUs splits a global batch of {global_batch} evenly (into "
                                f"data-parallel ranks and micro-batches, or a pipeline's {gpus} microbatches or more)",
                                hint=f"give a global batch that is a multiple of {gpus}")
    if search.over:
        search.pruned.append(f"{search.over} configurations whose model states and kept activations (their lower "
                             f"bounds) exceed the GPU: not estimated")
    # the cheap traces first: configurations without a pipeline (one micro-batch or two traced) before the
    # pipelines (every microbatch of the schedule traced), each in order of its bound
    queue = [(c.schedule is not None, c.bound, -c.mesh.dp_shard, c.mesh.dp_replicate, i) for i, c in enumerate(configs)]
    heapq.heapify(queue)
    failing: dict[tuple[Any, ...], list[tuple[int, int, int]]] = {}  # (dp_shard, ckpt, micro) that did not fit
    timings = _Timings()
    probed: set[tuple[int, int, int]] = set()  # (tp, ckpt, micro) probed without a pipeline
    best: list[PlanCandidate] = []
    broken: set[tuple[Mesh, bool, int]] = set()  # (mesh, pipelined, checkpointing) memcalc refuses
    peaks = Peaks()  # the traced peaks without a pipeline: a floor for their family's smaller micro-batches
    siblings = _siblings(configs)
    done: set[int] = set()  # traced, or ruled out, ahead of their turn (a more sharded sibling)
    bounded = 0

    def ruled_out(config: _Config) -> bool:
        """Whether what was traced says ``config`` does not fit, or memcalc refuses it (its note kept)."""
        if any(shards >= config.mesh.dp_shard and ckpt >= config.ckpt and micro <= config.micro
               for shards, ckpt, micro in failing.get(config.family(), [])):
            return True  # more sharding, more checkpointing or a smaller micro-batch did not fit
        if (config.mesh, config.schedule is not None, config.ckpt) in broken:
            return True
        floor, source = peaks.floor(config.family(), config.mesh.dp_shard, config.ckpt, config.micro)
        if capacity and floor > capacity:
            search.pruned.append(f"{config.describe(checkpoints)}: does not fit (at least {_gib(floor)} allocated at "
                                 f"the peak of {source}, scaled to its micro-batch; not traced)")
            failing.setdefault(config.family(), []).append((config.mesh.dp_shard, config.ckpt, config.micro))
            return True
        return False

    while queue:
        later, bound, shard, replicas, index = heapq.heappop(queue)
        if index in done:
            continue
        config = configs[index]
        if len(best) >= top and best[top - 1].seconds <= bound:
            if not later:  # every configuration left without a pipeline is at least this slow: on to the pipelines
                left = [entry for entry in queue if entry[0]]
                bounded += sum(1 for entry in queue if not entry[0] and entry[4] not in done) + 1
                queue = left
                heapq.heapify(queue)
                continue
            bounded += sum(1 for entry in queue if entry[4] not in done) + 1
            break  # every configuration left is at least this slow
        tighter = timings.bound(config)
        if tighter.bound > config.bound:  # traced configurations bound it more tightly: back in the queue
            configs[index] = config = tighter
            heapq.heappush(queue, (later, config.bound, shard, replicas, index))
            continue
        if ruled_out(config):
            continue
        pipelined = config.schedule is not None
        # its most sharded sibling first (the same kin, checkpointing and micro-batch, more dp_shard for fewer
        # replicas): one that does not fit rules this one out; one that fits is traced as it would have been
        sibling = next((j for j in siblings.get(index, ()) if j not in done), None)
        if sibling is not None:
            other = configs[sibling] = timings.bound(configs[sibling])
            if len(best) < top or other.bound < best[top - 1].seconds:
                heapq.heappush(queue, (later, bound, shard, replicas, index))  # this one again, next
                done.add(sibling)
                if ruled_out(other):
                    continue
                index, config = sibling, other
        if pipelined and len(best) >= top and _probe(search, config, gpus, global_batch, probed, timings):
            heapq.heappush(queue, (later, config.bound, shard, replicas, index))  # its bound again, with the probe's
            continue
        done.add(index)
        try:
            candidate, compute = _confirm(search, config)
        except PipelineOverCapacity as stop:  # a rank does not fit: as a report that does not fit, untimed
            search.pruned.append(f"{config.describe(checkpoints)}: does not fit (pipeline rank {stop.rank}: "
                                 f"{_gib(stop.peak_allocated)} allocated at its peak; the other ranks not traced)")
            failing.setdefault(config.family(), []).append((config.mesh.dp_shard, config.ckpt, config.micro))
            continue
        except MemcalcError as exc:  # a model without blocks to checkpoint, a batch a schedule refuses
            why = str(exc).splitlines()[0]
            where = "under a pipeline" if pipelined else "without a pipeline"
            broken.add((config.mesh, pipelined, config.ckpt))
            label = checkpoints[config.ckpt].label
            search.pruned.append(f"checkpointing {label}: not applicable ({why})" if "checkpoint" in why.lower()
                                 else f"{config.mesh.describe()}, checkpointing {label} {where}: not estimated, as "
                                      f"{config.describe(checkpoints)} failed ({why})")
            continue
        # a trace that does not fit still times its kernels: its compute bounds the others' as a fitting one's does
        timings.record(config, *compute)
        if not pipelined:
            peaks.record(config.family(), config.mesh.dp_shard, config.ckpt, config.micro,
                         search.reports[search.key(config)].bytes, config.describe(checkpoints))
        if candidate is None:
            failing.setdefault(config.family(), []).append((config.mesh.dp_shard, config.ckpt, config.micro))
            continue
        best = sorted([*best, candidate], key=lambda c: c.seconds)
    known = dimensions()
    searched = tuple(n for n in APPLICATION_ORDER if n in known and known[n].planned and (n != "cp" or searches_cp)
                     and (n != "ep" or searches_ep))
    not_searched = tuple(n for n in APPLICATION_ORDER if n not in searched)
    why_not = {"cp": _why_no_cp(context_parallel, search.sequence, "it"),
               "ep": "--no-ep" if facts.experts is not None else "the model has no experts"}
    return PlanResult(best=tuple(best[:top]), gpus=gpus, global_batch=global_batch, network=network,
                      searched=searched, not_searched=not_searched,
                      not_searched_why=tuple(why_not.get(n, "not modelled, or not yet in plan's cost model")
                                             for n in not_searched),
                      meshes=tuple(meshes), configurations=len(configs) + search.over, estimates=search.estimates,
                      pruned=tuple(search.pruned),
                      assumptions=(*_ASSUMPTIONS, _EP_ASSUMPTION) if searches_ep else _ASSUMPTIONS,
                      unsupported=len(unmodelled),
                      bounded=bounded, reused=search.reused)


@dataclass
class _Timings:
    """What the traces so far say about the compute of the configurations not traced yet (module
    docstring): a trace's compute and its part outside the optimizer step (``work``) bound its kin's
    with less sharding, more checkpointing or a smaller micro-batch; a trace without a pipeline's
    work per matmul FLOP-second, times the FLOPs under its checkpointing, bounds the work of those
    with as much tp or more, as much sharding or less, as much checkpointing or more (each adds
    recomputation; a ratio alone does not order, as the FLOPs count full's recomputation and not
    selective-op's) and a smaller micro-batch, pipelined or not (a stage runs a share of the same
    kernels), with the same cp (a ring's rank runs shorter sequences: its attention per matmul FLOP
    differs). A pipeline's bubble is ``(pp − 1) / stages per rank`` microbatches of its work."""

    # per kin: (dp_shard, ckpt, micro, compute, work)
    traced: dict[tuple[Any, ...], list[tuple[int, int, int, float, float]]] = field(default_factory=dict)
    # (tp, cp, dp_shard, ckpt, micro, r, ep)
    ratios: list[tuple[int, int, int, int, int, float, int]] = field(default_factory=list)

    def record(self, config: _Config, compute: float, once: float) -> None:
        """A traced configuration's compute per optimizer step and its optimizer step's part."""
        mesh = config.mesh
        self.traced.setdefault(config.kin(), []).append((mesh.dp_shard, config.ckpt, config.micro, compute,
                                                         compute - once))
        if config.schedule is None and config.flops > 0:
            self.ratios.append((mesh.tp, mesh.cp, mesh.dp_shard, config.ckpt, config.micro,
                                (compute - once) / config.flops, mesh.ep))

    def bound(self, config: _Config) -> _Config:
        """``config`` with the tightest bound the traces give (its own, if they give none tighter)."""
        mesh = config.mesh
        kin = [(compute, work) for s, c, m, compute, work in self.traced.get(config.kin(), [])
               if mesh.dp_shard <= s and config.ckpt >= c and config.micro <= m]
        work = max([w for _, w in kin] + [config.flops_at[c] * r for tp, cp, s, c, m, r, ep in self.ratios
                                          if tp <= mesh.tp and cp == mesh.cp and ep == mesh.ep and s >= mesh.dp_shard
                                          and c <= config.ckpt and m >= config.micro], default=0.0)
        floor = max([compute for compute, _ in kin] + [work, config.floor])
        bound = config.with_compute(floor, work)
        return replace(config, floor=floor, bound=bound) if bound > config.bound else config


def _probe(search: _Search, config: _Config, gpus: int, global_batch: int, probed: set[tuple[int, int, int]],
           timings: _Timings) -> bool:
    """Before a pipeline's trace (every microbatch of its schedule, on each stage): trace, once per
    (tp, checkpointing, micro-batch), the same tp, checkpointing and micro-batch without a pipeline
    over every GPU (``dp_shard = gpus / tp``: as much sharding as any pipeline of that tp has or
    more), a trace of one or two micro-batches, fitting or not, whose compute per matmul FLOP bounds
    the pipeline's (:class:`_Timings`). False: already probed, or no such mesh splits the batch."""
    mesh = config.mesh
    key = (mesh.tp, config.ckpt, config.micro)
    width = gpus // mesh.tp
    if key in probed or mesh.cp > 1 or mesh.ep > 1 or global_batch % (width * config.micro):
        return False
    probed.add(key)
    flat = Mesh(dp_shard=width, tp=mesh.tp)
    if mesh.tp > search.network.gpus_per_node or refusal(search.step, flat, search.resolved) is not None:
        return False
    accum = global_batch // (width * config.micro)
    tokens = config.micro * accum * search.sequence
    flops_at = tuple(compute_floor(search.facts, flat, tokens, c, search.flops_rate()) for c in search.checkpoints)
    probe = _Config(flat, config.ckpt, config.micro, accum, None, flops=flops_at[config.ckpt], flops_at=flops_at)
    try:
        time = search.report(probe).time
    except MemcalcError:
        return False
    assert time is not None
    compute, _, once = _seconds(time, min(accum, 2), accum)
    timings.record(probe, compute, once)
    return True


def _siblings(configs: list[_Config]) -> dict[int, tuple[int, ...]]:
    """Per configuration without a pipeline, those of its kin with the same checkpointing, micro-batch
    and accumulation and more ``dp_shard`` (fewer replicas), the most sharded first."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, config in enumerate(configs):
        if config.schedule is None:
            groups.setdefault((config.kin(), config.ckpt, config.micro, config.accum), []).append(index)
    out: dict[int, tuple[int, ...]] = {}
    for members in groups.values():
        members.sort(key=lambda i: -configs[i].mesh.dp_shard)
        for index in members:
            shards = configs[index].mesh.dp_shard
            more = tuple(j for j in members if configs[j].mesh.dp_shard > shards)
            if more:
                out[index] = more
    return out


def _checkpoints(checkpoint: str) -> tuple[Checkpointing, ...]:
    if checkpoint == "search":
        return CHECKPOINTS
    if checkpoint == "auto":
        return (AUTO,)
    for option in CHECKPOINTS:
        if option.label == checkpoint:
            return (option,)
    raise InvalidInputError(f"plan's checkpoint must be search, auto, off, selective-op or full, got {checkpoint!r}")


_ASSUMPTIONS = (
    "a step takes max(compute + pipeline bubble, overlapped collectives) + exposed collectives + the first "
    "all-gather's share of one block (1 / (layers + 1) of a forward all-gather), which FSDP cannot prefetch",
    "overlapped: FSDP's all-gathers and reduce-scatters, HSDP/DDP's all-reduces, a pipeline's sends; exposed: tensor "
    "parallelism's activation collectives (no async tensor parallelism)",
    "context parallelism: torch's ring (rotate_method=allgather) per attention call all-gathers K and V in forward "
    "and backward beside the call's first step, sends float32 dK/dV after each backward step beside the next (the "
    "last exposed); a step's attention taken at the GPU's dense peak, 2 x tokens x S/cp x heads/tp x head_dim FLOPs "
    "(backward 2.5 x), so only what exceeds it is exposed; the trace's attention kernels counted cp times (it ran "
    "one of the ring's cp steps); FSDP2 over dp_shard x cp; cp only where 2 x cp divides the sequence",
    "ring collectives: a rank receives size × (n − 1) / n per all-gather or reduce-scatter, twice that per "
    "all-reduce; a group within one node runs at NVLink's bandwidth, else at the network's; latency not modelled",
    "FSDP2 FULL_SHARD all-gathers in forward and backward and reduce-scatters every micro-batch (under a pipeline: "
    "once per step, reshard_after_forward=False); DDP/HSDP all-reduce every micro-batch (no no_sync; under a pipeline "
    "once per step, with the reduce-scatter); a rank moves "
    "1 / (tp × pp) of the parameters (FSDP2's group: dp_shard × cp)",
    "tensor parallelism: the collectives of the plan the trace runs, read per module (a Hugging Face tp_plan: an "
    "all-reduce after each row-wise layer in forward and before each column-wise one in backward, a recomputed "
    "block's forward ones again); torchtitan's Llama plan: sequence parallelism, 4 all-gathers and 4 "
    "reduce-scatters of a block's activation per micro-batch (6 + 6 under full checkpointing); the logits "
    "all-gathered (no loss_parallel)",
    "pipeline: bubble = (pp − 1) / stages per rank × one microbatch's compute of the busiest rank; each microbatch's "
    "activation and its gradient cross every stage boundary at the slowest link of the pp group",
    "pruning bounds (never above the truth): model states of a rank ≥ the textbook bytes over dp_shard × cp × tp × "
    "pp; compute ≥ the matmul FLOPs (of S / cp tokens per sample) at the GPU's dense peak for the compute dtype",
    "compute: memcalc's roofline of the traced kernels (memcalc.step_time), ±24% on its calibration steps",
)


#: Said beside the others where plan searches ep (a mixture of experts).
_EP_ASSUMPTION = (
    "expert parallelism: transformers' AllToAllEP per MoE layer all-to-alls its split counts and the routed tokens "
    "(dispatch and combine) in forward and the tokens in backward (the forward's again in each block checkpointing "
    "recomputes: full, selective-op, auto's choice), exposed, over the ep x cp x tp ranks that hold the experts "
    "(torchtitan's ep borrows cp and tp, etp=1), balanced routing, each rank's rows to the others (hidden elements "
    "of the residual stream a row: FSDP2's param_dtype); under tp its combined rows all-gathered over tp (their "
    "gradients in backward), and tp's own collectives those of the model's own plan less the experts; FSDP2 over "
    "dp_shard x cp x ep for the dense part, over dp_shard for each rank's experts; every ep rank runs a batch of its "
    "own; compute bounds count a token's top_k of the experts; meshes with ep need dp_shard or dp_replicate (FSDP2 "
    "or HSDP)")


def _confirm(search: _Search, config: _Config) -> tuple[PlanCandidate | None, tuple[float, float]]:
    """The configuration estimated and timed, or None (pruned) when it does not fit; beside it, its
    compute seconds per optimizer step and the optimizer step's part of them, fitting or not."""
    report = search.report(config)
    label = config.describe(search.checkpoints)
    time = report.time
    assert time is not None
    pipelined = config.schedule is not None
    cp = config.mesh.cp
    compute, per, once = _seconds(time, config.accum if pipelined else min(config.accum, 2),
                                  1 if pipelined else config.accum, cp)
    if pipelined:
        compute = time.seconds + _ring_steps(time, cp)
    if report.fits is False:
        search.pruned.append(f"{label}: does not fit ({_gib(report.bytes.peak_allocated)} allocated at its peak)")
        return None, (compute, once)
    bubble = per * (config.mesh.pp - 1) / config.stages_per_rank
    # what --checkpoint auto chose says which blocks' collectives the backward re-runs
    chosen = (parse_checkpointing(report.checkpointing)
              if search.checkpoints[config.ckpt].kind is CheckpointKind.AUTO else None)
    collectives = collectives_of(config.mesh, search.facts_for(config, chosen), config.accum)
    comm, exposed, seconds = step_seconds(compute, bubble, collectives, search.network, search.facts.layers)
    mesh = config.mesh
    tokens = None if time.tokens is None or not time.samples else (
        time.tokens // time.samples * mesh.cp * config.micro * config.accum * _data_parallel(mesh))
    candidate = PlanCandidate(mesh=mesh, checkpoint=search.checkpoints[config.ckpt], micro_batch=config.micro,
                              accum_steps=config.accum, report=report, compute_seconds=compute, collectives=collectives,
                              comm_seconds=comm, exposed_seconds=exposed, seconds=seconds, tokens_per_step=tokens,
                              schedule=config.schedule, bubble_seconds=bubble, once_seconds=once,
                              checkpoint_label=f"auto → {chosen.label}" if chosen is not None else "")
    return candidate, (compute, once)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"

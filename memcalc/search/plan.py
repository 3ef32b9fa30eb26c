"""``memcalc plan``: which device mesh, micro-batch and checkpointing to train a model with on N GPUs.

The space: every mesh over N GPUs made of the *modelled* dimensions' degrees (the registry
:data:`~memcalc.distributed.strategy.base.DIMENSIONS`, each dimension's
:meth:`~memcalc.distributed.strategy.base.RankStrategy.plan_degrees`; a dimension without a file
is not searched, and the result says which were), every micro-batch ``m`` with
``global batch = m × data-parallel size × accumulation``, and checkpointing off, selective-op
and full. A configuration fits when memcalc's estimate of its busiest rank fits the GPU
(the allocator replayed under the GPU's capacity).

Its time: the rank's compute, memcalc's roofline of the traced kernels (:func:`step_time`), and
its communication, the collective cost model (:mod:`memcalc.distributed.collectives`). Assumed
(and printed): collectives overlap compute, so a step takes ``max(compute, communication)``
plus the one collective that cannot overlap, the first all-gather (a block's share of it:
``1 / (layers + 1)`` of the forward's all-gather), which is what FSDP's prefetching leaves.

Each estimate of a large model costs seconds, so the search prunes on memory facts:

1. memory does not grow with checkpointing (off ≥ selective-op ≥ full) nor shrink with the
   micro-batch (at the same accumulation or none), nor grow with ``dp_shard`` at the same
   data-parallel size and other degrees;
2. a configuration's compute is first traced on its most-sharded mesh, which bounds the others'
   from below (the same forward and backward at the same batch; a less sharded rank steps its
   optimizer over more parameters, and DDP autocasts its fp32 replicas: measured on gpt2, 26 ms
   under dp_shard=8, 27 ms under HSDP 2 × 4, 37 ms under DDP 8), so with the collectives it
   orders the candidates; each is then estimated (and timed) on its own mesh in that order until
   no candidate left can beat the ``top`` found;
3. a less-sharded mesh whose sharded model states alone (those of the traced estimate, scaled by
   the shard degrees) plus the traced estimate's other bytes at its peak exceed the GPU is not
   estimated: the states are held throughout, the rest is the same step;
4. a micro-batch is timed only if it is one of the two largest that fit (the time per sample
   falls as the batch grows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memcalc.core.checkpointing import FULL, OFF, Checkpointing, CheckpointKind
from memcalc.core.errors import InvalidInputError
from memcalc.core.report import MemoryReport
from memcalc.core.throughput import StepTime
from memcalc.distributed.collectives import LAYOUT, Collective, ModelFacts, Network
from memcalc.distributed.estimate import run_estimate
from memcalc.distributed.mesh import Mesh
from memcalc.distributed.options import Distributed
from memcalc.distributed.strategy.base import DIMENSIONS, Plan
from memcalc.distributed.strategy.catalogue import APPLICATION_ORDER, strategies_for
from memcalc.engine.options import Step
from memcalc.timing.performance import step_time

__all__ = ("CHECKPOINTS", "PlanCandidate", "PlanResult", "collectives_of", "find_plan", "meshes_over", "model_facts")

#: The checkpointing tried, from the most memory to the least (and the fastest to the slowest).
CHECKPOINTS = (OFF, Checkpointing(CheckpointKind.SELECTIVE_OP), FULL)
#: Phases that run once per optimizer step, whatever the accumulation.
_ONCE_PER_STEP = ("optimizer", "zero_grad")
_DATA_PARALLEL = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class PlanCandidate:
    """One configuration, estimated: its mesh, micro-batch, accumulation and checkpointing, its
    busiest rank's report, and its time per optimizer step."""

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

    @property
    def tokens_per_second(self) -> float | None:
        return None if self.tokens_per_step is None else self.tokens_per_step / self.seconds

    def to_dict(self, network: Network) -> dict[str, Any]:
        report = self.report
        return {"mesh": self.mesh.used or {"dp_shard": 1}, "micro_batch": self.micro_batch,
                "accum_steps": self.accum_steps, "checkpoint": self.checkpoint.label,
                "peak_allocated": report.bytes.peak_allocated, "peak_reserved": report.peak_reserved,
                "capacity": report.capacity, "headroom": report.headroom, "step_seconds": self.seconds,
                "compute_seconds": self.compute_seconds, "communication_seconds": self.comm_seconds,
                "exposed_communication_seconds": self.exposed_seconds,
                "tokens_per_second": self.tokens_per_second,
                "collectives": [c.to_dict(network) for c in self.collectives]}


@dataclass(frozen=True)
class PlanResult:
    """The best configurations, fastest first, and what was searched and pruned."""

    best: tuple[PlanCandidate, ...]
    gpus: int
    global_batch: int
    network: Network
    searched: tuple[str, ...]
    not_searched: tuple[str, ...]
    meshes: tuple[Mesh, ...]
    configurations: int
    estimates: int
    pruned: tuple[str, ...]
    assumptions: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc plan --format json`` contract."""
        return {"gpus": self.gpus, "global_batch": self.global_batch, "network": self.network.to_dict(),
                "dimensions_searched": list(self.searched), "dimensions_not_searched": list(self.not_searched),
                "meshes": [m.describe() for m in self.meshes], "configurations": self.configurations,
                "estimates": self.estimates, "pruned": list(self.pruned), "assumptions": list(self.assumptions),
                "best": [c.to_dict(self.network) for c in self.best]}


def model_facts(step: Step) -> ModelFacts:
    """The parameter counts, communicated dtypes and transformer shape of ``step``'s model (one
    meta build). Under autocast FSDP gathers 16-bit parameters and reduces float32 gradients
    (torchtitan's ``MixedPrecisionPolicy``); otherwise both move in the stored dtype."""
    module = step.resolved(1).module
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

    return ModelFacts(parameters=parameters, trainable=trainable, gather_bytes=gather,
                      reduce_bytes=4 if precision.is_amp else stored_bytes,
                      layers=attribute("num_hidden_layers", "n_layer", "num_layers"),
                      heads=attribute("num_attention_heads", "n_head"),
                      kv_heads=attribute("num_key_value_heads", "num_attention_heads", "n_head"))


def meshes_over(gpus: int, facts: ModelFacts) -> list[Mesh]:
    """Every mesh of the modelled dimensions' offered degrees whose world size is ``gpus``."""
    names = [name for name in LAYOUT if name in DIMENSIONS and DIMENSIONS[name].planned]
    options = [DIMENSIONS[name].plan_degrees(facts, gpus) for name in names]
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
    return tuple(c for name in APPLICATION_ORDER if name in DIMENSIONS and mesh.degrees[name] > 1
                 for c in DIMENSIONS[name].collectives(mesh, facts, micro_batches))


@dataclass
class _Search:
    step: Step
    facts: ModelFacts
    network: Network
    estimates: int = 0
    pruned: list[str] = field(default_factory=list)
    reports: dict[tuple[Mesh, int, int], MemoryReport | None] = field(default_factory=dict)
    compute: dict[tuple[Mesh, int, int], float] = field(default_factory=dict)

    def estimate(self, mesh: Mesh, ckpt: int, micro: int, accum: int, timed: bool) -> MemoryReport:
        step = replace(self.step, batch_size=micro, checkpoint=CHECKPOINTS[ckpt], accum_steps=min(accum, 2),
                       record_costs=timed)
        distributed = Distributed() if mesh.world_size == 1 else Distributed(mesh=mesh)
        self.estimates += 1
        report = run_estimate(step, distributed)
        return replace(report, time=step_time(report)) if timed else report


def _refusal(step: Step, mesh: Mesh) -> str | None:
    """Why the strategies refuse ``mesh`` (a combination of dimensions not modelled together, such
    as ``dp_replicate`` with ``tp`` today), found by planning its roles without a trace; None: none."""
    if mesh.world_size == 1:
        return None
    try:
        plan = Plan(roles=(), batch=1, global_batch=mesh.dp_replicate * mesh.dp_shard)
        for strategy in strategies_for(Distributed(mesh=mesh)):
            plan = strategy.plan(plan, step)
    except InvalidInputError as exc:
        return f"not searched ({str(exc).splitlines()[0]})"
    return None


def _seconds(time: StepTime, traced: int, accum: int) -> float:
    """``accum`` micro-batches and one optimizer step, from an estimate of ``traced`` micro-batches."""
    once = sum(p.seconds for p in time.phases if p.phase in _ONCE_PER_STEP)
    return (time.seconds - once) / traced * accum + once


def _family(mesh: Mesh) -> tuple[tuple[str, int], ...]:
    """The degrees other than data parallel's, and the data-parallel size: meshes of one family
    run the same kernels at the same micro-batch."""
    degrees = mesh.degrees
    return (*((n, d) for n, d in degrees.items() if n not in _DATA_PARALLEL),
            ("dp", degrees["dp_replicate"] * degrees["dp_shard"]))


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def find_plan(step: Step, gpus: int, global_batch: int, facts: ModelFacts, *, network: Network,
              top: int = 5, on_estimate: Callable[[str], None] | None = None) -> PlanResult:
    """The ``top`` fastest configurations of ``step`` on ``gpus`` GPUs that fit (see the module
    docstring). ``step`` names the GPU (its capacity and figures); its batch, checkpointing and
    accumulation are replaced.

    Raises:
        InvalidInputError: no mesh splits ``global_batch`` evenly.
        DoesNotFitError-like: none; an empty ``best`` says nothing fits (``pruned`` says why).
    """
    meshes = meshes_over(gpus, facts)
    meshes = [m for m in meshes if global_batch % (m.dp_replicate * m.dp_shard) == 0]
    if not meshes:
        raise InvalidInputError(f"no mesh over {gpus} GPUs splits a global batch of {global_batch} evenly",
                                hint=f"give a global batch that is a multiple of {gpus}")
    search = _Search(step, facts, network)
    refused = {m: _refusal(step, m) for m in meshes}
    search.pruned += [f"{m.describe()}: {why}" for m, why in refused.items() if why is not None]
    meshes = [m for m in meshes if refused[m] is None]
    families: dict[tuple[tuple[str, int], ...], list[Mesh]] = {}
    for mesh in meshes:
        families.setdefault(_family(mesh), []).append(mesh)
    configurations = sum(3 * len(_divisors(global_batch // (m.dp_replicate * m.dp_shard))) for m in meshes)
    timed: list[tuple[float, Mesh, int, int, int]] = []  # (lower-bound seconds, mesh, ckpt, micro, accum)
    for members in families.values():
        members.sort(key=lambda m: -m.dp_shard)  # the most sharded first: the least memory
        timed += _family_candidates(search, members, global_batch, on_estimate)
    timed.sort(key=lambda t: (t[0], -t[1].dp_shard))
    best: list[PlanCandidate] = []
    for bound, mesh, ckpt, micro, accum in timed:
        if len(best) >= top and sorted(c.seconds for c in best)[top - 1] <= bound:
            break  # every candidate left is at least this slow
        candidate = _confirm(search, mesh, ckpt, micro, accum, on_estimate)
        if candidate is not None:
            best.append(candidate)
    best = sorted(best, key=lambda c: c.seconds)[:top]
    searched = tuple(n for n in APPLICATION_ORDER if n in DIMENSIONS and DIMENSIONS[n].planned)
    return PlanResult(best=tuple(best), gpus=gpus, global_batch=global_batch, network=network,
                      searched=searched, not_searched=tuple(n for n in APPLICATION_ORDER if n not in searched),
                      meshes=tuple(meshes), configurations=configurations, estimates=search.estimates,
                      pruned=tuple(search.pruned), assumptions=_ASSUMPTIONS)


_ASSUMPTIONS = (
    "collectives overlap compute: a step takes max(compute, communication) plus the first all-gather's "
    "share of one block (1 / (layers + 1) of a forward all-gather), which FSDP cannot prefetch",
    "ring collectives: a rank receives size × (n − 1) / n per all-gather or reduce-scatter, twice that per "
    "all-reduce; a group within one node runs at NVLink's bandwidth, else at the network's; latency not modelled",
    "FSDP2 FULL_SHARD all-gathers in forward and backward and reduce-scatters every micro-batch; DDP/HSDP "
    "all-reduce every micro-batch (no no_sync)",
    "the most-sharded mesh's compute (the smallest optimizer step, no autocast casts) bounds the others' from "
    "below: candidates are estimated in that order until the best are known",
    "compute: memcalc's roofline of the traced kernels (memcalc.step_time), ±24% on its calibration steps",
)


def _family_candidates(search: _Search, members: list[Mesh], global_batch: int,
                       on_estimate: Callable[[str], None] | None) -> Iterator[tuple[float, Mesh, int, int, int]]:
    """The configurations of one mesh family worth confirming, each with its time: the compute is
    traced on the most-sharded mesh (whose fit is then known), from full checkpointing (the least
    memory) to none, the largest micro-batches that fit first."""
    rep = members[0]
    dp = rep.dp_replicate * rep.dp_shard
    per_rank = global_batch // dp
    micro_batches = _divisors(per_rank)
    smallest_failing: dict[int, int] = {}  # ckpt -> smallest micro-batch that does not fit at rep
    for ckpt in reversed(range(len(CHECKPOINTS))):
        label = CHECKPOINTS[ckpt].label
        # less checkpointing needs at least as much memory: what failed under more fails here
        limit = min([smallest_failing[c] for c in smallest_failing if c > ckpt], default=per_rank + 1)
        tried = [m for m in micro_batches if m < limit]
        if not tried:
            search.pruned.append(f"{rep.describe()} with checkpointing {label}: not estimated, as more "
                                 f"checkpointing did not fit at micro-batch {limit}")
            smallest_failing[ckpt] = limit
            continue
        try:
            fitting = _largest_fitting(search, rep, ckpt, tried, per_rank, on_estimate)
        except InvalidInputError as exc:  # a model without blocks memcalc can checkpoint
            if not CHECKPOINTS[ckpt]:
                raise
            search.pruned.append(f"checkpointing {label}: not applicable ({str(exc).splitlines()[0]})")
            smallest_failing[ckpt] = per_rank + 1
            continue
        failing = [m for m in tried if m > (fitting[0] if fitting else 0)]
        smallest_failing[ckpt] = min([*failing, limit])
        if fitting and failing:
            search.pruned.append(f"{rep.describe()} with checkpointing {label}: micro-batch {min(failing)} and "
                                 f"larger do not fit (nor, then, on a less sharded mesh)")
        if not fitting:
            search.pruned.append(f"{rep.describe()} with checkpointing {label}: not even micro-batch "
                                 f"{tried[0]} fits (nor, then, a less sharded mesh)")
            continue
        for micro in fitting:
            accum = per_rank // micro
            seconds = search.compute[(rep, ckpt, micro)]
            for mesh in members:
                yield _timing(search, mesh, seconds, accum)[3], mesh, ckpt, micro, accum
    return


def _largest_fitting(search: _Search, rep: Mesh, ckpt: int, tried: list[int], per_rank: int,
                     on_estimate: Callable[[str], None] | None) -> list[int]:
    """The two largest of ``tried`` that fit on ``rep`` (each timed). Memory grows with the
    micro-batch, save that accumulating keeps the gradients alive: the micro-batch that does not
    accumulate (the whole per-rank batch) is tried apart from those that do, which are bisected
    (the largest first: on a small model everything fits)."""
    def fits(micro: int) -> bool:
        return _estimate(search, rep, ckpt, micro, per_rank // micro, True, on_estimate).fits is not False

    found = [m for m in tried if m == per_rank and fits(m)]
    parts = [m for m in tried if m != per_rank]
    lo, hi = -1, len(parts)  # parts[lo] fits (or lo == -1), parts[hi] does not (or hi == len)
    if parts:
        if fits(parts[-1]):
            lo = len(parts) - 1
        else:
            hi = len(parts) - 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(parts[mid]) else (lo, mid)
    if lo >= 0:
        found.append(parts[lo])
        if len(found) < 2 and lo >= 1 and fits(parts[lo - 1]):
            found.append(parts[lo - 1])
    return sorted(found, reverse=True)[:2]


def _estimate(search: _Search, mesh: Mesh, ckpt: int, micro: int, accum: int, timed: bool,
              on_estimate: Callable[[str], None] | None) -> MemoryReport:
    key = (mesh, ckpt, micro)
    known = search.reports.get(key)
    if known is not None and (not timed or known.time is not None):
        return known
    if on_estimate is not None:
        on_estimate(f"{mesh.describe()}, micro-batch {micro}, accumulation {accum}, "
                    f"checkpointing {CHECKPOINTS[ckpt].label}")
    report = search.estimate(mesh, ckpt, micro, accum, timed)
    search.reports[key] = report
    if report.time is not None:
        search.compute[key] = _seconds(report.time, min(accum, 2), accum)
    return report


def _timing(search: _Search, mesh: Mesh, compute: float,
            accum: int) -> tuple[tuple[Collective, ...], float, float, float]:
    """The collectives, their seconds, the part not overlapped, and the step's seconds."""
    collectives = collectives_of(mesh, search.facts, accum)
    comm = sum(c.seconds(search.network) for c in collectives)
    blocks = (search.facts.layers or 0) + 1
    first = [c for c in collectives if c.what.startswith("all-gather")]
    exposed = first[0].seconds(search.network) / first[0].count / blocks if first else 0.0
    return collectives, comm, exposed, max(compute, comm) + exposed


def _confirm(search: _Search, mesh: Mesh, ckpt: int, micro: int, accum: int,
             on_estimate: Callable[[str], None] | None) -> PlanCandidate | None:
    """The candidate estimated on its own mesh, or None (pruned) when it does not fit."""
    rep_key = max((k for k in search.compute if k[1] == ckpt and k[2] == micro and _family(k[0]) == _family(mesh)),
                  key=lambda k: k[0].dp_shard)
    rep_report = search.reports[rep_key]
    assert rep_report is not None
    label = f"{mesh.describe()}, micro-batch {micro}, checkpointing {CHECKPOINTS[ckpt].label}"
    if mesh != rep_key[0]:
        states = sum(getattr(rep_report.bytes, s) for s in ("parameters", "gradients", "optimizer_state"))
        bound = rep_report.bytes.peak_allocated + states * (rep_key[0].dp_shard / mesh.dp_shard - 1)
        if rep_report.capacity is not None and bound > rep_report.capacity:
            held = _gib(states * rep_key[0].dp_shard / mesh.dp_shard)
            search.pruned.append(f"{label}: its sharded model states ({held}) and the rest of the traced peak "
                                 f"exceed the GPU (not estimated)")
            return None
    report = _estimate(search, mesh, ckpt, micro, accum, True, on_estimate)
    if report.fits is False:
        search.pruned.append(f"{label}: does not fit ({_gib(report.bytes.peak_allocated)} allocated at its peak)")
        return None
    compute = search.compute[(mesh, ckpt, micro)]
    collectives, comm, exposed, seconds = _timing(search, mesh, compute, accum)
    time = rep_report.time
    tokens = None if time is None or time.tokens is None or not time.samples else (
        time.tokens // time.samples * micro * accum * mesh.dp_replicate * mesh.dp_shard)
    return PlanCandidate(mesh=mesh, checkpoint=CHECKPOINTS[ckpt], micro_batch=micro, accum_steps=accum,
                         report=report, compute_seconds=compute, collectives=collectives, comm_seconds=comm,
                         exposed_seconds=exposed, seconds=seconds, tokens_per_step=tokens)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


"""The interface every way of spreading a step over GPUs implements, and the registry that
finds one by its shorthand (``--strategy ddp``) or by its mesh dimension (``dp_shard``).

A strategy object says, for its part of the step:

- which options of :class:`~memcalc.distributed.setting.Distributed` it reads (the others are
  refused rather than ignored), and how a shorthand counts its GPUs;
- its **roles**: which ranks hold what, at what batch, under which rank program
  (:mod:`memcalc.distributed.program`) — by refining the :class:`Plan` the dimensions before it
  made, so that dimensions compose (a pipeline splits the roles into stages, tensor parallelism
  shards each stage's model, ``dp_shard`` wraps it in FSDP2);
- the precision its ranks trace at, the fine-tuning it refuses, the model preparation it
  requires (:meth:`RankStrategy.prepare`), and its notes (in the plan).

Adding a dimension is one file in this package with one :func:`register`-ed subclass; the
catalogue (:mod:`memcalc.distributed.strategy.catalogue`) imports every file here. A mesh
dimension without a file is refused by name when estimated ("pp is not modelled yet").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol, TypeVar

from memcalc.core.errors import InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.core.losses import LossFn
from memcalc.core.precision import Precision
from memcalc.core.report import MemoryReport, Shard
from memcalc.distributed.collectives import Collective, ModelFacts
from memcalc.distributed.mesh import DIMENSION_NAMES, Mesh
from memcalc.distributed.program import RankProgram
from memcalc.distributed.vocabulary import FsdpSharding, Routing, Strategy, ZeroStage3
from memcalc.engine.model import ResolvedModel
from memcalc.engine.run import CostRecorderFactory
from memcalc.engine.step_spec import Step

__all__ = ("DIMENSIONS", "MODEL_STATES", "SHORTHANDS", "Plan", "RankStrategy", "Role", "Setting", "every_rank",
           "register", "sharding")

#: Sharded states, as :class:`~memcalc.core.report.Shard` names them.
MODEL_STATES = ("parameters", "gradients", "optimizer_state")


class Setting(Protocol):
    """What a strategy reads of the multi-GPU setting: :class:`memcalc.Distributed`, which looks
    the strategies up when it is made (so they know it by this interface, not by import)."""

    @property
    def strategy(self) -> Strategy: ...
    @property
    def world_size(self) -> int: ...
    @property
    def mesh(self) -> Mesh | None: ...
    @property
    def device_ids(self) -> tuple[int, ...]: ...
    @property
    def batch_is_global(self) -> bool: ...
    @property
    def bucket_cap_mb(self) -> float: ...
    @property
    def gradient_as_bucket_view(self) -> bool: ...
    @property
    def sharding(self) -> FsdpSharding: ...
    @property
    def reduce_bucket_size(self) -> int: ...
    @property
    def overlap_comm(self) -> bool: ...
    @property
    def offload_optimizer(self) -> bool: ...
    @property
    def stage3(self) -> ZeroStage3 | None: ...
    @property
    def pp_schedule(self) -> str | None: ...
    @property
    def microbatches(self) -> int | None: ...
    @property
    def pp_split(self) -> tuple[str, ...] | None: ...
    @property
    def tp_plan(self) -> tuple[tuple[str, str], ...] | None: ...
    @property
    def loss_parallel(self) -> bool: ...
    @property
    def routing(self) -> Routing: ...
    @property
    def capacity_factor(self) -> float | None: ...
    @property
    def data_parallel_size(self) -> int: ...
    def per_rank_batch(self, batch: int) -> int: ...


@dataclass(frozen=True)
class Role:
    """One distinct kind of rank: the ranks that share one trace.

    Attributes:
        name: the per-rank table's row (``every rank``, ``output device (cuda:0)``).
        ranks: the GPUs of this role.
        batch: the samples its model runs.
        program: builds the rank program that wraps the role's model; None: none yet (the plan
            before any strategy).
        optimizer: False: this GPU runs no optimizer (DataParallel's other devices).
        loss_fn, loss_text: the loss this GPU computes, where it is not the step's.
        sharding: what each mesh dimension divides on these ranks; None: the GPUs are not ranks
            of a process group (DataParallel's one process).
        seq_len: the tokens per sample its model runs (context parallelism's share of the
            sequence); None: the step's.
    """

    name: str
    ranks: tuple[int, ...]
    batch: int
    program: Callable[[ResolvedModel], RankProgram] | None = None
    optimizer: bool = True
    loss_fn: LossFn | None = None
    loss_text: str | None = None
    sharding: tuple[Shard, ...] | None = ()
    seq_len: int | None = None


@dataclass(frozen=True)
class Plan:
    """The roles of a step, as the strategies made them, in order.

    Attributes:
        roles: one per distinct kind of rank.
        batch: the estimate's batch as the user gave it (each GPU's, or the global one).
        global_batch: the samples per step over all GPUs.
        notes: what applies to every role.
    """

    roles: tuple[Role, ...]
    batch: int
    global_batch: int
    notes: tuple[str, ...] = ()


class RankStrategy(ABC):
    """One way of spreading the step: a mesh dimension (``dp_shard``) or a strategy that is not
    one (DataParallel, DeepSpeed ZeRO). Instances are made per estimate from the setting.

    Class attributes (declarations, read before any estimate):
        name: the label of its rows and errors: the dimension's name (``dp_shard``) or the
            shorthand (``zero2``, ``dp``).
        options: the :class:`memcalc.Distributed` arguments it reads, beside ``world_size`` and
            ``batch_is_global`` (which every multi-GPU setting reads).
        mesh_dimension: the mesh dimension it implements; None: not a mesh dimension.
    """

    name: ClassVar[str]
    options: ClassVar[frozenset[str]] = frozenset()
    mesh_dimension: ClassVar[str | None] = None
    #: True: the dimension estimates the whole step itself (:meth:`estimate`) instead of adding
    #: to the roles: a pipeline rank runs a schedule over several microbatches, not one traced
    #: step. Such a dimension composes only with those of :attr:`composes_with`, which it applies itself.
    whole_step: ClassVar[bool] = False
    #: A :attr:`whole_step` dimension's: the dimensions it composes with (reading their degrees).
    composes_with: ClassVar[frozenset[str]] = frozenset()
    #: False: ``memcalc plan`` does not search this dimension: its communication (or a pipeline's
    #: bubble) is not in plan's cost model yet, and a dimension ranked as free would win unfairly.
    planned: ClassVar[bool] = True

    def __init__(self, distributed: Setting, degree: int) -> None:
        self.distributed = distributed
        self.degree = degree

    # ---- declarations of a shorthand --------------------------------------------------------
    @classmethod
    def world_size(cls, strategy: Strategy, world_size: int | None, device_ids: tuple[int, ...]) -> int:
        """The GPUs of ``--strategy NAME --world-size N``: N, which must be given."""
        if world_size is None:
            raise InvalidInputError(f"--strategy {strategy.value} needs the number of GPUs",
                                    hint=f"give --world-size N, e.g. --strategy {strategy.value} --world-size 8")
        return world_size

    @classmethod
    def shorthand_mesh(cls, world_size: int) -> Mesh | None:
        """The device mesh a shorthand of ``world_size`` GPUs stands for; None: not a mesh."""
        if cls.mesh_dimension is None:
            return None
        return Mesh(**{cls.mesh_dimension: world_size})

    # ---- declarations for ``memcalc plan`` (class methods: before any estimate) ----------------
    @classmethod
    def plan_degrees(cls, facts: ModelFacts, gpus: int) -> tuple[int, ...]:
        """The degrees ``memcalc plan`` tries for this dimension on ``gpus`` GPUs: by default every
        divisor of ``gpus``. A dimension with constraints narrows it (tensor parallelism: divisors
        of the attention and KV heads; a pipeline: at most the layers)."""
        return tuple(d for d in range(1, gpus + 1) if gpus % d == 0)

    @classmethod
    def collectives(cls, mesh: Mesh, facts: ModelFacts, micro_batches: int) -> tuple[Collective, ...]:
        """What one rank of this dimension communicates per optimizer step of ``micro_batches``
        micro-batches on ``mesh`` (:mod:`memcalc.distributed.collectives`); none by default."""
        return ()

    # ---- behaviour in an estimate ---------------------------------------------------------
    def trace_precision(self, precision: Precision) -> Precision:
        """The precision the traced step runs at (the program may cast around the model)."""
        return precision

    def refuse_finetune(self, finetune: FineTune) -> None:
        """Raise :class:`~memcalc.core.errors.InapplicableOptionError` for fine-tuning this
        strategy's program does not model faithfully (none, by default)."""
        return None

    def prepare(self, resolved: ResolvedModel, trace_precision: Precision) -> ResolvedModel:
        """One role's fine-tuned model, as this strategy requires it before its program wraps
        it (a refusal, a cast the real library makes)."""
        return resolved

    @abstractmethod
    def plan(self, plan: Plan, step: Step) -> Plan:
        """The roles with this strategy's part added: its program, its batch, its sharding, its notes."""

    def estimate(self, step: Step, batch: int, costs: CostRecorderFactory | None) -> MemoryReport:
        """A :attr:`whole_step` dimension's estimate of every rank at the user's ``batch`` (each
        data-parallel replica's); the others never get here."""
        raise NotImplementedError(f"{type(self).__name__} adds to the roles (whole_step is False)")


S = TypeVar("S", bound=type[RankStrategy])

#: The strategy behind each ``--strategy`` shorthand (``single`` and ``mesh`` have none).
SHORTHANDS: dict[Strategy, type[RankStrategy]] = {}
#: The strategy of each modelled mesh dimension.
DIMENSIONS: dict[str, type[RankStrategy]] = {}


def register(*shorthands: Strategy) -> Callable[[S], S]:
    """Class decorator: record a strategy under its shorthands and its mesh dimension (duplicates
    refused, as a registry of formulas refuses them)."""

    def add(cls: S) -> S:
        dimension = cls.mesh_dimension
        if dimension is not None:
            if dimension not in DIMENSION_NAMES:
                raise ValueError(f"{cls.__name__}: {dimension!r} is not a mesh dimension")
            if dimension in DIMENSIONS:
                raise ValueError(f"mesh dimension {dimension} is already {DIMENSIONS[dimension].__name__}")
            DIMENSIONS[dimension] = cls
        for shorthand in shorthands:
            if shorthand in SHORTHANDS or not shorthand.is_shorthand or shorthand is Strategy.SINGLE:
                raise ValueError(f"{cls.__name__}: --strategy {shorthand.value} cannot be registered")
            SHORTHANDS[shorthand] = cls
        return cls

    return add


def sharding(plan_sharding: tuple[Shard, ...] | None, *added: Shard) -> tuple[Shard, ...] | None:
    """A role's sharding with ``added``: None stays None (not a process group)."""
    return None if plan_sharding is None else (*plan_sharding, *added)


def every_rank(plan: Plan, distributed: Setting) -> Plan:
    """``plan``, or — for the first strategy to make roles — one role of every rank at the
    per-rank batch (the user's, or the global batch split over the data-parallel ranks)."""
    if plan.roles:
        return plan
    per_rank = distributed.per_rank_batch(plan.batch)
    role = Role("every rank", tuple(range(distributed.world_size)), per_rank)
    return replace(plan, roles=(role,), global_batch=per_rank * distributed.data_parallel_size)

"""The multi-GPU setting :class:`Distributed` that :func:`memcalc.estimate` takes, validated when
it is made: a ``--strategy`` shorthand (``Distributed("fsdp", world_size=8)``) or a device mesh
by its degrees (``Distributed(dp_shard=8, tp=4)``, torchtitan's names; :mod:`memcalc.distributed.mesh`).
What each strategy reads, counts and holds per GPU is its object's
(:mod:`memcalc.distributed.strategy`); the vocabulary is :mod:`memcalc.distributed.vocabulary`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from memcalc.core.choices import parse_choice
from memcalc.core.counts import INT64_MAX, as_integer
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.mesh import MAX_WORLD_SIZE, Mesh
from memcalc.distributed.pipeline_schedules import PipelineSchedule
from memcalc.distributed.strategy.catalogue import dimensions, options_of, shorthand_class, shorthands
from memcalc.distributed.vocabulary import (
    DEEPSPEED_REDUCE_BUCKET_SIZE,
    DEFAULT_BUCKET_CAP_MB,
    FsdpSharding,
    Routing,
    Strategy,
    ZeroStage3,
    dp_chunks,
)

__all__ = (
    "DEEPSPEED_REDUCE_BUCKET_SIZE",
    "DEFAULT_BUCKET_CAP_MB",
    "Distributed",
    "FsdpSharding",
    "Routing",
    "Strategy",
    "dp_chunks",
    "inapplicable_option",
)

_MIB = 1024 * 1024


@dataclass(frozen=True, init=False)
class Distributed:
    """The multi-GPU setting of an estimate, validated when it is made.

    ``Distributed("ddp", world_size=4)``; ``Distributed("dp", device_ids=(0, 1))``;
    ``Distributed("fsdp", world_size=8, sharding="shard_grad_op")``;
    ``Distributed("zero3", world_size=8, reduce_bucket_size=10**7)``; a device mesh by its
    degrees: ``Distributed(dp_shard=8, tp=4, pp=2)`` (the world size is their product).

    The shorthands are meshes of one dimension: ``"fsdp"`` is ``dp_shard=N`` and ``"ddp"`` is
    ``dp_replicate=N`` (the two settings are equal); ``"dp"`` (DataParallel) and ``"zero1"`` to
    ``"zero3"`` (DeepSpeed) are not device meshes.

    Args:
        strategy: ``single``, ``dp``, ``ddp``, ``fsdp``, ``zero1``, ``zero2`` or ``zero3``; with
            degrees: nothing, or the shorthand of one of the mesh's dimensions (``fsdp`` with
            ``dp_shard``).
        world_size: the number of GPUs (ranks); ``dp``: or give ``device_ids``; with degrees:
            their product, if given.
        device_ids: ``dp`` only: the GPUs DataParallel uses (outputs gathered on the first).
        batch_is_global: the estimate's ``batch_size`` is the global batch, split over the
            data-parallel GPUs (default: each GPU's batch).
        bucket_cap_mb: ``ddp`` / ``dp_replicate``: gradient bucket size in MiB (PyTorch's 25).
        gradient_as_bucket_view: ``ddp`` / ``dp_replicate``: gradients are views into the buckets.
        sharding: ``fsdp`` / ``dp_shard``: ``full_shard`` (the default) or ``shard_grad_op``.
        reduce_bucket_size: ``zero*``: DeepSpeed's reduce bucket, in elements (5e8).
        overlap_comm: ``zero1`` / ``zero2``: DeepSpeed's ``overlap_comm`` (two reduce buckets).
        offload_optimizer: ``zero*``: ``offload_optimizer.device: cpu`` (the fp32 master
            partition, the optimizer state and the gradient partition in host memory).
        stage3: ``zero3``: its parameter settings (:class:`~memcalc.distributed.vocabulary.ZeroStage3`:
            prefetch bucket, live and reuse bounds, persistence threshold, ``offload_param``);
            None: DeepSpeed's defaults.
        dp_replicate, dp_shard, tp, pp, cp, ep: the mesh's degrees (torchtitan's names; 1 or
            None: not used). A dimension without a strategy file, or a composition that is not
            modelled (tp or pp with anything but dp_shard; ep with another dimension), is
            accepted here and refused by the estimate, by name. ``sharding`` does not apply inside
            a pipeline: its stages keep torchtitan's ``reshard_after_forward=False``.
        etp: torchtitan's expert tensor-parallel degree under ``ep``: 1 (the layout modelled: the
            experts whole over ep ranks that borrow tp) or None; tp is refused by name (not modelled:
            torchtitan removed ``ExpertTensorParallel``), any other value as torchtitan refused it.
        tp_plan: ``tp``: the tensor-parallel plan, module-name pattern → transformers style string
            (``{"mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}``); None: the model's own
            (a Hugging Face ``tp_plan``, or torchtitan's for the zoo's Llama family).
        loss_parallel: ``tp``: keep the logits sharded over the vocabulary and compute the loss
            under torch's ``loss_parallel()`` (torchtitan's Llama plan only).
        routing: ``ep``: what the tokens' split over the experts is assumed to be, the router's
            choice being data: ``balanced`` (the default), ``worst`` (every rank sends the traced
            rank's experts all it can), or ``capacity`` (give ``capacity_factor``).
        capacity_factor: ``ep``: each expert receives this many times its balanced share from
            every rank (GShard's capacity factor, e.g. 1.25); implies ``routing="capacity"``.
        mesh: the same degrees as one mapping (``{"dp_shard": 8, "tp": 4}``) or a
            :class:`~memcalc.distributed.mesh.Mesh`.

    An option of another strategy (``bucket_cap_mb`` with ``"zero3"``, ``batch_is_global``
    with one GPU) raises :class:`~memcalc.core.errors.InapplicableOptionError` rather than
    being ignored.
    """

    strategy: Strategy
    world_size: int
    device_ids: tuple[int, ...]
    batch_is_global: bool
    bucket_cap_mb: float
    gradient_as_bucket_view: bool
    sharding: FsdpSharding
    reduce_bucket_size: int
    overlap_comm: bool
    offload_optimizer: bool
    #: ``zero3``'s parameter settings (DeepSpeed's defaults unless a config says otherwise); None otherwise.
    stage3: ZeroStage3 | None
    #: The device mesh (a single GPU's: every degree 1); None for ``dp`` and ``zero*``.
    mesh: Mesh | None
    #: ``pp``: the schedule's name (None: 1F1B, torchtitan's default), the microbatches per step
    #: (None: as many as the pipeline ranks) and the block each stage after the first begins with.
    pp_schedule: str | None
    microbatches: int | None
    pp_split: tuple[str, ...] | None
    #: ``tp``'s plan as (pattern, style string) pairs, in the user's order; None: the model's own.
    tp_plan: tuple[tuple[str, str], ...] | None
    loss_parallel: bool
    #: ``ep``: the routing assumed, and the capacity factor under ``capacity`` (else None).
    routing: Routing
    capacity_factor: float | None

    def __init__(self, strategy: Strategy | str = Strategy.SINGLE, *, world_size: int | None = None,
                 device_ids: Sequence[int] | None = None, batch_is_global: bool = False,
                 bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False,
                 sharding: FsdpSharding | str | None = None, reduce_bucket_size: int | None = None,
                 overlap_comm: bool = False, offload_optimizer: bool = False,
                 dp_replicate: int | None = None, dp_shard: int | None = None, tp: int | None = None,
                 pp: int | None = None, cp: int | None = None, ep: int | None = None,
                 etp: int | None = None, mesh: Mesh | Mapping[str, int] | None = None, pp_schedule: str | None = None,
                 microbatches: int | None = None, pp_split: Sequence[str] | None = None,
                 tp_plan: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
                 loss_parallel: bool = False, routing: Routing | str | None = None,
                 capacity_factor: float | None = None, stage3: ZeroStage3 | None = None) -> None:
        strategy_ = parse_choice(Strategy, strategy, "strategy")
        sharding_ = FsdpSharding.FULL_SHARD if sharding is None else parse_choice(FsdpSharding, sharding,
                                                                                 "FSDP sharding")
        world_size = _checked_world_size(world_size)
        for flag, setting in (("batch_is_global", batch_is_global),
                              ("gradient_as_bucket_view", gradient_as_bucket_view), ("loss_parallel", loss_parallel),
                              ("overlap_comm", overlap_comm), ("offload_optimizer", offload_optimizer)):
            if not isinstance(setting, bool):
                raise InvalidInputError(f"{flag} must be True or False, got {setting!r}")
        degrees = {name: value for name, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard),
                                                    ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep),
                                                    ("etp", etp))
                   if value is not None}
        mesh_ = _given_mesh(mesh, degrees)
        world = 0
        if mesh_ is not None:
            strategy_, world = _on_mesh(strategy_, mesh_, world_size)
        elif strategy_ is Strategy.MESH:
            raise InvalidInputError("a mesh is given by its degrees, not by strategy='mesh'",
                                    hint="e.g. Distributed(dp_shard=8, tp=4) (--mesh dp_shard=8,tp=4)")
        routing_, factor = _checked_routing(routing, capacity_factor)
        _refuse_inapplicable(strategy_, mesh_, bucket_cap_mb=bucket_cap_mb,
                             gradient_as_bucket_view=gradient_as_bucket_view, sharding=sharding_,
                             reduce_bucket_size=reduce_bucket_size, batch_is_global=batch_is_global,
                             overlap_comm=overlap_comm, offload_optimizer=offload_optimizer,
                             pp_schedule=pp_schedule, microbatches=microbatches, pp_split=pp_split,
                             tp_plan=_checked_tp_plan(tp_plan), loss_parallel=loss_parallel,
                             routing=routing_, capacity_factor=factor, stage3=stage3)
        if stage3 is not None and not isinstance(stage3, ZeroStage3):
            raise InvalidInputError(f"stage3 is a ZeroStage3, got {stage3!r}")
        if stage3 is not None and strategy_ not in (Strategy.ZERO3, Strategy.SINGLE):
            raise InapplicableOptionError(f"stage3 (DeepSpeed's stage3_* settings and offload_param) applies to "
                                          f"strategy zero3, not {strategy_.value}")
        ids = _device_ids(device_ids, strategy_)
        if mesh_ is None:
            world, mesh_ = _shorthand(strategy_, world_size, ids)
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else _checked_bucket_cap_mb(bucket_cap_mb)
        bucket = (DEEPSPEED_REDUCE_BUCKET_SIZE if reduce_bucket_size is None
                  else _checked_reduce_bucket_size(reduce_bucket_size))
        if "device_ids" in options_of(strategy_, None) and not ids:
            ids = tuple(range(world))
        values = {"strategy": strategy_, "world_size": world, "device_ids": ids,
                  "batch_is_global": bool(batch_is_global), "bucket_cap_mb": cap,
                  "gradient_as_bucket_view": bool(gradient_as_bucket_view), "sharding": sharding_,
                  "reduce_bucket_size": bucket, "overlap_comm": overlap_comm,
                  "offload_optimizer": offload_optimizer, "mesh": mesh_, "pp_schedule": _checked_schedule(pp_schedule),
                  "microbatches": _checked_microbatches(microbatches), "pp_split": _checked_split(pp_split),
                  "tp_plan": _checked_tp_plan(tp_plan), "loss_parallel": bool(loss_parallel),
                  "routing": routing_, "capacity_factor": factor,
                  "stage3": (stage3 or ZeroStage3()) if strategy_ is Strategy.ZERO3 else None}
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def is_single(self) -> bool:
        """One GPU, no strategy."""
        return self.strategy is Strategy.SINGLE

    @property
    def data_parallel_size(self) -> int:
        """The ranks the global batch is split over: the mesh's ``dp_replicate × dp_shard × ep``
        (each expert-parallel rank runs a batch of its own), or every GPU of a strategy that is not
        a mesh."""
        if self.mesh is None:
            return self.world_size
        return self.mesh.dp_replicate * self.mesh.dp_shard * self.mesh.ep

    def per_rank_batch(self, batch: int) -> int:
        """The batch one rank's model sees (DDP, FSDP, ZeRO, a mesh)."""
        if not self.batch_is_global:
            return batch
        n = self.data_parallel_size
        if batch % n:
            ranks = "ranks" if n == self.world_size else "data-parallel ranks (dp_replicate × dp_shard × ep)"
            raise InvalidInputError(
                f"a global batch of {batch} does not split evenly over {n} {ranks}",
                hint=f"give a multiple of {n}, or the per-GPU batch (--per-rank-batch)")
        return batch // n

    def global_batch(self, batch: int) -> int:
        """The samples per step over all GPUs when the estimate's batch is ``batch``."""
        return batch if self.batch_is_global else batch * self.data_parallel_size


def _given_mesh(mesh: Mesh | Mapping[str, int] | None, degrees: Mapping[str, object]) -> Mesh | None:
    """The mesh of the degrees or of ``mesh=``; None when neither is given."""
    if mesh is not None and degrees:
        raise InvalidInputError("give the mesh's degrees either as keywords (dp_shard=8, tp=4) or as mesh=, not both")
    if isinstance(mesh, Mesh):
        return Mesh.of(mesh.degrees)  # checked again: a Mesh(...) made directly is not
    if mesh is not None:
        if not isinstance(mesh, Mapping):
            raise InvalidInputError(f"mesh must map dimension names to degrees, got {mesh!r}",
                                    hint='e.g. mesh={"dp_shard": 8, "tp": 4}')
        return Mesh.of(mesh)
    return Mesh.of(degrees) if degrees else None


def _on_mesh(strategy: Strategy, mesh: Mesh, world_size: int | None) -> tuple[Strategy, int]:
    """The strategy a mesh is (a shorthand where it has one dimension that has one) and its world
    size; a shorthand given with it must be one of its dimensions."""
    if world_size is not None and world_size != mesh.world_size:
        raise InvalidInputError(f"--world-size {world_size} disagrees with the mesh {mesh.describe()} "
                                f"({mesh.world_size:,} GPUs: the product of its degrees)",
                                hint="leave out --world-size: the mesh counts the GPUs")
    cls = shorthand_class(strategy)
    if cls is not None:
        dimension = cls.mesh_dimension
        if dimension is None:
            raise InvalidInputError(f"--strategy {strategy.value} is not a device mesh dimension; it takes "
                                    f"--world-size, not a mesh",
                                    hint=f"give --strategy {strategy.value} --world-size N, or the mesh alone")
        if mesh.world_size == 1:  # the shorthand on one GPU (dataclasses.replace passes its mesh back)
            return strategy, 1
        if mesh.degrees[dimension] < 2:
            raise InvalidInputError(f"--strategy {strategy.value} is the mesh dimension {dimension}, which the mesh "
                                    f"{mesh.describe()} does not use",
                                    hint=f"give {dimension}=N in the mesh, or leave out --strategy")
    used = mesh.used
    if not used:
        return Strategy.SINGLE, 1
    if len(used) == 1:
        (name,) = used
        shorthand = next((s for s, c in shorthands().items() if c.mesh_dimension == name), None)
        if shorthand is not None:
            return shorthand, mesh.world_size
    return Strategy.MESH, mesh.world_size


def _shorthand(strategy: Strategy, world_size: int | None, ids: tuple[int, ...]) -> tuple[int, Mesh | None]:
    """A shorthand's world size and the mesh it stands for (one GPU: every degree 1)."""
    cls = shorthand_class(strategy)
    if cls is None:  # single
        if world_size not in (None, 1):
            raise InvalidInputError(f"--world-size {world_size} needs a multi-GPU strategy",
                                    hint="add --strategy ddp (or dp, fsdp, zero1, zero2, zero3)")
        return 1, Mesh()
    world = cls.world_size(strategy, world_size, ids)
    return world, cls.shorthand_mesh(world)


def _device_ids(device_ids: Sequence[int] | None, strategy: Strategy) -> tuple[int, ...]:
    if device_ids is None:
        return ()
    if isinstance(device_ids, (str, bytes)) or not isinstance(device_ids, Sequence):
        raise InvalidInputError(f"device_ids must be a list of CUDA device numbers, got {device_ids!r}",
                                hint="e.g. device_ids=[0, 1, 2, 3] (--device-ids 0,1,2,3)")
    ids = tuple(device_ids)
    takes_ids = "device_ids" in options_of(strategy, None)
    if not ids and not takes_ids:  # dataclasses.replace passes the normalised ()
        return ()
    if not takes_ids:
        raise InvalidInputError(f"device ids go with --strategy dp (DataParallel, one process driving several "
                                f"GPUs); {strategy.value} runs one process per GPU: give --world-size instead")
    if not ids:
        raise InvalidInputError("give at least one device id, e.g. --device-ids 0,1,2,3")
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise InvalidInputError(f"device ids are CUDA device numbers ≥ 0, got {list(ids)}")
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise InvalidInputError(f"device ids repeat ({', '.join(map(str, repeated))} in {list(ids)}): "
                                f"each GPU can hold one replica", hint="e.g. --device-ids 0,1,2,3")
    return ids


#: The options that apply to some strategies only: argument → (CLI flag, default). Which
#: strategies read each is their objects' ``options``; ``batch_is_global`` is every multi-GPU one's.
_STRATEGY_OPTIONS: dict[str, tuple[str, object]] = {
    "bucket_cap_mb": ("--bucket-cap-mb", DEFAULT_BUCKET_CAP_MB),
    "gradient_as_bucket_view": ("--gradient-as-bucket-view", False),
    "sharding": ("--fsdp-sharding", FsdpSharding.FULL_SHARD),
    "reduce_bucket_size": ("--reduce-bucket-size", DEEPSPEED_REDUCE_BUCKET_SIZE),
    "overlap_comm": ("--deepspeed's overlap_comm", False),
    "offload_optimizer": ("--deepspeed's offload_optimizer", False),
    "batch_is_global": ("--global-batch", False),
    "pp_schedule": ("--pp-schedule", None),
    "microbatches": ("--microbatches", None),
    "pp_split": ("--pp-split", None),
    "tp_plan": ("--tp-plan", None),
    "loss_parallel": ("--loss-parallel", False),
    "routing": ("--routing", Routing.BALANCED),
    "capacity_factor": ("--capacity-factor", None),
    "stage3": ("--deepspeed's stage3_* and offload_param", None),
}


def inapplicable_option(strategy: Strategy, given: Iterable[str], *, flags: bool = False,
                        mesh: Mesh | None = None) -> str | None:
    """Why the first of ``given`` (:class:`Distributed` argument names) would be ignored
    under ``strategy``; None when every one applies.

    Args:
        strategy: the strategy chosen (``mesh``: the dimensions of ``mesh`` in use).
        given: the arguments the user set (the CLI: the flags given on the command line).
        flags: name the CLI flags (``--bucket-cap-mb``) rather than the arguments.
        mesh: the device mesh, when the setting was given as one (the message then names it).

    Returns:
        A message naming the argument, the strategies it belongs to and what to do, or None.
    """
    chosen = set(given)
    strategy_word = "--strategy" if flags else "strategy"
    used = None if mesh is None else mesh.used
    multi_gpu = strategy is not Strategy.SINGLE
    applies = options_of(strategy, used) | ({"batch_is_global"} if multi_gpu else set())
    for option, (flag, _default) in _STRATEGY_OPTIONS.items():
        if option not in chosen or option in applies:
            continue
        name = flag if flags else f"{option} ({flag})"
        if option == "batch_is_global":
            names = [s.value for s in shorthands()]
        else:
            names = [s.value for s, cls in shorthands().items() if option in cls.options]
        names = [s.value for s in Strategy if s.value in names]  # in the enum's order
        modelled = [d for d, cls in dimensions().items() if option in cls.options]
        if not names:  # an option of a mesh dimension that has no shorthand (tp, pp)
            where = f"to the mesh dimension {' or '.join(modelled)} (--mesh {modelled[0]}=N, N at least 2)"
        else:
            listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
            where = (f"under a multi-GPU {strategy_word} ({listed})" if option == "batch_is_global"
                     else f"to {strategy_word} {listed}")
            if mesh is not None and modelled and option != "batch_is_global":
                where += f" (the mesh dimension {' or '.join(modelled)})"
        current = f"{strategy_word} {strategy.value}" if mesh is None else f"the mesh {mesh.describe()}"
        return f"{name} applies only {where}; with {current} it would be ignored"
    return None


def _refuse_inapplicable(strategy: Strategy, mesh: Mesh | None, **values: object) -> None:
    """A value the strategy would ignore is refused: the user meant something by it. A value
    equal to the default is let through (``dataclasses.replace`` passes every field; the CLI
    tells an explicit flag from a default itself)."""
    given = [option for option, (_flag, default) in _STRATEGY_OPTIONS.items()
             if values[option] is not None and values[option] != default]
    message = inapplicable_option(strategy, given, mesh=mesh)
    if message is not None:
        raise InapplicableOptionError(message)


def _checked_routing(routing: object, capacity_factor: object) -> tuple[Routing, float | None]:
    """The routing assumption and its capacity factor (a finite number, at least 1): a factor
    given means ``capacity``; ``capacity`` needs one; ``balanced`` or ``worst`` take none."""
    routing_ = None if routing is None else parse_choice(Routing, routing, "routing")
    if capacity_factor is None:
        if routing_ is Routing.CAPACITY:
            raise InvalidInputError("routing='capacity' needs its capacity factor",
                                    hint="e.g. capacity_factor=1.25 (--capacity-factor 1.25)")
        return routing_ or Routing.BALANCED, None
    if routing_ not in (None, Routing.CAPACITY):
        raise InvalidInputError(f"capacity_factor goes with routing='capacity', not {routing_.value!r}",
                                hint="give one of them")
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
            or not math.isfinite(float(capacity_factor)) or float(capacity_factor) < 1):
        raise InvalidInputError(f"capacity_factor (--capacity-factor) is how many times its balanced share an "
                                f"expert receives: a number, at least 1; got {capacity_factor!r}",
                                hint="e.g. 1.25 (Switch Transformer's training value)")
    return Routing.CAPACITY, float(capacity_factor)


def _checked_tp_plan(plan: object) -> tuple[tuple[str, str], ...] | None:
    """The tensor-parallel plan as (pattern, style string) pairs; the strings are checked when
    the plan is applied (:func:`memcalc.distributed.tp_plans.user_plan`), against the model."""
    if plan is None:
        return None
    pairs = list(plan.items()) if isinstance(plan, Mapping) else plan
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not pairs or any(
            not isinstance(pair, tuple) or len(pair) != 2 or not all(isinstance(x, str) and x for x in pair)
            for pair in pairs):
        raise InvalidInputError(f"tp_plan maps module-name patterns to style strings, got {plan!r}",
                                hint='e.g. tp_plan={"mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"} '
                                     '(--tp-plan mlp.up_proj=colwise,mlp.down_proj=rowwise)')
    return tuple(pairs)


def _checked_world_size(world_size: object) -> int | None:
    """None, or the number of GPUs as an ``int`` (NumPy's integers are integers), from 1 to
    :data:`MAX_WORLD_SIZE`."""
    if world_size is None:
        return None
    number = as_integer(world_size)
    if number is not None and number > MAX_WORLD_SIZE:
        raise InvalidInputError(f"world_size (--world-size) is the number of GPUs, at most {MAX_WORLD_SIZE:,} "
                                f"(2**20; memcalc lists every rank); got {number:,}")
    if number is None or number < 1:
        kind = "" if number is not None else f" ({type(world_size).__name__})"
        raise InvalidInputError(
            f"world_size is the number of GPUs: an integer, at least 1; got {world_size!r}{kind}",
            hint="e.g. world_size=4 (--world-size 4)")
    return number


def _checked_schedule(schedule: object) -> str | None:
    """A pipeline schedule's name as memcalc spells it (``1f1b``), or None."""
    if schedule is None:
        return None
    if not isinstance(schedule, str):
        raise InvalidInputError(f"pp_schedule is a schedule's name, got {schedule!r}",
                                hint=f"one of {', '.join(s.value for s in PipelineSchedule)}")
    return PipelineSchedule.parse(schedule).value


def _checked_microbatches(microbatches: object) -> int | None:
    """Microbatches per pipeline step: None or a positive integer."""
    if microbatches is None:
        return None
    number = as_integer(microbatches)
    if number is None or number < 1:
        raise InvalidInputError(f"microbatches (--microbatches) is a positive integer, got {microbatches!r}")
    return number


def _checked_split(split: object) -> tuple[str, ...] | None:
    """The pipeline's split points: module names, each a stage's first block (``layers.4``)."""
    if split is None:
        return None
    names = (split,) if isinstance(split, str) else tuple(split) if isinstance(split, Sequence) else None
    if names is None or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise InvalidInputError(f"pp_split (--pp-split) is a list of module names, got {split!r}",
                                hint="e.g. pp_split=('layers.4',) (--pp-split layers.4): stage 1 begins there")
    return tuple(n.strip() for n in names)


def _checked_bucket_cap_mb(bucket_cap_mb: object) -> float:
    """DDP's bucket size in MiB: a positive, finite number whose bytes fit a tensor (int64)."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real) or not float(bucket_cap_mb) > 0:
        raise InvalidInputError(
            f"bucket_cap_mb is DDP's bucket size in MiB, a positive number; got {bucket_cap_mb!r}")
    cap = float(bucket_cap_mb)
    if not math.isfinite(cap) or cap * _MIB > INT64_MAX:
        raise InvalidInputError(f"bucket_cap_mb (--bucket-cap-mb) is DDP's bucket size in MiB, at most "
                                f"{INT64_MAX // _MIB:,} (2**63 - 1 bytes, the largest tensor); got {bucket_cap_mb!r}")
    return cap


def _checked_reduce_bucket_size(reduce_bucket_size: object) -> int:
    """DeepSpeed's reduce bucket, in elements: an integer from 1 to 2**63 - 1."""
    number = as_integer(reduce_bucket_size)
    if number is None or number < 1 or number > INT64_MAX:
        raise InvalidInputError(f"reduce_bucket_size is a number of elements, an integer from 1 to {INT64_MAX:,} "
                                f"(2**63 - 1); got {reduce_bucket_size!r}")
    return number

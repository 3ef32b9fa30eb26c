"""The multi-GPU vocabulary: :class:`Strategy`, :class:`FsdpSharding` and the validated
setting :class:`Distributed` that :func:`memcalc.estimate` takes. What each strategy
holds per GPU is described in :mod:`memcalc.distributed.strategies`."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memcalc.core.choices import parse_choice
from memcalc.core.counts import INT64_MAX, as_integer
from memcalc.core.errors import InapplicableOptionError, InvalidInputError

__all__ = (
    "DEEPSPEED_REDUCE_BUCKET_SIZE",
    "DEFAULT_BUCKET_CAP_MB",
    "Distributed",
    "FsdpSharding",
    "Strategy",
    "dp_chunks",
    "inapplicable_option",
)

#: torch.nn.parallel.DistributedDataParallel: ``bucket_cap_mb=None`` means 25 (MiB).
DEFAULT_BUCKET_CAP_MB = 25.0
#: deepspeed/runtime/zero/config.py: ``reduce_bucket_size`` default, in elements.
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000
_MIB = 1024 * 1024
#: The most GPUs a setting may name: memcalc lists every rank (the largest clusters hold ~10**5 GPUs).
MAX_WORLD_SIZE = 2**20


class Strategy(str, enum.Enum):
    """How the training step is spread over GPUs (``single``: one GPU, no strategy)."""

    SINGLE = "single"
    DP = "dp"
    DDP = "ddp"
    FSDP = "fsdp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed ZeRO's stage (1, 2 or 3); None for the other strategies."""
        return {Strategy.ZERO1: 1, Strategy.ZERO2: 2, Strategy.ZERO3: 3}.get(self)


class FsdpSharding(str, enum.Enum):
    """FSDP's sharding: ``full_shard`` reshards after forward, ``shard_grad_op`` keeps the
    parameters gathered until backward."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"


@dataclass(frozen=True, init=False)
class Distributed:
    """The multi-GPU setting of an estimate, validated when it is made.

    ``Distributed("ddp", world_size=4)``; ``Distributed("dp", device_ids=(0, 1))``;
    ``Distributed("fsdp", world_size=8, sharding="shard_grad_op")``;
    ``Distributed("zero3", world_size=8, reduce_bucket_size=10**7)``.

    Args:
        strategy: ``single``, ``dp``, ``ddp``, ``fsdp``, ``zero1``, ``zero2`` or ``zero3``.
        world_size: the number of GPUs (ranks); ``dp``: or give ``device_ids``.
        device_ids: ``dp`` only: the GPUs DataParallel uses (outputs gathered on the first).
        batch_is_global: the estimate's ``batch_size`` is the global batch, split over the
            GPUs (default: each GPU's batch).
        bucket_cap_mb: ``ddp``: gradient bucket size in MiB (PyTorch's 25 by default).
        gradient_as_bucket_view: ``ddp``: gradients are views into the buckets.
        sharding: ``fsdp``: ``full_shard`` (the default) or ``shard_grad_op``.
        reduce_bucket_size: ``zero*``: DeepSpeed's reduce bucket, in elements (5e8).

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

    def __init__(self, strategy: Strategy | str = Strategy.SINGLE, *, world_size: int | None = None,
                 device_ids: Sequence[int] | None = None, batch_is_global: bool = False,
                 bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False,
                 sharding: FsdpSharding | str | None = None, reduce_bucket_size: int | None = None) -> None:
        strategy_ = parse_choice(Strategy, strategy, "strategy")
        sharding_ = FsdpSharding.FULL_SHARD if sharding is None else parse_choice(FsdpSharding, sharding,
                                                                                 "FSDP sharding")
        world_size = _checked_world_size(world_size)
        for flag, setting in (("batch_is_global", batch_is_global),
                              ("gradient_as_bucket_view", gradient_as_bucket_view)):
            if not isinstance(setting, bool):
                raise InvalidInputError(f"{flag} must be True or False, got {setting!r}")
        _refuse_inapplicable(strategy_, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
                             sharding=sharding_, reduce_bucket_size=reduce_bucket_size,
                             batch_is_global=batch_is_global)
        ids = _device_ids(device_ids, strategy_)
        world = _world_size(strategy_, world_size, ids)
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else _checked_bucket_cap_mb(bucket_cap_mb)
        bucket = (DEEPSPEED_REDUCE_BUCKET_SIZE if reduce_bucket_size is None
                  else _checked_reduce_bucket_size(reduce_bucket_size))
        if strategy_ is Strategy.DP and not ids:
            ids = tuple(range(world))
        values = {"strategy": strategy_, "world_size": world, "device_ids": ids,
                  "batch_is_global": bool(batch_is_global), "bucket_cap_mb": cap,
                  "gradient_as_bucket_view": bool(gradient_as_bucket_view), "sharding": sharding_,
                  "reduce_bucket_size": bucket}
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def is_single(self) -> bool:
        """One GPU, no strategy."""
        return self.strategy is Strategy.SINGLE

    def per_rank_batch(self, batch: int) -> int:
        """The batch one rank's model sees (DDP, FSDP, ZeRO)."""
        if not self.batch_is_global:
            return batch
        if batch % self.world_size:
            raise InvalidInputError(
                f"a global batch of {batch} does not split evenly over {self.world_size} ranks",
                hint=f"give a multiple of {self.world_size}, or the per-GPU batch (--per-rank-batch)")
        return batch // self.world_size

    def global_batch(self, batch: int) -> int:
        """The samples per step over all GPUs when the estimate's batch is ``batch``."""
        return batch if self.batch_is_global else batch * self.world_size


def _device_ids(device_ids: Sequence[int] | None, strategy: Strategy) -> tuple[int, ...]:
    if device_ids is None:
        return ()
    if isinstance(device_ids, (str, bytes)) or not isinstance(device_ids, Sequence):
        raise InvalidInputError(f"device_ids must be a list of CUDA device numbers, got {device_ids!r}",
                                hint="e.g. device_ids=[0, 1, 2, 3] (--device-ids 0,1,2,3)")
    ids = tuple(device_ids)
    if not ids and strategy is not Strategy.DP:  # dataclasses.replace passes the normalised ()
        return ()
    if strategy is not Strategy.DP:
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


#: The options that apply to one family of strategies only: (argument, CLI flag, strategies, default).
_STRATEGY_OPTIONS: tuple[tuple[str, str, tuple[Strategy, ...], object], ...] = (
    ("bucket_cap_mb", "--bucket-cap-mb", (Strategy.DDP,), DEFAULT_BUCKET_CAP_MB),
    ("gradient_as_bucket_view", "--gradient-as-bucket-view", (Strategy.DDP,), False),
    ("sharding", "--fsdp-sharding", (Strategy.FSDP,), FsdpSharding.FULL_SHARD),
    ("reduce_bucket_size", "--reduce-bucket-size", (Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3),
     DEEPSPEED_REDUCE_BUCKET_SIZE),
    ("batch_is_global", "--global-batch", tuple(s for s in Strategy if s is not Strategy.SINGLE), False),
)


def inapplicable_option(strategy: Strategy, given: Iterable[str], *, flags: bool = False) -> str | None:
    """Why the first of ``given`` (:class:`Distributed` argument names) would be ignored
    under ``strategy``; None when every one applies.

    Args:
        strategy: the strategy chosen.
        given: the arguments the user set (the CLI: the flags given on the command line).
        flags: name the CLI flags (``--bucket-cap-mb``) rather than the arguments.

    Returns:
        A message naming the argument, the strategies it belongs to and what to do, or None.
    """
    chosen = set(given)
    strategy_word = "--strategy" if flags else "strategy"
    for option, flag, applies, _default in _STRATEGY_OPTIONS:
        if option in chosen and strategy not in applies:
            name = flag if flags else f"{option} ({flag})"
            names = [s.value for s in applies]
            listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
            where = (f"under a multi-GPU {strategy_word} ({listed})" if option == "batch_is_global"
                     else f"to {strategy_word} {listed}")
            return f"{name} applies only {where}; with {strategy_word} {strategy.value} it would be ignored"
    return None


def _refuse_inapplicable(strategy: Strategy, **values: object) -> None:
    """A value the strategy would ignore is refused: the user meant something by it. A value
    equal to the default is let through (``dataclasses.replace`` passes every field; the CLI
    tells an explicit flag from a default itself)."""
    given = [option for option, _flag, _applies, default in _STRATEGY_OPTIONS
             if values[option] is not None and values[option] != default]
    message = inapplicable_option(strategy, given)
    if message is not None:
        raise InapplicableOptionError(message)


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


def _world_size(strategy: Strategy, world_size: int | None, ids: tuple[int, ...]) -> int:
    if strategy is Strategy.SINGLE:
        if world_size not in (None, 1):
            raise InvalidInputError(f"--world-size {world_size} needs a multi-GPU strategy",
                                    hint="add --strategy ddp (or dp, fsdp, zero1, zero2, zero3)")
        return 1
    if strategy is Strategy.DP:
        if ids and world_size is not None and world_size != len(ids):
            raise InvalidInputError(f"--world-size {world_size} disagrees with {len(ids)} device ids {list(ids)}")
        if not ids and world_size is None:
            raise InvalidInputError("--strategy dp needs the GPUs it spreads over",
                                    hint="give --device-ids 0,1,2,3 (or --world-size 4 for devices 0..3)")
        return len(ids) if ids else int(world_size or 1)
    if world_size is None:
        raise InvalidInputError(f"--strategy {strategy.value} needs the number of GPUs",
                                hint=f"give --world-size N, e.g. --strategy {strategy.value} --world-size 8")
    return world_size


def dp_chunks(global_batch: int, world_size: int) -> list[int]:
    """The batch of each replica as ``torch.chunk`` (DataParallel's scatter) splits it:
    ``ceil(B/N)`` per chunk, fewer (or fewer chunks) at the end."""
    size = math.ceil(global_batch / world_size)
    chunks = []
    left = global_batch
    while left > 0:
        chunks.append(min(size, left))
        left -= size
    return chunks

"""The words of the multi-GPU settings, apart from the setting itself
(:class:`memcalc.distributed.setting.Distributed`), so that the strategy objects
(:mod:`memcalc.distributed.strategy`) and the setting that looks them up can share them."""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass

__all__ = ("DEEPSPEED_REDUCE_BUCKET_SIZE", "DEFAULT_BUCKET_CAP_MB", "FsdpSharding", "Routing", "Strategy", "ZeroStage3",
           "dp_chunks")

#: torch.nn.parallel.DistributedDataParallel: ``bucket_cap_mb=None`` means 25 (MiB).
DEFAULT_BUCKET_CAP_MB = 25.0
#: deepspeed/runtime/zero/config.py: ``reduce_bucket_size`` default, in elements.
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000


@dataclass(frozen=True)
class ZeroStage3:
    """DeepSpeed ZeRO-3's parameter settings (``zero_optimization``'s ``stage3_*`` keys and
    ``offload_param``), in elements; the defaults are ``deepspeed/runtime/zero/config.py``'s,
    which apply when a config leaves a key out — and to ``--strategy zero3``.

    Attributes:
        prefetch_bucket_size: ``stage3_prefetch_bucket_size``: elements all-gathered ahead of use.
        max_live_parameters: ``stage3_max_live_parameters``: no prefetch beyond this many gathered.
        max_reuse_distance: ``stage3_max_reuse_distance``: a parameter used again within this many
            elements of the trace is not released.
        param_persistence_threshold: ``stage3_param_persistence_threshold``: parameters of at most
            this many elements stay whole on every rank (``ds_persist``).
        model_persistence_threshold: ``stage3_model_persistence_threshold``: at most this many
            persistent elements in all (taken in ``named_parameters`` order).
        offload_param: ``offload_param.device: cpu``: the 16-bit partitions live in host memory.
    """

    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    offload_param: bool = False


class Strategy(str, enum.Enum):
    """How the training step is spread over GPUs (``single``: one GPU, no strategy). ``mesh``
    is not a shorthand: it is what a device mesh of several dimensions (or of one that has no
    shorthand) is called, and it is given by its degrees."""

    SINGLE = "single"
    DP = "dp"
    DDP = "ddp"
    FSDP = "fsdp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    MESH = "mesh"

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed ZeRO's stage (1, 2 or 3); None for the other strategies."""
        return {Strategy.ZERO1: 1, Strategy.ZERO2: 2, Strategy.ZERO3: 3}.get(self)

    @property
    def is_shorthand(self) -> bool:
        """Whether ``--strategy`` offers it (every strategy but ``mesh``, which ``--mesh`` spells)."""
        return self is not Strategy.MESH


class FsdpSharding(str, enum.Enum):
    """FSDP's sharding: ``full_shard`` reshards after forward, ``shard_grad_op`` keeps the
    parameters gathered until backward."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"


class Routing(str, enum.Enum):
    """What expert parallelism assumes of the router's data-dependent split (the tokens each rank's
    experts receive): ``balanced``, every expert an equal share; ``capacity``, the traced rank's
    experts full to ``capacity_factor`` times their share from every rank; ``worst``, every rank
    sends the traced rank's experts all the pairs it can (each token picks distinct experts)."""

    BALANCED = "balanced"
    CAPACITY = "capacity"
    WORST = "worst"


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

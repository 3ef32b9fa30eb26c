"""The launch configuration an estimate was given, read once (:func:`read_launch`, before the
model is built: a bad file is said at once) and turned into the multi-GPU setting
(:func:`launch_distributed`) once the model's ``hidden_size`` has filled DeepSpeed's ``"auto"``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memcalc.core.counts import as_integer
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.launch.setup import LaunchSetup
from memcalc.distributed.setting import Distributed

__all__ = ("hidden_size_of", "launch_distributed", "read_launch")


def read_launch(accelerate_config: Any = None, deepspeed: Any = None, world_size: Any = None) -> LaunchSetup | None:
    """The launch configuration of ``accelerate_config`` (a file) or ``deepspeed`` (a file or a
    mapping), with ``world_size`` for one that does not count its GPUs; None for neither.

    Raises:
        InvalidInputError: both given, a world size that disagrees with the file's, or none
            where the file has none; the readers' errors.
    """
    if accelerate_config is not None and deepspeed is not None:
        raise InvalidInputError("give accelerate_config (--accelerate-config) or deepspeed (--deepspeed), not both",
                                hint="An accelerate config names its DeepSpeed file in deepspeed_config_file.")
    if accelerate_config is None and deepspeed is None:
        if world_size is not None:
            raise InapplicableOptionError("world_size alone goes with a launch configuration (deepspeed=, "
                                          "accelerate_config=)", hint="Give distributed=memcalc.Distributed(...).")
        return None
    # the readers import on first use: accelerate's imports memcalc's transformers stack (its
    # parallelism_config), which a request without a launch configuration never reads (issue 36)
    from memcalc.distributed.launch.accelerate_config import read_accelerate
    from memcalc.distributed.launch.deepspeed_config import read_deepspeed

    setup = read_accelerate(accelerate_config) if accelerate_config is not None else read_deepspeed(deepspeed)
    theirs = setup.distributed.get("world_size")
    if world_size is not None:
        number = as_integer(world_size)
        if number is None or number < 1:
            raise InvalidInputError(f"world_size is the number of GPUs, at least 1; got {world_size!r}")
        if theirs is not None and theirs != number:
            raise InapplicableOptionError(f"world size {number} disagrees with {setup.source}, which says {theirs}",
                                          hint="Leave out the world size: the file counts the processes.")
        return replace(setup, distributed={**setup.distributed, "world_size": number})
    if theirs is None and setup.distributed.get("strategy") is not None:
        raise InvalidInputError(f"{setup.source} does not say how many GPUs (its train_batch_size is not a number)",
                                hint="Give the world size: --world-size N (world_size=N).")
    return setup


def hidden_size_of(module: Any, source: str) -> int:
    """The model's hidden size as transformers' ``trainer_config_finalize`` finds it (``hidden_size``,
    else the largest of ``hidden_sizes``, else the text config's)."""
    config = getattr(module, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        if owner is None:
            continue
        if isinstance(getattr(owner, "hidden_size", None), int):
            return int(owner.hidden_size)
        if getattr(owner, "hidden_sizes", None):
            return int(max(owner.hidden_sizes))
    raise InvalidInputError(f"{source}: reduce_bucket_size (or a stage3_* key) is \"auto\", which transformers fills "
                            f"from the model config's hidden_size, and this model has no config with one",
                            hint="Give it a number of elements.")


def launch_distributed(setup: LaunchSetup) -> Distributed:
    """The multi-GPU setting the configuration decides (``"auto"`` filled first)."""
    if setup.auto_hidden:
        raise ValueError("fill the auto keys with LaunchSetup.with_hidden_size first")
    return Distributed(**setup.distributed)

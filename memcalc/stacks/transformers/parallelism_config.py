"""accelerate's ``ParallelismConfig`` as memcalc's device mesh: :func:`read_parallelism_config`.

Users of the Trainer (``TrainingArguments(parallelism_config=...)``) and of ``accelerate launch``
(the config file's ``parallelism_config`` section) give the mesh so. accelerate 1.16
(``accelerate/parallelism_config.py``, ``accelerator.py``) builds torchtitan's mesh from it, dims
in the order ``dp_replicate, dp_shard, cp, sp, tp`` (tp innermost, as memcalc's ranks are), and:

- FSDP2 ``fully_shard``-s over ``mesh[("dp_replicate", "dp_shard_cp")]`` (``fsdp_dim_names``; the
  flattened ``dp_shard × cp``), memcalc's FSDP2 / HSDP over ``dp_shard × cp``;
- tp is applied when the model is loaded (``from_pretrained(tp_plan="auto")``: the model's own
  tp plan, memcalc's ``hf_plan``); ``_prepare_tp`` makes the parameters it left whole Replicate
  DTensors on the tp sub-mesh, as memcalc's FSDP2 over tp has them;
- cp is torch's ``context_parallel`` on ``mesh["cp"]`` with ``set_rotate_method(cp_comm_strategy)``;
  its default ``allgather`` is memcalc's ring (:mod:`memcalc.distributed.ring_attention`).

So the sizes become the mesh degrees of the same names. Refused by name: ``sp_size`` (DeepSpeed's
Ulysses / ALST sequence parallelism), ``cp_comm_strategy`` ``alltoall``, dp_replicate with tp and
no dp_shard (accelerate: "composing DDP + TP is currently not supported"). The sizes are checked
by accelerate's own ``ParallelismConfig.__post_init__`` (given every value, so no
``PARALLELISM_CONFIG_*`` environment variable fills one). Mapping notes: docs/launch-configs.md.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.stacks.transformers.hub import import_hf

__all__ = ("ParallelismMesh", "read_parallelism_config")

#: The prefix ``accelerate config`` writes before each key of the file's section.
PREFIX = "parallelism_config_"

#: accelerate's size fields → memcalc's mesh dimension of the same name (``sp`` is refused).
_SIZES = {"dp_replicate_size": "dp_replicate", "dp_shard_size": "dp_shard", "tp_size": "tp", "cp_size": "cp"}

#: Keys of ``ParallelismConfig.to_json()`` (``_sizes`` is its private copy of the sizes) and of the
#: config file's section (``cp_comm_strategy`` and the ``sp_*`` settings flat there).
_KNOWN = frozenset({*_SIZES, "sp_size", "cp_backend", "sp_backend", "tp_handler", "cp_handler", "sp_handler",
                    "_sizes", "cp_comm_strategy", "sp_seq_length", "sp_seq_length_is_variable",
                    "sp_attn_implementation"})

_ULYSSES = ("DeepSpeed's Ulysses sequence parallelism (ALST, sp_backend deepspeed: all-to-alls of the heads "
            "around attention, in DeepSpeed's own process groups) is not modelled; memcalc's context "
            "parallelism is torch's ring attention (cp_size)")


@dataclass(frozen=True)
class ParallelismMesh:
    """A ``ParallelismConfig`` read: its mesh degrees above 1 (memcalc's names, accelerate's order)
    and what was read, for the report."""

    degrees: tuple[tuple[str, int], ...]
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, int]:
        """The degrees as :class:`~memcalc.distributed.setting.Distributed`'s keywords."""
        return dict(self.degrees)

    @property
    def world_size(self) -> int:
        """The product of the degrees (accelerate's ``total_size``)."""
        size = 1
        for _, degree in self.degrees:
            size *= degree
        return size

    def describe(self) -> str:
        """``dp_shard=2,tp=2``: the ``--mesh`` spelling."""
        return ",".join(f"{name}={degree}" for name, degree in self.degrees) or "every size 1"


def read_parallelism_config(value: Any, where: str) -> ParallelismMesh | None:
    """The mesh of ``value``: a ``ParallelismConfig``, a mapping as its ``to_json()`` writes it
    (``TrainingArguments.to_dict()``), or the config file's section (keys prefixed
    ``parallelism_config_``); None for None or an empty mapping.

    Raises:
        InvalidInputError: an unknown key (the closest named), a size that is not an integer,
            or one accelerate's ``ParallelismConfig`` refuses.
        InapplicableOptionError: a setting memcalc does not model (module docstring).
    """
    if value is None or (isinstance(value, Mapping) and not value):
        return None
    fields = _fields(value, where)
    sizes = {name: _size(fields.get(name, 1), name, where) for name in (*_SIZES, "sp_size")}
    strategy = _comm_strategy(fields)
    if sizes["sp_size"] > 1:
        raise InapplicableOptionError(f"{where}: parallelism_config sp_size={sizes['sp_size']}: {_ULYSSES}",
                                      hint="Give cp_size (torch's context parallelism) instead, or leave sp_size 1.")
    config = _accelerate_config(sizes, fields, strategy, where)
    if config.cp_enabled and strategy != "allgather":
        raise InapplicableOptionError(f"{where}: parallelism_config cp_comm_strategy={strategy!r}: memcalc models "
                                      f"torch's ring attention with rotate_method allgather (accelerate's default), "
                                      f"which all-gathers every rank's K/V; {strategy} passes them chunk by chunk",
                                      hint="Leave cp_comm_strategy at allgather to estimate it.")
    if config.dp_replicate_enabled and config.tp_enabled and not config.dp_shard_enabled:
        raise InapplicableOptionError(f"{where}: parallelism_config dp_replicate_size={config.dp_replicate_size} with "
                                      f"tp_size={config.tp_size} and dp_shard_size 1: accelerate says composing DDP + "
                                      f"TP is not supported, and memcalc does not model it either",
                                      hint="Give dp_shard_size > 1 (HSDP over tp), as accelerate asks.")
    names = config._get_mesh()  # accelerate's canonical order: dp_replicate, dp_shard, cp, sp, tp
    degrees = tuple((str(name), int(size)) for name, size in zip(*names, strict=True)) if names else ()
    notes = [f"parallelism_config → mesh {ParallelismMesh(degrees).describe()} (accelerate's ParallelismConfig)"]
    if config.tp_enabled and getattr(config.tp_handler, "enable_async_tp", False):
        notes.append("tp_handler enable_async_tp ignored (accelerate ignores it)")
    return ParallelismMesh(degrees, tuple(notes))


def _fields(value: Any, where: str) -> dict[str, Any]:
    """``value``'s settings by ``ParallelismConfig``'s field names (handlers as mappings)."""
    if isinstance(value, Mapping):
        fields = {(key[len(PREFIX):] if isinstance(key, str) and key.startswith(PREFIX) else key): item
                  for key, item in value.items()}
        unknown = [key for key in fields if key not in _KNOWN]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), sorted(_KNOWN), n=1)
            raise InvalidInputError(f"{where}: parallelism_config has no setting {unknown[0]!r}"
                                    + (f"; did you mean {close[0]!r}?" if close else ""),
                                    hint="Its settings: dp_replicate_size, dp_shard_size, tp_size, cp_size, "
                                         "cp_comm_strategy (accelerate's ParallelismConfig).")
        return fields
    parallelism = import_hf("accelerate", "parallelism_config (accelerate's ParallelismConfig)").ParallelismConfig
    if not isinstance(value, parallelism):
        raise InvalidInputError(f"{where}: parallelism_config must be an accelerate ParallelismConfig or a dict of "
                                f"its sizes, got {type(value).__name__}",
                                hint='e.g. {"dp_shard_size": 2, "tp_size": 2}')
    return {key: item for key, item in vars(value).items() if key in _KNOWN}


def _size(value: Any, name: str, where: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{where}: parallelism_config {name} must be an integer, got {value!r}")
    return value


def _comm_strategy(fields: Mapping[str, Any]) -> str:
    """``cp_comm_strategy``: flat in the config file, inside ``cp_handler`` in ``to_json()``."""
    handler = fields.get("cp_handler")
    inner = (handler.get("cp_comm_strategy") if isinstance(handler, Mapping)
             else getattr(handler, "cp_comm_strategy", None))
    return str(fields.get("cp_comm_strategy") or inner or "allgather")


def _accelerate_config(sizes: Mapping[str, int], fields: Mapping[str, Any], strategy: str, where: str) -> Any:
    """accelerate's own ``ParallelismConfig`` of these settings (its checks run)."""
    accelerate = import_hf("accelerate", "parallelism_config (accelerate's ParallelismConfig)")
    try:
        handler = (accelerate.utils.TorchContextParallelConfig(cp_comm_strategy=strategy) if sizes["cp_size"] > 1
                   else None)
        return accelerate.ParallelismConfig(**sizes, cp_backend=fields.get("cp_backend") or "torch",
                                            sp_backend=fields.get("sp_backend") or "deepspeed", cp_handler=handler)
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidInputError(f"{where}: accelerate's ParallelismConfig refuses it: "
                                f"{str(exc).strip().splitlines()[0]}") from None

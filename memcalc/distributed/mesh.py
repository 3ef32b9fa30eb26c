"""The device mesh: how many GPUs each dimension of a multi-GPU step spans, with torchtitan's
names for the degrees (``torchtitan/distributed/parallel_dims.py``: ``dp_replicate``,
``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``). The world size is their product.

:class:`Mesh` is the validated degrees; :func:`parse_mesh` reads the command line's spelling
(``--mesh dp_shard=8,tp=4,pp=2``). What each dimension does to a rank is the business of its
strategy object (:mod:`memcalc.distributed.strategy`); a mesh only counts.

``etp`` (torchtitan's ``expert_tensor_parallel_degree``) is read here but is no dimension: it says
how ``ep`` × ``tp`` lay out the experts. 1 (the default, modelled) is dropped; etp = tp is refused by
name (:func:`refuse_expert_tensor_parallel`), any other value as torchtitan refused it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from memcalc.core.counts import as_integer
from memcalc.core.errors import InapplicableOptionError, InvalidInputError

__all__ = ("DIMENSION_NAMES", "ETP", "MAX_WORLD_SIZE", "Mesh", "check_degree", "parse_mesh",
           "refuse_expert_tensor_parallel")

#: The most GPUs a setting may name: memcalc lists every rank (the largest clusters hold ~10**5 GPUs).
MAX_WORLD_SIZE = 2**20

#: What each degree spreads, in the order torchtitan lists them (and ``Mesh`` holds them).
DIMENSION_NAMES: Mapping[str, str] = {
    "dp_replicate": "data parallel, replicated (DDP; with dp_shard: HSDP's replicas)",
    "dp_shard": "data parallel, sharded (FSDP2 fully_shard)",
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
    "cp": "context parallelism",
    "ep": "expert parallelism",
}

#: torchtitan's expert tensor-parallel degree (``ParallelismConfig.expert_tensor_parallel_degree``,
#: ``ParallelDims.etp``; removed from torchtitan by its PR #3167, 2026-04-30): a mesh key, not a dimension.
ETP = "etp"


@dataclass(frozen=True)
class Mesh:
    """The degree of every dimension (1: not used). Build it with :meth:`of`, which checks."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, degrees: Mapping[str, object]) -> Mesh:
        """The mesh of ``degrees`` (dimension name → degree; a missing one is 1).

        Raises:
            InvalidInputError: an unknown dimension, a degree that is not a positive integer, or
                a product over :data:`MAX_WORLD_SIZE`; each naming the dimension; an ``etp``
                other than 1 or tp (as torchtitan refused it).
            InapplicableOptionError: etp = tp (:func:`refuse_expert_tensor_parallel`).
        """
        degrees = refuse_expert_tensor_parallel(degrees)
        for name in degrees:
            _check_name(name)
        mesh = cls(**{name: check_degree(name, value) for name, value in degrees.items()})
        if mesh.world_size > MAX_WORLD_SIZE:
            raise InvalidInputError(
                f"the mesh {mesh.describe()} spans {mesh.world_size:,} GPUs, more than {MAX_WORLD_SIZE:,} "
                f"(2**20; memcalc lists every rank)", hint="give smaller degrees")
        return mesh

    @property
    def degrees(self) -> dict[str, int]:
        """Every dimension's degree, in :data:`DIMENSION_NAMES`' order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def used(self) -> dict[str, int]:
        """The dimensions of degree above 1."""
        return {name: degree for name, degree in self.degrees.items() if degree > 1}

    @property
    def world_size(self) -> int:
        """The number of GPUs: the product of the degrees."""
        return math.prod(self.degrees.values())

    def describe(self) -> str:
        """``dp_shard=8,tp=4``: the command line's spelling of the dimensions in use (``1`` alone
        for a single GPU)."""
        return ",".join(f"{name}={degree}" for name, degree in self.used.items()) or "1"


def check_degree(name: str, value: object) -> int:
    """``value`` as the degree of dimension ``name``: an integer from 1 to :data:`MAX_WORLD_SIZE`."""
    number = as_integer(value)
    if number is None or number < 1:
        raise InvalidInputError(f"the mesh degree {name}={value!r} is not a number of GPUs: give an integer, "
                                f"at least 1", hint=f"e.g. {name}=2 (1: the dimension is not used)")
    if number > MAX_WORLD_SIZE:
        raise InvalidInputError(f"the mesh degree {name}={number:,} is more than {MAX_WORLD_SIZE:,} GPUs "
                                f"(2**20; memcalc lists every rank)")
    return number


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp_shard=8,tp=4"`` → ``{"dp_shard": 8, "tp": 4}``, each degree checked by name.

    Raises:
        InvalidInputError: an empty mesh, an item without ``=``, an unknown or repeated
            dimension, or a degree that is not a positive integer.
    """
    items = [item.strip() for item in str(text).split(",")]
    if not any(items):
        raise InvalidInputError("the mesh is empty", hint="e.g. --mesh dp_shard=8,tp=4")
    degrees: dict[str, int] = {}
    for item in items:
        name, equals, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not equals or not name:
            raise InvalidInputError(f"the mesh item {item!r} is not DIMENSION=DEGREE",
                                    hint=f"e.g. --mesh dp_shard=8,tp=4; the dimensions: {', '.join(DIMENSION_NAMES)}")
        if name != ETP:  # read with the degrees it depends on (Mesh.of)
            _check_name(name)
        if name in degrees:
            raise InvalidInputError(f"the mesh names {name} twice ({text})", hint="give each dimension once")
        if not (value.isascii() and value.isdigit()):
            raise InvalidInputError(f"the mesh degree {name}={value!r} is not a number of GPUs: give an integer, "
                                    f"at least 1", hint=f"e.g. {name}=2 (1: the dimension is not used)")
        degrees[name] = check_degree(name, int(value))
    return degrees


def refuse_expert_tensor_parallel(degrees: Mapping[str, object]) -> Mapping[str, object]:
    """``degrees`` without ``etp``, which torchtitan allowed as 1 or tp under ep
    (``ParallelDims._validate``: "Currently we only support ETP=TP or ETP=1").

    etp=1 is the layout memcalc models (the experts whole, over ep ranks that borrow tp). etp = tp
    (``ExpertTensorParallel``: each expert's w1/w3 split by columns and w2 by rows over tp, tokens
    moved over ep alone) is not modelled: torchtitan removed it (PR #3167, 2026-04-30) and
    transformers deprecates its ``moe_tp_experts`` style, so no library left runs it (the design, for
    whoever adds it: docs/many-gpus.md).

    Raises:
        InvalidInputError: etp not 1 or tp, or above 1 without ep.
        InapplicableOptionError: etp = tp > 1 under ep.
    """
    if ETP not in degrees:
        return degrees
    rest = {name: value for name, value in degrees.items() if name != ETP}
    etp = check_degree(ETP, degrees[ETP])
    if etp == 1:
        return rest
    tp, ep = (check_degree(name, rest.get(name, 1)) for name in ("tp", "ep"))
    if ep == 1:
        raise InvalidInputError(f"etp={etp} without ep: the expert tensor-parallel degree only lays out ep's experts",
                                hint=f"add ep (e.g. tp={etp},ep=2,etp={etp}) or drop etp")
    if etp != tp:
        raise InvalidInputError(f"etp={etp} with tp={tp}: torchtitan's expert_tensor_parallel_degree is 1 or tp",
                                hint="etp=1: the experts whole over ep ranks that borrow tp (modelled)")
    raise InapplicableOptionError(
        f"etp=tp={tp} (expert tensor parallelism: each expert's w1/w3 column-sharded and w2 row-sharded over "
        f"the {tp} tp ranks, tokens moved over ep={ep} alone) is not modelled: torchtitan removed it "
        f"(ExpertTensorParallel, PR #3167) and transformers deprecates moe_tp_experts",
        hint=f"Estimate etp=1 (the default: the experts whole over ep ranks that borrow tp; drop etp={etp}); "
             f"docs/many-gpus.md gives etp=tp's per-rank arithmetic.")


def _check_name(name: object) -> None:
    if name in DIMENSION_NAMES:
        return
    close = difflib.get_close_matches(str(name), list(DIMENSION_NAMES), n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    raise InvalidInputError(f"unknown mesh dimension {name!r}",
                            hint=f"{guess}The dimensions (torchtitan's names): "
                                 + "; ".join(f"{n}: {what}" for n, what in DIMENSION_NAMES.items()) + ".")

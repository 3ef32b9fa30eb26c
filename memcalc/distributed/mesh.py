"""The device mesh: how many GPUs each dimension of a multi-GPU step spans, with torchtitan's
names for the degrees (``torchtitan/distributed/parallel_dims.py``: ``dp_replicate``,
``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``). The world size is their product.

:class:`Mesh` is the validated degrees; :func:`parse_mesh` reads the command line's spelling
(``--mesh dp_shard=8,tp=4,pp=2``). What each dimension does to a rank is the business of its
strategy object (:mod:`memcalc.distributed.strategy`); a mesh only counts.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from memcalc.core.counts import as_integer
from memcalc.core.errors import InvalidInputError

__all__ = ("DIMENSION_NAMES", "MAX_WORLD_SIZE", "Mesh", "check_degree", "parse_mesh")

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
                a product over :data:`MAX_WORLD_SIZE`; each naming the dimension.
        """
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
        _check_name(name)
        if name in degrees:
            raise InvalidInputError(f"the mesh names {name} twice ({text})", hint="give each dimension once")
        if not (value.isascii() and value.isdigit()):
            raise InvalidInputError(f"the mesh degree {name}={value!r} is not a number of GPUs: give an integer, "
                                    f"at least 1", hint=f"e.g. {name}=2 (1: the dimension is not used)")
        degrees[name] = check_degree(name, int(value))
    return degrees


def _check_name(name: object) -> None:
    if name in DIMENSION_NAMES:
        return
    close = difflib.get_close_matches(str(name), list(DIMENSION_NAMES), n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    raise InvalidInputError(f"unknown mesh dimension {name!r}",
                            hint=f"{guess}The dimensions (torchtitan's names): "
                                 + "; ".join(f"{n}: {what}" for n, what in DIMENSION_NAMES.items()) + ".")

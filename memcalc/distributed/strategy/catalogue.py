"""Every strategy file of this package, imported once, and the strategies of a setting.

Each file here registers its :class:`~memcalc.distributed.strategy.base.RankStrategy` when it is
imported; this module imports them all (any module of the package but ``base`` and itself), so
that a new dimension is one new file. It does so the first time a registry is read through it
(:func:`dimensions`, :func:`shorthands` and the functions below), not when it is imported: the
strategy files import the pipeline's, DTensor's and ZeRO's modules, which a single-GPU request
never reads (issue 36; ``tests/test_startup.py``). :func:`strategies_for` gives a setting's
strategies in the order they apply to a rank — torchtitan's (``parallelize_llama``): the pipeline
splits the model into stages, then tensor and context parallelism and experts shard each stage's
modules, then FSDP2 wraps what is left, and replication goes around it all.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from memcalc.core.errors import InapplicableOptionError
from memcalc.distributed.mesh import DIMENSION_NAMES
from memcalc.distributed.strategy import base
from memcalc.distributed.strategy.base import DIMENSIONS, SHORTHANDS, RankStrategy, Setting
from memcalc.distributed.vocabulary import Strategy

__all__ = ("APPLICATION_ORDER", "dimensions", "options_of", "shorthand_class", "shorthands", "strategies_for")

#: The order in which the mesh's dimensions apply to a rank's model (see the module docstring).
APPLICATION_ORDER = ("pp", "tp", "cp", "ep", "dp_shard", "dp_replicate")
assert sorted(APPLICATION_ORDER) == sorted(DIMENSION_NAMES)


@functools.cache
def _import_every_strategy() -> None:
    package = importlib.import_module(base.__name__.rpartition(".")[0])
    for module in pkgutil.iter_modules(package.__path__):
        if module.name not in ("base", "catalogue"):
            importlib.import_module(f"{package.__name__}.{module.name}")


def dimensions() -> dict[str, type[RankStrategy]]:
    """Every modelled mesh dimension's strategy by its name (``dp_shard``), every file imported."""
    _import_every_strategy()
    return DIMENSIONS


def shorthands() -> dict[Strategy, type[RankStrategy]]:
    """Every ``--strategy`` shorthand's strategy, every file imported."""
    _import_every_strategy()
    return SHORTHANDS


def shorthand_class(strategy: Strategy) -> type[RankStrategy] | None:
    """The strategy of ``--strategy NAME``; None for ``single`` and ``mesh``, which ``base.register``
    refuses as shorthands (so a single-GPU request imports no strategy file to be told so)."""
    if strategy is Strategy.SINGLE or not strategy.is_shorthand:
        return None
    return shorthands().get(strategy)


def options_of(strategy: Strategy, used: dict[str, int] | None) -> frozenset[str]:
    """The :class:`memcalc.Distributed` arguments a setting reads beside the world size and the batch
    convention: its shorthand's, or (``mesh``) those of every modelled dimension in ``used``."""
    if strategy is Strategy.MESH:
        known = dimensions()
        return frozenset().union(*(known[name].options for name in used or {} if name in known))
    cls = shorthand_class(strategy)
    return frozenset() if cls is None else cls.options


def strategies_for(distributed: Setting) -> list[RankStrategy]:
    """The strategies of a multi-GPU setting, in the order they apply: a shorthand's one, or
    one per dimension of the mesh in use.

    Raises:
        InapplicableOptionError: a mesh dimension in use that no file here models yet.
    """
    cls = shorthand_class(distributed.strategy)
    if cls is not None:
        return [cls(distributed, distributed.world_size)]
    mesh = distributed.mesh
    assert mesh is not None and distributed.strategy is Strategy.MESH, distributed
    used = mesh.used
    missing = [name for name in APPLICATION_ORDER if name in used and name not in dimensions()]
    if missing:
        listed = ", ".join(f"{name}={used[name]} ({DIMENSION_NAMES[name]})" for name in missing)
        modelled = ", ".join(name for name in APPLICATION_ORDER if name in DIMENSIONS)
        raise InapplicableOptionError(
            f"the mesh {mesh.describe()}: {listed} {'is' if len(missing) == 1 else 'are'} not modelled yet",
            hint=f"The modelled dimensions: {modelled}. Estimate without {', '.join(missing)} "
                 f"(set {'=1, '.join(missing)}=1).")
    return [DIMENSIONS[name](distributed, used[name]) for name in APPLICATION_ORDER if name in used]

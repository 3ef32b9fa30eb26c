"""torch's ``_disable_dynamo`` wrappers run without importing Dynamo while it is not loaded.

torch wraps many functions a trace calls in ``torch._disable_dynamo`` (the elementwise
references that are the meta kernels of ``add``, ``mul``, ``where``, ``cat``...;
``Optimizer.add_param_group`` and ``zero_grad``; ``torch.utils.checkpoint``). The wrapper
imports ``torch._dynamo`` at its first call (0.5-1.0 CPU-s with sympy: several estimates'
worth, paid inside the first trace of a process) only to build ``torch._dynamo.disable(fn)``,
which keeps Dynamo's frame callback off while ``fn`` runs. While ``torch._dynamo`` is not
imported no frame callback can be set, so that wrapper would change nothing: inside
:func:`dynamo_deferred`, each such function's cached wrapper (the ``__dynamo_disable``
attribute torch's ``inner`` looks up) is a stand-in that calls ``fn`` directly, or, once
Dynamo is loaded, builds torch's own wrapper, keeps it and calls it. The stand-ins are put in
place on entry and taken out on exit (only where they are still there), so that outside the
block torch's functions are as torch left them.

The functions are found once per process by unwrapping the meta kernels of torch's
decomposition tables and the modules named in :data:`_MODULES`; a wrapped function found
nowhere there still imports Dynamo at its first call, as without this module.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._compile

__all__ = ("dynamo_deferred",)

_DYNAMO = "torch._dynamo"
_ATTRIBUTE = "__dynamo_disable"
#: The code of the closure ``torch._disable_dynamo`` returns (its free variables: ``fn``, ``recursive``).
_INNER_CODE = torch._compile._disable_dynamo(lambda: None).__code__
#: Modules whose functions (and classes' methods) a trace calls through ``_disable_dynamo``.
_MODULES = ("torch._refs", "torch._refs.nn.functional", "torch._refs.special", "torch._refs.linalg",
            "torch._refs.fft", "torch._decomp.decompositions", "torch.optim.optimizer", "torch.utils.checkpoint")


_found: list[tuple[Any, bool]] | None = None
_depth = 0
_placed: list[tuple[Any, Callable[..., Any]]] = []


def _unwrapped(candidate: object, into: dict[int, tuple[Any, bool]], depth: int = 0) -> None:
    # The layers of a reference (``out_wrapper`` -> type promotion -> ``_disable_dynamo``'s
    # ``inner`` -> ``fn``) hold the next in their closures; ``functools.wraps(prim)`` on the
    # outermost makes ``__wrapped__`` skip them, so the closures are what is followed.
    code = getattr(candidate, "__code__", None)
    if code is None or depth > 6:
        return
    cells = dict(zip(code.co_freevars, getattr(candidate, "__closure__", None) or (), strict=True))
    if code is _INNER_CODE:
        fn = cells["fn"].cell_contents
        into[id(fn)] = (fn, bool(cells["recursive"].cell_contents))
        return
    for cell in cells.values():
        try:
            inside = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(inside) and not isinstance(inside, type):
            _unwrapped(inside, into, depth + 1)


def _wrapped_functions() -> list[tuple[Any, bool]]:
    """Every ``(fn, recursive)`` of a ``_disable_dynamo`` wrapper reachable from torch's
    decomposition tables and :data:`_MODULES` (found once)."""
    global _found
    if _found is None:
        from torch._decomp import global_decomposition_table

        into: dict[int, tuple[Any, bool]] = {}
        for table in global_decomposition_table.values():
            for kernel in table.values():
                _unwrapped(kernel, into)
        for name in _MODULES:
            module = sys.modules.get(name) or importlib.import_module(name)
            for value in list(vars(module).values()):
                _unwrapped(value, into)
                if isinstance(value, type) and value.__module__ == name:
                    for member in vars(value).values():
                        _unwrapped(member, into)
        _found = list(into.values())
    return _found


def _stand_in(fn: Callable[..., Any], recursive: bool) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if _DYNAMO not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(fn, recursive, wrapping=False)  # type: ignore[no-untyped-call]
        setattr(fn, _ATTRIBUTE, disabled)  # torch's own from now on, as its first call would have made it
        return disabled(*args, **kwargs)

    return call


@contextlib.contextmanager
def dynamo_deferred() -> Iterator[None]:
    """Inside the block, torch's ``_disable_dynamo`` functions import no Dynamo while it is not
    loaded (nested blocks leave it to the outermost)."""
    global _depth
    if _depth == 0 and _DYNAMO not in sys.modules:
        for fn, recursive in _wrapped_functions():
            if getattr(fn, _ATTRIBUTE, None) is None:
                stand_in = _stand_in(fn, recursive)
                setattr(fn, _ATTRIBUTE, stand_in)
                _placed.append((fn, stand_in))
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for fn, stand_in in _placed:
                if getattr(fn, _ATTRIBUTE, None) is stand_in:
                    delattr(fn, _ATTRIBUTE)
            _placed.clear()


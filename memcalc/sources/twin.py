"""The model's own copy: what memcalc estimates (on meta) and measures (on a device) in place of
the ``nn.Module`` a user passes, so that the user's object, its tensors and everything its hooks
reach come back as they were.

``copy.deepcopy`` alone is not that copy:

- it copies every tensor it meets into real memory: a plain tensor attribute (neither a
  parameter nor a buffer) of 800 MB costs 800 MB;
- it refuses a tensor that is not a graph leaf, which ``nn.utils.prune`` and the old
  ``nn.utils.weight_norm`` leave as the module's ``weight`` (recomputed by their forward
  pre-hook before every forward);
- it copies a function as itself: a hook whose closure holds a list (or the user's module)
  appends to the user's list when the copy runs its forward.

So every tensor the module reaches is pre-seeded in deepcopy's memo with its copy (on meta for
the estimate), and every function the module reaches (hooks, a patched ``forward``) that has a
closure, or that the user wrote and that reads globals (a hook at the top of a notebook that
appends to a global list), with a function of the same code over copied cells and copied
globals. What stays shared: a library's functions (their globals are their package's state),
the methods of the user's classes (a ``forward`` that appends to a global list still does),
and what cannot be copied (a lock, an open file).
"""

from __future__ import annotations

import copy
import functools
import site
import sysconfig
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

import models_zoo
from memcalc.core.errors import MemcalcError, ModelSourceError
from memcalc.engine.model import ModelInputs

__all__ = ("check_supported_modules", "materialise_lazy", "meta_twin", "own_copy")

META = torch.device("meta")

#: Makes the copy of one tensor the module reaches; None leaves it to deepcopy.
TensorCopy = Callable[[torch.Tensor], "torch.Tensor | None"]


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose every tensor is on meta — parameters, buffers, plain tensor
    attributes and tensors its hooks hold — without copying any data. Tied weights stay tied
    (one memo entry each); lazy parameters stay lazy, on meta."""
    return own_copy(module, _on_meta)


def own_copy(module: nn.Module, tensor_copy: TensorCopy) -> nn.Module:
    """A deep copy of ``module`` that shares no mutable state with it: each tensor it reaches
    is ``tensor_copy(tensor)`` (deepcopy's own copy where that is None; a tensor that is not a
    graph leaf, which deepcopy refuses, a detached clone), each function with a closure a
    function over copied cells."""
    memo: dict[int, Any] = {}
    found = _Reached()
    found.visit(module)
    for tensor in found.tensors:
        made = tensor_copy(tensor)
        if made is None and not tensor.is_leaf:
            made = tensor.detach().clone()
        if made is not None:
            memo[id(tensor)] = made
    fills = [_seed_function(fn, memo) for fn in found.functions]
    for fill in fills:
        fill()
    return copy.deepcopy(module, memo)


#: The lazy tensors (``nn.LazyLinear``'s weight before its first forward), by type.
_LAZY_KINDS: dict[type, Callable[..., torch.Tensor]] = {UninitializedParameter: UninitializedParameter,
                                                        UninitializedBuffer: UninitializedBuffer}


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s counterpart on meta: a parameter stays a parameter (lazy stays lazy)."""
    lazy = _LAZY_KINDS.get(type(tensor))
    if lazy is not None:  # no data to move: a new lazy tensor on meta (torch's stubs type __new__ as Tensor's)
        made: torch.Tensor = lazy(requires_grad=tensor.requires_grad, device=META, dtype=tensor.dtype)
        return made
    meta = tensor.detach().to(META)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta


class _Reached:
    """The tensors and closures reachable from a module through the objects deepcopy would
    copy: attributes, containers, partials, bound methods, closure cells."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.functions: list[types.FunctionType] = []
        self._seen: set[int] = set()

    def visit(self, root: object) -> None:
        stack = [root]
        while stack:
            obj = stack.pop()
            if id(obj) in self._seen:
                continue
            self._seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                self.tensors.append(obj)
            elif isinstance(obj, types.FunctionType):
                if _copied(obj):
                    self.functions.append(obj)
                    stack.extend(_cell_contents(obj))
                    stack.extend(_globals_read(obj).values())
            else:
                stack.extend(_children(obj))


def _children(obj: object) -> Iterator[object]:
    """What deepcopy would descend into from ``obj`` (nothing for atoms: numbers, strings,
    types, Python modules)."""
    if isinstance(obj, (str, bytes, int, float, complex, bool, type, types.ModuleType, types.BuiltinFunctionType)):
        return
    if isinstance(obj, dict):
        yield from obj.keys()
        yield from obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
    elif isinstance(obj, types.MethodType):
        yield obj.__func__
        yield obj.__self__
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        yield from attributes.values()


def _copied(fn: types.FunctionType) -> bool:
    """Whether the copy gets its own copy of ``fn``: a closure, or a function of the user's own
    code that reads globals (a hook written at the top of a notebook or script appends to a
    global list). A library's function without a closure stays itself: its globals are its
    package's own state."""
    return bool(fn.__closure__) or (bool(_globals_read(fn)) and _users_code(fn))


def _users_code(fn: types.FunctionType) -> bool:
    """``fn`` was defined outside the installed packages, the standard library and memcalc."""
    path = Path(fn.__code__.co_filename)
    if not path.is_absolute():  # "<stdin>", "<string>": typed or generated by the user
        return True
    path = path.resolve()
    return not any(path.is_relative_to(directory) for directory in _library_dirs())


@functools.cache
def _library_dirs() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    found = {*site.getsitepackages(), paths["stdlib"], paths["purelib"], paths["platlib"]}
    return (*(Path(p).resolve() for p in found), Path(__file__).resolve().parent.parent,
            Path(models_zoo.__file__).resolve().parent)


def _globals_read(fn: types.FunctionType) -> dict[str, object]:
    """The module globals that ``fn``'s code (nested functions included) reads or writes,
    other than Python modules, classes and builtins: the shared state a copy must not touch."""
    names: set[str] = set()
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    scope = fn.__globals__
    return {name: scope[name] for name in names
            if name in scope and not isinstance(scope[name], (types.ModuleType, type))}


def _cell_contents(fn: types.FunctionType) -> Iterator[object]:
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell (a name not yet bound)
            continue


def _seed_function(fn: types.FunctionType, memo: dict[int, Any]) -> Callable[[], None]:
    """Seeds ``memo`` with a function of ``fn``'s code over new, empty cells; returns what
    fills those cells with deep copies of ``fn``'s (run once every function is seeded, so
    that closures that reach each other, or the module, are copied once). A cell whose
    content cannot be copied (a lock, an open file) stays shared, as deepcopy leaves a
    function."""
    closure = fn.__closure__ or ()
    cells = tuple(types.CellType() for _ in closure)
    shared = _globals_read(fn) if _users_code(fn) else {}
    # the user's function reads its globals from a scope of its own: the rest of the module's
    # globals as they are, the ones it reads copied below
    scope = {**fn.__globals__} if shared else fn.__globals__
    twin = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells or None)
    twin.__kwdefaults__ = fn.__kwdefaults__
    twin.__qualname__ = fn.__qualname__
    twin.__dict__.update(fn.__dict__)
    memo[id(fn)] = twin

    def fill() -> None:
        for cell, original in zip(cells, closure, strict=True):
            try:
                cell.cell_contents = _copy_or_share(original.cell_contents, memo)
            except ValueError:  # an empty cell
                continue
        for name, value in shared.items():
            scope[name] = _copy_or_share(value, memo)

    return fill


def _copy_or_share(value: object, memo: dict[int, Any]) -> object:
    """A deep copy of ``value`` through ``memo``; ``value`` itself when it cannot be copied (a
    lock, an open file): shared, as deepcopy leaves a function."""
    try:
        return copy.deepcopy(value, memo)
    except Exception:
        return value


def check_supported_modules(module: nn.Module, model: str) -> None:
    """Refuses a model that holds a TorchScript module: memcalc runs a module's Python forward
    on meta tensors, and a scripted (or traced) module runs compiled TorchScript instead, which
    takes no forward hooks and no meta twin.

    Raises:
        ModelSourceError: naming the module's path in the model.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, torch.jit.ScriptModule):
            where = f"module {name!r} of {model}" if name else f"the model {model}"
            raise ModelSourceError(
                f"{where} is a TorchScript module ({type(sub).__name__}, from torch.jit.script or "
                f"torch.jit.trace): memcalc runs the model's Python forward on meta tensors, which a "
                f"scripted module does not have",
                hint="Estimate the nn.Module before scripting it (the module you passed to torch.jit.script).")


def materialise_lazy(module: nn.Module, inputs: ModelInputs, model: str) -> None:
    """Gives the lazy modules of ``module`` (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) their
    parameters: a lazy module learns its weights' shapes from its first forward, so one dry
    forward on ``inputs`` (in eval mode, without grad; on meta it allocates nothing)
    materialises them, as the user's own first batch would, before the estimate registers the
    parameters and builds the optimizer over them.

    Raises:
        ModelSourceError: the dry forward failed, or left a lazy module uninitialised (one that
            the forward never calls), naming the module.
    """
    lazy = _lazy_modules(module)
    if not lazy:
        return
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            inputs.call(module)
    except MemcalcError:
        raise
    except Exception as exc:
        raise ModelSourceError(
            f"module {lazy[0]!r} of {model} is lazy ({type(module.get_submodule(lazy[0])).__name__}): memcalc "
            f"gives it its parameters with one forward on the inputs, which raised {type(exc).__name__}: {exc}",
            hint="Check the input shape, or run the model once on a sample batch before estimating it.") from exc
    finally:
        module.train(was_training)
    if left := _lazy_modules(module):
        raise ModelSourceError(
            f"module {left[0]!r} of {model} is lazy ({type(module.get_submodule(left[0])).__name__}) and the "
            f"model's forward does not call it, so its parameters have no shape",
            hint="Run the model once on a sample batch, or replace the lazy module by its sized counterpart.")


def _lazy_modules(module: nn.Module) -> list[str]:
    """The paths of the modules whose parameters are still uninitialised ("" for the root)."""
    return [name for name, sub in module.named_modules()
            if isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params()]  # type: ignore[misc]  # torch's self-type

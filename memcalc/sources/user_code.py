"""Loading the user's own model code: ``path/to/file.py:factory`` and
``package.module:factory``, with the ``example_inputs`` found beside the factory.

A model file runs as ``python file.py`` would run it: its folder is importable while its code
runs (at import, and when its factory and ``example_inputs`` are called), so that it can
import its neighbours (``from layers import Block``); afterwards neither the folder nor those
neighbours stay in ``sys.path`` / ``sys.modules``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias

from torch import nn

import models_zoo
from memcalc.core.errors import InvalidInputError, MemcalcError, ModelSourceError, UnknownModelError, user_frame

__all__ = ("Example", "factory_names", "load_from_file", "load_from_module", "load_function", "name_the_factory")

#: A user's ``example_inputs(batch_size[, seq_len=N])``: anything ``InputsLike`` (user code: unchecked).
Example: TypeAlias = Callable[..., Any]


def load_from_file(path: Path, attr: str) -> tuple[Callable[[], object], Example | None]:
    """The factory ``attr`` of the model file ``path`` and the file's ``example_inputs``
    (None if it has none), each run with the file's folder importable."""
    module, folder = _exec_file(path, "model file", ModelSourceError)
    factory, example = _factory_from(module, attr, str(path))
    # the factory and example_inputs may import their neighbours lazily, when they are called
    return _in_folder(factory, folder), (_in_folder(example, folder) if example is not None else None)


def name_the_factory(path: Path) -> InvalidInputError:
    """The error for a model file given without its factory (``memcalc models.py``): the file is
    run, as naming a factory would run it, to suggest the factories it defines."""
    module, _folder = _exec_file(path, "model file", ModelSourceError)
    names = factory_names(module)
    example = names[0] if names else "make_model"
    return InvalidInputError(f"{str(path)!r}: name the factory too, as {path}:{example}",
                             hint=f"Factories defined there (callables that take no argument): {', '.join(names[:10])}."
                             if names else "It defines no callable that takes no argument: add a function that "
                                           "returns the model (def make_model(): return MyModel()).")


def factory_names(module: ModuleType) -> list[str]:
    """The names in ``module`` that can build its model: module objects, and the functions and
    ``nn.Module`` classes defined there (not imported) that take no argument; not
    ``example_inputs``."""
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or name == "example_inputs":
            continue
        defined_here = getattr(value, "__module__", None) == module.__name__
        if isinstance(value, nn.Module) or (defined_here and _takes_no_argument(value)):
            names.append(name)
    return names


def _takes_no_argument(value: object) -> bool:
    """A function, or an ``nn.Module`` class, callable without arguments."""
    if not (inspect.isfunction(value) or (inspect.isclass(value) and issubclass(value, nn.Module))):
        return False
    try:
        parameters = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def _exec_file(path: Path, what: str, error: type[MemcalcError]) -> tuple[ModuleType, str]:
    """Run the Python file ``path`` (a ``what``: "model file", "loop file") with its folder
    importable; its module and folder. Failures are ``error``s naming the file."""
    if not path.is_file():
        raise error(f"{what} not found: {path}", hint="Check the path (relative to the current directory).")
    module_name = f"memcalc_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise error(f"cannot load the {what} {path} as Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(path.resolve().parent)
    try:
        with _importable(folder):
            spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise error(f"syntax error in {exc.filename or path}, line {exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        raise error(f"importing the {what} {path} raised {type(exc).__name__}: {exc}{user_frame(exc)}") from exc
    return module, folder


@contextmanager
def _importable(folder: str) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while a model file's code runs, as ``python file.py``
    has it, so that ``from layers import Block`` finds ``layers.py`` beside the file.

    Afterwards the folder leaves ``sys.path`` and the neighbours imported from it leave
    ``sys.modules`` (what they built keeps working): the next model file, in another folder,
    may have a ``layers.py`` of its own, and the user's session keeps no trace of either."""
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        if folder in sys.path:
            sys.path.remove(folder)  # the first occurrence: ours, unless the user's code moved it
        for name in set(sys.modules) - before:
            if _defined_in(sys.modules.get(name), folder):
                del sys.modules[name]


def _defined_in(module: ModuleType | None, folder: str) -> bool:
    location = getattr(module, "__file__", None)
    return isinstance(location, str) and Path(location).resolve().is_relative_to(folder)


def _in_folder(fn: Callable[..., Any], folder: str) -> Callable[..., Any]:
    """``fn`` called with its model file's folder importable (:func:`_importable`); its
    signature stays readable (``functools.wraps``)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _importable(folder):
            return fn(*args, **kwargs)

    return call


def load_from_module(module_path: str, attr: str) -> tuple[Callable[[], object], Example | None]:
    """The factory ``attr`` of the importable module ``module_path`` and its ``example_inputs``."""
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        if exc.name and module_path.startswith(exc.name):
            raise UnknownModelError(f"{module_path}:{attr}", models_zoo.closest(module_path),
                                    reason=f"no module named {exc.name!r} is importable here") from exc
        raise ModelSourceError(f"importing {module_path} raised ModuleNotFoundError: {exc}") from exc
    except SyntaxError as exc:
        raise ModelSourceError(f"syntax error in {exc.filename}, line {exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        raise ModelSourceError(f"importing {module_path} raised {type(exc).__name__}: {exc}{user_frame(exc)}") from exc
    return _factory_from(module, attr, module_path)


def _factory_from(module: ModuleType, attr: str, where: str) -> tuple[Callable[[], object], Example | None]:
    if not attr:
        raise InvalidInputError(f"name the factory after the colon: {where}:make_model")
    factory = getattr(module, attr, None)
    if factory is None:
        names = factory_names(module)
        close = difflib.get_close_matches(attr, names, n=1)
        meant = f"; did you mean {close[0]!r}?" if close else ""
        raise ModelSourceError(f"{where} has no attribute {attr!r}{meant}",
                               hint=f"Factories defined there (callables that take no argument): "
                                    f"{', '.join(names[:10]) or 'none'}.")
    example = getattr(module, "example_inputs", None)
    if isinstance(factory, nn.Module):
        instance = factory
        factory = lambda: instance  # a module object named directly
    if not callable(factory):
        raise ModelSourceError(f"{where}:{attr} is a {type(factory).__name__}, not a factory")
    return factory, example if callable(example) else None


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by ``path/to/file.py:name`` or ``package.module:name`` (a training
    loop given with ``--loop``), called with its file's folder importable.

    Raises:
        InvalidInputError: the file or module cannot be loaded, or has no such function.
    """
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise InvalidInputError(f"--loop {spec!r} names no loop function; give path/to/file.py:function or "
                                f"package.module:function, or a preset name")
    folder = None
    if where.endswith(".py"):
        module, folder = _exec_file(Path(where), "loop file", InvalidInputError)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise InvalidInputError(f"importing the loop module {where} raised {type(exc).__name__}: {exc}"
                                    f"{user_frame(exc)}") from exc
    function = getattr(module, attr, None)
    if function is None or isinstance(function, nn.Module) or not callable(function):
        public = [n for n, v in vars(module).items() if not n.startswith("_") and inspect.isfunction(v)]
        raise InvalidInputError(f"{where} has no attribute {attr!r}" if function is None else
                                f"{where}:{attr} is a {type(function).__name__}, not a loop function",
                                hint=f"A loop is a function fn(model, optimizer, batches). Functions defined "
                                     f"there: {', '.join(public[:10]) or 'none'}")
    return _in_folder(function, folder) if folder is not None else function

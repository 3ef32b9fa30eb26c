"""One exception class per way an estimate can fail; the CLI maps each to a message and an
exit code (2 for bad user input, 1 for a model that can't be estimated)."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

__all__ = (
    "CLI_KEYWORD_HINTS",
    "DataDependentError",
    "InapplicableOptionError",
    "InternalError",
    "InvalidInputError",
    "LoopFunctionError",
    "LossFunctionError",
    "MemcalcError",
    "MissingPackageError",
    "ModelSourceError",
    "OutputExistsError",
    "PlotPathError",
    "RefusedStepError",
    "RejectedShapesError",
    "SymbolicExecutionError",
    "UnknownModelError",
    "internal_errors_named",
    "symbolic_execution_error",
    "user_frame",
)


class MemcalcError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with; ``hint`` a suggestion to the user."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\n{self.hint}" if self.hint else text


class UnknownModelError(MemcalcError, LookupError):
    """A model name that is neither in the zoo nor a recognised source form."""

    exit_code = 2

    def __init__(self, name: str, suggestions: list[str], *, reason: str | None = None):
        hint = f"Did you mean {' or '.join(suggestions)}?" if suggestions else None
        hint = (hint + " " if hint else "") + "Run `memcalc zoo` to list the models."
        super().__init__(f"unknown model {name!r}" + (f": {reason}" if reason else ""), hint=hint)
        self.name = name
        self.suggestions = suggestions


class ModelSourceError(MemcalcError):
    """The user's own model code could not be loaded or did not produce a module."""


class InvalidInputError(MemcalcError, ValueError):
    """Arguments that make no sense (batch 0, a shape the model can't take, ...)."""

    exit_code = 2


class InapplicableOptionError(InvalidInputError):
    """An option that the rest of the request would ignore (an optimizer for an eval step, a
    DDP bucket size without DDP): refused rather than dropped, since the user meant something
    by it."""


class _UserFunctionError(InvalidInputError):
    """A function of the user's that memcalc calls on meta tensors failed: "the KIND function
    NAME PROBLEM", with the subclass's hint on how memcalc calls it."""

    KIND = ""
    HINT = ""

    def __init__(self, name: str, problem: str):
        super().__init__(f"the {self.KIND} function {name} {problem}", hint=self.HINT)
        self.name = name


class LossFunctionError(_UserFunctionError):
    """The user's own loss function raised, or returned something other than a scalar tensor."""

    KIND = "loss"
    HINT = ("memcalc calls loss(output) with the model's output as meta tensors (shapes, no values) "
            "and needs a one-element tensor back; fix the function, or use a built-in loss "
            "(loss=\"cross-entropy\", \"mean\", ...).")


class LoopFunctionError(_UserFunctionError):
    """The user's own training loop (``loop=fn``, ``--loop file.py:fn``) raised outside the
    model's forward."""

    KIND = "loop"
    HINT = ("memcalc calls loop(model, optimizer, batches) with the model and each batch as meta tensors "
            "(shapes, no values): make new tensors on the batch's device (device=x.device) and leave out "
            "what reads values (loss.item(), print(loss)).")


class PlotPathError(InvalidInputError):
    """A file memcalc was asked to write (a plot, a timeline, a snapshot) that cannot be
    written: its folder is missing or read-only, or its extension is not a format it writes."""


class OutputExistsError(PlotPathError):
    """The file memcalc was asked to write exists already: refused unless overwriting was asked
    for (``--force``, ``force=True``), so that an estimate never replaces a user's file."""

    def __init__(self, target: object, what: str):
        super().__init__(f"cannot write the {what} to {target}: the file exists; --force overwrites it "
                         f"(force=True in Python)")
        self.target = target


class RefusedStepError(InvalidInputError):
    """A training step that PyTorch itself refuses to run (an optimizer over no parameters, a
    backward through a loss that does not require grad), or whose gradients memcalc cannot
    follow (sparse ones): refused with the reason, rather than estimated as if it ran."""


class MissingPackageError(MemcalcError, ImportError):
    """An optional source (torchvision, timm, transformers, matplotlib) is not installed."""

    def __init__(self, package: str, purpose: str):
        super().__init__(f"{purpose} needs the package {package!r}, which is not installed",
                         hint=f"Install it with: pip install {package}")
        self.package = package


class SymbolicExecutionError(MemcalcError):
    """An op could not run on meta tensors: it has no shape-only (meta) kernel, or it rejected
    the shapes it was given (:class:`RejectedShapesError`). (An op that needs tensor values:
    :class:`DataDependentError`.) Made by :func:`symbolic_execution_error`, which tells them apart."""

    def __init__(self, op: str, module: str, phase: str, cause: BaseException, *, message: str | None = None,
                 hint: str | None = None):
        super().__init__(
            message or f"op {op} failed during {phase} in {_where(module)}: {type(cause).__name__}: {cause}",
            hint=hint or _hint_for(cause),
        )
        self.op = op
        self.module = module
        self.phase = phase
        #: The op refused the shapes it was given (it has a meta kernel): the inputs may be wrong.
        self.rejected_shapes = hint is None and not _no_meta_kernel(cause)


class RejectedShapesError(SymbolicExecutionError, InvalidInputError):
    """An op that has a meta kernel refused the shapes it was given: the model and its input
    disagree (an image shape of the wrong rank, another model's ``example_inputs``, a width the
    first layer does not take). The input is what the user can change, so it is bad input
    (exit 2, as :class:`InvalidInputError`); catching :class:`SymbolicExecutionError` still
    catches it."""


class DataDependentError(SymbolicExecutionError):
    """The model reads tensor values — ``.item()``, an ``if`` on a tensor, ``nonzero``, a
    boolean mask, ``torch.unique``, ``masked_select`` — whose result (a number, an output
    size) a run on shapes alone cannot know."""

    def __init__(self, op: str, module: str, phase: str, cause: BaseException, *, reads: str, advice: str):
        super().__init__(
            op, module, phase, cause,
            message=f"the model reads tensor values during {phase} in {_where(module)}: {reads} (op {op}), "
                    f"and memcalc runs the model on shapes only, without data",
            hint=f"{advice}Otherwise make that code depend on shapes or configuration, or estimate the "
                 f"submodule separately." if advice else
                 "Make that code depend on shapes or configuration instead, or estimate the submodule separately.",
        )
        self.reads = reads
        self.op = op

    def read_by_loop(self, loop: str) -> None:
        """The value was read by the user's training loop, not by the model (``loss.item()``
        after ``backward()``): one message that names the loop and its line, in place of the
        model-centred one (which would blame "the model's own code" during backward)."""
        self.args = (f"the loop function {loop} reads a tensor's value{user_frame(self)}: {self.reads} "
                     f"(op {self.op}), and memcalc runs the loop on meta tensors, shapes only, without data",)
        self.hint = ("Leave such lines (loss.item(), print(loss), float(loss), logging of values) out of the loop "
                     "you estimate: reading a value allocates no GPU memory, so the estimate is the same without "
                     "them.")


class InternalError(MemcalcError):
    """A bug in memcalc itself, not in the model, its input or the options: a bare ``KeyError``
    from the allocator model, say. It says so, asks for a report, and names where it happened —
    the aten op and the module being traced, when a trace was running — so that the report can
    be acted on. The original exception is its ``__cause__`` (``--debug`` shows both)."""

    def __init__(self, cause: BaseException, *, op: str = "", module: str | None = None, phase: str = "",
                 stage: str = ""):
        super().__init__(f"internal error in memcalc, please report it: {type(cause).__name__}: {cause} "
                         f"({_internal_where(op, module, phase, stage)})",
                         hint="Run again with --debug for the traceback and include it in the report.")
        self.op = op
        self.module = module
        self.phase = phase
        self.stage = stage


def _internal_where(op: str, module: str | None, phase: str, stage: str) -> str:
    """Where an internal error happened, as precisely as it is known."""
    parts = [stage] if stage else []
    if op:
        parts.append(f"op {op}")
    if module is not None:
        parts.append(f"in {_where(module)}")
    if phase:
        parts.append(f"during {phase}")
    return " ".join(parts) or "outside any traced op"


_P = ParamSpec("_P")
_R = TypeVar("_R")


def internal_errors_named(stage: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a public entry point: any exception that is not a :class:`MemcalcError` leaves
    it as an :class:`InternalError` (``stage`` says where: "in estimate"), never as a bare
    Python exception. An iterator it returns is mapped the same way while it is iterated."""

    def decorate(func: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(func)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                with _mapped(stage):
                    result = func(*args, **kwargs)
            except InternalError as exc:
                # a call that does not fit the signature (a misspelt or unknown keyword) is the
                # caller's mistake, not memcalc's; the signature is read only once a call failed
                if isinstance(exc.__cause__, TypeError) and (refused := _misfit_call(func, args, kwargs)):
                    raise refused from None
                raise
            if isinstance(result, Iterator):
                return cast(_R, _iterated(result, stage))
            return result

        return call

    return decorate


#: Hints for keywords that users reach for by the CLI's names (``--mesh``, ``--strategy``, ``--world-size``).
CLI_KEYWORD_HINTS = {
    "mesh": "a mesh is distributed=memcalc.Distributed(dp_shard=8, tp=2) (the CLI's --mesh dp_shard=8,tp=2)",
    "strategy": "a strategy is distributed=memcalc.Distributed(\"fsdp\", world_size=8) (the CLI's --strategy)",
    "world_size": "the world size is distributed=memcalc.Distributed(\"ddp\", world_size=8) (the CLI's --world-size)",
}


def _misfit_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> InvalidInputError | None:
    """The error for a call of ``func`` that its signature refuses (an unknown keyword, too many
    positional arguments), naming the closest keyword; None when the call fits (the TypeError
    came from inside)."""
    import difflib  # only once a call failed: not on --help's path
    import inspect

    signature = inspect.signature(func)
    # the public API's functions are read as memcalc.NAME (memcalc/__init__.py re-exports them)
    public = func.__name__ in getattr(sys.modules.get("memcalc"), "__all__", ())
    where = f"help({'memcalc' if public else func.__module__}.{func.__name__})"
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        known = [name for name, p in signature.parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [name for name in kwargs if name not in signature.parameters]
        if not unknown:
            return InvalidInputError(f"{func.__name__}(): {exc}", hint=f"see {where}")
        name = unknown[0]
        close = difflib.get_close_matches(name, known, n=1)
        hint = CLI_KEYWORD_HINTS.get(name) or (f"did you mean {close[0]}=?" if close else None)
        return InvalidInputError(f"{func.__name__}() has no argument {name!r}",
                                 hint=(hint + "; " if hint else "") + f"see {where}")
    return None


def _iterated(items: Iterator[Any], stage: str) -> Iterator[Any]:
    """``items``, with :func:`internal_errors_named`'s mapping around each step."""
    with _mapped(stage):
        yield from items


@contextmanager
def _mapped(stage: str) -> Iterator[None]:
    """The mapping of :func:`internal_errors_named`."""
    try:
        yield
    except MemcalcError:
        raise
    except Exception as exc:
        raise InternalError(exc, stage=stage) from exc


def user_frame(exc: BaseException) -> str:
    """' (at file.py, line N)' for the innermost frame of the user's code (outside torch and
    memcalc) in ``exc``'s traceback, or "" when there is none: errors name the user's line.

    A frame is torch's or memcalc's by the package its file lies in, not by the words in its
    path: ``git clone`` puts memcalc in a folder named ``memcalc``, and a user's files may lie
    in one too."""
    libraries = _library_dirs()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not _inside(frame.filename, libraries):
            return f" (at {frame.filename}, line {frame.lineno})"
    return ""


#: memcalc's own package directory (this file is memcalc/core/errors.py).
_MEMCALC_PACKAGE = Path(__file__).resolve().parent.parent


def _library_dirs() -> tuple[Path, ...]:
    """The package directories of memcalc and of the imported torch, resolved."""
    torch = sys.modules.get("torch")
    return (_MEMCALC_PACKAGE, *(Path(p).resolve() for p in getattr(torch, "__path__", ())))


def _inside(filename: str, directories: tuple[Path, ...]) -> bool:
    path = Path(filename).resolve()
    return any(path.is_relative_to(directory) for directory in directories)


def symbolic_execution_error(op: str, module: str, phase: str, cause: BaseException) -> SymbolicExecutionError:
    """The error for ``op`` failing on meta tensors with ``cause``: a :class:`DataDependentError`
    when the op needs tensor values (by the op, or by what its meta kernel said), a
    :class:`SymbolicExecutionError` when it has no meta kernel, else a :class:`RejectedShapesError`."""
    reads = _data_dependent(op, str(cause))
    if reads is not None:
        return DataDependentError(op, module, phase, cause, reads=reads[0], advice=reads[1])
    if _no_meta_kernel(cause):
        return SymbolicExecutionError(op, module, phase, cause)
    return RejectedShapesError(op, module, phase, cause)


def _where(module: str) -> str:
    return f"module {module!r}" if module else "the model's own code (outside its submodules)"


_SCALAR = (".item(), int() / float() / bool() of a tensor or an `if` on one, which needs the tensor's value",
           "Take such numbers from the configuration or the shapes (x.shape[0]) instead. ")
_MASK = ("boolean-mask indexing x[mask], whose result has as many elements as the mask has True values",
         "x * mask or torch.where(mask, x, 0) keep the shape and give the same sums. ")
# aten ops whose result needs the data (by NAME in "aten.NAME.overload"): what they read, and
# what keeps the shape instead ("" when there is no general substitute).
_DATA_DEPENDENT_OPS: dict[str, tuple[str, str]] = {
    "_local_scalar_dense": _SCALAR,
    "item": _SCALAR,
    "is_nonzero": _SCALAR,
    "nonzero": ("nonzero / argwhere / torch.where(condition), whose result has a row per nonzero element",
                "torch.nonzero_static(x, size=N) has a fixed size. "),
    "argwhere": ("argwhere, whose result has a row per nonzero element",
                 "torch.nonzero_static(x, size=N) has a fixed size. "),
    "masked_select": ("masked_select, whose result has as many elements as the mask has True values", _MASK[1]),
    "_unique": ("torch.unique, whose result has an element per distinct value", ""),
    "_unique2": ("torch.unique, whose result has an element per distinct value", ""),
    "unique_dim": ("torch.unique(dim=...), whose result has a slice per distinct slice", ""),
    "unique_consecutive": ("torch.unique_consecutive, whose result has an element per run of equal values", ""),
    "repeat_interleave": ("repeat_interleave with a tensor of repeats, whose output length is their sum",
                          "Pass output_size= (the total length) and the size is known. "),
    "bincount": ("bincount, whose output length is the largest value plus one",
                 "one_hot(x, num_classes).sum(0) or scatter_add_ into a tensor of known size count the same. "),
    "equal": ("torch.equal, which compares the values", ""),
    "allclose": ("torch.allclose, which compares the values", ""),
}


def _data_dependent(op: str, cause: str) -> tuple[str, str] | None:
    """What a failing op reads from the data, or None when it failed for another reason."""
    parts = op.split(".")
    name = parts[1] if len(parts) > 2 and parts[0] == "aten" else op
    if name in _DATA_DEPENDENT_OPS:
        return _DATA_DEPENDENT_OPS[name]
    text = cause.lower()
    if "nonzero" in text and name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return _MASK  # a boolean index becomes nonzero inside the op's meta decomposition
    if "item() cannot be called on meta" in text:
        return _SCALAR
    if "cannot copy out of meta tensor" in text:
        return (".tolist(), .cpu() or .numpy(), which copy the values out",
                "Keep the values on the device, or read what you need from the shapes. ")
    if "data-dependent" in text or "data dependent" in text:
        return ("an op whose result depends on the values", "")
    return None


def _no_meta_kernel(cause: BaseException) -> bool:
    text = str(cause).lower()
    # "no fake impl registered" is how a custom op (torch.library) without a meta function fails
    return isinstance(cause, NotImplementedError) or ("meta" in text and "implement" in text) or "fake impl" in text


#: What torch says when a tensor's sizes multiply past int64 (c10's ``computeStorageNbytes``, ``numel``).
_SIZE_OVERFLOW = ("Storage size calculation overflowed", "integer multiplication overflow")


def _hint_for(cause: BaseException) -> str:
    if any(words in str(cause) for words in _SIZE_OVERFLOW):
        return ("A tensor of these sizes would hold more than 2**63 - 1 bytes, the most PyTorch can address: "
                "give a smaller --batch (or --seq-len, --input-shape).")
    if _no_meta_kernel(cause):
        return ("The op has no shape-only (meta) implementation in this PyTorch version, so memcalc "
                "cannot run it without data; please report the op.")
    return ("The op rejected the shapes it was given: check the input, --input-shape C,H,W for "
            "vision models (one sample, no batch dimension) or --seq-len N for sequence models.")

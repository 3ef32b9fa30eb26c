"""One exception class per way an estimate can fail; the CLI maps each to a message and an
exit code (2 for bad user input, 1 for a model that can't be estimated)."""

from __future__ import annotations

__all__ = (
    "InvalidInputError",
    "MemcalcError",
    "MissingPackageError",
    "ModelSourceError",
    "SymbolicExecutionError",
    "UnknownModelError",
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

    def __init__(self, name: str, suggestions: list[str]):
        hint = f"Did you mean {' or '.join(suggestions)}?" if suggestions else None
        hint = (hint + " " if hint else "") + "Run `memcalc zoo` to list the models."
        super().__init__(f"unknown model {name!r}", hint=hint)
        self.name = name
        self.suggestions = suggestions


class ModelSourceError(MemcalcError):
    """The user's own model code could not be loaded or did not produce a module."""


class InvalidInputError(MemcalcError, ValueError):
    """Arguments that make no sense (batch 0, a shape the model can't take, ...)."""

    exit_code = 2


class MissingPackageError(MemcalcError, ImportError):
    """An optional source (torchvision, timm, transformers, matplotlib) is not installed."""

    def __init__(self, package: str, purpose: str):
        super().__init__(f"{purpose} needs the package {package!r}, which is not installed",
                         hint=f"Install it with: pip install {package}")
        self.package = package


class SymbolicExecutionError(MemcalcError):
    """An op could not run on meta tensors (no meta kernel, or data-dependent: ``.item()``,
    ``nonzero``, Python branching on tensor values)."""

    def __init__(self, op: str, module: str, phase: str, cause: BaseException):
        where = f"module {module!r}" if module else "the model's own forward (outside its submodules)"
        super().__init__(
            f"op {op} failed during {phase} in {where}: {type(cause).__name__}: {cause}",
            hint=_hint_for(op, cause),
        )
        self.op = op
        self.module = module
        self.phase = phase


_DATA_DEPENDENT = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "item")


def _hint_for(op: str, cause: BaseException) -> str:
    if any(name in op for name in _DATA_DEPENDENT):
        return ("The model reads tensor values (.item(), nonzero, boolean masks, or an `if` on a "
                "tensor), which have no value when memcalc runs it without data. Make that branch "
                "depend on shapes or configuration instead, or estimate the submodule separately.")
    if isinstance(cause, NotImplementedError) or ("meta" in str(cause).lower() and "implement" in str(cause).lower()):
        return ("The op has no shape-only (meta) implementation in this PyTorch version, so memcalc "
                "cannot run it without data; please report the op.")
    return ("The op rejected the shapes it was given: check the input, --input-shape C,H,W for "
            "vision models (one sample, no batch dimension) or --seq-len N for sequence models.")

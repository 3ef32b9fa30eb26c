"""The software stack the step is estimated for: :class:`Stack`.

Every kernel fact memcalc uses (SDPA backend priority and constraints, autocast op lists,
cuBLAS workspaces, optimizer defaults) depends on the PyTorch version, and the CUDA context on
the CUDA version (lazy module loading, CUDA ≥ 11.7, shrinks it from ~1.3 GiB to ~0.4 GiB).
The default is the installed torch; :class:`Stack` asks for another. Vocabulary only: the
rules keyed by these versions live in :mod:`memcalc.targets.versions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.core.errors import InvalidInputError

__all__ = ("Stack",)


@dataclass(frozen=True)
class Stack:
    """``memcalc.estimate(model, stack=memcalc.Stack(torch="2.4", cuda="11.6"))``.

    Attributes:
        torch: ``"X.Y"``: the PyTorch whose kernels are modelled (None: the installed one).
        cuda: ``"X.Y"``: the CUDA runtime (None: the installed torch's CUDA build, or 12.x for a
            CPU build).
        context_mib: the CUDA context in MiB, overriding the model of it (None: modelled from
            the CUDA version, lazy loading and the GPU).
    """

    torch: str | None = None
    cuda: str | None = None
    context_mib: float | None = None

    def __post_init__(self) -> None:
        for name in ("torch", "cuda"):
            value = getattr(self, name)
            if value is not None and not _is_version(value):
                raise InvalidInputError(f"{name} version must look like X.Y, got {value!r}",
                                        hint=f"e.g. --{name}-version 2.4" if name == "torch"
                                        else "e.g. --cuda-version 12.1")
        ctx = self.context_mib
        if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, (int, float)) or not 0 <= ctx < 65536):
            raise InvalidInputError(f"context_mib (--context-mib) must be a number of MiB ≥ 0, got {ctx!r}")


def _is_version(value: object) -> bool:
    if not isinstance(value, str):
        return False
    parts = value.strip().split(".")
    return 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts[:2])

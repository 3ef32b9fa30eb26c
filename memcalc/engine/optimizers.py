"""The optimizers memcalc knows, each built from the real ``torch.optim`` class.

Optimizer state is never taken from a table: the real class runs its real ``step()`` on the
symbolic parameters and whatever it keeps in ``optimizer.state`` is what we count. The
textbook multiplier (SGD ×2, momentum ×3, Adam ×4 of parameter memory) is kept only as the
explanation printed beside the simulated peak.

``foreach=True`` is passed explicitly because that is what ``torch.optim`` picks by default
when every parameter is on CUDA (``torch.optim.optimizer._default_to_fused_or_foreach``);
on meta or CPU tensors it would otherwise fall back to the per-parameter loop, whose
temporaries are much smaller than the foreach path's (which holds e.g. Adam's
``sqrt(exp_avg_sq)`` for all parameters at once).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ("OPTIMIZERS", "Optimizer", "OptimizerSpec", "spec_for")


class Optimizer(str, enum.Enum):
    """The optimizers memcalc simulates, by their user-facing names."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"
    NONE = "none"  # forward + backward only


Params = Iterable[torch.nn.Parameter]


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer, and its textbook memory multiplier."""

    key: Optimizer
    display: str
    factory: Callable[[Params, bool], torch.optim.Optimizer] | None
    textbook_multiplier: int  # × parameter bytes: weights + grads + state tensors per weight
    textbook_terms: str  # what the multiplier adds up, for the explanation line

    def build(self, params: Params, foreach: bool = True) -> torch.optim.Optimizer | None:
        """The optimizer over ``params`` (``foreach``: the multi-tensor kernels); None for ``none``.

        Args:
            params: the parameters to optimize.
            foreach: whether to use ``torch.optim``'s multi-tensor (``foreach``) implementation.

        Returns:
            A ``torch.optim.Optimizer``, or None when no optimizer step is simulated.
        """
        return None if self.factory is None else self.factory(params, foreach)


OPTIMIZERS: dict[Optimizer, OptimizerSpec] = {
    spec.key: spec
    for spec in (
        OptimizerSpec(Optimizer.SGD, "SGD", lambda p, f: torch.optim.SGD(p, lr=0.01, foreach=f), 2,
                      "weights + grads"),
        OptimizerSpec(Optimizer.SGD_MOMENTUM, "SGD (momentum 0.9)",
                      lambda p, f: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=f), 3,
                      "weights + grads + momentum"),
        OptimizerSpec(Optimizer.ADAM, "Adam", lambda p, f: torch.optim.Adam(p, foreach=f), 4,
                      "weights + grads + 2 moments"),
        OptimizerSpec(Optimizer.ADAMW, "AdamW", lambda p, f: torch.optim.AdamW(p, foreach=f), 4,
                      "weights + grads + 2 moments"),
        OptimizerSpec(Optimizer.RMSPROP, "RMSprop", lambda p, f: torch.optim.RMSprop(p, foreach=f), 3,
                      "weights + grads + square average"),
        OptimizerSpec(Optimizer.ADAGRAD, "Adagrad", lambda p, f: torch.optim.Adagrad(p, foreach=f), 3,
                      "weights + grads + sum of squares"),
        OptimizerSpec(Optimizer.NONE, "none (forward + backward)", None, 2, "weights + grads"),
    )
}


def spec_for(optimizer: Optimizer | str) -> OptimizerSpec:
    """The spec for an optimizer name; ``ValueError`` listing the choices for anything else."""
    try:
        key = optimizer.value if isinstance(optimizer, Optimizer) else str(optimizer).strip().lower()
        return OPTIMIZERS[Optimizer(key)]
    except ValueError:
        choices = ", ".join(o.value for o in Optimizer)
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: {choices}") from None

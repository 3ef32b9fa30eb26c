"""Random initialisation skipped while a model is built on meta.

A module's constructor fills its parameters (``nn.Linear.reset_parameters``: ``kaiming_uniform_``;
transformers' ``Conv1D``: ``nn.init.normal_``). On a meta tensor the fill writes nothing, yet its
meta kernel is torch's Python reference (``torch._refs.normal``, ``uniform``): about 4 ms per call,
60% of building gpt2 from its config, paid by every estimate and by each of a fit's. The fills
are in-place and return their tensor, which is all they do on meta, so returning it at once
builds the same module, storage for storage (their own argument checks are skipped with them, as
transformers' ``no_init_weights`` skips them). Only meta tensors are skipped: a real build (the
one ``--measure`` runs) is filled as its constructor says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ("RANDOM_FILLS", "MetaRandomFillsSkipped")

#: ``torch.nn.init``'s in-place fills (the list transformers' ``no_init_weights`` empties), which
#: reach a torch-function mode themselves, and the tensor methods that fill at random; each
#: returns its tensor.
RANDOM_FILLS: frozenset[Callable[..., Any]] = frozenset({
    *(getattr(torch.nn.init, name) for name in (
        "uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
        "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_")),
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.cauchy_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.random_,
})


class MetaRandomFillsSkipped(TorchFunctionMode):
    """Inside it, a random fill of a meta tensor returns the tensor without running its kernel."""

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in RANDOM_FILLS:
            # torch.nn.init's fills hand their tensor on by keyword (``tensor=``), a method by position
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)

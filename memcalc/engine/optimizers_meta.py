"""What ``torch.optim``'s real code needs to run on meta parameters, undone as soon as it is done.

**Fused implementations** (``fused=True``). torch refuses it for parameters on a device outside
``torch.utils._foreach_utils._get_fused_kernels_supported_devices()`` (mps, cuda, xpu, hpu, cpu,
mtia and the private-use backend in torch 2.13): ``torch.optim.optimizer._device_dtype_check_for_fused``
raises when the optimizer first meets a parameter (Adam's and Adagrad's ``_init_group`` at the
lazy state initialisation, SGD's ``_init_group`` once per optimizer). The check is about where
a kernel exists, not about what the fused path allocates, so for the duration of a build or a
step on meta parameters :func:`fused_kernels_on_meta` adds ``"meta"`` to that list — the
floating-point check stays — and the optimizer takes exactly the code path it takes on CUDA:
its ``step`` counters are float32 tensors on the parameter's device
(``_get_scalar_dtype(is_fused=True)``, adam.py ``Adam._init_group``), its state is created by
the same Python code, and its update is one in-place kernel call per device and dtype.

The kernels on meta: ``aten._fused_adam_`` / ``aten._fused_adamw_`` have torch's own meta kernel
(torch/_meta_registrations.py ``meta__fused_adam_``), which checks that its arguments are tensor
lists and returns nothing — the op updates its arguments in place and allocates nothing, as the
CUDA kernel does (aten/src/ATen/native/cuda/FusedAdamKernel.cu). ``aten._fused_sgd_`` and
``aten._fused_adagrad_`` have none in torch 2.13 (their schemas in native_functions.yaml return
``()`` and mark every list argument mutable, ``Tensor(a!)[]``); :func:`fused_kernels_on_meta`
registers the same kind of kernel for them while it is active, through a
``torch.library.Library`` it destroys on the way out, and only where torch has none of its own.

**Scalars read during the step.** Adafactor reads two values per parameter to size its step
(torch/optim/_adafactor.py ``_single_tensor_adafactor``: ``alpha = max(eps2,
param.norm(2).item() / ...)`` and ``denom = max(1.0, update.norm(2).item() / ...)``; the foreach
path the same): Python floats that scale the update and decide nothing about memory. Meta tensors
have no values, so :func:`scalars_on_meta` answers ``.item()`` of a meta tensor with 1 (1.0,
``True``) while the step runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ("META_KERNELS_ADDED", "fused_kernels_on_meta", "scalars_on_meta", "step_under")

#: The fused optimizer ops torch 2.13 has no meta kernel for (torch/_meta_registrations.py
#: registers only ``_fused_adam_``, ``_fused_adamw_`` and the out-of-place ``_fused_adam``),
#: with every overload: ``default`` (float lr) and ``tensor_lr``.
META_KERNELS_ADDED = ("_fused_sgd_", "_fused_sgd_.tensor_lr", "_fused_adagrad_", "_fused_adagrad_.tensor_lr")
#: The name ``_device_dtype_check_for_fused`` looks the fused devices up by, in torch.optim.optimizer
#: (imported there from torch.utils._foreach_utils).
_FUSED_DEVICES = "_get_fused_kernels_supported_devices"


def _in_place_fused_kernel(*args: Any, **kwargs: Any) -> None:
    """The meta kernel of an in-place fused optimizer op: like ``meta__fused_adam_``, check that
    the tensor arguments are lists and allocate nothing (the op returns ``()``)."""
    for value in args:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a tensor list, got {type(value).__name__}")


@contextmanager
def fused_kernels_on_meta() -> Iterator[None]:
    """While active: ``fused=True`` accepts meta parameters and every fused optimizer kernel of
    ``torch.optim`` has a meta kernel. Both changes are undone on exit."""
    original: Callable[[], list[str]] = getattr(torch_optimizer, _FUSED_DEVICES)

    def with_meta() -> list[str]:
        return [*original(), "meta"]

    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]  # untyped in torch
    try:
        for name in META_KERNELS_ADDED:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
                library.impl(name, _in_place_fused_kernel, "Meta")  # type: ignore[no-untyped-call]  # untyped
        setattr(torch_optimizer, _FUSED_DEVICES, with_meta)
        yield
    finally:
        setattr(torch_optimizer, _FUSED_DEVICES, original)
        library._destroy()  # type: ignore[no-untyped-call]  # untyped in torch: removes the kernels


class _MetaScalars(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """``.item()`` (``aten._local_scalar_dense``) of a meta tensor is 1 of its kind; every other
    op goes on to the modes below (the tracer) unchanged."""

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            tensor: torch.Tensor = args[0]
            return True if tensor.dtype is torch.bool else 1.0 if tensor.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def scalars_on_meta() -> AbstractContextManager[Any]:
    """While active, ``.item()`` of a meta tensor is 1 (1.0, ``True``) instead of an error."""
    return _MetaScalars()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped in torch


def step_under(optimizer: torch.optim.Optimizer,
               contexts: Sequence[Callable[[], AbstractContextManager[Any]]]) -> torch.optim.Optimizer:
    """``optimizer`` with its ``step()`` run inside ``contexts`` (an attribute of this instance:
    its class, and every other optimizer, are left as they were)."""
    if not contexts:
        return optimizer
    step = optimizer.step

    @functools.wraps(step)
    def step_in_contexts(*args: Any, **kwargs: Any) -> Any:
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            return step(*args, **kwargs)

    optimizer.step = step_in_contexts  # type: ignore[method-assign]
    return optimizer

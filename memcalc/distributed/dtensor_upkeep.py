"""What running torch's DTensor code on the meta model leaves behind, and how a rank program puts it
back: the one home of the pieces tensor parallelism (:mod:`memcalc.distributed.tensor_parallel`) and
expert parallelism (:mod:`memcalc.distributed.expert_parallel`, :mod:`memcalc.distributed.ep_stages`)
share, so that neither reaches into the other's private names.

- DTensor's sharding caches (:func:`clear_dtensor_caches`), keyed by mesh and not by the rank a
  mesh was made on, emptied around every program and dry run.
- DTensor's sharding propagation run outside memcalc's tracer (:func:`propagation_untraced`): a
  real rank allocates nothing for it.
- The modules' parameters and forward hooks, which ``parallelize_module`` (every ``ParallelStyle``)
  and transformers' ``apply_expert_parallelism`` replace and add to (:func:`snapshot_modules`,
  :func:`restore_modules`).

It knows no rank program: the programs build on it, never the reverse (lint-imports' distributed
contract).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ("ModuleSnapshot", "clear_dtensor_caches", "propagation_untraced", "restore_modules", "snapshot_modules")

#: The attribute ``torch.distributed.tensor.distribute_module`` sets on a module it has run on.
_DISTRIBUTED_MARK = "_distribute_module_applied"
#: The hook dictionaries of ``nn.Module`` that ``distribute_module`` (under every ParallelStyle)
#: and ``PrepareModuleInput`` add to.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

#: Each submodule, its parameters, and the ids of its forward hooks (:func:`snapshot_modules`).
ModuleSnapshot = list[tuple[nn.Module, dict[str, Any], dict[str, tuple[int, ...]]]]


def clear_dtensor_caches() -> None:
    """Empty DTensor's sharding caches. Their keys compare meshes, not the rank a mesh was made
    on: one process tracing rank 0 and then rank 3 of an uneven split would be handed rank 0's
    local shapes (a real process is one rank for life). Their entries also hold the fake mesh."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()  # type: ignore[no-untyped-call]  # untyped in torch
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    clear_redistribute_planner_cache()


def propagation_untraced() -> Callable[[], None]:
    """Run DTensor's sharding propagation (an op on global-shaped fake tensors, for the output's
    metadata) with every dispatch mode set aside; returns the undo."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(original)
    def untraced(self: ShardingPropagator, op_schema: Any) -> Any:
        with _no_dispatch_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untraced  # type: ignore[method-assign]

    def undo() -> None:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]

    return undo


@contextmanager
def _no_dispatch_modes() -> Iterator[None]:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def snapshot_modules(module: nn.Module) -> ModuleSnapshot:
    """Each submodule's parameters and the ids of its forward hooks, before parallelizing."""
    return [(m, dict(m._parameters), {name: tuple(getattr(m, name)) for name in _HOOK_DICTS})
            for m in module.modules()]


def restore_modules(snapshot: ModuleSnapshot) -> None:
    """Put back the parameters ``parallelize_module`` replaced by DTensors, and remove the hooks
    it added."""
    for module, parameters, hooks in snapshot:
        module._parameters.clear()
        module._parameters.update(parameters)
        for name, kept in hooks.items():
            table = getattr(module, name)
            for key in [k for k in table if k not in kept]:
                del table[key]
        # distribute_module marks a module it ran on and refuses it a second time (a pipeline stage
        # parallelized for a dry run, then for its trace)
        module.__dict__.pop(_DISTRIBUTED_MARK, None)

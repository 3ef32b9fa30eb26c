"""DeepSpeed ZeRO: one rank of stage 1 or 2, whose 16-bit model is whole but whose fp32
master weights, optimizer state (and, in stage 2, gradients) are partitioned, and the
partitioned optimizer of all three stages (stage 3 runs it over
:class:`~memcalc.distributed.fsdp.ShardedProgram`)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memcalc.core.categories import Category
from memcalc.core.loop import OptimizerImpl
from memcalc.distributed.fsdp import ShardedProgram
from memcalc.distributed.program import RankProgram
from memcalc.engine.optimizers import OptimizerSpec
from memcalc.engine.trace import StorageTracer

__all__ = (
    "ZeroOptimizer",
    "ZeroProgram",
)


class ZeroOptimizer:
    """DeepSpeed's ZeRO optimizer around a ``torch.optim`` optimizer: the wrapped optimizer
    steps only this rank's fp32 partition (``single_partition_of_fp32_groups`` in
    stage_1_and_2.py, ``fp32_partitioned_groups_flat`` in stage3.py). Before its step the
    16-bit gradient partition is flattened and converted to fp32 (a new tensor, freed after
    the step); afterwards the updated partition is copied back into the 16-bit parameters in
    place and all-gathered in place (no memory)."""

    def __init__(self, inner: torch.optim.Optimizer | None, master: torch.Tensor, params: Sequence[nn.Parameter],
                 tracer: StorageTracer, gradient_dtype: torch.dtype, *,
                 around: tuple[Callable[[], None], Callable[[], None]] | None = None):
        self.around = around  # ZeRO-3: release every gathered parameter before the step, regather after
        self.inner = inner
        self.master = master
        self.params = list(params)
        self.tracer = tracer
        self.gradient_dtype = gradient_dtype
        # OrderedDicts, as torch.optim keeps its hooks: RemovableHandle holds them by weak reference
        self._hooks: tuple[OrderedDict[int, Callable[..., None]], ...] = (OrderedDict(), OrderedDict())

    def register_step_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """A hook called as ``hook(optimizer, args, kwargs)`` before each step, as
        ``torch.optim.Optimizer``'s (a traced loop watches the step through it)."""
        return self._register(self._hooks[0], hook)

    def register_step_post_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """A hook called after each step, as ``torch.optim.Optimizer``'s."""
        return self._register(self._hooks[1], hook)

    @staticmethod
    def _register(hooks: OrderedDict[int, Callable[..., None]], hook: Callable[..., None]) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    @property
    def state(self) -> Any:
        return self.inner.state if self.inner is not None else {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups if self.inner is not None else []

    def step(self) -> None:
        for hook in list(self._hooks[0].values()):
            hook(self, (), {})
        if self.around is not None:
            self.around[0]()  # stage3.py step(): _partition_all_parameters
        self._step()
        if self.around is not None:
            self.around[1]()  # _post_step: the persistent parameters gathered again
        for hook in list(self._hooks[1].values()):
            hook(self, (), {})

    def _step(self) -> None:
        if self.inner is None:
            return
        flat = torch.empty(self.master.numel(), dtype=self.gradient_dtype, device="meta")  # flatten
        fp32 = flat.to(self.master.dtype)
        del flat
        self.tracer.track(fp32, Category.GRADIENTS)
        self.master.grad = fp32
        del fp32
        self.inner.step()
        self.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


class ZeroProgram(RankProgram):
    """A rank of DeepSpeed ZeRO stage 1 or 2 (``deepspeed/runtime/zero/stage_1_and_2.py``):
    the 16-bit model is whole on every rank; this rank keeps the fp32 master partition and
    the optimizer state of ``1/world_size`` of the flattened parameters (padded to a multiple
    of ``2 × world_size`` elements) — of the parameters that require grad only
    (``bit16_groups`` holds the ``trainable_parameters`` of each group); frozen ones stay
    whole in 16-bit, with no gradient. Backward first allocates the contiguous reduce bucket
    (``ipg_buffer``, ``reduce_bucket_size`` elements, freed when backward ends). Stage 1
    keeps every 16-bit gradient until ``zero_grad``; stage 2 copies each gradient into the
    bucket as autograd produces it and frees it, keeping only this rank's partition in a
    persistent 16-bit buffer (``grads_in_partition``).

    ``overlap_comm`` doubles the bucket (``ipg_buffer`` gets ``buf_1`` "to avoid data access
    conflict"). ``offload_optimizer`` (``offload_optimizer.device: cpu``) moves the fp32 master
    partition, the optimizer state and the step to the host (DeepSpeedCPUAdam): stage 2 then
    copies each reduced gradient to the host's fp32 partition (``copy_gradients_to_cpu``) and
    allocates no ``grads_in_partition`` on the GPU, so the GPU keeps the 16-bit model, the
    bucket(s) and the gradients in flight — DeepSpeed's own ``estimate_zero2_model_states_mem_needs``
    with ``cpu_offload``: 2 bytes per parameter.

    For ZeRO-3 the same :class:`ZeroOptimizer` runs over the partitions of
    :class:`ShardedProgram` (``sharded=`` that program)."""

    def __init__(self, stage: int, world_size: int, reduce_bucket_size: int, training: bool,
                 sharded: ShardedProgram | None = None, *, overlap_comm: bool = False,
                 offload_optimizer: bool = False):
        super().__init__()
        if stage not in (1, 2, 3) or (stage == 3) != (sharded is not None):
            raise ValueError("stage 3 takes the ShardedProgram it partitions; stages 1 and 2 none")
        if stage == 3 and overlap_comm:
            raise ValueError("overlap_comm is modelled for stages 1 and 2")
        self.buckets = 2 if overlap_comm else 1
        self.offload_optimizer = offload_optimizer
        self.stage = stage
        self.world_size = world_size
        self.reduce_bucket_size = reduce_bucket_size
        self.training = training
        self.sharded = sharded
        self.master: torch.Tensor | None = None
        self.partition_numel = 0
        self._bucket: list[torch.Tensor] = []
        self._dtype = torch.float32
        self._steps = True  # False when the step has no optimizer (nothing to partition)

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        if self.sharded is not None:
            self.sharded.install(tracer, module)
            self.communication = self.sharded.communication  # one set for both
        super().install(tracer, module)
        params = [p for p in module.parameters() if p.requires_grad]
        if not (self.training and params and self._steps):
            return
        self._dtype = params[0].dtype
        if self.sharded is not None:
            self.partition_numel = self.sharded.trainable_shard_numel  # the partitions (on the host: offload_param)
        else:
            total = sum(p.numel() for p in params)
            alignment = 2 * self.world_size  # nccl_start_alignment_factor × world size
            self.partition_numel = math.ceil(total / alignment) * alignment // self.world_size
        if not self.offload_optimizer:  # offloaded: the master partition lives on the host
            self.master = self._buffer(self.partition_numel, torch.float32, Category.OPTIMIZER_STATE,
                                       preexisting=True, communication=False)
        if self.sharded is not None:
            return
        if self.stage == 2 and not self.offload_optimizer:
            self._buffer(self.partition_numel, self._dtype, Category.GRADIENTS, preexisting=True,
                         communication=False)
        if self.stage == 2:
            for p in params:
                hook = p.register_post_accumulate_grad_hook(self._drop_gradient)  # type: ignore[no-untyped-call]
                self._handles.append(hook)
        self._at_backward(module, self._allocate_bucket, self._release_bucket)

    def _drop_gradient(self, param: torch.Tensor) -> None:
        # stage 2: copied into the reduce bucket and reduced into this rank's partition
        if param.grad is not None:
            self._tracer.track(param.grad, Category.GRADIENTS)
            param.grad = None

    def _allocate_bucket(self) -> None:
        if not self._bucket:
            self._bucket = [self._buffer(self.reduce_bucket_size, self._dtype, Category.WORKSPACE)
                            for _ in range(self.buckets)]

    def _release_bucket(self) -> None:
        self._bucket = []

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        self._steps = spec.factory is not None
        if spec.factory is None:
            return spec
        inner_factory = spec.factory
        if self.offload_optimizer:  # the host steps the host's partition: nothing on the GPU

            def on_host(params: Any, impl: OptimizerImpl) -> Any:
                return ZeroOptimizer(None, torch.empty(0, device="meta"), list(params), self._tracer, self._dtype,
                                     around=self._around())

            return replace(spec, factory=on_host)

        def build(params: Any, impl: OptimizerImpl) -> Any:
            assert self.master is not None
            inner = inner_factory([self.master], impl)  # type: ignore[list-item]
            return ZeroOptimizer(inner, self.master, list(params), self._tracer, self._dtype, around=self._around())

        return replace(spec, factory=build)

    def _around(self) -> tuple[Callable[[], None], Callable[[], None]] | None:
        coordinator = None if self.sharded is None else self.sharded.coordinator
        return None if coordinator is None else (coordinator.release_and_reset_all, coordinator.gather_persistent)

    @property
    def iterations_differ(self) -> bool:
        """ZeRO-3's first step records the module trace; the steps after it prefetch along it and
        keep the persistent parameters whole: the engine traces the second step rather than repeat
        the first."""
        return self.sharded is not None and self.training

    def remove(self) -> None:
        super().remove()
        if self.sharded is not None:
            self.sharded.remove()

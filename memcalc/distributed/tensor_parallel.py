"""One rank of tensor (and sequence) parallelism, run by torch's own code: the meta model is
parallelized with the real ``torch.distributed.tensor.parallel.parallelize_module`` over a fake
process group, and the step is traced on that rank's DTensors.

What the tracer sees: DTensor's ``__torch_dispatch__`` runs first (the tracer declines its ops,
:attr:`~memcalc.engine.trace.StorageTracer.defer_to`), so every op reaches it as the local op
the rank runs, collectives included, at their output's size. DTensor's sharding propagation
runs with the tracer set aside
(:func:`~memcalc.distributed.dtensor_upkeep.propagation_untraced`): a real rank allocates
nothing for it.

Real two-process gloo runs of the same plans agree with the per-rank estimate to the byte
(tests/test_gloo_tp.py), ``loss_parallel`` included (its handler's sum in backward is no in-place
gradient sum: :func:`memcalc.targets.autograd.called_by_the_engine`). Rank 0
holds the largest shards (``torch.chunk``), so it is the default rank traced.

A plan that leaves some trainable parameters plain tensors beside DTensors is refused by name
under foreach or fused optimizers, as the real run would fail. The optimizer steps each
parameter's local shard directly (:meth:`TensorParallel.optimizer_spec`), which allocates the
same as DTensor's dispatch without its cost.

The program leaves everything as it was: the model's parameters and hooks, the default process
group; DTensor's sharding caches are emptied before and after
(:func:`~memcalc.distributed.dtensor_upkeep.clear_dtensor_caches`).

The full account: docs/notes/tensor-parallel.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.loop import OptimizerImpl
from memcalc.distributed.dtensor_upkeep import (
    clear_dtensor_caches,
    propagation_untraced,
    restore_modules,
    snapshot_modules,
)
from memcalc.distributed.program import RankProgram
from memcalc.distributed.tp_plans import TpPlan, resolve_plan
from memcalc.engine.model import ResolvedModel
from memcalc.engine.optimizers import Factory, OptimizerSpec, Params
from memcalc.engine.trace import StorageTracer
from memcalc.targets.cpu.gloo import GLOO_STAGING

__all__ = ("COLLECTIVE_OPS", "TensorParallel", "mix_refused_by", "parallelized", "refused_mix",
           "tensor_parallel")

#: The namespace of the functional collectives DTensor's redistribution calls: their outputs
#: are the rank's communication buffers.
COLLECTIVE_OPS = "_c10d_functional."


class TensorParallel(RankProgram):
    """Rank ``rank`` of ``degree``-way tensor parallelism under ``plan``.

    Args:
        degree: the tensor-parallel degree (ranks of the ``tp`` mesh dimension).
        plan: module-name pattern → transformers style string; None: the model's own plan
            (:func:`memcalc.distributed.tp_plans.resolve_plan`).
        rank: the rank traced (0: the one with the largest shards).
        model_name: names the model in errors.
        optimizer_impl: the optimizer's implementation, resolved for the target (None: not
            checked): foreach and fused are refused when the plan leaves trainable
            parameters plain tensors.
        loss_parallel: keep the logits sharded over the vocabulary and compute the
            cross-entropy under torch's ``loss_parallel()`` (torchtitan's Llama plan only).
        mesh: the tp sub-mesh of a process group someone else made (a pipeline's ``(pp, tp)``
            mesh, :mod:`memcalc.distributed.tp_stages`), called at install; None: a fake group of
            ``degree`` ranks of the program's own. A resolved :class:`TpPlan` is then taken as it is.
        expert_parallel: tp beside ep (tp × ep): the modules the ep plan shards keep no tp rule
            (:func:`memcalc.distributed.tp_plans.without_expert_rules`).
    """

    def __init__(self, degree: int, plan: Mapping[str, str] | TpPlan | None = None, *, rank: int = 0,
                 model_name: str = "the model", optimizer_impl: OptimizerImpl | None = None,
                 loss_parallel: bool = False, local_step: bool = True,
                 mesh: Callable[[], Any] | None = None, expert_parallel: bool = False) -> None:
        super().__init__()
        if degree < 1:
            raise InvalidInputError(f"the tensor-parallel degree must be at least 1, got {degree}")
        if not 0 <= rank < degree:
            raise InvalidInputError(f"rank {rank} is not one of the {degree} tensor-parallel ranks")
        self.degree = degree
        self.plan_strings = dict(plan) if plan is not None and not isinstance(plan, TpPlan) else None
        self.expert_parallel = expert_parallel
        self.fixed_plan = plan if isinstance(plan, TpPlan) else None
        self.mesh = mesh
        self.rank = rank
        self.model_name = model_name
        self.optimizer_impl = optimizer_impl
        self.loss_parallel = loss_parallel
        self.local_step = local_step
        self.plan: TpPlan | None = None

    def optimizer_spec(self, spec: OptimizerSpec) -> OptimizerSpec:
        """The user's optimizer over the local shards of the DTensor parameters (module
        docstring); ``local_step=False``: over the DTensors, as the real run steps them."""
        factory = spec.factory
        if factory is None or not self.local_step:
            return spec

        def build(params: Params, impl: OptimizerImpl) -> torch.optim.Optimizer:
            return _on_local_shards(factory, list(params), impl)

        return replace(spec, factory=build)

    def install(self, tracer: StorageTracer, module: nn.Module) -> None:
        super().install(tracer, module)
        try:
            self._parallelize(tracer, module)
        except BaseException:
            self.remove()  # the engine removes a program only once installed
            raise

    def _parallelize(self, tracer: StorageTracer, module: nn.Module) -> None:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import parallelize_module

        self.plan = plan = self.fixed_plan or resolve_plan(module, self.plan_strings, self.model_name,
                                                           loss_parallel=self.loss_parallel,
                                                           expert_parallel=self.expert_parallel)
        if self.mesh is None:
            mesh = self._fake_mesh()
        else:
            clear_dtensor_caches()
            self._undo.append(clear_dtensor_caches)
            mesh = self.mesh()
        self._undo.append(functools.partial(restore_modules, snapshot_modules(module)))
        try:
            parallelize_module(module, mesh, dict(plan.styles), src_data_rank=None)
        except (NotImplementedError, ValueError, RuntimeError, AssertionError) as exc:  # a style on the wrong module
            raise InvalidInputError(
                f"torch's parallelize_module refused the tensor-parallel plan ({plan.source}) on {self.model_name}: "
                f"{type(exc).__name__}: {exc}",
                hint="colwise and rowwise styles apply to nn.Linear and nn.Embedding modules, sequence_parallel to "
                     "norms; name those modules in the plan.") from exc
        self._check_optimizer(module)
        tracer.defer_to = (DTensor,)
        self._undo.append(functools.partial(setattr, tracer, "defer_to", ()))
        self._undo.append(propagation_untraced())
        if self.loss_parallel:  # its handlers act on DTensor's loss ops only: entered for the whole step
            from torch.distributed.tensor.parallel import loss_parallel

            stack = ExitStack()
            stack.enter_context(loss_parallel())
            self._undo.append(stack.close)
        self.notes.append(f"tensor parallel over {self.degree} ranks (torch's parallelize_module), rank {self.rank}'s "
                          f"shards; plan: {plan.source}, {len(plan.styles)} entries")

    def remove(self) -> None:
        tracer = self.tracer
        if tracer is not None:  # the collectives' outputs (and gloo's staging): the rank's communication buffers
            ops = tracer.trace.op
            buffers = (COLLECTIVE_OPS, GLOO_STAGING)
            self.communication.update(uid for uid, op in enumerate(ops) if op.startswith(buffers))
        super().remove()

    def _check_optimizer(self, module: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        trainable = {name: isinstance(p, DTensor) for name, p in module.named_parameters() if p.requires_grad}
        impl = self.optimizer_impl
        plain = refused_mix(impl, trainable)
        if plain and impl is not None:
            shown = ", ".join(plain[:4]) + (f" and {len(plain) - 4} more" if len(plain) > 4 else "")
            raise InapplicableOptionError(
                f"the tensor-parallel plan ({self.plan.source if self.plan else ''}) leaves {len(plain)} trainable "
                f"parameters of {self.model_name} plain tensors beside DTensors ({shown}): torch's "
                f"{impl.value} optimizer refuses that mix (aten._foreach_* ops)",
                hint="Give those modules a style in the plan (norms: 'sequence_parallel'), or step the optimizer "
                     "one parameter at a time: Loop(optimizer_impl='for-loop').")

    def _fake_mesh(self) -> Any:
        """A one-dimensional mesh over torch's fake process group, torn down by :meth:`remove`."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise InapplicableOptionError(
                "tensor parallelism is estimated over a fake process group of memcalc's own, and this process has a "
                "default process group already",
                hint="Run the estimate in a process without torch.distributed initialized (before "
                     "init_process_group, or after destroy_process_group).")
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.degree)
        self._undo.append(_destroy_fake_group)
        clear_dtensor_caches()
        return DeviceMesh("cpu", torch.arange(self.degree), mesh_dim_names=("tp",))


def mix_refused_by(impl: OptimizerImpl | None) -> bool:
    """Whether torch's optimizer of implementation ``impl`` refuses plain tensors beside DTensors
    (:func:`refused_mix`): foreach and fused do."""
    return impl in (OptimizerImpl.FOREACH, OptimizerImpl.FUSED)


def refused_mix(impl: OptimizerImpl | None, trainable: Mapping[str, bool]) -> list[str]:
    """The trainable parameters (name → whether it is a DTensor) that torch's optimizer of
    implementation ``impl`` refuses as plain tensors beside DTensors, all of them; [] when it steps
    them. foreach and fused step lists of tensors with ``aten._foreach_*`` ops, which refuse the mix
    of a plan that distributes some parameters and leaves others plain (a Hugging Face plan's norms);
    the for-loop steps one at a time. The one rule of :meth:`TensorParallel._check_optimizer` (on the
    parallelized module) and of :func:`memcalc.search.plan_refusals.plain_beside_dtensors` (foreseen
    from the plan's styles, before any trace)."""
    if not mix_refused_by(impl):
        return []
    plain = [name for name, distributed in trainable.items() if not distributed]
    return plain if len(plain) < len(trainable) else []


def _on_local_shards(factory: Factory, params: list[nn.Parameter], impl: OptimizerImpl) -> torch.optim.Optimizer:
    """``factory``'s optimizer over each DTensor parameter's local tensor (a plain one as it is).

    Before each step the local tensors get their DTensor gradient's local tensor — where every
    gradient has its parameter's placements. Where one does not (DTensor would redistribute it
    inside each foreach op), the step runs on the DTensors themselves, as the real one does.
    ``zero_grad`` clears both, so that the DTensor gradients are freed when the real ones would be.
    """
    from torch.distributed.tensor import DTensor

    pairs = [(p, p._local_tensor) for p in params if isinstance(p, DTensor)]
    local = {id(p): p._local_tensor for p in params if isinstance(p, DTensor)}
    optimizer = factory([local.get(id(p), p) for p in params], impl)  # type: ignore[misc]  # plain leaves
    groups = [list(group["params"]) for group in optimizer.param_groups]
    owners: dict[int, nn.Parameter] = {}  # a local tensor's DTensor parameter (the first, were one shared)
    for parameter, shard in pairs:
        owners.setdefault(id(shard), parameter)
    globals_ = [[owners.get(id(q), q) for q in group] for group in groups]

    def gradients(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        on_local = all(parameter.grad is None or (isinstance(parameter.grad, DTensor)
                                                  and parameter.grad.placements == parameter.placements)
                       for parameter, _ in pairs)
        for group, shards, whole in zip(optimizer.param_groups, groups, globals_, strict=True):
            group["params"] = shards if on_local else whole
        for parameter, shard in pairs:
            grad = parameter.grad
            shard.grad = grad._local_tensor if on_local and isinstance(grad, DTensor) else None

    optimizer.register_step_pre_hook(gradients)
    base = type(optimizer)

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        base.zero_grad(self, set_to_none)
        if set_to_none:
            for parameter, shard in pairs:
                parameter.grad = None
                shard.grad = None

    optimizer.__class__ = type(f"LocalShards{base.__name__}", (base,), {"zero_grad": zero_grad})
    return optimizer


def tensor_parallel(degree: int, plan: Mapping[str, str] | None = None, *, rank: int = 0,
                    optimizer_impl: OptimizerImpl | None = None,
                    loss_parallel: bool = False) -> Callable[[ResolvedModel], RankProgram]:
    """The program factory a mesh's ``tp`` dimension gives a role: ``TensorParallel`` on each
    role's resolved model."""

    def program(resolved: ResolvedModel) -> RankProgram:
        return TensorParallel(degree, plan, rank=rank, model_name=resolved.name, optimizer_impl=optimizer_impl,
                              loss_parallel=loss_parallel)

    return program


@contextmanager
def parallelized(module: nn.Module, mesh: Any, styles: Mapping[str, Any]) -> Iterator[None]:
    """``module`` parallelized by torch's own ``parallelize_module`` over ``mesh`` for a dry run
    (a pipeline stage's shapes as its rank sees them), then put back as it was."""
    from torch.distributed.tensor.parallel import parallelize_module

    snapshot = snapshot_modules(module)
    clear_dtensor_caches()
    try:
        parallelize_module(module, mesh, dict(styles), src_data_rank=None)
        yield
    finally:
        restore_modules(snapshot)
        clear_dtensor_caches()


def _destroy_fake_group() -> None:
    clear_dtensor_caches()
    if dist.is_initialized():
        dist.destroy_process_group()

"""Expert parallelism inside every pipeline stage (``--mesh pp=P,ep=E``), as torchtitan composes
them for its MoE models (``torchtitan/models/deepseek_v3/infra/parallelize.py``: the model is split
into stages by ``pipeline_llm``, then each stage's module goes through the model's ``parallelize_fn``,
whose ``apply_moe_ep_tp`` shards the experts of the blocks the stage holds over the ``ep`` sub-mesh;
then each stage is wrapped in a ``PipelineStage`` over the ``pp`` sub-mesh's group).

memcalc's expert parallelism is transformers' (``apply_expert_parallelism`` with its ``AllToAllEP``,
:mod:`memcalc.distributed.expert_parallel`): its plan is expanded once on the whole model and applied
on each stage to the experts modules the stage holds, over the ``ep`` ranks of the pipeline rank
(innermost of the fake group's mesh, :func:`~memcalc.distributed.pipeline.stage_mesh`). The stage's
dry runs (its shapes) run with the experts sharded and the split sizes answered from the routing
assumption, as the traced step does. Each pipeline rank's ep rank 0 is traced (balanced routing: every
ep rank alike; under the worst case, the one every pair goes to). With dp_shard, FSDP2 wraps each stage
as :func:`~memcalc.distributed.strategy.dp_shard.fsdp_program` wraps an MoE model, its experts units
named by :meth:`StageExpertParallel.experts_paths`. With tp too (``--mesh pp=P,tp=T,ep=E``),
:class:`StageExpertTensorParallel`: each stage's dense part under tp's plan on the tp sub-mesh, its
experts over all ``ep × tp`` ranks of the pipeline rank (transformers' ``ep_size = fsdp_size ×
tp_size``, torchtitan's ``etp=1``), as :func:`~memcalc.distributed.expert_parallel.expert_tensor_parallel`
composes them without a pipeline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from memcalc.core.loop import OptimizerImpl
from memcalc.distributed.dtensor_upkeep import clear_dtensor_caches, restore_modules, snapshot_modules
from memcalc.distributed.expert_parallel import ExpertParallel, expert_plan, routing_text, split_sizes
from memcalc.distributed.pipeline import stage_mesh
from memcalc.distributed.program import RankProgram, StackedProgram
from memcalc.distributed.tensor_parallel import TensorParallel
from memcalc.distributed.tp_plans import stage_plan
from memcalc.distributed.tp_stages import StageTensorParallel
from memcalc.distributed.vocabulary import Routing
from memcalc.engine.model import ModelInputs, ResolvedModel
from memcalc.engine.trace import StorageTracer

__all__ = ("StageExpertParallel", "StageExpertTensorParallel", "replicated_expert_notes")


class StageExpertParallel:
    """``degree``-way expert parallelism of every stage of a pipeline rank (its ep rank 0), the
    split sizes answered by ``routing`` (and ``capacity_factor``). ``tp``: that many of the
    ``degree`` ranks are tensor-parallel ranks sharing a batch (innermost), the experts over all
    ``degree`` (:class:`StageExpertTensorParallel`)."""

    def __init__(self, degree: int, routing: Routing = Routing.BALANCED, capacity_factor: float | None = None,
                 tp: int = 1) -> None:
        self.degree = degree
        self.routing = routing
        self.capacity_factor = capacity_factor
        self.tp = tp
        self._plan: dict[str, str] | None = None
        self._name = "the model"

    def resolve(self, model: nn.Module, inputs: ModelInputs, name: str) -> None:
        """The model's expert-parallel plan, expanded on the whole model.

        Raises:
            InapplicableOptionError: the model has no expert-parallel plan.
        """
        self._plan = expert_plan(model, self.degree, name)
        self._name = name

    def stage_plan(self, module: nn.Module, prefix: str) -> dict[str, str]:
        """The plan's entries for what ``module`` holds (its modules are the model's under ``prefix``)."""
        assert self._plan is not None, "resolve() first"
        present = {name for name, _ in module.named_modules()} | {name for name, _ in module.named_parameters()}
        return {prefix + name: style for name, style in self._plan.items() if prefix + name in present}

    def experts_paths(self, stage: ResolvedModel) -> list[str]:
        """The experts modules a stage holds, by their paths in its module (under ``model.``):
        the units FSDP2 shards over dp_shard under ``pp × dp_shard × ep``."""
        return [path for path, style in self.stage_plan(stage.module, "model.").items()
                if style == "ep_dispatch_experts"]

    def applied(self, module: nn.Module, prefix: str) -> AbstractContextManager[None]:
        """``module`` with its experts sharded and its split sizes answered, for a dry run."""
        return self._applied(module, prefix)

    @contextmanager
    def _applied(self, module: nn.Module, prefix: str) -> Iterator[None]:
        from torch.distributed.tensor import DTensor
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        plan = self.stage_plan(module, prefix)
        snapshot = snapshot_modules(module)
        saved = {id(m): (m, dict(vars(m))) for m in module.modules()}
        clear_dtensor_caches()
        previous = _reader_in_use()
        answering = StorageTracer("meta", read_values=functools.partial(
            split_sizes, degree=self.degree, rank=0, routing=self.routing, capacity_factor=self.capacity_factor,
            previous=previous))
        answering.defer_to = (DTensor,)
        try:
            with ExitStack() as stack:
                ep_mesh, tp_mesh = expert_meshes(self.tp)
                apply_expert_parallelism(module, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
                stack.enter_context(answering)
                yield
        finally:
            restore_modules(snapshot)
            for m, attributes in saved.values():  # the forwards and marks apply_expert_parallelism set
                vars(m).clear()
                vars(m).update(attributes)
            clear_dtensor_caches()

    def program(self, stage: ResolvedModel) -> RankProgram:
        """The program of one stage's module (the model under ``model.``)."""
        return ExpertParallel(self.degree, routing=self.routing, capacity_factor=self.capacity_factor,
                              model_name=stage.name, meshes=functools.partial(expert_meshes, self.tp),
                              plan=self.stage_plan(stage.module, "model."), tp=self.tp)


class StageExpertTensorParallel:
    """tp × ep inside every stage of a pipeline rank (its rank 0 of ``ep · tp``): tp's plan on the
    dense part over the tp sub-mesh, the experts over all ``ep · tp`` ranks (``experts``, made with
    ``tp``). The pipeline sees one inner dimension of ``ep · tp`` ranks."""

    def __init__(self, experts: StageExpertParallel, strings: dict[str, str] | None, *,
                 optimizer_impl: OptimizerImpl | None = None) -> None:
        self.experts = experts
        self.degree = experts.degree
        self.routing = experts.routing
        self.capacity_factor = experts.capacity_factor
        self.tensor = StageTensorParallel(experts.tp, strings, functools.partial(_tp_mesh, experts.tp),
                                          optimizer_impl=optimizer_impl, expert_parallel=True)

    def resolve(self, model: nn.Module, inputs: ModelInputs, name: str) -> None:
        """Both plans on the whole model (tp's refuses an uneven split)."""
        self.experts.resolve(model, inputs, name)
        self.tensor.resolve(model, inputs, name)

    def experts_paths(self, stage: ResolvedModel) -> list[str]:
        return self.experts.experts_paths(stage)

    def applied(self, module: nn.Module, prefix: str) -> AbstractContextManager[None]:
        """``module`` with its experts sharded and tp's plan applied, for a dry run."""
        return self._applied(module, prefix)

    @contextmanager
    def _applied(self, module: nn.Module, prefix: str) -> Iterator[None]:
        with self.tensor.applied(module, prefix), self.experts.applied(module, prefix):
            yield

    def program(self, stage: ResolvedModel) -> RankProgram:
        """Expert parallelism's program, then tp's on the same group (one optimizer wrapper: expert
        parallelism's steps every DTensor's local shard)."""
        tensor = TensorParallel(self.tensor.degree, stage_plan(self.tensor.plan, stage.module, "model."),
                                model_name=stage.name, optimizer_impl=self.tensor.optimizer_impl, local_step=False,
                                mesh=self.tensor.mesh)
        return StackedProgram(self.experts.program(stage), tensor)


def replicated_expert_notes(degree: int, routing: Routing, capacity_factor: float | None, tp: int = 1) -> str:
    """The report's note on ``degree``-way expert parallelism inside pipeline stages under HSDP's
    dp_replicate without dp_shard (``tp``-way tensor parallelism beside it): torchtitan's ep borrows
    its dp_shard (``dp_shard_mod_ep`` = 1) and ``apply_fsdp`` wraps every MoE stage, so each block's
    experts are FSDP2 units over a one-rank shard group and the rest over the ep ranks."""
    experts = (f"each block's experts over all ep x tp = {degree * tp} ranks (etp=1), the dense part under tp's plan "
               f"over the {tp} tp ranks that share a batch; " if tp > 1 else "")
    return (f"expert parallelism over {degree} ranks inside every stage: each holds 1/{degree * tp} of the stage's "
            f"MoE layers' experts (their gradients and optimizer state) and a batch of its own; tokens move by "
            f"all-to-all under {routing_text(routing, capacity_factor)}; ep rank 0 traced; {experts}FSDP2 of each "
            f"stage as torchtitan shards MoE models under dp_replicate without dp_shard (its ep borrows its dp_shard: "
            f"dp_shard_mod_ep = 1): each block's experts over a one-rank shard group (no collective), the rest over "
            f"the {degree} ep ranks")


def expert_meshes(tp: int = 1) -> tuple[Any, Any]:
    """The expert-parallel and tp sub-meshes of the current pipeline rank's fake group: the inner
    dimension of the pipeline's ``(pp, inner)`` mesh is ``(inner / tp, tp)``, the experts over all
    of it (tp = 1: its ``(ep, tp=1)`` sub-meshes)."""
    mesh = _stage_meshes(tp)
    return (mesh["ep"] if tp == 1 else mesh["ep", "tp"]._flatten("ep_tp")), mesh["tp"]


def _tp_mesh(tp: int) -> Any:
    return _stage_meshes(tp)["tp"]


def _stage_meshes(tp: int) -> Any:
    """The ``(pp, ep, tp)`` mesh over the current pipeline rank's fake group."""
    from torch.distributed.device_mesh import DeviceMesh

    pp, inner = stage_mesh("pp").size(), stage_mesh("tp").size()
    return DeviceMesh("cpu", torch.arange(pp * inner).view(pp, inner // tp, tp), mesh_dim_names=("pp", "ep", "tp"))


def _reader_in_use() -> Callable[[torch.Tensor], Any] | None:
    """The read oracle of the innermost storage tracer active, if any (the step's: the model's own reads)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, StorageTracer) and mode.read_values is not None:
            return mode.read_values
    return None

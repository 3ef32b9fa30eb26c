"""Tensor parallelism inside every pipeline stage (``--mesh pp=P,tp=T``), as torchtitan composes
them (``torchtitan/distributed/pipeline_parallel.py`` then ``models/llama3/infra/parallelize.py``):
the model is split into stages, then each stage's module is parallelized by torch's own
``parallelize_module`` over the ``tp`` sub-mesh of a ``(pp, tp)`` device mesh, then wrapped in a
``PipelineStage`` over the ``pp`` sub-mesh's group.

The plan is resolved once on the whole model (the user's patterns checked against its modules,
torchtitan's Llama plan recognised by its layout) and applied on each stage to the modules it
holds (:func:`~memcalc.distributed.tp_plans.stage_plan`). A stage's shapes come from dry runs of
the parallelized modules (:meth:`StageTensorParallel.applied`): what a stage sends is the local
tensor its last block returns, ``(b, s/tp, d)`` under sequence parallelism, as a real stage's is.

Each pipeline rank's tp rank 0 is traced (``torch.chunk``: the largest shards); a plan that
splits a parameter or the sequence unevenly is refused by name, as is ``loss_parallel``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from memcalc.core.errors import InapplicableOptionError
from memcalc.core.loop import OptimizerImpl
from memcalc.distributed.program import RankProgram
from memcalc.distributed.tensor_parallel import TensorParallel, parallelized
from memcalc.distributed.tp_plans import TpPlan, planned_modules, resolve_plan, stage_plan
from memcalc.engine.model import ModelInputs, ResolvedModel

__all__ = ("StageTensorParallel",)


class StageTensorParallel:
    """``degree``-way tensor parallelism of every stage of a pipeline rank (its tp rank 0).

    Args:
        degree: the tp degree.
        strings: the user's plan (module-name pattern → transformers style string); None: the
            model's own, else torchtitan's for the zoo's Llama layout.
        mesh: the current rank's tp sub-mesh (the pipeline's fake group makes it), called when a
            stage is parallelized.
        optimizer_impl: the optimizer's implementation (foreach and fused refuse a plan that
            leaves trainable parameters plain beside DTensors); None: not checked (under FSDP2).
        expert_parallel: under ep (tp × ep), the ep plan's modules keep no tp rule.
    """

    def __init__(self, degree: int, strings: Mapping[str, str] | None, mesh: Callable[[], Any], *,
                 optimizer_impl: OptimizerImpl | None = None, expert_parallel: bool = False) -> None:
        self.degree = degree
        self.expert_parallel = expert_parallel
        self.strings = dict(strings) if strings is not None else None
        self.mesh = mesh
        self.optimizer_impl = optimizer_impl
        self._plan: TpPlan | None = None

    @property
    def plan(self) -> TpPlan:
        """The plan on the whole model (:meth:`resolve` first)."""
        assert self._plan is not None, "resolve() first"
        return self._plan

    def resolve(self, model: nn.Module, inputs: ModelInputs, name: str) -> None:
        """Resolve the plan on the whole ``model`` (at one microbatch's ``inputs``).

        Raises:
            InapplicableOptionError: a split the traced tp rank 0 would not stand for.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
        self._plan = plan = resolve_plan(model, self.strings, name, expert_parallel=self.expert_parallel)
        n = self.degree
        uneven: list[object] = [p for m in planned_modules(model, plan) for p in m.parameters(recurse=False)
                  if any(size % n for size in p.shape[:2])]
        sequence = any(isinstance(style, SequenceParallel) or (isinstance(style, (ColwiseParallel, RowwiseParallel))
                                                                and _shards_sequence(style))
                       for style in plan.styles.values())
        if sequence:
            uneven.extend(t for t in inputs if hasattr(t, "shape") and len(t.shape) > 1 and t.shape[1] % n)
        if uneven:
            raise InapplicableOptionError(
                f"tp={n} inside pipeline stages splits {name} unevenly (a planned dimension or the sequence does not "
                f"divide by {n}): memcalc traces each stage's tp rank 0 and does not model the smaller last rank "
                f"there yet",
                hint="Choose a tp degree that divides the planned dimensions and the sequence length.")

    def applied(self, module: nn.Module, prefix: str) -> AbstractContextManager[None]:
        """``module`` (the whole model, or a stage whose modules are the model's under
        ``prefix``) parallelized for a dry run, then put back."""
        return parallelized(module, self.mesh(), stage_plan(self.plan, module, prefix).styles)

    def program(self, stage: ResolvedModel) -> RankProgram:
        """The program of one stage's module (a :class:`~memcalc.distributed.pipeline_split.StageModule`,
        the model under ``model.``)."""
        return TensorParallel(self.degree, stage_plan(self.plan, stage.module, "model."), model_name=stage.name,
                              optimizer_impl=self.optimizer_impl, mesh=self.mesh)


def _shards_sequence(style: object) -> bool:
    layouts: list[object] = []
    for attribute in ("input_layouts", "output_layouts"):
        value = getattr(style, attribute, ())
        layouts.extend(value if isinstance(value, (tuple, list)) else (value,))
    return any(getattr(layout, "dim", None) == 1 for layout in layouts)

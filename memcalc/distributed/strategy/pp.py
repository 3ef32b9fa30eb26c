"""``pp``: pipeline parallelism, each pipeline rank estimated by running torch's own
``PipelineStage`` and schedule (:mod:`memcalc.distributed.pipeline`) on the meta model over a
fake process group: the microbatches in flight, the receive buffers, the gradients accumulated
over the microbatches and the optimizer step after the last. Every pipeline rank is a role
(the first holds the embedding, the last the head and the loss), the busiest one reported.

A pipeline rank does not run one traced step but a schedule, so this dimension estimates the
whole step itself (``whole_step``) and composes with no other dimension yet.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.core.report import MemoryReport, Shard
from memcalc.distributed.pipeline import Pipeline, estimate_pipeline
from memcalc.distributed.strategy.base import Plan, RankStrategy, register
from memcalc.engine.options import Step
from memcalc.engine.run import CostRecorderFactory

__all__ = ("PipelineParallel",)


@register()
class PipelineParallel(RankStrategy):
    """The model split into stages over ``pp`` ranks, run under a pipeline schedule."""

    name = "pp"
    mesh_dimension = "pp"
    options = frozenset({"pp_schedule", "microbatches", "pp_split"})
    whole_step = True
    planned = False  # the pipeline bubble and the stage sends are not in plan's cost model yet

    @property
    def pipeline(self) -> Pipeline:
        """The pipeline of this setting (schedule 1F1B and one microbatch per rank by default)."""
        setting = self.distributed
        schedule = setting.pp_schedule
        return Pipeline(self.degree, schedule if schedule is not None else "1f1b",
                        microbatches=setting.microbatches, split_points=setting.pp_split)

    def plan(self, plan: Plan, step: Step) -> Plan:
        """Not used: a pipeline estimates its whole step (:meth:`estimate`)."""
        raise NotImplementedError("a pipeline estimates its whole step (whole_step)")

    def estimate(self, step: Step, batch: int, costs: CostRecorderFactory | None) -> MemoryReport:
        pipeline = self.pipeline
        estimate = estimate_pipeline(replace(step, batch_size=batch), pipeline, costs=costs)
        shard = (Shard(("blocks",), self.name, self.degree),)
        report = estimate.as_report()
        # every pipeline rank runs the whole batch, microbatch by microbatch (a later stage's own
        # report counts the microbatch its stand-in input was built at)
        roles = tuple(replace(role, sharding=shard, batch_size=batch) for role in report.roles)
        notes = (*report.notes, f"pipeline: {pipeline.describe()}, schedule from the installed torch")
        return replace(report, roles=roles, notes=notes, batch_size=batch)

"""The device mesh of the Trainer's ``parallelism_config`` laid over the multi-GPU setting the
user (``--mesh``, ``--strategy``) or a launch file (``--accelerate-config``) gave:
:func:`with_trainer_mesh`.

accelerate runs a ``ParallelismConfig`` under FSDP2 (``distributed_type: FSDP``,
``fsdp_version: 2``: FSDP2 over ``dp_shard × cp``) or, tp alone, under MULTI_GPU (no DDP wrapper
then: ``prepare_model`` skips DDP when tp is enabled); a file's FSDP2 settings (``sharding``) are
kept. Anything else is refused by name: a mesh that disagrees with ``--mesh``, dp_shard or cp under
DDP (accelerate then wraps DDP over every process, or refuses cp without FSDP2), FSDP2 with
nothing to shard (accelerate's own refusal), DeepSpeed (its tensor / sequence parallelism is
DeepSpeed's), and tp on a model without its own Hugging Face tp plan (accelerate's tp is the plan
``from_pretrained(tp_plan="auto")`` applies; memcalc would use another). The Trainer's loop (its
own, TRL's) is then estimated under the mesh where it is modelled: dp_shard alone (FSDP2) or
dp_replicate alone (DDP); memcalc.estimation refuses the others by name.
"""

from __future__ import annotations

from memcalc.core.errors import InapplicableOptionError
from memcalc.distributed.setting import Distributed
from memcalc.distributed.tp_plans import hf_plan
from memcalc.distributed.vocabulary import Strategy
from memcalc.engine.step_spec import Step

__all__ = ("check_plan_source", "with_trainer_mesh")

_WHERE = "TrainingArguments parallelism_config"


def with_trainer_mesh(step: Step, distributed: Distributed | None) -> Distributed:
    """``distributed`` with the mesh of ``step``'s Trainer arguments (unchanged without one)."""
    given = distributed or Distributed()
    record = step.trainer_args
    if record is None or not record.mesh:
        return given
    mesh = dict(record.mesh)
    spelled = ",".join(f"{name}={degree}" for name, degree in record.mesh)
    world = 1
    for degree in mesh.values():
        world *= degree
    if given.mesh is not None and given.mesh.used == mesh:
        return given  # --mesh (or --strategy) says the same: its own settings (tp plan, batch) kept
    if given.is_single:
        out = Distributed(mesh=mesh)
    elif given.world_size != world:
        raise InapplicableOptionError(f"{_WHERE} (mesh {spelled}, {world} GPUs) disagrees with the "
                                      f"{given.world_size} GPUs of --strategy {given.strategy.value}",
                                      hint="accelerate refuses a total_size other than num_processes; make them "
                                           "agree, or leave out one of them.")
    elif given.strategy is Strategy.FSDP:
        if "dp_shard" not in mesh and "cp" not in mesh:
            raise InapplicableOptionError(f"{_WHERE} (mesh {spelled}) under FSDP2 leaves FSDP no dimension to "
                                          f"shard across (dp_shard_size and cp_size 1): accelerate refuses it",
                                          hint="Give dp_shard_size > 1, or launch without FSDP.")
        out = Distributed(mesh=mesh, sharding=given.sharding)
    elif given.strategy is Strategy.DDP and set(mesh) == {"tp"}:
        out = Distributed(mesh=mesh)  # accelerate's prepare_model wraps no DDP when tp is enabled
    else:
        raise InapplicableOptionError(_refusal(given, spelled),
                                      hint="Launch with FSDP2 (distributed_type FSDP, fsdp_version 2), as "
                                           "accelerate's ParallelismConfig expects.")
    check_plan_source(step, out, _WHERE)
    return out


def _refusal(given: Distributed, spelled: str) -> str:
    if given.strategy is Strategy.DDP:
        return (f"{_WHERE} (mesh {spelled}) under DDP (MULTI_GPU) is not modelled: accelerate wraps DDP over every "
                f"process, not FSDP2 over dp_shard, and refuses cp without FSDP2")
    return (f"{_WHERE} (mesh {spelled}) under --strategy {given.strategy.value} is not modelled: under DeepSpeed "
            f"accelerate leaves tensor and sequence parallelism to DeepSpeed (autotp, Ulysses)")


def check_plan_source(step: Step, distributed: Distributed, where: str) -> None:
    """accelerate's tp is the model's own plan (``from_pretrained(tp_plan="auto")``), so memcalc's
    must be too: its ``hf_plan``, not torchtitan's for the zoo's plain-torch Llama (a plan given
    with ``tp_plan`` is the user's own, kept)."""
    tp = 1 if distributed.mesh is None else distributed.mesh.tp
    if tp < 2 or distributed.tp_plan is not None:
        return
    module = step.resolved(1).module  # the plan depends on the modules, not the batch
    if hf_plan(module) is None:
        raise InapplicableOptionError(f"{where} tp_size={tp}: accelerate tensor-parallelises the model "
                                      f"from_pretrained(tp_plan='auto', ...) loaded, with its own Hugging Face "
                                      f"tp_plan; {type(module).__name__} has none",
                                      hint="Give a transformers model with a tp_plan (hf:...), or the plan with "
                                           "--mesh ...,tp=N --tp-plan.")

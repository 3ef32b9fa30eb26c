"""The multi-GPU options of ``memcalc MODEL`` (and of any command that estimates a step):
``--strategy``, ``--mesh``, ``--world-size``, ``--device-ids``, ``--global-batch/--per-rank-batch``,
``--bucket-cap-mb``, ``--gradient-as-bucket-view``, ``--fsdp-sharding``, ``--reduce-bucket-size``,
``--pp-schedule``, ``--microbatches``, ``--pp-split``, ``--tp-plan``, ``--loss-parallel``, ``--routing``,
``--capacity-factor``.
:func:`strategy_options` adds them to a click command;
:func:`strategy_arguments` checks them (bad combinations are usage errors) and returns the
:class:`memcalc.Distributed` setting as :func:`memcalc.estimate`'s ``distributed`` keyword —
so ``memcalc fit`` can take the same options and hand them to ``max_batch_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from memcalc.cli.options import given
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.distributed.launch.read import read_launch
from memcalc.distributed.launch.setup import LaunchSetup
from memcalc.distributed.mesh import DIMENSION_NAMES, Mesh, parse_mesh
from memcalc.distributed.pipeline_schedules import PipelineSchedule
from memcalc.distributed.setting import (
    DEEPSPEED_REDUCE_BUCKET_SIZE,
    DEFAULT_BUCKET_CAP_MB,
    Distributed,
    FsdpSharding,
    Routing,
    Strategy,
    inapplicable_option,
)

__all__ = ("DeviceIdsType", "MeshType", "TpPlanType", "launch_arguments", "strategy_arguments", "strategy_options")


class DeviceIdsType(click.ParamType[tuple[int, ...]]):
    """``0,1,2,3`` → ``(0, 1, 2, 3)``; each a CUDA device number, none repeated."""

    name = "ids"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        """Parse ``value``; a tuple is already a list of ids; a usage error otherwise."""
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            self.fail(f"{value!r} is not a list of CUDA device numbers; give e.g. 0,1,2,3", param, ctx)
        ids = tuple(int(p) for p in parts)
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            self.fail(f"device ids repeat ({', '.join(map(str, repeated))} in {value}): each GPU can hold one "
                      f"replica; give e.g. 0,1,2,3", param, ctx)
        return ids


class MeshType(click.ParamType[dict[str, int]]):
    """``dp_shard=8,tp=4`` → ``{"dp_shard": 8, "tp": 4}`` (:func:`memcalc.distributed.mesh.parse_mesh`);
    a usage error naming the dimension or the degree otherwise."""

    name = "mesh"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, int]:
        """Parse ``value``; a dict is already a mesh."""
        if isinstance(value, dict):
            return value
        try:
            return parse_mesh(str(value))
        except InvalidInputError as exc:
            self.fail(str(exc), param, ctx)


class TpPlanType(click.ParamType[dict[str, str]]):
    """``mlp.up_proj=colwise,mlp.down_proj=rowwise`` → ``{"mlp.up_proj": "colwise", ...}``: module-name
    patterns (``*`` for one name) and transformers' style strings, checked against the model."""

    name = "plan"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, str]:
        """Parse ``value``; a dict is already a plan."""
        if isinstance(value, dict):
            return value
        plan: dict[str, str] = {}
        for item in (part.strip() for part in str(value).split(",")):
            pattern, equals, style = (x.strip() for x in item.partition("="))
            if not equals or not pattern or not style:
                self.fail(f"the tp plan item {item!r} is not PATTERN=STYLE; give e.g. "
                          f"'layers.*.fc1=colwise,layers.*.fc2=rowwise'", param, ctx)
            if pattern in plan:
                self.fail(f"the tp plan names {pattern} twice; give each pattern once", param, ctx)
            plan[pattern] = style
        return plan


def _at_least_one(_ctx: click.Context, _param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise click.BadParameter(f"the world size is the number of GPUs and must be at least 1, got {value}")
    return value


def strategy_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add the multi-GPU options (as keyword arguments named like the options)."""
    options = [
        click.option("--strategy", type=click.Choice([s.value for s in Strategy if s.is_shorthand]),
                     default=Strategy.SINGLE.value,
                     show_default=True,
                     help="Multi-GPU training: dp (nn.DataParallel), ddp (DistributedDataParallel), fsdp "
                          "(FSDP2 fully_shard per block), zero1/zero2/zero3 (DeepSpeed ZeRO). The report has "
                          "one row per kind of GPU."),
        click.option("--mesh", type=MeshType(), default=None, metavar="DIM=N,...",
                     help="A device mesh by its degrees, torchtitan's names: "
                          + ", ".join(f"{name} ({what})" for name, what in DIMENSION_NAMES.items())
                          + "; e.g. dp_shard=8,tp=4,pp=2. The world size is their product. --strategy fsdp is "
                            "dp_shard=N, ddp is dp_replicate=N, both together HSDP; tp alone or under dp_shard "
                            "(FSDP2 over its DTensors, torchtitan's composition), cp with the data-parallel "
                            "dimensions, pp (torch's own pipeline schedule) alone or over dp_shard (each stage "
                            "FSDP2-sharded: gpipe, 1f1b, interleaved-1f1b), ep (an MoE model's experts over ep ranks; "
                            "with tp torchtitan's etp=1 layout; with dp_shard or dp_replicate the dense part "
                            "FSDP2-sharded over the ep ranks too; with cp the experts over ep x cp ranks, torchtitan's "
                            "layout, dp_shard=N,cp=C,ep=E; in a pipeline stage). etp=1 is accepted, etp=tp "
                            "refused (docs/many-gpus.md)."),
        click.option("--world-size", type=int, default=None, callback=_at_least_one, metavar="N",
                     help="Number of GPUs (ranks) for ddp, fsdp and zero*; for dp, devices 0..N-1."),
        click.option("--device-ids", type=DeviceIdsType(), default=None,
                     help="dp only: the GPUs DataParallel uses, e.g. 0,1,2,3 (outputs gathered on the first)."),
        click.option("--global-batch/--per-rank-batch", "global_batch", default=False, show_default=True,
                     help="Whether --batch is the global batch (split over the GPUs) or each GPU's batch "
                          "(the default: each rank's DataLoader batch)."),
        click.option("--bucket-cap-mb", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_BUCKET_CAP_MB,
                     show_default=True, help="ddp: gradient bucket size in MiB."),
        click.option("--gradient-as-bucket-view", is_flag=True,
                     help="ddp: gradients are views into the buckets (no second copy)."),
        click.option("--fsdp-sharding", type=click.Choice([s.value for s in FsdpSharding]),
                     default=FsdpSharding.FULL_SHARD.value, show_default=True,
                     help="fsdp: FULL_SHARD (reshard after forward) or SHARD_GRAD_OP (keep parameters gathered "
                          "until backward)."),
        click.option("--pp-schedule", type=click.Choice([s.value for s in PipelineSchedule]), default=None,
                     help="pp: the pipeline schedule, run from the installed torch.distributed.pipelining "
                          "(default 1f1b)."),
        click.option("--microbatches", type=click.IntRange(min=1), default=None, metavar="M",
                     help="pp: microbatches per step; --batch (each pipeline's batch) splits into M "
                          "(default: as many as the pipeline ranks)."),
        click.option("--pp-split", type=str, default=None, metavar="MODULE,...",
                     help="pp: the block each stage after the first begins with, e.g. model.layers.16 "
                          "(default: even blocks per stage)."),
        click.option("--reduce-bucket-size", type=click.IntRange(min=1), default=DEEPSPEED_REDUCE_BUCKET_SIZE,
                     show_default=True, metavar="ELEMENTS",
                     help="zero*: DeepSpeed's reduce_bucket_size (elements of the gradient reduce bucket)."),
        click.option("--tp-plan", type=TpPlanType(), default=None, metavar="PATTERN=STYLE,...",
                     help="tp: the tensor-parallel plan, module-name patterns and transformers' style strings "
                          "(colwise, rowwise, sequence_parallel, ...), "
                          "e.g. 'layers.*.fc1=colwise,layers.*.fc2=rowwise'. "
                          "Default: the model's own tp_plan, or torchtitan's for the zoo's Llama family."),
        click.option("--accelerate-config", "accelerate_config", type=click.Path(dir_okay=False), default=None,
                     metavar="FILE.yaml",
                     help="accelerate's config file (accelerate launch --config_file): distributed_type, "
                          "num_processes, mixed_precision, fsdp_config and deepspeed_config set the strategy, the "
                          "GPUs and the precision. Not with the other multi-GPU options (--world-size aside)."),
        click.option("--deepspeed", "deepspeed", type=click.Path(dir_okay=False), default=None, metavar="FILE.json",
                     help="A DeepSpeed config: the ZeRO stage, reduce_bucket_size, overlap_comm, offload_optimizer, "
                          "offload_param and ZeRO-3's stage3_* keys, bf16/fp16, the micro-batch and accumulation. The "
                          "GPUs: train_batch_size ÷ (micro-batch × accumulation), or --world-size."),
        click.option("--loss-parallel", is_flag=True,
                     help="tp: keep the logits sharded over the vocabulary and compute the loss under torch's "
                          "loss_parallel() (torchtitan's Llama plan only)."),
        click.option("--routing", type=click.Choice([r.value for r in Routing if r is not Routing.CAPACITY]),
                     default=Routing.BALANCED.value, show_default=True,
                     help="ep: the tokens' split over the experts, which is data: balanced (every expert its "
                          "share), or worst (every rank sends the traced rank's experts all it can)."),
        click.option("--capacity-factor", type=click.FloatRange(min=1), default=None, metavar="F",
                     help="ep: assume each expert receives F times its balanced share from every rank "
                          "(GShard's capacity factor, e.g. 1.25)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


#: The options of one family of strategies: click parameter → :class:`Distributed` argument.
_STRATEGY_ONLY = {"bucket_cap_mb": "bucket_cap_mb", "gradient_as_bucket_view": "gradient_as_bucket_view",
                  "fsdp_sharding": "sharding", "reduce_bucket_size": "reduce_bucket_size",
                  "global_batch": "batch_is_global", "pp_schedule": "pp_schedule", "microbatches": "microbatches",
                  "pp_split": "pp_split", "tp_plan": "tp_plan", "loss_parallel": "loss_parallel",
                  "routing": "routing", "capacity_factor": "capacity_factor"}


def launch_arguments(*, accelerate_config: str | None = None, deepspeed: str | None = None,
                     world_size: int | None = None, measure: bool = False) -> LaunchSetup | None:
    """``--accelerate-config`` / ``--deepspeed`` read (before the model is built), or None; a
    usage error beside another multi-GPU option (``--world-size`` aside: it counts a DeepSpeed
    config's GPUs) or ``--measure``."""
    if accelerate_config is None and deepspeed is None:
        return None
    flag = "--accelerate-config" if accelerate_config is not None else "--deepspeed"
    params = click.get_current_context().params
    others = [f"--{name.replace('_', '-')}" for name in ("strategy", "mesh", "device_ids", *_STRATEGY_ONLY)
              if given(name) and params.get(name) is not False]  # --per-rank-batch asks for nothing
    if others:  # memcalc's own errors, not click's: one line, exit 2, no usage banner
        raise InapplicableOptionError(f"{flag} sets the multi-GPU setting; leave out {', '.join(others)}")
    if measure:
        raise InapplicableOptionError(f"--measure runs the step on this machine's GPU (or CPU); it cannot measure "
                                      f"{flag}")
    return read_launch(accelerate_config, deepspeed, world_size)


def strategy_arguments(*, strategy: str, world_size: int | None, device_ids: tuple[int, ...] | None,
                       global_batch: bool, bucket_cap_mb: float, gradient_as_bucket_view: bool,
                       fsdp_sharding: str, reduce_bucket_size: int, mesh: dict[str, int] | None = None,
                       pp_schedule: str | None = None, microbatches: int | None = None, pp_split: str | None = None,
                       tp_plan: dict[str, str] | None = None, loss_parallel: bool = False,
                       routing: str = Routing.BALANCED.value, capacity_factor: float | None = None,
                       measure: bool = False, accelerate_config: str | None = None,
                       deepspeed: str | None = None) -> dict[str, Any]:
    """The options as :func:`memcalc.estimate`'s ``distributed`` keyword (none for a single
    GPU); a usage error for combinations that make no sense (``--mesh`` with a ``--strategy``
    that is none of its dimensions), and for an option given on the command line that the
    strategy would ignore (``--bucket-cap-mb`` without ddp). With a launch configuration
    (:func:`launch_arguments`): ``{"launch": ...}``, its setting."""
    launch = launch_arguments(accelerate_config=accelerate_config, deepspeed=deepspeed, world_size=world_size,
                              measure=measure)
    if launch is not None:
        return {"launch": launch}
    # a flag's explicit False (--per-rank-batch, the default's own spelling) asks for nothing
    explicit = {argument for parameter, argument in _STRATEGY_ONLY.items()
                if given(parameter) and click.get_current_context().params.get(parameter) is not False}
    kind, shape = Strategy(strategy), None
    try:
        if mesh is not None:  # the strategy a mesh is, to name the options it reads
            shaped = Distributed(strategy, world_size=world_size, mesh=mesh)
            kind, shape = shaped.strategy, shaped.mesh
        problem = inapplicable_option(kind, explicit, flags=True, mesh=shape if mesh is not None else None)
        if problem is not None:
            raise click.UsageError(problem)
        distributed = Distributed(strategy, world_size=world_size, device_ids=device_ids,
                                  batch_is_global=global_batch,
                                  bucket_cap_mb=bucket_cap_mb if "bucket_cap_mb" in explicit else None,
                                  gradient_as_bucket_view=gradient_as_bucket_view,
                                  sharding=fsdp_sharding if "sharding" in explicit else None,
                                  reduce_bucket_size=reduce_bucket_size if "reduce_bucket_size" in explicit else None,
                                  mesh=mesh, pp_schedule=pp_schedule, microbatches=microbatches,
                                  pp_split=None if pp_split is None else [n for n in pp_split.split(",") if n.strip()],
                                  tp_plan=tp_plan, loss_parallel=loss_parallel,
                                  routing=routing if "routing" in explicit else None, capacity_factor=capacity_factor)
    except InvalidInputError as exc:
        raise click.UsageError(str(exc)) from None
    if distributed.is_single:
        return {}
    if measure:
        what = f"--mesh {_described(shape)}" if mesh is not None else f"--strategy {strategy}"
        raise click.UsageError(f"--measure runs the step on this machine's GPU (or CPU); it cannot measure {what}")
    return {"distributed": distributed}


def _described(mesh: Mesh | None) -> str:
    return "1" if mesh is None else mesh.describe()

"""Real pipeline-parallel training steps over gloo on the CPU: torch.distributed.pipelining's
``PipelineStage`` and schedule classes on two processes, each rank's peak read from the
profiler, the reference for memcalc's per-rank pipeline estimates
(tests/test_gloo_pipeline.py).

The stages are cut by hand, as the pipelining tutorial does (an ``nn.Sequential`` of the
model's own modules: the input layer and the first half of the blocks, then the second half
and the head), not by memcalc's splitter. Each stage is a ``PipelineStage`` in torch's
default dynamic mode (its shapes found by the first step's metadata inference).

How a rank's peak is measured follows tests/gloo_runs.py: one warm-up step (the metadata
inference, the receive buffers), then the step under ``torch.profiler``: a fresh
``Adam(foreach=True)`` and two iterations of ``schedule.step(...)``, ``optimizer.step()``,
``zero_grad(set_to_none=True)``; the running sum of the ``[memory]`` events on top of the
storages alive before it — the parameters, the input (first rank), and what the stage keeps
between steps: its receive buffers for activations and gradients, and the previous step's
gradients of the received activations, which ``step()`` drops when it begins.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gloo_runs import Block, BlockNet, RankPeak, _net_bytes, run_on_ranks, until_complete
from torch import nn

#: The pipelined model: BlockNet at width 64 with 4 blocks, fed sequences of 64 positions of
#: FEATURES features, so that the activations in flight, not the weights, decide the peak.
WIDTH = 64
BLOCKS = 4
POSITIONS = 64
BATCH = 32


@dataclass(frozen=True)
class PipelineCase:
    """One real run: ``schedule`` (torch's name: "GPipe", "1F1B") over ``microbatches``;
    ``dp_shard`` > 1: each stage ``fully_shard``-ed over that many ranks (a ``(pp, dp_shard)``
    device mesh, pp outermost as torchtitan orders it; every block and the stage's root
    wrapped, ``reshard_after_forward=False`` as torchtitan's default under a pipeline).
    ``dp_replicate`` > 1 (with ``dp_shard``): HSDP stages, ``fully_shard`` over the 2-D
    ``(dp_replicate, dp_shard)`` sub-mesh of a ``(pp, dp_replicate, dp_shard)`` mesh, as torchtitan
    wraps them."""

    name: str
    schedule: str
    microbatches: int
    dp_shard: int = 1
    #: stages per rank (2 for "Interleaved1F1B"): rank r holds stages r, r + pp, ... (torch's loop placement)
    stages_per_rank: int = 1
    dp_replicate: int = 1
    #: "selective-op": each block wrapped before pipelining, as torchtitan applies op-level SAC
    #: per block (torch's ``checkpoint_wrapper``, non-reentrant, ``create_selective_checkpoint_contexts``
    #: with torchtitan's save list); None: no checkpointing
    checkpoint: str | None = None

    @property
    def data_parallel(self) -> int:
        """The ranks that hold one stage."""
        return self.dp_replicate * self.dp_shard


def pipeline_model() -> BlockNet:
    """The model every rank builds (the same seed: the same weights)."""
    return BlockNet(d=WIDTH, blocks=BLOCKS)


def check_every_rank(name: str, peaks: Sequence[RankPeak], estimated: Sequence[int], tolerance: float) -> None:
    """Each rank's real step peak (``peaks[rank]``) against memcalc's (``estimated[rank]``), printed
    (``-s``) and held within ``tolerance``: the comparison every pipeline gloo test makes."""
    assert len(estimated) == len(peaks), f"{name}: {len(estimated)} estimated ranks, {len(peaks)} real ones"
    for rank, (measured, mine) in enumerate(zip(peaks, estimated, strict=True)):
        real = measured.step_peak
        error = (mine - real) / real
        print(f"{name} rank {rank}: real {real:,} B, estimate {mine:,} B, {error:+.3%}")
        assert abs(error) <= tolerance, f"rank {rank}: estimate {mine:,} B, real {real:,} B ({error:+.3%})"


def peaks_by_rank(report: Any, world: int) -> list[int]:
    """Every rank's estimated step peak from a mesh estimate's per-role rows, in rank order; every
    rank of the ``world`` is held by exactly one role."""
    by_rank = {rank: role.report.peak_requested for role in report.roles for rank in role.ranks}
    assert sorted(by_rank) == list(range(world))
    return [by_rank[rank] for rank in range(world)]


def run_pipeline_cases(cases: Sequence[PipelineCase], work_dir: Path, *, world_size: int = 2,
                       timeout_s: float = 300.0) -> dict[str, list[RankPeak]]:
    """Run ``cases`` on ``world_size`` spawned processes (one pipeline stage each) over gloo.

    Returns:
        Each case's peaks, by rank.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    return run_on_ranks(_case_on_rank, cases, work_dir, world_size, timeout_s, what="gloo pipeline runs")


def _case_on_rank(case: PipelineCase, rank: int, world_size: int) -> RankPeak:
    return _run_case(case, rank, world_size // case.data_parallel)


def _stage_module(model: BlockNet, rank: int, world_size: int) -> nn.Sequential:
    """Stage ``rank`` of ``world_size``: its share of the blocks, the input layer first, the head last."""
    per = BLOCKS // world_size
    parts: list[nn.Module] = list(model.blocks)[rank * per:(rank + 1) * per]
    if rank == 0:
        parts.insert(0, model.inp)
    if rank == world_size - 1:
        parts.append(model.head)
    return nn.Sequential(*parts)


def _run_case(case: PipelineCase, global_rank: int, world_size: int) -> RankPeak:
    """``world_size``: the pipeline ranks; the process's stage is its global rank // (dp_replicate ·
    dp_shard)."""
    from gloo_runs import FEATURES
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    torch.manual_seed(0)
    rank = global_rank // case.data_parallel
    total = world_size * case.stages_per_rank
    indices = [rank + k * world_size for k in range(case.stages_per_rank)]
    model = pipeline_model()
    if case.checkpoint == "selective-op":
        _selective_blocks(model)
    modules = [_stage_module(model, index, total) for index in indices]
    group = None
    if case.dp_shard > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size, case.dp_replicate, case.dp_shard),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        dp_mesh = mesh["dp_replicate", "dp_shard"] if case.dp_replicate > 1 else mesh["dp_shard"]  # HSDP: 2-D
        for stage_module in modules:
            for block in stage_module:
                if isinstance(block, Block):
                    fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(stage_module, mesh=dp_mesh, reshard_after_forward=False)
        group = mesh["pp"].get_group()
    stages = [PipelineStage(m, i, total, torch.device("cpu"), group=group) for m, i in zip(modules, indices,
                                                                                           strict=True)]
    schedule_cls = get_schedule_class(case.schedule)
    schedule = schedule_cls(stages[0] if case.stages_per_rank == 1 else stages, case.microbatches,
                            loss_fn=lambda out, _target: out.mean())
    first, last = 0 in indices, total - 1 in indices
    x = torch.randn(BATCH, POSITIONS, FEATURES) if first else None
    return measure_schedule(schedule, stages, nn.ModuleList(modules), x, last=last, batch=BATCH, name=case.name)


def _selective_blocks(model: BlockNet) -> None:
    """Op-level selective checkpointing of every block, as torchtitan's ``_apply_op_sac`` wraps
    a block (``checkpoint_wrapper`` with a fresh torchtitan policy per call), before the split, with
    torch's default ``preserve_rng_state=True`` as memcalc's checkpoint has it (torchtitan passes
    False): each call in flight holds a copy of the CPU generator's state (5,056 B; rank 0 of GPipe
    holds 7, 35,392 B), host memory on a GPU, which the CPU target counts
    (memcalc.targets.cpu.generator) and the CUDA target does not."""

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from memcalc.engine.sac_policy import torchtitan_policy

    def context_fn() -> Any:
        return create_selective_checkpoint_contexts(torchtitan_policy())

    wrap = partial(checkpoint_wrapper, context_fn=context_fn)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = wrap(block)


def cut_stage(model: nn.Module, index: int, stages: int) -> nn.Module:
    """A copy of a causal LM (``model.model.layers``, ``embed_tokens``, ``norm``, ``lm_head``) cut
    to stage ``index`` of ``stages`` as torchtitan cuts it: its share of the layers, and None for
    the embedding (all but the first stage) and the norm and head (all but the last)."""
    cut = copy.deepcopy(model)
    layers = list(cut.model.layers)
    per = len(layers) // stages
    cut.model.layers = nn.ModuleList(layers[index * per:(index + 1) * per])
    if index > 0:
        cut.model.embed_tokens = None
    if index < stages - 1:
        cut.model.norm = None
        cut.lm_head = None
    return cut


#: The pipeline runs' optimizer: a fresh foreach Adam per measured step.
FOREACH_ADAM = partial(torch.optim.Adam, foreach=True)


def measure_schedule(schedule: Any, stages: Sequence[Any], stage_module: nn.Module, x: torch.Tensor | None, *,
                     last: bool, batch: int, name: str,
                     optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = FOREACH_ADAM,
                     counters_per_parameter: int = 4) -> RankPeak:
    """One rank's peak over two optimizer steps of ``schedule`` (each a fresh ``optimizer`` over
    the rank's trainable parameters, foreach Adam unless told, dropped at the end; its host step
    counters, ``counters_per_parameter`` bytes a parameter, left out), after a warm-up step (metadata
    inference, receive buffers). ``x``: the batch on the first stage's rank, else None; the
    last stage's rank passes an empty ``batch``-row target (the mean loss takes none; the schedule
    splits one)."""
    target = torch.empty(batch, 0) if last else None
    trainable = [p for p in stage_module.parameters() if p.requires_grad]

    def step() -> None:
        made = optimizer(trainable)
        for _ in range(2):
            if x is not None:
                schedule.step(x, return_outputs=False)
            else:
                schedule.step(target=target, return_outputs=False)
            made.step()
            made.zero_grad(set_to_none=True)
        del made
        gc.collect()

    step()
    before = _storages_before(stages, stage_module, x)
    return until_complete(lambda: _measured(step), before, counters_per_parameter * len(trainable), f"{name}: ")


def _storages_before(stages: Sequence[Any], module: nn.Module, x: torch.Tensor | None) -> int:
    """Bytes alive when the step starts: parameters, the input, the stage's receive buffers and
    the previous step's gradients on the activation buffers."""
    from memcalc.measure.step import storage_bytes

    local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]  # FSDP2's shards
    kept: list[torch.Tensor] = [*local, *module.buffers()]
    if x is not None:
        kept.append(x)
    for infos in (*(i for s in stages for i in s.args_recv_info.values()),
                  *(i for s in stages for i in s.grad_recv_info.values())):
        for info in infos:
            if info.buffer is not None and not info.is_root_arg:
                kept.append(info.buffer)
                if info.buffer.grad is not None:
                    kept.append(info.buffer.grad)
    return storage_bytes(kept)


def _measured(step: Any) -> tuple[int, bool]:
    from torch.profiler import ProfilerActivity, profile

    from memcalc.measure.step import _profiler_peak

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return _profiler_peak(prof), _net_bytes(prof) == 0

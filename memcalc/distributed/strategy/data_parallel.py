"""``dp``: ``nn.DataParallel(model, device_ids)``, one process driving several GPUs. Each
forward scatters the batch (``torch.chunk``), broadcasts the parameters and buffers to every
other device and gathers the outputs on ``device_ids[0]``, which computes the loss and alone
runs the optimizer (:mod:`memcalc.distributed.dp`). Two roles: the output device and the others.
Not a device mesh, and its GPUs are not ranks of a process group: its roles have no sharding."""

from __future__ import annotations

from dataclasses import replace

import torch

from memcalc.core.categories import Mode
from memcalc.core.errors import InapplicableOptionError, InvalidInputError
from memcalc.core.finetune import FineTune
from memcalc.distributed.dp import DataParallelOutputDevice, DataParallelReplica
from memcalc.distributed.program import RankProgram
from memcalc.distributed.strategy.base import Plan, RankStrategy, Role, register
from memcalc.distributed.vocabulary import Strategy, dp_chunks
from memcalc.engine.model import ResolvedModel
from memcalc.engine.step_spec import Step

__all__ = ("DataParallel",)


@register(Strategy.DP)
class DataParallel(RankStrategy):
    """The output device holds the gathered outputs, the loss and the optimizer; the other
    devices a replica and their chunk."""

    name = "dp"
    options = frozenset({"device_ids"})

    @classmethod
    def world_size(cls, strategy: Strategy, world_size: int | None, device_ids: tuple[int, ...]) -> int:
        """The devices of ``device_ids`` or, without them, devices ``0..world_size-1``."""
        if device_ids and world_size is not None and world_size != len(device_ids):
            raise InvalidInputError(
                f"--world-size {world_size} disagrees with {len(device_ids)} device ids {list(device_ids)}")
        if not device_ids and world_size is None:
            raise InvalidInputError("--strategy dp needs the GPUs it spreads over",
                                    hint="give --device-ids 0,1,2,3 (or --world-size 4 for devices 0..3)")
        return len(device_ids) if device_ids else int(world_size or 1)

    def refuse_finetune(self, finetune: FineTune) -> None:
        if finetune.is_empty:
            return
        # Broadcast.forward marks the replicas of frozen parameters non-differentiable, and an
        # autograd Function receives zeros for those outputs (materialize_grads), which
        # Broadcast.backward reduces with the real gradients (torch/nn/parallel/_functions.py)
        raise InapplicableOptionError(
            "fine-tuning options (--freeze, --lora, --quant) are not estimated under --strategy dp: DataParallel "
            "gives every frozen parameter's replica a zero gradient in backward and reduces them onto the output "
            "device (torch.nn.parallel Broadcast/ReduceAddCoalesced), which memcalc does not model",
            hint="Use --strategy ddp (PyTorch recommends it over DataParallel), or leave out --strategy.")

    def plan(self, plan: Plan, step: Step) -> Plan:
        dist = self.distributed
        n = dist.world_size
        training = step.mode is Mode.TRAIN
        global_batch = plan.batch if dist.batch_is_global else plan.batch * n
        chunks = dp_chunks(global_batch, n)
        primary = dist.device_ids[0]

        def output_device(_resolved: ResolvedModel) -> RankProgram:
            return DataParallelOutputDevice(chunks, training)

        def replica(_resolved: ResolvedModel) -> RankProgram:
            return DataParallelReplica(training)

        roles = [Role(f"output device (cuda:{primary})", (primary,), chunks[0], output_device, sharding=None)]
        others = dist.device_ids[1:len(chunks)]
        if others:
            roles.append(Role("other devices", tuple(others), max(chunks[1:]), replica, optimizer=False,
                              loss_fn=_sent_output, loss_text=f"computed on cuda:{primary}", sharding=None))
        notes = []
        idle = dist.device_ids[len(chunks):]
        if idle:
            notes.append(f"the batch of {global_batch} fills only {len(chunks)} of {n} devices: "
                         f"cuda:{', cuda:'.join(map(str, idle))} get no chunk (torch.chunk)")
        notes.append("DataParallel replicas of the parameters and buffers are counted as alive for the whole "
                     "forward and backward (they are broadcast at each forward)")
        return replace(plan, roles=tuple(roles), global_batch=global_batch, notes=(*plan.notes, *notes))


def _sent_output(output: torch.Tensor) -> torch.Tensor:
    return output  # DataParallelReplica made the output a scalar standing for the sent tensors

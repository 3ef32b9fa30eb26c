"""Real tensor-parallel training steps on processes over gloo, each rank's peak read from the
profiler: the reference for memcalc's per-rank tensor-parallel estimate on the CPU target
(tests/test_gloo_tp.py), alone and under FSDP2 (tests/test_gloo_fsdp_tp.py).

Each rank builds the same model (same seed), applies torch's own ``parallelize_module`` over a
real gloo ``DeviceMesh`` with the case's plan — the same torch styles memcalc applies over its
fake process group (:mod:`memcalc.distributed.tp_plans`) — and is measured as
tests/gloo_runs.py measures DDP and FSDP2: a warm-up step, then two iterations of memcalc's
default loop with a fresh ``Adam(foreach=True)`` under ``torch.profiler``, repeated until the
trace is complete (:func:`gloo_runs._measured_step`).

With ``dp_shard`` above 1 the run composes FSDP2 with tensor parallelism as torchtitan does
(``torchtitan/models/llama3/infra/parallelize.py``): a 2-D ``DeviceMesh`` ``("dp_shard", "tp")``,
``parallelize_module`` on its ``tp`` sub-mesh, then ``fully_shard`` on every block of the first
``nn.ModuleList`` and on the root over its ``dp_shard`` sub-mesh (the same units as memcalc's
:func:`~memcalc.distributed.fsdp.fsdp_units`), so that FSDP2 shards the tensor-parallel DTensors.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from gloo_runs import (
    FEATURES,
    BlockNet,
    RankPeak,
    _net_bytes,
    _storages_before,
    run_on_ranks,
    until_complete,
)
from torch import nn
from torch.nn import functional as F

from models_zoo.llama import LlamaConfig, LlamaForCausalLM

#: A small Llama (the zoo's layout): 2 layers, grouped-query attention (4 heads, 2 KV heads).
SMALL_LLAMA = LlamaConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=344,
                          vocab_size=1000, max_position_embeddings=128)
#: The Llama's batch and sequence length (the sequence divides by the ranks: sequence parallelism).
LLAMA_BATCH, LLAMA_SEQ = 4, 32
#: BlockNet's batch.
MLP_BATCH = 16


def small_llama() -> nn.Module:
    return LlamaForCausalLM(SMALL_LLAMA)


@dataclass(frozen=True)
class TpCase:
    """One real run: ``model`` ("llama": :func:`small_llama`; "mlp": tests/gloo_runs.py's
    BlockNet) under ``plan`` (transformers' style strings; None: memcalc's default for the
    model, torchtitan's for the Llama), stepped by ``Adam(foreach=foreach)``: a plan that leaves
    some parameters plain tensors needs the for-loop Adam (torch's foreach kernels refuse a mix
    of Tensors and DTensors), or by SGD (``optimizer``: no state, so the step peaks in forward or
    backward, where the collectives are)."""

    name: str
    model: str
    plan: Mapping[str, str] | None = None
    foreach: bool = True
    #: "mean" (of the output) or "lm-cross-entropy" (the Llama's next-token loss against
    #: random targets that arrive with the batch, as memcalc's targets do)
    loss: str = "mean"
    #: torchtitan's plan keeping the logits sharded, the loss under torch's ``loss_parallel()``
    loss_parallel: bool = False
    #: FSDP2 over this many ranks of a 2-D ``(dp_shard, tp)`` mesh (1: tensor parallelism alone)
    dp_shard: int = 1
    #: "adam" (``Adam(foreach=foreach)``) or "sgd" (``SGD(lr=1e-3, foreach=foreach)``)
    optimizer: str = "adam"
    #: the Llama's vocabulary (None: :data:`SMALL_LLAMA`'s), batch and sequence length
    vocab_size: int | None = None
    batch_size: int = LLAMA_BATCH
    seq_len: int = LLAMA_SEQ

    @property
    def config(self) -> LlamaConfig:
        return replace(SMALL_LLAMA, vocab_size=self.vocab_size or SMALL_LLAMA.vocab_size)

    def build(self) -> nn.Module:
        return self.factory()()

    def factory(self) -> Callable[[], nn.Module]:
        return functools.partial(LlamaForCausalLM, self.config) if self.model == "llama" else BlockNet

    def batch(self) -> torch.Tensor:
        if self.model == "llama":
            return torch.randint(0, self.config.vocab_size, (self.batch_size, self.seq_len))
        return torch.randn(MLP_BATCH, FEATURES)


def run_tp_cases(cases: Sequence[TpCase], work_dir: Path, *, world_size: int = 2,
                 timeout_s: float = 300.0) -> dict[str, list[RankPeak]]:
    """Run ``cases`` on ``world_size`` spawned processes over gloo; each case's peaks by rank.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    return run_on_ranks(_run_case, cases, work_dir, world_size, timeout_s)


def _run_case(case: TpCase, rank: int, world_size: int) -> RankPeak:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from memcalc.distributed.tp_plans import resolve_plan
    from memcalc.measure.step import storage_bytes

    torch.manual_seed(0)
    model = case.build()
    x = case.batch()
    targets = torch.randint(0, case.config.vocab_size, x.shape) if case.loss == "lm-cross-entropy" else None
    tp = world_size // case.dp_shard
    mesh = init_device_mesh("cpu", (case.dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    # the same torch styles as memcalc's estimate
    plan = resolve_plan(model, case.plan, case.name, loss_parallel=case.loss_parallel)
    parallelize_module(model, mesh["tp"], dict(plan.styles))
    if case.dp_shard > 1:  # torchtitan's order: FSDP2 over the tensor-parallel DTensors
        from torch.distributed.fsdp import fully_shard

        blocks = next(m for m in model.modules() if isinstance(m, nn.ModuleList))
        for block in blocks:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    _step(model, x, trainable, case, targets)  # the warm-up
    before = _storages_before(model, x) + (storage_bytes([targets]) if targets is not None else 0)
    counters = 4 * len(trainable) if case.optimizer == "adam" else 0  # Adam's step counters
    return until_complete(lambda: _measured_step(model, x, trainable, case, targets), before, counters,
                          f"{case.name}: ")


def _step(model: nn.Module, x: torch.Tensor, trainable: list[nn.Parameter], case: TpCase,
          targets: torch.Tensor | None) -> None:
    """tests/gloo_runs.py's step (two iterations of memcalc's default loop, a fresh optimizer
    dropped at the end) with the case's optimizer, its ``foreach`` and the loss as the case says."""
    from torch.distributed.tensor.parallel import loss_parallel

    optimizer = (torch.optim.Adam(trainable, foreach=case.foreach) if case.optimizer == "adam"
                 else torch.optim.SGD(trainable, lr=1e-3, foreach=case.foreach))
    for _ in range(2):
        out = model(x)
        with loss_parallel() if case.loss_parallel else contextlib.nullcontext():
            # the mean, or memcalc's lm-cross-entropy (memcalc.engine.losses.compute_loss)
            loss = out.mean() if targets is None else F.cross_entropy(out.flatten(0, -2), targets.flatten())
            loss.backward()
        del out, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del optimizer
    gc.collect()


def _measured_step(model: nn.Module, x: torch.Tensor, trainable: list[nn.Parameter], case: TpCase,
                   targets: torch.Tensor | None) -> tuple[int, bool]:
    """The step's peak over the storages alive before it, and whether its trace is complete."""
    from torch.profiler import ProfilerActivity, profile

    from memcalc.measure.step import _profiler_peak

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, x, trainable, case, targets)
    return _profiler_peak(prof), _net_bytes(prof) == 0

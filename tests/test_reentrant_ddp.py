"""Reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``) under DDP and FSDP2:
memcalc's per-rank estimate against real training steps on two processes over gloo, every rank's
peak read from the profiler (the harness of tests/gloo_runs.py: forkserver ranks, a warm-up step,
the step repeated until its trace is complete).

One model is the zoo's plain-torch ``llama-tiny`` (2 x 32 tokens), each decoder layer's forward
wrapped in torch's reentrant checkpoint as memcalc wraps it (hooks outside the checkpoint: DDP's
and FSDP2's fire around the layer's call, not in its recomputation), plain SGD (no state),
memcalc's default loop (loss = the output's mean, the output held to the step, two iterations).

A transformers Llama (small vocabulary, 3 layers) checkpoints itself: its layers run
``checkpoint(super().__call__)``, so FSDP2's hooks run inside the reentrant checkpoint, and its peak
is in the layers' backward, where reentrance keeps one layer's output more. Its real runs under DDP
and FSDP2 are in tests/test_reentrant_gloo_options.py's one spawn, which runs the same model, step
and DDP wrapper for its DDP options (a spawn of its own here had measured the DDP cases twice).

DDP: torch's notes say reentrant checkpointing works "when there are no unused parameters in the
model and each layer is checkpointed at most once" (``find_unused_parameters`` False, the
default): each layer's gradients are produced in its checkpoint's inner backward, where the
Reducer's hooks copy them into the buckets as usual. FSDP2: the layer's pre-backward hook (on the
checkpoint's output) all-gathers its parameters before ``CheckpointFunctionBackward`` recomputes.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_runs import _storages_before, profiled, spawn_ranks, until_complete
from torch import nn
from torch.utils.checkpoint import checkpoint

import memcalc
from memcalc.core.checkpointing import Checkpointing, CheckpointKind

pytestmark = pytest.mark.slow  # one spawn of two processes for all cases

WORLD = 2
LLAMA = "torch:llama-tiny"
BATCH = 2
SEQ = 32
#: The runs step SGD(foreach=True); the estimates step the same implementation.
FOREACH = memcalc.Loop(optimizer_impl="foreach")
#: (strategy, reentrant): the non-reentrant cases are the reference each reentrant one differs from.
CASES = [(strategy, reentrant) for strategy in ("ddp", "fsdp") for reentrant in (False, True)]


def _name(strategy: str, reentrant: bool) -> str:
    return f"{strategy}-{'reentrant' if reentrant else 'non-reentrant'}"


def _checkpointed(forward: Any, reentrant: bool) -> Any:
    """``forward`` under torch's checkpoint, as a user (or memcalc's --checkpoint full) wraps a layer."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if reentrant:  # CheckpointFunction takes no keyword arguments: bind them, as transformers does
            return checkpoint(lambda *a: forward(*a, **kwargs), *args, use_reentrant=True)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def _real_model(strategy: str, reentrant: bool) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memcalc.sources.resolve import resolve

    torch.manual_seed(0)  # the same weights on every rank
    model, inputs = resolve(LLAMA, batch_size=BATCH, seq_len=SEQ).build_real(torch.device("cpu"))
    layers = model.get_submodule("model.layers")
    for layer in layers:
        layer.forward = _checkpointed(layer.forward, reentrant)
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model), tuple(inputs.args), dict(inputs.kwargs)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, tuple(inputs.args), dict(inputs.kwargs)


def _step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], trainable: list[nn.Parameter]) -> None:
    optimizer = torch.optim.SGD(trainable, lr=1e-3, foreach=True)
    for _ in range(2):
        out = model(*args, **kwargs)
        loss = out.mean()
        loss.backward()
        del out, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del optimizer
    gc.collect()


def _rank_peak(strategy: str, reentrant: bool) -> int:
    """This rank's peak: the storages alive before the step plus the profiler's peak over it (SGD
    keeps no state, so there are no step counters to take off)."""
    model, args, kwargs = _real_model(strategy, reentrant)
    trainable = [p for p in model.parameters() if p.requires_grad]
    _step(model, args, kwargs, trainable)  # the warm-up (FSDP's lazy init, DDP's bucket rebuild)
    before = _storages_before(model, args[0])
    return until_complete(lambda: profiled(lambda: _step(model, args, kwargs, trainable)), before, 0,
                          f"{_name(strategy, reentrant)}: ").peak


def _worker(rank: int, world_size: int, port: int, work_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    results: dict[str, Any] = {}
    try:
        for strategy, reentrant in CASES:
            results[_name(strategy, reentrant)] = _rank_peak(strategy, reentrant)
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    work_dir = tmp_path_factory.mktemp("gloo-reentrant")
    spawn_ranks(_worker, WORLD, (str(work_dir),), timeout_s=600.0)
    ranks = [json.loads((work_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    return {_name(*case): [ranks[rank][_name(*case)] for rank in range(WORLD)] for case in CASES}


def _estimate(strategy: str, reentrant: bool) -> int:
    return memcalc.estimate(LLAMA, seq_len=SEQ, batch_size=BATCH, optimizer="sgd", loss="mean", gpu="cpu",
                            loop=FOREACH, checkpoint=Checkpointing(CheckpointKind.FULL, reentrant=reentrant),
                            distributed=memcalc.Distributed(strategy, world_size=WORLD)).peak_requested


#: The CPU generator's state that the reentrant checkpoint saves per layer (``preserve_rng_state``:
#: ``torch.get_rng_state()``, 5,056 B on torch 2.13), which the CPU target counts
#: (memcalc.targets.cpu.generator); host memory on a GPU. llama-tiny has 8 layers.
RNG_STATES = 8 * torch.get_rng_state().numel()


@pytest.mark.parametrize("case", CASES, ids=lambda case: _name(*case))
def test_estimate_against_every_rank_of_a_real_gloo_run(real_peaks: dict[str, list[int]],
                                                        case: tuple[str, bool]) -> None:
    """Every rank to the byte (measured 2026-12-07, load ~18: DDP 667,458,056 B non-reentrant,
    667,498,504 B reentrant; FSDP2 555,588,116 B and 555,628,564 B; both ranks alike). The peak is
    in the head's backward (32,000 logits a token), where reentrance holds only the CPU generator
    states of the 8 layers more (the non-reentrant checkpoint's are freed in each layer's backward,
    the reentrant one's at the end of backward), in the real runs as in the estimates."""
    strategy, reentrant = case
    estimate = _estimate(strategy, reentrant)
    for rank, real in enumerate(real_peaks[_name(*case)]):
        print(f"{_name(*case)} rank {rank}: real {real:,} B, estimate {estimate:,} B, {(estimate - real) / real:+.4%}")
    assert real_peaks[_name(*case)] == [estimate] * WORLD


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_reentrance_adds_only_the_generator_states_here(real_peaks: dict[str, list[int]], strategy: str) -> None:
    real = [b - a for a, b in zip(real_peaks[_name(strategy, False)], real_peaks[_name(strategy, True)], strict=True)]
    assert real == [RNG_STATES] * WORLD
    assert _estimate(strategy, True) - _estimate(strategy, False) == RNG_STATES


# ============================================================================================
# Where reentrance is not checked: refused by name
# ============================================================================================


@pytest.mark.parametrize(("distributed", "message"), [
    (dict(strategy="zero2", world_size=WORLD), "under --strategy zero2 is not modelled"),
    (dict(dp_replicate=2, dp_shard=2), "under --strategy mesh is not modelled"),
    (dict(dp_shard=2, tp=2), "under --strategy mesh is not modelled"),
])
def test_unchecked_strategies_are_refused(distributed: dict[str, Any], message: str) -> None:
    with pytest.raises(memcalc.InapplicableOptionError, match=message):
        memcalc.estimate(LLAMA, seq_len=SEQ, batch_size=BATCH, optimizer="sgd", gpu="cpu",
                         checkpoint=Checkpointing(CheckpointKind.FULL, reentrant=True),
                         distributed=memcalc.Distributed(**distributed))


# ============================================================================================
# A model that checkpoints itself (transformers' layers, FSDP2's hooks inside the checkpoint):
# tests/test_reentrant_gloo_options.py, whose one spawn runs the same transformers Llama under DDP
# and FSDP2 (test_transformers_own_reentrant_checkpoint_against_real_ranks there)
# ============================================================================================

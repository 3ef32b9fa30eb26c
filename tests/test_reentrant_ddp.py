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
is in the layers' backward, where reentrance keeps one layer's output more.

DDP: torch's notes say reentrant checkpointing works "when there are no unused parameters in the
model and each layer is checkpointed at most once" (``find_unused_parameters`` False, the
default): each layer's gradients are produced in its checkpoint's inner backward, where the
Reducer's hooks copy them into the buckets as usual. FSDP2: the layer's pre-backward hook (on the
checkpoint's output) all-gathers its parameters before ``CheckpointFunctionBackward`` recomputes.
"""

from __future__ import annotations

import gc
import json
import sys
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

sys.path.insert(0, str(Path(__file__).parent / "hf_reference"))
from hf_harness import llama_config, write_config

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
# A model that checkpoints itself: transformers' layers, FSDP2's hooks inside the checkpoint
# ============================================================================================

#: A small-vocabulary Llama (tests/test_reentrant.py's): its peak is in its layers' backward.
HF_CONFIG = {**llama_config(512, hidden=256, layers=3), "intermediate_size": 1024}
HF_BATCH, HF_SEQ = 2, 512
HF_CASES = [(strategy, reentrant) for strategy in ("ddp", "fsdp") for reentrant in (False, True)]


def _real_hf(strategy: str, reentrant: bool) -> int:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memcalc.measure.step import storage_bytes

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**HF_CONFIG)
    model: nn.Module = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids = torch.randint(0, 512, (HF_BATCH, HF_SEQ), generator=torch.Generator().manual_seed(1))
    if strategy == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    # labels a tensor of their own, as a causal-LM collator makes them (``labels = input_ids.clone()``)
    # and as memcalc's step has them
    kwargs = {"input_ids": ids, "labels": ids.clone()}

    def step() -> None:
        optimizer = torch.optim.SGD(trainable, lr=1e-3, foreach=True)
        for _ in range(2):
            output = wrapped(**kwargs)
            output.loss.backward()
            del output
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del optimizer
        gc.collect()

    step()
    before = _storages_before(wrapped, ids) + storage_bytes([kwargs["labels"]])
    return until_complete(lambda: profiled(step), before, 0, f"hf {strategy} {reentrant}: ").peak


def _hf_worker(rank: int, world_size: int, port: int, work_dir: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        results = {_name(*case): _real_hf(*case) for case in HF_CASES}
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def hf_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    pytest.importorskip("transformers")
    work_dir = tmp_path_factory.mktemp("gloo-reentrant-hf")
    spawn_ranks(_hf_worker, WORLD, (str(work_dir),), timeout_s=600.0)
    ranks = [json.loads((work_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    return {_name(*case): [ranks[rank][_name(*case)] for rank in range(WORLD)] for case in HF_CASES}


#: One layer's CPU generator state (see :data:`RNG_STATES`); HF_CONFIG has 3 layers.
RNG_STATE = torch.get_rng_state().numel()
#: How many more generator states reentrance holds at the layers' backward peak: all 3 layers'
#: (until backward ends) against the non-reentrant checkpoint's 1 under DDP and 2 under FSDP2 (each
#: freed with its layer's saved tensors; FSDP2's peak comes a layer earlier), read off the runs' profilers.
MORE_STATES = {"ddp": 2, "fsdp": 1}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_transformers_own_reentrant_checkpoint_against_real_ranks(hf_peaks: dict[str, list[int]], strategy: str,
                                                                   tmp_path: Path) -> None:
    """transformers' layers checkpoint ``super().__call__``, so FSDP2's hooks run inside the reentrant
    checkpoint (in forward under ``no_grad``, again in the recomputation). The peak is in the
    layers' backward, where reentrance keeps one layer's output more (1 MiB) and more CPU generator
    states. Every rank to the byte. Measured 2026-12-07 (torch 2.13, both ranks alike): DDP
    73,208,008 B non-reentrant and 74,266,696 B reentrant; FSDP2 61,934,216 B and 62,987,848 B.
    Before the CPU target counted the generator states and the runs passed labels of their own
    (they passed ``input_ids`` as labels, 8,192 B less than a collator's batch), memcalc was
    +3,136, -6,976, -1,920 and -6,976 B off."""
    source = write_config(tmp_path, HF_CONFIG)
    estimates = {reentrant: memcalc.estimate(
        source, batch_size=HF_BATCH, seq_len=HF_SEQ, gpu="cpu", optimizer="sgd", loop=FOREACH,
        checkpoint=Checkpointing(CheckpointKind.FULL, reentrant=reentrant),
        distributed=memcalc.Distributed(strategy, world_size=WORLD)).peak_requested for reentrant in (False, True)}
    for reentrant in (False, True):
        for rank, real in enumerate(hf_peaks[_name(strategy, reentrant)]):
            estimate = estimates[reentrant]
            print(f"hf {_name(strategy, reentrant)} rank {rank}: real {real:,} B, estimate {estimate:,} B, "
                  f"{(estimate - real) / real:+.4%}")
        assert hf_peaks[_name(strategy, reentrant)] == [estimates[reentrant]] * WORLD
    one_layer_output = HF_BATCH * HF_SEQ * 256 * 4  # fp32
    assert estimates[True] - estimates[False] == one_layer_output + MORE_STATES[strategy] * RNG_STATE

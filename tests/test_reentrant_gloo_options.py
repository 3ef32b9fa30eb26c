"""Reentrant checkpointing under the wrapper options the first comparison left out, against real
two-process gloo runs (the harness of tests/gloo_runs.py, as tests/test_reentrant_ddp.py runs it):

- FSDP2 with ``reshard_after_forward=False`` (``Distributed("fsdp", sharding="shard_grad_op")``):
  the layers stay gathered from their forward to their backward, so a reentrant recomputation
  finds them unsharded; with the zoo's ``llama-tiny`` (the checkpoint outside FSDP2's hooks) and a
  transformers Llama (its layers checkpoint ``super().__call__``: the hooks inside);
- DDP's ``find_unused_parameters=True`` and ``static_graph=True`` (the Trainer passes
  ``find_unused_parameters=True`` for a model that is not a ``PreTrainedModel``, a ``PeftModel``
  among them, and ``ddp_static_graph`` through): measured beside plain DDP in the same run, with
  and without the reentrant checkpoint. torch's notes name ``static_graph=True`` as the way to run
  reentrant checkpointing where a layer is used more than once; ``find_unused_parameters=True``
  with the reentrant checkpoint is an error in torch (the parameters a checkpointed layer uses are
  unreachable from the output, so DDP marks them unused and then sees their gradients): recorded
  as the error the real run raises.

The same spawn runs that Llama under DDP and under ``fully_shard``'s defaults, with and without the
reentrant checkpoint, for the comparison of transformers' own checkpoint with the estimate
(test_transformers_own_reentrant_checkpoint_against_real_ranks, from tests/test_reentrant_ddp.py).

memcalc models no DDP option: the measured peaks say the options change nothing on this step
(the test asserts every rank equal to plain DDP's), so memcalc's DDP estimate holds for them; the
failing combination is refused where the Trainer would pass it
(memcalc.distributed.strategies.refuse_unused_reentrant, tests/test_kbit_trainer_cells.py).
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

#: A case's name for its checkpoint: none, non-reentrant ("plain"), reentrant.
_KINDS = {None: "none", False: "plain", True: "reentrant"}

WORLD = 2
ZOO = "torch:llama-tiny"
ZOO_BATCH, ZOO_SEQ = 2, 32
#: tests/test_reentrant_ddp.py's small-vocabulary Llama: its peak is in its layers' backward.
HF_CONFIG = {**llama_config(512, hidden=256, layers=3), "intermediate_size": 1024}
HF_BATCH, HF_SEQ = 2, 512
#: The runs step SGD(foreach=True); the estimates step the same implementation.
FOREACH = memcalc.Loop(optimizer_impl="foreach")

#: name -> (model, wrapper, checkpoint (None: none; else use_reentrant), wrapper options)
CASES: dict[str, tuple[str, str, bool | None, dict[str, bool]]] = {
    **{f"zoo-fsdp-sgo-{'reentrant' if r else 'plain'}": ("zoo", "fsdp", r, {"reshard_after_forward": False})
       for r in (False, True)},
    **{f"hf-fsdp-{sharding}-{_KINDS[r]}": ("hf", "fsdp", r, {"reshard_after_forward": sharding == "full"})
       for sharding in ("full", "sgo") for r in (None, False, True)},
    # fully_shard's defaults (the root left unsharded between forward and backward), as a user calls it:
    # test_transformers_own_reentrant_checkpoint_against_real_ranks
    **{f"hf-fsdp-default-{_KINDS[r]}": ("hf", "fsdp", r, {}) for r in (False, True)},
    **{f"hf-ddp-{_KINDS[r]}": ("hf", "ddp", r, {}) for r in (False, True)},
    **{f"hf-ddp-static-{_KINDS[r]}": ("hf", "ddp", r, {"static_graph": True}) for r in (False, True)},
    "hf-ddp-unused-plain": ("hf", "ddp", False, {"find_unused_parameters": True}),
    # last: its backward fails on both ranks, and the process group is not used after it
    "hf-ddp-unused-reentrant": ("hf", "ddp", True, {"find_unused_parameters": True}),
}


def _zoo_model(reentrant: bool | None) -> tuple[nn.Module, dict[str, Any], list[nn.Module]]:
    from memcalc.sources.resolve import resolve

    model, inputs = resolve(ZOO, batch_size=ZOO_BATCH, seq_len=ZOO_SEQ).build_real(torch.device("cpu"))
    layers = list(model.get_submodule("model.layers"))
    for layer in layers:
        forward = layer.forward

        def run(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if reentrant:  # CheckpointFunction takes no keyword arguments: bind them, as transformers does
                return checkpoint(lambda *a: _forward(*a, **kwargs), *args, use_reentrant=True)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        layer.forward = run
    assert not inputs.kwargs
    return model, {"x": inputs.args[0]}, layers


def _hf_model(reentrant: bool | None) -> tuple[nn.Module, dict[str, Any], list[nn.Module]]:
    import transformers

    config = transformers.AutoConfig.for_model(**HF_CONFIG)
    model: nn.Module = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids = torch.randint(0, 512, (HF_BATCH, HF_SEQ), generator=torch.Generator().manual_seed(1))
    # labels a tensor of their own, as a collator makes them and memcalc's step has them
    return model, {"input_ids": ids, "labels": ids.clone()}, list(model.model.layers)


def _real_peak(name: str) -> int | str:
    """This rank's peak for case ``name`` (the storages alive before the step plus the profiler's
    peak over it), or the error the real run raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memcalc.measure.step import storage_bytes

    kind, wrapper, reentrant, options = CASES[name]
    torch.manual_seed(0)  # the same weights on every rank
    model, inputs, layers = (_zoo_model if kind == "zoo" else _hf_model)(reentrant)
    if wrapper == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model, **options)
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in layers:
            fully_shard(layer, mesh=mesh, **options)
        wrapped = fully_shard(model, mesh=mesh, **options)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    first = next(iter(inputs.values()))

    def step() -> None:
        optimizer = torch.optim.SGD(trainable, lr=1e-3, foreach=True)
        for _ in range(2):
            out = wrapped(**inputs) if kind == "hf" else wrapped(inputs["x"])
            loss = out.loss if kind == "hf" else out.mean()
            loss.backward()
            del out, loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del optimizer
        gc.collect()

    try:
        step()  # the warm-up (FSDP's lazy init, DDP's bucket rebuild and static graph's first iteration)
    except RuntimeError as error:
        return f"RuntimeError: {str(error).splitlines()[0]}"
    before = _storages_before(wrapped, first) + storage_bytes([t for t in inputs.values() if t is not first])
    return until_complete(lambda: profiled(step), before, 0, f"{name}: ").peak


def _worker(rank: int, world_size: int, port: int, work_dir: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    results: dict[str, Any] = {}
    try:
        for name in CASES:
            results[name] = _real_peak(name)
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    pytest.importorskip("transformers")
    work_dir = tmp_path_factory.mktemp("gloo-reentrant-options")
    spawn_ranks(_worker, WORLD, (str(work_dir),), timeout_s=900.0)
    ranks = [json.loads((work_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    print(json.dumps(ranks))
    return {name: [ranks[rank][name] for rank in range(WORLD)] for name in CASES}


def _estimate(kind: str, reentrant: bool | None, tmp_path: Path, **distributed: Any) -> int:
    source, batch, seq = ((ZOO, ZOO_BATCH, ZOO_SEQ) if kind == "zoo"
                          else (write_config(tmp_path, HF_CONFIG), HF_BATCH, HF_SEQ))
    loss = {"loss": "mean"} if kind == "zoo" else {}
    return memcalc.estimate(source, batch_size=batch, seq_len=seq, gpu="cpu", optimizer="sgd", loop=FOREACH,
                            **loss, checkpoint=(False if reentrant is None
                                                else Checkpointing(CheckpointKind.FULL, reentrant=reentrant)),
                            distributed=memcalc.Distributed(world_size=WORLD, **distributed)).peak_requested



def _per_rank(real_peaks: dict[str, list[Any]], name: str, estimate: int) -> list[int]:
    """Each rank's real peak less the estimate, printed."""
    gaps = []
    for rank, real in enumerate(real_peaks[name]):
        print(f"{name} rank {rank}: real {real:,} B, estimate {estimate:,} B, {(estimate - real) / real:+.4%}")
        gaps.append(real - estimate)
    return gaps


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_zoo_shard_grad_op_to_the_byte(real_peaks: dict[str, list[Any]], reentrant: bool, tmp_path: Path) -> None:
    """The checkpoint outside FSDP2's hooks, the layers kept gathered from forward to backward:
    every rank to the byte, the reentrant checkpoint's CPU generator states (8 layers') included.
    Measured 2026-12-07 (load ~13): 555,588,116 B and 555,628,564 B, both ranks, the same as
    FULL_SHARD's (tests/test_reentrant_ddp.py: the peak is in the head's backward)."""
    estimate = _estimate("zoo", reentrant, tmp_path, strategy="fsdp", sharding="shard_grad_op")
    assert _per_rank(real_peaks, f"zoo-fsdp-sgo-{_KINDS[reentrant]}", estimate) == [0] * WORLD


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["no-checkpoint", "non-reentrant", "reentrant"])
def test_hf_shard_grad_op_to_the_byte(real_peaks: dict[str, list[Any]], reentrant: bool | None,
                                      tmp_path: Path) -> None:
    """transformers' layers (FSDP2's hooks inside the checkpoint) under ``reshard_after_forward``
    False and True, in the same run: every rank to the byte, both. Without checkpointing the layers
    kept gathered raise the peak (real and estimate alike: the case shows the option took effect);
    with the checkpoint the peak is in the middle layer's backward, where FULL_SHARD's backward
    prefetch holds the same two layers gathered, so both peaks are equal. (Before the CPU target
    counted the checkpoint's CPU generator states and the runs passed labels of their own, both
    shardings were off by the same +8,192, -1,920 and -6,976 B.)"""
    kind = _KINDS[reentrant]
    full = _estimate("hf", reentrant, tmp_path, strategy="fsdp")
    sgo = _estimate("hf", reentrant, tmp_path, strategy="fsdp", sharding="shard_grad_op")
    assert _per_rank(real_peaks, f"hf-fsdp-full-{kind}", full) == [0] * WORLD
    assert _per_rank(real_peaks, f"hf-fsdp-sgo-{kind}", sgo) == [0] * WORLD
    if reentrant is None:
        assert sgo > full


@pytest.mark.parametrize("option", ["static", "unused"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_ddp_options_change_no_memory(real_peaks: dict[str, list[Any]], option: str, reentrant: bool) -> None:
    """``static_graph=True`` and ``find_unused_parameters=True`` against plain DDP in the same run,
    every rank: equal to the byte (73,208,008 B non-reentrant, 74,266,696 B reentrant on 2026-12-07
    evening; 73,199,816 and 74,258,504 B that morning), so memcalc's DDP estimate (which models neither)
    holds for them; except ``find_unused_parameters=True`` with the reentrant checkpoint, which torch
    refuses in backward."""
    name = f"hf-ddp-{option}-{_KINDS[reentrant]}"
    if option == "unused" and reentrant:
        assert all(str(result).startswith("RuntimeError: Expected to mark a variable ready only once")
                   for result in real_peaks[name]), real_peaks[name]
        return
    assert real_peaks[name] == real_peaks[f"hf-ddp-{_KINDS[reentrant]}"]


#: One layer's CPU generator state (the CPU target counts it: memcalc.targets.cpu.generator); HF_CONFIG has 3 layers.
RNG_STATE = torch.get_rng_state().numel()
#: How many more generator states reentrance holds at the layers' backward peak: all 3 layers'
#: (until backward ends) against the non-reentrant checkpoint's 1 under DDP and 2 under FSDP2 (each
#: freed with its layer's saved tensors; FSDP2's peak comes a layer earlier), read off the runs' profilers.
MORE_STATES = {"ddp": 2, "fsdp": 1}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_transformers_own_reentrant_checkpoint_against_real_ranks(real_peaks: dict[str, list[Any]], strategy: str,
                                                                   tmp_path: Path) -> None:
    """transformers' layers checkpoint ``super().__call__``, so FSDP2's hooks run inside the reentrant
    checkpoint (in forward under ``no_grad``, again in the recomputation). The peak is in the
    layers' backward, where reentrance keeps one layer's output more (1 MiB) and more CPU generator
    states. Every rank to the byte. Measured 2026-12-07 (torch 2.13, both ranks alike): DDP
    73,208,008 B non-reentrant and 74,266,696 B reentrant; FSDP2 61,934,216 B and 62,987,848 B.
    Before the CPU target counted the generator states and the runs passed labels of their own
    (they passed ``input_ids`` as labels, 8,192 B less than a collator's batch), memcalc was
    +3,136, -6,976, -1,920 and -6,976 B off. (Moved from tests/test_reentrant_ddp.py, whose spawn of its
    own ran these DDP cases as this module's hf-ddp cases run them.)"""
    source = write_config(tmp_path, HF_CONFIG)
    estimates = {reentrant: memcalc.estimate(
        source, batch_size=HF_BATCH, seq_len=HF_SEQ, gpu="cpu", optimizer="sgd", loop=FOREACH,
        checkpoint=Checkpointing(CheckpointKind.FULL, reentrant=reentrant),
        distributed=memcalc.Distributed(strategy, world_size=WORLD)).peak_requested for reentrant in (False, True)}
    for reentrant in (False, True):
        name = f"hf-{strategy}-{_KINDS[reentrant]}" if strategy == "ddp" else f"hf-fsdp-default-{_KINDS[reentrant]}"
        assert _per_rank(real_peaks, name, estimates[reentrant]) == [0] * WORLD
    one_layer_output = HF_BATCH * HF_SEQ * 256 * 4  # fp32
    assert estimates[True] - estimates[False] == one_layer_output + MORE_STATES[strategy] * RNG_STATE

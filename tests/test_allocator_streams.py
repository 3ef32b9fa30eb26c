"""The allocator model's streams (issue 38, item 4), worked out by hand from
``c10/cuda/CUDACachingAllocator.cpp``, and FSDP2's collective buffers placed on their streams.

The facts of the source these tests hold the model to:

* ``BlockComparatorSize`` orders a pool's cached blocks by (stream, size, address), and
  ``get_free_block`` takes the lower bound of (request's stream, size) and gives up when that
  block belongs to another stream: a request never takes another stream's cached block.
* ``free`` → ``free_block`` puts the block back into its own pool, whose stream is the one it
  was allocated on (``block->stream``); without ``record_stream`` there are no events to wait on.
* ``release_cached_blocks`` (``empty_cache`` and the out-of-memory retry) walks every block of
  the large and the small pool, every stream's.
* ``find_expandable_block`` looks only at the unmapped ranges of the request's stream
  (``BlockComparatorAddress`` compares the stream first) and makes a new ``ExpandableSegment``
  for (stream, pool) when none has room: one segment per stream and pool.
* FSDP2 (``_fsdp_collectives.py``, torch 2.13): ``foreach_all_gather`` allocates the cast inputs
  and the all-gather output under ``device_handle.stream(all_gather_copy_in_stream)``;
  ``foreach_reduce`` the reduce-scatter output under ``device_handle.stream(reduce_scatter_stream)``
  and the reduce-scatter input on the current stream.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memcalc
from memcalc.core.alloc_conf import AllocConf
from memcalc.core.categories import Category
from memcalc.core.streams import Stream
from memcalc.core.units import format_bytes
from memcalc.engine.allocator import ALLOC, EMPTY_CACHE, FREE, CachingAllocatorModel, replay

MiB = 1 << 20
AG, RS = int(Stream.ALL_GATHER_COPY_IN), int(Stream.REDUCE_SCATTER)


def test_a_block_freed_on_the_all_gather_stream_is_not_reused_by_the_compute_stream():
    # 50 MiB is a multiple of 2 MiB (kRoundLarge): a 50 MiB segment per cudaMalloc.
    model = CachingAllocatorModel()
    model.malloc("gathered", 50 * MiB, AG)
    model.free("gathered")  # cached in the all-gather copy-in stream's pool
    model.malloc("activation", 50 * MiB)  # compute stream: get_free_block stops at AG's block
    assert model.reserved == 100 * MiB and model.allocated == 50 * MiB
    model.malloc("gathered again", 50 * MiB, AG)  # its own stream's cached block: no cudaMalloc
    assert model.reserved == 100 * MiB and model.stats().num_mallocs == 2
    model.check_invariants()
    # the same requests on one stream: the freed block serves the compute request, then a second segment
    single = replay([(ALLOC, 1, 50 * MiB), (FREE, 1, 0), (ALLOC, 2, 50 * MiB), (ALLOC, 3, 50 * MiB)])
    assert single.peak_reserved == 100 * MiB and single.num_mallocs == 2
    assert replay([(ALLOC, 1, 50 * MiB), (FREE, 1, 0), (ALLOC, 2, 50 * MiB)]).peak_reserved == 50 * MiB


def test_reserved_counts_every_streams_pools():
    # compute 50 MiB, all-gather 30 MiB (rounded to 2 MiB: 30), reduce-scatter 1 MiB (small pool: a
    # 2 MiB segment of its own although the compute stream has none, and its 1 MiB request would fit one)
    events = [(ALLOC, "a", 50 * MiB), (ALLOC, "g", 30 * MiB), (ALLOC, "r", MiB), (FREE, "g", 0), (FREE, "r", 0),
              (ALLOC, "s", 512)]
    stats = replay(events, streams={"g": AG, "r": RS})
    assert stats.peak_reserved == 50 * MiB + 30 * MiB + 2 * MiB + 2 * MiB  # "s": compute's own small segment
    assert stats.peak_reserved_by_stream == ((0, 52 * MiB), (AG, 30 * MiB), (RS, 2 * MiB))
    assert sum(nbytes for _, nbytes in stats.peak_reserved_by_stream) == stats.peak_reserved
    # one stream: "s" takes the cached small block, "g"'s segment stays cached, nothing is split by stream
    assert replay(events).peak_reserved == 50 * MiB + 30 * MiB + 2 * MiB
    assert replay(events).peak_reserved_by_stream == ()


def test_no_streams_is_the_single_stream_replay():
    events = [(ALLOC, k, (k * 7919) % (9 * MiB) + 1) for k in range(200)] + [(FREE, k, 0) for k in range(0, 200, 3)] \
        + [(ALLOC, 1000 + k, (k * 104729) % (30 * MiB) + 1) for k in range(50)] + [(EMPTY_CACHE, None, 0)]
    assert replay(events, streams={}) == replay(events) == replay(events, streams={k: 0 for k in range(2000)})


def test_empty_cache_and_the_oom_retry_release_every_streams_cached_segments():
    model = CachingAllocatorModel()
    model.malloc("g", 40 * MiB, AG)
    model.malloc("r", 4 * MiB, RS)  # a 20 MiB segment (1-10 MiB requests), its own stream's
    model.free("g")
    model.free("r")
    assert model.reserved == 60 * MiB
    model.empty_cache()
    assert model.reserved == 0 and model.stats().num_device_frees == 2
    # under a capacity of 100 MiB: AG's cached 60 MiB segment cannot serve the compute request,
    # the cudaMalloc of 60 MiB more would exceed 100, so the allocator frees every cached segment
    # (AG's too) and retries: no OOM, one retry, reserved back to 60 MiB
    stats = replay([(ALLOC, "g", 60 * MiB), (FREE, "g", 0), (ALLOC, "x", 60 * MiB)], capacity=100 * MiB,
                   streams={"g": AG})
    assert stats.oom_at is None and stats.num_alloc_retries == 1 and stats.num_device_frees == 1
    assert stats.peak_reserved == 60 * MiB and stats.final_reserved == 60 * MiB


def test_expandable_segments_one_segment_per_stream_and_pool():
    # expandable_segments:True: large-pool pages of 20 MiB (kLargeBuffer), small-pool ones of 2 MiB.
    model = CachingAllocatorModel(settings=AllocConf(expandable_segments=True))
    model.malloc("g", 30 * MiB, AG)  # AG's segment: 2 pages mapped, 40 MiB
    model.malloc("a", 5 * MiB)  # compute's own segment: 1 page, 20 MiB (AG's 10 free MiB are AG's)
    assert model.reserved == 60 * MiB
    model.free("g")  # AG's 40 MiB stay mapped, cached for AG
    model.malloc("b", 30 * MiB)  # compute: its free 15 MiB + one more page of its own segment
    assert model.reserved == 80 * MiB
    model.malloc("r", 512, RS)  # small pool of RS: a segment of its own, one 2 MiB page
    assert model.reserved == 82 * MiB
    segments = model.segments()  # each contiguous mapped run of each expandable segment
    assert [size for _, size, _ in segments] == [40 * MiB, 40 * MiB, 2 * MiB]
    bases = [base for base, _, _ in segments]
    assert len({base >> 40 for base in bases}) == 3  # three segments' address ranges (1 TiB each)
    model.check_invariants()
    model.free("a")
    model.free("b")
    model.free("r")
    model.empty_cache()  # every page of every stream's segment unmapped
    assert model.reserved == 0


def test_garbage_collection_ages_every_streams_blocks_by_one_clock():
    # garbage_collection_threshold 0.5 of 100 MiB: before a cudaMalloc, reserved over 50 MiB frees the
    # oldest unsplit cached large blocks, whatever their stream (garbage_collect_cached_blocks walks large_blocks)
    settings = AllocConf(garbage_collection_threshold=0.5)
    stats = replay([(ALLOC, "g", 40 * MiB), (FREE, "g", 0), (ALLOC, "a", 20 * MiB), (ALLOC, "b", 20 * MiB)],
                   capacity=100 * MiB, settings=settings, streams={"g": AG})
    # "a": reserved 40 ≤ 50, no collection, a 20 MiB segment (60); "b": 60 > 50, AG's cached 40 MiB goes
    assert stats.num_device_frees == 1 and stats.final_reserved == 40 * MiB and stats.peak_reserved == 60 * MiB


# --- FSDP2's buffers on their streams ----------------------------------------------------------


def _two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))


def _fsdp_trace(mixed: bool = False):
    from memcalc.distributed.fsdp import ShardedProgram, fsdp_units
    from memcalc.engine.step_spec import Step
    from memcalc.sources.resolve import resolve
    from memcalc.targets.backend import trace_step

    resolved = resolve(_two_layers, input_shape=(1024,), batch_size=1)
    # dp_shard's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) when mixed
    program = ShardedProgram(fsdp_units(resolved.module, ()), 4, style="fsdp2", reshard_after_forward=True,
                             sharded_dtype=torch.float32 if mixed else None,
                             gather_dtype=torch.bfloat16 if mixed else None,
                             reduce_dtype=torch.float32 if mixed else None, training=True)
    return trace_step(resolved, Step(), hooks=program)


@pytest.fixture
def fsdp_trace():
    return _fsdp_trace()


def test_fsdp2_allocates_all_gather_outputs_and_sharded_gradients_on_their_streams(fsdp_trace):
    trace, categories = fsdp_trace.trace, fsdp_trace.categories
    on = {stream: sorted((trace.nbytes[u], categories[u]) for u, s in trace.stream.items() if s == stream)
          for stream in (AG, RS)}
    # two units of one 1024x1024 fp32 Linear over 4 ranks: each all-gather output is the whole
    # unit, 4 MiB, gathered in forward and again in backward (fp32: no cast inputs); each
    # reduce-scatter output is the rank's sharded gradient, 1 MiB
    assert on[AG] == [(4 * MiB, Category.WORKSPACE)] * 4
    assert on[RS] == [(MiB, Category.GRADIENTS)] * 2
    assert set(trace.stream.values()) == {AG, RS}
    assert not set(trace.stream) & set(trace.preexisting)


def test_fsdp2_reserved_counts_the_collective_streams_pools():
    # The CUDA target (a generic GPU): the all-gather copy-in stream holds 4 MiB outputs, at most
    # two alive, in one 20 MiB segment (1-10 MiB requests: kLargeBuffer); the reduce-scatter stream
    # holds two 1 MiB sharded gradients in one 2 MiB small segment. Reserved only grows with no
    # limit, so at its peak the pools are at their final size.
    report = memcalc.estimate(_two_layers, input_shape=(1024,), batch_size=1, loss="mean", optimizer="adam",
                              distributed=memcalc.Distributed("fsdp", world_size=4))
    role = report.roles[0].report
    note = next(n for n in role.notes if n.startswith("streams:"))
    assert "all-gather copy-in 20.00 MiB" in note and "reduce-scatter 2.00 MiB" in note
    compute = role.peak_reserved_unconstrained - 22 * MiB
    assert f"compute {format_bytes(compute)}," in note


class _StreamRecorder:
    """Which stream each new CPU storage of a real ``fully_shard`` step is born on: FSDP2 selects
    its streams with ``device_handle.stream(s)``, which on the CPU is ``torch.cpu.stream``, a
    no-op that this records; the storages come from a dispatch mode, as memcalc's tracer sees them."""

    def __init__(self) -> None:
        self.current: list[object] = []
        self.births: list[tuple[int, int]] = []  # (bytes, id of the current stream object or 0)
        self._seen: dict[int, object] = {}

    def stream(self, stream: object):
        from contextlib import contextmanager

        @contextmanager
        def selected():
            self.current.append(stream)
            try:
                yield
            finally:
                self.current.pop()

        return selected()

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Births(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for tensor in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                        storage = tensor.untyped_storage()
                        if id(storage) not in recorder._seen and storage.nbytes():
                            # held, not weakly: a collected wrapper's id is reused by a later storage,
                            # which would then pass for seen (a birth lost, as once under xdist)
                            recorder._seen[id(storage)] = storage
                            current = recorder.current[-1] if recorder.current else None
                            recorder.births.append((storage.nbytes(), id(current) if current is not None else 0))
                return out

        return Births()


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-params"])
def test_fsdp2_streams_are_the_ones_real_fully_shard_allocates_on(fake_process_group, monkeypatch, mixed):
    # torch's own fully_shard on the CPU over the fake process group (its collectives allocate
    # nothing), the second training step's forward and backward: every storage born under a side
    # stream, by size and stream, is what memcalc's FSDP2 program allocates on that stream
    # (the same model, 4 ranks). The all-gather stream itself allocates nothing. Under
    # MixedPrecisionPolicy(param_dtype=bfloat16) the copy-in stream also holds the shards cast
    # to bf16 (_get_param_all_gather_inputs' flat foreach copy), 0.5 MiB, and the output is bf16.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    assert fake_process_group == 4
    recorder = _StreamRecorder()
    monkeypatch.setattr(torch.cpu, "stream", recorder.stream)
    torch.manual_seed(0)
    model = _two_layers()
    mesh = init_device_mesh("cpu", (fake_process_group,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    x = torch.randn(1, 1024)
    model(x).mean().backward()  # the first step: lazy init makes the streams (FSDPCommContext)
    model.zero_grad(set_to_none=True)
    context = model._get_fsdp_state()._comm_ctx
    names = {id(context.all_gather_copy_in_stream): AG, id(context.reduce_scatter_stream): RS,
             id(context.all_gather_stream): -1, id(context.all_reduce_stream): -2}
    recorder.births.clear()
    with recorder.mode():
        model(x).mean().backward()
    real = sorted((nbytes, names[stream]) for nbytes, stream in recorder.births if stream)
    trace = _fsdp_trace(mixed).trace
    estimated = sorted((trace.nbytes[u], stream) for u, stream in trace.stream.items())
    expected = [(MiB // 2, AG)] * 4 + [(MiB, RS)] * 2 + [(2 * MiB, AG)] * 4 if mixed \
        else [(MiB, RS)] * 2 + [(4 * MiB, AG)] * 4
    assert real == estimated == expected


def _two_stream_snapshot(side: int) -> dict:
    """A ``torch.cuda.memory._snapshot()`` of the first test's requests, as a real allocator records
    them: a 50 MiB block on stream ``side`` freed, a 50 MiB request on the default stream
    (a cudaMalloc of its own), the side stream's request again (its cached block)."""
    a, b = 0x7F0000000000, 0x7F0004000000
    trace = [
        {"action": "segment_alloc", "addr": a, "size": 50 * MiB, "stream": side},
        {"action": "alloc", "addr": a, "size": 50 * MiB, "stream": side},
        {"action": "free_requested", "addr": a, "size": 50 * MiB, "stream": side},
        {"action": "free_completed", "addr": a, "size": 50 * MiB, "stream": side},
        {"action": "segment_alloc", "addr": b, "size": 50 * MiB, "stream": 0},
        {"action": "alloc", "addr": b, "size": 50 * MiB, "stream": 0},
        {"action": "alloc", "addr": a, "size": 50 * MiB, "stream": side},
    ]
    segments = [{"device": 0, "address": base, "total_size": 50 * MiB, "stream": stream, "segment_type": "large",
                 "blocks": [{"size": 50 * MiB, "requested_size": 50 * MiB, "state": "active_allocated"}]}
                for base, stream in ((a, side), (b, 0))]
    return {"segments": segments, "device_traces": [trace]}


def test_a_real_snapshots_streams_are_replayed_in_their_pools():
    from memcalc.measure.snapshot import read_snapshot, replay_snapshot

    side = 0x55D0C0DE  # a cudaStream_t as the snapshot records it
    snapshot = read_snapshot(_two_stream_snapshot(side))
    assert snapshot.reserved == (50 * MiB, 50 * MiB, 100 * MiB, 100 * MiB)
    assert dict(snapshot.streams) == {0: side, 2: side}
    replayed = replay_snapshot(snapshot)
    assert replayed.first_divergence is None and replayed.stats.peak_reserved == 100 * MiB
    assert replayed.stats.peak_reserved_by_stream == ((0, 50 * MiB), (side, 50 * MiB))
    # read as one stream, the default stream's request would take the freed block: 50 MiB, wrong
    one_stream = read_snapshot(_two_stream_snapshot(0))
    assert replay_snapshot(one_stream).first_divergence == 2

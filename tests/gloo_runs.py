"""Real multi-process training steps over gloo on the CPU, each rank's peak read from the
profiler: the reference for memcalc's DDP and FSDP2 estimates on the CPU target
(tests/test_gloo_runs.py). Unlike the fake process group of tests/test_strategies.py, these
runs allocate every buffer the real collectives allocate.

:func:`run_cases` starts ``world_size`` processes once for a list of :class:`GlooCase`s, forked
from a forkserver that has imported what they need (:func:`spawn_ranks`); each process joins a
gloo group over a localhost TCP store, and runs the cases in order, each on a fresh model,
wrapped as the case says.

How a rank's peak is measured: one warm-up step (FSDP's lazy init and DDP's bucket rebuild,
which a steady-state step does not repeat), then the step under ``torch.profiler``
(``profile_memory=True``): a fresh ``Adam(foreach=True)``, two iterations of memcalc's default
loop (loss = the output's mean, the output referenced until the optimizer step,
``zero_grad(set_to_none=True)``), the running sum of the ``[memory]`` events in time order
(:func:`memcalc.measure.step._profiler_peak`, as ``--measure`` reads a CPU run) on top of
the storages alive before it (parameters, buffers, the input, DDP's buckets).

Why a step can be measured more than once: gloo runs each collective on a worker thread, and
the profiler records a thread's allocations and frees only while that thread carries the
profiler's state, which ``ProcessGroupGloo::AsyncWork::execute`` gives the worker around the
collective's ``run()`` alone. A buffer the work holds (the reduce-scatter's clone of its input in
``reduce_scatter_tensor_coalesced``, FSDP2's all-gather output) is freed where the last reference
to the work is dropped: when that is gloo's worker, after the caller, the free goes unrecorded and
the running sum never comes down (a trace then ends one buffer or more above where it began). So
the step ends by dropping its optimizer: a complete trace ends where it began, and a rank repeats
the step until it has one (the ranks repeat together, since every step runs collectives).

The complete trace is not only the readable one: its peak is the ordering in which every buffer
dies when the caller drops it, the ordering memcalc models. In the other steps the process
really holds a buffer longer, and the CPU allocator's own counter peaks up to one buffer higher
in about a third of FSDP2's steps. torch 2.13's ``profile_all_threads`` records no ``[memory]``
event at all (the allocator reports only to the thread-local profiler state), so it cannot
complete a trace. Measurements and torch's code: docs/notes/gloo-traces.md.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException

from memcalc.core.finetune import FineTune

#: How many times a rank may repeat the step to get a complete trace: from a third to a half of
#: FSDP2's traces are complete on torch 2.13 on an idle machine (ten repeats were seen once), and
#: as many beside three busy loops; but a fresh-clone CI run beside three suite replays once found
#: none in 40. Each repeat of these tiny steps takes a fraction of a second, and an idle run stops
#: at its first complete trace, so the bound is generous: it only decides when a run gives up.
MAX_ATTEMPTS = 150
#: The Hugging Face Trainer's steps (its own loop and TRL's, tests/test_trainer_gloo.py and
#: test_trl_trainer_gloo.py) leave incomplete traces far more often: 2 to 109 repeats, and DPO under
#: FSDP2 232 to 370 on an idle machine (2026-12-07; a `dist.barrier()` closing the window did not
#: help), about 0.4 s each. A bound, not a cost: a run stops at its first complete trace on every rank.
TRAINER_MAX_ATTEMPTS = 1000
#: How the ranks start: forked from one server process per test process, which has imported what
#: they import (:data:`PRELOAD`), instead of a fresh interpreter each (``spawn``) that imports torch
#: again: seconds of CPU a rank. The forkserver, unlike ``fork``, forks from a process that has run
#: no test (no threads, no process group, no profiler).
START_METHOD = "forkserver"
#: The forkserver's preload (tests/gloo_preload.py).
PRELOAD = "gloo_preload"
#: The environment the forkserver starts with, and so every rank forked from it: each rank's OpenMP
#: threads (libgomp's, torch's parallel backend) sleep between parallel regions instead of spinning
#: (libgomp's default spins at every barrier until its spin count runs out). The ranks keep the test
#: process's thread count (:func:`_rank`); only how an idle thread waits changes, which allocates
#: nothing. Four to sixteen ranks of two threads each share CI's two cores with the other xdist
#: worker, and a spinning thread holds a core that the rank it waits on needs: on 2026-12-07 (the
#: 2-core AMD EPYC host, load 6-13, tests/test_gloo_pipeline_cp.py's pp=2 x cp=2 x tp=2 GPipe case,
#: the same peaks to the byte) 192 s -> 63 s. libgomp reads it once, when torch loads it (the
#: preload), so it is set for the forkserver's start; a value the user exported is kept.
RANK_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}
#: Input features, batch and model width of :class:`BlockNet`.
FEATURES = 64
BATCH = 16


class Block(nn.Module):
    """A residual MLP block: an FSDP unit."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class BlockNet(nn.Module):
    """Three blocks in a ModuleList (memcalc's FSDP units, and the runs' ``fully_shard`` units)
    between an input and an output layer, which belong to the root. The head's 9 rows do not
    divide by 2 ranks: FSDP2 pads its shard, and the CPU's ``chunk_cat`` pads its gradient."""

    def __init__(self, d: int = 256, blocks: int = 3, classes: int = 9):
        super().__init__()
        self.inp = nn.Linear(FEATURES, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass(frozen=True)
class GlooCase:
    """One real run: ``strategy`` ("ddp" or "fsdp") over :class:`BlockNet`, fine-tuned by
    ``finetune`` (memcalc's :func:`~memcalc.stacks.peft.finetune_module`, PEFT for LoRA)
    before it is wrapped.

    Attributes:
        gradient_as_bucket_view: DDP's argument.
        reshard_after_forward: ``fully_shard``'s argument on every block and on the root
            (None: its default, which leaves the root unsharded between forward and backward).
        replicate: FSDP over a 2-D mesh of ``(replicate, world_size // replicate)`` ranks
            (HSDP: sharded within a row, replicated across rows) when above 1.
        compile: each block's forward compiled by ``torch.compile`` (Inductor) before the
            model is wrapped, as torchtitan's ``apply_compile`` does.
        batch: the samples of each rank's step.
        float8: torchao's ``convert_to_float8_training`` with ``Float8LinearConfig(emulate=True)``
            (float8 casts, fp32 matmuls: it runs on the CPU) before the model is wrapped.
        float8_all_gather: with ``enable_fsdp_float8_all_gather=True`` too (FSDP2 all-gathers the
            converted weights in float8, torchao's ``WeightWithDynamicFloat8CastTensor``).
    """

    name: str
    strategy: str
    finetune: FineTune = field(default_factory=FineTune)
    gradient_as_bucket_view: bool = False
    reshard_after_forward: bool | None = None
    replicate: int = 1
    compile: bool = False
    batch: int = BATCH
    float8: bool = False
    float8_all_gather: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"a gloo run wraps the model in DDP or FSDP, not {self.strategy!r}")
        if self.replicate > 1 and self.strategy != "fsdp":
            raise ValueError("replicate (HSDP) goes with fsdp")


@dataclass(frozen=True)
class RankPeak:
    """What one rank measured.

    Attributes:
        peak: bytes: the storages alive before the step plus the profiler's peak over it.
        step_counters: bytes of Adam's ``step`` tensors, 4 per trainable parameter tensor:
            CPU memory that memcalc leaves out (on a GPU they stay on the host).
        attempts: steps run to get a complete trace.
    """

    peak: int
    step_counters: int
    attempts: int

    @property
    def step_peak(self) -> int:
        """The peak without Adam's step counters: what memcalc's estimate describes."""
        return self.peak - self.step_counters


class GlooRunError(RuntimeError):
    """The processes failed, hung, or could not get a complete trace."""


#: What each harness's ``timeout_s`` is multiplied by (``MEMCALC_GLOO_TIMEOUT_SCALE`` overrides it). The
#: timeouts were set at two to three times a run's time on the 2-core Intel host of the earlier sessions;
#: on 2026-12-07 a clean-clone `.ci/run` on a 2-core AMD EPYC host about 2.4 times slower (``import torch``
#: 2.9 CPU-s against 1.2), at a load average of 25, errored in the gloo fixtures of the compiled and the
#: float8 runs with their rank files unwritten, while the float8 run alone passed in 121 s. A hang is
#: still caught, only later.
HANG_GUARD_SCALE = 4.0


def hang_guard_scale() -> float:
    """:data:`HANG_GUARD_SCALE`, or ``MEMCALC_GLOO_TIMEOUT_SCALE`` where it is set (a positive number)."""
    given = os.environ.get("MEMCALC_GLOO_TIMEOUT_SCALE")
    if given is None:
        return HANG_GUARD_SCALE
    scale = float(given)
    if not scale > 0:
        raise ValueError(f"MEMCALC_GLOO_TIMEOUT_SCALE={given!r}: a positive number, please")
    return scale


def spawn_ranks(worker: Callable[..., None], world_size: int, args: tuple[Any, ...], timeout_s: float,
                what: str = "gloo runs") -> None:
    """Run ``worker(rank, world_size, port, *args)`` on ``world_size`` processes forked from the
    forkserver (:func:`start_forkserver`), the parent holding the rendezvous store's server (no
    port is picked and then lost to another process), and wait for them all (every harness here:
    DDP/FSDP2, TP, PP, EP). Each rank runs on this process's CPU threads (:func:`_rank`).

    ``timeout_s`` is a hang guard, sized on an idle fast host: it is stretched by
    :func:`hang_guard_scale` so that a slower host under CI's load does not read as a hang.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s`` × :func:`hang_guard_scale`.
    """
    timeout_s *= hang_guard_scale()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    start_forkserver()
    context = mp.start_processes(_rank, args=(torch.get_num_threads(), worker, world_size, store.port, *args),
                                 nprocs=world_size, join=False, start_method=START_METHOD)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise GlooRunError(f"the {what} took more than {timeout_s:.0f} s")
    except ProcessException as error:  # a rank raised, or died
        raise GlooRunError(f"a rank failed:\n{error}") from error
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join()


def _rank(rank: int, threads: int, worker: Callable[..., None], *args: Any) -> None:
    """One rank: ``worker(rank, *args)`` on ``threads`` CPU threads, the count of the test process
    that compares its estimate with the ranks (tests/conftest.py's ``cpu_threads``): the CPU
    target sizes the flash kernels' per-thread buffers by that process's count. The forkserver's
    own is the machine's (it reads no test's setting)."""
    torch.set_num_threads(threads)
    worker(rank, *args)


def start_forkserver() -> None:
    """Start this process's forkserver, if it is not running, with :data:`PRELOAD` imported.

    The forkserver is a fresh interpreter, and Python 3.11's ignores the ``sys_path`` it is
    given (later releases apply it): it finds ``tests/`` on ``PYTHONPATH``, set for its start
    alone, as :data:`RANK_ENVIRONMENT` is. A preload it cannot import is skipped silently, and
    every rank then imports for itself.
    """
    from multiprocessing import forkserver

    mp.get_context(START_METHOD).set_forkserver_preload([PRELOAD])
    path = os.environ.get("PYTHONPATH")
    start_with = {**RANK_ENVIRONMENT, **{name: os.environ[name] for name in RANK_ENVIRONMENT if name in os.environ},
                  "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *([path] if path else [])])}
    saved = {name: os.environ.get(name) for name in start_with}
    os.environ.update(start_with)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def until_complete(measure: Callable[[], tuple[int, bool]], before: int, counters: int, name: str,
                   max_attempts: int = MAX_ATTEMPTS) -> RankPeak:
    """Measure the step again until every rank has one complete trace (``measure`` gives the
    profiler's peak and whether the trace saw every free): every step runs collectives, so the
    ranks stop together, at most ``max_attempts`` steps. ``before``: the bytes alive when the
    step starts; ``counters``: the bytes of Adam's CPU step counters (4 per trainable tensor)."""
    result = None
    for attempt in range(1, max_attempts + 1):
        peak, complete = measure()
        if complete and result is None:
            result = RankPeak(before + peak, counters, attempt)
        missing = torch.tensor([0 if result is not None else 1])
        dist.all_reduce(missing)
        if int(missing) == 0:
            break
    if result is None:
        raise GlooRunError(f"{name}no complete trace in {max_attempts} steps")
    return result


def measure_model_step(module: nn.Module, inputs: Any, config: Any) -> RankPeak:
    """One rank's real peak of memcalc's own step (``memcalc.engine.step.run_step``) on a module
    already laid out over its meshes: a warm-up step, then profiled steps until every rank has a
    complete trace; the bytes alive before the step are the local shards, buffers and inputs."""
    from memcalc.engine.step import run_step
    from memcalc.measure.step import storage_bytes

    run_step(module, inputs, config)  # the warm-up
    local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
    before = storage_bytes([*local, *module.buffers(), *inputs])
    trainable = [p for p in module.parameters() if p.requires_grad]

    def measured() -> tuple[int, bool]:
        return profiled(lambda: run_step(module, inputs, config))

    return until_complete(measured, before, 4 * len(trainable), "")


def run_cases(cases: Sequence[GlooCase], work_dir: Path, *, world_size: int = 2,
              timeout_s: float = 300.0) -> dict[str, list[RankPeak]]:
    """Run ``cases`` on ``world_size`` spawned processes over gloo.

    Returns:
        Each case's peaks, by rank.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    return run_on_ranks(_run_case, cases, work_dir, world_size, timeout_s)


def run_on_ranks(run_case: Callable[[Any, int, int], RankPeak], cases: Sequence[Any], work_dir: Path,
                 world_size: int, timeout_s: float, what: str = "gloo runs") -> dict[str, list[RankPeak]]:
    """Every case (anything with a unique ``name``) run by ``run_case(case, rank, world_size)`` on each
    of ``world_size`` gloo processes in one spawn, in order (every per-case harness here: DDP/FSDP2,
    TP and the pipelines; ``run_case`` a module-level function or a partial of one, so the forkserver's
    ranks can unpickle it); each case's peaks by rank.

    Raises:
        GlooRunError: a process failed or ran past ``timeout_s``.
    """
    names = [case.name for case in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names repeat: {names}")
    spawn_ranks(_cases_worker, world_size, (run_case, list(cases), str(work_dir)), timeout_s, what=what)
    peaks: dict[str, list[RankPeak]] = {name: [] for name in names}
    for rank in range(world_size):
        measured = json.loads((work_dir / f"rank{rank}.json").read_text())
        for name in names:
            peaks[name].append(RankPeak(**measured[name]))
    return peaks


def _cases_worker(rank: int, world_size: int, port: int, run_case: Callable[[Any, int, int], RankPeak],
                  cases: list[Any], work_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        results = {case.name: asdict(run_case(case, rank, world_size)) for case in cases}
    finally:
        dist.destroy_process_group()
    (Path(work_dir) / f"rank{rank}.json").write_text(json.dumps(results))


def _run_case(case: GlooCase, rank: int, world_size: int) -> RankPeak:
    from memcalc.core.categories import Mode
    from memcalc.core.precision import Precision
    from memcalc.stacks.peft import finetune_module

    torch.manual_seed(0)  # the same weights on every rank, as DDP and FSDP expect
    model: nn.Module = BlockNet()
    if not case.finetune.is_empty:
        model, _notes = finetune_module(model, case.finetune, precision=Precision.FP32, mode=Mode.TRAIN)
    if case.float8:  # memcalc's conversion is torchao's own convert_to_float8_training, with its layer filter
        from torchao.float8 import Float8LinearConfig

        from memcalc.core.float8 import Float8
        from memcalc.stacks.float8 import float8_module

        config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=case.float8_all_gather)
        model, _notes, _wrapper = float8_module(model, Float8("config", config))
    x = torch.randn(case.batch, FEATURES)
    wrapped = _wrap(case, model, world_size)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    _step(wrapped, x, trainable)  # the warm-up
    before = _storages_before(wrapped, x)
    return until_complete(lambda: _measured_step(wrapped, x, trainable), before, 4 * len(trainable),
                          f"{case.name}: ")


def _wrap(case: GlooCase, model: nn.Module, world_size: int) -> nn.Module:
    if case.compile:  # torchtitan's apply_compile: every block on its own, one code object for all
        from memcalc.engine.compiled import compile_forward, fresh_forward

        forward = fresh_forward(Block)
        for block in next(m for m in model.modules() if isinstance(m, nn.ModuleList)):
            compile_forward(block, "inductor", function=forward)
    if case.strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=case.gradient_as_bucket_view)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if case.replicate > 1:  # HSDP: FSDP2 on a 2-D mesh
        mesh = init_device_mesh("cpu", (case.replicate, world_size // case.replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    blocks = next(m for m in model.modules() if isinstance(m, nn.ModuleList))  # under PEFT's wrappers too
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=case.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=case.reshard_after_forward)
    return model


def _storages_before(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes alive when the step starts: the parameters (this rank's shards under FSDP), the
    buffers, the input and DDP's gradient buckets (the Reducer keeps them for the model's life)."""
    from memcalc.measure.step import storage_bytes

    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    local = [getattr(t, "_tensor", t) for t in local]  # torchao's float8 all-gather wrapper holds its shard
    nbytes = storage_bytes([*local, *model.buffers(), x])
    if isinstance(model, nn.parallel.DistributedDataParallel):
        buckets = model.reducer._get_zeros_like_grad_buckets()  # zeros of each bucket's size
        nbytes += sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)
    return nbytes


def _step(model: nn.Module, x: torch.Tensor, trainable: list[nn.Parameter]) -> None:
    """Two iterations of memcalc's default loop (the output referenced until the optimizer
    step) with a fresh Adam, which is dropped at the end with its state."""
    optimizer = torch.optim.Adam(trainable, foreach=True)
    for _ in range(2):
        out = model(x)
        loss = out.mean()
        loss.backward()
        del out, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del optimizer
    gc.collect()


def _measured_step(model: nn.Module, x: torch.Tensor, trainable: list[nn.Parameter]) -> tuple[int, bool]:
    """The step's peak over the storages alive before it, and whether its trace is complete
    (every byte it allocated seen freed)."""
    return profiled(lambda: _step(model, x, trainable))


def profiled(step: Callable[[], None]) -> tuple[int, bool]:
    """``step`` run once under torch's CPU profiler: its peak over the bytes alive before it, and
    whether its trace is complete (every byte it allocated seen freed), as
    :func:`until_complete` takes them."""
    from torch.profiler import ProfilerActivity, profile

    from memcalc.measure.step import _profiler_peak

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return _profiler_peak(prof), _net_bytes(prof) == 0


def _net_bytes(prof: Any) -> int:
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")

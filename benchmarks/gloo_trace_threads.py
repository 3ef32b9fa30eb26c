"""Why a real gloo rank's profiled step must be repeated (tests/gloo_runs.py), measured three ways
on the same steps (docs/gloo-traces.md).

Two gloo ranks wrap :class:`gloo_runs.BlockNet` as a case says (FSDP2 by default), run the warm-up
step, then ``--steps`` profiled steps (``gloo_runs._step``: two iterations of memcalc's loop, a
fresh Adam). For each step it prints, per rank:

* the running sum of the ``[memory]`` events (``memcalc.measure.step._profiler_peak``) and
  whether the trace is complete (net bytes 0), as the harness reads them;
* the peak of the CPU allocator's own live-bytes counter (``total_allocated`` on each recorded
  event, less its value before the step) with c10's ``FLAGS_caffe2_report_cpu_memory_usage``
  set, which makes ``ProfiledCPUMemoryReporter`` count every thread's frees, not only those of
  threads that carry the profiler's state: the memory the process really held;
* the allocations a trace saw made and not freed (their size and the ops they were made under),
  an allocation whose address was taken again before its free was seen counted too;
* with ``--all-threads``, the ``[memory]`` events recorded under
  ``_ExperimentalConfig(profile_all_threads=True)`` as well.

With ``--trainer CASE ...`` it runs the slow tests' own Trainer harnesses instead (a case of
tests/test_trainer_gloo.py, or of tests/test_trl_trainer_gloo.py with a ``trl:`` prefix), their
``profiled`` wrapped to tally, over the repeats ``until_complete`` makes, what each trace saw made
and not freed, and prints each rank's repeats and tally.

Run: ``PYTHONPATH=. python benchmarks/gloo_trace_threads.py [--strategy ddp] [--steps 20] [--all-threads]``,
or ``... --trainer ddp fsdp trl:dpo-fsdp``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # tests/ is not a package: found through sys.path
import gloo_runs

from memcalc.measure.step import _profiler_peak

#: c10's flag (c10/core/CPUAllocator.cpp): the CPU allocator's size table and live-bytes counter kept
#: on every allocation and free, whether or not the thread is profiled. Not exposed to Python.
REPORT_CPU_MEMORY_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def _allocations(prof: Any) -> list[Any]:
    """The profiler's allocation records (``[memory]`` events with their pointers), in time order."""
    def walk(nodes: list[Any]) -> list[Any]:
        return [m for n in nodes for m in (n, *walk(n.children))]

    found = [n for n in walk(prof.profiler.kineto_results.experimental_event_tree()) if n.tag == _EventType.Allocation]
    return sorted(found, key=lambda n: n.start_time_ns)


def _made_under(node: Any) -> str:
    names, parent = [], node.parent
    while parent is not None and len(names) < 3:
        names.append(parent.name)
        parent = parent.parent
    return " < ".join(names)


def _unfreed(allocations: list[Any]) -> list[str]:
    """The allocations whose free the trace did not see: never freed, or their address reused first."""
    alive: dict[int, Any] = {}
    lost = []
    for node in allocations:
        fields = node.extra_fields
        if fields.alloc_size > 0:
            if fields.ptr in alive:
                lost.append(alive[fields.ptr])
            alive[fields.ptr] = node
        else:
            alive.pop(fields.ptr, None)
    return [f"{n.extra_fields.alloc_size} B, {_made_under(n)}" for n in [*lost, *alive.values()]]


def _counter_peak(allocations: list[Any]) -> int:
    first = allocations[0].extra_fields
    before = first.total_allocated - first.alloc_size
    return max(n.extra_fields.total_allocated for n in allocations) - before


def _rank(rank: int, world_size: int, port: int, strategy: str, steps: int, all_threads: bool, out: str) -> None:
    libc10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(libc10, REPORT_CPU_MEMORY_FLAG).value = True
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    case = gloo_runs.GlooCase("bench", strategy)
    torch.manual_seed(0)
    model = gloo_runs._wrap(case, gloo_runs.BlockNet(), world_size)
    x = torch.randn(case.batch, gloo_runs.FEATURES)
    trainable = [p for p in model.parameters() if p.requires_grad]
    gloo_runs._step(model, x, trainable)
    rows = []
    for _ in range(steps):
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            gloo_runs._step(model, x, trainable)
        allocations = _allocations(prof)
        rows.append({"sum_peak": _profiler_peak(prof), "complete": gloo_runs._net_bytes(prof) == 0,
                     "counter_peak": _counter_peak(allocations), "unfreed": _unfreed(allocations)})
    if all_threads:
        config = _ExperimentalConfig(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, experimental_config=config) as prof:
            gloo_runs._step(model, x, trainable)
        events = list(prof.profiler.kineto_results.events())
        rows.append({"all_threads_memory_events": sum(e.name() == "[memory]" for e in events),
                     "all_threads_threads": len({e.start_thread_id() for e in events})})
    dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(rows))


def _harness(case: str) -> tuple[Any, str]:
    """The test module whose Trainer harness runs ``case``, and the case's name there."""
    import test_trainer_gloo

    if case.startswith("trl:"):
        import test_trl_trainer_gloo

        return test_trl_trainer_gloo, case.removeprefix("trl:")
    return test_trainer_gloo, case


def _tallied_peak(case: str, output_dir: str) -> gloo_runs.RankPeak:
    """``case``'s real peak by its own harness, each trace's unseen frees tallied in ``output_dir``'s parent."""
    module, name = _harness(case)
    tally: Counter[str] = Counter()

    def profiled(step: Any) -> tuple[int, bool]:
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        tally.update(_unfreed(_allocations(prof)))
        return _profiler_peak(prof), gloo_runs._net_bytes(prof) == 0

    module.profiled = profiled
    peak: gloo_runs.RankPeak = module._real_peak(name, output_dir)
    tallies = Path(output_dir).parent / f"tally-{case.replace(':', '-')}-{dist.get_rank()}.json"
    tallies.write_text(json.dumps(tally.most_common(8)))
    return peak


def trainer_main(cases: list[str]) -> None:
    import test_trainer_gloo

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        test_trainer_gloo.run_launched(_tallied_peak, cases, Path(out), 1200.0, "Trainer runs")
        for case in cases:
            for rank in range(test_trainer_gloo.WORLD):
                measured = json.loads((Path(out) / f"rank{rank}.json").read_text())[case]
                tally = json.loads((Path(out) / f"tally-{case.replace(':', '-')}-{rank}.json").read_text())
                print(f"{case} rank {rank}: peak {measured[0]} B after {measured[1]} steps; unfreed, over all of them:")
                for what, count in tally:
                    print(f"  x{count}: {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--all-threads", action="store_true")
    parser.add_argument("--trainer", nargs="+", metavar="CASE")
    args = parser.parse_args()
    if args.trainer:
        trainer_main(args.trainer)
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        gloo_runs.spawn_ranks(_rank, 2, (args.strategy, args.steps, args.all_threads, out), 300.0)
        ranks = [json.loads((Path(out) / f"rank{rank}.json").read_text()) for rank in range(2)]
    print(f"{args.strategy}, {args.steps} profiled steps a rank, torch {torch.__version__}")
    for rank, rows in enumerate(ranks):
        steps = [row for row in rows if "sum_peak" in row]
        complete = [row for row in steps if row["complete"]]
        print(f"rank {rank}: complete traces {len(complete)}/{len(steps)}; "
              f"running-sum peaks of the complete ones {sorted({row['sum_peak'] for row in complete})} B")
        print(f"  running-sum peaks, all steps: {sorted(Counter(row['sum_peak'] for row in steps).items())}")
        print(f"  allocator-counter peaks, all steps: {sorted(Counter(row['counter_peak'] for row in steps).items())}")
        for what, count in Counter(u for row in steps for u in row["unfreed"]).most_common():
            print(f"  unfreed x{count}: {what}")
        for row in rows:
            if "all_threads_memory_events" in row:
                print(f"  profile_all_threads: {row['all_threads_memory_events']} [memory] events, "
                      f"ops from {row['all_threads_threads']} threads")


if __name__ == "__main__":
    main()

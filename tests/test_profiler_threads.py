"""What torch's CPU profiler records on threads other than the one that started it: the two facts
that decide how tests/gloo_runs.py reads a rank's peak (docs/gloo-traces.md).

* A free on a thread that does not carry the profiler's state is not recorded. gloo's worker
  threads carry it only while a collective runs (``ProcessGroupGloo::AsyncWork::execute``: a
  ``ThreadLocalStateGuard`` around ``run()``); a collective's buffer freed when the worker drops
  its work afterwards is lost, so a rank repeats its step until a trace ends where it began.
* ``_ExperimentalConfig(profile_all_threads=True)`` records every thread's ops but no
  ``[memory]`` event at all on torch 2.13, its own thread's included: the all-threads state goes
  to the profiler's global slot (``ProfilerStateBase::push``), and the CPU allocator reports only
  to the thread-local one (``c10::reportMemoryUsageToProfiler``). So it cannot complete the
  gloo traces. If this test fails after a torch upgrade, the allocator has learnt to report to
  the global slot: try it in ``gloo_runs.profiled`` again.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from gloo_runs import _net_bytes
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

#: Elements of the tensors the tests allocate: 256 KiB of fp32, far above any bookkeeping allocation.
ELEMENTS = 1 << 16


def _on_another_thread(work: Any) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_a_free_on_a_thread_without_the_profilers_state_goes_unrecorded() -> None:
    held: list[torch.Tensor] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        held.append(torch.empty(ELEMENTS))
        _on_another_thread(held.clear)  # the last reference dropped there: the storage freed there
    assert not held
    # seen allocated on this thread, never seen freed: the trace ends 4 x 65,536 = 262,144 B above its start
    assert _net_bytes(prof) == 4 * ELEMENTS


def test_the_same_free_on_the_profiling_thread_is_recorded() -> None:
    held: list[torch.Tensor] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        held.append(torch.empty(ELEMENTS))
        held.clear()
    assert _net_bytes(prof) == 0


def test_profile_all_threads_records_every_threads_ops_but_no_memory() -> None:
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, experimental_config=config) as prof:
        kept = torch.ones(ELEMENTS)
        _on_another_thread(lambda: torch.ones(ELEMENTS))
    events = list(prof.profiler.kineto_results.events())
    assert kept.numel() == ELEMENTS
    assert len({e.start_thread_id() for e in events if e.name() == "aten::ones"}) == 2  # both threads' ops
    assert [e for e in events if e.name() == "[memory]"] == []  # not even this thread's 262,144 B

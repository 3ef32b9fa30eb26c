"""The quick suite's CPU, every process counted (issue 36 item 7: at most 60 s on 2 idle cores).

On a shared machine wall time says little, and ``/usr/bin/time`` misses the gloo ranks: they are
children of a forkserver that the xdist worker never waits for. This runs pytest as a child
subreaper (``PR_SET_CHILD_SUBREAPER``), so that every orphaned descendant is reaped here and its
CPU counted, and loads itself into pytest (``-p benchmarks.quick_suite_cpu``) to read, in each
process, the CPU of that process and everything under it (gloo ranks included) around each test
and at the end of collection. It prints the total, each worker's start and its tests, the slowest
tests by CPU, and the expected wall on idle cores: the CPU both workers shared over two cores,
plus the tail one worker ran alone. Asserts nothing.

Run (from the checkout to measure; a fresh ``git archive`` for the "clean clone" figure, since a
second run reads the rewritten asserts' bytecode where bytecode is written)::

    python benchmarks/quick_suite_cpu.py [--out DIR] [--top 20] [-- PYTEST ARGS]

The pytest arguments default to the README's quick command (``-q -p no:cacheprovider -m "not
slow" -n 2 --dist loadgroup``). For before and after, run it in both checkouts side by side (the
same load), and compare CPU-s, not wall.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QUICK = ["-q", "-p", "no:cacheprovider", "-m", "not slow", "-n", "2", "--dist", "loadgroup"]
#: prctl(2)'s PR_SET_CHILD_SUBREAPER (linux/prctl.h)
PR_SET_CHILD_SUBREAPER = 36
_OUT = "MEMCALC_QUICK_CPU_OUT"


# ---- the pytest plugin (in each pytest process: the controller and every xdist worker) ----------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _descendants(pid: int) -> list[int]:
    """The live descendants of ``pid``, read from /proc/PID/task/TID/children (Linux 3.5+): a few
    small reads, where listing every process of the machine (psutil) took 2 ms a call."""
    found: set[int] = set()
    stack = [pid]
    while stack:
        for task in Path(f"/proc/{stack.pop()}/task").glob("*/children"):
            try:
                children = {int(child) for child in task.read_text().split()} - found
            except OSError:  # the process ended meanwhile
                continue
            found |= children
            stack.extend(children)
    return sorted(found)


def _tree_cpu() -> float:
    """CPU-s of this process, its reaped children, and every live descendant with their reaped
    children (a gloo forkserver's finished ranks are in its ``cutime``/``cstime``)."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for pid in _descendants(os.getpid()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended between the listing and the read: its parent reaps it
            continue
        # proc(5): utime, stime, cutime, cstime are fields 14-17, the 12th-15th after the name
        total += sum(int(value) for value in fields[11:15]) / _TICK
    return total


_ROWS: list[list[Any]] = []
_STARTED: dict[str, float] = {}


def pytest_collection_finish(session: Any) -> None:
    _STARTED["@collected"] = _tree_cpu()


def pytest_runtest_protocol(item: Any, nextitem: Any) -> None:
    """Where the test runs (a worker, or the only process): not xdist's controller, whose
    ``pytest_runtest_logstart`` would count its workers' CPU."""
    _STARTED[item.nodeid] = _tree_cpu()


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if nodeid in _STARTED:
        _ROWS.append([nodeid, _tree_cpu() - _STARTED.pop(nodeid), time.time()])


def pytest_unconfigure(config: Any) -> None:
    out = os.environ.get(_OUT)
    if out:
        own = resource.getrusage(resource.RUSAGE_SELF)
        name = os.environ.get("PYTEST_XDIST_WORKER", "controller")
        Path(out, f"{name}.json").write_text(json.dumps({
            "rows": _ROWS, "collected": _STARTED.get("@collected"), "end": _tree_cpu(),
            "self": own.ru_utime + own.ru_stime}))


# ---- the driver -----------------------------------------------------------------------------------

def _run(pytest_args: list[str], out: Path) -> tuple[int, float, float]:
    """pytest under a subreaper; its exit status, the CPU of every descendant, and the wall."""
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, _OUT: str(out),
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start = time.time()
    status = subprocess.call([sys.executable, "-m", "pytest", "-p", "benchmarks.quick_suite_cpu", *pytest_args],
                             cwd=root, env=env)
    while True:  # the orphans: forkservers whose worker ended first
        try:
            os.wait()
        except ChildProcessError:
            break
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return status, reaped.ru_utime + reaped.ru_stime, time.time() - start


def _report(out: Path, total: float, wall: float, top: int) -> None:
    workers = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("gw*.json"))}
    controller = json.loads((out / "controller.json").read_text()) if (out / "controller.json").exists() else None
    rows = [row for data in workers.values() for row in data["rows"]] or (controller or {}).get("rows", [])
    tests = sum(row[1] for row in rows)
    print(f"all processes: {total:.1f} CPU-s ({wall:.0f} s wall, load average {os.getloadavg()[0]:.1f} now)")
    if controller is not None:
        print(f"  controller (pytest/xdist itself): {controller['self']:.1f} CPU-s")
    for name, data in workers.items():
        start = data["collected"] or 0.0
        print(f"  {name}: start and collection {start:.1f} CPU-s, {len(data['rows'])} tests "
              f"{sum(r[1] for r in data['rows']):.1f} CPU-s, in all {data['end']:.1f}")
    print(f"  tests: {len(rows)}, {tests:.1f} CPU-s")
    if len(workers) == 2:  # the tail: the tests the later worker ran after the other's last ended
        ends = {name: max((r[2] for r in data["rows"]), default=0.0) for name, data in workers.items()}
        first = min(ends.values())
        tail = sum(r[1] for data in workers.values() for r in data["rows"] if r[2] > first)
        print(f"  tail after one worker ended: {tail:.1f} CPU-s; expected wall on 2 idle cores "
              f"~ (all - tail) / 2 + tail = {(total - tail) / 2 + tail:.0f} s")
    print(f"\nslowest {top} tests by CPU-s (their own process and every process under it):")
    for row in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{row[1]:7.2f}  {row[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="where each process writes its figures (default: a temporary folder)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the quick suite)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="quick-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    status, total, wall = _run(args.pytest_args or QUICK, out)
    _report(out, total, wall, args.top)
    sys.exit(status)


if __name__ == "__main__":
    main()

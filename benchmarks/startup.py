"""Start-up and per-command overhead of the ``memcalc`` command (issue 36). Prints figures beside
their targets; asserts nothing (machines are noisy: each figure is the median of ``--repeat``
fresh processes, and the ratios are taken within one run).

1. ``memcalc --help``, ``--version``, ``zoo`` and ``gpus`` against the floor, a bare
   ``python -c "import click, tabulate"``: target at most 2x, and no torch imported.
2. An estimate (``mlp``, ``resnet50``): wall time, the ratio to the import floor of an estimate
   (``python -c "import torch"``), and whether it imported what it does not use (transformers,
   PEFT, the FLOP recorder without ``--time``): target none.
3. The cyclic collector paused during the trace and replay (:mod:`memcalc.engine.collector`), on
   and off, on a deep model: wall time, seconds spent in collections, and peak RSS (what the pause
   holds). Needs ``memcalc.engine.collector`` (skipped for a tree that predates it).

Run: ``python benchmarks/startup.py [--repeat 5] [--root DIR]``; ``--root`` times the commands of
another checkout (e.g. a worktree of an older commit: "before").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: Modules that only some requests use, reported when a command imported them.
HEAVY = ("torch", "transformers", "peft", "sympy", "torch._dynamo", "memcalc.timing.flops",
         "torch.utils.flop_counter")

#: Runs one ``memcalc`` command line in this interpreter, then prints the heavy modules it imported.
_RUN = """
import contextlib, io, json, sys
sys.path.insert(0, ".")
from memcalc.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:], prog_name="memcalc")
    except SystemExit as exc:
        assert not exc.code, exc.code
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
""".replace("{heavy!r}", repr(HEAVY))

#: One estimate with the collector paused or not; prints wall seconds, seconds in collections and peak RSS.
_GC_RUN = """
import gc, json, resource, sys, time
sys.path.insert(0, ".")
import memcalc
from memcalc.engine import collector
collector.PAUSE_COLLECTOR = sys.argv[1] == "paused"
spent = [0.0, 0]
start_of = {}
def watch(phase, info):
    if phase == "start":
        start_of["t"] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - start_of["t"]; spent[1] += 1
memcalc.estimate  # the API loaded before the clock starts: the import is the same both ways
import memcalc.api
gc.callbacks.append(watch)
t0 = time.perf_counter()
memcalc.estimate(sys.argv[2], batch_size=int(sys.argv[3]), seq_len=int(sys.argv[4]) or None, optimizer="adamw")
wall = time.perf_counter() - t0
print(json.dumps({"wall": wall, "gc_s": spent[0], "collections": spent[1],
                  "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def timed(argv: list[str], cwd: str) -> tuple[float, str]:
    """Wall seconds of one fresh process, and its last line of output."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    lines = done.stdout.strip().splitlines()
    return wall, lines[-1] if lines else ""


def paired(argv: list[str], floor: list[str], cwd: str, repeat: int) -> tuple[float, float, float, str]:
    """``argv`` and ``floor`` run in turn ``repeat`` times (after one warm-up of each): the median wall
    seconds of each, the median of the pairwise ratios (robust to a machine whose load drifts), and
    ``argv``'s last output line."""
    timed(argv, cwd)
    timed(floor, cwd)
    pairs = [(timed(floor, cwd)[0], timed(argv, cwd)) for _ in range(repeat)]
    return (statistics.median(w for _, (w, _) in pairs), statistics.median(f for f, _ in pairs),
            statistics.median(w / f for f, (w, _) in pairs), pairs[-1][1][1])


def commands(root: str, repeat: int) -> None:
    """Figures 1 and 2."""
    py = sys.executable
    light, heavy = [py, "-c", "import click, tabulate"], [py, "-c", "import torch"]
    print("\n1. commands that need no torch (target: at most 2.0x python -c 'import click, tabulate', no torch)")
    for args in (["--help"], ["--version"], ["zoo"], ["gpus"]):
        wall, floor, ratio, loaded = paired([py, "-c", _RUN, *args], light, root, repeat)
        print(f"   memcalc {' '.join(args):<10} {wall:6.2f} s  floor {floor:5.2f} s  {ratio:5.1f}x the floor  "
              f"imported: "
              f"{', '.join(json.loads(loaded)) or 'none of ' + '/'.join(HEAVY[:3])}")
    print("\n2. estimates (target: nothing imported that the request does not use)")
    for args in (["mlp", "--batch", "2"], ["resnet50", "--batch", "8"],
                 ["mlp", "--batch", "2", "--time", "--gpu", "h100-80gb"]):
        wall, floor, ratio, loaded = paired([py, "-c", _RUN, *args], heavy, root, repeat)
        unused = sorted(set(json.loads(loaded)) & {"transformers", "peft"} |
                        (set(json.loads(loaded)) & {"memcalc.timing.flops", "torch.utils.flop_counter"}
                         if "--time" not in args else set()))
        print(f"   memcalc {' '.join(args):<42} {wall:6.2f} s  'import torch' {floor:5.2f} s  {ratio:4.1f}x   "
              f"unused imports: {', '.join(unused) or 'none'}")


def collector(root: str, repeat: int, model: str, batch: int, seq_len: int) -> None:
    """Figure 3."""
    if not os.path.exists(os.path.join(root, "memcalc", "engine", "collector.py")):
        print("\n3. (this tree has no memcalc.engine.collector: the collector runs throughout)")
        return
    print(f"\n3. {model}, batch {batch}, seq {seq_len}, AdamW: the collector paused during trace and replay, or not "
          f"(median of {repeat})")
    rows = {}
    for state in ("running", "paused"):
        runs = [json.loads(timed([sys.executable, "-c", _GC_RUN, state, model, str(batch), str(seq_len)], root)[1])
                for _ in range(repeat)]
        rows[state] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        r = rows[state]
        print(f"   collector {state:<8} estimate {r['wall']:6.2f} s   in collections {r['gc_s']:5.2f} s "
              f"({r['collections']:.0f})   peak RSS {r['maxrss_mib']:7.0f} MiB")
    run, pause = rows["running"], rows["paused"]
    extra = pause['maxrss_mib'] - run['maxrss_mib']
    print(f"   paused / running: time {pause['wall'] / run['wall']:.2f}x, peak RSS {extra:+.0f} MiB")


def main() -> None:
    """Print every figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose memcalc is timed (default: this one)")
    parser.add_argument("--model", default="torch:gpt2-xl", help="figure 3's model (default: 48 layers)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--only", choices=("commands", "collector"), default=None)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"root {args.root}")
    if args.only != "collector":
        commands(args.root, args.repeat)
    if args.only != "commands":
        collector(args.root, args.repeat, args.model, args.batch, args.seq_len)


if __name__ == "__main__":
    main()

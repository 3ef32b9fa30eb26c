"""What Python's cyclic collector costs after estimates (issue 36, item 4): ``--estimates N``
(default 20) estimates in one process, their reports kept as a notebook or a sweep keeps them,
taking turns over resnet50 (training, batch 8), gpt2 (training, 2 x 256), llama-2-7b generating
1,024 tokens after 512, a ``memcalc.sweep`` of gpt2 (batch 1 and 2) and ``max_batch_size`` of
gpt2 (A100 40 GB). The collector is paused inside each estimate (:mod:`memcalc.engine.collector`);
what is measured is every collection Python makes *between and after* them (``gc.callbacks``,
per generation: how many, their seconds), then ``gc.collect(0)``, ``(1)``, ``(2)`` timed once the
reports are all kept, and the containers of 10,000 entries or more the reports keep (walked from each
report), those the collector tracks (and walks entry by entry) first.

``--baseline DIR`` first runs this script on DIR's tree (a ``git archive`` of another commit) in
its own process with the same options, then on this one; ``--rounds R`` alternates the two R
times. Asserts nothing (machines are noisy; compare within one run).

Run: ``python benchmarks/gc_walk.py [--estimates 20] [--baseline DIR] [--rounds 1]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv
                else str(Path(__file__).resolve().parent.parent))

import numpy as np

_COLLECTIONS: dict[int, list[float]] = {0: [], 1: [], 2: []}
_STARTED: list[float] = []


def _callback(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _STARTED.append(time.perf_counter())
    elif _STARTED:
        _COLLECTIONS[info["generation"]].append(time.perf_counter() - _STARTED.pop())


def _cases() -> list[tuple[str, Any]]:
    import memcalc

    return [
        ("resnet50", lambda: memcalc.estimate("resnet50", batch_size=8, optimizer="adam")),
        ("gpt2", lambda: memcalc.estimate("gpt2", batch_size=2, seq_len=256, optimizer="adamw")),
        ("llama-2-7b generate", lambda: memcalc.estimate("llama-2-7b", batch_size=1, seq_len=512, mode="generate",
                                                         new_tokens=1024, optimizer="none")),
        ("sweep gpt2", lambda: memcalc.sweep("gpt2", batch_sizes=[1, 2], seq_len=256, optimizers=["adamw"])),
        ("max_batch_size gpt2", lambda: memcalc.max_batch_size("gpt2", gpu="a100-40gb", seq_len=256,
                                                               optimizer="adamw")),
    ]


def _big_containers(roots: list[Any], least: int) -> list[tuple[int, str, bool]]:
    """Containers reachable from ``roots`` through plain objects with at least ``least`` entries
    (modules and the torch objects the reports do not keep are not walked)."""
    seen: set[int] = set()
    stack = list(roots)
    found: list[tuple[int, str, bool]] = []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type, types.ModuleType)) or \
                type(obj).__module__.startswith(("torch", "transformers")):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, dict, tuple, set, np.ndarray)) and len(obj) >= least:
            item = next(iter(obj.values() if isinstance(obj, dict) else obj), None)
            found.append((len(obj), f"{type(obj).__name__} of {type(item).__name__}", gc.is_tracked(obj)))
        if isinstance(obj, (list, tuple, dict, set)) and len(obj) >= least:  # one entry each: they are alike
            stack.append(next(iter(obj.items() if isinstance(obj, dict) else obj), None))
            continue
        stack.extend(gc.get_referents(obj))
    return sorted(found, key=lambda f: (f[2], f[0]), reverse=True)  # what the collector walks first


def measure(estimates: int) -> dict[str, Any]:
    """This tree's figures: one process, ``estimates`` estimates after a warm-up of each case."""
    cases = _cases()
    for _, run in cases:  # imports, first builds
        run()
    gc.collect()
    start = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - start
    gc.callbacks.append(_callback)
    kept: list[Any] = []
    cpu = time.process_time()
    for n in range(estimates):
        kept.append(cases[n % len(cases)][1]())
    cpu = time.process_time() - cpu
    gc.callbacks.remove(_callback)
    after: dict[str, float] = {}
    for generation in (0, 1, 2):
        start = time.perf_counter()
        gc.collect(generation)
        after[str(generation)] = time.perf_counter() - start
    return {
        "estimates_cpu_s": cpu,
        "collections": {str(g): len(t) for g, t in _COLLECTIONS.items()},
        "collection_s": {str(g): sum(t) for g, t in _COLLECTIONS.items()},
        "collect_after_s": after,
        "full_collect_before_s": before,
        "tracked_objects": len(gc.get_objects()),
        "kept_containers": _big_containers(kept, 10_000)[:12],
    }


def _show(label: str, figures: dict[str, Any]) -> None:
    print(f"{label}: {figures['estimates_cpu_s']:.2f} CPU-s of estimates; collections during them "
          + ", ".join(f"gen{g} {figures['collections'][g]} ({figures['collection_s'][g]:.3f} s)" for g in "012")
          + "; gc.collect(0/1/2) after: " + ", ".join(f"{figures['collect_after_s'][g]:.4f}" for g in "012")
          + f" s (before the estimates: {figures['full_collect_before_s']:.4f}); "
          f"{figures['tracked_objects']:,} tracked objects")
    for size, kind, tracked in figures["kept_containers"]:
        print(f"    kept: {size:,}-entry {kind}{'' if tracked else ' (untracked)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimates", type=int, default=20)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tree", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.json or args.baseline is None:
        figures = measure(args.estimates)
        print(json.dumps(figures) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            _show("this tree", figures)
        return
    here = str(Path(__file__).resolve().parent.parent)
    print(f"load average at the start: {os.getloadavg()}")
    for _ in range(args.rounds):
        for label, tree in (("baseline", str(args.baseline)), ("this tree", here)):
            out = subprocess.run([sys.executable, __file__, "--json", "--estimates", str(args.estimates),
                                  "--tree", tree], check=True, capture_output=True, text=True).stdout
            _show(label, json.loads(out.strip().splitlines()[-1]))
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()

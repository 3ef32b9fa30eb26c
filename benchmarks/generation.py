"""``--mode generate`` in steady state (issue 36, item 5): the time of a generation of ``N`` new
tokens against a prefill-only estimate of the same model and prompt (``--new-tokens 1``), with the
steady decode steps extrapolated (:mod:`memcalc.engine.steady`: "after") and with every decode step
traced ("before"), measured in one run, one process; and whether both give the same report, byte
for byte (text and JSON). Target: after at most 2x the prefill-only estimate. Asserts nothing
(machines are noisy; the ratios are taken within one run).

The "floor" row is a generation of as many tokens as the extrapolation traces (the prefill and
four decode steps), traced in full and reported: what the extrapolated estimate costs at least
before it writes, replays and sums the steps it did not trace.

Each figure is one estimate through the API after a warm-up estimate (the imports and the model's
first build are not counted), split into its trace (``trace_model``, the extrapolation included)
and its report (``build_report``: the allocator replay of every event, the module rows).

The report's replay skips the small pool's repeated decode steps (:mod:`memcalc.engine.steady_replay`);
``--replay-all`` replays every event instead, for the figure before it.

Run: ``python benchmarks/generation.py [--model llama-2-7b] [--seq-len 512] [--new-tokens 1024]
[--skip-full] [--replay-all] [--cpu-time] [--repeat K] [--gpu NAME] [--baseline DIR]``; ``--skip-full`` leaves out
"before" (llama-2-7b, 1,024 tokens: minutes); ``--repeat K`` times the prefill-only estimate and
"after" K times each, taking turns, and prints their medians (a collection of Python's older
generations, 0.14 s when it falls in one estimate, moves a single figure by more than the change
measured); ``--baseline DIR`` first runs this script on DIR's tree (a ``git archive`` of another
commit: its ``memcalc``, this measuring code) with the same options in its own process, then on
this one: the two commits back to back; ``--gpu h100`` judges every estimate under that GPU's
capacity, where a long generation's unlimited peak reserved exceeds it and the replay under the
capacity decides (``--replay-all``: every event of both replays). The issue's two: ``--model
llama-2-7b`` (prompt 512, 1,024 tokens) and ``--model gpt2 --seq-len 256 --new-tokens 768`` (its whole
1,024-position context).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the tree measured: this script's own, or ``--tree DIR`` (how ``--baseline`` runs another commit)
sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv
                else str(Path(__file__).resolve().parent.parent))

import memcalc
import memcalc.estimation as estimate_module
import memcalc.targets.backend as backend_module
from memcalc.engine import steady, steady_replay
from memcalc.report.render import render_report

_SPLIT: dict[str, float] = {}
#: The clock: wall time, or with ``--cpu-time`` this process's CPU time (on a machine shared with
#: other loads, the wall time of one run inflates by the others' share, the CPU time much less).
_CLOCK: list[Callable[[], float]] = [time.perf_counter]


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = _CLOCK[0]()
        try:
            return function(*args, **kwargs)
        finally:
            _SPLIT[name] = _SPLIT.get(name, 0.0) + _CLOCK[0]() - start
    return run


#: ``--gpu``: the GPU every estimate is judged under (None: no capacity).
_GPU: list[str | None] = [None]


def _estimate(model: str, seq_len: int, tokens: int) -> tuple[memcalc.MemoryReport, float, dict[str, float]]:
    _SPLIT.clear()
    start = _CLOCK[0]()
    report = memcalc.estimate(model, batch_size=1, seq_len=seq_len, mode="generate", new_tokens=tokens,
                              optimizer="none", gpu=_GPU[0])
    return report, _CLOCK[0]() - start, dict(_SPLIT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--skip-full", action="store_true", help="leave out 'before' (every decode step traced)")
    parser.add_argument("--replay-all", action="store_true", help="replay every event (no skipped steps)")
    parser.add_argument("--cpu-time", action="store_true", help="time by this process's CPU time, not the wall clock")
    parser.add_argument("--baseline", type=Path, help="a tree of another commit, run first with the same options")
    parser.add_argument("--tree", type=Path, help="the tree whose memcalc is measured (default: this script's)")
    parser.add_argument("--repeat", type=int, default=1, help="time prefill-only and after this many times each")
    parser.add_argument("--gpu", help="judge every estimate under this GPU's capacity (h100: the replay under it)")
    args = parser.parse_args()
    _GPU[0] = args.gpu
    if args.baseline is not None:
        given = [a for i, a in enumerate(sys.argv[1:]) if a != "--baseline" and sys.argv[i] != "--baseline"
                 and not a.startswith("--baseline=")]
        print(f"== baseline: {args.baseline}", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), *given, "--tree", str(args.baseline)],
                       check=True, cwd=args.baseline, env={**os.environ, "PYTHONPATH": str(args.baseline)})
        print(f"== this tree: {sys.path[0]}", flush=True)
    if args.cpu_time:
        _CLOCK[0] = time.process_time
    if args.replay_all:
        steady_replay.SKIP_FROM = 10**9
    backend_module.trace_model = _timed("trace", backend_module.trace_model)  # type: ignore[attr-defined]
    estimate_module.build_report = _timed("report", estimate_module.build_report)  # type: ignore[attr-defined]

    _estimate(args.model, args.seq_len, 2)  # warm-up: imports, the config, the first build
    prefills, afters = [], []
    for _ in range(max(args.repeat, 1)):  # taking turns: each its median
        prefills.append(_estimate(args.model, args.seq_len, 1))
        afters.append(_estimate(args.model, args.seq_len, args.new_tokens))
    _, prefill, prefill_split = sorted(prefills, key=lambda row: row[1])[len(prefills) // 2]
    after, after_time, after_split = sorted(afters, key=lambda row: row[1])[len(afters) // 2]
    if len(afters) > 1:
        print(f"prefill only: {', '.join(f'{row[1]:.3f}' for row in prefills)} s; after: "
              f"{', '.join(f'{row[1]:.3f}' for row in afters)} s (medians below)")
    floor_tokens = max(steady.TRACED_TOKENS[0], 2)
    _, floor, floor_split = _estimate(args.model, args.seq_len, floor_tokens)  # under EXTRAPOLATE_FROM: in full
    rows = [("prefill only (--new-tokens 1)", prefill, prefill_split),
            (f"floor: {floor_tokens} tokens traced in full (what is traced)", floor, floor_split),
            (f"after: {args.new_tokens} tokens, steady steps extrapolated", after_time, after_split)]
    full = None
    if not args.skip_full:
        saved = steady.EXTRAPOLATE_FROM
        steady.EXTRAPOLATE_FROM = 10**9
        try:
            full, full_time, full_split = _estimate(args.model, args.seq_len, args.new_tokens)
        finally:
            steady.EXTRAPOLATE_FROM = saved
        rows.append((f"before: {args.new_tokens} tokens, every decode step traced", full_time, full_split))

    print(f"{args.model}, prompt {args.seq_len}, mode generate{f', --gpu {args.gpu}' if args.gpu else ''} (one "
          f"process, after a warm-up estimate{'; CPU seconds' if args.cpu_time else ''})")
    print(f"{'estimate':<58} {'seconds':>8} {'trace':>7} {'report':>7} {'x prefill':>10}")
    for name, seconds, split in rows:
        print(f"{name:<58} {seconds:8.2f} {split.get('trace', 0):7.2f} {split.get('report', 0):7.2f} "
              f"{seconds / prefill:9.1f}x")
    print(f"target: after at most 2.0x prefill only; after is {after_time / prefill:.1f}x"
          f"{' (every event replayed)' if args.replay_all else ''}")
    if full is not None:
        same_json = json.dumps(after.to_dict()) == json.dumps(full.to_dict())
        same_text = render_report(after) == render_report(full)
        print(f"before / after: {rows[3][1] / after_time:.1f}x; same report: JSON {same_json}, text {same_text}")
    print(f"peak allocated {after.bytes.peak_allocated:,} B, reserved {after.peak_reserved:,} B, at "
          f"{after.peak_location}")
    if after.fits is not None:
        print(f"fits: {after.fits}; reserved within the capacity {after.reserved_within_capacity:,} B, with no "
              f"limit {after.peak_reserved_unconstrained:,} B")
    note = [n for n in after.notes if "token by token" in n]
    if note:
        print(f"not extrapolated: {note[0]}")


if __name__ == "__main__":
    main()

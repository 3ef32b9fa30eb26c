"""How much does sharing a trace between identical pipeline ranks save (issue 33)?

Estimates a pipeline twice in one process, alternately, ``REPEATS`` times: with the middle ranks
sharing one trace (GPipe, looped BFS: ``memcalc.distributed.pipeline_share``) or composed from
one's calls (1F1B, interleaved 1F1B: ``pipeline_compose``), and with every rank traced
(``share_key`` answering None). Prints the CPU seconds of each (user + system of this process:
the wall time on a shared machine is its neighbours' too), their ratio, how many ranks shared,
and whether every rank's report is the same both ways (less the note that says it was shared).

    python benchmarks/pipeline_share.py [MODEL] [--pp 8] [--microbatches 8] [--seq-len 8192]
        [--schedule gpipe] [--tp 1] [--checkpoint full]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import memcalc
from memcalc.distributed import pipeline

REPEATS = 2
_SHARED = ("its trace shared", "its step composed from")


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def _shared(note: str) -> bool:
    return any(s in note for s in _SHARED)


def _rows(report: memcalc.MemoryReport) -> list[str]:
    rows = []
    for role in report.roles:
        mine = replace(role.report, notes=tuple(n for n in role.report.notes if not _shared(n)))
        rows.append(role.name + json.dumps(mine.to_dict(), sort_keys=True, default=str))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama-3-70b")
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--dp-shard", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--checkpoint", default="full", help="memcalc's --checkpoint, or 'off'")
    args = parser.parse_args()
    mesh = {"pp": args.pp, "dp_shard": args.dp_shard, **({"tp": args.tp} if args.tp > 1 else {})}
    setting = memcalc.Distributed(mesh=mesh, pp_schedule=args.schedule, microbatches=args.microbatches)
    kwargs = {"batch_size": args.microbatches, "seq_len": args.seq_len, "precision": "amp-bf16",
              "gpu": "h100-80gb", "distributed": setting,
              **({} if args.checkpoint == "off" else {"checkpoint": args.checkpoint})}
    share_key = pipeline.share_key
    best = {"shared": float("inf"), "traced": float("inf")}
    reports: dict[str, memcalc.MemoryReport] = {}
    for _ in range(REPEATS):
        for way in ("shared", "traced"):
            pipeline.share_key = share_key if way == "shared" else (lambda *_args: None)  # type: ignore[assignment]
            try:
                start = _cpu()
                reports[way] = memcalc.estimate(args.model, **kwargs)
                best[way] = min(best[way], _cpu() - start)
            finally:
                pipeline.share_key = share_key
    shared = sum(any(_shared(n) for n in r.report.notes) for r in reports["shared"].roles)
    print(f"{args.model}, {args.schedule}, {mesh}, {args.microbatches} microbatches of "
          f"{args.seq_len} positions: {shared} of {args.pp} ranks shared a trace or were composed")
    print(f"CPU seconds (best of {REPEATS}): shared {best['shared']:.1f}, every rank traced {best['traced']:.1f}, "
          f"ratio {best['shared'] / best['traced']:.2f}; load average {os.getloadavg()[0]:.1f}")
    print(f"every rank's report the same both ways: {_rows(reports['shared']) == _rows(reports['traced'])}")


if __name__ == "__main__":
    main()

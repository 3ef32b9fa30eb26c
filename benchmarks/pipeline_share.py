"""How much does sharing a trace between identical pipeline ranks save (issue 33)?

Estimates a GPipe pipeline twice in one process, alternately, ``REPEATS`` times: with the middle
ranks sharing one trace (``memcalc.distributed.pipeline_share``), and with every rank traced
(``share_key`` answering None). Prints the CPU seconds of each (user + system of this process:
the wall time on a shared machine is its neighbours' too), their ratio, how many ranks shared,
and whether every rank's report is the same both ways (less the note that says it was shared).

    python benchmarks/pipeline_share.py [MODEL] [--pp 8] [--microbatches 8] [--seq-len 8192]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import memcalc
from memcalc.distributed import pipeline

REPEATS = 2
_SHARED = "its trace shared"


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def _rows(report: memcalc.MemoryReport) -> list[str]:
    rows = []
    for role in report.roles:
        mine = replace(role.report, notes=tuple(n for n in role.report.notes if _SHARED not in n))
        rows.append(role.name + json.dumps(mine.to_dict(), sort_keys=True, default=str))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama-3-70b")
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--dp-shard", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    setting = memcalc.Distributed(mesh={"pp": args.pp, "dp_shard": args.dp_shard}, pp_schedule="gpipe",
                                  microbatches=args.microbatches)
    kwargs = {"batch_size": args.microbatches, "seq_len": args.seq_len, "precision": "amp-bf16",
              "gpu": "h100-80gb", "checkpoint": "full", "distributed": setting}
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
    shared = sum(any(_SHARED in n for n in r.report.notes) for r in reports["shared"].roles)
    print(f"{args.model}, GPipe, pp={args.pp}, dp_shard={args.dp_shard}, {args.microbatches} microbatches of "
          f"{args.seq_len} positions: {shared} of {args.pp} ranks shared a trace")
    print(f"CPU seconds (best of {REPEATS}): shared {best['shared']:.1f}, every rank traced {best['traced']:.1f}, "
          f"ratio {best['shared'] / best['traced']:.2f}; load average {os.getloadavg()[0]:.1f}")
    print(f"every rank's report the same both ways: {_rows(reports['shared']) == _rows(reports['traced'])}")


if __name__ == "__main__":
    main()

"""The accuracy suite measured under PYTORCH_CUDA_ALLOC_CONF settings, re-estimated with each setting.

    python benchmarks/alloc_conf_replay.py [--results benchmarks/results/2026-11-28-h200-alloc-conf]
                                           [--gpu h200] [--only CONFIG ...] [--json OUT.json]

Each folder of ``--results`` holds one ``benchmarks/accuracy.py --suite gpu`` run measured under the
setting its ``alloc_conf.txt`` names (``expandable_segments-True/``: ``expandable_segments:True``).
The estimates written in those files are the default allocator model's; this script re-estimates
every config twice with today's code — with the default settings ("before") and with the folder's
setting (``alloc_conf=``, "after") — for the catalogue GPU and the torch/CUDA the run had, the
plain-torch zoo models the suite ran (:func:`benchmarks.replay_suite.replay`'s choices), and prints
each config's reserved error before and after, then per setting the median and worst |error| and
how many are within 3% (and the same for peak allocated with the setting: it counts blocks, and
the settings decide which blocks are split). The measured figures are the recording's; only the estimates are new.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from tabulate import tabulate

import memcalc

sys.path.insert(0, str(Path(__file__).parent))
from replay_suite import options_of  # benchmarks/ is not a package: found through sys.path

from models_zoo import plain_torch

DEFAULT = Path(__file__).parent / "results" / "2026-11-28-h200-alloc-conf"


def setting_runs(results: Path) -> list[tuple[str, Path]]:
    """Each measured setting of ``results``: its ``PYTORCH_CUDA_ALLOC_CONF`` and its ``.jsonl``."""
    runs = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        setting = (folder / "alloc_conf.txt").read_text().strip().split("=", 1)[-1]
        runs.append((setting, next(folder.glob("*.jsonl"))))
    return runs


def reestimate(suite: Path, setting: str, gpu: str, only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every config of ``suite`` (or those in ``only``) estimated with the default settings and with
    ``setting``: the measured and both estimated reserved bytes, and each estimate's error."""
    lines = suite.read_text().splitlines()
    env = json.loads(lines[0])
    stack = memcalc.Stack(torch=".".join(env["torch"].split("+")[0].split(".")[:2]), cuda=env["cuda"])
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for line in lines[1:]:
            record = json.loads(line)
            if only is not None and record["config"] not in only:
                continue
            options = options_of(record["config"])
            name = options.pop("model")
            started = time.perf_counter()
            before = memcalc.estimate(plain_torch(name), gpu=gpu, stack=stack, alloc_conf="", **options)
            after = memcalc.estimate(plain_torch(name), gpu=gpu, stack=stack, alloc_conf=setting, **options)
            measured = record["measured"]["peak_reserved"]
            allocated = record["measured"]["peak_allocated"]
            # allocated may differ too: it counts blocks, and the settings decide which are split
            rows.append({"config": record["config"], "measured_reserved": measured,
                         "before_reserved": before.peak_reserved, "after_reserved": after.peak_reserved,
                         "before_error": (before.peak_reserved - measured) / measured,
                         "after_error": (after.peak_reserved - measured) / measured,
                         "measured_allocated": allocated, "after_allocated": after.bytes.peak_allocated,
                         "after_allocated_error": (after.bytes.peak_allocated - allocated) / allocated,
                         "seconds": round(time.perf_counter() - started, 1)})
            print(f"  {setting}: {record['config']}: {rows[-1]['before_error']:+.2%} -> {rows[-1]['after_error']:+.2%}",
                  file=sys.stderr, flush=True)
    return rows


def summary(errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    within = sum(a <= 0.03 for a in absolute)
    return (f"median {statistics.median(absolute):.2%}, worst {max(absolute):.2%}, "
            f"within 3%: {within} of {len(absolute)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT)
    parser.add_argument("--gpu", default="h200", help="the catalogue GPU the runs were on")
    parser.add_argument("--only", nargs="*", help="configs to re-estimate (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    only = set(args.only) if args.only else None
    everything = {}
    for setting, suite in setting_runs(args.results):
        rows = reestimate(suite, setting, args.gpu, only)
        everything[setting] = rows
        print(f"\n{setting} ({suite.parent.name}): reserved, (estimate − measured) / measured")
        print(tabulate([[r["config"], f"{r['measured_reserved'] / 2**20:,.0f} MiB", f"{r['before_error']:+.2%}",
                         f"{r['after_error']:+.2%}"] for r in rows],
                       headers=["config", "measured", "default model", f"with {setting}"], disable_numparse=True))
        print(f"default model: {summary([r['before_error'] for r in rows])}")
        print(f"with {setting}: {summary([r['after_error'] for r in rows])}")
        print(f"peak allocated with {setting}: {summary([r['after_allocated_error'] for r in rows])}")
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=1) + "\n")


if __name__ == "__main__":
    main()

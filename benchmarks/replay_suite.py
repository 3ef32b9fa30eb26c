"""Today's estimates against a recorded GPU run of the accuracy suite, without a GPU.

    python benchmarks/replay_suite.py [tests/data/gpu/2026-11-25-h100/suite-gpu.jsonl] [--gpu h100-80gb]
                                      [--as-measured]

Re-estimates every config of a recorded ``benchmarks/accuracy.py --suite gpu`` run (its
``.jsonl``: the environment first, then a record per config) with the current code, for the
catalogue GPU and the torch/CUDA the run had, and prints each config's error on peak allocated and
reserved beside the recorded one, then the median and worst |error| and how many are within 1%
and 3%. The measured figures are the recording's; only the estimates are new.

``--as-measured`` estimates each step as the measuring process ran it: warm, holding the
workspaces its record's note says an earlier warm-up left allocated ("includes N B allocated by
the cuBLAS/cuDNN warm-up"; :func:`memcalc.targets.cuda.workspaces.warm_process`). The default is
the fresh process memcalc estimates for a user; the difference between the two is the
measurement's, not the estimate's.

:func:`replay` is the part others reuse: ``tests/test_margins.py`` loads this file by its path
(``benchmarks/`` is not a package) to derive the fit's margin tables from today's estimates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

import memcalc
from memcalc.targets.cuda.workspaces import warm_process
from models_zoo import plain_torch

DEFAULT = Path(__file__).parent.parent / "tests" / "data" / "gpu" / "2026-11-25-h100" / "suite-gpu.jsonl"


def options_of(label: str) -> dict[str, Any]:
    """``"gpt2 seq 1024 b8 adamw train precision=amp-bf16"`` → estimate() keywords."""
    words = label.split()
    options: dict[str, Any] = {"model": words[0]}
    if "seq" in words:
        options["seq_len"] = int(words[words.index("seq") + 1])
    batch = next(w for w in words if re.fullmatch(r"b\d+", w))
    options["batch_size"] = int(batch[1:])
    at = words.index(batch)
    options["optimizer"], options["mode"] = words[at + 1], words[at + 2]
    for word in words[at + 3:]:
        key, value = word.split("=", 1)
        options[key] = True if value == "True" else int(value) if value.isdigit() else value
    return options


@dataclass(frozen=True)
class Replayed:
    """One config of a recorded suite run: its record as written, and today's estimate of it."""

    record: dict[str, Any]
    peak_allocated: int  # today's estimate, bytes
    peak_reserved: int

    @property
    def config(self) -> str:
        return str(self.record["config"])

    @property
    def measured(self) -> dict[str, int]:
        return dict(self.record["measured"])

    @property
    def error_allocated(self) -> float:
        """Today's error on peak allocated, (estimate − measured) / measured, as the suite writes it."""
        return (self.peak_allocated - self.measured["peak_allocated"]) / self.measured["peak_allocated"]

    @property
    def error_reserved(self) -> float:
        return (self.peak_reserved - self.measured["peak_reserved"]) / self.measured["peak_reserved"]


#: How a record's note states what the warm-up left allocated (benchmarks/accuracy.py writes it).
_WARM_NOTE = re.compile(r"includes ([\d,]+) B allocated by")


def warm_bytes(record: dict[str, Any]) -> int:
    """The bytes of workspaces the measuring process held before the step, from the record's note."""
    measured = record.get("measured", record)
    match = _WARM_NOTE.search(str(measured.get("note", "")))
    return int(match.group(1).replace(",", "")) if match else 0


def replay(suite: Path = DEFAULT, gpu: str = "h100-80gb", *,
           as_measured: bool = False) -> tuple[dict[str, Any], list[Replayed]]:
    """The run's environment, and every config of it re-estimated with today's code for the
    catalogue ``gpu`` and the torch/CUDA the run had (shared with tests/test_margins.py, whose
    margin tables are derived from it); ``as_measured``: in a process as warm as the measuring
    one was (see the module docstring)."""
    lines = suite.read_text().splitlines()
    env = json.loads(lines[0])
    stack = memcalc.Stack(torch=".".join(env["torch"].split("+")[0].split(".")[:2]), cuda=env["cuda"])
    replayed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for line in lines[1:]:
            record = json.loads(line)
            options = options_of(record["config"])
            # the suite ran the zoo's plain-torch models (torch:NAME), whatever NAME builds today
            model = plain_torch(options.pop("model"))
            warm = warm_process(warm_bytes(record)) if as_measured else contextlib.nullcontext()
            with warm:
                report = memcalc.estimate(model, gpu=gpu, stack=stack, **options)
            replayed.append(Replayed(record, report.bytes.peak_allocated, report.peak_reserved))
    return env, replayed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--gpu", default="h100-80gb", help="the catalogue GPU the run was on")
    parser.add_argument("--as-measured", action="store_true",
                        help="estimate each step in a process as warm as the measuring one (its note)")
    args = parser.parse_args()
    env, replayed = replay(args.suite, args.gpu, as_measured=args.as_measured)
    rows = [[r.config, f"{r.record['error_allocated']:+.2%}", f"{r.error_allocated:+.2%}",
             f"{r.record['error_reserved']:+.2%}", f"{r.error_reserved:+.2%}"] for r in replayed]
    errors = [abs(r.error_allocated) for r in replayed]
    recorded = [abs(r.record["error_allocated"]) for r in replayed]
    reserved_errors = [abs(r.error_reserved) for r in replayed]
    reserved_recorded = [abs(r.record["error_reserved"]) for r in replayed]
    process = "as warm as the measuring process" if args.as_measured else "in a fresh process"
    print(f"{args.suite} ({env['device']}, torch {env['torch']}): estimates of today, {process}, "
          "against its measurements")
    print(tabulate(rows, headers=["config", "allocated, recorded", "allocated, today", "reserved, recorded",
                                  "reserved, today"], disable_numparse=True))
    summaries = (("recorded", recorded, "peak allocated", 0.01), ("today", errors, "peak allocated", 0.01),
                 ("recorded", reserved_recorded, "peak reserved", 0.05),
                 ("today", reserved_errors, "peak reserved", 0.05))
    for name, values, what, near in summaries:
        print(f"{name}: median |error| {statistics.median(values):.2%}, worst {max(values):.2%}; "
              f"{sum(v <= near for v in values)} within {near:.0%}, {sum(v <= 0.03 for v in values)} within 3% "
              f"of {len(values)} ({what})")


if __name__ == "__main__":
    main()

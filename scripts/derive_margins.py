"""Derive the fit's margin tables from a recorded GPU suite and write them as package data.

    python scripts/derive_margins.py            # writes memcalc/search/margins.json
    python scripts/derive_margins.py --check    # fails if the committed tables are stale

Re-estimates every config of :data:`SUITE` (the H100 suite of 2026-11-25, 51 configs) with this
checkout for the run's GPU, torch and CUDA (``benchmarks/replay_suite.py``), and derives α per
class of step, ρ per model and β per family from today's estimates against the recorded
measurements, as :mod:`memcalc.search.margins` documents them. Every figure comes from the suite:
nothing is typed in. ``tests/test_margins.py`` re-derives them and fails when an estimate's
change moves them.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from memcalc.core.categories import Mode
from memcalc.core.precision import Precision
from memcalc.search.margins import MARGINS_FILE, StepClass, step_class

ROOT = Path(__file__).resolve().parent.parent
#: The recorded run the tables are derived from.
SUITE = ROOT / "tests" / "data" / "gpu" / "2026-11-25-h100" / "suite-gpu.jsonl"
#: The catalogue GPU it ran on.
GPU = "h100-80gb"
MEASURED_ON = "H100 80GB, torch 2.11 + CUDA 13.0, 2026-11-25 (tests/data/gpu/2026-11-25-h100/suite-gpu.jsonl)"
OUT = ROOT / "memcalc" / "search" / MARGINS_FILE
GiB = 1024**3

Tables = tuple[dict[StepClass, tuple[float, str]], dict[str, tuple[float, str]], dict[str, tuple[int, int, str]]]


def replay_suite() -> ModuleType:
    """benchmarks/replay_suite.py, loaded by its path (benchmarks/ is not a package)."""
    module = sys.modules.get("replay_suite")
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location("replay_suite", ROOT / "benchmarks" / "replay_suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while it is defined
    spec.loader.exec_module(module)
    return module


def class_of(config: str) -> StepClass:
    """The step class of a suite config's label (``"gpt2 seq 1024 b8 adamw train precision=amp-bf16"``)."""
    words = config.split()
    precision = next((w.split("=")[1] for w in words if w.startswith("precision=")), "fp32")
    mode = Mode(words[words.index(next(w for w in words if w in ("train", "eval", "inference")))])
    return step_class(words[0], Precision(precision), "checkpoint=True" in words, mode)


def derive_tables() -> Tables:
    """α per class, ρ per model and β per family, from today's estimates of every config against
    the recorded measurements (not the estimates the suite recorded: fixes since have changed
    some), as memcalc.search.margins documents them."""
    _, replayed = replay_suite().replay(SUITE, GPU)
    assert len(replayed) == 51
    allocated: dict[StepClass, tuple[float, str]] = {}
    largest: dict[str, tuple[int, float, str]] = {}  # model: (real peak reserved, ρ, config)
    fixed: dict[str, tuple[int, int, str]] = {}
    for config in replayed:
        key, measured = class_of(config.config), config.measured
        large = measured["peak_allocated"] >= GiB
        # α: under-estimates of peak allocated, on real peaks of at least 1 GiB
        alpha = round(max(0.0, -config.error_allocated), 4) if large else 0.0
        if key.kind not in allocated or alpha > allocated[key.kind][0]:
            allocated[key.kind] = (alpha, config.config)
        shortfall = max(0, measured["peak_reserved"] - config.peak_reserved)
        if large:  # ρ: the share on the model's largest run
            share = round(shortfall / measured["peak_reserved"], 4)
            if key.model not in largest or measured["peak_reserved"] > largest[key.model][0]:
                largest[key.model] = (measured["peak_reserved"], share, config.config)
        elif key.family not in fixed or shortfall > fixed[key.family][0]:  # β: bytes on small runs
            fixed[key.family] = (shortfall, measured["peak_reserved"], config.config)
    shares = {model: (share, config) for model, (_, share, config) in largest.items()}
    return allocated, shares, fixed


def to_json(tables: Tables) -> dict[str, Any]:
    """The tables as :data:`OUT` holds them, with their provenance (less the date written)."""
    allocated, shares, fixed = tables
    return {
        "provenance": {
            "script": "scripts/derive_margins.py",
            "inputs": [str(SUITE.relative_to(ROOT)), "benchmarks/replay_suite.py (today's estimates)"],
            "measured": "2026-11-25",
            "note": "do not edit: run the script (--check tells whether this file is current)",
        },
        "measured_on": MEASURED_ON,
        "allocated_underestimate": [
            {"family": k.family, "precision": k.precision, "checkpoint": k.checkpoint, "training": k.training,
             "alpha": alpha, "config": config}
            for k, (alpha, config) in sorted(allocated.items(), key=lambda item: (
                item[0].family, item[0].precision, item[0].checkpoint, item[0].training))],
        "reserved_share": {model: {"rho": rho, "config": config} for model, (rho, config) in sorted(shares.items())},
        "reserved_fixed": {family: {"shortfall": shortfall, "run": run, "config": config}
                           for family, (shortfall, run, config) in sorted(fixed.items())},
    }


def _without_date(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "provenance": {k: v for k, v in data.get("provenance", {}).items() if k != "written"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed tables are stale")
    args = parser.parse_args()
    data = to_json(derive_tables())
    if args.check:
        current = json.loads(OUT.read_text()) if OUT.exists() else {}
        if _without_date(current) != data:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/derive_margins.py", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is current")
        return 0
    data["provenance"]["written"] = datetime.date.today().isoformat()
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

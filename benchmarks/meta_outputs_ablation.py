"""What a set of output rules (memcalc.engine.meta_outputs) saves a cold trace: one process, the
meta-kernel cache emptied before each estimate, this tree's ``OUTPUT_RULES`` and another tree's
taking turns (so that a change of load falls on both). Prints, per case, the whole estimate's CPU
time (best of N) and the CPU time inside ``StorageTracer._run`` (the rules and the meta kernels
they leave; median of N), and whether the two reports are equal. Asserts nothing.

Run from the repository root: ``python benchmarks/meta_outputs_ablation.py OTHER_TREE [N]``, where
OTHER_TREE is, e.g., ``git archive main | tar -x -C /tmp/base`` (only its
``memcalc/engine/meta_outputs.py`` is loaded).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import memcalc
from memcalc.engine import trace
from memcalc.engine.meta_outputs import OUTPUT_RULES

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "resnet50": ("resnet50", {"batch_size": 8, "optimizer": "adam"}),
    "gpt2": ("gpt2", {"batch_size": 2, "seq_len": 256, "optimizer": "adamw"}),
    "vit_b_16": ("vit_b_16", {"batch_size": 8, "optimizer": "adamw"}),
    "llama-tiny amp-bf16": ("llama-tiny", {"batch_size": 2, "seq_len": 256, "optimizer": "adamw",
                                           "precision": "amp-bf16"}),
}


def _other_rules(tree: str) -> dict[object, Any]:
    spec = importlib.util.spec_from_file_location("other_meta_outputs",
                                                  os.path.join(tree, "memcalc/engine/meta_outputs.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.OUTPUT_RULES)


def main() -> None:
    warnings.simplefilter("ignore")
    other, repeat = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 9
    ours = {id(op) for op in OUTPUT_RULES}
    base = {key: rule for key, rule in trace._SHORTCUTS.items() if key not in ours}
    tables = {"other": {**base, **{id(op): rule for op, rule in _other_rules(other).items()}},
              "this": {**base, **{id(op): rule for op, rule in OUTPUT_RULES.items()}}}
    inside = [0.0]
    run = trace.StorageTracer._run

    def timed_run(self: trace.StorageTracer, func: Any, args: Any, kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return run(self, func, args, kwargs)
        finally:
            inside[0] += time.process_time() - start

    trace.StorageTracer._run = timed_run  # type: ignore[method-assign]
    table = dict(trace._SHORTCUTS)
    try:
        for case, (model, options) in CASES.items():
            memcalc.estimate(model, **options)
            whole: dict[str, list[float]] = {side: [] for side in tables}
            kernels: dict[str, list[float]] = {side: [] for side in tables}
            reports = {}
            for i in range(repeat):
                for side in (("other", "this") if i % 2 == 0 else ("this", "other")):
                    trace._SHORTCUTS.clear()
                    trace._SHORTCUTS.update(tables[side])
                    trace.MetaKernelCache.clear()
                    inside[0] = 0.0
                    start = time.process_time()
                    report = memcalc.estimate(model, **options)
                    whole[side].append(time.process_time() - start)
                    kernels[side].append(inside[0])
                    reports[side] = json.dumps(report.to_dict(), sort_keys=True, default=str)
            before, after = min(whole["other"]), min(whole["this"])
            print(f"{case:22s} estimate {before * 1e3:6.1f} -> {after * 1e3:6.1f} ms ({after / before:5.3f}x)  "
                  f"rules and meta kernels {statistics.median(kernels['other']) * 1e3:5.1f} -> "
                  f"{statistics.median(kernels['this']) * 1e3:5.1f} ms  same report: "
                  f"{reports['other'] == reports['this']}", flush=True)
    finally:
        trace.StorageTracer._run = run  # type: ignore[method-assign]
        trace._SHORTCUTS.clear()
        trace._SHORTCUTS.update(table)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

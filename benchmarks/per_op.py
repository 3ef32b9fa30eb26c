"""Per-op cost of the trace and the cost of ``fit`` in estimates (issue 36, items 3 and 6).
Prints figures beside their targets; asserts nothing (machines are noisy: CPU time, best of
``--repeat``, and each ratio taken within one run).

1. µs per aten op: the CPU time of the traced step (from the tracer's ``__enter__`` to its
   ``stop``) over the aten ops it saw, best of ``--repeat`` warm estimates, on resnet50, gpt2,
   vit_b_16, a QLoRA step (llama-tiny, nf4, LoRA 16, bf16, checkpointing), llama-tiny in
   amp-bf16 and resnet50's inference (no optimizer); beside it the same less the time inside
   meta kernels (``StorageTracer._run``: the misses of the meta-kernel cache), the part
   memcalc's dispatch stack and the model's own code make. Target: at most half of the
   baseline's (``--baseline DIR``, a checkout of an older commit, run in its own process by the
   same script).
2. ``max_batch_size`` in units of one estimate (CPU time, warm process): resnet50, vit_b_16,
   gpt2 (256 tokens) and vgg16 with ``margin=0``, on an A100 40 GB. Target: at most 2.5x.

Run: ``python benchmarks/per_op.py [--repeat 3] [--baseline DIR] [--only ops|fit] [--cold | --fresh]
[--rounds N] [--cases resnet50,gpt2]`` (``--rounds``: N child processes per tree, the trees' taking turns); a
baseline tree is made with ``git archive <commit> | tar -x -C DIR``. The meta-kernel cache outlives a
trace (the process's): ``--cold`` empties it before each timed estimate, so that each trace runs
every kernel it does not repeat itself, as a first estimate does. ``--fresh`` times what a first
estimate pays besides: each case's first estimate, each in its own fresh process (the imports and
first calls made inside the trace included), the two trees' processes alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

#: Runs in the checkout given as argv[1]; prints one JSON line per case.
_CHILD = r'''
import json, sys, time, warnings
sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore")
import memcalc
from memcalc.api import max_batch_size
from memcalc.engine import trace as T
what, repeat, cold = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "cold"
forget = getattr(T.MetaKernelCache, "clear", None)  # a tree whose cache outlives a trace (the process's)
window = {"t": 0.0, "ops": 0, "start": None, "kernels": 0.0}
enter, stop, run = T.StorageTracer.__enter__, T.StorageTracer.stop, T.StorageTracer._run
def timed_enter(self):
    window["start"] = time.process_time()
    return enter(self)
def timed_stop(self):
    out = stop(self)
    if window["start"] is not None:
        window["t"] += time.process_time() - window["start"]
        window["start"] = None
        window["ops"] += sum(self.trace.op_counts.values())
    return out
def timed_run(self, func, args, kwargs):
    start = time.process_time()
    try:
        return run(self, func, args, kwargs)
    finally:
        window["kernels"] += time.process_time() - start
T.StorageTracer.__enter__, T.StorageTracer.stop, T.StorageTracer._run = timed_enter, timed_stop, timed_run
QLORA = memcalc.FineTune(lora=memcalc.LoRA(16), quant="nf4")
OPS = {
    "resnet50": ("resnet50", dict(batch_size=8, optimizer="adam")),
    "gpt2": ("gpt2", dict(batch_size=2, seq_len=256, optimizer="adamw")),
    "vit_b_16": ("vit_b_16", dict(batch_size=8, optimizer="adamw")),
    "qlora": ("llama-tiny", dict(batch_size=2, seq_len=256, optimizer="adamw", precision="bf16", finetune=QLORA,
                                 checkpoint=True)),
    "llama-tiny amp-bf16": ("llama-tiny", dict(batch_size=2, seq_len=256, optimizer="adamw", precision="amp-bf16")),
    "resnet50 inference": ("resnet50", dict(batch_size=8, mode="inference")),
}
FIT = {"resnet50": ({}, {}), "vit_b_16": ({}, {}), "gpt2": ({"seq_len": 256}, {}), "vgg16": ({}, {"margin": 0})}
GPU = "a100-40gb"
if what.startswith("fresh:"):  # this process's first estimate of one case: nothing run before it
    case = what.partition(":")[2]
    model, options = OPS[case]
    start = time.process_time()
    memcalc.estimate(model, **options)
    print(json.dumps({"case": case, "us_per_op": window["t"] / window["ops"] * 1e6,
                      "outside_kernels": (window["t"] - window["kernels"]) / window["ops"] * 1e6,
                      "ops": window["ops"], "estimate": time.process_time() - start}), flush=True)
elif what == "ops":
    chosen = sys.argv[5].split(",") if len(sys.argv) > 5 else list(OPS)
    for case, (model, options) in ((case, OPS[case]) for case in chosen):
        memcalc.estimate(model, **options)
        best = None
        for _ in range(repeat):
            window.update(t=0.0, ops=0, kernels=0.0)
            if cold and forget is not None:
                forget()
            memcalc.estimate(model, **options)
            row = (window["t"] / window["ops"] * 1e6, (window["t"] - window["kernels"]) / window["ops"] * 1e6,
                   window["ops"])
            best = row if best is None or row[0] < best[0] else best
        print(json.dumps({"case": case, "us_per_op": best[0], "outside_kernels": best[1], "ops": best[2]}), flush=True)
else:
    for model, (options, fit_options) in FIT.items():
        memcalc.estimate(model, batch_size=2, **options)
        fits, estimates = [], []
        for _ in range(repeat):
            start = time.process_time()
            result = max_batch_size(model, gpu=GPU, **options, **fit_options)
            fits.append(time.process_time() - start)
            start = time.process_time()
            memcalc.estimate(model, batch_size=result.batch_size, gpu=GPU, capacity=result.budget_bytes, **options)
            estimates.append(time.process_time() - start)
        print(json.dumps({"case": model + (" margin 0" if fit_options else ""), "fit": min(fits),
                          "estimate": min(estimates), "batch": result.batch_size, "gpu": GPU,
                          "estimates": result.num_estimates, "replays": result.replays}), flush=True)
'''

#: The cases of figure 1, as the child names them.
_CASES = ("resnet50", "gpt2", "vit_b_16", "qlora", "llama-tiny amp-bf16", "resnet50 inference")
#: Item 3: the per-op cost at most half the baseline's; item 6: a fit in at most 2.5 estimates.
OPS_TARGET = 0.5
FIT_TARGET = 2.5


def measure(root: str, what: str, repeat: int, cold: bool = False,
            cases: tuple[str, ...] = _CASES) -> dict[str, dict[str, float]]:
    """The child's rows for ``root``, by case (``cold``: the meta-kernel cache emptied before each
    timed estimate, where it outlives a trace)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, root, what, str(repeat), "cold" if cold else "warm",
                           ",".join(cases)], capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{root} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


def first_estimates(root: str, baseline: str | None, repeat: int) -> tuple[dict[str, dict[str, float]], ...]:
    """Each case's first estimate in a fresh process, best of ``repeat`` processes, the two trees'
    processes alternating (so that a change of load falls on both)."""
    rows: tuple[dict[str, dict[str, float]], ...] = ({}, {})
    for _ in range(repeat):
        for side, tree in enumerate((root, baseline)):
            if tree is None:
                continue
            for case in _CASES:
                row = measure(tree, f"fresh:{case}", 1)[case]
                best = rows[side].get(case)
                rows[side][case] = row if best is None or row["us_per_op"] < best["us_per_op"] else best
    return rows


def alternating(trees: list[str], repeat: int, cold: bool, rounds: int,
                cases: tuple[str, ...]) -> list[dict[str, dict[str, float]]]:
    """Each tree's rows, best of ``rounds`` child processes per tree, the trees' processes taking
    turns (so that a change of load falls on all of them)."""
    rows: list[dict[str, dict[str, float]]] = [{} for _ in trees]
    for _ in range(rounds):
        for side, tree in enumerate(trees):
            for case, row in measure(tree, "ops", repeat, cold, cases).items():
                best = rows[side].get(case)
                rows[side][case] = row if best is None or row["us_per_op"] < best["us_per_op"] else best
    return rows


def per_op(root: str, baseline: str | None, repeat: int, cold: bool, fresh: bool = False, rounds: int = 1,
           cases: tuple[str, ...] = _CASES) -> None:
    """Figure 1."""
    if fresh:
        after, before = first_estimates(root, baseline, repeat)
    else:
        after, *others = alternating([root, *([baseline] if baseline else [])], repeat, cold, rounds, cases)
        before = others[0] if others else {}
    how = ("; the first estimate of a fresh process" if fresh
           else "; the meta-kernel cache emptied before each estimate" if cold else "")
    print(f"\n1. µs per aten op in the traced step (CPU time, best of {repeat}; target: after / before "
          f"<= {OPS_TARGET}){how}")
    print(f"   {'case':22s} {'ops':>5s}  {'before':>7s} {'after':>7s} {'ratio':>6s}   outside meta kernels: "
          f"{'before':>7s} {'after':>7s} {'ratio':>6s}")
    for case, row in after.items():
        old = before.get(case)
        whole = (f"{old['us_per_op']:7.1f} {row['us_per_op']:7.1f} {row['us_per_op'] / old['us_per_op']:6.2f}"
                 if old else f"{'':7s} {row['us_per_op']:7.1f} {'':6s}")
        outside = (f"{old['outside_kernels']:7.1f} {row['outside_kernels']:7.1f} "
                   f"{row['outside_kernels'] / old['outside_kernels']:6.2f}"
                   if old else f"{'':7s} {row['outside_kernels']:7.1f}")
        whole_estimate = ""
        if "estimate" in row:  # --fresh: the whole first estimate (model building and imports included)
            whole_estimate = (f"   estimate {old['estimate']:5.2f} -> {row['estimate']:5.2f} s" if old
                              else f"   estimate {row['estimate']:5.2f} s")
        print(f"   {case:22s} {row['ops']:5d}  {whole}   {'':21s}{outside}{whole_estimate}")


def fit(root: str, baseline: str | None, repeat: int) -> None:
    """Figure 2."""
    print(f"\n2. max_batch_size / one estimate (CPU time, best of {repeat}, an A100 40 GB; target <= {FIT_TARGET}x)")
    for label, tree in (("before", baseline), ("after", root)):
        if tree is None:
            continue
        for case, row in measure(tree, "fit", repeat).items():
            ratio = row["fit"] / row["estimate"]
            print(f"   {label:6s} {case:18s} fit {row['fit']:6.2f} s  estimate {row['estimate']:5.2f} s  "
                  f"{ratio:5.2f}x {'ok' if ratio <= FIT_TARGET else 'over':4s}  batch {row['batch']:5d}, "
                  f"{row['estimates']} estimates, {row['replays']} replays")


def main() -> None:
    """Print every figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="a checkout of the commit to compare with (before)")
    parser.add_argument("--only", choices=("ops", "fit"), default=None)
    parser.add_argument("--cold", action="store_true",
                        help="empty the meta-kernel cache before each timed estimate (it outlives a trace)")
    parser.add_argument("--fresh", action="store_true",
                        help="time each case's first estimate, each in a fresh process (what it pays once)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="child processes per tree, taking turns with the baseline's (best of them)")
    parser.add_argument("--cases", default=",".join(_CASES), help="figure 1's cases, comma-separated")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if args.only != "fit":
        per_op(root, args.baseline, args.repeat, args.cold, args.fresh, args.rounds, tuple(args.cases.split(",")))
    if args.only != "ops":
        fit(root, args.baseline, args.repeat)


if __name__ == "__main__":
    main()

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

4. Whole commands, as a user waits for them (``--only whole``, and with ``--all``): ``resnet50
   --batch 64 --optim adam``, ``gpt2 --batch 8``, ``llama-3-70b --batch 1`` and the README's QLoRA
   recipe, each in a fresh process: wall and CPU seconds, and the CPU split into torch's import,
   the Hugging Face libraries' imports (transformers, PEFT, TRL, accelerate, bitsandbytes,
   datasets, torchao: each whole subtree), memcalc's own imports (its modules, the zoo's, and what
   they import themselves: click, tabulate), torch's later imports (torch modules first imported
   after ``import torch``: Dynamo in ``Optimizer.step``, sympy under ``torch._check``...) and the
   rest (the estimate, the interpreter's start). With ``--before DIR`` (e.g. a ``git archive`` of
   main), DIR's commands run in turn with ``--root``'s and each figure is printed before → after.

With ``--all``, also issue 36's other figures, each from the script that measures it: the
µs per aten op against a checkout of the commit before (item 3, ``benchmarks/per_op.py``, needs
``--baseline DIR``), ``fit`` in units of one estimate (item 6, the same script) and a generation
of 1,024 tokens against a prefill-only estimate (item 5, ``benchmarks/generation.py``); then one
table of every figure beside its target. The quick suite's time (item 7) is printed by ``.ci/run``.

Run: ``python benchmarks/startup.py [--repeat 5] [--root DIR] [--only whole --before DIR] [--all [--baseline DIR]]``;
``--root``
times the commands of another checkout (e.g. a worktree of an older commit: "before").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

#: Modules that only some requests use, reported when a command imported them.
HEAVY = ("torch", "transformers", "peft", "sympy", "torch._dynamo", "memcalc.timing.flops",
         "torch.utils.flop_counter", "torch.distributed.tensor")

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


#: Runs one ``memcalc`` command line in this interpreter with every module load timed (CPU seconds,
#: ``_frozen_importlib._load_unlocked`` wrapped: the loads' nesting gives each its own time) and
#: prints the split of figure 4 as JSON. A module's time counts to the category of the package that
#: started its subtree, except below memcalc's own modules, whose imports are classed by their name.
_SPLIT_RUN = """
import contextlib, io, json, resource, sys, time
import _frozen_importlib as bootstrap
sys.path.insert(0, ".")
cpu = time.process_time
HF = {hf!r}
spent = {"torch": 0.0, "hf": 0.0, "memcalc": 0.0, "torch_later": 0.0}
stack = []
torch_done = [False]
load = bootstrap._load_unlocked
def category(name):
    if stack and stack[-1][0] != "memcalc":
        return stack[-1][0]
    top = name.partition(".")[0]
    if top in HF:
        return "hf"
    if top in ("torch", "torchgen", "functorch"):
        return "torch_later" if torch_done[0] else "torch"
    return "memcalc"
def timed_load(spec):
    frame = [category(spec.name), cpu(), 0.0]
    stack.append(frame)
    try:
        return load(spec)
    finally:
        stack.pop()
        elapsed = cpu() - frame[1]
        spent[frame[0]] += elapsed - frame[2]
        if stack:
            stack[-1][2] += elapsed
        if spec.name == "torch":
            torch_done[0] = True
bootstrap._load_unlocked = timed_load
from memcalc.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:], prog_name="memcalc")
    except SystemExit as exc:
        assert not exc.code, exc.code
usage = resource.getrusage(resource.RUSAGE_SELF)
total = usage.ru_utime + usage.ru_stime
print(json.dumps({**spent, "rest": total - sum(spent.values()), "cpu": total}))
""".replace("{hf!r}", repr(("transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "huggingface_hub",
                            "tokenizers", "safetensors", "torchao", "pandas", "pyarrow")))

#: Figure 4's commands: the issue's three and the README's QLoRA recipe.
WHOLE_COMMANDS = (
    ("resnet50", "resnet50 --batch 64 --optim adam"),
    ("gpt2", "gpt2 --batch 8"),
    ("llama-3-70b", "llama-3-70b --batch 1"),
    ("QLoRA", "llama-3-8b --lora 16 --quant nf4 --double-quant --precision bf16 --checkpoint --loop trainer "
              "--optim paged-adamw-8bit --seq-len 2048 --batch 1 --gpu rtx-4090"),
)
#: Figure 4's columns: (key, heading).
_SPLIT = (("wall", "wall"), ("cpu", "CPU"), ("torch", "torch import"), ("hf", "HF imports"),
          ("memcalc", "memcalc's imports"), ("torch_later", "torch's later imports"), ("rest", "rest"))


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


#: One line of the closing table: (issue item, figure, target, met).
Row = tuple[str, str, str, bool]


def commands(root: str, repeat: int) -> list[Row]:
    """Figures 1 and 2."""
    rows: list[Row] = []
    py = sys.executable
    light, heavy = [py, "-c", "import click, tabulate"], [py, "-c", "import torch"]
    print("\n1. commands that need no torch (target: at most 2.0x python -c 'import click, tabulate', no torch)")
    for args in (["--help"], ["--version"], ["zoo"], ["gpus"]):
        wall, floor, ratio, loaded = paired([py, "-c", _RUN, *args], light, root, repeat)
        print(f"   memcalc {' '.join(args):<10} {wall:6.2f} s  floor {floor:5.2f} s  {ratio:5.1f}x the floor  "
              f"imported: "
              f"{', '.join(json.loads(loaded)) or 'none of ' + '/'.join(HEAVY[:3])}")
        torch_free = "torch" not in json.loads(loaded)
        rows.append(("1", f"memcalc {' '.join(args)}: {ratio:.1f}x the floor, {'no torch' if torch_free else 'torch'}",
                     "<= 2.0x, no torch", ratio <= 2.0 and torch_free))
    print("\n2. estimates (target: nothing imported that the request does not use)")
    for args in (["mlp", "--batch", "2"], ["resnet50", "--batch", "8"],
                 ["mlp", "--batch", "2", "--time", "--gpu", "h100-80gb"],
                 ["mlp", "--batch", "2", "--mode", "inference"], ["resnet50", "--batch", "8", "--mode", "inference"]):
        wall, floor, ratio, loaded = paired([py, "-c", _RUN, *args], heavy, root, repeat)
        # an inference step needs neither DTensor nor Dynamo (a training step's optimizer imports Dynamo,
        # which imports DTensor: torch's doing)
        needless = {"transformers", "peft"} | ({"torch.distributed.tensor", "torch._dynamo"}
                                               if "inference" in args else set())
        unused = sorted(set(json.loads(loaded)) & needless |
                        (set(json.loads(loaded)) & {"memcalc.timing.flops", "torch.utils.flop_counter"}
                         if "--time" not in args else set()))
        print(f"   memcalc {' '.join(args):<42} {wall:6.2f} s  'import torch' {floor:5.2f} s  {ratio:4.1f}x   "
              f"unused imports: {', '.join(unused) or 'none'}")
        rows.append(("2", f"memcalc {' '.join(args)}: unused imports {', '.join(unused) or 'none'}", "none",
                     not unused))
    return rows


def collector(root: str, repeat: int, model: str, batch: int, seq_len: int) -> list[Row]:
    """Figure 3."""
    if not os.path.exists(os.path.join(root, "memcalc", "engine", "collector.py")):
        print("\n3. (this tree has no memcalc.engine.collector: the collector runs throughout)")
        return [("4", "the collector runs throughout the trace and replay", "paused, RSS cost stated", False)]
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
    return [("4", f"{model}: collections {run['gc_s']:.2f} s -> {pause['gc_s']:.2f} s, estimate "
                  f"{pause['wall'] / run['wall']:.2f}x, peak RSS {extra:+.0f} MiB", "paused, RSS cost stated",
             pause["collections"] <= 1)]


def others(baseline: str | None, repeat: int) -> list[Row]:
    """Items 3, 5 and 6, each from its own script (run in this interpreter's environment)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import per_op  # benchmarks/per_op.py: the figures of items 3 and 6

    root = os.path.dirname(here)
    rows: list[Row] = []
    print(f"\n4. per-op cost (item 3) and fit (item 6) (benchmarks/per_op.py, best of {repeat})")
    if baseline is None:
        print("   item 3 needs --baseline DIR (a checkout of the commit before): not measured")
    else:
        after, before = per_op.measure(root, "ops", repeat), per_op.measure(baseline, "ops", repeat)
        for case, row in after.items():
            if case in before:
                ratio = row["us_per_op"] / before[case]["us_per_op"]
                print(f"   {case:22s} {before[case]['us_per_op']:6.1f} -> {row['us_per_op']:6.1f} us per aten op "
                      f"({ratio:.2f}x)")
                rows.append(("3", f"{case}: {before[case]['us_per_op']:.1f} -> {row['us_per_op']:.1f} us/op "
                                  f"({ratio:.2f}x)", f"<= {per_op.OPS_TARGET}x", ratio <= per_op.OPS_TARGET))
    fits = per_op.measure(root, "fit", repeat)
    for case, row in fits.items():
        ratio = row["fit"] / row["estimate"]
        print(f"   fit {case:18s} {row['fit']:5.2f} s, one estimate {row['estimate']:5.2f} s: {ratio:.2f}x")
        rows.append(("6", f"fit {case}: {ratio:.2f}x one estimate", f"<= {per_op.FIT_TARGET}x",
                     ratio <= per_op.FIT_TARGET))
    waits(root, repeat, {case: int(row["batch"]) for case, row in fits.items()}, str(next(iter(fits.values()))["gpu"]))
    print("\n5. generation, item 5 (benchmarks/generation.py --skip-full: llama-2-7b, prompt 512, 1,024 new tokens)")
    done = subprocess.run([sys.executable, os.path.join(here, "generation.py"), "--skip-full"], cwd=root,
                          capture_output=True, text=True, timeout=1800, check=False)
    found = re.search(r"after is ([0-9.]+)x", done.stdout)
    print("   " + "\n   ".join(done.stdout.strip().splitlines()[-4:]) if done.returncode == 0 else
          f"   failed:\n{done.stderr[-1500:]}")
    if found:
        rows.append(("5", f"llama-2-7b, 1,024 new tokens: {found.group(1)}x a prefill-only estimate", "<= 2.0x",
                     float(found.group(1)) <= 2.0))
    return rows


#: Items 5 and 6 as a user waits: (label, the command, the command it is measured against), the
#: latter's ``{batch}`` the fit's answer (an estimate costs the same at any batch: meta tensors).
_WAITS = (
    ("fit resnet50", "fit resnet50 --gpu {gpu}", "resnet50 --batch {batch} --gpu {gpu}"),
    ("fit vit_b_16", "fit vit_b_16 --gpu {gpu}", "vit_b_16 --batch {batch} --gpu {gpu}"),
    ("fit gpt2", "fit gpt2 --seq-len 256 --gpu {gpu}", "gpt2 --seq-len 256 --batch {batch} --gpu {gpu}"),
    ("fit vgg16 margin 0", "fit vgg16 --margin 0 --gpu {gpu}", "vgg16 --batch {batch} --gpu {gpu}"),
    ("generate llama-2-7b", "llama-2-7b --mode generate --seq-len 512 --new-tokens 1024",
     "llama-2-7b --mode generate --seq-len 512 --new-tokens 1"),
)


def waits(root: str, repeat: int, batches: dict[str, int], gpu: str) -> None:
    """Items 5 and 6 as a user waits for them: each whole command in a fresh process against the
    one-estimate command it is measured against (:data:`_WAITS`), in turn (:func:`paired`). Printed
    beside the in-process ratios the targets are stated in, not judged against them: the import
    of torch (and transformers) that both commands pay is most of either."""
    print(f"\n   as a user waits: whole commands in fresh processes, against one estimate's (median of {repeat})")
    for label, command, against in _WAITS:
        batch = batches.get(label.removeprefix("fit "), 2)
        argv, floor = ([sys.executable, "-c", _RUN, *text.format(gpu=gpu, batch=batch).split()]
                       for text in (command, against))
        wall, other, ratio, _ = paired(argv, floor, root, repeat)
        print(f"   {label:22s} {wall:6.2f} s against {other:6.2f} s: {ratio:.2f}x   "
              f"(against: memcalc {against.format(gpu=gpu, batch=batch)})")


def whole(root: str, before: str | None, repeat: int) -> list[Row]:
    """Figure 4: each command in a fresh process, ``before``'s and ``root``'s in turn (after one
    warm-up of each), the medians of ``repeat``."""
    print(f"\n4. whole commands (CPU seconds split by who imported what; median of {repeat}"
          + (f"; before: {before}, in turn with the after tree)" if before else ")"))
    trees = [("before", before)] if before else []
    trees.append(("after", root))
    rows: list[Row] = []
    for label, command in WHOLE_COMMANDS:
        argv = [sys.executable, "-c", _SPLIT_RUN, *command.split()]
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
        for round_ in range(repeat + 1):
            for name, tree in trees:
                wall, line = timed(argv, tree)
                if round_:  # the first round warms the file cache of both trees
                    runs[name].append({"wall": wall, **json.loads(line)})
        medians = {name: {key: statistics.median(r[key] for r in got) for key, _ in _SPLIT}
                   for name, got in runs.items()}
        print(f"   {label}: memcalc {command}")
        for key, heading in _SPLIT:
            after = medians["after"][key]
            if before:
                was = medians["before"][key]
                ratio = f"({after / was:.2f}x)" if was >= 0.005 else ""
                print(f"      {heading:<24} {was:6.2f} s -> {after:6.2f} s  {ratio}")
            else:
                print(f"      {heading:<24} {after:6.2f} s")
        if before:  # each the median of the pairwise ratios (robust to a load that drifts)
            pairs = list(zip(runs["after"], runs["before"], strict=True))
            own, whole_ = (statistics.median(a[key] / b[key] for a, b in pairs) for key in ("memcalc", "cpu"))
            rows.append(("2", f"memcalc {label}: memcalc's imports {own:.2f}x, the whole command {whole_:.2f}x "
                              f"before's CPU", "memcalc's imports < before's", own < 1.0))
    return rows


def table(rows: list[Row]) -> None:
    """Every figure beside its target."""
    print("\nissue 36: every figure beside its target (item 7, the quick suite's time, is printed by .ci/run)")
    width = max(len(figure) for _, figure, _, _ in rows)
    for item, figure, target, met in rows:
        print(f"   {item}  {figure:<{width}}  target {target:<24} {'met' if met else 'NOT met'}")


def main() -> None:
    """Print every figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose memcalc is timed (default: this one)")
    parser.add_argument("--model", default="torch:gpt2-xl", help="figure 3's model (default: 48 layers)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--only", choices=("commands", "collector", "whole", "others"), default=None)
    parser.add_argument("--before", default=None, help="figure 4: the checkout the whole commands are compared with")
    parser.add_argument("--all", action="store_true", help="issue 36's other figures too, and the closing table")
    parser.add_argument("--baseline", default=None, help="with --all: the checkout item 3 compares with")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"root {args.root}")
    rows: list[Row] = []
    if args.only in (None, "commands"):
        rows += commands(args.root, args.repeat)
    if args.only in (None, "collector"):
        rows += collector(args.root, args.repeat, args.model, args.batch, args.seq_len)
    if args.all or args.only == "whole":
        rows += whole(args.root, args.before, args.repeat)
    if args.all or args.only == "others":
        rows += others(args.baseline, min(args.repeat, 3))
    table(rows)


if __name__ == "__main__":
    main()

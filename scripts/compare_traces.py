"""Compare every trace of a few estimates between two checkouts, field by field and event for event.

    python scripts/compare_traces.py BEFORE_DIR [AFTER_DIR]   # AFTER_DIR: this checkout

A change meant to make the trace cheaper (the dispatch path, the function modes, the meta-kernel
cache) must leave what it records alone. Each checkout runs the same estimates in its own process
(each twice: the second with the meta-kernel cache warm) and pickles every ``StepTrace`` it stops
(storage sizes, events, ops, modules, phases, categories, op counts, phase log, streams, sized
storages) with the estimate's report; the two dumps are then compared, and each difference
printed. Exit status 1 on any difference. The cases: resnet50 (Adam, and inference), gpt2, vit_b_16,
llama-tiny amp-bf16, a QLoRA step (nf4, LoRA 16, checkpointing), gpt2 amp-fp16 with SGD momentum
and checkpointing (the gradient scaler), and the CPU target under amp-bf16.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

#: Runs in the checkout given as argv[1]; pickles {case: (traces, report)} to argv[2].
_CHILD = r'''
import pickle, sys, warnings
sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore")
import memcalc
from memcalc.engine import trace as T
traces = []
stop = T.StorageTracer.stop
def kept(self):
    out = stop(self)
    fields = {name: repr(value) for name, value in vars(self.trace).items()}
    traces.append({**fields, "number of events": str(len(self.trace.events))})
    return out
T.StorageTracer.stop = kept
QLORA = memcalc.FineTune(lora=memcalc.LoRA(16), quant="nf4")
CASES = [
    ("resnet50", dict(batch_size=8, optimizer="adam")),
    ("gpt2", dict(batch_size=2, seq_len=256, optimizer="adamw")),
    ("vit_b_16", dict(batch_size=8, optimizer="adamw")),
    ("llama-tiny", dict(batch_size=2, seq_len=256, optimizer="adamw", precision="amp-bf16")),
    ("llama-tiny", dict(batch_size=2, seq_len=256, optimizer="adamw", precision="bf16", finetune=QLORA,
                        checkpoint=True)),
    ("gpt2", dict(batch_size=2, seq_len=128, optimizer="sgd-momentum", precision="amp-fp16", checkpoint=True)),
    ("resnet50", dict(batch_size=4, mode="inference")),
    ("mlp", dict(batch_size=4, optimizer="adam", gpu="cpu", precision="amp-bf16")),
]
dump = {}
for model, options in CASES:
    traces.clear()
    for _ in range(2):
        report = memcalc.estimate(model, **options)
    dump[f"{model} {sorted(options.items(), key=str)}"] = (list(traces), repr(report.to_dict()))
with open(sys.argv[2], "wb") as out:
    pickle.dump(dump, out)
'''


def dump(root: str, path: str) -> dict[str, tuple[list[dict[str, str]], str]]:
    """Every trace and report of the cases, as the checkout at ``root`` makes them."""
    subprocess.run([sys.executable, "-c", _CHILD, root, path], check=True)
    with open(path, "rb") as handle:
        loaded: dict[str, tuple[list[dict[str, str]], str]] = pickle.load(handle)
    return loaded


def differences(before: dict[str, tuple[list[dict[str, str]], str]],
                after: dict[str, tuple[list[dict[str, str]], str]]) -> list[str]:
    """Each field of each trace (and each report) that differs, named."""
    found = []
    for case, (traces, report) in before.items():
        other_traces, other_report = after[case]
        if len(traces) != len(other_traces):
            found.append(f"{case}: {len(traces)} traces before, {len(other_traces)} after")
            continue
        for index, (trace, other) in enumerate(zip(traces, other_traces, strict=True)):
            found += [f"{case}: trace {index}, {name}" for name in trace if trace[name] != other.get(name)]
        if report != other_report:
            found.append(f"{case}: the report")
    return found


def main() -> None:
    """Dump both checkouts and print what differs."""
    before_root = sys.argv[1]
    after_root = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as scratch:
        before = dump(before_root, os.path.join(scratch, "before.pkl"))
        after = dump(after_root, os.path.join(scratch, "after.pkl"))
    found = differences(before, after)
    for line in found:
        print(line)
    events = sum(int(t["number of events"]) for traces, _ in after.values() for t in traces)
    print(f"{len(after)} cases, {sum(len(t) for t, _ in after.values())} traces, {events:,} events: "
          f"{len(found)} differences")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()

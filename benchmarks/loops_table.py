"""How much the training loop moves the peak: one model under each preset loop, with and
without ``keep_grads`` (``zero_grad(set_to_none=False)``), on the generic CUDA GPU, Adam at
its resolved implementation (given to every loop: ``trainer`` alone would take the
TrainingArguments defaults' fused AdamW), fp32. Peaks are relative to the ``minimal`` loop's of the same
model (ratios measured in one run). Then the time of the traced loop path against the fast
path (memcalc's default loop, whose second iteration is synthesised) for gpt2, in the same
process. GPT-2 is the zoo's plain-torch model (``torch:gpt2``), whose output is the logits that
memcalc's loss takes, as the README's table and its arithmetic were written for; ``gpt2`` alone
is transformers' model where transformers is installed, trained with its own loss.

Prints a table; asserts nothing. Run: ``python benchmarks/loops_table.py``.
"""

from __future__ import annotations

import time
from typing import Any

import memcalc
from memcalc.engine.run import build_report, trace_model
from memcalc.fields import build_step
from memcalc.sources.resolve import resolve
from memcalc.targets.backend import CudaBackend

MiB = 2**20
MODELS: dict[str, dict[str, Any]] = {
    "torch:gpt2 (batch 4, seq 512)": dict(model="torch:gpt2", batch_size=4, seq_len=512),
    "resnet50 (batch 32)": dict(model="resnet50", batch_size=32),
}
PRESETS = ("minimal", "tutorial", "trainer", "zero-grad-late")


def table() -> None:
    print(f"{'model':<26} {'loop':<16} {'keep_grads':<10} {'peak (MiB)':>11} {'vs minimal':>10}  "
          f"{'peak at':<18} optimizer")
    for label, spec in MODELS.items():
        spec = dict(spec)
        model = spec.pop("model")
        baseline = None
        for keep in (False, True):
            for preset in PRESETS:
                report = memcalc.estimate(model, loop=memcalc.Loop(preset, keep_grads=keep), optimizer="adam", **spec)
                peak = report.bytes.peak_allocated
                baseline = baseline or peak
                where = f"{report.peak_phase.value}, it. {report.peak_iteration}"
                print(f"{label:<26} {preset:<16} {keep!s:<10} {peak / MiB:>11,.1f} {peak / baseline:>10.3f}  "
                      f"{where:<18} {report.optimizer} ({report.optimizer_impl})")
        print()


def timings() -> None:
    spec = dict(batch_size=4, seq_len=512)
    memcalc.estimate("torch:gpt2", **spec)  # warm: imports, kernel caches
    start = time.perf_counter()
    fast = memcalc.estimate("torch:gpt2", **spec)
    fast_s = time.perf_counter() - start
    start = time.perf_counter()
    step = build_step("torch:gpt2", **spec)
    resolved = resolve("torch:gpt2", **spec)
    traced = build_report(resolved, trace_model(resolved, step, CudaBackend(step), traced_loop=True), step)
    traced_s = time.perf_counter() - start
    print(f"torch:gpt2 (batch 4, seq 512), Adam, generic GPU: fast path {fast_s:.2f} s "
          f"(peak {fast.bytes.peak_allocated:,} B); minimal loop traced as written {traced_s:.2f} s "
          f"(peak {traced.bytes.peak_allocated:,} B); {traced_s / fast_s:.2f}×")


if __name__ == "__main__":
    table()
    timings()

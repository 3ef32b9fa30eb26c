"""How long does ``memcalc.max_batch_size`` take, in units of one estimate?

The target: a fit in at most four estimates' time (an estimate costs the same at any batch
size: meta tensors). For a batch-affine step the search makes three real estimates (batch 2,
one jump, the answer) and replays the batch-affine trace family through the allocator model
for the rest: the search under the budget less the margin, the check that walks down from
the boundary it finds, and the raw boundary under the whole budget. For resnet50 (224×224)
and gpt2 (256 tokens), Adam, fp32, on a few catalogue GPUs, with the default margin, this
prints the fit time, the median time of one estimate with the same options (warm, under the
same capacity; both medians of three runs), their ratio, the estimates and replays the fit made, the batch with and
without the margin, the batches the check replayed, and the search's probes.

    python benchmarks/speed_fit.py
"""

from __future__ import annotations

import statistics
import time
import warnings

from tabulate import tabulate

import memcalc
from memcalc.api import max_batch_size

CASES = (
    ("resnet50", {}),
    ("gpt2", {"seq_len": 256}),
)
GPUS = ("t4", "a100-40gb", "h100-80gb")
#: Estimates timed per case for the "one estimate" baseline, and fits timed per case (medians
#: taken: a garbage collection of the whole heap now and then adds ~0.1 s to one run).
BASELINE_REPEATS = 3
FIT_REPEATS = 3


def one_estimate_seconds(model: str, batch: int, capacity: int, options: dict) -> float:
    times = []
    for _ in range(BASELINE_REPEATS):
        start = time.perf_counter()
        memcalc.estimate(model, batch_size=batch, capacity=capacity, **options)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    warnings.simplefilter("ignore")  # approximation notes are not what is measured here
    rows = []
    for model, options in CASES:
        memcalc.estimate(model, batch_size=1, **options)  # warm-up: imports, first-call caches
        for gpu in GPUS:
            times = []
            for _ in range(FIT_REPEATS):
                start = time.perf_counter()
                result = max_batch_size(model, gpu=gpu, **options)
                times.append(time.perf_counter() - start)
            fit_seconds = statistics.median(times)
            baseline = one_estimate_seconds(model, result.batch_size, result.budget_bytes,
                                            {**options, "gpu": gpu})
            rows.append([model, gpu, result.batch_size, result.raw_batch_size, f"{fit_seconds:.2f}",
                         f"{baseline:.2f}", f"{fit_seconds / baseline:.1f}", result.num_estimates, result.replays,
                         f"{result.checked_from}–{result.batch_size}",
                         " ".join(f"{'~' if p.synthetic else ''}{p.batch_size}{'' if p.fits else '✗'}"
                                  for p in result.probes)])
    print(tabulate(rows, headers=["model", "gpu", "batch", "raw", "fit s", "1 estimate s", "fit / estimate",
                                  "estimates", "replays", "checked", "probes (✗: does not fit; ~: replay)"],
                   colalign=("left", "left", "right", "right", "right", "right", "right", "right", "right", "left",
                             "left"),
                   disable_numparse=True))


if __name__ == "__main__":
    main()

"""How long does ``memcalc.max_batch_size`` take, in units of one estimate?

The search's target is a fit in at most about four estimates' time (four real estimates for
a batch-affine step, plus synthetic replays of the allocator model) (an estimate costs the same
at any batch size: meta tensors). For resnet50 (224×224) and gpt2 (256 tokens), Adam, fp32,
on a few catalogue GPUs, this prints the fit time, the median time of one estimate with the
same options (warm, under the same capacity), their ratio, and the estimates the fit made.

    python benchmarks/speed_fit.py
"""

from __future__ import annotations

import statistics
import time
import warnings

from tabulate import tabulate

import memcalc
from memcalc.search.fit import max_batch_size

CASES = (
    ("resnet50", {}),
    ("gpt2", {"seq_len": 256}),
)
GPUS = ("t4", "a100-40gb", "h100-80gb")
#: Estimates timed per case for the "one estimate" baseline (median taken).
BASELINE_REPEATS = 3


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
            start = time.perf_counter()
            result = max_batch_size(model, gpu=gpu, **options)
            fit_seconds = time.perf_counter() - start
            baseline = one_estimate_seconds(model, result.batch_size, result.budget_bytes,
                                            {**options, "gpu": gpu})
            rows.append([model, gpu, result.batch_size, f"{fit_seconds:.2f}", f"{baseline:.2f}",
                         f"{fit_seconds / baseline:.1f}", result.num_estimates,
                         " ".join(f"{'~' if p.synthetic else ''}{p.batch_size}{'' if p.fits else '✗'}"
                                  for p in result.probes)])
    print(tabulate(rows, headers=["model", "gpu", "batch", "fit s", "1 estimate s", "fit / estimate",
                                  "estimates", "probes (✗: does not fit; ~: synthetic replay)"],
                   colalign=("left", "left", "right", "right", "right", "right", "right", "left"),
                   disable_numparse=True))


if __name__ == "__main__":
    main()

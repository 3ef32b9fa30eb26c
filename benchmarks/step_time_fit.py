"""How well does the fitted step-time model predict steps it was not fitted to?

    python benchmarks/step_time_fit.py

The H100's measurements (``tests/data/gpu/2026-11-25-h100/``: eight profiled configs, eight
timed ones, six of them both) are split in two. The model (:mod:`memcalc.cuda.gpus.calibration`)
is fitted on the first part, the profile and the step times of its configs only, and predicts
the held-out part, which differs from it in batch (resnet50 at 256), checkpointing (gpt2 b16),
model (bert-base) and dtype (resnet50 in float32, TF32 convolutions). Then every timed config is
held out in turn (leave one out: the seven others and their profiles fit it). It prints
predicted / measured for each, and the errors of each part, beside the model fitted on all of
them (the committed coefficients) and the roofline before the fit (``times.jsonl``'s
``predicted_s``). Last, the committed model against the same steps measured again on another
H100 and an H200 (``tests/data/gpu/2026-11-26-steps/``).
"""

from __future__ import annotations

import functools
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

import memcalc
from memcalc.cuda.gpus.calibration import (
    ClassFeatures,
    FitResult,
    MeasuredConfig,
    fit,
    ideal_overrides,
    load_measurements,
    predict,
)

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "gpu" / "2026-11-25-h100"
#: The configs held out of the fit: unseen batch, checkpointing, model and dtype.
HELD_OUT = (
    "resnet50 b256 sgd-momentum amp-bf16",
    "gpt2 b16 s1024 adamw amp-bf16 + checkpoint",
    "bert-base b32 s512 adamw amp-bf16",
    "resnet50 b64 adam fp32",
)


AGAIN = DATA.parent / "2026-11-26-steps"


@functools.cache
def features(config: MeasuredConfig) -> ClassFeatures:
    """memcalc's per-class ideal seconds and kernels of the config's traced step on the H100."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = memcalc.estimate(config.model, **config.estimate_kwargs())
    return ClassFeatures.of(memcalc.step_time(report, **ideal_overrides()))


def predicted(config: MeasuredConfig, gpu: str) -> float:
    """memcalc's step time for ``config`` on the catalogue GPU ``gpu`` (the committed coefficients)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        time = memcalc.estimate(config.model, **config.estimate_kwargs(gpu)).time
    assert time is not None
    return time.seconds


def measured_again() -> None:
    """The committed model against the steps measured again on 2026-11-26 (an H100, an H200)."""
    first = {c.name: c.step_seconds for c in load_measurements(DATA)}
    rows = []
    for file, gpu in (("h100-times.jsonl", "h100-80gb"), ("h200-times.jsonl", "h200")):
        for config in load_measurements(AGAIN, file):
            if config.step_seconds is None:
                continue
            before = first.get(config.name)
            rows.append([gpu, config.name, f"{config.step_seconds * 1e3:.1f}",
                         f"{before / config.step_seconds:.2f}" if before else "",
                         f"{predicted(config, gpu) / config.step_seconds:.2f}"])
    print("\nmeasured again on 2026-11-26 (tests/data/gpu/2026-11-26-steps/): the committed model, predicted / "
          "measured\n")
    print(tabulate(rows, headers=["GPU", "config", "measured ms", "2026-11-25 H100 / this", "predicted / measured"],
                   colalign=("left", "left", "right", "right", "right"), disable_numparse=True))


def ratio(result: FitResult, config: MeasuredConfig) -> float:
    """Predicted / measured step."""
    assert config.step_seconds is not None
    return predict(result, features(config)) / config.step_seconds


def summary(ratios: Sequence[float]) -> str:
    """``median 3.1%, worst 8.8%`` of |predicted / measured − 1|."""
    errors = [abs(r - 1) for r in ratios]
    return f"median {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def main() -> None:
    configs = load_measurements(DATA)
    timed = [c for c in configs if c.step_seconds]
    everything = fit(configs, features)
    train = [c for c in configs if c.name not in HELD_OUT]
    split = fit(train, features)
    loo = {c.name: ratio(fit([o for o in configs if o is not c], features), c) for c in timed}
    rows = []
    for config in timed:
        assert config.step_seconds is not None and config.predicted_before is not None
        held = config.name in HELD_OUT
        rows.append([config.name, f"{config.step_seconds * 1e3:.1f}",
                     f"{config.predicted_before / config.step_seconds:.2f}", f"{ratio(everything, config):.2f}",
                     ("held out " if held else "fitted ") + f"{ratio(split, config):.2f}", f"{loo[config.name]:.2f}"])
    print("step time on the NVIDIA H100 80GB (torch 2.11), predicted / measured (median of 8 real steps)\n")
    print(tabulate(rows, headers=["config", "measured ms", "before the fit", "fitted on all 8",
                                  "split: fitted on 4 + 2 profiled", "leave one out"],
                   colalign=("left", "right", "right", "right", "right", "right"), disable_numparse=True))
    fitted_on = [c for c in timed if c.name not in HELD_OUT]
    held_out = [c for c in timed if c.name in HELD_OUT]
    print()
    before = [c.predicted_before / c.step_seconds for c in timed if c.predicted_before and c.step_seconds]
    print(f"before the fit (the assumed efficiencies): {summary(before)}")
    print(f"fitted on all eight (the committed coefficients): {summary([ratio(everything, c) for c in timed])}")
    print(f"split, the {len(fitted_on)} timed configs fitted on: {summary([ratio(split, c) for c in fitted_on])}")
    print(f"split, the {len(held_out)} held out: {summary([ratio(split, c) for c in held_out])}")
    print(f"leave one out, each config predicted by a fit on the seven others: {summary(list(loo.values()))}")
    measured_again()


if __name__ == "__main__":
    main()

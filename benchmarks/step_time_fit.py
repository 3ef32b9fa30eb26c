"""How well does the fitted step-time model predict steps it was not fitted to?

    python benchmarks/step_time_fit.py

The healthy H200's measurements (``tests/data/gpu/2026-11-26-h200-profile/``: eight profiled
configs, twelve timed ones, the eight profiled among them) are split in two. The model
(:mod:`memcalc.timing.calibration`) is fitted on the first part, the profile and the step
times of its configs only, and predicts the held-out part (:data:`HELD_OUT`), which differs from
it in batch (resnet50 at 256), checkpointing (gpt2 b16), model (bert-base, mobilenet_v2), dtype
(resnet50 in float32, TF32 convolutions) and a host-bound step (gpt2 b2 × 512 tokens). Then
every timed config is held out in turn (leave one out: the eleven others and their profiles fit
it). It prints predicted / measured for each, and the errors of each part, beside the model
fitted on all of them (the committed coefficients) and the model before this fit (the one fitted
to the half-speed H100 of 2026-11-25, ``times.jsonl``'s ``predicted_s``).

Last, the H100: the committed model, timed with the H100's datasheet peaks, against a healthy
H100's eight steps (``tests/data/gpu/2026-11-26-steps/h100-times.jsonl``), beside the same fit
made on the 2026-11-25 H100's data (``tests/data/gpu/2026-11-25-h100/``); then with the H100's
bandwidth factor fitted to those eight steps (what memcalc uses on an H100), and with each step
left out of that factor's fit in turn.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

# the fit script's data and its traced features (the plain-torch models the steps were measured
# with): one definition, so that this check cannot drift from what the committed model is fitted to
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from fit_step_time import DATA, EXCLUDED, RECHECK, RECHECK_FILE, features_on

from memcalc.timing.calibration import (
    ClassFeatures,
    FitResult,
    MeasuredConfig,
    fit,
    fit_bandwidth,
    leave_one_out_bandwidth,
    load_measurements,
    predict,
)

#: The configs held out of the split's fit: unseen batch, checkpointing, models, dtype, a host-bound step.
HELD_OUT = (
    "resnet50 b256 sgd-momentum amp-bf16",
    "gpt2 b16 s1024 adamw amp-bf16 + checkpoint",
    "bert-base b32 s512 adamw amp-bf16",
    "resnet50 b64 adam fp32",
    "gpt2 b2 s512 adamw amp-bf16",
    "mobilenet_v2 b128 sgd-momentum amp-fp16",
)
#: A healthy H100's eight steps: the check of the datasheet scaling, and its bandwidth factor's data.
H100_STEPS = (RECHECK, RECHECK_FILE)


def features(config: MeasuredConfig) -> ClassFeatures:
    """:func:`features_on` the H200."""
    return features_on(config, "h200")


def h100_features(config: MeasuredConfig, bandwidth_scale: float = 1.0) -> ClassFeatures:
    """:func:`features_on` the H100 80GB (SXM)."""
    return features_on(config, "h100-80gb", bandwidth_scale)


def ratio(result: FitResult, config: MeasuredConfig, gpu: str = "h200") -> float:
    """Predicted / measured step."""
    assert config.step_seconds is not None
    return predict(result, features_on(config, gpu)) / config.step_seconds


def summary(ratios: Sequence[float]) -> str:
    """``median 3.1%, worst 8.8%`` of |predicted / measured − 1|."""
    errors = [abs(r - 1) for r in ratios]
    return f"median {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def datasheet_scaling(committed: FitResult) -> None:
    """The committed model on the healthy H100's steps: fitted to the 2026-11-25 H100, scaled from the
    H200 by the datasheet, with the H100's bandwidth factor fitted to these steps, and each left out of it."""
    first = fit(load_measurements(EXCLUDED), h100_features)
    again = [c for c in load_measurements(*H100_STEPS) if c.step_seconds]
    bandwidth = fit_bandwidth(committed, again, h100_features)
    held_out = leave_one_out_bandwidth(committed, again, h100_features)
    rows = [[c.name, f"{c.step_seconds * 1e3:.1f}" if c.step_seconds else "",
             f"{ratio(first, c, 'h100-80gb'):.2f}", f"{ratio(committed, c, 'h100-80gb'):.2f}", f"{fitted_ratio:.2f}",
             f"{held:.2f}"] for c, fitted_ratio, held in zip(again, bandwidth.ratios, held_out, strict=True)]
    print("\na healthy H100 80GB on 2026-11-26 (tests/data/gpu/2026-11-26-steps/h100-times.jsonl), "
          "predicted / measured\n")
    print(tabulate(rows, headers=["config", "measured ms", "fitted to the 2026-11-25 H100",
                                  "fitted to the H200, scaled by datasheet",
                                  f"H100 bandwidth x{bandwidth.scale:.3f}, fitted on these 8", "each left out"],
                   colalign=("left", "right", "right", "right", "right", "right"), disable_numparse=True))
    print(f"\nfitted to the 2026-11-25 H100: {summary([ratio(first, c, 'h100-80gb') for c in again])}")
    print(f"fitted to the H200 (committed), H100 datasheet peaks: "
          f"{summary([ratio(committed, c, 'h100-80gb') for c in again])}")
    print(f"with the H100's bandwidth factor (x{bandwidth.scale:.3f}) fitted on these eight: "
          f"{summary(bandwidth.ratios)}")
    print(f"each step left out of the factor's fit (fitted on the seven others): {summary(held_out)}")


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
    fitted_on = [c for c in timed if c.name not in HELD_OUT]
    held_out = [c for c in timed if c.name in HELD_OUT]
    profiled = sum(1 for c in train if c.kernel_seconds)
    print("step time on the NVIDIA H200 (torch 2.11), predicted / measured (median of 8 real steps)\n")
    print(tabulate(rows, headers=["config", "measured ms", "before (fitted to the 2026-11-25 H100)",
                                  f"fitted on all {len(timed)}",
                                  f"split: fitted on {len(fitted_on)} ({profiled} profiled)", "leave one out"],
                   colalign=("left", "right", "right", "right", "right", "right"), disable_numparse=True))
    print()
    before = [c.predicted_before / c.step_seconds for c in timed if c.predicted_before and c.step_seconds]
    print(f"before (the model fitted to the 2026-11-25 H100): {summary(before)}")
    print(f"fitted on all {len(timed)} (the committed coefficients): {summary([ratio(everything, c) for c in timed])}")
    print(f"split, the {len(fitted_on)} timed configs fitted on: {summary([ratio(split, c) for c in fitted_on])}")
    print(f"split, the {len(held_out)} held out: {summary([ratio(split, c) for c in held_out])}")
    print(f"leave one out, each config predicted by a fit on the {len(timed) - 1} others: "
          f"{summary(list(loo.values()))}")
    datasheet_scaling(everything)


if __name__ == "__main__":
    main()

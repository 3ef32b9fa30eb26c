"""The step-time model's coefficients, read from ``fitted.json`` beside this module (package data).

That file is WRITTEN BY ``scripts/fit_step_time.py`` from a GPU's profiled kernels and timed steps
(its ``provenance`` names the script, the inputs and the dates); do not edit it, run the script
(``--check`` tells whether it is current). This module only gives its figures names and types.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from memcalc.core.throughput import OpClass

#: The data file, beside this module.
FITTED_FILE = "fitted.json"
_DATA: dict[str, Any] = json.loads(resources.files(__package__).joinpath(FITTED_FILE).read_text(encoding="utf-8"))


def _range(values: list[float]) -> tuple[float, float]:
    low, high = values
    return float(low), float(high)


#: Which script wrote the file, from which inputs, when they were measured and when it was written.
PROVENANCE: dict[str, Any] = dict(_DATA["provenance"])
#: The catalogue key, the device and the torch the coefficients were measured with.
GPU: str = str(_DATA["gpu"])
DEVICE: str = str(_DATA["device"])
TORCH: str = str(_DATA["torch"])
#: fraction of the binding datasheet peak a large kernel of each class reaches
EFFICIENCY: dict[OpClass, float] = {OpClass[name]: float(v) for name, v in _DATA["efficiency"].items()}
#: seconds each kernel of a class takes besides its roofline time
KERNEL_SECONDS: dict[OpClass, float] = {OpClass[name]: float(v) for name, v in _DATA["kernel_seconds"].items()}
#: seconds between kernels (launch and host-side dispatch), per kernel
GAP_SECONDS = float(_DATA["gap_seconds"])
#: the host's seconds per kernel (eager dispatch): a step is never shorter than its kernels × this
HOST_SECONDS = float(_DATA["host_seconds"])
#: the largest |measured / predicted - 1| on the timed steps below: predicted × (1 ± this) covers them
SPREAD = float(_DATA["spread"])
#: the timed steps the spread is measured on
TIMED: tuple[str, ...] = tuple(str(name) for name in _DATA["timed"])
#: predicted / measured on a healthy H100's steps, not fitted, timed with the H100's datasheet
#: peaks: the check of the datasheet scaling
RECHECK_GPU = str(_DATA["recheck"]["gpu"])
RECHECK_STEPS = int(_DATA["recheck"]["steps"])
RECHECK_RATIO = float(_DATA["recheck"]["ratio"])
RECHECK_RANGE = _range(_DATA["recheck"]["range"])
RECHECK_DATE = str(_DATA["recheck"]["date"])
#: per catalogue key, the factor on the datasheet bandwidth fitted to that GPU's own steps above
#: (the H200's coefficients kept); its predicted / measured on them, and each left out of the fit
MEASURED_BANDWIDTH: dict[str, float] = {
    str(k): float(v) for k, v in _DATA["measured_bandwidth"]["scale"].items()}
MEASURED_STEPS = int(_DATA["measured_bandwidth"]["steps"])
MEASURED_RANGE = _range(_DATA["measured_bandwidth"]["range"])
MEASURED_HELD_OUT_RANGE = _range(_DATA["measured_bandwidth"]["held_out_range"])
#: the profiled steps the kernel coefficients are fitted to
PROFILED: tuple[str, ...] = tuple(str(name) for name in _DATA["profiled"])

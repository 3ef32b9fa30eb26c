"""Depth extrapolation's gain: a deep Llama's distributed estimate with the composition on and
off (every role traced whole), in one process, warm, alternating, CPU seconds by
``time.process_time``. Run: ``PYTHONPATH=. python benchmarks/depth_extrapolation.py [ROUNDS]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import memcalc
import memcalc.distributed.strategies as strategies
from memcalc.distributed.setting import Distributed

_COMPOSE = strategies.traced_by_depth


def _off(*args: Any, **kwargs: Any) -> None:
    return None


def _run(compose: bool) -> tuple[float, str]:
    strategies.traced_by_depth = _COMPOSE if compose else _off  # type: ignore[assignment]
    start = time.process_time()
    report = memcalc.estimate("llama-3-70b", batch_size=2, seq_len=8192, checkpoint=True, precision="amp-bf16",
                              gpu="h100-80gb", distributed=Distributed(mesh={"dp_shard": 32, "tp": 2}))
    return time.process_time() - start, json.dumps(report.to_dict(), sort_keys=True)


def main(rounds: int) -> None:
    _run(True)
    _run(False)  # warm: imports, kernel caches
    timings: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, str] = {}
    for _ in range(rounds):
        for compose in (False, True):
            seconds, outputs[compose] = _run(compose)
            timings[compose].append(seconds)
    print(f"load average {os.getloadavg()[0]:.2f}; rounds {rounds}")
    for compose, label in ((False, "80 layers traced"), (True, "2+3+4 layers traced, 80 composed")):
        print(f"{label}: CPU s {', '.join(f'{t:.2f}' for t in timings[compose])}; min {min(timings[compose]):.2f}")
    print("reports identical:", outputs[True] == outputs[False])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)

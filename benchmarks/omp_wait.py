"""OpenMP's wait policy and a real training step on two threads (tests/conftest.py sets
``OMP_WAIT_POLICY=PASSIVE`` for the test processes, tests/gloo_runs.py for the gloo ranks).

Each round runs the same step in two fresh processes, one with libgomp's default wait policy (an
idle thread spins at a barrier before it sleeps) and one with ``OMP_WAIT_POLICY=PASSIVE`` (it
sleeps at once), taking turns, and prints each one's wall and CPU seconds and the ratio of the
round. The step: three real Adam steps (after one warm-up) of the zoo's llama-tiny, batch 2 x 128
tokens, on :func:`torch.get_num_threads` threads, as a slow test's real step runs. On an idle
machine the two policies are close; the passive one pays where the cores are shared (CI's two
xdist workers and their gloo ranks on two cores), so run it beside the load you care about and
give the load average with the figures.

Run: ``python benchmarks/omp_wait.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

#: What a child process runs: one warm-up step, then three timed (wall and CPU seconds, as JSON).
STEP = """
import json, time, torch
from memcalc.sources.resolve import resolve
torch.manual_seed(0)
model, inputs = resolve("torch:llama-tiny", batch_size=2, seq_len=128).build_real(torch.device("cpu"))
optimizer = torch.optim.Adam(model.parameters(), foreach=True)
def step():
    model(*inputs.args).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
step()
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(3):
    step()
print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                  "threads": torch.get_num_threads()}))
"""


def run(policy: str | None) -> dict[str, float]:
    """The step in a fresh process whose ``OMP_WAIT_POLICY`` is ``policy`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    rounds = parser.parse_args().rounds
    for round_ in range(1, rounds + 1):
        load = os.getloadavg()[0]
        default, passive = run(None), run("PASSIVE")
        print(f"round {round_} (load {load:.1f} -> {os.getloadavg()[0]:.1f}, {default['threads']:.0f} threads): "
              f"default {default['wall']:.2f} s wall / {default['cpu']:.2f} CPU-s, "
              f"passive {passive['wall']:.2f} s / {passive['cpu']:.2f} CPU-s: "
              f"{passive['wall'] / default['wall']:.2f}x wall", flush=True)


if __name__ == "__main__":
    main()

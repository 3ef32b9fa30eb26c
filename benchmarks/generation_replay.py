"""The report's replay of a long generation alone (:func:`memcalc.engine.steady_replay.replay_generation`),
another checkout's against this one's on the same traced step, in one process: CPU seconds of each
(``--repeat`` pairs, alternating, and their medians) and whether their stats are equal. For a change
of the replay on a loaded machine, where whole estimates in two processes are too noisy to compare.
Then the replay's floor while the large pool is replayed event by event: the decode steps'
large-pool events fed alone. Asserts nothing.

Run: ``python benchmarks/generation_replay.py --base /tmp/main-archive [--model llama-2-7b]
[--seq-len 512] [--new-tokens 1024] [--repeat 2]``; ``--base``: a checkout (e.g. a ``git archive``
of main) whose ``memcalc/engine/steady_replay.py`` is loaded beside this one (it imports this
checkout's allocator).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import memcalc
from memcalc.core.categories import Phase
from memcalc.engine import allocator, run, steady_replay
from memcalc.engine.timeline import Program
from memcalc.engine.trace import StepTrace


def replay_call(model: str, seq_len: int, new_tokens: int) -> tuple[Any, ...]:
    """The positional arguments of the report's ``run._replayed`` call (program, trace, ...) in an
    estimate of ``model`` generating ``new_tokens`` after ``seq_len``, caught by a spy around it."""
    seen: list[tuple[Any, ...]] = []
    replayed = run._replayed

    def spy(*call: Any, **given: Any) -> Any:
        seen.append(call)
        return replayed(*call, **given)

    run._replayed = spy  # type: ignore[assignment]
    try:
        memcalc.estimate(model, batch_size=1, seq_len=seq_len, mode="generate", new_tokens=new_tokens,
                         optimizer="none")
    finally:
        run._replayed = replayed  # type: ignore[method-assign]
    return seen[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, type=Path)
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=2, help="pairs of replays, alternating (medians printed)")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("base_steady_replay",
                                                  args.base / "memcalc" / "engine" / "steady_replay.py")
    assert spec is not None and spec.loader is not None
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    call = replay_call(args.model, args.seq_len, args.new_tokens)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.repeat):
        start = time.process_time()
        before = base.replay_generation(*call)
        middle = time.process_time()
        after = steady_replay.replay_generation(*call)
        end = time.process_time()
        times[0].append(middle - start)
        times[1].append(end - middle)
        print(f"{args.model} {args.seq_len}+{args.new_tokens}: base {middle - start:.2f} s, this "
              f"{end - middle:.2f} s ({(middle - start) / (end - middle):.1f}x); same stats {before == after}")
    medians = [sorted(t)[len(t) // 2] for t in times]
    print(f"the decode steps' large-pool events alone, fed in one call: {_large_pool_alone(*call[:2]):.3f} s "
          f"(what the replay costs at least while the large pool is replayed event by event)")
    print(f"medians of {args.repeat}: base {medians[0]:.3f} s, this {medians[1]:.3f} s "
          f"({medians[0] / medians[1]:.2f}x); load average {os.getloadavg()[0]:.1f}")

def _large_pool_alone(program: Program, trace: StepTrace) -> float:
    """CPU seconds of the decode steps' large-pool events fed to an allocator that replayed the
    events before them (the best of three)."""
    offset = program.iteration_starts[0]
    start = offset + next(index for phase, index in trace.phase_log if phase is Phase.DECODE)
    nbytes = np.asarray(trace.nbytes, dtype=np.int64)
    rounded = np.where(nbytes == 0, 0, np.maximum(-(-nbytes // allocator.K_MIN_BLOCK_SIZE), 1)
                       * allocator.K_MIN_BLOCK_SIZE)
    keys = program.keys[start:]
    large = (rounded > allocator.K_SMALL_SIZE)[np.where(keys >= 0, keys, ~keys)]
    events, sized = keys[large].tolist(), rounded.tolist()
    best = float("inf")
    for _ in range(3):
        model, held = allocator.CachingAllocatorModel(), dict[int, int]()
        model.feed(program.events[:start], trace.nbytes, sized, held)
        begin = time.process_time()
        model.feed(events, trace.nbytes, sized, held)
        best = min(best, time.process_time() - begin)
    return best


if __name__ == "__main__":
    main()

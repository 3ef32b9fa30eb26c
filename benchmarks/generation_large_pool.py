"""Why a long generation's large pool is replayed event by event (issue 36, item 5, option (a)):
whether its decode steps repeat the step before's decisions up to the caches' growth. Replays the
estimate's events in one process and, as each decode step begins, reads the large pool's
*structure*: its segments by address, each a chain of blocks, each free or held by a storage named
from the step's first storage (sizes and addresses left out). A run of steps could be skipped
exactly, each block's size advanced arithmetically, only where that structure is the step
before's (the same blocks chosen, split and merged, each free naming the block the step before's
same free named); prints how often it is, and how often it equals any of the ``--lags`` steps
before. Asserts nothing.

Run: ``python benchmarks/generation_large_pool.py [--model llama-2-7b] [--seq-len 512]
[--new-tokens 1024] [--lags 40]``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from generation_replay import replay_call

from memcalc.core.categories import Phase
from memcalc.engine import allocator


def _structure(model: allocator.CachingAllocatorModel, first: int, base: int) -> tuple[Any, ...]:
    """The large pool's segments by address, each its blocks in order: free (None) or the owner,
    named from ``base`` (a decode step's first storage) when it is a decode step's (born from
    ``first`` on), else by uid."""
    large = model._large
    owner = {id(block): key for key, block in model._live.items() if block.pool is large}
    heads: dict[int, Any] = {}
    for block in [*large.blocks.values(), *(b for b in model._live.values() if b.pool is large)]:
        while block.prev is not None:
            block = block.prev
        heads[block.addr] = block
    out = []
    for addr in sorted(heads):
        chain, block = [], heads[addr]
        while block is not None:
            key = owner.get(id(block))
            chain.append(None if key is None else ("step", key - base) if key >= first else ("uid", key))
            block = block.next
        out.append(tuple(chain))
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--lags", type=int, default=40)
    args = parser.parse_args()
    program, trace = replay_call(args.model, args.seq_len, args.new_tokens)[:2]
    offset = program.iteration_starts[0]
    starts = [offset + start for phase, start in trace.phase_log if phase is Phase.DECODE]
    keys, nbytes = program.keys, trace.nbytes_array()
    rounded = ((nbytes + allocator.K_MIN_BLOCK_SIZE - 1) // allocator.K_MIN_BLOCK_SIZE) * allocator.K_MIN_BLOCK_SIZE
    model, held = allocator.CachingAllocatorModel(), dict[int, int]()

    def feed(events: np.ndarray) -> None:
        births = events[events >= 0]
        sized = dict(zip(births.tolist(), rounded[births].tolist(), strict=True))
        model.feed(events.tolist(), sized, sized, held)

    feed(keys[:starts[0]])
    bounds = [*starts, keys.size]
    structures: list[tuple[Any, ...]] = []
    segments = []
    bases = [int(step[step >= 0].min()) for step in (keys[a:b] for a, b in itertools.pairwise(bounds))]
    for j in range(len(starts)):
        step = keys[bounds[j]:bounds[j + 1]]
        structures.append(_structure(model, bases[0], bases[j]))
        segments.append(model._num_segments)
        feed(step)
    same = sum(a == b for a, b in itertools.pairwise(structures))
    earlier = sum(any(structures[j] == structures[j - lag] for lag in range(1, min(args.lags, j) + 1))
                  for j in range(1, len(structures)))
    print(f"{args.model} {args.seq_len}+{args.new_tokens}: {len(starts)} decode steps, the large pool's "
          f"segments {segments[0]} -> {model._num_segments} (new ones at {len(set(segments)) - 1} steps)")
    print(f"its structure as a step begins equals the step before's at {same} of {len(starts) - 1} steps, "
          f"one of the {args.lags} before at {earlier}")


if __name__ == "__main__":
    main()

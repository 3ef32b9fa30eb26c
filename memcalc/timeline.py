"""From a :class:`~memcalc.trace.StepTrace` to the memory curve of a training loop.

A training loop's first step is not its worst: ``torch.optim`` creates its state lazily at the
first ``step()``, after backward has freed the activations, so the first iteration never holds
optimizer state and activations together — every later iteration does. We trace one step and
build the second iteration from it (the same alloc/free order, with the storages still alive
after the first iteration — optimizer state — already there), then replay both.

Replaying is a single pass over integers: allocation sizes (rounded as the CUDA caching
allocator rounds them), running totals per category, and a copy of those totals whenever
a new peak is reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .categories import Category, Phase
from .trace import StepTrace

__all__ = ("Program", "Peak", "final_categories", "build_program", "replay", "alive_at_end",
           "CUDA_BLOCK_ROUNDING", "cuda_round")

# c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize = 512; round_size() rounds every request
# up to a multiple of it, and that rounded size is what max_memory_allocated counts.
CUDA_BLOCK_ROUNDING = 512

_CATEGORIES = list(Category)
_CATEGORY_INDEX = {c: i for i, c in enumerate(_CATEGORIES)}


def cuda_round(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a request of ``nbytes`` (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // CUDA_BLOCK_ROUNDING) * CUDA_BLOCK_ROUNDING


def final_categories(trace: StepTrace, gradients: Iterable[int], optimizer_state: Iterable[int]) -> list[Category]:
    """One category per storage: explicit (parameters, buffers, inputs) first, then what the
    storage turned out to be (a ``.grad``, optimizer state), else by the phase of its birth."""
    categories: list[Category] = []
    for uid, explicit in enumerate(trace.category):
        if explicit is not None:
            categories.append(explicit)
        elif trace.phase[uid] in (Phase.FORWARD, Phase.LOSS):
            categories.append(Category.ACTIVATIONS)
        else:
            categories.append(Category.WORKSPACE)
    for uid in gradients:
        if trace.category[uid] is None:
            categories[uid] = Category.GRADIENTS
    for uid in optimizer_state:
        if trace.category[uid] is None:
            categories[uid] = Category.OPTIMIZER_STATE
    return categories


def alive_at_end(trace: StepTrace) -> set[int]:
    """Storages born during the step and still alive when it ended."""
    alive: set[int] = set()
    for event in trace.events:
        if event >= 0:
            alive.add(event)
        else:
            alive.discard(~event)
    return alive


@dataclass(frozen=True)
class Program:
    """The replayable sequence: ``events`` over keys ``0 .. 2N-1`` (``uid`` for the first
    iteration, ``uid + N`` for the second), every key's storage being ``key % N``."""

    events: list[int]
    num_storages: int
    iterations: int
    iteration_starts: tuple[int, ...]  # index in events where each iteration begins

    def storage(self, key: int) -> int:
        return key % self.num_storages

    def iteration_of(self, index: int) -> int:
        iteration = 1
        for i, start in enumerate(self.iteration_starts):
            if index >= start:
                iteration = i + 1
        return iteration


def build_program(trace: StepTrace, iterations: int) -> Program:
    """Pre-existing storages, then ``iterations`` copies of the step (at most 2 are needed:
    the third iteration's events are the second's)."""
    n = trace.num_storages
    events: list[int] = list(trace.preexisting)
    starts = [len(events)]
    events.extend(trace.events)
    if iterations >= 2:
        persistent = alive_at_end(trace)
        starts.append(len(events))
        for event in trace.events:
            uid = event if event >= 0 else ~event
            if uid in persistent:
                continue  # already alive from the first iteration (optimizer state)
            events.append(event + n if event >= 0 else ~(uid + n))
    return Program(events=events, num_storages=n, iterations=min(iterations, 2), iteration_starts=tuple(starts))


@dataclass(frozen=True)
class Peak:
    """The highest point of the curve and what was alive then."""

    bytes: int
    index: int  # index into Program.events of the allocation that reached the peak
    key: int  # the allocation (program key) that reached the peak
    by_category: dict[Category, int]


def replay(program: Program, sizes: Sequence[int], categories: Sequence[Category],
           until: int | None = None) -> Peak:
    """The peak of live bytes over ``program.events[:until]`` (sizes already rounded)."""
    n = program.num_storages
    cat_index = [_CATEGORY_INDEX[c] for c in categories]
    totals = [0] * len(_CATEGORIES)
    current = 0
    best = -1
    best_index = best_key = 0
    best_totals = totals[:]
    events = program.events if until is None else program.events[:until]
    for index, event in enumerate(events):
        if event >= 0:
            uid = event % n
            size = sizes[uid]
            current += size
            totals[cat_index[uid]] += size
            if current > best:
                best, best_index, best_key = current, index, event
                best_totals = totals[:]
        else:
            uid = (~event) % n
            size = sizes[uid]
            current -= size
            totals[cat_index[uid]] -= size
    by_category = {c: best_totals[i] for i, c in enumerate(_CATEGORIES)}
    return Peak(bytes=max(best, 0), index=best_index, key=best_key, by_category=by_category)


def rounded_sizes(trace: StepTrace, rounding: Callable[[int], int] = cuda_round) -> list[int]:
    return [rounding(n) for n in trace.nbytes]

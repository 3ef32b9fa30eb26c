"""From a :class:`~memcalc.engine.trace.StepTrace` to the memory curve of a training loop.

A training loop's first step is not its worst: ``torch.optim`` creates its state lazily at the
first ``step()``, after backward has freed the activations, so the first iteration never holds
optimizer state and activations together — every later iteration does. We trace one step and
build the second iteration from it (the same alloc/free order, with the storages still alive
after the first iteration — optimizer state — already there), then replay both.

The replay itself is :mod:`memcalc.allocator` (the CUDA caching allocator model); this module
builds the sequence it replays and reads the categories alive at the peak it finds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from memcalc.core.categories import Category, Phase
from memcalc.engine.trace import StepTrace

__all__ = (
    "Program",
    "alive_at_end",
    "alive_before",
    "allocator_events",
    "build_program",
    "category_totals_at",
    "final_categories",
)

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


def alive_before(trace: StepTrace, index: int) -> set[int]:
    """Storages born during the step and alive just before ``trace.events[index]``."""
    alive: set[int] = set()
    for event in trace.events[:index]:
        if event >= 0:
            alive.add(event)
        else:
            alive.discard(~event)
    return alive


def alive_at_end(trace: StepTrace) -> set[int]:
    """Storages born during the step and still alive when it ended."""
    return alive_before(trace, len(trace.events))


@dataclass(frozen=True)
class Program:
    """The replayable sequence: ``events`` over keys ``0 .. 2N-1`` (``uid`` for the first
    iteration, ``uid + N`` for the second), every key's storage being ``key % N``."""

    events: list[int]
    num_storages: int
    iterations: int
    iteration_starts: tuple[int, ...]  # index in events where each iteration begins

    def storage(self, key: int) -> int:
        """The storage uid behind an event key."""
        return key % self.num_storages

    def iteration_of(self, index: int) -> int:
        """The iteration (1-based) that ``events[index]`` belongs to."""
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


def category_totals_at(program: Program, nbytes: Sequence[int], categories: Sequence[Category],
                       index: int) -> dict[Category, int]:
    """Requested bytes per category alive just after ``program.events[index]``."""
    totals = {c: 0 for c in Category}
    n = program.num_storages
    for event in program.events[: index + 1]:
        uid = (event if event >= 0 else ~event) % n
        totals[categories[uid]] += nbytes[uid] if event >= 0 else -nbytes[uid]
    return totals


def allocator_events(program: Program, nbytes: Sequence[int],
                     until: int | None = None) -> Iterator[tuple[int, int, int]]:
    """The program as ``(+1, key, nbytes)`` / ``(-1, key, 0)`` events for
    :func:`memcalc.engine.allocator.replay`."""
    n = program.num_storages
    events = program.events if until is None else program.events[:until]
    for event in events:
        if event >= 0:
            yield (1, event, nbytes[event % n])
        else:
            yield (-1, ~event, 0)

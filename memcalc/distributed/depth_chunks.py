"""Depth extrapolation, first part (work in progress): how a step traced at depth ``n + 1`` differs
from the same step traced at depth ``n``.

A deep decoder's step repeats one block: tracing 80 identical layers through DTensor and FSDP2
costs most of a distributed estimate. If the traced event stream is affine in the depth, the
80-layer stream can be composed from two shallow traces. This module finds the structure that
composition needs and checks it; it composes nothing yet, and no estimate uses it.

:func:`depth_chunks` aligns the two streams event by event (a token per event: birth or death,
bytes, phase, op, category, stream, and the module with its block index blanked) and accepts only
insertions: the deeper stream is the shallower one with blocks of events added (measured on
``llama-3-70b --mesh dp_shard=32,tp=2 --checkpoint --precision amp-bf16`` at 2, 3 and 4 layers: six
blocks of 115, 288, 18, 9, 9 and 1 events — the forward period, the backward period, three runs of
per-parameter optimizer ops and one zero_grad free). For every aligned run it also reads how the
block indices in module names moved (``shift``: 0 before a forward insertion, 1 after it; the
reverse in the backward), which composing uses to name the added layers.

What composing still needs (why no estimate uses this yet): a death in an added block may free a
storage born one period earlier (a layer's output freed by the next layer) or born in another
block (a checkpointed layer's input saved in the forward, freed in its backward); each composed
death must be linked to the right copy's birth, and the self-check must compare a composed depth
with a traced one before an estimate may trust it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from memcalc.core.categories import Category
from memcalc.engine.trace import StepTrace

__all__ = ("DepthChunks", "Run", "depth_chunks")


@dataclass(frozen=True)
class Run:
    """A run of the deeper stream: ``[start, stop)`` in its events. ``added``: events the shallower
    stream has not (one period of the repeated block); otherwise aligned with the shallower
    stream's ``[other, other + stop - start)``, its block indices moved by ``shift``."""

    start: int
    stop: int
    added: bool
    other: int = -1
    shift: int = 0


@dataclass(frozen=True)
class DepthChunks:
    """How a deeper trace is the shallower one with blocks added."""

    runs: tuple[Run, ...]
    #: added storages that exist before the step (a layer's parameters): their positions in the
    #: deeper trace's ``preexisting``
    added_preexisting: tuple[int, ...]

    @property
    def added_events(self) -> int:
        """Events one more layer adds to the stream."""
        return sum(run.stop - run.start for run in self.runs if run.added)


def _pattern(containers: Sequence[str]) -> re.Pattern[str]:
    return re.compile("(" + "|".join(re.escape(c) for c in containers) + r")\.(\d+)")


def _blank(pattern: re.Pattern[str], name: str) -> str:
    return pattern.sub(r"\1.*", name)


def _index(pattern: re.Pattern[str], name: str) -> int | None:
    found = pattern.search(name)
    return None if found is None else int(found.group(2))


def _tokens(trace: StepTrace, categories: Sequence[Category], pattern: re.Pattern[str]) -> list[Hashable]:
    tokens: list[Hashable] = []
    for event in trace.events:
        uid = event if event >= 0 else ~event
        sized = trace.sized.get(uid)
        tokens.append((event >= 0, trace.nbytes[uid], trace.phase[uid], _blank(pattern, trace.module[uid]),
                       trace.op[uid], categories[uid], trace.stream.get(uid, 0), sized))
    return tokens


def depth_chunks(shallow: StepTrace, shallow_categories: Sequence[Category], deep: StepTrace,
                 deep_categories: Sequence[Category], containers: Sequence[str]) -> DepthChunks | None:
    """The runs of ``deep`` (the step traced with one more block in each of ``containers``) against
    ``shallow``; None: ``deep`` is not ``shallow`` with events added (an event changed, or one was
    taken away), or the block indices of an aligned run do not move by one amount."""
    pattern = _pattern(containers)
    matcher = difflib.SequenceMatcher(None, _tokens(shallow, shallow_categories, pattern),
                                      _tokens(deep, deep_categories, pattern), autojunk=False)
    runs: list[Run] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            runs.append(Run(j1, j2, added=True))
            continue
        if tag != "equal":
            return None
        shifts = set()
        for k in range(i2 - i1):
            a, b = shallow.events[i1 + k], deep.events[j1 + k]
            before = _index(pattern, shallow.module[a if a >= 0 else ~a])
            after = _index(pattern, deep.module[b if b >= 0 else ~b])
            if (before is None) != (after is None):
                return None
            if before is not None and after is not None:
                shifts.add(after - before)
        if len(shifts) > 1 or not shifts <= {0, 1}:
            return None
        runs.append(Run(j1, j2, added=False, other=i1, shift=next(iter(shifts), 0)))
    old: list[Hashable] = [(shallow.nbytes[u], _blank(pattern, shallow.module[u]), shallow_categories[u])
              for u in shallow.preexisting]
    new: list[Hashable] = [(deep.nbytes[u], _blank(pattern, deep.module[u]), deep_categories[u]) for u in deep.preexisting]
    pre = difflib.SequenceMatcher(None, old, new, autojunk=False)
    added: list[int] = []
    for tag, _i1, _i2, j1, j2 in pre.get_opcodes():
        if tag == "insert":
            added.extend(range(j1, j2))
        elif tag != "equal":
            return None
    return DepthChunks(runs=tuple(runs), added_preexisting=tuple(added))

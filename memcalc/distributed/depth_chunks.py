"""Depth extrapolation, first part: how a step traced at depth ``n + 1`` differs from the same
step traced at depth ``n``.

A deep decoder's step repeats one block: tracing 80 identical layers through DTensor and FSDP2
costs most of a distributed estimate. If the traced event stream is affine in the depth, the
80-layer stream can be composed from shallow traces (:mod:`depth_compose`, :mod:`depth_step`).

:func:`depth_chunks` aligns the two streams event by event (a token per event: birth or death,
bytes, phase, op, category, stream, and the module with its block index blanked) and accepts only
insertions: the deeper stream is the shallower one with blocks of events added (measured on
``llama-3-70b --mesh dp_shard=32,tp=2 --checkpoint --precision amp-bf16`` at 2, 3 and 4 layers: six
blocks of 115, 288, 18, 9, 9 and 1 events — the forward period, the backward period, three runs of
per-parameter optimizer ops and one zero_grad free). For every aligned event it also reads how
far the block index in its module name moved (``shift``: 0 before a forward insertion, 1 after
it, the reverse in the backward; FSDP2's reduce-scatter of the next block, run inside a block's
backward, moves where its neighbours do not), which composing uses to name the added layers. The
pre-existing storages are aligned the same way (an added layer's parameter shards).
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from memcalc.core.categories import Category
from memcalc.engine.trace import StepTrace

__all__ = ("DepthChunks", "Run", "depth_chunks", "index_of", "pattern_of", "tokens_of")


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
    #: the events of an aligned run whose block index moved otherwise than ``shift`` (by position:
    #: FSDP2's reduce-scatter of the block after, run inside a block's backward), and how much
    moved: Mapping[int, int] = field(default_factory=dict)

    def shift_at(self, position: int) -> int:
        """How far the block index of the event at ``position`` moved."""
        return self.moved.get(position, self.shift)


@dataclass(frozen=True)
class DepthChunks:
    """How a deeper trace is the shallower one with blocks added."""

    runs: tuple[Run, ...]
    #: the same over the deeper trace's ``preexisting`` (positions in that list): the added runs
    #: are a layer's parameters
    preexisting_runs: tuple[Run, ...]

    @property
    def added_preexisting(self) -> tuple[int, ...]:
        """Positions in the deeper trace's ``preexisting`` of the storages one more layer adds."""
        return tuple(n for run in self.preexisting_runs if run.added for n in range(run.start, run.stop))

    @property
    def added_events(self) -> int:
        """Events one more layer adds to the stream."""
        return sum(run.stop - run.start for run in self.runs if run.added)


def pattern_of(containers: Sequence[str]) -> re.Pattern[str]:
    """Finds a block's index in a module name: ``model.layers.7.mlp`` → ``model.layers``, ``7``."""
    return re.compile("(" + "|".join(re.escape(c) for c in containers) + r")\.(\d+)")


def _blank(pattern: re.Pattern[str], name: str) -> str:
    return pattern.sub(r"\1.*", name)


def index_of(pattern: re.Pattern[str], name: str) -> int | None:
    found = pattern.search(name)
    return None if found is None else int(found.group(2))


def tokens_of(trace: StepTrace, categories: Sequence[Category], pattern: re.Pattern[str]) -> list[Hashable]:
    """One token per event, equal for the same event in another block (its block index blanked)."""
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
    pattern = pattern_of(containers)
    matcher = difflib.SequenceMatcher(None, tokens_of(shallow, shallow_categories, pattern),
                                      tokens_of(deep, deep_categories, pattern), autojunk=False)
    runs = _runs(matcher, shallow.events, deep.events, shallow, deep, pattern)
    old: list[Hashable] = [(shallow.nbytes[u], _blank(pattern, shallow.module[u]), shallow_categories[u])
                           for u in shallow.preexisting]
    new: list[Hashable] = [(deep.nbytes[u], _blank(pattern, deep.module[u]), deep_categories[u])
                           for u in deep.preexisting]
    pre = _runs(difflib.SequenceMatcher(None, old, new, autojunk=False), [~u for u in shallow.preexisting],
                [~u for u in deep.preexisting], shallow, deep, pattern)
    if runs is None or pre is None:
        return None
    return DepthChunks(runs=tuple(runs), preexisting_runs=tuple(pre))


def _runs(matcher: difflib.SequenceMatcher[Hashable], old: Sequence[int], new: Sequence[int], shallow: StepTrace,
          deep: StepTrace, pattern: re.Pattern[str]) -> list[Run] | None:
    """The runs of ``new`` (storages as events: a uid or its complement) against ``old``."""
    runs: list[Run] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            runs.append(Run(j1, j2, added=True))
            continue
        if tag != "equal":
            return None
        moved: dict[int, int] = {}
        for k in range(i2 - i1):
            a, b = old[i1 + k], new[j1 + k]
            before = index_of(pattern, shallow.module[a if a >= 0 else ~a])
            after = index_of(pattern, deep.module[b if b >= 0 else ~b])
            if (before is None) != (after is None):
                return None
            if before is not None and after is not None:
                if after - before not in (0, 1):
                    return None
                moved[j1 + k] = after - before
        counts = Counter(moved.values())
        shift = counts.most_common(1)[0][0] if counts else 0
        runs.append(Run(j1, j2, added=False, other=i1, shift=shift,
                        moved={p: m for p, m in moved.items() if m != shift}))
    return runs

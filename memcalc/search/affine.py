"""Batch-affine trace families: the same step at any batch size, from two traces.

For most models the step at batch ``B`` allocates the same storages in the same order as at
any other batch, and each storage's size is affine in ``B`` (activations grow with the
batch, weights and their state do not). Two traces at batches ``b1 < b2`` with identical
structure then give every storage's size at any ``B`` — ``a + s·B`` — and a replay through
the allocator model answers "does batch ``B`` fit?" in milliseconds instead of a new
symbolic run. Whether the assumption holds at the batch that matters is never assumed: the
search traces its answer for real and checks that the trace is the family's, storage for
storage (:meth:`AffineFamily.matches`; see :mod:`memcalc.search.fit`).

A kernel's scratch sized by a rule from a tensor's shape (a reduction's staging buffer, a step
function of the rows it sums: :class:`~memcalc.engine.trace.ShapeSized`) is not affine in ``B``
although the shape is: the family takes the rule's arguments as affine instead, and applies
the rule at each batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from memcalc.core.alloc_conf import AllocConf
from memcalc.engine import allocator
from memcalc.engine.collector import collector_paused
from memcalc.engine.run import TracedStep
from memcalc.engine.timeline import Program, allocator_events
from memcalc.engine.trace import SizeRule

__all__ = ("AffineFamily", "SyntheticPoint", "replay_stats", "replay_under")


#: Storages sized by one rule on the same lines of arguments: (rule, intercepts, slopes, uids).
_RuleGroup: TypeAlias = tuple[SizeRule, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class _Line(Protocol):
    def at(self, batch: int) -> int: ...


@runtime_checkable
class _AlongLines(Protocol):
    """A size rule that says its bytes at every batch of its arguments' lines at once
    (:meth:`memcalc.targets.cuda.cudnn.ConvWorkspaceRule.along`), or None where it cannot."""

    def along(self, intercepts: tuple[int, ...], slopes: tuple[int, ...]) -> _Line | None: ...


class SyntheticPoint(NamedTuple):
    """What a replay at batch ``batch_size`` under a capacity says, in the terms the search uses.

    ``reserved_within_capacity``: the peak reserved of the replay under the capacity; for a
    step that does not fit, the replay goes on past its OOM, so this is what it needed."""

    batch_size: int
    fits: bool
    peak_allocated: int
    reserved_within_capacity: int


def replay_under(program: Program, nbytes: Sequence[int], capacity: int | None, batch: int,
                 settings: AllocConf | None = None, *, host: bool = False) -> SyntheticPoint:
    """One replay of ``program`` with storage sizes ``nbytes`` under ``capacity`` (None: no
    limit; the allocator frees its cache and retries before it gives up, as PyTorch does):
    whether it fits, under the allocator's ``settings`` (``PYTORCH_CUDA_ALLOC_CONF``; None: the
    defaults). ``host``: the CPU target's allocator (no rounding, nothing cached)."""
    stats = replay_stats(program, nbytes, capacity, settings, host=host)
    return SyntheticPoint(batch, stats.oom_at is None, stats.peak_allocated, stats.peak_reserved)


def replay_stats(program: Program, nbytes: Sequence[int], capacity: int | None, settings: AllocConf | None = None,
                 *, host: bool = False) -> allocator.AllocatorStats:
    """:func:`memcalc.engine.allocator.replay` of ``program`` with sizes ``nbytes``: on the compute
    stream alone, through the allocator's inlined loop (the same decisions, two to three times as
    fast)."""
    if host or program.streams:
        return allocator.replay(allocator_events(program, nbytes), capacity=capacity, settings=settings, host=host,
                                streams=program.streams)
    return _fed(program, nbytes, capacity, settings)


@collector_paused()
def _fed(program: Program, nbytes: Sequence[int], capacity: int | None,
         settings: AllocConf | None) -> allocator.AllocatorStats:
    """:func:`memcalc.engine.allocator.replay` of ``program`` on the compute stream, through
    :meth:`~memcalc.engine.allocator.CachingAllocatorModel.feed`: its keys are ``uid`` and
    ``uid + N`` (the second iteration), so each size is listed once per iteration."""
    model = allocator.CachingAllocatorModel(capacity, settings=settings)
    if settings is None or not any(settings.roundup_power2_divisions):  # round_size: up to a multiple of 512 B
        rounded = ((np.asarray(nbytes, dtype=np.int64) + _ROUNDING - 1) // _ROUNDING * _ROUNDING).tolist()
    else:
        rounded = [allocator.round_size(size, settings) for size in nbytes]
    model.feed(program.events, list(nbytes) * 2, rounded * 2, {})
    return model.stats()


_ROUNDING = allocator.K_MIN_BLOCK_SIZE


@dataclass(frozen=True)
class AffineFamily:
    """One step at every batch size: its alloc/free ``program`` (the same at any batch) and
    each storage's size ``intercepts[uid] + slopes[uid]·B``."""

    program: Program
    intercepts: tuple[int, ...]
    slopes: tuple[int, ...]
    #: storages sized by a rule: (uid, rule, the rule's arguments' intercepts, their slopes)
    sized: tuple[tuple[int, SizeRule, tuple[int, ...], tuple[int, ...]], ...] = ()
    #: the traced step the family was built from: its structure, to compare other traces with
    reference: TracedStep | None = field(default=None, compare=False, repr=False)
    #: the CPU target's step: replayed through the host allocator (:func:`replay_under`)
    host: bool = False

    @classmethod
    def from_traces(cls, first: TracedStep, b1: int, second: TracedStep, b2: int) -> AffineFamily | None:
        """The family through two traced steps (``TracedStep``), or None when they differ in
        structure (events, categories) or a size is not an integer-affine function of the batch."""
        if b1 == b2 or not _same_structure(first, second):
            return None
        program = first.program()
        if program.events != second.program().events:
            return None
        sized = []
        rules1, rules2 = first.trace.sized, second.trace.sized
        if rules1.keys() != rules2.keys():
            return None
        for uid, one in rules1.items():
            other = rules2[uid]
            line = _integer_line(one.arguments, other.arguments, b1, b2)
            if one.rule != other.rule or line is None:
                return None
            sized.append((uid, one.rule, *line))
        line = _integer_line(first.trace.nbytes, second.trace.nbytes, b1, b2, skip=rules1.keys())
        if line is None:
            return None
        intercepts, slopes = line
        return cls(program=program, intercepts=intercepts, slopes=slopes, sized=tuple(sized), reference=first,
                   host=not first.step.emulate_cuda)

    def nbytes(self, batch: int) -> list[int]:
        """Every storage's size at ``batch``, indexed by uid."""
        return list(self._sizes(batch).tolist())

    def _sizes(self, batch: int) -> npt.NDArray[np.int64]:
        """:meth:`nbytes` as an array, the last batch's kept: :meth:`least_peak` and then
        :meth:`probe` at one batch size it once."""
        last = self._last_sizes
        if batch not in last:
            intercepts, slopes = self._lines
            sizes = intercepts + slopes * batch  # int64: exact (a size is bytes)
            # a model repeats its layers, so many storages share a rule and its arguments' lines: each
            # group is sized once per batch (a rule is a function of its arguments alone)
            for rule, starts, steps, uids in self._sized_groups:
                sizes[list(uids)] = rule(tuple(a + s * batch for a, s in zip(starts, steps, strict=True)))
            lines, lined, group_of = self._lined_groups
            if lines:
                sizes[lined] = np.fromiter((line(batch) for line in lines), np.int64, len(lines))[group_of]
            sizes.flags.writeable = False  # shared by the next call at this batch
            last.clear()
            last[batch] = sizes
        return last[batch]

    @cached_property
    def _last_sizes(self) -> dict[int, npt.NDArray[np.int64]]:
        return {}

    @cached_property
    def _lines(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        return np.asarray(self.intercepts, dtype=np.int64), np.asarray(self.slopes, dtype=np.int64)

    @cached_property
    def _sized_groups(self) -> tuple[_RuleGroup, ...]:
        """The rule-sized storages grouped by rule and argument lines, (rule, intercepts, slopes,
        uids), less those :attr:`_lined_groups` sizes."""
        return tuple(group for group, line in self._group_lines if line is None)

    @cached_property
    def _lined_groups(self) -> tuple[tuple[Callable[[int], int], ...], npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """The groups whose rule gives its bytes at every batch of their lines at once
        (:class:`_AlongLines`, the cuDNN convolutions'), built once per family where the rule
        would re-read every shape at every replayed batch: (each group's bytes at a batch, the
        storages' uids, each uid's group)."""
        lines: list[Callable[[int], int]] = []
        uids: list[int] = []
        group_of: list[int] = []
        for group, line in self._group_lines:
            if line is not None:
                uids.extend(group[3])
                group_of.extend([len(lines)] * len(group[3]))
                lines.append(line)
        return tuple(lines), np.asarray(uids, dtype=np.intp), np.asarray(group_of, dtype=np.intp)

    @cached_property
    def _group_lines(self) -> tuple[tuple[_RuleGroup, Callable[[int], int] | None], ...]:
        """Each group with its bytes along its lines, where its rule gives them (None: it does not)."""
        out = []
        for group in self._rule_groups:
            rule: object = group[0]
            line = rule.along(group[1], group[2]) if isinstance(rule, _AlongLines) else None
            out.append((group, None if line is None else line.at))
        return tuple(out)

    @cached_property
    def _rule_groups(self) -> tuple[_RuleGroup, ...]:
        groups: dict[tuple[SizeRule, tuple[int, ...], tuple[int, ...]], list[int]] = {}
        for uid, rule, intercepts, slopes in self.sized:
            groups.setdefault((rule, intercepts, slopes), []).append(uid)
        return tuple((*key, tuple(uids)) for key, uids in groups.items())

    def least_peak(self, batch: int) -> int:
        """A floor under the peak allocated of every replay at ``batch``, whatever the allocator's
        settings: the most bytes live at once, each storage rounded to 512 B (the CUDA
        allocator's least rounding, ``kMinBlockSize``; none on the CPU target). A block handed out
        is at least its request rounded so, and a replay that fits never reserves more than its
        capacity, so a batch whose floor is over a capacity does not fit it — known without a
        replay, in numpy over the events (0.1 ms where a replay takes 1–8)."""
        sizes = self._sizes(batch)
        if not self.host:
            sizes = (sizes + _ROUNDING - 1) // _ROUNDING * _ROUNDING
        storages, signs = self._event_storages
        return int(np.cumsum(signs * sizes[storages]).max(initial=0))

    @cached_property
    def _event_storages(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Each event's storage and its sign (+1: allocated, −1: freed), for :meth:`least_peak`."""
        keys = self.program.keys
        allocated = keys >= 0
        return np.where(allocated, keys, ~keys) % self.program.num_storages, np.where(allocated, 1, -1)

    def probe(self, batch: int, capacity: int, settings: AllocConf | None = None) -> SyntheticPoint:
        """Replay the step at ``batch`` through the allocator model under ``capacity`` (one replay)."""
        return replay_under(self.program, self.nbytes(batch), capacity, batch, settings, host=self.host)

    def matches(self, traced: TracedStep, batch: int) -> bool:
        """Whether ``traced`` (a real trace at ``batch``) is this family's step at ``batch``: the
        same alloc/free sequence and categories, every storage of the size the family gives.
        Then the family's replay at ``batch`` *is* the estimate's replay, byte for byte."""
        if self.reference is None or not _same_structure(self.reference, traced):
            return False
        return traced.trace.nbytes == self.nbytes(batch)


def _integer_line(at1: Sequence[int], at2: Sequence[int], b1: int, b2: int,
                  skip: Iterable[int] = ()) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Intercepts and slopes of the values ``at1`` (at batch ``b1``) and ``at2`` (at ``b2``), each
    a non-negative integer line that does not fall with the batch; None if one is not. The
    indices in ``skip`` get (0, 0)."""
    skipped = set(skip)
    intercepts: list[int] = []
    slopes: list[int] = []
    for i, (v1, v2) in enumerate(zip(at1, at2, strict=True)):
        if i in skipped:
            intercepts.append(0)
            slopes.append(0)
            continue
        step, remainder = divmod(v2 - v1, b2 - b1)
        intercept = v1 - step * b1
        if remainder or step < 0 or intercept < 0:
            return None
        intercepts.append(intercept)
        slopes.append(step)
    return tuple(intercepts), tuple(slopes)


def _same_structure(first: TracedStep, second: TracedStep) -> bool:
    t1, t2 = first.trace, second.trace
    return (t1.events == t2.events and t1.preexisting == t2.preexisting and first.categories == second.categories
            and t1.stream == t2.stream)

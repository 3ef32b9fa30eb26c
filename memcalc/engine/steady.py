"""A generation's decode steps in steady state: trace a few, write out the rest.

After its first decode steps, each step of ``generate()`` runs the same code over a cache one
token longer: the same ops, the same storages born and freed in the same order, each storage's
size growing by a constant number of bytes per step (the cache's ``torch.cat`` outputs, the
attention scores over it) or not at all. So :func:`extend` takes a trace of the prefill and a
few decode steps (:data:`TRACED_TOKENS`) and writes the trace of ``N`` tokens: the steps it did not
run are copies of the last steady one, each storage's bytes on the line its traced steps draw,
and the last step (with what generate() frees as it returns) is the traced last step moved to
step ``N - 1``. The replay, the report and the JSON are then those of the full trace, event for
event — tests/test_generation_steady.py compares both, byte for byte. The steps written are held as
the copies they are (:class:`~memcalc.engine.trace.UnwrittenSteps`: one step's columns, the events
and bytes as arrays), which the report reads as arrays or a few steps at a time; the first reader of
a trace's lists writes them out (llama-2-7b, 1,024 tokens: 2.9M events, 1.45M storages).

It extrapolates only what it has confirmed, and says why not otherwise (the caller then traces
more decode steps, then every one): the decode steps before the last, as far back as they make
the same storages (step 1 too, where it does: the prefill and four decode steps are traced
first), must be :data:`STEADY_STEPS` or more, congruent — the same op, module, phase and category
per storage, sizes on one line per storage, the same events in each step that frees only the
step before's (nothing that accumulates) — and the last traced step must be such a step at its
own point of the lines, plus its tail. A storage sized by a kernel rule memcalc computes from
the step's shapes (a workspace, an attention scratch) is a step function of the cache length,
not a line: a decode step that holds one is not extrapolated, except a rule-sized one
(:class:`~memcalc.engine.trace.ShapeSized`), whose arguments are extrapolated and its rule
evaluated at each step. What the run counted (ops per name, attention calls, the
numbers in the backend's notes) must be on a line per step too; output shapes and the module
order must not change. What the model's own code decides from the cache length (a sliding
window, chunked attention) is the model source's to rule out (``ResolvedModel.steady_decoding``).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memcalc.core.categories import Phase
from memcalc.engine.trace import ShapeSized, SteadyRun, StepTrace, UnwrittenSteps

__all__ = ("EXTRAPOLATE_FROM", "STEADY_STEPS", "TRACED_TOKENS", "Extension", "RunCounts", "extend",
           "traced_tokens")

#: Tokens traced, tried in turn: the prefill's and four decode steps' (steps 1–3 the steady steps
#: compared, 4 the last with generate()'s return), then, where step 1 is not congruent with the
#: steps after it (it frees the prefill's cache; it may make storages of its own), six (2–5, 6).
TRACED_TOKENS = (5, 7)
#: A generation of fewer new tokens is traced in full (extrapolating would save little).
EXTRAPOLATE_FROM = 16
#: Congruent decode steps needed before the last: sizes on a line checked at a third point, the
#: events of two steps that each free the step before's compared.
STEADY_STEPS = 3
_NUMBER = re.compile(r"\d[\d,]*\d|\d")


def traced_tokens(new_tokens: int, attempt: int = 0) -> int | None:
    """The tokens to trace before extrapolating to ``new_tokens`` at the ``attempt``-th try
    (:data:`TRACED_TOKENS`); None: trace them all."""
    if attempt >= len(TRACED_TOKENS):
        return None
    tokens = TRACED_TOKENS[attempt]
    return tokens if new_tokens >= max(EXTRAPOLATE_FROM, tokens + 2) else None


@dataclass(frozen=True)
class RunCounts:
    """What the run had counted when a decode forward started (or when the call ended)."""

    op_counts: Counter[str]
    attention: Mapping[str, int]
    notes: tuple[str, ...]
    output_shapes: Mapping[str, tuple[int, ...]]
    order: tuple[str, ...]
    approximated: Mapping[str, int] | None = None  # the backend's own count (StepBackend.approximated_ops)


@dataclass(frozen=True)
class Extension:
    """The run's counts at the end of the ``N``-token generation (the trace is extended in place)."""

    op_counts: Counter[str]
    attention: dict[str, int]
    notes: list[str]
    approximated: dict[str, int] | None = None


class _NotSteady(Exception):
    """The pattern is not confirmed: the message says what differs."""


def extend(trace: StepTrace, counts: Sequence[RunCounts], end: RunCounts, new_tokens: int) -> Extension | str:
    """Extend ``trace`` (of ``len(counts) + 1`` tokens, stopped early) to ``new_tokens`` tokens.

    Args:
        trace: the trace of the prefill and decode steps ``1 .. M - 1``; extended in place only
            when the pattern is confirmed.
        counts: the run's counts at the start of each decode step ``1 .. M - 1``.
        end: the run's counts when the call returned.
        new_tokens: ``N``, the tokens of the generation estimated.

    Returns:
        The run's counts after ``N`` tokens, or why the decode steps are not extrapolated.
    """
    try:
        return _extend(trace, counts, end, new_tokens)
    except _NotSteady as exc:
        return str(exc)


@dataclass(frozen=True)
class _Layout:
    """One steady decode step: its storages (per birth) and its events."""

    first: int  # the first steady decode step
    nbytes0: np.ndarray  # bytes of each birth at step 0 of the line
    slope: np.ndarray  # bytes per step
    phase: list[Phase]
    module: list[str]
    category: list[object]
    op: list[str]
    sized: dict[int, tuple[ShapeSized, tuple[int, ...]]]  # birth index -> (rule at step 0, slope of its arguments)
    events: list[tuple[int, int]]  # (kind, value): 0 birth i, 1 death of birth value - d·n (rel.), 2 fixed uid


def _extend(trace: StepTrace, counts: Sequence[RunCounts], end: RunCounts, new_tokens: int) -> Extension:
    steps = len(counts) + 1  # M: the prefill's token and one per decode step
    starts = [start for phase, start in trace.phase_log if phase is Phase.DECODE]
    if len(starts) != steps - 1 or steps < 3:
        raise _NotSteady(f"{len(starts)} decode steps were traced, not {steps - 1} (two or more)")
    if any(start >= starts[0] and phase is not Phase.DECODE for phase, start in trace.phase_log):
        raise _NotSteady("a phase other than decode began among the decode steps")
    bounds = [*starts, len(trace.events)]
    segments = [trace.events[a:b] for a, b in itertools.pairwise(bounds)]  # steps 1 .. M-1
    bases: list[tuple[int, int]] = []
    for step, events in enumerate(segments, start=1):
        births = [e for e in events if e >= 0]
        base = births[0] if births else (bases[-1][0] + bases[-1][1] if bases else 0)
        if births != list(range(base, base + len(births))) or (bases and base != bases[-1][0] + bases[-1][1]):
            raise _NotSteady(f"the storages of decode step {step} are not numbered in birth order")
        bases.append((base, len(births)))
    if trace.num_storages != bases[-1][0] + bases[-1][1]:
        raise _NotSteady("storages were recorded after the last decode step")
    last_steady = steps - 2  # the last decode step before the last one
    n = bases[last_steady - 1][1]
    first = last_steady  # the steady steps: as far back as their storages are made alike
    while first > 1 and _alike(trace, bases, first - 1, last_steady):
        first -= 1
    if last_steady - first + 1 < STEADY_STEPS:
        raise _NotSteady(f"only decode steps {first} to {last_steady} make the same storages, fewer than "
                         f"{STEADY_STEPS} before the last")
    while True:  # a first step alike in its storages may differ in their sizes, frees or ops: then without it
        try:
            layout = _layout(trace, segments, bases, list(range(first, last_steady + 1)), n)
            last = _last_step(trace, layout, bases[steps - 2], steps - 1)
            counted = _counts(counts, end, steps, new_tokens, first)
            break
        except _NotSteady:
            if last_steady - first + 1 == STEADY_STEPS:
                raise
            first += 1
    _write(trace, layout, last, segments[-1], bases, steps, new_tokens, n, starts)
    return counted


def _alike(trace: StepTrace, bases: list[tuple[int, int]], step: int, other: int) -> bool:
    """Whether decode steps ``step`` and ``other`` make as many storages, by the same ops in
    the same modules, phases and categories (their sizes and frees are compared later)."""
    (one, count), (two, count2) = bases[step - 1], bases[other - 1]
    return count == count2 and all(getattr(trace, field)[one:one + count] == getattr(trace, field)[two:two + count]
                                   for field in ("op", "module", "phase", "category"))


def _layout(trace: StepTrace, segments: list[list[int]], bases: list[tuple[int, int]], steady: list[int],
            n: int) -> _Layout:
    """The steady step's storages and events, confirmed over the ``steady`` steps: their sizes
    on a line; the events of each that frees only the step before's (all but the first) alike."""
    step = steady[0]
    first = bases[step - 1][0]
    uids = [[bases[s - 1][0] + i for i in range(n)] for s in steady]
    for field in ("phase", "module", "category", "op"):
        column = getattr(trace, field)
        rows = [[column[u] for u in row] for row in uids]
        if any(row != rows[0] for row in rows[1:]):
            raise _NotSteady(f"the storages' {field} differs between decode steps")
    sizes = np.array([[trace.nbytes[u] for u in row] for row in uids], dtype=np.int64)
    slope = sizes[1] - sizes[0]
    if not (np.diff(sizes, axis=0) == slope).all():
        raise _NotSteady("a storage's size does not grow by the same bytes at each decode step")
    nbytes0 = sizes[0] - step * slope  # on the line: bytes at step s = nbytes0 + s · slope
    sized = _sized(trace, bases, steady, n)
    for i, op in enumerate(trace.op[first:first + n]):
        if not op.startswith("aten.") and i not in sized:
            raise _NotSteady(f"a decode step holds a storage sized by a rule of memcalc's ({op}), which may "
                             f"change with the cache length")
    events = [_events(segments[s - 1], bases[s - 1][0], first, n) for s in steady[1:]]
    if any(row != events[0] for row in events[1:]):  # (the first may free older storages)
        raise _NotSteady("the decode steps' allocations and frees differ")
    if any(kind == 2 for kind, _ in events[0]):
        raise _NotSteady("a steady decode step frees a storage born before the steady steps")
    return _Layout(step, nbytes0, slope, trace.phase[first:first + n], trace.module[first:first + n],
                   list(trace.category[first:first + n]), trace.op[first:first + n], sized, events[0])


def _last_step(trace: StepTrace, layout: _Layout, base_count: tuple[int, int], step: int) -> list[int]:
    """Which steady storage each storage of the last decode step is (generate() stops before
    the steady step's last allocations): matched in order by op, module, phase, category, bytes
    on the line at ``step`` and rule; a storage matched two ways, or not at all, is not confirmed."""
    base, count = base_count
    n = len(layout.op)
    at = layout.nbytes0 + step * layout.slope
    keys = [(layout.op[i], layout.module[i], layout.phase[i], layout.category[i]) for i in range(n)]
    matched: list[int] = []
    i = 0
    for uid in range(base, base + count):
        key = (trace.op[uid], trace.module[uid], trace.phase[uid], trace.category[uid])
        while i < n and (keys[i] != key or at[i] != trace.nbytes[uid] or not _same_rule(trace, uid, layout, i, step)):
            i += 1
        if i == n:
            raise _NotSteady("a storage of the last decode step is not one of the steady steps'")
        # the same storage, whichever of its look-alikes up to the next match: they must grow alike
        matched.append(i)
        i += 1
    for j, i in enumerate(matched):
        stop = matched[j + 1] if j + 1 < len(matched) else n
        twins = [k for k in range(i, stop) if keys[k] == keys[i] and at[k] == at[i]]
        if any(layout.slope[k] != layout.slope[i] or (k in layout.sized) != (i in layout.sized) for k in twins):
            raise _NotSteady("a storage of the last decode step matches steady storages that grow differently")
    return matched


def _same_rule(trace: StepTrace, uid: int, layout: _Layout, i: int, step: int) -> bool:
    if i not in layout.sized:
        return uid not in trace.sized
    zero, slope = layout.sized[i]
    return trace.sized.get(uid) == _sized_at(zero, slope, step)


def _sized(trace: StepTrace, bases: list[tuple[int, int]], steady: list[int],
           n: int) -> dict[int, tuple[ShapeSized, tuple[int, ...]]]:
    """Rule-sized storages of the steady step: their rule, arguments on a line per step."""
    out: dict[int, tuple[ShapeSized, tuple[int, ...]]] = {}
    for i in range(n):
        rules = [trace.sized.get(bases[s - 1][0] + i) for s in steady]
        if all(r is None for r in rules):
            continue
        present = [r for r in rules if r is not None]
        if len(present) != len(rules) or any(r.rule != present[0].rule or len(r.arguments) != len(present[0].arguments)
                                             for r in present):
            raise _NotSteady("a rule-sized storage of the decode steps changes its rule")
        args = np.array([r.arguments for r in present], dtype=np.int64)
        slope = args[1] - args[0]
        if not (np.diff(args, axis=0) == slope).all():
            raise _NotSteady("a rule-sized storage's arguments do not grow by the same step")
        zero = args[0] - steady[0] * slope
        out[i] = (ShapeSized(present[0].rule, tuple(int(a) for a in zero)), tuple(int(a) for a in slope))
    return out


def _events(segment: list[int], base: int, oldest: int, n: int) -> list[tuple[int, int]]:
    """A step's events relative to its own storages (numbered from ``base``): births by index,
    frees of this step's or the step before's storages (of ``n``) by ``uid - base``, frees of
    storages born before ``oldest`` (the first steady step's) by uid; nothing in between."""
    out = []
    for event in segment:
        if event >= 0:
            out.append((0, event - base))
            continue
        uid = ~event
        if uid >= oldest:
            if uid < base - n:
                raise _NotSteady("a decode step frees a storage of an older step (something accumulates)")
            out.append((1, uid - base))
        else:
            out.append((2, uid))
    return out


def _counts(counts: Sequence[RunCounts], end: RunCounts, steps: int, new_tokens: int, first: int) -> Extension:
    """The run's counts after ``new_tokens`` tokens, on the line the steady steps (from decode
    step ``first``) draw."""
    seen = counts[first - 1:]  # at the start of steady steps first .. M-1: what each steady step adds
    if any(c.output_shapes != end.output_shapes for c in seen[1:]):
        raise _NotSteady("a module's output shape changes between decode steps")
    if any(c.order != end.order for c in seen):
        raise _NotSteady("a module ran for the first time in a decode step")
    extra = new_tokens - steps  # steady steps the full trace has more (the last step's counts are in ``end``)
    names = set(end.op_counts)
    op_counts = Counter(_line({name: [c.op_counts.get(name, 0) for c in seen] for name in names},
                              dict(end.op_counts), extra, "ops"))
    attention = _line({name: [c.attention.get(name, 0) for c in seen] for name in end.attention},
                      dict(end.attention), extra, "attention calls")
    notes = [_note([c.notes[k] if k < len(c.notes) else "" for c in seen], note, extra)
             for k, note in enumerate(end.notes)]
    approximated = None if end.approximated is None else _line(
        {name: [(c.approximated or {}).get(name, 0) for c in seen] for name in end.approximated},
        dict(end.approximated), extra, "approximated calls")
    return Extension(op_counts, attention, notes, approximated)


def _line(values: Mapping[str, list[int]], end: Mapping[str, int], extra: int, what: str) -> dict[str, int]:
    """Each count at the end plus ``extra`` steady steps' worth, a step's worth being constant."""
    out = {}
    for name, series in values.items():
        steps = {b - a for a, b in itertools.pairwise(series)}
        if len(steps) != 1:
            raise _NotSteady(f"the {what} per decode step are not constant ({name})")
        out[name] = end[name] + extra * steps.pop()
    return out


def _note(series: list[str], end: str, extra: int) -> str:
    """The note ``end`` after ``extra`` more steady steps: its numbers on the line ``series`` (the
    note at the start of each steady step) draws, written as the note writes them."""
    texts = [_NUMBER.split(text) for text in (*series, end)]
    if any(t != texts[0] for t in texts):
        raise _NotSteady("a note's words change between decode steps")
    numbers = [_NUMBER.findall(text) for text in series]
    grown = []
    for k, written in enumerate(_NUMBER.findall(end)):
        values = [int(row[k].replace(",", "")) for row in numbers]
        steps = {b - a for a, b in itertools.pairwise(values)}
        if len(steps) != 1:
            raise _NotSteady("a number in a note does not grow by the same at each decode step")
        step = steps.pop()
        value = int(written.replace(",", "")) + extra * step
        commas = "," in written or any("," in row[k] for row in numbers)
        if step and not commas and value >= 1000 > int(written.replace(",", "")):
            raise _NotSteady("a number in a note would reach 1,000, written with or without commas")
        grown.append(written if not step else (f"{value:,}" if commas else str(value)))
    return "".join(p + (grown[k] if k < len(grown) else "") for k, p in enumerate(texts[-1]))


def _write(trace: StepTrace, layout: _Layout, last: list[int], last_segment: list[int],
           bases: list[tuple[int, int]], steps: int, new_tokens: int, n: int, starts: list[int]) -> None:
    """Replace the traced last step by the steady steps ``M - 1 .. N - 2`` and the last one at ``N - 1``,
    held unwritten (:meth:`~memcalc.engine.trace.StepTrace.hold`)."""
    last_base = bases[steps - 2][0]
    last_events = _events(last_segment, last_base, bases[layout.first - 1][0], n)
    del trace.events[starts[-1]:]
    for column in (trace.nbytes, trace.phase, trace.module, trace.category, trace.op):
        del column[last_base:]
    for uid in [u for u in trace.sized if u >= last_base]:
        del trace.sized[uid]
    trace.phase_log[:] = [(p, i) for p, i in trace.phase_log if i < starts[-1]]
    first_new = steps - 1
    count = new_tokens - steps  # steady steps written: M-1 .. N-2
    length = len(layout.events)
    start = len(trace.events)
    kinds = np.array([k for k, _ in layout.events], dtype=np.int64)
    values = np.array([v for _, v in layout.events], dtype=np.int64)
    rows = (last_base + n * np.arange(count, dtype=np.int64))[:, None] + values[None, :]
    coded = np.where(kinds == 0, rows, ~rows)  # a steady step frees only its own or the last step's
    step_numbers = np.arange(first_new, first_new + count, dtype=np.int64)
    sizes = layout.nbytes0[None, :] + step_numbers[:, None] * layout.slope[None, :]
    at: dict[int, list[ShapeSized]] = {}
    for i, (zero, slope) in layout.sized.items():  # a rule's bytes are the rule's, not a line's
        at[i] = ([_sized_at(zero, slope, s) for s in step_numbers.tolist()] if any(slope)
                 else [_sized_at(zero, slope, first_new)] * count)  # one shape: one object, one size
        sizes[:, i] = [_bytes(rule) for rule in at[i]] if any(slope) else _bytes(at[i][0])
    trace.phase_log.extend((Phase.DECODE, start + k * length) for k in range(count))
    for i, rules in at.items():
        trace.sized.update(zip(range(last_base + i, last_base + i + n * count, n), rules, strict=True))
    if count:
        trace.steady = SteadyRun(start, length, count, n, last_base, _affine(layout, n))
    # the last step: the traced one, each storage on its steady storage's line at step N - 1
    base = last_base + n * count
    s = new_tokens - 1
    trace.phase_log.append((Phase.DECODE, start + count * length))
    tail: dict[str, list[Any]] = {"nbytes": [], "phase": [], "module": [], "category": [], "op": []}
    for j, i in enumerate(last):
        if i in layout.sized:
            zero, slope = layout.sized[i]
            trace.sized[base + j] = rule = _sized_at(zero, slope, s)
            tail["nbytes"].append(_bytes(rule))
        else:
            tail["nbytes"].append(int(layout.nbytes0[i] + s * layout.slope[i]))
        for name in ("phase", "module", "category", "op"):
            tail[name].append(getattr(layout, name)[i])
    tail_events = [base + v if kind == 0 else ~(base + v) if kind == 1 else ~v for kind, v in last_events]
    events, nbytes = coded.ravel(), sizes.ravel()
    events.flags.writeable = nbytes.flags.writeable = False  # the copies as extrapolated: read, never changed
    columns: dict[str, list[Any]] = {"phase": layout.phase, "module": layout.module, "category": layout.category,
                                     "op": layout.op}
    # held as copies, not written: the first reader of a list writes them out (trace.UnwrittenSteps)
    trace.hold(UnwrittenSteps(events, nbytes, columns, count, tail_events, tail, trace.steady if count else None))


def _affine(layout: _Layout, n: int) -> bool:
    """Whether the bytes alive at each point of a steady step are affine in the step: every
    storage's bytes on a line (a rule-sized one whose arguments grow is a step function) and
    every storage freed in its own step or the next, so that the storages alive as a step begins
    are the same ones of the step before (nothing accumulates)."""
    if any(any(slope) for _, slope in layout.sized.values()):
        return False
    born = {value for kind, value in layout.events if kind == 0}
    freed = {value if value >= 0 else value + n for kind, value in layout.events if kind == 1}
    return born <= freed


def _bytes(sized: ShapeSized) -> int:
    return int(sized.rule(sized.arguments))


def _sized_at(zero: ShapeSized, slope: tuple[int, ...], step: int) -> ShapeSized:
    arguments = tuple(a + step * d for a, d in zip(zero.arguments, slope, strict=True))
    return ShapeSized(zero.rule, arguments)

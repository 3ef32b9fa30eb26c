"""The report's sums over a long generation without a pass over its every event.

:mod:`memcalc.engine.steady` writes a generation's decode steps ``a .. a + count - 1`` as copies
of one steady step (the :class:`~memcalc.engine.trace.SteadyRun` it records), the last step after
them. Where the run is ``affine`` (each storage's bytes on a line in the step, each storage freed
in its step or the next), the bytes alive just after the ``p``-th event of step ``s``, of any set
of storages chosen by what each is (its module, phase, category), are affine in ``s``: the
storages alive as a step begins are the step before's same ones, so that base grows by the same
net bytes each step, and the step's own events add the same affine amounts. Hence:

- a maximum over those steps (a module row's high water) is reached in the first of them (after
  step ``a``, whose step before was traced) or the last: the events read are the prefix, steps ``a``
  and ``a + 1``, then ``count - 3`` times step ``a + 1``'s net bytes (one weighted copy of its
  events, no maximum taken there), then step ``a + count - 1`` and the last step as they are — the
  sums at each of those events are the full trace's;
- a total at one event of step ``a + k`` (the categories at the peak) is the prefix, steps ``a`` and
  ``a + 1``, ``k - 2`` times step ``a + 1``'s net bytes, then step ``a + k``'s events up to that one.

So both read a few steps' events, not the millions the trace holds: :func:`stream` builds those
events' indices and weights; :func:`applies` checks the run on the trace first (the written steps
copies, their bytes on lines, nothing accumulating), else the caller reads every event. Tests
compare both paths' reports byte for byte (tests/test_steady_sums.py).
"""

from __future__ import annotations

import numpy as np

from memcalc.core.categories import Category
from memcalc.engine.trace import SteadyRun, StepTrace

__all__ = ("Stream", "applies", "stream", "totals_at")

#: (event indices into the trace's events, each one's weight, whether a maximum may be read after it)
Stream = tuple[np.ndarray, np.ndarray, np.ndarray]
#: Written steps from which reading a few of them pays (fewer: every event is read).
SKIP_FROM = 4


def applies(trace: StepTrace, categories: list[Category], events: np.ndarray, nbytes: np.ndarray) -> SteadyRun | None:
    """The trace's steady run where the sums may skip it, checked on the trace as it is now
    (``events``, ``nbytes``: its events and storages' bytes, int64): long enough, its written steps
    copies of the first (the same events, renamed a step's storages on), their bytes on the lines the
    first two draw, each storage freed in its step or the next, and the first and last steps'
    storages alike (the same modules, phases and final categories). Steps the trace holds unwritten
    (:class:`~memcalc.engine.trace.UnwrittenSteps`) are those copies as extrapolated, which
    ``engine.steady`` checked affine: only their modules, phases and categories are compared."""
    run = trace.steady
    if run is None or not run.affine or run.count < SKIP_FROM:
        return None
    a, length, count, n, base = run.start, run.length, run.count, run.storages, run.base
    last = base + (count - 1) * n
    if a + count * length > events.size or last + n > nbytes.size:
        return None
    for name in ("module", "phase"):
        if trace.column_range(name, base, base + n) != trace.column_range(name, last, last + n):
            return None
    if categories[base:base + n] != categories[last:last + n]:
        return None
    if trace.unwritten is not None and trace.unwritten.run is run:  # held as engine.steady made them: copies
        return run
    sizes = nbytes[base:base + count * n].reshape(count, n)
    steps = np.arange(count, dtype=np.int64)[:, None]
    if not (sizes == sizes[0] + steps * (sizes[1] - sizes[0])).all():
        return None
    block = events[a:a + count * length].reshape(count, length)
    born = block >= 0
    named = np.where(born, block, ~block) - base - steps * n  # each step's storages from 0, the step before's < 0
    if not ((born == born[0]).all() and (named == named[0]).all()):
        return None
    first, made = named[0], born[0]
    if (first[~made] < -n).any() or not np.isin(first[made], np.concatenate([first[~made], first[~made] + n])).all():
        return None  # a free of an older step's storage, or a storage freed neither in its step nor the next
    return run


def stream(run: SteadyRun, total: int, until: int | None = None) -> Stream:
    """The events whose weighted running sums are the full trace's (module docstring): for the
    maxima over every event (``until`` None), or for the sums just after event ``until``. ``total``:
    the trace's events."""
    a, length, count = run.start, run.length, run.count
    first = np.arange(a + 2 * length, dtype=np.int64)  # the prefix and steps a, a + 1
    net = np.arange(a + length, a + 2 * length, dtype=np.int64)  # step a + 1's events: its net bytes, weighted
    if until is None:
        skipped, rest = count - 3, np.arange(a + (count - 1) * length, total, dtype=np.int64)
    else:
        k = min((until - a) // length, count)  # the step of ``until``: a + k (count: the last step)
        if k < 3:
            index = np.arange(until + 1, dtype=np.int64)
            return index, np.ones(index.size, dtype=np.int64), np.ones(index.size, dtype=bool)
        skipped, rest = k - 2, np.arange(a + k * length, until + 1, dtype=np.int64)
    index = np.concatenate([first, net, rest])
    weights = np.ones(index.size, dtype=np.int64)
    weights[first.size:first.size + net.size] = skipped
    read = np.ones(index.size, dtype=bool)
    read[first.size:first.size + net.size] = False
    return index, weights, read


def totals_at(run: SteadyRun, keys: np.ndarray, offset: int, nbytes: np.ndarray, categories: list[Category],
              index: int) -> dict[Category, int]:
    """Requested bytes per category alive just after event ``index`` of a program of one iteration
    (``keys``: its events, the pre-existing storages' ``offset`` births first, then the trace's;
    ``nbytes``: the storages' bytes, int64), read off :func:`stream`."""
    at, weights, _ = stream(run, keys.size - offset, index - offset)
    events = np.concatenate([keys[:offset], keys[offset:][at]])
    signed = np.concatenate([np.ones(offset, dtype=np.int64), weights])
    uids = np.where(events >= 0, events, ~events)
    signed *= nbytes[uids]  # int64: exact
    signed[events < 0] *= -1
    unique, inverse = np.unique(uids, return_inverse=True)
    code = {category: i for i, category in enumerate(Category)}
    of = np.fromiter((code[categories[uid]] for uid in unique.tolist()), dtype=np.int64, count=unique.size)[inverse]
    return {category: int(signed[of == i].sum()) for i, category in enumerate(Category)}

"""Progress of long work (a generation's decode steps, a sweep's estimates, a fit's search),
told to whoever listens: the seam between the code that does the work and the one that shows it.

The engine and the searches call :func:`report_progress` as they go; nothing is shown unless a
listener was installed with :func:`progress_to` around the call, in this thread (a context
variable: another thread's estimate tells its own listener, or none). The command line installs
a bar on stderr when stderr is a terminal; a Python caller may install any callable::

    from memcalc.core.progress import progress_to

    with progress_to(lambda task, done, total: print(task, done, total)):
        memcalc.estimate("hf:gpt2", batch_size=1, mode="generate", new_tokens=1000)

A listener is told ``(task, done, total)``: the task's name, the units done so far, and how
many there are (None when the work does not know ahead, as a search does). A task with a total
is told ``done == 0`` first and ``done == total`` last. So that nothing here costs the work
when no one listens, :func:`report_progress` is one context-variable read then.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeAlias, TypeVar

__all__ = ("ProgressListener", "progress_to", "report_progress", "reported")

_T = TypeVar("_T")

#: Told ``(task, done, total)`` as long work goes on (module docstring).
ProgressListener: TypeAlias = Callable[[str, int, "int | None"], None]

_LISTENER: ContextVar[ProgressListener | None] = ContextVar("memcalc_progress_listener", default=None)


@contextmanager
def progress_to(listener: ProgressListener | None) -> Iterator[None]:
    """Tell ``listener`` of the long work done inside the block (None: tell no one, hiding an
    outer listener), restoring the previous listener on the way out."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def report_progress(task: str, done: int, total: int | None) -> None:
    """Tell the listener, if any, that ``done`` of ``total`` units of ``task`` are done."""
    listener = _LISTENER.get()
    if listener is not None:
        listener(task, done, total)


def reported(task: str, items: Iterable[_T], total: int, *, every: int = 1 << 16) -> Iterator[_T]:
    """``items`` (``total`` of them), telling the listener of ``task`` every ``every`` items: a
    consumer of millions of cheap items (the allocator's replay of a long generation's events)
    pays one check per chunk, not one per item."""
    report_progress(task, 0, total)
    source = iter(items)
    done = 0
    while chunk := list(itertools.islice(source, every)):
        yield from chunk
        done += len(chunk)
        report_progress(task, min(done, total), total)
    if done < total:  # fewer than promised: the task still ends
        report_progress(task, total, total)

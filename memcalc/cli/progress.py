"""The command line's progress bar: long work (a generation's tokens, a sweep's configurations,
a fit's estimates, told through :mod:`memcalc.core.progress`) drawn as one line on stderr — only
when stderr is a terminal and the output is not JSON, and only for work that has taken a while,
so that a pipe, a log, a test's captured output or a quick estimate never sees it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from memcalc.core.progress import progress_to

__all__ = ("TerminalProgress", "is_terminal", "progress_on_terminal")

#: Work that ends sooner than this shows nothing: a bar that flashes by says nothing.
SHOW_AFTER_S = 1.0
#: The line is redrawn at most this often (a generation tells every token).
REDRAW_S = 0.1
#: Characters of the bar between its brackets.
BAR_WIDTH = 30


class TerminalProgress:
    """A progress listener drawing one line on ``stream``: the first task it is told of, until
    that task ends; another task told meanwhile (a generation inside a sweep's estimate) is left
    out, so that the line never flickers between two."""

    def __init__(self, stream: TextIO, *, show_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._show_after_s = SHOW_AFTER_S if show_after_s is None else show_after_s
        self._clock = clock
        self._task: str | None = None
        self._started = 0.0
        self._drawn_at: float | None = None
        self._width = 0

    def __call__(self, task: str, done: int, total: int | None) -> None:
        now = self._clock()
        if task == self._task and done == 0:  # the same work again (a fit per setting): a new line
            self.close()
        if self._task is None:
            self._task, self._started = task, now
        if task != self._task:
            return
        finished = total is not None and done >= total
        due = self._drawn_at is None or finished or now - self._drawn_at >= REDRAW_S
        if now - self._started >= self._show_after_s and due:
            self._draw(done, total, now)
        if finished:
            self.close()

    def close(self) -> None:
        """End the line drawn, if any; the next task told starts a new one."""
        if self._drawn_at is not None:
            self._stream.write("\n")
            self._stream.flush()
        self._task, self._drawn_at, self._width = None, None, 0

    def _draw(self, done: int, total: int | None, now: float) -> None:
        elapsed = f"{now - self._started:.0f} s"
        if total is None:
            line = f"{self._task}  {done:,} done  {elapsed}"
        else:
            filled = BAR_WIDTH * min(done, total) // max(total, 1)
            bar = "#" * filled + "-" * (BAR_WIDTH - filled)
            line = f"{self._task}  [{bar}]  {done:,}/{total:,}  {elapsed}"
        self._stream.write("\r" + line.ljust(self._width))  # spaces cover a longer line drawn before
        self._stream.flush()
        self._drawn_at, self._width = now, len(line)


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (a closed or replaced stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@contextmanager
def progress_on_terminal(fmt: str) -> Iterator[None]:
    """Draw the progress of the long work inside the block on stderr, when stderr is a terminal
    and ``fmt`` is not JSON; the line is ended on the way out, before any error is printed."""
    stream = sys.stderr
    if fmt == "json" or not is_terminal(stream):
        yield
        return
    listener = TerminalProgress(stream)
    try:
        with progress_to(listener):
            yield
    finally:
        listener.close()

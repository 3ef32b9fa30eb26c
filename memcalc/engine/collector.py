"""Python's cyclic garbage collector, paused while a step is traced and replayed.

Tracing a large model creates millions of short-lived objects (op records, fake tensors, saved
frames), and every so many allocations the collector walks all tracked objects: a full
collection once a model has tens of layers takes 0.1–0.4 s, several times per estimate. Reference
counting still frees what it always frees; only the search for reference cycles waits, and cycles
made during the step are collected once it ends (the RSS they hold meanwhile is measured in
benchmarks/startup.py). The user's setting is restored on the way out, errors included: a
collector the user had disabled stays disabled, and one enabled is enabled again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ("PAUSE_COLLECTOR", "collector_paused")

#: Whether the collector is paused during traces and replays: benchmarks/startup.py sets it to
#: False to measure what the pause saves and what it holds; nothing else changes it.
PAUSE_COLLECTOR = True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block, and put back the state found (nested blocks
    leave it to the outermost)."""
    was_enabled = gc.isenabled()
    if PAUSE_COLLECTOR:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


"""The ``memcalc`` command line: one module per command, options shared in :mod:`.options`.

The command modules hold options and error mapping only; the library does the work."""

from memcalc.cli.app import main

__all__ = ("main",)

"""The ``memcalc`` command line: one module per command, options shared in :mod:`.options`.

The command modules hold options and error mapping only; the library does the work. The group,
:mod:`memcalc.cli.commands`, imports a command's module only when that command runs."""

from memcalc.cli.commands import main

__all__ = ("main",)

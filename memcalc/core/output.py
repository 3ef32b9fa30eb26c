"""Every file memcalc writes (plots, timelines, snapshots, a real step's snapshot): the path
checked before any work is done, the file written whole or not at all, and a user's existing
file never replaced unless overwriting was asked for (``--force``, ``force=True``). One place,
so every output path fails the same way, with one line naming the file.

It sits in the core, below the engine, because the files are written from two layers: the
report layer (plots, timelines, simulated snapshots) and the measurement (a real step's
allocator history, ``--measure-snapshot``)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

from memcalc.core.errors import OutputExistsError, PlotPathError

__all__ = ("check_output_path", "check_writable", "write_atomically")


def check_writable(target: Path, what: str, *, force: bool = False) -> None:
    """Check that ``what`` (``"plot"``, ``"timeline"``, ``"snapshot"``) can be written to
    ``target``: its folder exists and takes a new file, it is not itself a folder, and it does
    not exist (unless ``force``).

    The folder is tried for real, with a file made and removed there: permission bits say
    nothing of a read-only file system, or of a folder that refuses even root (``/sys``).

    Raises:
        OutputExistsError: ``target`` exists and ``force`` is False.
        PlotPathError: one line naming the path and what to do.
    """
    folder = target.parent
    if not folder.is_dir():
        raise PlotPathError(f"cannot write the {what} to {target}: the folder {folder} does not exist; "
                            f"create it first")
    if target.is_dir():
        raise PlotPathError(f"cannot write the {what} to {target}: it is a folder; give a file name")
    if target.exists() and not force:
        raise OutputExistsError(target, what)
    refused = _refuses_new_files(folder)
    if refused is not None:
        raise PlotPathError(f"cannot write the {what} to {target}: the folder {folder} refuses new files "
                            f"({refused})")
    if target.exists() and not os.access(target, os.W_OK):
        raise PlotPathError(f"cannot write the {what} to {target}: the file is read-only")


def check_output_path(path: str | Path, what: str, formats: Sequence[str], *,
                      force: bool = False) -> tuple[Path, str]:
    """Check that ``what`` can be written to ``path`` (:func:`check_writable`), whose
    extension must be one of ``formats`` (without the dot).

    Returns:
        The path and its format (its extension, lower case).

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is False.
        PlotPathError: one line naming the path and what to do.
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in formats:
        endings = ", ".join("." + f for f in formats[:-1]) + f" or .{formats[-1]}" if len(formats) > 1 \
            else "." + formats[0]
        what_is = f"{target.suffix!r} is not a {what} format" if target.suffix else "the name has no extension"
        raise PlotPathError(f"cannot write the {what} to {target}: {what_is}; end the name in {endings}")
    check_writable(target, what, force=force)
    return target, fmt


def write_atomically(target: Path, what: str, write: Callable[[Path], object], *, force: bool = False) -> Path:
    """Call ``write(temporary)`` for a temporary file beside ``target``, then rename it into
    place: a failure midway leaves neither a truncated file nor a stray one. Without ``force``
    a file that appeared at ``target`` meanwhile (while the estimate ran) is left as it is.

    Raises:
        OutputExistsError: ``target`` exists and ``force`` is False.
        PlotPathError: ``write`` or the rename failed; the message names ``target``, never the
            temporary file.
    """
    # Named here rather than made by mkstemp, whose 0600 mode the file would keep.
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(temporary)
        if not force and target.exists():
            raise OutputExistsError(target, what)
        os.replace(temporary, target)
    except PlotPathError:
        raise
    except OSError as exc:
        raise PlotPathError(f"cannot write the {what} to {target}: {_reason(exc)}") from exc
    except Exception as exc:
        raise PlotPathError(f"cannot write the {what} to {target}: {type(exc).__name__}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return target


def _refuses_new_files(folder: Path) -> str | None:
    """Why ``folder`` refuses a new file (``"permission denied"``), or None when it takes one:
    a file made there and removed at once."""
    probe = folder / f".memcalc-probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as exc:
        return _reason(exc)
    os.unlink(probe)
    return None


def _reason(exc: OSError) -> str:
    """An OS error's reason without the file name it carries (a temporary or probe file the
    user never named): ``"permission denied"``, ``"no space left on device"``."""
    if exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return f"{type(exc).__name__}: {exc}"

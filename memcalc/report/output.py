"""Files the report layer writes (plots, timelines, snapshots): checked before any work is
done, and written whole or not at all. One place, so every output path fails the same way."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

from memcalc.core.errors import PlotPathError

__all__ = ("check_output_path", "check_writable", "write_atomically")


def check_writable(target: Path, what: str) -> None:
    """Check that ``what`` (``"plot"``, ``"timeline"``, ``"snapshot"``) can be written to
    ``target``: its folder exists and is writable, and it is not itself a folder.

    Raises:
        PlotPathError: one line naming the path and what to do.
    """
    folder = target.parent
    if not folder.is_dir():
        raise PlotPathError(f"cannot write the {what} to {target}: the folder {folder} does not exist; "
                            f"create it first")
    if target.is_dir():
        raise PlotPathError(f"cannot write the {what} to {target}: it is a folder; give a file name")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise PlotPathError(f"cannot write the {what} to {target}: permission denied")


def check_output_path(path: str | Path, what: str, formats: Sequence[str]) -> tuple[Path, str]:
    """Check that ``what`` can be written to ``path``, whose extension must be one of
    ``formats`` (without the dot).

    Returns:
        The path and its format (its extension, lower case).

    Raises:
        PlotPathError: one line naming the path and what to do.
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in formats:
        endings = ", ".join("." + f for f in formats[:-1]) + f" or .{formats[-1]}" if len(formats) > 1 \
            else "." + formats[0]
        what_is = f"{target.suffix!r} is not a {what} format" if target.suffix else "the name has no extension"
        raise PlotPathError(f"cannot write the {what} to {target}: {what_is}; end the name in {endings}")
    check_writable(target, what)
    return target, fmt


def write_atomically(target: Path, what: str, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary)`` for a temporary file beside ``target``, then rename it into
    place: a failure midway leaves neither a truncated file nor a stray one.

    Raises:
        PlotPathError: ``write`` or the rename failed.
    """
    # Named here rather than made by mkstemp, whose 0600 mode the file would keep.
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(temporary)
        os.replace(temporary, target)
    except Exception as exc:
        raise PlotPathError(f"cannot write the {what} to {target}: {type(exc).__name__}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return target

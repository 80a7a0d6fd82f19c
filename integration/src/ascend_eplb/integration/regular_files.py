"""Files the integration reads or appends to are regular files, judged before they are opened.

A FIFO, a socket or a device named as a placement file or an events file blocks the process that opens
it (or never ends); every reader and writer of those files goes through these two functions, which judge
the path with ``stat`` first and open without blocking. Standard library only (start-up's rules read
placement files through it before anything is built).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

__all__ = ["open_for_append", "read_regular_file", "regular_file_problem"]

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str | None:
    """What a non-regular file is (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "another kind of file")


def regular_file_problem(path: str | os.PathLike[str], *, missing_ok: bool = False) -> str | None:
    """Why ``path`` cannot be read or appended to as a file, or None (a regular file; with
    ``missing_ok``, also a path that does not exist yet). Symbolic links are followed."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a file where a folder is named
        return None if missing_ok else "no such file"
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    kind = _kind(mode)
    return None if kind is None else f"not a regular file but {kind}"


def read_regular_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file ``path``, judged before it is read (:func:`regular_file_problem`)
    and opened without blocking (a file replaced by a FIFO in between is refused too).

    Raises:
        ValueError: what is wrong, without the path (the caller names the file): missing, a folder, a FIFO,
            a socket or a device, or unreadable.
    """
    problem = regular_file_problem(path)
    if problem is not None:
        raise ValueError(problem)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise ValueError(f"not a regular file but {kind}")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from None
    finally:
        if fd >= 0:
            os.close(fd)


def open_for_append(path: str | os.PathLike[str]) -> IO[str]:
    """``path`` opened for appending UTF-8 text (created when missing, its folder too), refused unless it
    is a regular file; the open never blocks (a FIFO without a reader would).

    Raises:
        ValueError: what is wrong, without the path: a folder, a FIFO, a socket or a device, or the
            file or its folder cannot be created or written.
    """
    try:
        kind = _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        kind = None
    except OSError as e:
        raise ValueError(f"cannot append there ({e.strerror or e})") from None
    if kind is not None:
        raise ValueError(f"not a regular file but {kind}")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except OSError as e:
        raise ValueError(f"cannot append there ({e.strerror or e})") from None
    kind = _kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise ValueError(f"not a regular file but {kind}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")

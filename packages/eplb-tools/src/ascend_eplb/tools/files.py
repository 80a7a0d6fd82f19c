"""The one loading layer of every file the tools read.

Every reader (a compact trace ``.npz``, load matrices ``.npy``/``.csv``/``.json``, an ESFT
``summary.json``, a serving events file ``.jsonl``) reads through :func:`read_input`: the bytes come from
the integration's one reader (:func:`ascend_eplb.integration.regular_files.read_regular_file`: a regular
file only, never blocking, at most its kind's cap), and whatever goes wrong in the parse (a truncated
archive, an empty file, bytes that are not UTF-8, JSON of another structure, a number too large for its
type, a file too large for memory) becomes one :class:`InputFileError` whose message starts with the
file's path; the command prints it as one line, exit status 2, never a library's traceback.
:func:`check_load_values`: values finite and >= 0 with a sum at most the largest float32 (upstream's
policy reads the load as float32), so every sum computed from a load stays finite.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ascend_eplb.integration.regular_files import MODEL_CONFIG, FileKind, RegularFileError, read_regular_file

__all__ = [
    "FLOAT32_MAX",
    "InputFileError",
    "InputFileWarning",
    "check_load_values",
    "json_object",
    "read_input",
]

T = TypeVar("T")

FLOAT32_MAX = float(np.finfo(np.float32).max)


class InputFileError(ValueError):
    """A file a tool reads is missing, empty, unreadable or not what it must be.

    The message starts with the file's path. A ``ValueError``, so every caller that refuses bad input
    with exit status 2 refuses it the same way.
    """


class InputFileWarning(UserWarning):
    """A file a tool reads had a defect the reader skipped (an events file's truncated last line).

    Every command prints it as one line, ``ascend-eplb COMMAND: warning: <path>:<line>: ...``
    (``simulate`` too, which leaves other libraries' warnings as they are).
    """


def read_input(path: str | Path, what: str, parse: Callable[[Path, bytes], T], kind: FileKind) -> T:
    """``parse(path, data)`` of the bytes of ``path``, with every failure turned into
    :class:`InputFileError` naming ``path``.

    Args:
        path: the file.
        what: what the file must be, for the message ("a compact routing trace .npz").
        parse: checks and parses the file's bytes; it may raise anything. A ``ValueError`` whose message
            already starts with the path keeps its message; any other failure is reported as
            ``"<path>: not <what> (<type>: <detail>)"``.
        kind: its kind (:mod:`ascend_eplb.integration.regular_files`): the most of it read.

    Raises:
        InputFileError: the file is missing, not a regular file (a FIFO, a folder, a device: judged before
            it is opened), larger than its kind's cap, empty, or ``parse`` failed.
    """
    path = Path(path)
    source = str(path)
    try:
        data = read_regular_file(path, kind)
    except RegularFileError as e:
        fix = "" if e.fix is None else f"; fix: {e.fix}"
        raise InputFileError(f"{source}: {e.problem} ({what}){fix}") from None
    if not data:
        raise InputFileError(f"{source}: empty file, not {what}")
    try:
        return parse(path, data)
    except InputFileError:
        raise
    except MemoryError:
        raise InputFileError(f"{source}: too large to load into memory ({len(data)} bytes on disk)") from None
    except RecursionError:
        raise InputFileError(f"{source}: not {what} (nested too deeply to parse)") from None
    except OSError as e:
        raise InputFileError(f"{source}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise InputFileError(f"{source}: not UTF-8 text (byte {e.start}), not {what}") from None
    except Exception as e:
        message = str(e)
        if isinstance(e, ValueError) and message.startswith(source):
            raise InputFileError(message) from None
        detail = f"{type(e).__name__}: {message}" if message else type(e).__name__
        raise InputFileError(f"{source}: not {what} ({detail})") from None


def json_object(file: str | Path, kind: FileKind = MODEL_CONFIG) -> dict[str, Any]:
    """The JSON object of ``file`` (a model's ``config.json`` or msModelSlim description by default), read
    by the one reader (a regular file, up to its kind's cap).

    Raises:
        ValueError: unreadable, not a regular file, too large, not JSON or not an object (naming the file).
    """
    try:
        data = json.loads(read_regular_file(file, kind).decode("utf-8"))
    except RegularFileError as exc:
        raise ValueError(f"{file}: {exc.reason}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{file}: cannot read as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must be a JSON object, got {type(data).__name__}")
    return data


def check_load_values(arr: np.ndarray, source: str) -> np.ndarray:
    """Return ``arr`` (float64) if every value is finite and >= 0 and the sum is at most
    :data:`FLOAT32_MAX`; raise ``ValueError`` naming ``source`` and the rule otherwise."""
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError(f"{source}: load must be finite and >= 0")
    with np.errstate(over="ignore"):
        total = float(arr.sum())
    if not total <= FLOAT32_MAX:
        raise ValueError(
            f"{source}: the loads sum to {total:.4g}, more than {FLOAT32_MAX:.4g} (the largest float32, "
            "the type upstream's policy reads the load in); scale the load down"
        )
    return arr

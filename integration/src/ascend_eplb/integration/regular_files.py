"""The one reader and the one writer of the files the integration and the tools read and write.

Reading (:func:`read_regular_file`): only a regular file (symbolic links followed) is read; a folder, a
FIFO, a socket or a device is refused by ``stat`` before it is opened, and the open itself never blocks
(``O_NONBLOCK``, then ``fstat`` again: a path replaced by a FIFO in between is refused too). At most the
cap of its :class:`FileKind` is read (``/dev/zero`` renamed, or a file grown past any sane size, is not
read into memory); ``ASCEND_EPLB_MAX_INPUT_MIB`` (:func:`max_input_mib`; ``ascend-eplb``'s
``--max-input-mib``, :func:`input_limit`) raises the caps.

Writing (:func:`write_regular_file`): whole or not at all, into a temporary file beside the target, then
renamed over it. Only a regular file is replaced; a symbolic link to a regular file has its target
replaced and stays a link; a link to anything else, a FIFO, a device, a socket or a folder is refused,
and so is a file the same run reads (``inputs``). Appending (:func:`open_for_append`, the events file):
the same judgement, the open never blocks.

Every refusal is one :class:`RegularFileError` (a ``ValueError``) naming the path, what is wrong and the fix.
Standard library only (start-up's rules read placement files through it before anything is built).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "CONFIG_FILE",
    "ENV_MAX_INPUT_MIB",
    "EVENTS_FILE",
    "LOAD_FILE",
    "MIB",
    "MODEL_CONFIG",
    "PLACEMENT_FILE",
    "ROUTING_TRACE",
    "FileKind",
    "RegularFileError",
    "input_limit",
    "max_input_mib",
    "open_for_append",
    "read_regular_file",
    "regular_file_problem",
    "writable_file_problem",
    "write_regular_file",
]

MIB = 1 << 20


@dataclass(frozen=True)
class FileKind:
    """A kind of file read, and the most of it read.

    Attributes:
        what: the file in words (``"a placement file"``), for messages.
        max_mib: the most MiB read (a larger file is refused unread) unless ``ASCEND_EPLB_MAX_INPUT_MIB``
            says another (:func:`max_input_mib`).
    """

    what: str
    max_mib: int


#: A placement file (``plan --export-expert-map``): L x P ids, ~0.1 MiB for DeepSeek-V3's 58 x 288.
PLACEMENT_FILE = FileKind("a placement file", 64)
#: A serving events file: a window record of DeepSeek-V3 is ~0.2 MiB; 256 MiB holds ~1000 windows, a
#: few days of serving at the default step interval. A soak's may be larger: ``--max-input-mib``.
EVENTS_FILE = FileKind("a serving events file", 256)
#: A config file ``check`` reads (this package's schema, a ``vllm serve --config`` YAML).
CONFIG_FILE = FileKind("a config file", 16)
#: A model's ``config.json`` or msModelSlim description.
MODEL_CONFIG = FileKind("a model config", 16)
#: A load matrix (``.json``, ``.npy``, ``.csv``, ESFT's text and ``summary.json``).
LOAD_FILE = FileKind("a load file", 256)
#: A compact routing trace (``.npz``).
ROUTING_TRACE = FileKind("a routing trace", 1024)

#: The switch that raises (or lowers) every kind's cap, in MiB: a server's, and what ``ascend-eplb``'s
#: ``--max-input-mib`` sets for the command and the rank processes it starts.
ENV_MAX_INPUT_MIB = "ASCEND_EPLB_MAX_INPUT_MIB"


def max_input_mib(environ: Mapping[str, str] | None = None) -> int | None:
    """``ASCEND_EPLB_MAX_INPUT_MIB``: the cap of every kind of file, in MiB; None: unset or empty (each
    kind's own cap, :attr:`FileKind.max_mib`).

    Raises:
        ValueError: not an integer >= 1 (naming the value).
    """
    raw = (os.environ if environ is None else environ).get(ENV_MAX_INPUT_MIB, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{ENV_MAX_INPUT_MIB}={raw!r}: must be an integer >= 1 (MiB); unset: each file's own cap"
        )
    return value


@contextlib.contextmanager
def input_limit(max_mib: int | None) -> Iterator[None]:
    """Inside, every kind of file is read up to ``max_mib`` MiB (None: as outside), through
    ``ASCEND_EPLB_MAX_INPUT_MIB`` (so the processes started inside read the same)."""
    if max_mib is None:
        yield
        return
    if isinstance(max_mib, bool) or not isinstance(max_mib, int) or max_mib < 1:
        raise ValueError(f"max input MiB={max_mib!r}: must be an integer >= 1")
    before = os.environ.get(ENV_MAX_INPUT_MIB)
    os.environ[ENV_MAX_INPUT_MIB] = str(max_mib)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_MAX_INPUT_MIB, None)
        else:
            os.environ[ENV_MAX_INPUT_MIB] = before


def _cap_mib(kind: FileKind) -> int:
    """``kind``'s cap: ``ASCEND_EPLB_MAX_INPUT_MIB``'s, else its own (also for a bad value of the switch,
    which the serving switches' check refuses on its own: ``guardrail_facts.serving_switch_errors``)."""
    try:
        limit = max_input_mib()
    except ValueError:
        limit = None
    return kind.max_mib if limit is None else limit


class RegularFileError(ValueError):
    """A file that cannot be read or written as asked.

    Attributes:
        path: the file as named; ``problem``: what is wrong; ``fix``: what to do (None: nothing to say).
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str | None = None) -> None:
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"{self.path}: {self.reason}")

    @property
    def reason(self) -> str:
        """The problem and the fix, without the path."""
        return self.problem if self.fix is None else f"{self.problem}; fix: {self.fix}"


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _kind(mode: int) -> str | None:
    """What a non-regular file is (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "another kind of file")


#: Why a non-regular file is refused, by what was asked of it.
_WHY = {
    "read": "reading it would block or never end",
    "write": "only a regular file is replaced",
    "append to": "appending to it would block or never end",
}


def _not_regular(path: str | os.PathLike[str], kind: str, verb: str) -> RegularFileError:
    if kind == "a folder":
        return RegularFileError(path, f"is a folder, not a file to {verb}", "name the file, not its folder")
    fix = "name a regular file" + ("; copy what it holds into one first" if verb == "read" else "")
    return RegularFileError(path, f"is {kind}, not a regular file ({_WHY[verb]})", fix)


def _os_problem(path: str | os.PathLike[str], e: OSError, verb: str) -> RegularFileError:
    return RegularFileError(path, f"cannot {verb} it ({e.strerror or e})")


def regular_file_problem(
    path: str | os.PathLike[str], *, missing_ok: bool = False, verb: str = "read"
) -> RegularFileError | None:
    """Why ``path`` cannot be read (``verb``: or appended to) as a file, or None (a regular file; with
    ``missing_ok``, also a path that does not exist yet). Symbolic links are followed."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a file where a folder is named
        return None if missing_ok else RegularFileError(path, "no such file")
    except OSError as e:
        return _os_problem(path, e, verb)
    kind = _kind(mode)
    return None if kind is None else _not_regular(path, kind, verb)


def read_regular_file(path: str | os.PathLike[str], kind: FileKind) -> bytes:
    """The bytes of the regular file ``path``, at most ``kind``'s cap (:func:`input_limit`).

    Judged by ``stat`` before it is opened (:func:`regular_file_problem`), opened without blocking, judged
    again by ``fstat``, read up to the cap.

    Raises:
        RegularFileError: missing, a folder, a FIFO, a socket or a device, unreadable, or larger than the cap
            (unread), each naming the path and the fix.
    """
    problem = regular_file_problem(path)
    if problem is not None:
        raise problem
    cap = _cap_mib(kind) * MIB
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise _os_problem(path, e, "read") from None
    try:
        info = os.fstat(fd)
        if (what := _kind(info.st_mode)) is not None:
            raise _not_regular(path, what, "read")
        if info.st_size > cap:
            raise _too_large(path, kind, info.st_size)
        chunks, total = [], 0
        while total <= cap:
            chunk = os.read(fd, min(cap + 1 - total, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > cap:  # grown while read, or a regular file that never ends (procfs)
            raise _too_large(path, kind, None)
        return b"".join(chunks)
    except OSError as e:
        raise _os_problem(path, e, "read") from None
    finally:
        os.close(fd)


def _too_large(path: str | os.PathLike[str], kind: FileKind, size: int | None) -> RegularFileError:
    """``size``: the file's bytes (None: more than the cap, still growing or never ending)."""
    cap = _cap_mib(kind)
    said = f"more than {cap} MiB" if size is None else f"{size / MIB:.1f} MiB"
    need = cap * 4 if size is None else max(-(-size // MIB), cap + 1)
    return RegularFileError(
        path,
        f"{said}, more than the {cap} MiB {kind.what} is read up to (not read)",
        f"name the right file, or raise the limit: ascend-eplb's --max-input-mib {need} ({ENV_MAX_INPUT_MIB}="
        f"{need} for a server)",
    )


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing folder of ``path`` when it is not a folder (a file named as one), or None."""
    existing = next((p for p in path.parents if os.path.lexists(p)), None)
    return existing if existing is not None and not existing.is_dir() else None


def _target(path: Path) -> tuple[Path, os.stat_result | None]:
    """The file a write to ``path`` replaces (a symbolic link's target) and its ``stat`` (None: missing).

    Raises:
        RegularFileError: ``path`` is a link to a missing or non-regular file, or not a regular file.
    """
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a file where a folder is named
        return path, None
    except OSError as e:
        raise _os_problem(path, e, "write") from None
    if not stat.S_ISLNK(info.st_mode):
        if (what := _kind(info.st_mode)) is not None:
            raise _not_regular(path, what, "write")
        return path, info
    target = Path(os.path.realpath(path))
    try:
        info = os.stat(target)
    except OSError:
        raise RegularFileError(
            path,
            f"is a symbolic link to {target}, which does not exist (a link is written through only to a "
            "regular file)",
            "name the file to write, not the link",
        ) from None
    if (what := _kind(info.st_mode)) is not None:
        raise RegularFileError(
            path,
            f"is a symbolic link to {target}, {what}, not a regular file (only a regular file is replaced)",
            "name a regular file",
        )
    return target, info


def writable_file_problem(
    path: str | os.PathLike[str], inputs: Sequence[tuple[str, str | os.PathLike[str] | None]] = ()
) -> RegularFileError | None:
    """Why :func:`write_regular_file` would refuse ``path`` now, or None: not a regular file (nor a link
    to one), its folder missing or not writable, or one of ``inputs`` (``(option, path)`` of the files
    the same run reads: a folder stands for its ``config.json``)."""
    try:
        _judge_write(Path(path), inputs)
    except RegularFileError as e:
        return e
    return None


def _judge_write(
    path: Path, inputs: Sequence[tuple[str, str | os.PathLike[str] | None]]
) -> tuple[Path, os.stat_result | None]:
    if str(path) in ("", ".") or str(path).endswith(("/", os.sep)):
        raise RegularFileError(path, "is a folder, not a file to write", "name the file to write")
    target, info = _target(path)
    for option, given in inputs:
        if given is None:
            continue
        read = Path(given) / "config.json" if Path(given).is_dir() else Path(given)
        same = (
            os.path.samefile(target, read)
            if info is not None and read.exists()
            else os.path.realpath(target) == os.path.realpath(read)
        )
        if same:
            raise RegularFileError(
                path,
                f"is the file {option} reads ({read}): writing it would destroy that input",
                "write to another file",
            )
    folder = target.parent
    if not folder.is_dir():
        if (blocker := _file_in_the_way(target)) is not None:
            raise RegularFileError(
                path, f"{blocker} is a file, not a folder: nothing can be written under it"
            )
        raise RegularFileError(path, f"the folder {folder} does not exist", "create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RegularFileError(
            path, f"the folder {folder} is not writable (the file is replaced by a rename there)"
        )
    return target, info


def write_regular_file(
    path: str | os.PathLike[str],
    data: bytes | str,
    inputs: Sequence[tuple[str, str | os.PathLike[str] | None]] = (),
) -> Path:
    """Write ``data`` (a str as UTF-8) to ``path``, whole or not at all: into a temporary file beside the
    file replaced, flushed to disk, renamed over it (a crash or a full disk never leaves a truncated file
    nor destroys the one there). A symbolic link to a regular file has its target replaced (the link
    stays); the replaced file's permission bits are kept (a new file's: 0666 less the umask).

    Args:
        inputs: ``(option, path)`` of the files the same run reads; none of them is ever written.

    Returns:
        The file written (the link's target for a link).

    Raises:
        RegularFileError: :func:`writable_file_problem`'s refusals, or the write failed (``path`` unchanged).
    """
    path = Path(path)
    target, info = _judge_write(path, inputs)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if info is not None:
        mode = stat.S_IMODE(info.st_mode)
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        _target(path)  # still a regular file (or a link to one, or missing) just before the rename
        os.replace(temporary, target)
    except RegularFileError:
        os.unlink(temporary)
        raise
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise _os_problem(path, e, "write") from None
    return target


def open_for_append(path: str | os.PathLike[str]) -> IO[str]:
    """``path`` opened for appending UTF-8 text (created when missing, its folder too), refused unless it
    is a regular file; the open never blocks (a FIFO without a reader would).

    Raises:
        RegularFileError: a folder, a FIFO, a socket or a device, or the file or its folder cannot be created
            or written (naming the path).
    """
    problem = regular_file_problem(path, missing_ok=True, verb="append to")
    if problem is not None:
        raise problem
    if (blocker := _file_in_the_way(Path(path))) is not None:
        raise RegularFileError(path, f"{blocker} is a file, not a folder: nothing can be created under it")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o666)
    except OSError as e:
        raise _os_problem(path, e, "append to") from None
    what = _kind(os.fstat(fd).st_mode)
    if what is not None:
        os.close(fd)
        raise _not_regular(path, what, "append to")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")

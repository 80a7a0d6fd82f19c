"""How an ``ascend-eplb`` command ends: signals, the whole-run deadline, and nothing left behind.

- :func:`command_scope`: SIGTERM and SIGHUP stop a command as Ctrl-C does (one line, exit
  ``128 + signal``); its scratch compile cache and, for ``simulate``, the fork server go with it.
- :func:`deadline_alarm`: ``--timeout`` ends whatever is still starting when the run's deadline passes.
- :func:`record_rank_resources` (in a rank) and :func:`release_world_resources` (in the launcher): the
  shared-memory segments and socket files a crashed or killed rank left are removed.
- :func:`own_output_folder`: one run owns its ``--out`` folder at a time.
- :func:`record_refusal` and :func:`read_refusals`: a refusal only the ranks can make (vLLM's model
  class, which the launcher does not import) reaches the command as one message, not as tracebacks.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import gc
import json
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

from ascend_eplb.launch import reap_child, stop_fork_server

__all__ = [
    "MAX_TIMEOUT_S",
    "OUTPUT_LOCK",
    "SCRATCH_PREFIX",
    "DeadlineExceededError",
    "OutputFolderInUseError",
    "RunPhase",
    "StoppedBySignal",
    "command_scope",
    "deadline_alarm",
    "exit_code_of",
    "own_output_folder",
    "read_refusals",
    "record_rank_resources",
    "record_refusal",
    "release_world_resources",
    "signal_name_of",
]

#: Longest ``--timeout`` / ``--worker-timeout``: 7 days (the OS timers and timedeltas they feed stay
#: far from their limits).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
SCRATCH_PREFIX = "ascend-eplb-simulate-"
#: The alarm comes this long after the deadline, so the launcher's own deadline (which names each
#: rank still running) decides first whenever ranks run.
_ALARM_AFTER_S = 0.5
#: A deadline dropped inside a finalizer is raised again this soon after.
_REARM_S = 0.01


class DeadlineExceededError(RuntimeError):
    """The run's deadline passed before its ranks finished starting."""


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP stopped the command (outside the launcher's run of the ranks).

    Attributes:
        signal_name: ``"SIGTERM"`` or ``"SIGHUP"``.
    """

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name}")
        self.signal_name = signal_name


def signal_name_of(error: BaseException) -> str:
    """The signal that stopped the command: ``error.signal_name`` (:class:`StoppedBySignal`, the
    launcher's ``LauncherInterruptedError``), else ``"SIGINT"`` (Ctrl-C's ``KeyboardInterrupt``)."""
    return getattr(error, "signal_name", None) or "SIGINT"


def exit_code_of(error: BaseException) -> int:
    """``128 + signal number`` of a stop by signal (SIGINT for ``KeyboardInterrupt``)."""
    return 128 + int(signal.Signals[signal_name_of(error)])


@contextlib.contextmanager
def _signals_stop() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise :class:`StoppedBySignal` in the main thread; a signal the
    process ignores (``nohup`` ignores SIGHUP) stays ignored."""
    if not _main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise StoppedBySignal(signal.Signals(signum).name)

    previous = {
        sig: signal.signal(sig, handler)
        for sig in (signal.SIGTERM, signal.SIGHUP)
        if signal.getsignal(sig) != signal.SIG_IGN
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Clean-up runs to its end: a second Ctrl-C or SIGTERM does not cut it short."""
    if not _main_thread():
        yield
        return
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stop_resource_tracker(wait_s: float = 5.0) -> None:
    """End this process's multiprocessing resource tracker (it exits once every user closed its pipe:
    the fork server and the ranks are gone by now), waiting at most ``wait_s``."""

    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        if tracker._fd is None:
            return
        os.close(tracker._fd)
        tracker._fd = None
        pid, tracker._pid = tracker._pid, None
    reap_child(pid, wait_s)


@contextlib.contextmanager
def command_scope(command: str) -> Iterator[None]:
    """The whole of one ``ascend-eplb`` command: SIGTERM and SIGHUP raise :class:`StoppedBySignal`
    wherever the command is (reading a file, importing vLLM, starting ranks; while ranks run, the
    launcher raises its ``LauncherInterruptedError`` after stopping them). It is a ``KeyboardInterrupt``,
    so no ``except Exception`` on the way (``check`` turns any error of a file into a violation) takes a
    stop for bad input.

    Every command gets a scratch folder (``$TMPDIR/ascend-eplb-<command>-*``) for torch's compile cache:
    importing vLLM imports ``torch._dynamo``, whose module-level ``DiskDynamoCache`` creates
    ``$TMPDIR/torchinductor_<user>`` unless ``TORCHINDUCTOR_CACHE_DIR`` names another folder (``check``
    and ``plan --policies`` import vLLM; ``simulate``'s fork server and ranks inherit the variable). The
    folder is removed on the way out, whatever ended the command; a cache folder set by the caller is
    kept as it is. ``simulate`` also stops the fork server (so its ranks) and the resource tracker first.
    """
    scratch = Path(tempfile.mkdtemp(prefix=f"ascend-eplb-{command}-"))
    own_cache = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    if own_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "torchinductor")
    try:
        with _signals_stop():
            yield
    finally:
        with _signals_ignored():
            if command == "simulate":
                gc.collect()  # a failed run's queues and locks: their semaphores unlinked, not "leaked"
                stop_fork_server()
                _stop_resource_tracker()
            shutil.rmtree(scratch, ignore_errors=True)
            if own_cache:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@dataclass
class RunPhase:
    """What the run is doing (``what``, set as it goes on), for the deadline's message."""

    what: str


@contextlib.contextmanager
def deadline_alarm(deadline: float, timeout_s: float, phase: RunPhase) -> Iterator[None]:
    """Raise :class:`DeadlineExceededError` in the main thread just after ``deadline`` (monotonic).

    ``phase`` says what the run was doing, for the message. Off the main thread (no signals
    there) this does nothing: the launcher's own deadline still holds once ranks run. An alarm that
    fires inside a finalizer (where Python drops any error, printing "Exception ignored") is not
    printed and fires again a moment later, outside it.
    """
    if not _main_thread():
        yield
        return

    fired: list[str] = []

    def handler(_signum: int, _frame: object) -> None:
        fired.append(
            f"simulation failed: the deadline (--timeout {timeout_s:g} s, start-up included) passed while "
            f"{phase.what}; every process of the run was stopped"
        )
        raise DeadlineExceededError(fired[0])

    def swallowed(unraisable: object) -> None:
        # The alarm fired inside a finalizer (a ``__del__``, a weakref callback), where Python prints
        # the error and drops it: no trace of it, and the alarm comes again at once, to be raised where
        # it can end the run.
        if isinstance(getattr(unraisable, "exc_value", None), DeadlineExceededError):
            signal.setitimer(signal.ITIMER_REAL, _REARM_S)
            return
        previous_hook(unraisable)

    previous = signal.signal(signal.SIGALRM, handler)
    previous_hook, sys.unraisablehook = sys.unraisablehook, swallowed
    # Capped: a timeout beyond the limit, or not > 0 (--timeout -1: a deadline already past), is refused
    # by the options' validation, inside this scope; no alarm may end the run before that refusal.
    remaining = deadline - time.monotonic() + _ALARM_AFTER_S
    if not (timeout_s > 0 and remaining < MAX_TIMEOUT_S + 60.0):  # also nan and inf
        remaining = MAX_TIMEOUT_S + 60.0
    signal.setitimer(signal.ITIMER_REAL, max(remaining, 0.001))
    try:
        yield
    except BaseException as e:
        # The alarm raises wherever the main thread is; a library running then may wrap the error in
        # its own (transformers' lazy imports raise RuntimeError from it): the deadline is what ended it.
        if fired and not isinstance(e, DeadlineExceededError):
            raise DeadlineExceededError(fired[0]) from None
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook


def record_rank_resources(world_dir: str | os.PathLike[str], rank: int) -> None:
    """In a rank, once vLLM's groups exist: write ``resources-rank<r>.json`` (shared-memory segment
    names and message-queue socket paths this rank's vLLM groups created) into the world's folder."""
    # local: every command imports this module; only a rank, where vLLM is loaded already, calls this
    from vllm.distributed import parallel_state

    shm, sockets = [], []
    for ref in list(parallel_state._groups.values()):
        group = ref()
        queue = getattr(group, "mq_broadcaster", None) if group is not None else None
        if queue is None:
            continue
        for holder in (getattr(queue, "buffer", None), getattr(queue, "tensor_arena", None)):
            memory = getattr(holder, "shared_memory", None)
            if memory is not None and getattr(holder, "is_creator", False):
                shm.append(memory.name)
        handle = getattr(queue, "handle", None)
        for address in (
            getattr(handle, "local_subscribe_addr", None),
            getattr(handle, "local_notify_addr", None),
        ):
            if isinstance(address, str) and address.startswith("ipc://"):
                sockets.append(address.removeprefix("ipc://"))
    path = Path(world_dir) / f"resources-rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"shared_memory": shm, "sockets": sockets}))
    tmp.replace(path)


def release_world_resources(scratch: str | os.PathLike[str]) -> None:
    """In the launcher, after a world ended: remove what its ranks recorded and left (a rank that ended
    cleanly removed its own; a crashed or killed one could not)."""

    for record in sorted(Path(scratch).glob("*/resources-rank*.json")):
        try:
            listed = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        for socket_path in listed.get("sockets", []):
            with contextlib.suppress(OSError):
                os.unlink(socket_path)
        for name in listed.get("shared_memory", []):
            try:
                segment = shared_memory.SharedMemory(name=name)
            except (OSError, ValueError):
                continue  # already unlinked by its rank
            segment.close()
            segment.unlink()  # also unregisters it from the resource tracker: no "leaked" warning


#: The file a rank refused by start-up validation writes its refusal into, in the world's folder.
_REFUSAL_FILE = "refused-rank{rank}.txt"


def record_refusal(world_dir: str | os.PathLike[str], rank: int, message: str) -> None:
    """In a rank whose start-up refused the configuration (the serving path's validation, or its
    placement file's reader): write the refusal's message into the world's folder for the launcher."""
    (Path(world_dir) / _REFUSAL_FILE.format(rank=rank)).write_text(message, encoding="utf-8")


def read_refusals(scratch: str | os.PathLike[str]) -> dict[int, str]:
    """In the launcher, after a world failed: rank -> the refusal its start-up wrote (:func:`record_refusal`);
    empty when no rank was refused."""
    found = {}
    for path in Path(scratch).glob("*/" + _REFUSAL_FILE.format(rank="*")):
        rank = path.name.removeprefix("refused-rank").removesuffix(".txt")
        with contextlib.suppress(OSError, ValueError):
            found[int(rank)] = path.read_text(encoding="utf-8")
    return dict(sorted(found.items()))


#: The lock file of an output folder (:func:`own_output_folder`), inside it.
OUTPUT_LOCK = ".ascend-eplb-simulate.lock"


class OutputFolderInUseError(ValueError):
    """Another live run owns the output folder (:func:`own_output_folder`); the message names it."""


def _holder_text(raw: bytes) -> str:
    try:
        h = json.loads(raw)
        return f"{h['command']}, pid {h['pid']} on {h['host']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "its pid and start not written yet"


@contextlib.contextmanager
def own_output_folder(out: str | os.PathLike[str]) -> Iterator[None]:
    """Own the output folder ``out`` (existing) for the run inside: a second run on it is refused, so no
    run deletes or mixes another's ``events.jsonl``, report or plot.

    The owner holds an exclusive ``flock`` on ``out/OUTPUT_LOCK`` and writes its pid, host and start time
    into it; the file is removed when the run ends. A stale lock (a run killed with
    SIGKILL, a crashed host) holds nothing: the kernel drops a ``flock`` with the last descriptor of its
    holder, dead processes included, so the next run takes the lock and writes its own details over the
    dead run's; no pid is guessed alive or dead. A lock file removed by its owner's end while another run
    was taking it is detected (the locked file is no longer the one at the path) and taken again.

    Raises:
        OutputFolderInUseError: a live run holds the lock (the message names it: pid, host, start).
        ValueError: the folder's filesystem does not lock (naming it).
    """
    path = Path(out) / OUTPUT_LOCK
    while True:
        try:
            # Not through a link, and never blocking: a FIFO put there opens at once and is refused below.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise ValueError(
                f"out={out}: cannot open its lock file {path} ({e.strerror or e}); remove what is there"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"out={out}: {path}, the run's lock file, is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(os.read(fd, 65536))
            os.close(fd)
            raise OutputFolderInUseError(
                f"out={out}: in use by another run ({holder}); two runs in one folder delete and mix each "
                "other's events.jsonl, report.json and balancedness.png: wait for it to end, or give "
                "another --out"
            ) from None
        except OSError as e:
            os.close(fd)
            raise ValueError(
                f"out={out}: cannot lock {path} ({e.strerror or e}); one run owns an output folder at a "
                "time: give an --out on a filesystem that supports locks"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its owner ended and removed it after this run opened it: take the new one
    holder = {
        "command": "ascend-eplb simulate",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # still locked: a run opening it now finds it gone and takes a new one
        os.close(fd)

"""How an ``ascend-eplb`` command ends: signals, the whole-run deadline, and nothing left behind.

- :func:`command_scope` wraps a whole command. SIGTERM and SIGHUP raise :class:`StoppedBySignal`
  wherever the command is (reading a file, importing vLLM, vLLM's parser, starting ranks; while ranks
  run, the launcher's :class:`~ascend_eplb.launch.LauncherInterruptedError` after it stopped them), as
  Ctrl-C raises ``KeyboardInterrupt``; the command prints one line and exits ``128 + signal``.
  :class:`StoppedBySignal` is a ``KeyboardInterrupt``, so no ``except Exception`` on the way (a file
  reader's, ``check``'s, which turns any error of a file into a violation) takes a stop for bad input:
  ``check`` stopped by SIGTERM printed ``INVALID`` with a violation about stopped ranks. For
  ``simulate`` it also gives torch's compile cache (which importing vLLM creates in ``$TMPDIR``) a
  scratch folder of the command, and on the way out stops the fork server (so its ranks) and the
  resource tracker and removes that folder.
- :func:`deadline_alarm`: ``--timeout`` is the deadline of the whole run; a SIGALRM just after it ends
  whatever is still starting (the routing's reading, the fork server's preload of vLLM, a stalled rank
  start), which the launcher's own deadline (counted while ranks run) cannot interrupt.
- :func:`record_rank_resources` (in each rank, once vLLM's groups exist) writes the names of the
  shared-memory segments and message-queue sockets vLLM created into the world's folder;
  :func:`release_world_resources` (in the launcher, after the world, whatever ended it) removes those a
  crashed or killed rank left, so no socket file stays in ``$TMPDIR`` and the resource tracker has no
  leaked segment to warn about.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ascend_eplb.launch import reap_child, stop_fork_server

__all__ = [
    "SCRATCH_PREFIX",
    "DeadlineExceededError",
    "StoppedBySignal",
    "command_scope",
    "deadline_alarm",
    "exit_code_of",
    "record_rank_resources",
    "release_world_resources",
    "signal_name_of",
]

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
    from multiprocessing import resource_tracker

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
    """The whole of one ``ascend-eplb`` command (see the module docstring)."""
    if command != "simulate":
        with _signals_stop():
            yield
        return
    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    own_cache = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    if own_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "torchinductor")
    try:
        with _signals_stop():
            yield
    finally:
        with _signals_ignored():
            gc.collect()  # a failed run's queues and locks: their semaphores unlinked, not "leaked"
            stop_fork_server()
            _stop_resource_tracker()
            shutil.rmtree(scratch, ignore_errors=True)
            if own_cache:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@contextlib.contextmanager
def deadline_alarm(deadline: float, timeout_s: float, phase: list[str]) -> Iterator[None]:
    """Raise :class:`DeadlineExceededError` in the main thread just after ``deadline`` (monotonic).

    ``phase[0]`` says what the run was doing, for the message. Off the main thread (no signals
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
            f"{phase[0]}; every process of the run was stopped"
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
    from ascend_eplb.tools.simulate.resources import MAX_TIMEOUT_S

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
    from multiprocessing import shared_memory

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

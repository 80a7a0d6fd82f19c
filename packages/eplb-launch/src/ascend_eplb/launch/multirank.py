"""Run one function on N real rank processes over Gloo on CPU, and surface every rank's failure.

The repository's one multi-rank launcher (DESIGN.md section 6): tests and ``ascend-eplb simulate`` call
:func:`run_ranks`; under ``torchrun`` the same rank functions take :meth:`RankContext.from_torchrun`.
Ranks come from a ``forkserver`` that imports ``preload`` once, rendezvous through a ``file://`` URL in
the caller's folder, run with :data:`RANK_ENV`, and freeze what they inherited (``gc.freeze()``). Each
world's ranks share a temporary folder of their own (``TMPDIR``), removed once every rank has ended: what
their libraries leave there (vLLM's IPC sockets, which a rank's ``os._exit`` never unlinks) goes with it. One
deadline covers the world; after a failure the others get ``grace_s``, then are killed, and
:class:`RankFailureError` reports every rank. Nothing outlives the launcher. Rank functions are
module-level ``fn(ctx: RankContext, *args)``, in an installed module or a plain file loaded with
:func:`load_module`, never in a test file (pytest's module names do not import in a child). README.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import hashlib
import importlib
import importlib.util
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue as queue_module
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver, util
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "RANK_ENV",
    "LauncherInterruptedError",
    "RankContext",
    "RankFailureError",
    "load_module",
    "reap_child",
    "run_ranks",
    "signals_raise",
    "stop_fork_server",
]

#: Environment every rank process gets (set in the test process before the fork server starts, so
#: modules preloaded there see it too). Values already present in the environment are kept.
RANK_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
}


@dataclass(frozen=True)
class RankContext:
    """What a rank function learns about its world.

    Attributes:
        rank: global rank of this process, in ``[0, world_size)``.
        world_size: number of rank processes.
        init_method: the rendezvous URL: ``file://`` unique to this world under :func:`run_ranks`,
            ``env://`` under ``torchrun``.
        tmp_dir: a directory of this world (shared by its ranks on one host).
        timeout_s: the world's deadline in seconds; use it for collective timeouts.
        local_rank: rank on this host (the device index on an accelerator host).
        messages: the launcher's message queue (None under ``torchrun`` or without ``on_message``).
    """

    rank: int
    world_size: int
    init_method: str
    tmp_dir: Path
    timeout_s: float
    local_rank: int = 0
    messages: Any = None

    @classmethod
    def from_torchrun(cls, tmp_dir: Path, timeout_s: float) -> RankContext:
        """The context of a process started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).

        Raises:
            RuntimeError: one of torchrun's variables is missing or not an integer.
        """
        values = {}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(f"{name} is not set: this process was not started by torchrun")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            try:
                values[name] = int(os.environ[name])
            except ValueError:
                raise RuntimeError(f"{name}={os.environ[name]!r} from torchrun is not an integer") from None
        return cls(
            rank=values["RANK"],
            world_size=values["WORLD_SIZE"],
            init_method="env://",
            tmp_dir=Path(tmp_dir),
            timeout_s=timeout_s,
            local_rank=values["LOCAL_RANK"],
        )

    def send(self, message: Any) -> None:
        """Hand ``message`` (picklable) to the launcher's ``on_message``; nothing when there is none."""
        if self.messages is not None:
            self.messages.put((self.rank, message))

    def init_gloo(self, timeout_s: float | None = None) -> None:
        """Initialise the default ``torch.distributed`` process group over Gloo for this world.

        Returns once every rank has connected (a barrier): Gloo's ``connectFullMesh`` fails with
        "Connection closed by peer" on a rank still connecting when a peer that finished first leaves
        and closes its end, as a rank with no collective to run does at once on a loaded host.
        """
        # local: torch only in a rank, once RANK_ENV is set
        import torch.distributed as dist

        dist.init_process_group(
            backend="gloo",
            init_method=self.init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s if timeout_s is not None else self.timeout_s),
        )
        dist.barrier()


class RankFailureError(AssertionError):
    """One or more ranks raised, exited non-zero or missed the deadline.

    Attributes:
        reports: per rank, ``(exit_code, detail)``; ``exit_code`` is None for a rank killed at the deadline.
    """

    def __init__(self, fn_name: str, reports: dict[int, tuple[int | None, str]]):
        self.reports = reports
        lines = [f"{fn_name}: {sum(1 for c, _ in reports.values() if c != 0)} of {len(reports)} ranks failed"]
        for rank in sorted(reports):
            code, detail = reports[rank]
            state = "ok" if code == 0 else ("killed" if code is None else f"exit code {code}")
            lines.append(f"--- rank {rank}: {state}")
            if code != 0 and detail:
                lines.append(detail.rstrip())
        super().__init__("\n".join(lines))


class LauncherInterruptedError(RuntimeError):
    """The launcher got SIGTERM or SIGHUP while ranks ran; every rank was killed first.

    Attributes:
        signal_name: ``"SIGTERM"`` or ``"SIGHUP"``.
    """

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name}; every rank was stopped")
        self.signal_name = signal_name


def _function_spec(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """(module name, file, qualname) of a module-level function, checked in the test process."""
    qualname = fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"rank function {qualname!r} must be defined at module level")
    file = inspect.getfile(fn)
    return fn.__module__, file, qualname


def load_module(file: str | os.PathLike[str]) -> ModuleType:
    """Import a plain Python file (a tests folder's rank functions) under a stable private name.

    The test process and every rank process load the same file under the same name, so functions
    from it can be handed to :func:`run_ranks`. The file's folder is put on ``sys.path`` so it can
    import its siblings.
    """
    path = os.path.realpath(file)
    alias = "_ascend_eplb_ranks_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(alias)
    if module is None:
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        file_spec = importlib.util.spec_from_file_location(alias, path)
        if file_spec is None or file_spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[alias] = module
        file_spec.loader.exec_module(module)
    return module


def _load_function(module_name: str, file: str, qualname: str) -> Callable[..., Any]:
    spec = None
    if module_name != "__main__" and not module_name.startswith("_ascend_eplb_ranks_"):
        spec = importlib.util.find_spec(module_name)
    if spec is not None and spec.origin and os.path.samefile(spec.origin, file):
        module = importlib.import_module(module_name)
    else:
        module = load_module(file)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_PR_SET_PDEATHSIG = 1


def _die_with(launcher_pid: int) -> None:
    """Make this rank process end when its parent (the fork server) or the launcher ends."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        while True:
            try:
                os.kill(launcher_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _rank_main(
    fn_spec: tuple[str, str, str],
    ctx: RankContext,
    args: tuple[Any, ...],
    result_file: str,
    launcher_pid: int,
    temporary: str,
) -> None:
    gc.freeze()  # what the fork server imported is never traversed by this rank's collections
    _die_with(launcher_pid)
    # The world's temporary folder, for this process (tempfile's cached choice, inherited from the fork
    # server) and any it starts (TMPDIR).
    os.environ["TMPDIR"] = tempfile.tempdir = temporary
    os.environ.update({k: v for k, v in RANK_ENV.items() if k not in os.environ})
    try:
        # local: after RANK_ENV: OMP_NUM_THREADS and TORCH_DEVICE_BACKEND_AUTOLOAD act at import
        import torch

        torch.set_num_threads(1)
        fn = _load_function(*fn_spec)
        result = fn(ctx, *args)
        payload: tuple[str, Any] = ("ok", result)
    except BaseException:
        payload = ("error", traceback.format_exc())
    with open(result_file, "wb") as f:
        try:
            pickle.dump(payload, f)
        except Exception:
            pickle.dump(
                ("error", f"result of rank {ctx.rank} is not picklable:\n{traceback.format_exc()}"), f
            )
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: daemon threads (vLLM's async worker) and Gloo groups of a test
    # world need no orderly shutdown, and joining them could hang.
    os._exit(0 if payload[0] == "ok" else 1)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise :class:`LauncherInterruptedError` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise LauncherInterruptedError(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _kill(procs: Sequence[Any]) -> None:
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join(5)


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tmp_path: Path,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    grace_s: float = 10.0,
    preload: Sequence[str] = (),
    on_message: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` rank processes; return ``[result of rank 0, ...]``.

    Args:
        fn: module-level function taking a :class:`RankContext` first; its result must pickle.
        world_size: 1 to 8 ranks; ``args``: pickled to every rank.
        tmp_path: a folder; the world's rendezvous file and results go in a fresh folder there.
        timeout_s: the world's deadline in seconds from this call; ``grace_s``: how long the others
            may run after a rank fails.
        preload: modules imported once in this process's fork server (``"vllm"``).
        on_message: ``on_message(rank, message)`` per :meth:`RankContext.send`, in this thread.

    Raises:
        ValueError: ``world_size`` outside ``[1, 8]``, ``timeout_s`` not a finite positive number, or
            ``fn`` not defined at module level.
        RankFailureError: any rank raised, exited non-zero or missed the deadline.
        LauncherInterruptedError: SIGTERM or SIGHUP arrived (every rank is killed first);
            ``KeyboardInterrupt`` likewise for SIGINT.
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size={world_size} must be in [1, 8]")
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s={timeout_s} must be a finite number of seconds > 0")
    spec = _function_spec(fn)
    deadline = time.monotonic() + timeout_s
    # The world's temporary folder (short: vLLM's IPC socket paths must fit AF_UNIX's 108 bytes).
    with tempfile.TemporaryDirectory(prefix="ascend-eplb-ranks-", ignore_cleanup_errors=True) as temporary:
        world_dir = Path(tmp_path) / f"world-{time.monotonic_ns()}"
        world_dir.mkdir(parents=True)
        for key, value in RANK_ENV.items():
            os.environ.setdefault(key, value)
        mp = multiprocessing.get_context("forkserver")
        if preload:
            mp.set_forkserver_preload(list(preload))
        messages = mp.Queue() if on_message is not None else None
        procs: list[Any] = []
        first_failure: float | None = None
        with signals_raise():
            try:
                for rank in range(world_size):
                    ctx = RankContext(
                        rank=rank,
                        world_size=world_size,
                        init_method=f"file://{world_dir / 'rendezvous'}",
                        tmp_dir=world_dir,
                        timeout_s=timeout_s,
                        local_rank=rank,
                        messages=messages,
                    )
                    result_file = str(world_dir / f"rank{rank}.pkl")
                    proc = mp.Process(
                        target=_rank_main,
                        args=(spec, ctx, tuple(args), result_file, os.getpid(), temporary),
                        name=f"rank{rank}",
                        daemon=True,
                    )
                    proc.start()
                    procs.append(proc)
                while True:
                    _drain(messages, on_message)
                    alive = [p for p in procs if p.exitcode is None]
                    if not alive:
                        break
                    if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                        first_failure = time.monotonic()
                    now = time.monotonic()
                    limit = deadline if first_failure is None else min(deadline, first_failure + grace_s)
                    if now >= limit:
                        break
                    poll = 0.5 if messages is None else 0.1
                    sentinels = [p.sentinel for p in alive]
                    multiprocessing.connection.wait(sentinels, timeout=min(poll, limit - now))
                _drain(messages, on_message)
            except BaseException:
                _kill(procs)
                raise
            finally:
                if messages is not None:
                    messages.close()
                    messages.cancel_join_thread()

        reports: dict[int, tuple[int | None, str]] = {}
        results: list[Any] = []
        for rank, proc in enumerate(procs):
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
                reason = "deadline" if first_failure is None else "grace period after another rank failed"
                waited = timeout_s if first_failure is None else grace_s
                reports[rank] = (None, f"still running after the {reason} ({waited:.0f} s); killed")
                results.append(None)
                continue
            proc.join()
            result_file = world_dir / f"rank{rank}.pkl"
            if not result_file.exists():
                reports[rank] = (proc.exitcode or 1, f"exited with code {proc.exitcode} without a result")
                results.append(None)
                continue
            with open(result_file, "rb") as f:
                status, value = pickle.load(f)
            if status == "ok" and proc.exitcode == 0:
                reports[rank] = (0, "")
                results.append(value)
            else:
                reports[rank] = (proc.exitcode or 1, value if status == "error" else "")
                results.append(None)
        if any(code != 0 for code, _ in reports.values()):
            raise RankFailureError(f"{spec[2]} on {world_size} ranks", reports)
        return results


def _drain(messages: Any, on_message: Callable[[int, Any], None] | None) -> None:
    if messages is None or on_message is None:
        return
    while True:
        try:
            rank, message = messages.get_nowait()
        except queue_module.Empty:
            return
        on_message(rank, message)


def reap_child(pid: int, wait_s: float) -> bool:
    """Wait at most ``wait_s`` seconds for this process's child ``pid`` to end, and reap it.

    Returns:
        True once it ended (or is not a child of this process any more), False if it still runs.
    """
    end = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def stop_fork_server(*, kill: bool = False, wait_s: float = 5.0) -> None:
    """End this process's fork server, and with it every rank it forked (``PR_SET_PDEATHSIG``).

    The fork server otherwise lives until this process exits (it sees its end of a pipe close), so a
    command that must leave no process behind when it returns calls this. ``kill``: at once with
    SIGKILL (after a failure, or while it may still be importing the preloads); otherwise it is asked to
    stop and killed if it has not within ``wait_s``. The next :func:`run_ranks` starts a fresh one.
    """
    server = forkserver._forkserver
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.close(server._forkserver_alive_fd)
        if not reap_child(pid, wait_s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        address = server._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_alive_fd = None
        server._forkserver_pid = None
        server._forkserver_address = None

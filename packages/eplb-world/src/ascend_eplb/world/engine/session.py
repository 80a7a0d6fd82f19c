"""A process of the engine world in a session of its own, and how it ends.

Both ways the world runs vLLM's engine, :class:`~.host.EngineWorld` (``vllm.LLM`` in a host process) and
:class:`~.server.ServedEngine` (``vllm serve``), start one process with the engine world's environment
(:func:`spec_environment`), its own ``TMPDIR`` (vLLM leaves its IPC sockets and file store there) and its
output in a log file of the world's folder, in a session of its own so that vLLM's engine core and workers
can be found and ended with it. :meth:`EngineProcess.close` ends it the same way for both and returns the
:class:`Shutdown` record. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ascend_eplb.world.engine.environment import cache_root, engine_environment
from ascend_eplb.world.engine.spec import EngineSpec

__all__ = [
    "EngineError",
    "EngineProcess",
    "Shutdown",
    "copy_modelinfos",
    "log_tail",
    "modelinfo_cache",
    "spec_environment",
]


class EngineError(RuntimeError):
    """An engine process failed: it did not start, a request raised, it died or missed its deadline. The
    message carries the traceback (or exit status) and the tail of its log."""


@dataclass(frozen=True)
class Shutdown:
    """How an engine process ended (:meth:`EngineProcess.close`): its exit ``status``, the ``lingering``
    processes of its session (vLLM's engine core, workers, resource tracker) still alive 10 s after it
    exited (then killed), the ``shared_memory`` segments its processes had mapped that still exist, and the
    ``scratch`` entries vLLM left in the process's own ``TMPDIR`` (removed with it)."""

    status: int | None
    lingering: tuple[str, ...]
    shared_memory: tuple[str, ...]
    scratch: tuple[str, ...]


def spec_environment(spec: EngineSpec, tmp: str | os.PathLike[str], env: Mapping[str, str]) -> dict[str, str]:
    """The environment of the process that starts ``spec``'s engine: the engine world's
    (:func:`~.environment.engine_environment`), ``TMPDIR=tmp`` and ``VLLM_CACHE_ROOT`` under it (vLLM's
    compile cache stays in the engine's scratch), the spec's own (:meth:`~.spec.EngineSpec.environment`),
    then ``env``."""
    scratch = {"TMPDIR": str(tmp), "VLLM_CACHE_ROOT": str(_vllm_cache_root(tmp))}
    return engine_environment(**{**scratch, **spec.environment(), **env})


def _vllm_cache_root(tmp: str | os.PathLike[str]) -> Path:
    """An engine's ``VLLM_CACHE_ROOT``: ``vllm`` in its ``TMPDIR`` ``tmp``."""
    return Path(tmp) / "vllm"


class EngineProcess:
    """``argv`` started in a session of its own with ``spec``'s environment (:func:`spec_environment`),
    ``TMPDIR`` ``folder/tmp`` (created), the working folder ``folder`` and its output appended to
    ``folder/log_name``."""

    def __init__(
        self,
        spec: EngineSpec,
        folder: Path,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_name: str,
    ) -> None:
        self.folder = folder
        self.tmp = folder / "tmp"
        self.log_path = folder / log_name
        self._modelinfos = _vllm_cache_root(self.tmp) / "modelinfos"  # where vLLM looks for them
        self._spec, self._argv, self._env = spec, list(argv), dict(env)
        self._process: subprocess.Popen[bytes] | None = None
        self._descendants: list[Any] = []
        self.shutdown: Shutdown | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None, "the engine process is not started"
        return self._process.pid

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        copy_modelinfos(modelinfo_cache(), self._modelinfos)
        env = spec_environment(self._spec, self.tmp, self._env)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self._argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.folder,
                start_new_session=True,
            )

    def ready(self) -> None:
        """Note the process's descendants (vLLM's engine core and workers) once its engine is built: the
        processes :meth:`close` waits for."""
        self._descendants = _descendants(self.pid)

    def check_alive(self, when: str) -> None:
        """Raise :class:`EngineError` (with the log's tail) if the process has exited."""
        assert self._process is not None
        status = self._process.poll()
        if status is not None:
            raise EngineError(f"the engine process exited with status {status} {when}{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` of the log (:func:`log_tail`)."""
        return log_tail(self.log_path, lines)

    def kill(self) -> None:
        """SIGKILL the process's whole session (vLLM's engine core and workers with it), the process
        itself exited or not: its group outlives it while a child of it lives."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, 9)
            self._process.wait()

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """While the engine starts: a failure, or a signal, inside it kills every process of the session and
        removes ``TMPDIR`` before it propagates (the caller's with-block never entered, so nothing else
        would end the session)."""
        try:
            yield
        except BaseException:
            self.kill()
            self.close(lambda: None, 10.0)
            raise

    def close(self, stop: Callable[[], None], timeout: float) -> Shutdown | None:
        """End the process: ``stop()`` asks it to shut down as vLLM does (an :class:`EngineError` from it
        kills the session), then wait ``timeout`` s for it (else kill), 10 s for every process of its
        session (then kill and name them), remove ``TMPDIR``; idempotent.

        Returns:
            the :class:`Shutdown` record (also :attr:`shutdown`); None if the process was never started.
        """
        if self._process is None or self.shutdown is not None:
            return self.shutdown
        processes = list({*_descendants(self._process.pid), *self._descendants})
        mapped = _shared_memory([*_process(self._process.pid), *processes])
        try:
            if self._process.poll() is None:
                stop()
        except EngineError:
            self.kill()
        try:
            status = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            status = self._process.wait()
        lingering = _reap(processes, 10.0)
        scratch = tuple(sorted(p.name for p in self.tmp.iterdir())) if self.tmp.is_dir() else ()
        copy_modelinfos(self._modelinfos, modelinfo_cache())
        shutil.rmtree(self.tmp, ignore_errors=True)
        left = tuple(sorted(name for name in mapped if Path(name).exists()))
        self.shutdown = Shutdown(status, lingering, left, scratch)
        return self.shutdown

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``ready()`` every 0.2 s until it is true; :class:`EngineError` naming ``what`` (the session
        killed) if the process exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.check_alive(f"while waiting for {what}")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineError(f"no {what} within {timeout:.0f} s{self.tail()}")
            time.sleep(0.2)


def modelinfo_cache() -> Path:
    """Where vLLM's model-class inspections are kept across engines (``vllm-modelinfos`` under
    :func:`~.environment.cache_root`). An engine's ``VLLM_CACHE_ROOT`` is its own scratch, where vLLM
    looks for them (``modelinfos/<module>-<class>.json``, each with its model module's source hash, which
    vLLM checks before use); without them each engine start inspects its model class in a fresh
    ``python`` that imports vLLM (the CHANGELOG has what it cost)."""
    return cache_root() / "vllm-modelinfos"


def copy_modelinfos(source: Path, target: Path) -> int:
    """Copy the regular ``*.json`` files of ``source`` into ``target`` (created), each written whole
    (a temporary file renamed over the old one, so engines closing together never read half a file);
    returns how many. A cache only: a missing or unreadable ``source`` or an unwritable ``target`` copies
    what it can and raises nothing."""
    copied = 0
    try:
        files = [p for p in source.iterdir() if p.suffix == ".json" and p.is_file() and not p.is_symlink()]
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        return 0
    for path in files:
        partial = target / f".{path.name}.{os.getpid()}.partial"
        try:
            shutil.copyfile(path, partial)
            os.replace(partial, target / path.name)
            copied += 1
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
    return copied


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` of the log at ``path``, headed by its path, for an error message ("" if
    unreadable)."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- the last lines of {path} ---\n" + "\n".join(text)


def _process(pid: int) -> list[Any]:
    try:
        return [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return []


def _descendants(pid: int) -> list[Any]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _shared_memory(processes: list[Any]) -> set[str]:
    """The ``/dev/shm`` segments ``processes`` (psutil) have mapped now."""
    out = set()
    for process in processes:
        try:
            out |= {m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/")}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _reap(processes: list[Any], timeout: float) -> tuple[str, ...]:
    """Wait up to ``timeout`` s for ``processes`` (psutil) to exit; kill those still alive and name them."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    names = []
    for process in alive:
        try:
            names.append(f"{process.pid} {process.name()}")
            process.kill()
        except psutil.NoSuchProcess:
            continue
    return tuple(sorted(names))

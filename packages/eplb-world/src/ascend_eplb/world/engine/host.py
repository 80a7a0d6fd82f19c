"""An engine of the engine world in a process of its own, and the client that drives it.

vLLM's engine must start in a process whose environment is the engine world's from its first instruction
(:mod:`.environment`); a test or a tool that has imported torch or vLLM already cannot host it. So
:class:`EngineWorld` starts ``python -m ascend_eplb.world.engine.host_main`` (:mod:`.host_main`) with that
environment, and the host builds ``vllm.LLM`` (with data parallelism vLLM's DP engine,
:mod:`.data_parallel`) from an :class:`~.spec.EngineSpec` and answers requests over a Unix socket in the
world's folder: generate (vLLM's ``LLM.generate``), run a function on every worker (vLLM's
``LLM.collective_rpc``), close (vLLM's shutdown). The host's output goes to ``engine.log`` in the folder.
This module, the client, imports no vLLM.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from ascend_eplb.world.engine.session import EngineError, EngineProcess, Shutdown
from ascend_eplb.world.engine.spec import EngineSpec

__all__ = ["Completion", "EngineError", "EngineWorld", "Shutdown"]

_SOCKET = "engine.sock"
_LOG = "engine.log"


@dataclass(frozen=True)
class Completion:
    """One request's output: the generated ``token_ids``, per generated token its ``logprobs`` (token id ->
    logprob of the top candidates vLLM returned, the chosen token among them), and vLLM's own timing of
    the request (seconds; None when vLLM kept none): ``ttft_s`` from scheduling to the first token,
    ``tpot_s`` per output token after it."""

    token_ids: tuple[int, ...]
    logprobs: tuple[Mapping[int, float], ...]
    ttft_s: float | None = None
    tpot_s: float | None = None


def _function_name(fn: Callable[..., Any]) -> str:
    name = f"{fn.__module__}:{fn.__qualname__}"
    if "<" in name or fn.__module__ == "__main__":
        raise ValueError(f"{name}: run a module-level function of an importable module on the workers")
    return name


class EngineWorld:
    """One engine host: ``with EngineWorld(spec, folder) as engine: engine.generate(...)``.

    Args:
        spec: what the engine serves.
        folder: the world's own folder (socket, log, the host's ``TMPDIR``); created.
        env: variables set in the host's environment after the engine world's (e.g. ``ASCEND_EPLB_VERIFY``).
        start_timeout: seconds for vLLM's start-up (importing vLLM in each process, loading, profiling).

    Attributes:
        pid: the host's process id (its children are vLLM's engine core and workers).
        ready: what the host reported once the engine was built (``{"seconds": start-up wall time}``).
    """

    def __init__(
        self,
        spec: EngineSpec,
        folder: str | os.PathLike[str],
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        self.spec = spec
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._env = dict(env or {})
        self._start_timeout = start_timeout
        self._host: EngineProcess | None = None
        self._conn: Connection | None = None
        self.ready: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self._host is not None, "the engine host is not started"
        return self._host.pid

    @property
    def log_path(self) -> Path:
        return self.folder / _LOG

    @property
    def shutdown(self) -> Shutdown | None:
        """The :class:`Shutdown` record once :meth:`close` ran."""
        return None if self._host is None else self._host.shutdown

    def __enter__(self) -> EngineWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the host and wait until its engine is built.

        Raises:
            EngineError: the host exited or did not report ready within ``start_timeout``.
        """
        address = str(self.folder / _SOCKET)
        authkey = secrets.token_hex(16)
        argv = [sys.executable, "-m", "ascend_eplb.world.engine.host_main", address, authkey]
        self._host = host = EngineProcess(self.spec, self.folder, argv, env=self._env, log_name=_LOG)
        host.start()
        deadline = time.monotonic() + self._start_timeout

        def connected() -> bool:
            try:  # the socket file appears at bind(), before listen(): refused until then
                self._conn = Client(address, authkey=authkey.encode())
            except (FileNotFoundError, ConnectionRefusedError):
                return False
            return True

        with host.starting():
            host.wait_until(connected, self._start_timeout, "listening engine host")
            self.ready = self._request(("start", _spec_dict(self.spec)), deadline - time.monotonic())
        host.ready()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int | Sequence[int],
        logprobs: int = 5,
        timeout: float = 600.0,
    ) -> list[Completion]:
        """Greedy completions of ``prompts`` (token ids) through vLLM's ``LLM.generate``, in order;
        ``max_tokens`` for every prompt, or one per prompt (requests that end at different steps, so that
        the scheduler admits waiting ones beside running ones)."""
        if not isinstance(max_tokens, int):
            max_tokens = [int(n) for n in max_tokens]
            if len(max_tokens) != len(prompts):
                raise ValueError(
                    f"{len(max_tokens)} max_tokens for {len(prompts)} prompts: give one per prompt"
                )
        raw = self._request(("generate", [list(p) for p in prompts], max_tokens, logprobs), timeout)
        return [Completion(tuple(ids), tuple(map(dict, lps)), ttft, tpot) for ids, lps, ttft, tpot in raw]

    def run_on_workers(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        """``fn(worker, *args)`` on every worker (vLLM's ``collective_rpc``), one result per worker in rank
        order; ``fn`` a module-level function of an importable module, ``args`` and results picklable."""
        return self._request(("rpc", _function_name(fn), args), timeout)

    def close(self, timeout: float = 120.0) -> Shutdown | None:
        """Shut the engine down as vLLM does, wait for the host and every process of its session to exit,
        then remove the host's ``TMPDIR``; idempotent (a second call returns the first's record).

        Returns:
            the :class:`Shutdown` record (also :attr:`shutdown`); None if the host was never started.
        """
        if self._host is None:
            return None

        def stop() -> None:
            try:
                if self._conn is not None:
                    self._request(("close",), timeout)
            finally:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None

        shutdown = self._host.close(stop, timeout)
        Path(self.folder / _SOCKET).unlink(missing_ok=True)
        return shutdown

    def kill(self) -> None:
        """SIGKILL the host's whole session (the host, vLLM's engine core and workers)."""
        if self._host is not None:
            self._host.kill()

    def _request(self, message: tuple[Any, ...], timeout: float) -> Any:
        if self._conn is None:
            raise EngineError("the engine host is not connected")
        self._conn.send(message)
        deadline = time.monotonic() + max(timeout, 0.0)
        while not self._conn.poll(0.2):
            self._host.check_alive(f"during {message[0]!r}")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineError(f"{message[0]!r} did not answer within {timeout:.0f} s{self._host.tail()}")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._host.check_alive(f"during {message[0]!r}")
            raise EngineError(f"the engine host closed its connection during {message[0]!r}") from None
        if status != "ok":
            raise EngineError(f"{message[0]!r} raised in the engine host:\n{value}{self._host.tail(15)}")
        return value


def _spec_dict(spec: EngineSpec) -> dict[str, Any]:
    out = asdict(spec)
    out["compilation"] = None if spec.compilation is None else dict(spec.compilation)
    return out

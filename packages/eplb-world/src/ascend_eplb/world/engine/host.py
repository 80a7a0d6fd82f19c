"""An engine of the engine world in a process of its own, and the client that drives it.

vLLM's engine must start in a process whose environment is the engine world's from its first instruction
(:mod:`.environment`); a test or a tool that has imported torch or vLLM already cannot host it. So
:class:`EngineWorld` starts ``python -m ascend_eplb.world.engine.host`` with that environment, and the host
builds ``vllm.LLM`` (with data parallelism vLLM's DP engine, :mod:`.data_parallel`) from an
:class:`~.spec.EngineSpec` and answers requests over a Unix socket in the
world's folder: generate (vLLM's ``LLM.generate``), run a function on every worker (vLLM's
``LLM.collective_rpc``), close (vLLM's shutdown). The host's output goes to ``engine.log`` in the folder.
"""

from __future__ import annotations

import importlib
import os
import secrets
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from ascend_eplb.world.engine.session import EngineError, EngineProcess, Shutdown
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

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


def _resolve(name: str) -> Callable[..., Any]:
    module, qualname = name.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


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
        argv = [sys.executable, "-m", "ascend_eplb.world.engine.host", address, authkey]
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


def _spec_of(data: dict[str, Any]) -> EngineSpec:
    eplb = data.pop("eplb")
    return EngineSpec(**data, eplb=None if eplb is None else EplbSpec(**eplb))


def _serve(conn: Connection) -> None:
    """The host's loop: build the engine on ``start``, answer until ``close``."""
    llm: Any = None
    while True:
        message = conn.recv()
        kind = message[0]
        try:
            if kind == "start":
                started = time.monotonic()
                spec = _spec_of(message[1])
                if spec.data_parallel_size > 1:
                    # local: the client side of this module runs without vLLM (world.engine)
                    from ascend_eplb.world.engine.data_parallel import DataParallelEngine

                    llm = DataParallelEngine(spec.engine_kwargs())
                else:
                    # local: the client side of this module runs without vLLM (world.engine)
                    from vllm import LLM

                    llm = LLM(**spec.engine_kwargs())
                value: Any = {"seconds": time.monotonic() - started}
            elif kind == "generate":
                _, prompts, max_tokens, logprobs = message
                value = _generate(llm, prompts, max_tokens, logprobs)
            elif kind == "rpc":
                _, name, args = message
                value = llm.collective_rpc(_resolve(name), args=tuple(args))
            elif kind == "close":
                if hasattr(llm, "llm_engine"):  # vllm.LLM
                    llm.llm_engine.engine_core.shutdown()
                elif llm is not None:  # DataParallelEngine
                    llm.shutdown()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown request {kind!r}")
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            if kind == "start":
                return
            continue
        conn.send(("ok", value))


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int | list[int], logprobs: int) -> list[Any]:
    # local: the client side of this module runs without vLLM (world.engine)
    from vllm import SamplingParams

    def params_of(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, logprobs=logprobs, ignore_eos=True)

    params = params_of(max_tokens) if isinstance(max_tokens, int) else [params_of(n) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            list(out.outputs[0].token_ids),
            [{int(t): float(lp.logprob) for t, lp in step.items()} for step in out.outputs[0].logprobs],
            *_timing(out.metrics),
        )
        for out in outputs
    ]


def _timing(stats: Any) -> tuple[float | None, float | None]:
    """(time to first token, time per output token) of vLLM's ``RequestStateStats``, in seconds."""
    if stats is None or not stats.first_token_ts:
        return None, None
    ttft = stats.first_token_ts - stats.scheduled_ts
    n = stats.num_generation_tokens
    return ttft, (stats.last_token_ts - stats.first_token_ts) / (n - 1) if n > 1 else None


def main(argv: Sequence[str]) -> int:
    """``python -m ascend_eplb.world.engine.host ADDRESS AUTHKEY``: listen, serve one client, exit."""
    address, authkey = argv
    with Listener(address, family="AF_UNIX", authkey=authkey.encode()) as listener, listener.accept() as conn:
        _serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

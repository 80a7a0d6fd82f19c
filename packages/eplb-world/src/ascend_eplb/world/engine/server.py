"""An engine of the engine world served by vLLM's own API server, and vLLM's own client against it.

:class:`ServedEngine` runs ``vllm serve`` (``python -m vllm.entrypoints.cli.main serve``) with an
:class:`~.spec.EngineSpec`'s flags (:meth:`~.spec.EngineSpec.serve_argv`) on 127.0.0.1 at a free port, in
an :class:`~.session.EngineProcess` (the engine world's environment, its own ``TMPDIR``, its own session;
log ``serve.log``), and waits for ``/health``. vLLM's and the project's Prometheus series go through
``PROMETHEUS_MULTIPROC_DIR`` (a fresh folder of the world's; ``ASCEND_EPLB_METRICS=1`` with EPLB on).
:meth:`ServedEngine.complete` asks the OpenAI completions API for greedy token ids,
:meth:`ServedEngine.bench` runs ``vllm bench serve`` against it; :meth:`ServedEngine.close` ends it with
SIGTERM (vLLM's graceful shutdown) and returns the :class:`~.session.Shutdown` record.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ascend_eplb.world.engine.session import EngineError, EngineProcess, Shutdown, log_tail
from ascend_eplb.world.engine.spec import EngineSpec

__all__ = ["ServedEngine", "free_port"]

_LOG = "serve.log"
_HOST = "127.0.0.1"
_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the kernel's pick for port 0, as vLLM's ``get_open_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


class ServedEngine:
    """``with ServedEngine(spec, folder, served_model_name="tiny") as server: server.complete(...)``.

    Args:
        spec: what the engine serves.
        folder: the world's own folder (log, ``TMPDIR``, the Prometheus folder); created.
        served_model_name: vLLM's ``--served-model-name`` (the API's ``model`` and the ``model_name``
            label of the metrics); None: vLLM's default, the model folder.
        env: variables set in the server's environment after the engine world's (e.g. ``ASCEND_EPLB_EVENTS``).
        start_timeout: seconds until ``/health`` answers 200 (importing vLLM, loading, profiling).

    Attributes:
        url: ``http://127.0.0.1:PORT`` once started.
        ready_s: seconds from the start until ``/health`` answered.
    """

    def __init__(
        self,
        spec: EngineSpec,
        folder: str | os.PathLike[str],
        *,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        self.spec = spec
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.served_model_name = served_model_name or spec.model
        self._served_flag = served_model_name
        self._env = dict(env or {})
        self._start_timeout = start_timeout
        self._server: EngineProcess | None = None
        self.url = ""
        self.ready_s = 0.0

    @property
    def prometheus_folder(self) -> Path:
        return self.folder / "prometheus"

    @property
    def log_path(self) -> Path:
        return self.folder / _LOG

    @property
    def pid(self) -> int:
        assert self._server is not None, "the server is not started"
        return self._server.pid

    @property
    def shutdown(self) -> Shutdown | None:
        """The :class:`Shutdown` record once :meth:`close` ran."""
        return None if self._server is None else self._server.shutdown

    def __enter__(self) -> ServedEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start ``vllm serve`` and wait until ``/health`` answers 200.

        Raises:
            EngineError: the server exited or did not answer within ``start_timeout`` (its session killed).
        """
        port = free_port()
        argv = [*_CLI, "serve", *self.spec.serve_argv(), "--host", _HOST, "--port", str(port)]
        if self._served_flag is not None:
            argv += ["--served-model-name", self._served_flag]
        # prometheus_client's multiprocess folder must be empty at the start, or counters add up.
        shutil.rmtree(self.prometheus_folder, ignore_errors=True)
        self.prometheus_folder.mkdir()
        env = {"PROMETHEUS_MULTIPROC_DIR": str(self.prometheus_folder), **self._env}
        if self.spec.eplb is not None:
            env.setdefault("ASCEND_EPLB_METRICS", "1")
        self.url = f"http://{_HOST}:{port}"
        self._server = server = EngineProcess(self.spec, self.folder, argv, env=env, log_name=_LOG)
        started = time.monotonic()
        server.start()
        with server.starting():
            server.wait_until(self._healthy, self._start_timeout, f"200 from {self.url}/health")
        self.ready_s = time.monotonic() - started
        server.ready()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def get(self, path: str, timeout: float = 30.0) -> str:
        """The body of ``GET path`` (e.g. ``/metrics``), as text.

        Raises:
            EngineError: the server answered an error status or did not answer.
        """
        return self._call(urllib.request.Request(self.url + path), timeout)

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 300.0) -> Any:
        """``POST path`` with ``body`` as JSON; the answer's JSON.

        Raises:
            EngineError: the server answered an error status (its body in the message) or did not answer.
        """
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        return json.loads(self._call(request, timeout))

    def _call(self, request: urllib.request.Request, timeout: float) -> str:
        assert self._server is not None, "the server is not started"
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read().decode()
        except urllib.error.HTTPError as e:
            raise EngineError(
                f"{request.full_url}: HTTP {e.code}: {e.read().decode(errors='replace')}"
            ) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            self._server.check_alive(f"during {request.full_url}")
            raise EngineError(f"{request.full_url}: {e}{self._server.tail(15)}") from None

    def complete(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[tuple[int, ...]]:
        """Greedy completions of ``prompts`` (token ids) through the OpenAI completions API (temperature 0,
        ``ignore_eos``, vLLM's ``return_token_ids``), one request for all: the generated ids, in order."""
        answer = self.post(
            "/v1/completions",
            {
                "model": self.served_model_name,
                "prompt": [list(p) for p in prompts],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        return [tuple(c["token_ids"]) for c in choices]

    def bench(
        self,
        result: str | os.PathLike[str],
        *,
        num_prompts: int,
        input_len: int,
        output_len: int,
        max_concurrency: int,
        seed: int = 0,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Run vLLM's own client, ``vllm bench serve --backend vllm --dataset-name random`` (every request
        ``--ignore-eos``, the checkpoint folder's tokenizer), against this server; its ``--save-result
        --save-detailed`` JSON, written to ``result`` (its output beside it, ``.log``), parsed.

        Raises:
            EngineError: the client exited non-zero or ran past ``timeout`` (the log's tail in the message).
        """
        result = Path(result)
        argv = [
            *_CLI, "bench", "serve", "--backend", "vllm", "--base-url", self.url,
            "--model", self.spec.model, "--served-model-name", self.served_model_name,
            "--tokenizer", self.spec.model, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(max_concurrency),
            "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent),
            "--result-filename", result.name,
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        log = result.with_suffix(".log")
        with open(log, "wb") as out:
            try:
                status = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise EngineError(f"vllm bench serve ran past {timeout:.0f} s{log_tail(log)}") from None
        if status.returncode != 0:
            raise EngineError(f"vllm bench serve exited with status {status.returncode}{log_tail(log)}")
        return json.loads(result.read_text())

    def close(self, timeout: float = 120.0) -> Shutdown | None:
        """SIGTERM the server (vLLM's graceful shutdown of the API server, engine core and workers), wait
        for every process of its session, remove its ``TMPDIR`` and Prometheus folder; idempotent.

        Returns:
            the :class:`Shutdown` record (also :attr:`shutdown`); None if the server was never started.
        """
        if self._server is None:
            return None
        server = self._server

        def terminate() -> None:
            with contextlib.suppress(ProcessLookupError):  # it exited since close looked
                os.kill(server.pid, signal.SIGTERM)

        shutdown = server.close(terminate, timeout)
        shutil.rmtree(self.prometheus_folder, ignore_errors=True)
        return shutdown

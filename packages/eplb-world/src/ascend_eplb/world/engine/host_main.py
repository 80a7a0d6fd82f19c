"""The engine host's process: ``python -m ascend_eplb.world.engine.host_main ADDRESS AUTHKEY``.

:class:`~.host.EngineWorld` starts it with the engine world's environment (:mod:`.environment`), so it
imports vLLM at the top. It listens on the Unix socket ``ADDRESS``, serves one client and exits: ``start``
builds ``vllm.LLM`` (with data parallelism vLLM's DP engine, :mod:`.data_parallel`) from the
:class:`~.spec.EngineSpec` sent; ``generate`` (vLLM's ``LLM.generate``), ``rpc`` (a function named
``module:qualname`` on every worker, vLLM's ``LLM.collective_rpc``) and ``close`` (vLLM's shutdown) answer
``("ok", value)`` or ``("error", traceback)``. vLLM's CPU platform spawns its engine core and workers,
which import this module again (as ``__mp_main__``, as any script of vLLM's ``LLM``): nothing runs outside
:func:`main`.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Listener
from typing import Any

from vllm import LLM, SamplingParams

from ascend_eplb.world.engine.data_parallel import DataParallelEngine
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

__all__ = ["main"]


def _resolve(name: str) -> Callable[..., Any]:
    module, qualname = name.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


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
                    llm = DataParallelEngine(spec.engine_kwargs())
                else:
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
    def params_of(n: int) -> SamplingParams:
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
    """Listen on ``argv``'s ``ADDRESS`` (a Unix socket) with ``AUTHKEY``, serve one client, exit."""
    address, authkey = argv
    with Listener(address, family="AF_UNIX", authkey=authkey.encode()) as listener, listener.accept() as conn:
        _serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

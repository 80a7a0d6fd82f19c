"""vLLM's own data-parallel engine in the engine host: ``AsyncLLM`` with ``data_parallel_size`` D > 1.

``vllm.LLM`` refuses D > 1 in one process (vLLM 0.33.0 points to its multi-process example); vLLM's DP
engine is the one ``vllm serve`` runs: ``AsyncLLM`` starts a DP coordinator and one engine core per DP rank
(each with its TP workers), balances requests across them, and runs a dummy batch on a rank that has none
while another serves (every forward meets the others in the EP collectives). :class:`DataParallelEngine`
is that engine behind the calls the host makes of ``vllm.LLM`` (``generate``, ``collective_rpc``,
``shutdown``), driven on an event loop of its own. Imported by the engine host alone (:mod:`.host_main`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["DataParallelEngine"]


class DataParallelEngine:
    """``AsyncLLM(**kwargs)`` (``vllm.LLM``'s keyword arguments, ``data_parallel_size`` > 1), synchronously.

    Raises:
        ValueError: ``data_parallel_size`` is not above 1 (a single engine is ``vllm.LLM``'s).
    """

    def __init__(self, kwargs: Mapping[str, Any]) -> None:
        if int(kwargs.get("data_parallel_size", 1)) <= 1:
            raise ValueError(
                f"data_parallel_size={kwargs.get('data_parallel_size', 1)}: a single engine is vllm.LLM's"
            )
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count()
        args = AsyncEngineArgs(**kwargs)
        self.engine = self._loop.run_until_complete(_call(AsyncLLM.from_engine_args, args))

    def generate(
        self, prompts: Sequence[Mapping[str, Any]], params: Any, use_tqdm: bool = False
    ) -> list[Any]:
        """Each prompt (``{"prompt_token_ids": ...}``) through the DP engine at once (vLLM's balancer picks
        each request's DP rank); the final ``RequestOutput`` of each, in order."""
        return self._loop.run_until_complete(self._all(prompts, params))

    async def _all(self, prompts: Sequence[Mapping[str, Any]], params: Any) -> list[Any]:
        return list(await asyncio.gather(*(self._one(p, params) for p in prompts)))

    async def _one(self, prompt: Mapping[str, Any], params: Any) -> Any:
        final = None
        async for output in self.engine.generate(dict(prompt), params, request_id=f"dp-{next(self._ids)}"):
            final = output
        return final

    def collective_rpc(self, method: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Any]:
        """``method(worker, *args)`` on every worker of every DP rank: one result per worker, DP rank-major
        (vLLM's ``collective_rpc`` of a DP client answers with the first DP rank's workers only)."""
        core = self.engine.engine_core
        per_rank = self._loop.run_until_complete(
            core.call_utility_all_async("collective_rpc", method, None, args, None)
        )
        return [result for rank in per_rank for result in rank]

    def shutdown(self) -> None:
        """vLLM's shutdown of the engine cores and the coordinator, then the loop's."""
        self.engine.shutdown()
        self._loop.close()


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` inside the loop (``AsyncLLM`` binds its output handler to the running loop)."""
    return fn(*args)

"""A compiled world's models: their TorchDynamo graphs, observed as vLLM compiles them.

Under vLLM's ``DYNAMO_TRACE_ONCE`` (what its CPU platform makes of ``VLLM_COMPILE``) a model is traced
once, at its first forward, and every guard is dropped. :func:`observe_compilation` makes the models
built under one ``VllmConfig`` compile with dataplane's
:class:`~ascend_eplb.dataplane.graphs.GraphObserver` (the ``eager`` backend with a record of each
graph's inputs by source), so that the world can check after every step that each tensor the trace
reads from the model kept its storage (:meth:`~ascend_eplb.dataplane.graphs.TracedGraph.moved`: the
graph-replay contract). With the ``eager`` backend the observer changes nothing of what runs.
This module imports vLLM inside its functions only.
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_eplb.dataplane.graphs import GraphObserver

__all__ = ["compiled_module", "dynamo_counters", "observe_compilation"]


def observe_compilation(vllm_config: Any) -> GraphObserver:
    """Make the models built under ``vllm_config`` compile with a ``GraphObserver`` and return it.

    Replaces ``init_backend`` on this ``CompilationConfig`` instance (upstream's method of the class is
    untouched; a row of ``ascend_eplb.world.upstream.INSTANCE_BINDINGS``): it returns the observer
    where upstream returns ``"eager"``.

    Raises:
        ValueError: the configuration does not compile with the ``eager`` backend (an inductor graph is
            compiled from options only the ``"inductor"`` name carries; not observed).
    """
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if compilation.mode != CompilationMode.DYNAMO_TRACE_ONCE or compilation.backend != "eager":
        raise ValueError(
            f"observe_compilation: mode {compilation.mode} backend {compilation.backend!r}; only "
            "DYNAMO_TRACE_ONCE with the eager backend is observed"
        )
    observer = GraphObserver()
    upstream_init_backend = type(compilation).init_backend

    def init_backend(
        vllm_config: Any, prefix: str = "", is_encoder: bool = False, use_aot_compile: bool = True
    ) -> Any:
        backend = upstream_init_backend(
            compilation, vllm_config, prefix=prefix, is_encoder=is_encoder, use_aot_compile=use_aot_compile
        )
        if backend != "eager":
            raise RuntimeError(f"observe_compilation: upstream chose backend {backend!r}, not 'eager'")
        return observer

    object.__setattr__(compilation, "init_backend", init_backend)
    return observer


def compiled_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module of ``model`` vLLM compiles (the one its ``support_torch_compile`` decorated).

    Raises:
        RuntimeError: none, or more than one.
    """
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    found = [
        m
        for m in model.modules()
        if isinstance(m, TorchCompileWithNoGuardsWrapper) and not getattr(m, "do_not_compile", False)
    ]
    if len(found) != 1:
        raise RuntimeError(f"{type(model).__name__}: {len(found)} compiled modules, expected one")
    return found[0]


def dynamo_counters() -> dict[str, Any]:
    """TorchDynamo's counters of this process: ``unique_graphs`` (graphs compiled) and
    ``graph_breaks`` (reason -> count; empty when none)."""
    # TorchDynamo is imported when counted: importing it creates torch's compile cache, before
    # `ascend-eplb` (whose option parser imports this module) gives that cache a scratch folder.
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": dict(counters["graph_break"]),
    }

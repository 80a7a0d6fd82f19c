"""A compiled world's TorchDynamo graphs: what the one trace of a model reads, and whether it still holds.

Under vLLM's ``DYNAMO_TRACE_ONCE`` (what its CPU platform makes of ``VLLM_COMPILE``) a model is traced
once, at its first forward, and every guard is dropped: each later forward runs the traced graph on the
tensors at the paths the trace read them from (the compiled bytecode loads them again by path), with
every Python value it read frozen. A CUDA or ACL graph replay goes further and reads the very storage
it captured. So everything EPLB changes between forwards must be a tensor the graph reads, written in
place: the graph-replay contract.

:class:`GraphObserver` is the ``eager`` backend with a record: for every graph TorchDynamo hands it, the
source of each graph input (``L['self']._modules['layers']...``: where the compiled code loads it from)
and the storage it had (``data_ptr``, shape, stride), and the ops the graph calls.
:meth:`TracedGraph.moved` evaluates those sources again on the live model and names every input of the
model's state (sources rooted at the compiled module or at a module global; the forward's own
arguments excluded) whose storage is not the traced one: a tensor replaced instead of written in place,
which a graph replay would read stale. No list of tensors is kept by hand, so a new one cannot be
missed.

The observer is installed on one ``VllmConfig`` (:func:`observe_compilation`) before the model is built
(vLLM's compile wrapper takes its backend at construction); with the ``eager`` backend it changes
nothing of what runs (TorchDynamo's ``eager`` backend also returns the graph module's ``forward``).
This module imports vLLM inside its functions only.
"""

from __future__ import annotations

import collections
import types
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "GraphInput",
    "GraphObserver",
    "TracedGraph",
    "compiled_module",
    "dynamo_counters",
    "observe_compilation",
]


@dataclass(frozen=True)
class GraphInput:
    """One tensor input of a traced graph.

    Attributes:
        source: TorchDynamo's source of it (``L['self']...`` an attribute path of the compiled module,
            ``G['...']`` a module global, ``L['<argument>']`` a forward argument).
        storage: ``(data_ptr, shape, stride)`` when traced.
    """

    source: str
    storage: tuple[int, tuple[int, ...], tuple[int, ...]]

    @property
    def is_argument(self) -> bool:
        """Whether it is one of the forward's own arguments (new every forward, not model state)."""
        return self.source.startswith("L[") and not self.source.startswith("L['self']")


def _storage(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return (t.data_ptr(), tuple(int(n) for n in t.shape), tuple(int(n) for n in t.stride()))


def _source_name(source: Any) -> str:
    name = source.name
    return name if isinstance(name, str) else name()


def _target_name(target: Any) -> str:
    return str(target) if not isinstance(target, types.BuiltinFunctionType) else target.__name__


@dataclass
class TracedGraph:
    """What one TorchDynamo graph reads.

    Attributes:
        inputs: every tensor input, in the graph's order.
        ops: how often the graph calls each function (``call_function`` targets by name, e.g.
            ``ascend_eplb.map_to_physical_and_record.default``).
    """

    inputs: list[GraphInput] = field(default_factory=list)
    ops: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def state(self) -> list[GraphInput]:
        """The inputs that are model state (not the forward's arguments)."""
        return [i for i in self.inputs if not i.is_argument]

    def moved(self, module: torch.nn.Module) -> list[str]:
        """The state inputs whose tensor at their source, on the live ``module`` (the compiled module the
        graph was traced from), has another storage than when traced, each as ``"source: traced ->
        now"``; a source that no longer resolves to a tensor is named too.
        """
        scope = {"L": {"self": module}, "G": type(module).forward.__globals__}
        out = []
        for graph_input in self.state:
            try:
                now = eval(graph_input.source, {"__builtins__": {}}, scope)
            except Exception as exc:  # a path that no longer exists: named, never skipped
                out.append(f"{graph_input.source}: no longer resolves ({type(exc).__name__}: {exc})")
                continue
            if not isinstance(now, torch.Tensor):
                out.append(f"{graph_input.source}: now {type(now).__name__}, not a tensor")
            elif _storage(now) != graph_input.storage:
                out.append(f"{graph_input.source}: {graph_input.storage} -> {_storage(now)}")
        return out


class GraphObserver:
    """The ``eager`` backend, recording each graph it is given (:class:`TracedGraph`) in :attr:`graphs`."""

    def __init__(self) -> None:
        self.graphs: list[TracedGraph] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graph = TracedGraph()
        for node in gm.graph.find_nodes(op="placeholder"):
            arg = node.meta.get("grapharg")
            example = getattr(arg, "example", None)
            if isinstance(example, torch.Tensor):
                graph.inputs.append(GraphInput(_source_name(arg.source), _storage(example)))
        for node in gm.graph.nodes:
            if node.op == "call_function":
                graph.ops[_target_name(node.target)] += 1
        self.graphs.append(graph)
        return gm.forward


def observe_compilation(vllm_config: Any) -> GraphObserver:
    """Make the models built under ``vllm_config`` compile with a :class:`GraphObserver` and return it.

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
    ):
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
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": dict(counters["graph_break"]),
    }

"""What a TorchDynamo trace reads, and whether each tensor it reads still holds the traced storage.

A forward traced once with its guards dropped (vLLM's ``DYNAMO_TRACE_ONCE``) or a graph replay reads
each tensor from the path, or storage, it was traced from; so every tensor EPLB changes between forwards
must be one the graph reads, written in place (README, "graph-replay contract"). :class:`GraphObserver`
(TorchDynamo's ``eager`` backend) records each graph's tensor inputs by source with their storage and
its ops; :meth:`TracedGraph.moved` names the module-state inputs whose storage changed since;
:func:`trace_once` compiles as ``DYNAMO_TRACE_ONCE`` does, with an observer.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["GraphInput", "GraphObserver", "TracedGraph", "trace_once"]

# torch 2.10 named the filter that drops every guard; before it (this plane's floor, 2.9.1) the same
# filter is written out, as vLLM writes it (vllm-project/vllm#37219).
_SKIP_ALL_GUARDS: Callable[[list[Any]], list[bool]] = getattr(
    torch.compiler, "skip_all_guards_unsafe", lambda guard_entries: [False] * len(guard_entries)
)


@dataclass(frozen=True)
class GraphInput:
    """One tensor input of a traced graph.

    Attributes:
        source: TorchDynamo's source of it (``L['self']...`` an attribute path of the traced method's
            ``self``, ``G['...']`` a global of its module, ``L['<argument>']`` an argument).
        storage: ``(data_ptr, shape, stride)`` when traced.
    """

    source: str
    storage: tuple[int, tuple[int, ...], tuple[int, ...]]

    @property
    def is_argument(self) -> bool:
        """Whether it is one of the traced function's own arguments (new every call, not state)."""
        return self.source.startswith("L[") and not self.source.startswith("L['self']")


def _storage(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return (t.data_ptr(), tuple(int(n) for n in t.shape), tuple(int(n) for n in t.stride()))


def _source_name(source: Any) -> str:
    name = source.name
    return name if isinstance(name, str) else name()


def _target_name(target: Any) -> str:
    return target.__name__ if isinstance(target, types.BuiltinFunctionType) else str(target)


@dataclass
class TracedGraph:
    """What one TorchDynamo graph reads.

    Attributes:
        inputs: every tensor input, in the graph's order.
        ops: how often the graph calls each function (``call_function`` targets by name, e.g.
            ``ascend_eplb.map_to_physical_and_record`` for the op packet).
    """

    inputs: list[GraphInput] = field(default_factory=list)
    ops: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def state(self) -> list[GraphInput]:
        """The inputs that are state (not the traced function's arguments)."""
        return [i for i in self.inputs if not i.is_argument]

    def moved(self, locals_: Mapping[str, Any], globals_: Mapping[str, Any]) -> list[str]:
        """The state inputs whose tensor at their source now has another storage than when traced, each
        as ``"source: traced -> now"`` (a source that no longer resolves to a tensor is named too).

        Args:
            locals_: the traced frame's locals the sources start from (``{"self": module}``).
            globals_: its globals (the traced function's ``__globals__``).
        """
        scope = {"L": dict(locals_), "G": globals_}
        out = []
        for graph_input in self.state:
            try:  # TorchDynamo's Python text of a path, e.g. list.__getitem__(L['self'].x, 0)
                now = eval(graph_input.source, {}, scope)
            except Exception as exc:  # a path that no longer exists: named, never skipped
                out.append(f"{graph_input.source}: no longer resolves ({type(exc).__name__}: {exc})")
                continue
            if not isinstance(now, torch.Tensor):
                out.append(f"{graph_input.source}: now {type(now).__name__}, not a tensor")
            elif _storage(now) != graph_input.storage:
                out.append(f"{graph_input.source}: {graph_input.storage} -> {_storage(now)}")
        return out


class GraphObserver:
    """TorchDynamo's ``eager`` backend (the graph module's ``forward`` runs), recording each graph it is
    given as a :class:`TracedGraph` in :attr:`graphs`."""

    def __init__(self) -> None:
        self.graphs: list[TracedGraph] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graph = TracedGraph()
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                arg = node.meta.get("grapharg")
                example = getattr(arg, "example", None)
                if isinstance(example, torch.Tensor):
                    graph.inputs.append(GraphInput(_source_name(arg.source), _storage(example)))
            elif node.op == "call_function":
                graph.ops[_target_name(node.target)] += 1
        self.graphs.append(graph)
        return gm.forward


def trace_once(fn: Callable[..., Any], *, dynamic: bool = False) -> tuple[Callable[..., Any], GraphObserver]:
    """``fn`` compiled as vLLM's ``DYNAMO_TRACE_ONCE`` compiles a model (``torch.compile`` with
    ``fullgraph=True`` and every guard dropped: traced at its first call, never again), with a
    :class:`GraphObserver` as the backend; returns ``(compiled, observer)``. ``dynamic``: every size
    symbolic (vLLM marks the token dimension so; without it later calls must keep the traced shapes).
    TorchDynamo caches by code object: functions sharing one (a method of several instances, a lambda
    made per case) are traced once each only after ``torch._dynamo.reset()`` (what vLLM does per model
    by removing the cache entry; 8 traces of one code object are TorchDynamo's limit)."""
    observer = GraphObserver()
    compiled = torch.compile(
        fn,
        fullgraph=True,
        dynamic=dynamic,
        backend=observer,
        options={"guard_filter_fn": _SKIP_ALL_GUARDS},
    )
    return compiled, observer

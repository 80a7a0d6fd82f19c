"""The graph-replay contract under a trace whose guards are dropped (vLLM's DYNAMO_TRACE_ONCE).

A bound router traced once by :func:`trace_once` keeps following the lookup, the record flag and the
unpadded count when they are written in place; a Python value the trace read stays frozen; a tensor
replaced instead of written in place is named by :meth:`TracedGraph.moved`, from the graph's own inputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ascend_eplb.dataplane import ReplicaLookup, bind_router, map_to_physical, trace_once

E, P, K = 8, 12, 2


class Router(torch.nn.Module):
    """The upstream router's shape: selection, then ``_apply_eplb_mapping(topk_ids)``."""

    def __init__(self) -> None:
        super().__init__()
        gate = torch.randn(E, 16, generator=torch.Generator().manual_seed(0))
        self.gate = torch.nn.Parameter(gate, requires_grad=False)
        self.eplb_state = None
        self.scale = 1.0  # a Python value the forward reads

    def _apply_eplb_mapping(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return topk_ids

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(torch.softmax(x @ self.gate.T, dim=-1) * self.scale, K)
        return weights, self._apply_eplb_mapping(ids)


def _placement(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A logical -> physical map (E, 2) with the 4 redundant slots on random experts, and its counts."""
    gen = torch.Generator().manual_seed(seed)
    l2p = torch.full((E, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.randperm(E, generator=gen)
    hot = torch.randperm(E, generator=gen)[: P - E]
    l2p[hot, 1] = torch.arange(E, P)
    return l2p, 1 + (l2p[:, 1] >= 0).to(torch.int64)


def _state() -> SimpleNamespace:
    lookup = ReplicaLookup(E, "cpu", rows=16, num_physical_experts=P)
    lookup.refresh_(*_placement(0))
    return SimpleNamespace(
        replica_lookup=lookup,
        expert_load_view=torch.zeros(P, dtype=torch.int32),
        should_record_tensor=torch.tensor(True),
        num_unpadded_tokens_tensors=[torch.tensor(10, dtype=torch.int32)],
        row_layout=torch.tensor([0, 1, 0, 0]),
    )


def test_a_trace_once_follows_every_in_place_write_and_freezes_python_values():
    router, state = Router(), _state()
    bind_router(router, state)
    compiled, observer = trace_once(router.forward)
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    _, physical = compiled(x)
    logical = torch.topk(torch.softmax(x @ router.gate.T, dim=-1), K).indices
    assert torch.equal(physical, map_to_physical(logical, state.replica_lookup.table))
    assert int(state.expert_load_view.sum()) == 10 * K
    (graph,) = observer.graphs
    assert graph.ops["ascend_eplb.map_to_physical_and_record"] == 1
    sources = [i.source for i in graph.state]
    for name in (
        "L['self']._parameters['gate']",
        "L['self'].eplb_state.replica_lookup.table",
        "L['self'].eplb_state.expert_load_view",
        "L['self'].eplb_state.should_record_tensor",
        "L['self'].eplb_state.num_unpadded_tokens_tensors[0]",
        "L['self'].eplb_state.row_layout",
    ):
        assert name in sources
    assert [i.source for i in graph.inputs if i.is_argument] == ["L['x']"]

    # Written in place between calls: the next call reads the new values; nothing moved.
    for seed, unpadded, record in ((1, 4, True), (2, 10, False), (3, 7, True)):
        state.replica_lookup.refresh_(*_placement(seed))
        state.num_unpadded_tokens_tensors[0].fill_(unpadded)
        state.should_record_tensor.fill_(record)
        state.expert_load_view.zero_()
        _, physical = compiled(x)
        assert torch.equal(physical, map_to_physical(logical, state.replica_lookup.table))
        assert int(state.expert_load_view.sum()) == (unpadded * K if record else 0)
        assert graph.moved({"self": router}, Router.forward.__globals__) == []
    assert len(observer.graphs) == 1  # never traced again

    # A Python value the trace read is frozen: the scale of the trace stays (a device scalar would not).
    router.scale = 0.0
    weights, _ = compiled(x)
    assert float(weights.abs().sum()) > 0

    # A tensor replaced instead of written in place: the compiled code loads it again by path here,
    # but a captured graph would read the old storage; moved() names it, from the graph's inputs.
    state.expert_load_view = torch.zeros(P, dtype=torch.int32)
    moved = graph.moved({"self": router}, Router.forward.__globals__)
    assert len(moved) == 1
    assert moved[0].startswith("L['self'].eplb_state.expert_load_view: (")
    state.row_layout = None
    assert graph.moved({"self": router}, Router.forward.__globals__)[1] == (
        "L['self'].eplb_state.row_layout: now NoneType, not a tensor"
    )

"""torch.compile(fullgraph=True, dynamic=True) over the ops and a bound router: one graph, eager-equal.

``fullgraph=True`` fails on any graph break, so a host synchronisation (``.item()``, ``.tolist()``,
a data-dependent branch) in the traced path would fail these tests; the ops' fake implementations
are what the compiler traces.
"""

import torch
from torch._inductor.compile_fx import compile_fx

from ascend_eplb.dataplane import ReplicaLookup, bind_router, map_to_physical, map_to_physical_and_record


class CountingInductor:
    """Inductor, counting how many graphs it was asked to compile."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return compile_fx(gm, example_inputs)


def _lookup() -> ReplicaLookup:
    # 16 logical experts, 20 physical: experts 0..3 have a second replica in slots 16..19.
    l2p = torch.full((16, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.arange(16)
    l2p[:4, 1] = torch.arange(16, 20)
    count = torch.tensor([2] * 4 + [1] * 12)
    lookup = ReplicaLookup(16, "cpu", rows=64, num_physical_experts=20)
    lookup.refresh_(l2p, count)
    return lookup


def _step(ids, table, load, record_enabled, num_unpadded):
    physical = map_to_physical_and_record(ids, table, load, record_enabled, num_unpadded)
    local = physical - 10  # followed by ordinary ops that inductor fuses
    return torch.where(local >= 0, local, -1), map_to_physical(ids, table)


def test_compiled_map_and_record_matches_eager_with_one_graph():
    lookup = _lookup()
    backend = CountingInductor()
    compiled = torch.compile(_step, backend=backend, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    cases = [  # (T, unpadded, record) - T crosses the table's 64 rows; ids include invalid ones
        (6, 4, True),
        (6, 4, False),
        (150, 150, True),
        (150, 77, True),
        (150, 77, False),
        (1000, 3, True),
    ]
    for num_tokens, num_unpadded, record in cases:
        ids = torch.randint(-2, 18, (num_tokens, 4), generator=gen, dtype=torch.int32)
        flag = torch.tensor(record)
        count = torch.tensor(num_unpadded, dtype=torch.int32)
        eager_load = torch.arange(20, dtype=torch.int32)
        compiled_load = eager_load.clone()
        eager = _step(ids, lookup.table, eager_load, flag, count)
        got = compiled(ids, lookup.table, compiled_load, flag, count)
        assert torch.equal(got[0], eager[0])
        assert torch.equal(got[1], eager[1])
        assert torch.equal(compiled_load, eager_load)
        recorded = int((compiled_load - torch.arange(20)).sum())
        valid = ((ids[:num_unpadded] >= 0) & (ids[:num_unpadded] < 16)).sum()
        assert recorded == (int(valid) if record else 0)
    assert backend.graphs == 1


class Router:
    def __init__(self, top_k):
        self.top_k = top_k
        self.eplb_state = None

    def _apply_eplb_mapping(self, topk_ids):
        return topk_ids

    def select_experts(self, router_logits):
        return self._apply_eplb_mapping(torch.topk(router_logits, self.top_k, dim=-1).indices)


class LayerState:
    def __init__(self, lookup):
        self.replica_lookup = lookup
        self.expert_load_view = torch.zeros(20, dtype=torch.int32)
        self.should_record_tensor = torch.tensor(True)
        self.num_unpadded_tokens_tensors = [torch.tensor(0, dtype=torch.int32)]
        self.row_layout = torch.tensor([0, 1, 0, 0])


def test_compiled_bound_router_sees_refreshes_without_recompiling():
    lookup = _lookup()
    state = LayerState(lookup)
    router = Router(3)
    bind_router(router, state)
    backend = CountingInductor()
    compiled = torch.compile(router.select_experts, backend=backend, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 16, generator=gen)
    logical = torch.topk(logits, 3, dim=-1).indices
    state.num_unpadded_tokens_tensors[0].fill_(30)
    assert torch.equal(compiled(logits), map_to_physical(logical, lookup.table))
    assert int(state.expert_load_view.sum()) == 30 * 3
    # A new placement committed in place: the compiled graph reads it without recompiling.
    l2p = torch.full((16, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.arange(15, -1, -1)
    l2p[15, 1] = 19
    lookup.refresh_(l2p, torch.tensor([1] * 15 + [2]))
    state.should_record_tensor.fill_(False)
    state.num_unpadded_tokens_tensors[0].fill_(12)
    logits = torch.randn(25, 16, generator=gen)
    logical = torch.topk(logits, 3, dim=-1).indices
    physical = compiled(logits)
    assert torch.equal(physical, map_to_physical(logical, lookup.table))
    assert set(physical[logical == 0].tolist()) <= {15, 19}
    assert int(state.expert_load_view.sum()) == 90  # record flag off: nothing added
    # A new row layout of the next forward (offset 3, the second of 2 slices recorded): the same graph.
    state.should_record_tensor.fill_(True)
    state.row_layout.copy_(torch.tensor([3, 2, 1, 0]))
    state.expert_load_view.zero_()
    physical = compiled(logits)
    shifted = lookup.table[(torch.arange(25).unsqueeze(1) + 3) % lookup.table.shape[0], logical]
    assert torch.equal(physical, shifted.to(physical.dtype))
    assert int(state.expert_load_view.sum()) == 12 * 3  # rows 12..23 of slice 1; row 24 beyond it
    assert backend.graphs == 1

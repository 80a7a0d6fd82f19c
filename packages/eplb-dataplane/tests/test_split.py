"""The batch split on hand-made batches: exact shares at the bound, padding, row layouts, graphs, rules."""

import itertools

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from ascend_eplb.dataplane import (
    BatchSplit,
    ReplicaLookup,
    bind_router,
    executed_rank_loads,
    map_to_physical_and_record,
    map_to_physical_split_and_record,
    replica_maps,
    split_boundaries,
    split_counts,
    split_rank_loads,
)

# 4 ranks of 2 slots: [e0 e1 | e2 e3 | e4 e5 | e0 e2]; experts 0 and 2 have a second replica.
E, P, N = 6, 8, 4
L2P = torch.tensor([[0, 6, -1], [1, -1, -1], [2, 7, -1], [3, -1, -1], [4, -1, -1], [5, -1, -1]])
COUNT = torch.tensor([2, 1, 2, 1, 1, 1])


def _lookup(rows: int = 16) -> ReplicaLookup:
    lookup = ReplicaLookup(E, "cpu", rows=rows, num_physical_experts=P, num_ranks=N)
    lookup.refresh_(L2P, COUNT)
    return lookup


def _hot_batch() -> torch.Tensor:
    """40 rows of top-2: expert 0 selected 30 times, experts 1..5 10 times each (80 selections)."""
    first = [0] * 30 + [4] * 10
    second = [1] * 10 + [2] * 10 + [3] * 10 + [5] * 10
    return torch.tensor([first, second], dtype=torch.int32).T.contiguous()


def _bound(counts: torch.Tensor) -> float:
    """max over rank sets A of (selections of experts whose replicas all lie in A) / |A|."""
    ranks = [{int(s) // 2 for s in L2P[e, : COUNT[e]]} for e in range(E)]
    best = 0.0
    for size in range(1, N + 1):
        for subset in itertools.combinations(range(N), size):
            inside = sum(int(counts[e]) for e in range(E) if ranks[e] <= set(subset))
            best = max(best, inside / size)
    return best


def _route(ids, lookup, unpadded, layout=None, counts=None, prefix=None, stats=None, record=True):
    load = torch.zeros(P, dtype=torch.int32)
    flag = torch.tensor(record)
    out = map_to_physical_split_and_record(
        ids,
        lookup.table,
        *lookup.split_inputs,
        load,
        flag,
        torch.tensor(unpadded),
        layout,
        counts,
        prefix,
        stats,
    )
    return out, load


def test_hot_expert_spreads_to_the_bound_with_exact_shares():
    lookup, ids = _lookup(), _hot_batch()
    counts = split_counts(ids, E, torch.tensor(40))
    assert counts.tolist() == [30, 10, 10, 10, 10, 10]
    # The bound: rank 2 alone holds 20 (experts 4, 5), every set averages at most 20: balancedness 1.
    assert _bound(counts) == 20.0
    boundaries = split_boundaries(counts, *lookup.split_inputs)
    # Expert 0: 10 to slot 0 (rank 0, beside expert 1's 10), 20 to slot 6 (rank 3); expert 2 all on slot 2.
    assert boundaries[0].tolist() == [10, 30, 30]
    assert boundaries[2].tolist() == [10, 10, 10]
    assert boundaries[1].tolist() == [10, 10, 10]
    assert split_rank_loads(boundaries, *lookup.split_inputs[:2]).tolist() == [20, 20, 20, 20, 0, 0, 0, 0]
    out, load = _route(ids, lookup, 40)
    # Expert 0's selections in row order: the first 10 on slot 0, the next 20 on slot 6.
    assert out[:, 0][:30].tolist() == [0] * 10 + [6] * 20
    assert out[10:20, 1].tolist() == [2] * 10
    assert load.tolist() == [10, 10, 10, 10, 10, 10, 20, 0]
    assert load.view(N, 2).sum(1).tolist() == [20, 20, 20, 20]
    # Today's equal split of the same batch: expert 0 and expert 2 halved, rank 0 carries 25.
    equal = torch.zeros(P, dtype=torch.int32)
    map_to_physical_and_record(ids, lookup.table, equal, torch.tensor(True), torch.tensor(40))
    assert equal.view(N, 2).sum(1).tolist() == [25, 15, 20, 20]


def test_stats_add_executed_and_equal_balancedness_when_recording():
    lookup, ids = _lookup(), _hot_batch()
    stats = torch.zeros(3)
    _route(ids, lookup, 40, stats=stats)
    assert torch.equal(stats, torch.tensor([1.0, 0.8, 1.0]))  # mean 20 over max 20; equal split max 25
    _route(ids, lookup, 40, stats=stats, record=False)
    assert torch.equal(stats, torch.tensor([1.0, 0.8, 1.0]))
    _route(ids, lookup, 0, stats=stats)  # no selection takes a share: not a batch
    assert torch.equal(stats, torch.tensor([1.0, 0.8, 1.0]))


def test_padding_takes_no_share_and_shifts_no_rank():
    lookup, ids = _lookup(), _hot_batch()
    want, want_load = _route(ids, lookup, 40)
    for pad in ([0, 2], [4, 5], [-1, 9]):
        padded = torch.cat([ids, torch.tensor([pad] * 8, dtype=torch.int32)])
        out, load = _route(padded, lookup, 40)
        assert torch.equal(out[:40], want)
        assert torch.equal(load, want_load)
        # Padding rows read the table (today's rule), ids outside [0, E) map to -1.
        equal = map_to_physical_and_record(
            padded, lookup.table, torch.zeros(P, dtype=torch.int32), torch.tensor(False), torch.tensor(40)
        )
        assert torch.equal(out[40:], equal[40:])
        assert (out[40:] == -1).tolist() == [[p not in range(E) for p in pad]] * 8


def test_replicated_rows_ignore_the_replica_offset_and_a_non_leader_records_nothing():
    lookup, ids = _lookup(), _hot_batch()
    want, want_load = _route(ids, lookup, 40)
    out, load = _route(ids, lookup, 40, layout=torch.tensor([3, 1, 0, 0]))
    assert torch.equal(out, want)
    assert torch.equal(load, want_load)
    out, load = _route(ids, lookup, 40, layout=torch.tensor([3, 1, -1, 0]))
    assert torch.equal(out, want)
    assert int(load.sum()) == 0


def test_gathered_rows_all_take_shares_and_each_rank_records_its_slice():
    lookup, ids = _lookup(), _hot_batch()
    everything, _ = _route(ids, lookup, 40)
    loads = []
    for rank in range(2):  # two DP ranks of 20 rows each (16 real): the same ids on both
        out, load = _route(ids, lookup, 16, layout=torch.tensor([0, 2, rank, 0]))
        assert torch.equal(out, everything)
        loads.append(load)
    for rank in range(2):
        rows = everything[rank * 20 : rank * 20 + 16]
        assert torch.equal(loads[rank].long(), torch.bincount(rows.flatten().long(), minlength=P))


def test_split_rows_with_global_counts_choose_the_whole_batch_replicas():
    lookup, ids = _lookup(), _hot_batch()
    whole, whole_load = _route(ids, lookup, 40)
    chunks = [ids[:13], ids[13:31], ids[31:]]
    local = [split_counts(c, E, torch.tensor(c.shape[0])) for c in chunks]
    total = torch.stack(local).sum(0)
    outs, load = [], torch.zeros(P, dtype=torch.int32)
    for rank, chunk in enumerate(chunks):
        split = BatchSplit(gather_counts=lambda _: torch.stack(local), rank=rank)
        counts, prefix = split.global_counts(local[rank])
        assert torch.equal(counts, total)
        out, part = _route(chunk, lookup, chunk.shape[0], torch.tensor([rank, 1, 0, 0]), counts, prefix)
        outs.append(out)
        load += part
    assert torch.equal(torch.cat(outs), whole)
    assert torch.equal(load, whole_load)
    # Rank-local split: each chunk alone (no counts gathered), its own balance.
    for chunk in chunks:
        out, _ = _route(chunk, lookup, chunk.shape[0], torch.tensor([0, 1, 0, 0]))
        alone = split_boundaries(split_counts(chunk, E, torch.tensor(chunk.shape[0])), *lookup.split_inputs)
        for e in (0, 2):
            picked = out[chunk == e]
            first = int(alone[e, 0])
            assert picked.tolist() == [int(L2P[e, 0])] * first + [int(L2P[e, 1])] * (picked.numel() - first)


def test_lookup_keeps_split_inputs_in_place():
    lookup = ReplicaLookup(E, "cpu", rows=8, num_physical_experts=P, num_ranks=N)
    slots, rank, experts = lookup.split_inputs
    pointers = [t.data_ptr() for t in lookup.split_inputs]
    assert slots[:, 0].tolist() == list(range(E))
    assert int((slots[:, 1:] >= 0).sum()) == 0
    assert rank.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert experts.tolist() == [-1, -1]
    lookup.refresh_(L2P, COUNT)
    assert [t.data_ptr() for t in lookup.split_inputs] == pointers
    assert slots.tolist() == [[0, 6, -1], [1, -1, -1], [2, 7, -1], [3, -1, -1], [4, -1, -1], [5, -1, -1]]
    assert experts.tolist() == [0, 2]
    with pytest.raises(ValueError, match=r"num_ranks=3 needs num_physical_experts \(P\) given and divisible"):
        ReplicaLookup(E, "cpu", num_physical_experts=P, num_ranks=3)
    with pytest.raises(ValueError, match="num_ranks=2 needs num_physical_experts"):
        ReplicaLookup(E, "cpu", num_ranks=2)
    assert ReplicaLookup(E, "cpu").split_inputs is None


class CountingInductor:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return compile_fx(gm, example_inputs)


class Router:
    def __init__(self):
        self.eplb_state = None

    def _apply_eplb_mapping(self, topk_ids):
        return topk_ids

    def select(self, topk_ids):
        return self._apply_eplb_mapping(topk_ids)


class LayerState:
    def __init__(self, lookup):
        self.replica_lookup = lookup
        self.expert_load_view = torch.zeros(P, dtype=torch.int32)
        self.should_record_tensor = torch.tensor(True)
        self.num_unpadded_tokens_tensors = [torch.tensor(0, dtype=torch.int32)]
        self.row_layout = torch.tensor([0, 1, 0, 0])
        self.batch_split = BatchSplit(stats=torch.zeros(3))


def test_compiled_router_with_the_split_keeps_one_graph_across_batches_and_refreshes():
    lookup = _lookup()
    state = LayerState(lookup)
    router = Router()
    bind_router(router, state)
    backend = CountingInductor()
    compiled = torch.compile(router.select, backend=backend, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for step, (num_tokens, unpadded) in enumerate([(40, 40), (48, 40), (7, 3), (300, 290)]):
        ids = (
            _hot_batch()
            if num_tokens == 40
            else torch.randint(0, E, (num_tokens, 2), generator=gen, dtype=torch.int32)
        )
        if num_tokens == 48:
            ids = torch.cat([_hot_batch(), torch.zeros(8, 2, dtype=torch.int32)])
        if step == 2:  # a new placement committed in place: expert 5 gets slot 7, expert 2 loses it
            l2p = L2P.clone()
            l2p[2, 1], l2p[5, 1] = -1, 7
            lookup.refresh_(l2p, torch.tensor([2, 1, 1, 1, 1, 2]))
        state.num_unpadded_tokens_tensors[0].fill_(unpadded)
        before = state.expert_load_view.clone()
        eager_load = state.expert_load_view.clone()
        eager_stats = state.batch_split.stats.clone()
        eager = map_to_physical_split_and_record(
            ids,
            lookup.table,
            *lookup.split_inputs,
            eager_load,
            torch.tensor(True),
            torch.tensor(unpadded),
            state.row_layout,
            None,
            None,
            eager_stats,
        )
        got = compiled(ids)
        assert torch.equal(got, eager)
        assert torch.equal(state.expert_load_view, eager_load)
        assert torch.equal(state.batch_split.stats, eager_stats)
        assert int((state.expert_load_view - before).sum()) == unpadded * 2
    assert backend.graphs == 1
    assert state.batch_split.stats[2].item() == 4.0


def test_opcheck():
    lookup, ids = _lookup(), _hot_batch()
    args = (
        ids,
        lookup.table,
        *lookup.split_inputs,
        torch.zeros(P, dtype=torch.int32),
        torch.tensor(True),
        torch.tensor(37),
        torch.tensor([1, 1, 0, 0]),
        None,
        None,
        torch.zeros(3),
        8,
    )
    torch.library.opcheck(torch.ops.ascend_eplb.map_to_physical_split_and_record.default, args)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"slots": torch.zeros(E, 3, dtype=torch.int64)}, r"replica_slots must be int32 \(E, M\)"),
        ({"slots": torch.zeros(E + 1, 3, dtype=torch.int32)}, r"replica_slots must be int32 \(E, M\)"),
        ({"rank": torch.zeros(3, dtype=torch.int32)}, r"slot_rank must be int32 \(P,\) with P >= E = 6"),
        ({"experts": torch.zeros(0, dtype=torch.int32)}, r"split_experts must be int32 \(X,\) with X >= 1"),
        ({"counts": torch.zeros(E, dtype=torch.int64)}, "global_counts and rank_prefix go together"),
        ({"counts": torch.zeros(E + 1), "prefix": torch.zeros(E)}, r"global_counts must be int32 or int64"),
        ({"stats": torch.zeros(3, dtype=torch.float64)}, r"split_stats must be float32 \(3,\)"),
        ({"steps": -1}, r"steps must be an int in \[0, 64\], got -1"),
        ({"steps": 65}, r"steps must be an int in \[0, 64\], got 65"),
    ],
)
def test_argument_rules_raise_before_anything_is_written(change, pattern):
    lookup, ids = _lookup(), _hot_batch()
    slots, rank, experts = lookup.split_inputs
    args = {"slots": slots, "rank": rank, "experts": experts, "counts": None, "prefix": None, "stats": None}
    args["steps"] = 8
    args.update(change)
    load = torch.zeros(P, dtype=torch.int32)
    with pytest.raises(ValueError, match=pattern):
        map_to_physical_split_and_record(
            ids,
            lookup.table,
            args["slots"],
            args["rank"],
            args["experts"],
            load,
            torch.tensor(True),
            torch.tensor(40),
            None,
            args["counts"],
            args["prefix"],
            args["stats"],
            args["steps"],
        )
    assert int(load.sum()) == 0


def test_replica_maps_and_executed_rank_loads_of_a_placement():
    l2p, count = replica_maps(torch.tensor([0, 1, 2, 3, 4, 5, 0, 2]), E)
    assert torch.equal(l2p, L2P)
    assert torch.equal(count, COUNT)
    with pytest.raises(ValueError, match=r"slot 3 holds expert 6, outside \[0, 6\)"):
        replica_maps(torch.tensor([0, 1, 2, 6, 4, 5, 0, 2]), E)
    lookup, ids = _lookup(), _hot_batch()
    assert executed_rank_loads(ids, lookup, split=True).tolist() == [20, 20, 20, 20]
    assert executed_rank_loads(ids, lookup, split=False).tolist() == [25, 15, 20, 20]
    with pytest.raises(ValueError, match="keeps no split inputs: build it with num_ranks"):
        executed_rank_loads(ids, ReplicaLookup(E, "cpu", num_physical_experts=P), split=False)

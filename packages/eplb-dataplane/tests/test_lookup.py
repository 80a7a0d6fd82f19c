"""ReplicaLookup and build_replica_table: the replica rule, validation, in-place refresh, checksum."""

import pytest
import torch

from ascend_eplb.dataplane import (
    ReplicaLookup,
    build_replica_table,
    map_to_physical,
    map_to_physical_and_record,
    table_checksum,
    validate_placement,
)


def _maps(replicas: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logical_to_physical_map (E, M) -1 padded and logical_replica_count (E,) from replica lists."""
    width = width or max(len(r) for r in replicas)
    l2p = torch.full((len(replicas), width), -1, dtype=torch.int64)
    for e, ids in enumerate(replicas):
        l2p[e, : len(ids)] = torch.tensor(ids)
    return l2p, torch.tensor([len(r) for r in replicas])


# 4 logical experts, 7 physical slots: expert 0 has 3 replicas, expert 2 has 2.
REPLICAS = [[0, 4, 6], [1], [2, 5], [3]]


def test_table_follows_the_documented_rule_at_every_phase():
    l2p, count = _maps(REPLICAS)
    for phase in range(4):
        table = build_replica_table(l2p, count, phase, rows=12)
        assert table.dtype == torch.int32
        assert table.shape == (12, 4)
        expected = [
            [REPLICAS[e][(row + phase + e) % len(REPLICAS[e])] for e in range(4)] for row in range(12)
        ]
        assert table.tolist() == expected


def test_the_phase_shifts_the_replica_a_row_starts_on():
    l2p, count = _maps(REPLICAS)
    first = {build_replica_table(l2p, count, r, rows=8)[0, 0].item() for r in range(3)}
    assert first == {0, 4, 6}


@pytest.mark.parametrize(("num_replicas", "num_tokens"), [(2, 1000), (3, 1000), (3, 3000), (5, 4096)])
def test_replicas_share_one_experts_tokens_evenly_at_every_phase(num_replicas, num_tokens):
    # Logical expert 3 of 8 gets num_replicas replicas; every token selects it (in a rotating top-k
    # column) plus other experts, so T tokens are routed to it.
    num_experts, top_k, num_phases = 8, 4, 4
    hot = 3
    replicas = [[e] for e in range(num_experts)]
    replicas[hot] = [hot, *range(num_experts, num_experts + num_replicas - 1)]
    l2p, count = _maps(replicas)
    gen = torch.Generator().manual_seed(num_tokens)
    others = torch.tensor([e for e in range(num_experts) if e != hot])
    topk = torch.stack(
        [others[torch.randperm(len(others), generator=gen)[: top_k - 1]] for _ in range(num_tokens)]
    )
    column = torch.arange(num_tokens) % top_k
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64)
    for t in range(num_tokens):  # test data construction only
        row = topk[t].tolist()
        row.insert(int(column[t]), hot)
        ids[t] = torch.tensor(row)
    for phase in range(num_phases):
        physical = map_to_physical(ids, build_replica_table(l2p, count, phase))
        chosen = physical[ids == hot]
        assert chosen.numel() == num_tokens
        assert set(chosen.tolist()) == set(replicas[hot])
        shares = torch.bincount(chosen)[replicas[hot]].double()
        assert shares.sum().item() == num_tokens
        assert ((shares - num_tokens / num_replicas).abs() <= 0.01 * num_tokens / num_replicas).all(), shares
        # Other experts keep their only replica.
        assert torch.equal(physical[ids != hot], ids[ids != hot])


def test_table_storage_is_stable_across_refreshes_of_any_shape():
    lookup = ReplicaLookup(4, "cpu", rows=16, num_physical_experts=7)
    table = lookup.table
    ptr = table.data_ptr()
    assert table.tolist() == [[0, 1, 2, 3]] * 16  # identity until the first refresh
    placements = [
        _maps(REPLICAS),  # M = 3
        _maps([[0, 1, 2, 3], [4], [5], [6]]),  # M = 4
        _maps([[6], [5], [4], [3]], width=1),  # M = 1
        _maps([[6], [5], [4], [3]], width=9),  # M = 9, padded
    ]
    for l2p, count in placements:
        lookup.refresh_(l2p, count)
        assert lookup.table is table
        assert lookup.table.data_ptr() == ptr
        expected = build_replica_table(l2p, count, 0, rows=16, num_physical_experts=7)
        assert torch.equal(lookup.table, expected)
        assert lookup.checksum() == table_checksum(expected)
    assert lookup.table[:, 0].tolist() == [6] * 16


def test_checksum_distinguishes_placements_and_ranks():
    l2p, count = _maps(REPLICAS)
    sums = {table_checksum(build_replica_table(l2p, count, r, rows=64)) for r in range(3)}
    assert len(sums) == 3
    a = build_replica_table(l2p, count, 0, rows=64)
    assert table_checksum(a) == table_checksum(a.clone()) == table_checksum(a.to(torch.int64))
    assert table_checksum(a.reshape(32, 8)) != table_checksum(a)  # same values, another shape


def test_checksum_tells_apart_the_replica_choices_a_linear_sum_confuses():
    # 8 experts on 10 slots (experts 1 and 2 replicated): the probe batch of the serving verifier (8 rows,
    # each routing every expert once) read at replica offsets 0 and 1 (TP peers whose offsets differ, the
    # broken replica agreement it must name). The choices differ, yet their position-weighted sums
    # (the verifier's checksum before, which then let the broken agreement through) are equal.
    placement = [7, 2, 1, 2, 1, 0, 3, 4, 5, 6]
    replicas = [[slot for slot, e in enumerate(placement) if e == expert] for expert in range(8)]
    table = build_replica_table(*_maps(replicas), rows=64)
    probe = torch.arange(8).repeat(8, 1)
    off, rows = torch.tensor(False), torch.tensor(8)
    at_offset = [
        map_to_physical_and_record(
            probe, table, torch.zeros(10, dtype=torch.int64), off, rows, torch.tensor(layout)
        )
        for layout in ([0, 1, 0, 0], [1, 1, 0, 0])
    ]
    assert at_offset[0][:, 1:3].tolist() == [[4, 1], [2, 3]] * 4
    assert at_offset[1][:, 1:3].tolist() == [[2, 3], [4, 1]] * 4

    def linear(t: torch.Tensor) -> int:
        flat = t.flatten().to(torch.int64) + 1
        return int((flat * torch.arange(1, flat.numel() + 1)).sum())

    assert linear(at_offset[0]) == linear(at_offset[1])
    assert table_checksum(at_offset[0]) != table_checksum(at_offset[1])


BAD_PLACEMENTS = [
    (
        _maps([[0], [], [2], [3]], width=2),
        {},
        r"logical expert 1 has no replica \(logical_replica_count\[1\] = 0\)",
    ),
    (
        (torch.tensor([[0, 4], [1, -1], [2, -1], [3, -1]]), torch.tensor([3, 1, 1, 1])),
        {},
        r"logical_replica_count\[0\] = 3 exceeds M = 2",
    ),
    (
        _maps([[0, 7], [1], [2], [3]]),
        {"num_physical_experts": 7},
        r"logical_to_physical_map\[0, 1\] = 7 is outside \[0, 7\)",
    ),
    (
        _maps([[0, -3], [1], [2], [3]]),
        {"num_physical_experts": 7},
        r"logical_to_physical_map\[0, 1\] = -3 is outside \[0, 7\)",
    ),
    (
        _maps([[0], [1], [2], [9]]),  # P inferred as sum(count) = 4
        {},
        r"logical_to_physical_map\[3, 0\] = 9 is outside \[0, 4\)",
    ),
    (
        (torch.tensor([[0, 5], [1, -1], [2, -1], [3, -1]]), torch.tensor([1, 1, 1, 1])),
        {"num_physical_experts": 7},
        r"logical_to_physical_map\[0, 1\] = 5 lies beyond logical_replica_count\[0\] = 1; padding must be -1",
    ),
    (
        _maps([[0, 4], [1], [2, 4], [3]]),
        {"num_physical_experts": 7},
        r"physical expert 4 is listed 2 times \(logical experts \[0, 2\]\)",
    ),
    (
        _maps([[0], [1], [2]]),
        {},
        r"logical_to_physical_map has 3 logical experts, this lookup has 4",
    ),
    (
        (torch.tensor([[0], [1], [2], [3]]), torch.tensor([1, 1, 1])),
        {},
        r"logical_replica_count must have shape \(4,\)",
    ),
    (
        (torch.tensor([0, 1, 2, 3]), torch.tensor([1, 1, 1, 1])),
        {},
        r"logical_to_physical_map must be 2-D \(E, M\)",
    ),
]


@pytest.mark.parametrize(("maps", "kwargs", "message"), BAD_PLACEMENTS)
def test_rejected_refresh_leaves_the_table_untouched(maps, kwargs, message):
    lookup = ReplicaLookup(4, "cpu", rows=8, **kwargs)
    good = _maps(REPLICAS)
    lookup.refresh_(*good)
    before = lookup.table.clone()
    with pytest.raises(ValueError, match=message):
        lookup.refresh_(*maps)
    assert torch.equal(lookup.table, before)


def test_float_maps_are_a_type_error():
    l2p, count = _maps(REPLICAS)
    with pytest.raises(TypeError, match=r"logical_to_physical_map must be an integer torch\.Tensor"):
        validate_placement(l2p.float(), count)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((0, "cpu"), {}, ValueError, "num_logical_experts must be >= 1, got 0"),
        ((4, "cpu", 0), {}, ValueError, "rows must be >= 1, got 0"),
        ((4, "cpu"), {"num_physical_experts": 3}, ValueError, "num_physical_experts must be >= 4, got 3"),
        ((4.0, "cpu"), {}, TypeError, "num_logical_experts must be an int"),
    ],
)
def test_constructor_rejects_bad_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        ReplicaLookup(*args, **kwargs)


def test_validate_placement_returns_host_int64_copies_and_inferred_size():
    l2p, count = _maps(REPLICAS)
    out_l2p, out_count, num_physical = validate_placement(l2p.to(torch.int32), count.to(torch.int32))
    assert num_physical == 7
    assert out_l2p.dtype == out_count.dtype == torch.int64
    assert torch.equal(out_l2p, l2p)
    assert torch.equal(out_count, count)


def test_physical_id_bound_follows_the_placement_and_bounds_the_load_view():
    lookup = ReplicaLookup(4, "cpu", rows=8)
    assert lookup.physical_id_bound == 4  # identity table: ids < E
    lookup.check_load_view(torch.zeros(4, dtype=torch.int32))
    l2p, count = _maps(REPLICAS)  # P = 7 inferred
    lookup.refresh_(l2p, count)
    assert lookup.physical_id_bound == 7
    assert int(lookup.table.max()) == 6
    lookup.check_load_view(torch.zeros(7, dtype=torch.int64))
    lookup.check_load_view(torch.zeros(9, dtype=torch.int32))  # elastic-EP capacity above P: fine
    fixed = ReplicaLookup(4, "cpu", rows=8, num_physical_experts=9)
    assert fixed.physical_id_bound == 9


@pytest.mark.parametrize(
    ("view", "message"),
    [
        (
            torch.zeros(6, dtype=torch.int32),
            r"expert_load_view has 6 counters, fewer than the lookup's P = 7",
        ),
        (torch.zeros(7), r"expert_load_view must be int32 or int64 \(P,\), got torch.float32 \(7,\)"),
        (torch.zeros((1, 7), dtype=torch.int32), r"must be int32 or int64 \(P,\), got torch.int32 \(1, 7\)"),
        ([0] * 7, r"expert_load_view must be int32 or int64 \(P,\), got list"),
        (
            torch.zeros(7, dtype=torch.int32, device="meta"),
            r"expert_load_view is on meta, the lookup's table on cpu",
        ),
        (torch.zeros(1, dtype=torch.int32).expand(7), r"must not be a stride-0 \(expanded\) view"),
    ],
)
def test_check_load_view_and_refresh_reject_a_view_that_cannot_count_the_table(view, message):
    l2p, count = _maps(REPLICAS)
    lookup = ReplicaLookup(4, "cpu", rows=8)
    lookup.refresh_(l2p, count)
    with pytest.raises(ValueError, match=message):
        lookup.check_load_view(view)
    # refresh_ checks the view against the new placement's P before touching the table.
    lookup = ReplicaLookup(4, "cpu", rows=8)
    before = lookup.table.clone()
    with pytest.raises(ValueError, match=message):
        lookup.refresh_(l2p, count, expert_load_view=view)
    assert torch.equal(lookup.table, before)
    assert lookup.physical_id_bound == 4

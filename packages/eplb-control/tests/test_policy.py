"""The migration-aware policy and the two placement measures, on hand-made loads with exact results."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ascend_eplb.control.policy import MigrationAwarePolicy, balancedness, moved_experts

# One real load: the ESFT translation trace (DeepSeek-V2-Lite, top-6, MIT; ascend_eplb.world.esft), MoE
# layers 1 and 2, summed over sequences 0-3 (window 0) and 4-7 (window 1).
ESFT_WINDOW_0 = [
    [57, 18, 7, 69, 112, 16, 205, 42, 63, 104, 12, 48, 27, 263, 40, 45, 88, 24, 16, 21, 205, 9, 295, 7, 245,
     38, 70, 55, 11, 31, 21, 22, 52, 64, 82, 426, 178, 9, 123, 26, 24, 9, 27, 247, 226, 128, 7, 50, 127, 157,
     19, 41, 29, 93, 30, 136, 26, 92, 46, 36, 220, 26, 16, 12],
    [58, 341, 2, 20, 24, 136, 74, 42, 68, 20, 70, 9, 25, 183, 102, 105, 83, 10, 180, 41, 23, 215, 169, 429,
     55, 22, 21, 95, 19, 12, 95, 81, 26, 433, 54, 218, 19, 191, 46, 11, 11, 28, 79, 25, 18, 11, 69, 85, 27,
     17, 10, 71, 11, 81, 14, 7, 56, 43, 13, 97, 260, 61, 68, 81],
]  # fmt: skip
ESFT_WINDOW_1 = [
    [79, 27, 12, 90, 156, 21, 242, 51, 53, 138, 13, 58, 51, 330, 49, 48, 109, 32, 12, 28, 245, 11, 366, 15,
     287, 42, 99, 72, 11, 28, 27, 23, 51, 76, 107, 522, 216, 10, 165, 31, 50, 14, 24, 292, 288, 154, 11, 50,
     129, 196, 23, 66, 37, 123, 56, 158, 24, 107, 39, 57, 272, 40, 21, 12],
    [82, 413, 5, 18, 36, 163, 90, 70, 100, 14, 79, 14, 33, 227, 116, 116, 95, 12, 230, 73, 26, 268, 201, 531,
     59, 24, 21, 115, 19, 13, 106, 96, 24, 531, 64, 272, 30, 241, 42, 6, 11, 32, 97, 48, 44, 16, 95, 105, 30,
     9, 18, 73, 17, 104, 19, 15, 62, 47, 8, 147, 313, 80, 83, 98],
]  # fmt: skip


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def _policies(load, old, num_physical, num_groups, num_nodes, num_ranks):
    args = (torch.tensor(load), num_physical, num_groups, num_nodes, num_ranks, _t(old))
    return MigrationAwarePolicy.rebalance_experts(*args), DefaultEplbPolicy.rebalance_experts(*args)


def _node_of_each_group(placement: torch.Tensor, group_size: int, num_nodes: int) -> list[list[set[int]]]:
    """Per layer and expert group, the set of nodes its slots lie on."""
    slots_per_node = placement.shape[1] // num_nodes
    out = []
    for row in placement.tolist():
        groups: dict[int, set[int]] = {}
        for slot, expert in enumerate(row):
            groups.setdefault(expert // group_size, set()).add(slot // slots_per_node)
        out.append([groups[g] for g in sorted(groups)])
    return out


# ---------------------------------------------------------------------------------------------------
# balancedness and moved_experts


def test_balancedness_splits_each_expert_over_its_replicas_and_an_empty_layer_is_even():
    # Layer 0: expert 0 has two replicas (1.5 each), slot 2 is empty (-1): rank 0 holds 1.5 + 1 + 0 and
    # rank 1 holds 2 + 2 + 1.5; mean 4, max 5.5. Layer 1 has no load.
    placement = _t([[0, 1, -1, 2, 3, 0], [0, 1, 2, 3, 0, 1]])
    load = [[3, 1, 2, 2], [0, 0, 0, 0]]
    expected = torch.tensor([4.0 / 5.5, 1.0], dtype=torch.float64)
    for weight in (torch.tensor(load), torch.tensor(load, dtype=torch.float32)):
        got = balancedness(weight, placement, 2)
        assert got.dtype == torch.float64
        assert torch.equal(got, expected)
    # Three ranks: 1.5 + 1, 0 + 2, 2 + 1.5 -> mean 8/3, max 3.5.
    assert balancedness(torch.tensor([load[0]]), placement[:1], 3).tolist() == [(8 / 3) / 3.5]


def test_moved_experts_counts_experts_new_to_a_rank_once_and_empty_slots_hold_nothing():
    old = _t([[0, 1, 2, 3, 0, 1], [0, 1, -1, 2, 3, -1], [0, 1, 2, 3, 0, 1]])
    new = _t([
        [0, 0, 3, 3, 2, 1],  # rank 0 receives 3, rank 1 receives 2
        [0, 1, 2, 2, 3, -1],  # rank 0 receives 2 into its empty slot; rank 1's empty slot stays empty
        [3, 3, 2, 3, 0, 1],  # rank 0 receives 3 (twice: one transfer) and keeps 2; rank 1 nothing
    ])  # fmt: skip
    got = moved_experts(old, new, 2)
    assert got.dtype == torch.int64
    assert got.tolist() == [2, 1, 1]
    assert moved_experts(old, old, 2).tolist() == [0, 0, 0]
    # One rank per slot: every slot whose expert changed is a transfer.
    assert moved_experts(old[:1], new[:1], 6).tolist() == [3]


_FOUR = torch.ones(1, 4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: balancedness(torch.ones(2, 4), _t([[0, 1, 2, 3]]), 2), r"must have the same L"),
        (lambda: balancedness(_FOUR, _t([[0, 1, 2, 3]]), 3), r"num_ranks=3: must divide .* P=4"),
        (lambda: balancedness(_FOUR, _t([[0, 1, 2, 4]]), 2), r"expert id 4: ids must be in \[0, 4\)"),
        (lambda: balancedness(_FOUR, _t([[0, 1, 2, -1]]), 2), r"expert 3 has load 1.0 but no slot"),
        (lambda: balancedness(-_FOUR, _t([[0, 1, 2, 3]]), 2), r"load holds -1.0: every load must be >= 0"),
        (lambda: balancedness(torch.ones(4), _t([[0, 1, 2, 3]]), 2), r"load has shape \(4,\)"),
        (lambda: moved_experts(_t([[0, 1]]), _t([[0, 1, 2, 3]]), 2), r"must have the same shape"),
        (lambda: moved_experts(_t([[0, 1]]), _t([[0, -2]]), 2), r"expert id -2"),
        (lambda: moved_experts(_t([[0, 1]]), _t([[0, 1]]), 0), r"num_ranks=0: must be an int >= 1"),
    ],
)
def test_measures_refuse_bad_input_naming_the_value_and_the_rule(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------------------------------
# The policy on hand-made loads


def test_it_is_an_upstream_policy_and_without_an_old_placement_returns_upstreams_result():
    assert issubclass(MigrationAwarePolicy, AbstractEplbPolicy)
    load = torch.tensor([[5, 1, 3, 3, 4, 2, 7, 1], [1, 1, 1, 1, 1, 1, 1, 9]])
    got = MigrationAwarePolicy.rebalance_experts(load, 12, 2, 2, 4)
    assert torch.equal(got, DefaultEplbPolicy.rebalance_experts(load, 12, 2, 2, 4))


def test_an_old_placement_of_another_ep_size_gets_upstreams_result():
    # Upstream's elastic-EP scale-down passes num_replicas = P // old_ep_size * new_ep_size with the
    # (L, P) map of the old size: there is nothing of the new size to migrate from (it raised on the shape).
    load = torch.tensor([[5, 1, 3, 3, 4, 2, 7, 1], [1, 1, 1, 1, 1, 1, 1, 9]])
    old = DefaultEplbPolicy.rebalance_experts(load, 12, 1, 1, 4)
    got = MigrationAwarePolicy.rebalance_experts(load, 9, 1, 1, 3, old)
    assert torch.equal(got, DefaultEplbPolicy.rebalance_experts(load, 9, 1, 1, 3, old))
    assert tuple(got.shape) == (2, 9)


def test_a_balanced_placement_in_force_moves_nothing():
    # Ranks {0, 1}, {2, 3}, {4, 5} carry 6 each: already even. Upstream packs the same pairs onto other
    # ranks and moves 4 experts for no gain.
    old = [[0, 1, 2, 3, 4, 5]]
    new, up = _policies([[5, 1, 3, 3, 4, 2]], old, 6, 1, 1, 3)
    assert torch.equal(new, _t(old))
    assert up.tolist() == [[0, 1, 4, 5, 3, 2]]
    assert moved_experts(_t(old), up, 3).tolist() == [4]
    # Hierarchical, upstream's initial placement (group 1's experts 4 and 5 on node 0): already even, so
    # it is kept as it is (no regrouping for nothing); upstream regroups and moves 9 experts.
    old = [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    new, up = _policies([[2, 2, 2, 2, 1, 1, 1, 1]], old, 12, 2, 2, 4)
    assert torch.equal(new, _t(old))
    assert moved_experts(_t(old), up, 4).tolist() == [9]


def test_one_hot_expert_moves_exactly_one_replica():
    # Expert 0 is hot (9 of 12) on rank 0; rank 1's redundant replica of expert 1 becomes a second replica
    # of expert 0: ranks 4.5 + 1 + 0.5 and 1 + 4.5 + 0.5, even, with one move (upstream reaches 6/7).
    old = [[0, 1, 2, 3, 1, 2]]
    new, up = _policies([[9, 1, 1, 1]], old, 6, 1, 1, 2)
    assert new.tolist() == [[0, 1, 2, 3, 0, 2]]
    assert moved_experts(_t(old), new, 2).tolist() == [1]
    assert balancedness(torch.tensor([[9, 1, 1, 1]]), new, 2).tolist() == [1.0]
    assert balancedness(torch.tensor([[9, 1, 1, 1]]), up, 2).tolist() == [6 / 7]
    # Three ranks, expert 5 hot on rank 1: one transfer to rank 0 (two of its slots become expert 5: a
    # transfer and a local copy) reaches upstream's balancedness 8/9; upstream moves 6 experts for it.
    old = [[0, 1, 2, 3, 4, 5, 0, 1, 2]]
    new, up = _policies([[2, 2, 2, 2, 2, 6]], old, 9, 1, 1, 3)
    assert new.tolist() == [[5, 5, 2, 3, 4, 5, 0, 1, 2]]
    assert moved_experts(_t(old), new, 3).tolist() == [1]
    assert moved_experts(_t(old), up, 3).tolist() == [6]
    load = torch.tensor([[2, 2, 2, 2, 2, 6]])
    assert balancedness(load, new, 3).tolist() == balancedness(load, up, 3).tolist() == [(16 / 3) / 6]


def test_node_grouping_is_kept_in_a_two_node_hierarchical_case():
    # 8 experts in 2 groups on 2 nodes of 2 ranks (3 slots each). Expert 4 (group 1, node 1) is hot;
    # node 0's ranks are the lightest, but the new replica of expert 4 stays on node 1: rank 3's
    # redundant replica of expert 5 becomes expert 4.
    old = [[0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 5, 6]]
    load = [[1, 1, 1, 1, 6, 1, 1, 1]]
    new, up = _policies(load, old, 12, 2, 2, 4)
    assert new.tolist() == [[0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 4, 6]]
    assert _node_of_each_group(new, 4, 2) == [[{0}, {1}]]
    assert moved_experts(_t(old), new, 4).tolist() == [1]
    assert moved_experts(_t(old), up, 4).tolist() == [3]
    assert balancedness(torch.tensor(load), new, 4).tolist() == [3.25 / 4.5]
    assert balancedness(torch.tensor(load), up, 4).tolist() == [3.25 / 5]


def test_an_old_placement_that_breaks_node_grouping_is_regrouped_onto_upstreams_node_packing():
    # Upstream's initial placement (experts in order, then redundant slots) puts group 1's experts 4 and
    # 5 on node 0. Upstream packs group 0 on node 0 and group 1 on node 1; the slots of node 0 keep
    # experts 0-3, node 1's keep 6 and 7 and take 4 and 5, and the search fills the emptied slots.
    old = [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    load = torch.tensor([[1, 1, 1, 1, 6, 1, 1, 1]])
    new, up = _policies(load.tolist(), old, 12, 2, 2, 4)
    assert new.tolist() == [[0, 1, 2, 3, 0, 1, 6, 7, 4, 5, 4, 4]]
    assert _node_of_each_group(new, 4, 2) == [[{0}, {1}]]
    assert balancedness(load, new, 4).tolist() == balancedness(load, up, 4).tolist() == [0.65]
    assert moved_experts(_t(old), new, 4).tolist() == [5]
    assert moved_experts(_t(old), up, 4).tolist() == [8]


def test_groups_whose_nodes_cannot_carry_the_balance_take_upstreams_node_packing():
    # Groups 0 and 1 (experts 0-3, load 20) share node 0, groups 2 and 3 (load 4) node 1: no placement
    # inside those nodes passes 0.6. Upstream packs groups 0 + 2 and 1 + 3 (1.0); node 0 keeps group
    # 0, takes group 2, and the emptied slots are filled by the search: 4 moves where upstream makes 8.
    old = [[0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 4, 5]]
    load = torch.tensor([[5, 5, 5, 5, 1, 1, 1, 1]])
    new, up = _policies(load.tolist(), old, 12, 4, 2, 4)
    assert new.tolist() == [[0, 1, 4, 5, 0, 1, 3, 3, 6, 2, 7, 2]]
    assert _node_of_each_group(new, 2, 2) == [[{0}, {1}, {0}, {1}]]
    assert balancedness(load, _t(old), 4).tolist() == [0.6]
    assert balancedness(load, new, 4).tolist() == balancedness(load, up, 4).tolist() == [1.0]
    assert moved_experts(_t(old), new, 4).tolist() == [4]
    assert moved_experts(_t(old), up, 4).tolist() == [8]


def test_a_greedy_dead_end_is_searched_again_by_gain_alone():
    # Ranks carry 10 and 22 (mean 16). Per move, the free local copy wins (rank 1's replica of expert 2
    # becomes a second expert 0: 22 -> 17 for no move) and then nothing improves: 16/17. Searched again by
    # gain alone, one swap (experts 3 and 0) gives 16 and 16.
    old = [[4, 2, 3, 0, 1, 2]]
    load = torch.tensor([[7, 10, 10, 1, 4]])
    new, _ = _policies(load.tolist(), old, 6, 1, 1, 2)
    assert new.tolist() == [[4, 2, 0, 3, 1, 2]]
    assert balancedness(load, new, 2).tolist() == [1.0]
    assert moved_experts(_t(old), new, 2).tolist() == [2]


def test_a_layer_the_search_cannot_bring_close_takes_upstreams_layer_with_ranks_aligned():
    # From this placement both greedy orders of the search (per move, then by gain alone) end in a dead
    # end below upstream's 0.94 - 0.01; the layer takes upstream's three rank contents, each on the rank
    # of the old placement it overlaps most, and its slots keep their old experts where they can: 4
    # moves, where upstream's own order makes 5.
    old = [[2, 3, 5, 0, 1, 4, 3, 5, 5]]
    load = torch.tensor([[1, 12, 8, 1, 8, 1]])
    new, up = _policies(load.tolist(), old, 9, 1, 1, 3)
    assert up.tolist() == [[2, 1, 0, 5, 1, 4, 3, 4, 2]]
    assert new.tolist() == [[2, 3, 4, 0, 1, 2, 1, 5, 4]]
    assert sorted(map(sorted, new.view(3, 3).tolist())) == sorted(map(sorted, up.view(3, 3).tolist()))
    assert balancedness(load, new, 3).tolist() == balancedness(load, up, 3).tolist()
    assert moved_experts(_t(old), new, 3).tolist() == [4]
    assert moved_experts(_t(old), up, 3).tolist() == [5]


def test_empty_slots_of_elastic_padding_are_filled():
    # Each rank has an empty slot (-1); expert 0 (load 6) takes both: rank 0's as a local copy, rank 1's
    # as the one transfer (upstream moves 3 experts for the same 1.0).
    old = [[0, 1, -1, 2, 3, -1]]
    new, up = _policies([[6, 2, 2, 2]], old, 6, 1, 1, 2)
    assert new.tolist() == [[0, 1, 0, 2, 3, 0]]
    assert moved_experts(_t(old), new, 2).tolist() == [1]
    assert moved_experts(_t(old), up, 2).tolist() == [3]
    assert balancedness(torch.tensor([[6, 2, 2, 2]]), new, 2).tolist() == [1.0]


def test_the_same_input_gives_the_same_output_and_every_expert_stays_placed():
    generator = torch.Generator().manual_seed(7)
    load = torch.randint(0, 1000, (6, 32), generator=generator)
    load[2] = 0  # a layer without load keeps its placement
    old = torch.cat([torch.arange(32), torch.arange(8)]).repeat(6, 1)
    first = MigrationAwarePolicy.rebalance_experts(load, 40, 4, 2, 8, old)
    again = MigrationAwarePolicy.rebalance_experts(load.clone(), 40, 4, 2, 8, old.clone())
    assert torch.equal(first, again)
    assert first.dtype == torch.int64
    assert first.device.type == "cpu"
    assert first.shape == (6, 40)
    for row in first.tolist():
        assert set(row) == set(range(32))
    step = MigrationAwarePolicy.rebalance_experts(load.flip(1), 40, 4, 2, 8, first)
    assert torch.equal(step[2], first[2])
    assert _node_of_each_group(step, 8, 2) == _node_of_each_group(first, 8, 2)
    for row in step.tolist():
        assert set(row) == set(range(32))


def test_on_a_real_esft_window_it_moves_far_less_for_upstreams_balance():
    # Window 0 placed by upstream from its initial placement; then window 1 from that placement.
    initial = torch.cat([torch.arange(64), torch.arange(8)]).repeat(2, 1)
    placed = DefaultEplbPolicy.rebalance_experts(torch.tensor(ESFT_WINDOW_0), 72, 1, 1, 8, initial)
    load = torch.tensor(ESFT_WINDOW_1)
    new = MigrationAwarePolicy.rebalance_experts(load, 72, 1, 1, 8, placed)
    up = DefaultEplbPolicy.rebalance_experts(load, 72, 1, 1, 8, placed)
    ours_moved, up_moved = moved_experts(placed, new, 8), moved_experts(placed, up, 8)
    ours_b, up_b = balancedness(load, new, 8), balancedness(load, up, 8)
    assert int(ours_moved.sum()) * 5 <= int(up_moved.sum())
    assert float(ours_b.mean()) >= float(up_b.mean()) - 0.005
    assert (ours_b >= up_b - MigrationAwarePolicy.balancedness_tolerance - 1e-12).all()


#: Upstream's initial placement of 64 experts on 72 slots: experts in order, then 0..7 again.
_INITIAL = torch.cat([torch.arange(64), torch.arange(8)]).repeat(2, 1)


@pytest.mark.parametrize(
    "policy", [DefaultEplbPolicy, MigrationAwarePolicy], ids=["default", "migration_aware"]
)
@pytest.mark.parametrize(
    ("num_groups", "num_nodes", "old"),
    [(1, 1, None), (1, 1, _INITIAL), (8, 2, None), (8, 2, _INITIAL)],
    ids=["global", "global-from-initial", "hierarchical", "hierarchical-from-initial"],
)
def test_a_load_counted_once_and_counted_on_every_tp_rank_gets_the_same_placement(
    policy, num_groups, num_nodes, old
):
    """GLOSSARY "recorded load" (8 against 16): this project records each real selection once; upstream's
    router records it on every TP rank of the replicated layout, x TP (2 here). The policies place a load
    and its double alike (upstream's sorts, argmin/argmax of weights and weight / replica count are
    invariant to a uniform scale): the same placement, the same balancedness; only the window's absolute
    values differ, as do vLLM's logged avg_tokens and max_tokens."""
    from vllm.distributed.eplb.eplb_state import _compute_eplb_load_stats

    from ascend_eplb.control.measures import rank_loads

    load = torch.tensor(ESFT_WINDOW_1)
    once = policy.rebalance_experts(load, 72, num_groups, num_nodes, 8, old)
    every_tp_rank = policy.rebalance_experts(2 * load, 72, num_groups, num_nodes, 8, old)
    assert torch.equal(once, every_tp_rank)
    assert torch.equal(balancedness(load, once, 8), balancedness(2 * load, every_tp_rank, 8))
    # vLLM's log_balancedness line on the two counts: avg_tokens and max_tokens double, the ratio stays.
    avg, peak = _compute_eplb_load_stats(rank_loads(load, once, 8).float())
    avg2, peak2 = _compute_eplb_load_stats(rank_loads(2 * load, once, 8).float())
    assert (float(avg2), float(peak2)) == (2 * float(avg), 2 * float(peak))
    assert float(avg2) / float(peak2) == float(avg) / float(peak)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_replicas": 70}, r"num_ranks=8: must divide the physical experts per layer P=70"),
        ({"num_replicas": 60}, r"num_replicas=60: must be an int >= the logical experts per layer E=64"),
        ({"num_ranks": 6, "num_nodes": 4}, r"num_ranks=6: must be a multiple of num_nodes=4"),
        ({"num_groups": 3, "num_nodes": 1}, r"num_groups=3: must divide the logical experts E=64"),
        ({"num_nodes": 0}, r"num_nodes=0: must be an int >= 1"),
        ({"num_groups": True}, r"num_groups=True: must be an int >= 1"),
        ({"old": torch.zeros(2, 64, dtype=torch.int64)}, r"old_global_expert_indices has shape \(2, 64\)"),
        ({"old": torch.zeros(2, 72)}, r"old_global_expert_indices has dtype torch.float32"),
        ({"old": torch.full((2, 72), 64)}, r"old_global_expert_indices holds expert id 64"),
        ({"old": _INITIAL.index_fill(1, torch.tensor([10]), 0)},
         r"layer 0 places no slot of logical expert 10: every logical expert must be placed"),
        ({"weight": torch.full((2, 64), float("nan"))}, r"load holds a non-finite value"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_value_and_the_rule(change, message):
    args = {
        "weight": torch.ones(2, 64),
        "num_replicas": 72,
        "num_groups": 1,
        "num_nodes": 1,
        "num_ranks": 8,
        "old": _INITIAL,
    } | change
    with pytest.raises(ValueError, match=message):
        MigrationAwarePolicy.rebalance_experts(
            args["weight"],
            args["num_replicas"],
            args["num_groups"],
            args["num_nodes"],
            args["num_ranks"],
            args["old"],
        )

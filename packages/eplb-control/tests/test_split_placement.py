"""Placement for the batch split (replicas swapped to link ranks, never lowering the planned split bound),
and the state's reading of the split's on-device stats."""

import numpy as np
import pytest
import torch

from ascend_eplb.control._split_placement import _graph, _holdings, link_replicas
from ascend_eplb.control.measures import split_bound
from ascend_eplb.control.policy import MigrationAwarePolicy, SplitAwarePolicy

# 4 ranks of 3 slots: [e0 e1 e2 | e3 e4 e0 | e5 e6 e8 | e7 e8 e5]: experts 0, 5 and 8 replicated; the
# replica graph has the pieces {0, 1} and {2, 3} (5 and 8 both link 2-3).
ROW = np.array([0, 1, 2, 3, 4, 0, 5, 6, 8, 7, 8, 5])
LOAD = np.array([[40, 10, 10, 10, 10, 40, 10, 10, 40]], dtype=np.float64)


def test_one_swap_links_the_pieces_and_lifts_the_bound():
    before = ROW[None].copy()
    assert [int(v[0]) for v in _graph(_holdings(before, 4, 9))] == [2, 2]  # pieces, distinct links
    # Ranks 2 and 3 hold 100 of 180: no split reaches below 50 there (mean 45): 0.9.
    assert split_bound(torch.from_numpy(LOAD), torch.from_numpy(before), 4).tolist() == [0.9]
    after = link_replicas(LOAD, before, 4, 1, 4)
    # Expert 5's replica on rank 2 trades places with rank 0's lightest single (expert 1, lowest slot).
    assert after.tolist() == [[0, 5, 2, 3, 4, 0, 1, 6, 8, 7, 8, 5]]
    assert [int(v[0]) for v in _graph(_holdings(after, 4, 9))] == [1, 3]
    assert split_bound(torch.from_numpy(LOAD), torch.from_numpy(after), 4).tolist() == [1.0]
    assert before.tolist() == [ROW.tolist()]  # the input is not changed


def test_swaps_stay_inside_a_node():
    # Two nodes of two ranks: expert 5's replica may only trade with rank 3's slots; rank 2 and 3 are
    # linked already, so nothing links {0, 1} to {2, 3}: no swap.
    after = link_replicas(LOAD, ROW[None].copy(), 4, 2, 4)
    assert after.tolist() == [ROW.tolist()]


def test_the_planned_bound_never_falls_on_random_layers():
    rng = np.random.default_rng(0)
    for _ in range(12):
        num_experts, num_physical, num_ranks = 16, 24, 4
        row = np.concatenate(
            [np.arange(num_experts), rng.integers(0, num_experts, num_physical - num_experts)]
        )
        rng.shuffle(row)
        load = rng.integers(1, 100, (1, num_experts)).astype(np.float64)
        after = link_replicas(load, row[None].copy(), num_ranks, 1, num_ranks)
        assert sorted(after[0].tolist()) == sorted(row.tolist())  # the same replicas, other ranks
        pieces_before, links_before = _graph(_holdings(row[None], num_ranks, num_experts))
        pieces_after, links_after = _graph(_holdings(after, num_ranks, num_experts))
        assert (pieces_after[0], -links_after[0]) <= (pieces_before[0], -links_before[0])
        both = torch.from_numpy(np.stack([row, after[0]]))
        bounds = split_bound(torch.from_numpy(np.repeat(load, 2, axis=0)), both, num_ranks)
        assert bounds[1] >= bounds[0] - 1e-12


def test_split_aware_policy_is_the_migration_aware_placement_linked():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randint(0, 500, (3, 16), generator=gen)
    old = torch.stack([torch.randperm(24, generator=gen) % 16 for _ in range(3)])
    base = MigrationAwarePolicy.rebalance_experts(weight, 24, 1, 1, 4, old)
    linked = SplitAwarePolicy.rebalance_experts(weight, 24, 1, 1, 4, old)
    expected = link_replicas(weight.double().numpy(), base.numpy(), 4, 1, 4)
    assert torch.equal(linked, torch.from_numpy(expected))
    assert torch.equal(SplitAwarePolicy.rebalance_experts(weight, 24, 1, 1, 4, old), linked)
    # Without a placement in force: upstream's placement, linked.
    fresh = SplitAwarePolicy.rebalance_experts(weight, 24, 1, 1, 4)
    upstream = MigrationAwarePolicy.rebalance_experts(weight, 24, 1, 1, 4)
    assert torch.equal(
        fresh, torch.from_numpy(link_replicas(weight.double().numpy(), upstream.numpy(), 4, 1, 4))
    )


def test_take_split_balancedness_is_the_mean_over_layers_of_each_layers_batch_mean_then_restarts():
    from types import SimpleNamespace

    from ascend_eplb.control.state import AscendEplbState

    # Layer 0: two batches (0.9 + 0.7 executed, 0.6 + 0.5 equal); layer 1: one (1.0, 0.8); layer 2: none.
    stats = torch.tensor([[1.6, 1.1, 2.0], [1.0, 0.8, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float32)
    config = SimpleNamespace(compute_hash=lambda: "m")
    state = SimpleNamespace(split_stats={"m": stats})
    executed, equal = AscendEplbState.take_split_balancedness(state, config)
    assert executed == pytest.approx((0.8 + 1.0) / 2, abs=1e-7)
    assert equal == pytest.approx((0.55 + 0.8) / 2, abs=1e-7)
    assert int(stats.count_nonzero()) == 0  # restarted in place
    assert AscendEplbState.take_split_balancedness(state, config) is None  # no batch since
    assert AscendEplbState.take_split_balancedness(state, SimpleNamespace(compute_hash=lambda: "x")) is None

"""The placement measures' one definition (control.measures), which the events file, plan, simulate, the
policy and the gate read: exact values."""

import pytest
import torch
from vllm.distributed.eplb.eplb_state import EplbState

from ascend_eplb.control import measures, upstream


def test_received_experts_counts_one_transfer_per_expert_and_rank_as_upstream_receives_it():
    # 2 ranks x 2 slots. Rank 0 held {0, 1} and gets {2, 2}: one expert received (upstream's move_to_buffer
    # receives one primary copy of expert 2 and copies it into the second slot). Rank 1 held {2, 3} and
    # keeps 3, gets 0: one received; its slot of 3 moved within the rank is a local copy.
    old = torch.tensor([[0, 1, 2, 3]])
    new = torch.tensor([[2, 2, 0, 3]])
    assert measures.received_experts(old, new, 2).tolist() == [[1, 1]]
    assert measures.moved_experts(old, new, 2).tolist() == [2]


def test_per_layer_and_mean_balancedness_are_distinct_and_exact():
    load = torch.tensor([[6.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    placement = torch.tensor([[0, 1, 0, 2, 3, 0], [0, 1, 2, 3, 0, 1]])  # expert 0: 3 replicas in layer 0
    loads = measures.rank_loads(load, placement, 3)
    assert loads.dtype == torch.float64
    assert loads.tolist() == [[4.0, 4.0, 2.0], [0.0, 0.0, 0.0]]
    per_layer = measures.layer_balancedness(loads)  # (L,): mean / max per layer, an empty layer is even
    assert per_layer.tolist() == [pytest.approx(10.0 / 3 / 4.0), 1.0]
    assert measures.mean_balancedness(loads) == pytest.approx((10.0 / 3 / 4.0 + 1.0) / 2)  # one float
    assert isinstance(measures.mean_balancedness(loads), float)
    # The name control.policy and control.gate call: the per-layer balancedness of a placement's loads.
    assert measures.balancedness(load, placement, 3).tolist() == per_layer.tolist()
    assert measures.hottest_rank_share(loads) == 0.4  # layer 0: 4 of 10; layer 1 has no load
    assert measures.hottest_rank_share(torch.zeros(2, 3)) == 0.0


def test_layer_balancedness_names_a_bad_value():
    with pytest.raises(ValueError, match=r"rank_loads_LN holds -1.0: every load must be >= 0"):
        measures.layer_balancedness(torch.tensor([[1.0, -1.0]]))
    with pytest.raises(ValueError, match=r"rank_loads_LN has shape \(3,\): it must be \(L, N\)"):
        measures.mean_balancedness(torch.tensor([1.0, 2.0, 3.0]))


def test_initial_placement_is_upstreams_for_every_size_and_its_signature_is_a_row():
    # Its signature is a row of the serving surface (user control.measures); its body is pinned by the tools'
    # row (ascend_eplb.tools.upstream, held by the tools' tests: plan runs without vLLM).
    (row,) = upstream.SURFACE.used_by(upstream.MEASURES)
    assert row.label == "EplbState.build_initial_global_physical_to_logical_map"
    upstream.SURFACE.check(upstream.MEASURES)
    for experts in range(1, 10):
        for redundant in range(2 * experts + 1):
            want = list(EplbState.build_initial_global_physical_to_logical_map(experts, redundant))
            got = measures.upstream_initial_placement(experts, redundant, 3)
            assert got.dtype == torch.int64
            assert got.tolist() == [want] * 3, (experts, redundant)
    assert measures.upstream_initial_placement(4, 2, 1).tolist() == [[0, 1, 2, 3, 0, 1]]
    with pytest.raises(ValueError, match=r"num_redundant_experts=-1: must be an int >= 0"):
        measures.upstream_initial_placement(4, -1, 1)


def test_split_bound_is_the_densest_rank_set_by_enumeration_and_by_min_cut():
    # 4 ranks of 2 slots [e0 e1 | e2 e3 | e4 e5 | e0 e2]: experts 0 and 2 have a second replica. Load
    # 30, 10 x 5 (mean 20): no set holds more than 20 a rank, the split reaches 1.0; the equal split 0.8.
    placement = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 2]])
    load = torch.tensor([[30, 10, 10, 10, 10, 10]])
    assert measures.split_bound(load, placement, 4).tolist() == [1.0]
    assert measures.balancedness(load, placement, 4).tolist() == [0.8]
    # Expert 4 at 50: rank 2 alone holds 60 of 120 (mean 30): 0.5; a layer without load: 1.0.
    heavy = torch.tensor([[30, 10, 10, 10, 50, 10], [0, 0, 0, 0, 0, 0]])
    assert measures.split_bound(heavy, placement.repeat(2, 1), 4).tolist() == [0.5, 1.0]
    # The min cut (Dinkelbach) reaches the same sets as the enumeration on random layers of 8 ranks.
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        row = torch.cat([torch.arange(24), torch.randint(0, 24, (8,), generator=gen)])
        row = row[torch.randperm(32, generator=gen)]
        weight = torch.randint(0, 50, (24,), generator=gen).double()
        held = measures._holdings(row[None].numpy(), 8, 24)[0] > 0
        want = float(weight.sum()) / 8 / measures._closure_peak(weight.numpy(), held)
        assert measures.split_bound(weight[None], row[None], 8).item() == pytest.approx(want, rel=1e-12)


def test_split_bound_refuses_what_rank_loads_refuses():
    with pytest.raises(ValueError, match=r"logical expert 2 has load 5\.0 but no slot"):
        measures.split_bound(torch.tensor([[1, 1, 5]]), torch.tensor([[0, 1]]), 2)

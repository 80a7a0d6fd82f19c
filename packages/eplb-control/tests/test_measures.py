"""The placement measures' one definition (control.measures), which metrics, the gate and plan read."""

import pytest
import torch

from ascend_eplb.control import measures
from ascend_eplb.integration import metrics


def test_received_experts_counts_one_transfer_per_expert_and_rank_as_upstream_receives_it():
    # 2 ranks x 2 slots. Rank 0 held {0, 1} and gets {2, 2}: one expert received (upstream's move_to_buffer
    # receives one primary copy of expert 2 and copies it into the second slot). Rank 1 held {2, 3} and
    # keeps 3, gets 0: one received; its slot of 3 moved within the rank is a local copy.
    old = torch.tensor([[0, 1, 2, 3]])
    new = torch.tensor([[2, 2, 0, 3]])
    assert measures.received_experts(old, new, 2).tolist() == [[1, 1]]
    assert measures.moved_experts(old, new, 2).tolist() == [2]
    assert metrics.experts_received_per_rank(old, new, 2).tolist() == [[1, 1]]
    assert metrics.experts_crossing_ranks(old, new, 2) == 2


def test_rank_loads_and_balancedness_are_one_definition_for_metrics_and_the_policy():
    load = torch.tensor([[6.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    placement = torch.tensor([[0, 1, 0, 2, 3, 0], [0, 1, 2, 3, 0, 1]])  # expert 0: 3 replicas in layer 0
    loads = measures.rank_loads(load, placement, 3)
    assert loads.tolist() == [[4.0, 4.0, 2.0], [0.0, 0.0, 0.0]]
    per_layer = measures.rank_balancedness(loads)
    assert per_layer.tolist() == [pytest.approx(10.0 / 3 / 4.0), 1.0]  # an empty layer is even
    assert measures.balancedness(load, placement, 3).tolist() == per_layer.tolist()
    assert metrics.rank_loads(load, placement, 3).tolist() == loads.tolist()
    assert metrics.balancedness(loads) == pytest.approx(float(per_layer.mean()))


def test_rank_balancedness_names_a_bad_value():
    with pytest.raises(ValueError, match=r"rank_loads_LN holds -1.0: every load must be >= 0"):
        measures.rank_balancedness(torch.tensor([[1.0, -1.0]]))
    with pytest.raises(ValueError, match=r"rank_loads_LN has shape \(3,\): it must be \(L, N\)"):
        measures.rank_balancedness(torch.tensor([1.0, 2.0, 3.0]))

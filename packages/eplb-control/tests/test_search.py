"""The migration-aware policy's local search, part by part, on hand-made layers with exact values.

The layer most tests use: 4 logical experts, 2 ranks of 3 slots (one node): rank 0 holds experts 0,
1, 2 and rank 1 holds 3, 1, 2 (experts 1 and 2 have two replicas each). Load 6, 3, 3, 2: per replica 6,
1.5, 1.5, 2; rank loads 9 and 5, mean 7; the target balancedness 1.0 caps each rank at 7, so rank 0
(the donor) is 2 above it. Inside the search, ids are shifted by one (0 = an empty slot).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_eplb.control import _search as search
from ascend_eplb.control.measures import rank_loads

PLACEMENT = np.array([[0, 1, 2, 3, 1, 2]])
LOAD = np.array([[6.0, 3.0, 3.0, 2.0]])
INF = -np.inf


def _state(placement=PLACEMENT, old=PLACEMENT, load=LOAD) -> search.SearchState:
    return search.SearchState.begin(load, placement.copy(), old, np.array([1.0]), 2, 1)


def _round(state: search.SearchState, **kwargs):
    layer = np.array([0])
    donors = search.donors(state, layer, *search.rank_view(state, layer))
    return donors, search.candidates(donors, **kwargs)


def test_the_donor_is_the_heaviest_rank_above_its_cap():
    d, _ = _round(_state())
    assert d.heaviest.tolist() == [0]
    assert d.cap.tolist() == [7.0]
    assert d.peak.tolist() == [9.0]
    assert d.node_loads.tolist() == [[9.0, 5.0]]
    assert d.experts.tolist() == [[1, 2, 3, 4, 2, 3]]
    assert d.donor_slots.tolist() == [[0, 1, 2]]
    assert d.donor_experts.tolist() == [[1, 2, 3]]


def test_candidates_are_every_repoint_of_a_duplicate_and_every_swap_with_another_rank():
    _, c = _round(_state())
    assert c.x.tolist() == [[1, 2, 3]]
    assert c.slot.tolist() == [[1, 2, 4, 5]]  # the slots of experts 1 and 2, which keep another replica
    assert c.y.tolist() == [[2, 3, 2, 3]]
    assert c.y_count.tolist() == [[2, 2, 2, 2]]
    # Expert x may not take a slot of its own.
    assert c.repointable.tolist() == [[[True] * 4, [False, True, False, True], [True, False, True, False]]]
    assert c.partner.tolist() == [[0, 1, 2, 3, 4, 5]]
    # Only rank 1's slots, never the same expert.
    assert c.swappable.tolist() == [
        [
            [False, False, False, True, True, True],
            [False, False, False, True, False, True],
            [False, False, False, True, True, False],
        ]
    ]
    # A node of more ranks than partner_ranks: the swaps go to its lightest ranks only.
    _, c = _round(_state(), partner_ranks=1)
    assert c.partner.tolist() == [[3, 4, 5]]
    assert c.swappable.tolist() == [[[True, True, True], [True, False, True], [True, True, False]]]


def test_score_is_each_changes_excess_reduction_and_moves():
    state = _state()
    d, c = _round(state)
    gain, cost = search.score(state, d, c)
    # Re-points (x = experts 0, 1, 2; slots 1, 2, 4, 5). Expert 0 in any slot: ranks 7.5 and 6.5, 1.5
    # less excess; in rank 0's slots a local copy (no move). Expert 1 in slot 2: ranks 8 and 6; in slot
    # 5 (expert 2 then single on rank 0): 10 and 4, 1 more excess. Expert 2 mirrors expert 1.
    assert gain[0, :12].tolist() == [1.5, 1.5, 1.5, 1.5, INF, 1.0, INF, -1.0, 1.0, INF, -1.0, INF]
    assert cost[0, :12].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    # Swaps (donor slots 0-2 with slots 0-5). Expert 0 (6) with expert 3 (2): ranks 5 and 9, no gain,
    # two moves; with expert 1 or 2 of rank 1 (1.5): 4.5 and 9.5, 0.5 more excess, one move (they are
    # on rank 0 already). Experts 1 and 2 (1.5) with expert 3: 0.5 more; with each other: nothing.
    swaps = gain[0, 12:].reshape(3, 6)
    assert swaps.tolist() == [
        [INF, INF, INF, 0.0, -0.5, -0.5],
        [INF, INF, INF, -0.5, INF, 0.0],
        [INF, INF, INF, -0.5, 0.0, INF],
    ]
    assert cost[0, 12:].reshape(3, 6)[:, 3:].tolist() == [[2, 1, 1], [1, 0, 0], [1, 0, 0]]


def test_the_mirrored_layer_scores_each_change_as_its_mirror_image():
    # The two ranks exchanged: rank 1 is the donor, and the other rank holding both experts of a
    # re-point (x and y on rank 0) comes before it; each correction is still made, in rank order.
    mirrored = np.array([[3, 1, 2, 0, 1, 2]])
    state = _state(placement=mirrored, old=mirrored)
    d, c = _round(state)
    assert d.heaviest.tolist() == [1]
    assert c.x.tolist() == [[1, 2, 3]]
    assert c.slot.tolist() == [[1, 2, 4, 5]]  # now slots 1, 2 of rank 0 and 4, 5 of the donor
    gain, cost = search.score(state, d, c)
    assert gain[0, :12].reshape(3, 4).tolist() == [
        [1.5, 1.5, 1.5, 1.5],
        [INF, -1.0, INF, 1.0],
        [-1.0, INF, 1.0, INF],
    ]
    assert cost[0, :12].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert gain[0, 12:].reshape(3, 6).tolist() == [
        [0.0, -0.5, -0.5, INF, INF, INF],
        [-0.5, INF, 0.0, INF, INF, INF],
        [-0.5, 0.0, INF, INF, INF, INF],
    ]
    assert cost[0, 12:].reshape(3, 6)[:, :3].tolist() == [[2, 1, 1], [1, 0, 0], [1, 0, 0]]


def _excess(load: np.ndarray, placement: np.ndarray, cap: float) -> float:
    """The ranks' summed load over ``cap`` (2 ranks), recomputed from the placement."""
    loads = rank_loads(torch.from_numpy(load), torch.from_numpy(placement), 2).numpy()
    return float(np.maximum(loads - cap, 0.0).sum())


@pytest.mark.parametrize(
    ("placement", "load"),
    [
        # The module's layer: rank 1 holds both experts of some re-points (after the donor).
        ([[0, 1, 2, 3, 1, 2]], [[6.0, 3.0, 3.0, 2.0]]),
        # Rank 1 is the donor; rank 0, before it, holds both experts of a re-point and goes over the cap.
        ([[3, 1, 2, 1, 3, 0]], [[6.0, 2.0, 1.0, 6.0]]),
        # The same after the donor (rank 0): rank 1 holds both experts 0 and 2 of a re-point.
        ([[1, 0, 2, 2, 2, 0]], [[6.0, 1.0, 1.0]]),
        # Expert 1 twice on the donor: the donor's load with it counts once, not once per slot.
        ([[0, 1, 1, 2, 3, 1]], [[6.0, 3.0, 3.0, 2.0]]),
    ],
)
def test_each_change_scores_the_excess_reduction_it_makes(placement, load):
    placement, load = np.array(placement), np.array(load)
    state = _state(placement=placement, old=placement, load=load)
    d, c = _round(state)
    gain, _ = search.score(state, d, c)
    cap, before = float(d.cap[0]), _excess(load, placement, float(d.cap[0]))
    num_x, k = c.repointable.shape[1:]
    changes = []
    for i, col in zip(*np.nonzero(c.repointable[0]), strict=True):  # slot col takes donor expert i
        new = placement.copy()
        new[0, c.slot[0, col]] = c.x[0, i] - 1
        changes.append((i * k + col, new))
    for i, t in zip(*np.nonzero(c.swappable[0]), strict=True):  # donor slot i <-> node slot partner[t]
        new = placement.copy()
        a, b = d.donor_slots[0, i], c.partner[0, t]
        new[0, [a, b]] = new[0, [b, a]]
        changes.append((num_x * k + i * c.partner.shape[1] + t, new))
    assert len(changes) == np.isfinite(gain[0]).sum() > 0
    for column, new in changes:
        assert gain[0, column] == pytest.approx(before - _excess(load, new, cap), abs=1e-12)


def test_a_change_that_undoes_an_earlier_move_costs_one_less():
    # From the old placement [0, 1, 2, 3, 1, 2], the search gave slot 4 of rank 1 expert 0 (a move).
    # Re-pointing that slot again gives the move back: to expert 1 (there before) or 2 (there now), -1.
    start = np.array([[0, 1, 2, 3, 0, 2]])
    state = _state(placement=start)
    d, c = _round(state)
    assert c.slot.tolist() == [[0, 2, 4, 5]]
    assert c.y.tolist() == [[1, 3, 1, 3]]
    _, cost = search.score(state, d, c)
    assert cost[0, :12].reshape(3, 4)[:, 2].tolist() == [-1, -1, -1]  # slot 4 takes expert 0, 1 or 2
    # Slot 5: expert 0 is on rank 1 now (slot 4), expert 1 was before: no move.
    assert cost[0, :12].reshape(3, 4)[:, 3].tolist() == [0, 0, 0]


@pytest.mark.parametrize(("by_gain", "best"), [(False, 0), (True, 0)])
def test_the_best_change_is_the_largest_reduction_per_move_the_lowest_column_on_a_tie(by_gain, best):
    state = _state()
    d, c = _round(state)
    gain, cost = search.score(state, d, c)
    got, stuck = search.best_change(gain, cost, d.cap, by_gain=by_gain)
    # Per move: the local copies of expert 0 give 1.5 / 0.5 = 3, the transfers 1.5; by gain alone all
    # four give 1.5 and the fewer moves win (columns 0 and 1), then the lowest column.
    assert got.tolist() == [best]
    assert stuck.tolist() == [False]
    # Nothing reduces the excess: stuck.
    _, stuck = search.best_change(np.minimum(gain, 0.0), cost, d.cap, by_gain=by_gain)
    assert stuck.tolist() == [True]


def test_apply_makes_the_chosen_repoint_or_swap_and_keeps_counts_and_holdings():
    state = _state()
    d, c = _round(state)
    search.apply(state, d, c, np.array([2]), np.array([True]))  # expert 0 into slot 4
    assert (state.placement - 1).tolist() == [[0, 1, 2, 3, 0, 2]]
    assert state.counts.tolist() == [[2, 1, 2, 1]]
    assert state.held[0, 1:].tolist() == [[1, 1], [1, 0], [1, 1], [0, 1]]  # experts x ranks

    state = _state()
    d, c = _round(state)
    search.apply(state, d, c, np.array([12 + 3]), np.array([True]))  # donor slot 0 <-> slot 3
    assert (state.placement - 1).tolist() == [[3, 1, 2, 0, 1, 2]]
    assert state.counts.tolist() == [[1, 2, 2, 1]]
    assert state.held[0, 1:].tolist() == [[0, 1], [1, 1], [1, 1], [1, 0]]

    state = _state()
    d, c = _round(state)
    search.apply(state, d, c, np.array([2]), np.array([False]))  # not picked: nothing changes
    assert (state.placement - 1).tolist() == PLACEMENT.tolist()


@pytest.mark.parametrize("by_gain", [False, True])
def test_the_search_reaches_the_cap_with_one_move(by_gain):
    # A local copy of expert 0 on rank 0 (slot 1), then slot 5 of rank 1 takes expert 0 (one move):
    # expert 0 in three replicas of 2, ranks 7 and 7.
    new = search.local_search(LOAD, PLACEMENT, PLACEMENT, np.array([1.0]), 2, 1, by_gain=by_gain)
    assert new.tolist() == [[0, 0, 2, 3, 1, 0]]

"""The shared commit-order oracle passes a log in commit order and fails each broken rule."""

from __future__ import annotations

import copy

import pytest

from ascend_eplb.testing.oracles import COMMIT_ORDER, check_commit_order, tag

LAYERS = (0, 1)
SLOTS = (2, 3)  # this rank's physical slots
BEFORE = [[0, 1, 2, 3], [0, 1, 2, 3]]
NEW = [[3, 2, 1, 0], [1, 0, 3, 2]]
PTRS = [1000, 2000]


def _log(acknowledged=True):
    log = []
    for layer in LAYERS:
        evidence = {
            "move": {"probe": [[tag(layer, NEW[layer][s])] * 2 for s in SLOTS], "map_before": BEFORE[layer]},
            "commit": {"map": NEW[layer]},
            "refresh": {"data_ptrs": [PTRS[layer]], "checksums": [layer + 7]},
            "acknowledge": {"pending_result_cleared": True, "checksums": [layer + 7]},
        }
        for kind in COMMIT_ORDER if acknowledged else COMMIT_ORDER[:-1]:
            log.append((kind, "toy/moe", layer, 1, evidence[kind]))
    return log


def _check(log, acknowledged=True):
    return check_commit_order(
        log, LAYERS, local_slots=SLOTS, maps_before=BEFORE, table_ptrs=PTRS, acknowledged=acknowledged
    )


def test_tag_is_exact_and_distinct_per_layer_and_expert():
    assert tag(0, 0) == 1.0
    assert tag(1, 5) == 70.0
    assert len({tag(layer, e) for layer in range(3) for e in range(64)}) == 3 * 64


def test_a_log_in_commit_order_passes_and_returns_the_committed_maps():
    assert _check(_log()) == {0: NEW[0], 1: NEW[1]}
    assert _check(_log(acknowledged=False), acknowledged=False) == {0: NEW[0], 1: NEW[1]}


def _swap_refresh_and_commit(log):
    log[1], log[2] = log[2], log[1]


def _stale_probe(log):
    log[0][4]["probe"] = [[tag(0, BEFORE[0][s])] * 2 for s in SLOTS]


def _table_moved(log):
    log[2][4]["data_ptrs"] = [PTRS[0] + 8]


def _pending_result_kept(log):
    log[3][4]["pending_result_cleared"] = False


def _acknowledged_checksum_differs(log):
    log[3][4]["checksums"] = [99]


def _next_layer_moves_before_acknowledgement(log):
    log[3], log[4] = log[4], log[3]


def _map_before_is_the_new_one(log):
    log[0][4]["map_before"] = NEW[0]


@pytest.mark.parametrize(
    ("break_it", "rule"),
    [
        (
            _swap_refresh_and_commit,
            "layer 0: commit order ['move', 'refresh', 'commit', 'acknowledge'], expected "
            "['move', 'commit', 'refresh', 'acknowledge']",
        ),
        (_stale_probe, "layer 0: at move time the weights do not hold the new placement"),
        (_table_moved, "layer 0: the refresh moved the lookup table's storage"),
        (_pending_result_kept, "layer 0: acknowledged before upstream cleared its pending result"),
        (
            _acknowledged_checksum_differs,
            "layer 0: the lookup checksums at acknowledgement differ from the refresh's",
        ),
        (
            _next_layer_moves_before_acknowledgement,
            "a layer moved before the previous layer was acknowledged",
        ),
        (_map_before_is_the_new_one, "layer 0: at move time the map is not the old placement"),
    ],
)
def test_each_broken_rule_fails_naming_it(break_it, rule):
    """Issue 30: a bare ``pytest.raises(AssertionError)`` passed whichever rule fired; each break must
    fail on its own rule."""
    log = copy.deepcopy(_log())
    log = [list(e) for e in log]
    break_it(log)
    with pytest.raises(AssertionError) as info:
        _check(log)
    assert str(info.value) == rule


def test_an_acknowledgement_missing_from_an_async_commit_fails():
    with pytest.raises(AssertionError) as info:
        _check(_log(acknowledged=False))
    assert str(info.value) == (
        "layer 0: commit order ['move', 'commit', 'refresh'], expected "
        "['move', 'commit', 'refresh', 'acknowledge']"
    )

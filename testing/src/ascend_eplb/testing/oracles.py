"""Oracles the packages' multi-rank tests share: the tagged-weight value and the commit-order check.

Standard library only; what a rank reports is plain data (lists, dicts), so these run in the test
process on the reports of :func:`~ascend_eplb.testing.run_ranks`.

The commit log (``AscendEplbState.commit_log`` with ``collect_commit_evidence``, as the rank modules
report it) is a list of ``(kind, model, layer, rearrangement, evidence)``; per layer the order is
:data:`COMMIT_ORDER` (invariant 6: move, commit, refresh, acknowledge).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["COMMIT_ORDER", "check_commit_order", "tag"]

#: The per-layer order of an asynchronous commit (a synchronous one has no acknowledgement).
COMMIT_ORDER = ("move", "commit", "refresh", "acknowledge")


def tag(layer: int, logical_expert: int) -> float:
    """The value every weight row of ``layer`` holding ``logical_expert`` carries (exact in bf16)."""
    return float(64 * layer + logical_expert + 1)


def check_commit_order(
    events: Sequence[Sequence[Any]],
    layers: Sequence[int],
    *,
    local_slots: Sequence[int],
    maps_before: Sequence[Sequence[int]],
    table_ptrs: Sequence[int],
    acknowledged: bool = True,
    tag_of: Callable[[int, int], float] = tag,
) -> dict[int, list[int]]:
    """Assert one rank's commit-log events of one rearrangement follow the commit order, layer by layer.

    Per layer: the kinds are :data:`COMMIT_ORDER` (without ``acknowledge`` when ``acknowledged`` is
    false: a synchronous commit); at move time every local slot's tagged weights already hold the new
    placement's expert while the map is still the old one (``maps_before[layer]``); the refresh wrote
    the lookup table in place (``table_ptrs[layer]``); the acknowledgement came after upstream cleared
    its pending result, with the lookup checksums of the refresh. With ``acknowledged``, one layer is
    fully acknowledged before the next one moves.

    Args:
        events: the ``(kind, model, layer, rearrangement, evidence)`` tuples of one rearrangement.
        layers: the MoE layers expected to commit, in commit order.
        local_slots: this rank's physical slots (global ids).
        maps_before: per layer, the ``physical_to_logical_map`` row in force before the commit.
        table_ptrs: per layer, the ``data_ptr`` of the layer's lookup table.
        acknowledged: whether each commit is acknowledged (asynchronous commit).
        tag_of: the weight tag of ``(layer, logical_expert)``.

    Returns:
        layer -> the committed ``physical_to_logical_map`` row.

    Raises:
        AssertionError: at the first rule broken.
    """
    order = list(COMMIT_ORDER if acknowledged else COMMIT_ORDER[:-1])
    committed: dict[int, list[int]] = {}
    for layer in layers:
        kinds = [e[0] for e in events if e[2] == layer]
        assert kinds == order, f"layer {layer}: commit order {kinds}, expected {order}"
        ev = {e[0]: e[4] for e in events if e[2] == layer}
        new_map = ev["commit"]["map"]
        # At move time the weights already hold the new placement, the map still the old one.
        assert ev["move"]["probe"] == [[tag_of(layer, new_map[s])] * 2 for s in local_slots], (
            f"layer {layer}: at move time the weights do not hold the new placement"
        )
        assert ev["move"]["map_before"] == maps_before[layer], (
            f"layer {layer}: at move time the map is not the old placement"
        )
        assert ev["refresh"]["data_ptrs"] == [table_ptrs[layer]], (
            f"layer {layer}: the refresh moved the lookup table's storage"
        )
        if acknowledged:
            assert ev["acknowledge"]["pending_result_cleared"] is True, (
                f"layer {layer}: acknowledged before upstream cleared its pending result"
            )
            assert ev["acknowledge"]["checksums"] == ev["refresh"]["checksums"], (
                f"layer {layer}: the lookup checksums at acknowledgement differ from the refresh's"
            )
        committed[layer] = new_map
    if acknowledged:
        # Layer by layer: one layer is fully acknowledged before the next one moves.
        assert [(e[0], e[2]) for e in events] == [(k, layer) for layer in layers for k in COMMIT_ORDER], (
            "a layer moved before the previous layer was acknowledged"
        )
    return committed

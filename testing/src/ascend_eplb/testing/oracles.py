"""Oracles the packages' multi-rank tests share: the tagged-weight value and the commit-order check.

Standard library only, run in the test process on the plain-data reports of
:func:`~ascend_eplb.testing.run_ranks`. A commit log (``AscendEplbState.commit_log`` with
``collect_commit_evidence``) is a list of ``(kind, model, layer, rearrangement, evidence)``.
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
    """Assert one rank's commit-log ``events`` of one rearrangement follow the commit order (invariant 6).

    Per layer of ``layers`` (in commit order): the kinds are :data:`COMMIT_ORDER` (no ``acknowledge``
    unless ``acknowledged``, the asynchronous commit); at move time the tagged weights of every
    ``local_slots`` slot (global ids) hold the new expert (``tag_of(layer, expert)``) while the map is
    ``maps_before[layer]``; the refresh kept the table at ``table_ptrs[layer]``; the acknowledgement
    came after upstream cleared its pending result, with the refresh's checksums; and, acknowledged,
    each layer is done before the next moves. Returns layer -> the committed ``physical_to_logical_map``
    row; ``AssertionError`` at the first rule broken.
    """
    order = list(COMMIT_ORDER if acknowledged else COMMIT_ORDER[:-1])
    committed: dict[int, list[int]] = {}
    for layer in layers:
        kinds = [e[0] for e in events if e[2] == layer]
        assert kinds == order, f"layer {layer}: commit order {kinds}, expected {order}"
        ev = {e[0]: e[4] for e in events if e[2] == layer}
        new_map = ev["commit"]["map"]
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
        assert [(e[0], e[2]) for e in events] == [(k, layer) for layer in layers for k in COMMIT_ORDER], (
            "a layer moved before the previous layer was acknowledged"
        )
    return committed

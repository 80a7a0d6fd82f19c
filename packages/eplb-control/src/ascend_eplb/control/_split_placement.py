"""Placement for the batch split: replicas that link ranks (:class:`~.policy.SplitAwarePolicy`'s last step).

The data plane's batch split moves a batch's selections only between the ranks of one expert's replicas,
so what it can reach (``measures.split_bound``) depends on the *replica graph*: ranks as nodes, an edge
between two ranks for each logical expert with replicas on both. A placement planned for the equal
split packs replicas by average load and often leaves that graph in pieces (on the ESFT trace at 72
slots, upstream's placement splits most layers' 8 ranks into 2 to 4 groups no batch can balance
between). DeepSeek's LPLB lays replicas out as a cube or torus for that reason.

:func:`link_replicas` swaps slots, a few per layer, each exchanging one replica of a replicated expert
with a single-replica expert on another rank: the swap leaving the fewest pieces, then the most
distinct linked rank pairs, then the smallest rise of the heaviest rank's load, first; a swap is taken
only if the split bound of the planned load does not fall. Shapes: L layers, E logical experts, P
slots, N ranks, C candidate swaps.
"""

from __future__ import annotations

import numpy as np

from ascend_eplb.control.measures import SPLIT_BOUND_ENUMERATED_RANKS, _closure_peak, _enumerated_peak

#: Candidates whose split bound is computed per swap, best ranked first, before the layer stops.
_BOUND_TRIES = 8


def _peak(load: np.ndarray, held: np.ndarray) -> np.ndarray:
    """``(C,)`` split-bound peaks of one layer's ``load (E,)`` under ``held (C, N, E)``."""
    if held.shape[1] <= SPLIT_BOUND_ENUMERATED_RANKS:
        return _enumerated_peak(np.broadcast_to(load, (held.shape[0], load.shape[0])), held)
    return np.array([_closure_peak(load, h) for h in held])


def _graph(held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(pieces (C,), links (C,))`` of the replica graphs of ``held (C, N, E)``."""
    num = held.shape[1]
    shared = held.astype(np.int32)
    linked = np.matmul(shared, shared.transpose(0, 2, 1)) > 0  # (C, N, N): an expert on both ranks
    eye = np.eye(num, dtype=bool)
    links = (linked & ~eye).sum(axis=(1, 2)) // 2
    reach = linked | eye
    for _ in range(max(1, int(np.ceil(np.log2(num))))):
        reach = np.matmul(reach.astype(np.int32), reach.astype(np.int32)) > 0
    pieces = (1.0 / reach.sum(axis=2)).sum(axis=1)
    return np.rint(pieces).astype(np.int64), links


def _holdings(rows: np.ndarray, num_ranks: int, num_experts: int) -> np.ndarray:
    """bool ``(C, N, E)`` of placements ``rows (C, P)``."""
    held = np.zeros((rows.shape[0], num_ranks, num_experts), dtype=bool)
    slot_rank = np.arange(rows.shape[1]) // (rows.shape[1] // num_ranks)
    held[np.arange(rows.shape[0])[:, None], slot_rank[None, :], rows] = True
    return held


def _candidates(row: np.ndarray, load: np.ndarray, num_ranks: int, num_nodes: int) -> np.ndarray:
    """int64 ``(C, 2)`` slot pairs ``(s1, s2)``: ``s1`` a replica of an expert with two or more, ``s2``
    the lightest single-replica slot of another rank of the same node that lacks the replica's expert,
    whose expert is not on ``s1``'s rank (ties to the lowest slot)."""
    ranks_per_node = num_ranks // num_nodes
    per_rank = row.shape[0] // num_ranks
    count = np.bincount(row, minlength=load.shape[0])
    held = _holdings(row[None], num_ranks, load.shape[0])[0]  # (N, E)
    share = load[row] / count[row]
    pairs = []
    for s1 in np.nonzero(count[row] > 1)[0]:
        x, a = row[s1], s1 // per_rank
        for c in range(num_ranks):
            if c == a or held[c, x] or c // ranks_per_node != a // ranks_per_node:
                continue
            slots = np.arange(c * per_rank, (c + 1) * per_rank)
            ok = slots[(count[row[slots]] == 1) & ~held[a, row[slots]]]
            if ok.size:
                pairs.append((s1, ok[np.argmin(share[ok])]))
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def link_replicas(
    load: np.ndarray, placement: np.ndarray, num_ranks: int, num_nodes: int, max_swaps: int
) -> np.ndarray:
    """``placement (L, P)`` with at most ``max_swaps`` swaps per layer that link its replica graph
    (module docstring), each inside a node (``num_nodes``, the hierarchical policy's); deterministic.
    ``load (L, E)`` is the planned load."""
    out = placement.copy()
    num_experts = load.shape[1]
    per_rank = placement.shape[1] // num_ranks
    for layer in range(out.shape[0]):
        row, weight = out[layer], load[layer]
        for _ in range(max_swaps):
            pairs = _candidates(row, weight, num_ranks, num_nodes)
            if not pairs.size:
                break
            rows = np.repeat(row[None], len(pairs) + 1, axis=0)
            index = np.arange(1, len(pairs) + 1)
            rows[index, pairs[:, 0]], rows[index, pairs[:, 1]] = row[pairs[:, 1]], row[pairs[:, 0]]
            held = _holdings(rows, num_ranks, num_experts)
            pieces, links = _graph(held)
            count = np.bincount(row, minlength=num_experts)
            share = weight / np.maximum(count, 1)
            peak = np.stack(
                [np.bincount(np.arange(r.size) // per_rank, share[r], num_ranks) for r in rows]
            ).max(1)
            better = (pieces[1:] < pieces[0]) | ((pieces[1:] == pieces[0]) & (links[1:] > links[0]))
            order = np.lexsort((pairs[:, 1], pairs[:, 0], peak[1:], -links[1:], pieces[1:]))
            order = [i for i in order if better[i]][:_BOUND_TRIES]
            if not order:
                break
            bounds = _peak(weight, held[[0, *(i + 1 for i in order)]])
            taken = next(
                (i for i, b in zip(order, bounds[1:], strict=True) if b <= bounds[0] * (1 + 1e-12)), None
            )
            if taken is None:
                break
            row[:] = rows[taken + 1]
    return out

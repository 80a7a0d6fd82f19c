"""Migration-aware EPLB policy: the fewest expert moves for the balancedness upstream's default reaches.

Upstream's :class:`DefaultEplbPolicy` recomputes every placement and re-places 80-90 % of the slots a
rearrangement on real load (``shared/notes/placement-cost.md``); :class:`MigrationAwarePolicy` starts
from the placement in force and changes only what buys upstream's balance on the same load. It is judged
by :func:`balancedness` and :func:`moved_experts` (re-exported from :mod:`ascend_eplb.control.measures`,
their one definition). Placements are int64 ``(L, P)``, ``-1`` an empty slot of elastic padding.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ascend_eplb.control._search import local_search
from ascend_eplb.control._split_placement import link_replicas
from ascend_eplb.control.measures import (
    _balancedness,
    _check_ids,
    _check_num_ranks,
    _holdings,
    _load_array,
    _placement_array,
    _rank_loads,
    _replica_counts,
    balancedness,
    moved_experts,
)
from ascend_eplb.control.values import is_int

#: ``balancedness`` and ``moved_experts`` are :mod:`ascend_eplb.control.measures`' (re-exported here,
#: beside the policy they judge).
__all__ = ["MigrationAwarePolicy", "SplitAwarePolicy", "balancedness", "moved_experts"]

# ----------------------------------------------------------------------------------------------------
# The policy


class MigrationAwarePolicy(AbstractEplbPolicy):
    """Upstream's policy interface; from the placement in force, the fewest moves for upstream's balance.

    Per ``rebalance_experts`` call (README "Migration-aware policy"): upstream's default on the same input
    gives each layer's target balancedness ``b_up`` (without an old placement its result is returned);
    a local search (:mod:`._search`) from the old placement, all layers in lockstep, applies the change
    with the largest reduction of the excess over the peak ``mean / (b_up - balancedness_tolerance)`` per
    move; a layer more than ``fallback_margin`` short is searched again by gain alone, then takes
    upstream's layer aligned to the old placement. Hierarchical placement (``num_groups % num_nodes ==
    0``, more than one node) keeps every replica on its group's node, as upstream does. Deterministic
    (ties to the lowest index, float64 in a fixed order): every rank gets the same answer.
    """

    #: The search stops a layer at ``b_up - balancedness_tolerance`` (per layer; the layers' mean ends
    #: within it of upstream's). Issue 27's targets are 0.005 (ESFT) and 0.01 (DeepSeek-V3 size).
    balancedness_tolerance: ClassVar[float] = 0.002
    #: A layer whose search ends more than this below ``b_up`` takes upstream's layer (aligned).
    fallback_margin: ClassVar[float] = 0.01
    #: Place for the data plane's batch split: a last step swaps replicas so that they link ranks
    #: (:mod:`._split_placement`), at most :attr:`split_swaps` per layer (None: N); see
    #: :class:`SplitAwarePolicy`.
    place_for_split: ClassVar[bool] = False
    split_swaps: ClassVar[int | None] = None

    @classmethod
    def rebalance_experts(
        cls,
        weight: torch.Tensor,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The new placement: int64 ``(L, P)`` on CPU, every logical expert placed, no empty slot.

        Args:
            weight: ``(L, E)`` global load per logical expert (int or float, any device), the closed
                window upstream's ``EplbState.rearrange`` all-reduced.
            num_replicas: P, physical experts per layer (upstream's name), a multiple of ``num_ranks``,
                at least E.
            num_groups: expert groups (``E`` a multiple of it where the hierarchical policy applies).
            num_nodes: nodes; ``num_ranks`` a multiple of it.
            num_ranks: N, EP ranks.
            old_global_expert_indices: the placement in force, integer ``(L, P)`` with ids in
                ``[0, E)`` or -1, every logical expert placed in every layer; ``None``: upstream's result.
                Wider than ``num_replicas`` (upstream's elastic-EP scale-down,
                ``EplbState.rearrange(rank_mapping=...)``, passes the map of the larger EP size):
                upstream's result, as there is no placement of the new size to start from.

        Raises:
            ValueError: naming the value and the rule, before anything is computed.
        """
        if (
            isinstance(old_global_expert_indices, torch.Tensor)
            and old_global_expert_indices.dim() == 2
            and is_int(num_replicas)
            and old_global_expert_indices.shape[1] > num_replicas
        ):
            _check_policy_inputs(weight, num_replicas, num_groups, num_nodes, num_ranks, None)
            return DefaultEplbPolicy.rebalance_experts(
                weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
            )
        load, old = _check_policy_inputs(
            weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
        )
        upstream = DefaultEplbPolicy.rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
        )
        hierarchical = num_groups % num_nodes == 0 and num_nodes > 1
        if old is None:
            return cls._for_split(load, upstream, num_ranks, num_nodes if hierarchical else 1)
        placement = _migrate(
            load,
            old,
            upstream.numpy().astype(np.int64, copy=False),
            num_ranks=num_ranks,
            num_nodes=num_nodes if hierarchical else 1,
            num_groups=num_groups if hierarchical else 1,
            tolerance=cls.balancedness_tolerance,
            fallback_margin=cls.fallback_margin,
        )
        return cls._for_split(load, torch.from_numpy(placement), num_ranks, num_nodes if hierarchical else 1)

    @classmethod
    def _for_split(
        cls, load: np.ndarray, placement: torch.Tensor, num_ranks: int, num_nodes: int
    ) -> torch.Tensor:
        if not cls.place_for_split:
            return placement
        swaps = num_ranks if cls.split_swaps is None else cls.split_swaps
        linked = link_replicas(load, placement.numpy().astype(np.int64), num_ranks, num_nodes, swaps)
        return torch.from_numpy(linked)


class SplitAwarePolicy(MigrationAwarePolicy):
    """:class:`MigrationAwarePolicy` placing for the data plane's batch split (policy ``split_aware``):
    its placement, then up to N swaps per layer (inside a node) exchanging a replica with a single-replica
    expert of another rank, fewest pieces of the replica graph first, then the most distinct linked rank
    pairs, never lowering the planned load's split bound (:mod:`._split_placement`; LPLB's cube and torus
    layouts serve the same end). Moves a few more experts than its base; the bound it allows per batch:
    the dataplane README's "Batch split" table."""

    place_for_split: ClassVar[bool] = True


def _check_policy_inputs(
    weight: object,
    num_replicas: object,
    num_groups: object,
    num_nodes: object,
    num_ranks: object,
    old: object,
) -> tuple[np.ndarray, np.ndarray | None]:
    load = _load_array(weight)
    num_layers, num_logical = load.shape
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1")
    if not is_int(num_replicas) or num_replicas < num_logical:
        raise ValueError(
            f"num_replicas={num_replicas!r}: must be an int >= the logical experts per layer E={num_logical}"
        )
    _check_num_ranks(num_ranks, num_replicas)
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks}: must be a multiple of num_nodes={num_nodes}")
    if num_groups % num_nodes == 0 and num_logical % num_groups:
        raise ValueError(
            f"num_groups={num_groups}: must divide the logical experts E={num_logical} where the "
            f"hierarchical policy applies (num_groups % num_nodes == 0, num_nodes={num_nodes})"
        )
    if old is None:
        return load, None
    placement = _placement_array("old_global_expert_indices", old)
    if placement.shape != (num_layers, num_replicas):
        raise ValueError(
            f"old_global_expert_indices has shape {placement.shape}: it must be (L, P) = "
            f"({num_layers}, {num_replicas})"
        )
    _check_ids("old_global_expert_indices", placement, num_logical)
    missing = _replica_counts(placement, num_logical) == 0
    if missing.any():
        layer, expert = (int(i[0]) for i in np.nonzero(missing))
        raise ValueError(
            f"old_global_expert_indices: layer {layer} places no slot of logical expert {expert}: every "
            "logical expert must be placed in every layer"
        )
    return load, placement


def _group_presence(placement: np.ndarray, num_groups: int, num_nodes: int, num_logical: int) -> np.ndarray:
    """bool ``(L, G, nodes)``: whether a filled slot of each expert group lies on each node."""
    num_layers, num_physical = placement.shape
    filled = placement >= 0
    groups = np.where(filled, placement, 0) // (num_logical // num_groups)
    nodes = np.broadcast_to(np.arange(num_physical) // (num_physical // num_nodes), placement.shape)
    rows = np.broadcast_to(np.arange(num_layers)[:, None], placement.shape)
    present = np.zeros((num_layers, num_groups, num_nodes), dtype=bool)
    present[rows[filled], groups[filled], nodes[filled]] = True
    return present


def _follows_node_grouping(
    placement: np.ndarray, num_groups: int, num_nodes: int, num_logical: int
) -> np.ndarray:
    """bool ``(L,)``: the filled slots of each expert group lie on one node."""
    present = _group_presence(placement, num_groups, num_nodes, num_logical)
    return (present.sum(axis=2) <= 1).all(axis=1)


def _group_nodes(placement: np.ndarray, num_groups: int, num_nodes: int, num_logical: int) -> np.ndarray:
    """int64 ``(L, G)``: the node of each expert group's first filled slot (its node where the layer
    follows the node grouping)."""
    return _group_presence(placement, num_groups, num_nodes, num_logical).argmax(axis=2)


def _node_balancedness(load: np.ndarray, group_node: np.ndarray, num_nodes: int) -> np.ndarray:
    """float64 ``(L,)``: mean node load / max node load when expert groups sit on ``group_node``
    ``(L, G)``: the most any placement of those groups reaches."""
    group_load = load.reshape(load.shape[0], group_node.shape[1], -1).sum(axis=2)
    node_load = np.zeros((load.shape[0], num_nodes))
    np.add.at(
        node_load,
        (np.broadcast_to(np.arange(load.shape[0])[:, None], group_node.shape), group_node),
        group_load,
    )
    return _balancedness(node_load)


def _aligned_group_nodes(
    upstream: np.ndarray, old: np.ndarray, num_groups: int, num_nodes: int, num_logical: int
) -> np.ndarray:
    """Upstream's (balanced) group-to-node packing ``(L, G)``, its nodes renamed (greedy overlap) so that
    the most of ``old``'s experts are already on their group's node."""
    num_layers = old.shape[0]
    up_node = _group_nodes(upstream, num_groups, num_nodes, num_logical)
    present = _holdings(old, num_nodes, num_logical) > 0  # (L, nodes, E)
    on_old_node = present.reshape(num_layers, num_nodes, num_groups, -1).sum(axis=3)  # (L, nodes, G)
    onehot = up_node[:, :, None] == np.arange(num_nodes)  # (L, G, nodes)
    overlap = np.matmul(onehot.transpose(0, 2, 1).astype(np.float64), on_old_node.transpose(0, 2, 1))
    rename = _greedy_match(overlap)  # upstream node -> old node
    return np.take_along_axis(rename, up_node, axis=1)


def _regroup(old: np.ndarray, group_node: np.ndarray, num_logical: int, num_nodes: int) -> np.ndarray:
    """A start close to ``old`` ``(L, P)`` with each expert group's slots on its node of ``group_node``.

    A slot keeps its expert where the expert's group is on the slot's node and is emptied (-1)
    otherwise; each expert its node lacks fills an empty slot of the node, in slot order (a node short
    of empty slots first empties duplicate slots, the last ones first). The search fills the remaining
    empty slots.
    """
    num_layers, num_physical = old.shape
    group_size = num_logical // group_node.shape[1]
    slots_per_node = num_physical // num_nodes
    rows = np.arange(num_layers)
    slot_node = np.arange(num_physical) // slots_per_node
    start = np.where(
        (old >= 0) & (group_node[rows[:, None], np.maximum(old, 0) // group_size] == slot_node), old, -1
    )
    expert_node = group_node[:, np.arange(num_logical) // group_size]  # (L, E)
    by_node = start.reshape(num_layers, num_nodes, slots_per_node)
    held = _holdings(start, num_nodes, num_logical) > 0
    missing = ~held[rows[:, None], expert_node, np.arange(num_logical)]  # (L, E)
    onehot = missing[:, None, :] & (expert_node[:, None, :] == np.arange(num_nodes)[None, :, None])
    short = onehot.sum(axis=2) - (by_node < 0).sum(axis=2)  # (L, nodes)
    if (short > 0).any():
        same = by_node[..., :, None] == by_node[..., None, :]
        duplicate = (by_node >= 0) & np.tril(same, k=-1).any(axis=3)
        last_first = np.cumsum(duplicate[..., ::-1], axis=2)[..., ::-1]
        by_node[duplicate & (last_first <= short[..., None])] = -1
    empty = by_node < 0
    slot_of_rank = np.zeros_like(by_node)
    layer_i, node_i, slot_i = np.nonzero(empty)
    slot_of_rank[layer_i, node_i, (np.cumsum(empty, axis=2) - 1)[layer_i, node_i, slot_i]] = slot_i
    miss_rank = np.cumsum(onehot, axis=2) - 1  # (L, nodes, E): each missing expert's rank on its node
    layer_i, expert_i = np.nonzero(missing)
    node_i = expert_node[layer_i, expert_i]
    by_node[layer_i, node_i, slot_of_rank[layer_i, node_i, miss_rank[layer_i, node_i, expert_i]]] = expert_i
    return by_node.reshape(num_layers, num_physical)


def _migrate(
    load: np.ndarray,
    old: np.ndarray,
    upstream: np.ndarray,
    *,
    num_ranks: int,
    num_nodes: int,
    num_groups: int,
    tolerance: float,
    fallback_margin: float,
) -> np.ndarray:
    num_logical = load.shape[1]
    target = _balancedness(_rank_loads(load, upstream, _replica_counts(upstream, num_logical), num_ranks))

    def reached(placement: np.ndarray, layers: np.ndarray) -> np.ndarray:
        counts = _replica_counts(placement, num_logical)
        return _balancedness(_rank_loads(load[layers], placement, counts, num_ranks))

    everything = np.arange(load.shape[0])
    start = old
    if num_nodes > 1:
        # A layer that must change regroups onto upstream's node packing (nodes renamed to keep the most)
        # when its old placement breaks the node grouping or its groups' nodes cannot carry the target.
        grouped = _follows_node_grouping(old, num_groups, num_nodes, num_logical)
        old_nodes = _group_nodes(old, num_groups, num_nodes, num_logical)
        regroup = ~grouped | (_node_balancedness(load, old_nodes, num_nodes) < target - tolerance)
        regroup &= (reached(old, everything) < target - tolerance) | (old < 0).any(axis=1)
        if regroup.any():
            start = old.copy()
            nodes = _aligned_group_nodes(upstream[regroup], old[regroup], num_groups, num_nodes, num_logical)
            start[regroup] = _regroup(old[regroup], nodes, num_logical, num_nodes)

    new = local_search(load, start, old, target - tolerance, num_ranks, num_nodes)
    short = np.nonzero(reached(new, everything) < target - fallback_margin)[0]
    if short.size:  # a greedy dead end (a cheap change that blocks the way): again, by gain alone
        again = local_search(
            load[short],
            start[short],
            old[short],
            target[short] - tolerance,
            num_ranks,
            num_nodes,
            by_gain=True,
        )
        better = reached(again, short) >= target[short] - fallback_margin
        new[short[better]] = again[better]
        short = short[~better]
    if short.size:
        new[short] = _align_to_old(upstream[short], old[short], num_ranks, num_nodes, num_logical)
    return new


def _greedy_match(overlap: np.ndarray) -> np.ndarray:
    """``(L, K, K)`` overlap of new block i with old block j -> int64 ``(L, K)``: the old position of each
    new block, largest overlap first (ties to the lowest index)."""
    num_layers, k, _ = overlap.shape
    overlap = overlap.astype(np.float64, copy=True)
    target = np.empty((num_layers, k), dtype=np.int64)
    rows = np.arange(num_layers)
    for _ in range(k):
        flat = overlap.reshape(num_layers, -1).argmax(axis=1)
        i, j = np.divmod(flat, k)
        target[rows, i] = j
        overlap[rows, i, :] = -np.inf
        overlap[rows, :, j] = -np.inf
    return target


def _permute_blocks(placement: np.ndarray, target: np.ndarray, block: int) -> np.ndarray:
    """Move block i (``block`` slots) of each layer to block ``target[l, i]``."""
    num_layers, num_physical = placement.shape
    k = num_physical // block
    out = np.empty_like(placement)
    rows = np.arange(num_layers)[:, None, None]
    dest = target[:, :, None] * block + np.arange(block)
    out[rows, dest] = placement.reshape(num_layers, k, block)
    return out


def _align_to_old(
    new: np.ndarray, old: np.ndarray, num_ranks: int, num_nodes: int, num_logical: int
) -> np.ndarray:
    """``new`` with whole nodes, ranks within a node, and slots within a rank permuted to keep what
    ``old`` holds (the same balance: the permutation keeps each rank's experts and each node's ranks)."""
    num_layers, num_physical = new.shape
    slots_per_rank = num_physical // num_ranks
    ranks_per_node = num_ranks // num_nodes
    if num_nodes > 1:
        shape = (num_layers, num_nodes, num_logical)
        new_n = _holdings(new, num_nodes, num_logical).reshape(shape)
        old_n = _holdings(old, num_nodes, num_logical).reshape(shape)
        overlap = np.minimum(new_n[:, :, None, :], old_n[:, None, :, :]).sum(axis=3)
        new = _permute_blocks(new, _greedy_match(overlap), num_physical // num_nodes)
    new_r = (_holdings(new, num_ranks, num_logical) > 0).astype(np.float32)
    old_r = (_holdings(old, num_ranks, num_logical) > 0).astype(np.float32)
    overlap = np.matmul(new_r, old_r.transpose(0, 2, 1)).astype(np.float64)
    node = np.arange(num_ranks) // ranks_per_node
    overlap[:, node[:, None] != node[None, :]] = -1.0  # ranks keep their node
    new = _permute_blocks(new, _greedy_match(overlap), slots_per_rank)
    # Slots: an expert the rank held keeps its old slot; the others fill the free slots in order.
    new_s = new.reshape(-1, slots_per_rank)
    old_s = old.reshape(-1, slots_per_rank)
    rows = np.arange(new_s.shape[0])
    out = np.full_like(new_s, -1)
    used = np.zeros(new_s.shape, dtype=bool)
    for k in range(slots_per_rank):
        match = (new_s == old_s[:, k : k + 1]) & ~used
        has = match.any(axis=1)
        first = match.argmax(axis=1)
        out[has, k] = old_s[has, k]
        used[rows[has], first[has]] = True
    source = np.argsort(used, axis=1, kind="stable")
    free = np.argsort(out >= 0, axis=1, kind="stable")
    fill = np.arange(slots_per_rank)[None, :] < (~used).sum(axis=1)[:, None]
    r, c = np.nonzero(fill)
    out[r, free[r, c]] = new_s[r, source[r, c]]
    return out.reshape(num_layers, num_physical)

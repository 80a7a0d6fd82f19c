"""Migration-aware EPLB policy: the fewest expert moves for the balancedness upstream's default reaches.

Glossary (DESIGN.md section 2). A *logical expert* is an expert of the model definition; a *physical
expert* (slot) is one installed copy of a logical expert's weights; slots beyond the logical count are
*redundant experts*. A *placement* is ``physical_to_logical`` ``(L, P)`` (int64, ``-1`` = an empty slot
of elastic padding); slot ``s`` lives on rank ``s // p`` with ``p = P / N`` slots per rank, and rank
``r`` on node ``r // (N / num_nodes)``.

The two measures it is judged by, re-exported from :mod:`ascend_eplb.control.measures` (the one
definition of each for the whole project, ``shared/notes/placement-cost.md``):

* :func:`balancedness` ``(L,)``: each logical expert's load split evenly over its replicas, a rank's
  load the sum over its slots, and per layer mean rank load / max rank load (1.0 = even);
* :func:`moved_experts` ``(L,)``: per layer, over ranks, the logical experts a rank holds after a
  rearrangement that it did not hold before (an expert already on the rank is a local copy, not a
  transfer; upstream's ``rearrange_expert_weights_inplace`` counts it the same way).

:class:`MigrationAwarePolicy` is an upstream :class:`AbstractEplbPolicy`, run by upstream's worker, its
result moved by upstream's transaction. Upstream's :class:`DefaultEplbPolicy` recomputes every placement
from scratch and re-places 80-90 % of the slots per rearrangement on real load
(``shared/notes/placement-cost.md``); this policy starts from the placement in force and changes only
what buys the balance upstream's default reaches on the same load (its result computes the target).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

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
__all__ = ["MigrationAwarePolicy", "balancedness", "moved_experts"]

#: The search ranks a change by its excess reduction per move; a change that moves nothing (a local copy)
#: or undoes an earlier move counts as this many moves (measured on the benchmark's ESFT windows: 0.25,
#: 0.5 and 1.0 give 213, 216 and 226 moves; 0.25 prefers a useless local duplicate to a real fix).
_FREE_CHANGE_COST = 0.5


# ----------------------------------------------------------------------------------------------------
# The policy


class MigrationAwarePolicy(AbstractEplbPolicy):
    """Upstream's policy interface; from the placement in force, the fewest moves for upstream's balance.

    Per call (``rebalance_experts``, vLLM's classmethod signature):

    1. Upstream's ``DefaultEplbPolicy.rebalance_experts`` on the same input gives, per layer, the
       balancedness to reach (``b_up``). Without an old placement its result is returned as it is.
    2. A local search from the old placement, all layers in lockstep (one change per layer and
       iteration; numpy over whole tensors, no loop over slots or layers). The donor is the heaviest
       rank ``h``; the candidates are (a) re-point a slot whose expert keeps another replica (or an empty
       slot) to one of ``h``'s experts: every rank holding it gets lighter, at most 1 move; and (b) swap
       a slot of ``h`` with a slot of another rank, at most 2 moves. The objective is the excess over the
       target peak ``T = mean rank load / (b_up - balancedness_tolerance)``, summed over ranks; the change
       with the largest excess reduction per move is applied (moves counted exactly as
       :func:`moved_experts` does; a local copy or a change undoing an earlier move counts as half a
       move). A layer stops when its peak is at most ``T`` or no change reduces the excess; every applied
       change reduces it, so the search ends (capped at ``5 P`` iterations). Empty slots left then take
       their node's expert with the largest load per replica (upstream's ``replicate_experts`` rule), on
       the lightest rank first, and the search resumes.
    3. A layer left more than ``fallback_margin`` below ``b_up`` (a greedy dead end: a cheap change that
       blocks the way) is searched again with the largest excess reduction first, fewer moves only on a
       tie; still short, it takes upstream's layer, its nodes, ranks and slots aligned to the old
       placement (greedy overlap) to keep what it can.

    Hierarchical placement (``num_groups % num_nodes == 0`` and ``num_nodes > 1``): upstream packs expert
    groups (``E / num_groups`` consecutive experts) onto nodes and keeps every replica of an expert on
    its group's node; so does this policy. The search changes only slots of the donor's node, for
    experts of that node's groups (a node whose groups carry more than ``T`` per rank aims at its own
    mean). A layer whose old placement breaks the grouping (upstream's initial placement, experts in
    order then the redundant slots appended), or whose groups' nodes cannot carry ``b_up -
    balancedness_tolerance``, starts from upstream's group-to-node packing, its nodes renamed to keep
    the most of the old placement: slots whose expert's group stays on their node keep it, the
    experts a node lacks fill its other slots, the rest are emptied for the search. A layer whose old
    placement already reaches ``b_up - balancedness_tolerance`` is kept as it is, grouped or not.

    ``-1`` slots of the old placement (elastic scale-up) are empty slots to fill. Deterministic (ties go
    to the lowest index; float64 host arithmetic in a fixed order, so every rank's worker gets the same
    answer), valid (every logical expert placed in every layer, no empty slot, int64 CPU ``(L, P)``);
    about 0.15 s of CPU time a call at DeepSeek-V3 size on one thread, upstream's policy (which it runs)
    0.05 s of it (figures in the control README, from ``benchmarks/bench_policy.py``).
    """

    #: The search stops a layer at ``b_up - balancedness_tolerance`` (per layer; the layers' mean ends
    #: within it of upstream's). Issue 27's targets are 0.005 (ESFT) and 0.01 (DeepSeek-V3 size).
    balancedness_tolerance: ClassVar[float] = 0.002
    #: A layer whose search ends more than this below ``b_up`` takes upstream's layer (aligned).
    fallback_margin: ClassVar[float] = 0.01

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
        """The new placement: int64 ``(L, P)`` on CPU, every logical expert placed in every layer.

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
        if old is None:
            return upstream
        hierarchical = num_groups % num_nodes == 0 and num_nodes > 1
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
        return torch.from_numpy(placement)


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

    new = _local_search(load, start, old, target - tolerance, num_ranks, num_nodes)
    short = np.nonzero(reached(new, everything) < target - fallback_margin)[0]
    if short.size:  # a greedy dead end (a cheap change that blocks the way): again, by gain alone
        again = _local_search(
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


def _with_empty(values: np.ndarray, fill: float) -> np.ndarray:
    """``(n, E)`` -> ``(n, 1 + E)``: column 0 stands for an empty slot (expert id -1, index 0)."""
    return np.concatenate([np.full((values.shape[0], 1), fill, dtype=values.dtype), values], axis=1)


def _local_search(
    load: np.ndarray,
    start: np.ndarray,
    old: np.ndarray,
    target: np.ndarray,
    num_ranks: int,
    num_nodes: int,
    *,
    by_gain: bool = False,
) -> np.ndarray:
    """The search of :class:`MigrationAwarePolicy` step 2 from ``start`` (moves counted from ``old``);
    ``by_gain``: the largest excess reduction wins, fewer moves only on a tie.

    Expert ids are shifted by one inside (index 0: an empty slot, no load, never moved by a swap).
    """
    num_physical = old.shape[1]
    num_logical = load.shape[1]
    slots_per_rank = num_physical // num_ranks
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = num_physical // num_nodes
    placement = start + 1
    counts = _replica_counts(start, num_logical)
    held = _holdings(start, num_ranks, num_logical, with_empty=True)  # (L, N, 1 + E)
    held_before = _holdings(old, num_ranks, num_logical, with_empty=True) > 0
    held_before[:, :, 0] = True  # an empty slot costs nothing to leave
    # The peak rank load each layer must reach, per node: mean / target balancedness, or the node's own
    # mean rank load where its groups carry more (moves stay in the node); a layer without load is done.
    node_mean = _rank_loads(load, start, counts, num_nodes) / ranks_per_node  # (L, nodes)
    mean = load.sum(axis=1, keepdims=True) / num_ranks
    node_cap = np.maximum(mean / np.maximum(target, 1e-12)[:, None], node_mean)
    active = load.sum(axis=1) > 0
    slot_rank = np.arange(slots_per_node) // slots_per_rank  # rank of a node-local slot, within the node
    donor_slot = np.arange(slots_per_rank)
    for _ in range(5 * num_physical):
        layer = np.nonzero(active)[0]
        if not layer.size:
            break
        w = _with_empty(load[layer], 0.0)
        cnt = _with_empty(counts[layer], 2)  # an empty slot: w / (2 - 1) - w / 2 = 0 when it is taken
        per_replica = w / np.maximum(cnt, 1)
        loads = np.take_along_axis(per_replica, placement[layer], axis=1)
        loads = loads.reshape(layer.size, num_ranks, slots_per_rank).sum(axis=2)
        heaviest = loads.argmax(axis=1)
        peak = loads[np.arange(layer.size), heaviest]
        cap = node_cap[layer, heaviest // ranks_per_node]
        go = peak > cap * (1 + 1e-12)
        has_empty = (placement[layer] == 0).any(axis=1)
        active[layer[~go & ~has_empty]] = False
        _fill_one(load, placement, counts, held, layer[~go & has_empty], num_ranks, num_nodes)
        if not go.any():
            continue
        layer, w, cnt, per_replica, loads = layer[go], w[go], cnt[go], per_replica[go], loads[go]
        heaviest, peak, cap = heaviest[go], peak[go], cap[go]
        n = layer.size
        row = np.arange(n)
        # The donor's node: its ranks and slots (the whole layer when not hierarchical).
        node = heaviest // ranks_per_node
        node_ranks = node[:, None] * ranks_per_node + np.arange(ranks_per_node)
        node_slots = node[:, None] * slots_per_node + np.arange(slots_per_node)
        donor = heaviest - node * ranks_per_node
        node_loads = np.take_along_axis(loads, node_ranks, axis=1)  # (n, R)
        experts = np.take_along_axis(placement[layer], node_slots, axis=1)  # (n, S)
        lay2, lay3 = layer[:, None], layer[:, None, None]
        slot_ranks = node_ranks[:, slot_rank]  # (n, S): each node slot's rank
        excess = np.maximum(node_loads - cap[:, None], 0.0)
        donor_slots = donor[:, None] * slots_per_rank + donor_slot  # (n, p), node-local
        donor_experts = np.take_along_axis(experts, donor_slots, axis=1)
        donor_per_replica = np.take_along_axis(per_replica, donor_experts, axis=1)
        y_held = held[lay2, slot_ranks, experts]  # (n, S)
        y_leaves = ~held_before[lay2, slot_ranks, experts] & (y_held == 1)

        # (a) re-point slot s (expert y: empty, or keeping another replica) to donor expert x: (n, X, K),
        # over the K re-pointable slots only (padded; a node has few redundant slots).
        cnt_s = np.take_along_axis(cnt, experts, axis=1)
        free = (cnt_s >= 2) | (experts == 0)
        cand = np.argsort(~free, axis=1, kind="stable")[:, : max(int(free.sum(axis=1).max()), 1)]
        y = np.take_along_axis(experts, cand, axis=1)  # (n, K)
        y_rank = slot_rank[cand]
        x = donor_experts  # (n, X = p)
        repointable = np.take_along_axis(free, cand, axis=1)[:, None, :] & (y[:, None, :] != x[:, :, None])
        repointable &= (x > 0)[:, :, None]
        cnt_y = np.where(repointable, np.take_along_axis(cnt, y, axis=1)[:, None, :], 2)
        w_y = np.take_along_axis(w, y, axis=1)[:, None, :]
        cnt_x = np.take_along_axis(cnt, x, axis=1)[:, :, None]
        w_x = np.take_along_axis(w, x, axis=1)[:, :, None]
        d_x = w_x / (cnt_x + 1) - w_x / cnt_x  # (n, X, 1): each replica of x gets lighter
        d_y = w_y / (cnt_y - 1) - w_y / cnt_y  # (n, X, K): each other replica of y gets heavier
        held_x = held[lay3, node_ranks[:, :, None], x[:, None, :]]  # (n, R, X)
        held_y = held[lay3, node_ranks[:, :, None], y[:, None, :]]  # (n, R, K)
        own_delta = w_x / (cnt_x + 1) - w_y / (cnt_y - 1)  # (n, X, K): the slot's own rank, x in, y out
        own = y_rank[:, None, :] == np.arange(ranks_per_node)[None, :, None]  # (n, R, K)
        after = (
            node_loads[:, None, :, None]
            + held_x.transpose(0, 2, 1)[:, :, :, None] * d_x[:, :, :, None]
            + held_y[:, None, :, :] * d_y[:, :, None, :]
            + own[:, None] * own_delta[:, :, None, :]
        )  # (n, X, R, K)
        gain_a = excess.sum(axis=1)[:, None, None] - np.maximum(after - cap[:, None, None, None], 0.0).sum(
            axis=2
        )
        y_ranks = np.take_along_axis(slot_ranks, cand, axis=1)[:, None, :]
        x_there = held[lay3, y_ranks, x[:, :, None]] > 0
        x_there |= held_before[lay3, y_ranks, x[:, :, None]]
        cost_a = (~x_there).astype(np.int64) - np.take_along_axis(y_leaves, cand, axis=1)[:, None, :]
        gain_a = np.where(repointable, gain_a, -np.inf)

        # (b) swap donor slot i (expert a) with slot j (expert b) of another rank of the node: (n, p, S).
        moved = donor_per_replica[:, :, None] - np.take_along_axis(per_replica, experts, axis=1)[:, None, :]
        other = node_loads[:, slot_rank]  # (n, S): the load of slot j's rank
        gain_b = (
            excess[row, donor][:, None, None]
            + np.maximum(other - cap[:, None], 0.0)[:, None, :]
            - np.maximum(peak[:, None, None] - moved - cap[:, None, None], 0.0)
            - np.maximum(other[:, None, :] + moved - cap[:, None, None], 0.0)
        )
        swappable = (slot_rank[None, None, :] != donor[:, None, None]) & (
            donor_experts[:, :, None] != experts[:, None, :]
        )
        swappable &= (donor_experts > 0)[:, :, None] & (experts > 0)[:, None, :]
        gain_b = np.where(swappable, gain_b, -np.inf)
        b_there = held[lay2, heaviest[:, None], experts] > 0
        b_there |= held_before[lay2, heaviest[:, None], experts]
        a_leaves = ~held_before[lay2, heaviest[:, None], donor_experts] & (
            held[lay2, heaviest[:, None], donor_experts] == 1
        )
        a_there = held[lay3, slot_ranks[:, None, :], donor_experts[:, :, None]] > 0
        a_there |= held_before[lay3, slot_ranks[:, None, :], donor_experts[:, :, None]]
        cost_b = (~b_there)[:, None, :] * 1 - a_leaves[:, :, None] + ~a_there - y_leaves[:, None, :]

        # The largest excess reduction per move (a free or undoing change: _FREE_CHANGE_COST moves).
        gain = np.concatenate([gain_a.reshape(n, -1), gain_b.reshape(n, -1)], axis=1)
        cost = np.concatenate([cost_a.reshape(n, -1), cost_b.reshape(n, -1)], axis=1)
        per_move = gain * (1 - 1e-9 * cost) if by_gain else gain / np.maximum(cost, _FREE_CHANGE_COST)
        score = np.where(gain > 1e-9 * cap[:, None], per_move, -np.inf)
        best = score.argmax(axis=1)
        stuck = ~np.isfinite(score[row, best])
        has_empty = (placement[layer] == 0).any(axis=1)
        active[layer[stuck & ~has_empty]] = False
        _fill_one(load, placement, counts, held, layer[stuck & has_empty], num_ranks, num_nodes)
        base = node * slots_per_node
        num_a = gain_a.shape[1] * gain_a.shape[2]
        pick = ~stuck & (best < num_a)
        if pick.any():  # (a): slot s gets x
            k, c = np.divmod(best[pick], gain_a.shape[2])
            slot = cand[pick, c]
            lay, add, drop = layer[pick], x[pick, k], experts[pick, slot]
            rank = node_ranks[pick, slot_rank[slot]]
            placement[lay, base[pick] + slot] = add
            counts[lay, add - 1] += 1
            filled = drop > 0
            counts[lay[filled], drop[filled] - 1] -= 1
            held[lay, rank, add] += 1
            held[lay, rank, drop] -= 1
        pick = ~stuck & (best >= num_a)
        if pick.any():  # (b): donor slot i and slot j exchange their experts
            i, j = np.divmod(best[pick] - num_a, slots_per_node)
            lay = layer[pick]
            a, b = donor_experts[pick, i], experts[pick, j]
            rank_h, rank_r = heaviest[pick], node_ranks[pick, slot_rank[j]]
            placement[lay, base[pick] + donor_slots[pick, i]] = b
            placement[lay, base[pick] + j] = a
            held[lay, rank_h, a] -= 1
            held[lay, rank_h, b] += 1
            held[lay, rank_r, b] -= 1
            held[lay, rank_r, a] += 1
    while (left := np.nonzero((placement == 0).any(axis=1))[0]).size:  # only if the iterations ran out
        _fill_one(load, placement, counts, held, left, num_ranks, num_nodes)
    return placement - 1


def _fill_one(
    load: np.ndarray,
    placement: np.ndarray,
    counts: np.ndarray,
    held: np.ndarray,
    layer: np.ndarray,
    num_ranks: int,
    num_nodes: int,
) -> None:
    """In each of ``layer``, the empty slot of the lightest rank (first slot on a tie) takes the expert
    of its node with the largest load per replica (upstream's ``replicate_experts`` rule, within the
    node; lowest id on a tie). Updates the search's state (ids shifted by one, 0 = empty) in place."""
    if not layer.size:
        return
    num_physical = placement.shape[1]
    slots_per_rank = num_physical // num_ranks
    slots_per_node = num_physical // num_nodes
    shifted = placement[layer]
    w, cnt = load[layer], counts[layer]
    per_replica = _with_empty(w / np.maximum(cnt, 1), 0.0)
    loads = np.take_along_axis(per_replica, shifted, axis=1).reshape(layer.size, num_ranks, -1).sum(axis=2)
    slot_load = np.where(shifted == 0, np.repeat(loads, slots_per_rank, axis=1), np.inf)
    slot = slot_load.argmin(axis=1)
    node_slots = (slot // slots_per_node)[:, None] * slots_per_node + np.arange(slots_per_node)
    on_node = _replica_counts(np.take_along_axis(shifted, node_slots, axis=1) - 1, load.shape[1]) > 0
    expert = np.where(on_node, w / np.maximum(cnt, 1), -np.inf).argmax(axis=1)
    rank = slot // slots_per_rank
    placement[layer, slot] = expert + 1
    counts[layer, expert] += 1
    held[layer, rank, expert + 1] += 1
    held[layer, rank, 0] -= 1


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

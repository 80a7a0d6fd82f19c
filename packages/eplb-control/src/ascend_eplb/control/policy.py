"""Migration-aware EPLB policy: the fewest expert moves for the balancedness upstream's default reaches.

Glossary (DESIGN.md section 2). A *logical expert* is an expert of the model definition; a *physical
expert* (slot) is one installed copy of a logical expert's weights; slots beyond the logical count are
*redundant experts*. A *placement* is ``physical_to_logical`` ``(L, P)`` (int64, ``-1`` = an empty slot
of elastic padding); slot ``s`` lives on rank ``s // p`` with ``p = P / N`` slots per rank, and rank
``r`` on node ``r // (N / num_nodes)``.

Two measures, each defined once for the whole project (``shared/notes/placement-cost.md``):

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

from ascend_eplb.control.values import is_int

__all__ = ["MigrationAwarePolicy", "balancedness", "moved_experts"]

#: The search ranks a change by its excess reduction per move; a change that moves nothing (a local copy)
#: or undoes an earlier move counts as this many moves (measured on the benchmark's ESFT windows: 0.25,
#: 0.5 and 1.0 give 213, 216 and 226 moves; 0.25 prefers a useless local duplicate to a real fix).
_FREE_CHANGE_COST = 0.5


# ----------------------------------------------------------------------------------------------------
# The two measures


def _placement_array(name: str, placement: object) -> np.ndarray:
    """int64 ``(L, P)`` host copy of a placement; ``ValueError`` unless it is a 2-D integer tensor."""
    if not isinstance(placement, torch.Tensor):
        raise ValueError(f"{name} is a {type(placement).__name__}: it must be a torch.Tensor (L, P)")
    if placement.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(placement.shape)}: it must be 2-D (L, P)")
    if placement.dtype.is_floating_point or placement.dtype.is_complex or placement.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {placement.dtype}: it must hold integer expert ids")
    return placement.detach().to("cpu", torch.int64).numpy()


def _load_array(weight: object) -> np.ndarray:
    """float64 ``(L, E)`` host copy of a load; ``ValueError`` unless 2-D, finite and non-negative."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"load is a {type(weight).__name__}: it must be a torch.Tensor (L, E)")
    if weight.dim() != 2 or weight.shape[1] < 1:
        raise ValueError(f"load has shape {tuple(weight.shape)}: it must be (L, E) with E >= 1")
    if weight.dtype == torch.bool or weight.dtype.is_complex:
        raise ValueError(f"load has dtype {weight.dtype}: it must be an integer or float count")
    load = weight.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(load).all():
        raise ValueError("load holds a non-finite value: every load must be finite")
    if load.size and load.min() < 0:
        raise ValueError(f"load holds {load.min()}: every load must be >= 0")
    return load


def _check_num_ranks(num_ranks: object, num_physical_experts: int) -> int:
    if not is_int(num_ranks) or num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks!r}: must be an int >= 1")
    if num_physical_experts % num_ranks:
        raise ValueError(
            f"num_ranks={num_ranks}: must divide the physical experts per layer P={num_physical_experts}"
        )
    return num_ranks


def _check_ids(name: str, placement: np.ndarray, num_logical_experts: int) -> None:
    if placement.size and (placement.min() < -1 or placement.max() >= num_logical_experts):
        bad = placement[(placement < -1) | (placement >= num_logical_experts)][0]
        raise ValueError(
            f"{name} holds expert id {int(bad)}: ids must be in [0, {num_logical_experts}) or -1 (empty slot)"
        )


def _replica_counts(placement: np.ndarray, num_logical_experts: int) -> np.ndarray:
    """int64 ``(L, E)``: slots per logical expert (``-1`` slots count for none)."""
    counts = np.zeros((placement.shape[0], num_logical_experts + 1), dtype=np.int64)
    rows = np.broadcast_to(np.arange(placement.shape[0])[:, None], placement.shape)
    np.add.at(counts, (rows, placement + 1), 1)
    return counts[:, 1:]


def _rank_loads(load: np.ndarray, placement: np.ndarray, counts: np.ndarray, num_ranks: int) -> np.ndarray:
    """float64 ``(L, N)``: each expert's load split over its ``counts`` replicas, summed per rank."""
    per_replica = load / np.maximum(counts, 1)
    slot_load = np.take_along_axis(per_replica, np.maximum(placement, 0), axis=1)
    slot_load[placement < 0] = 0.0
    return slot_load.reshape(placement.shape[0], num_ranks, -1).sum(axis=2)


def _balancedness(rank_loads: np.ndarray) -> np.ndarray:
    peak = rank_loads.max(axis=1)
    mean = rank_loads.mean(axis=1)
    return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)


def balancedness(
    weight_LE: torch.Tensor,  # noqa: N803 (DESIGN.md shape letters)
    physical_to_logical_LP: torch.Tensor,  # noqa: N803
    num_ranks: int,
) -> torch.Tensor:
    """Balancedness of each layer's rank loads under a placement: float64 ``(L,)``, CPU, in ``(0, 1]``.

    Each logical expert's load is split evenly over its replicas (the model upstream's
    ``DefaultEplbPolicy`` optimises: ``tokens_per_mlog / mlogcnt``); rank ``r``'s load is the sum over its
    slots ``r * p .. (r + 1) * p - 1``; a layer's balancedness is mean rank load / max rank load. A layer
    without load is 1.0 (even). ``-1`` slots (elastic padding) hold nothing. Averaging over layers is
    the caller's (``.mean()``: every layer counts equally).

    Args:
        weight_LE: ``(L, E)`` load per logical expert, int or float, any device (any non-negative unit:
            tokens, selections).
        physical_to_logical_LP: integer ``(L, P)``, each slot's logical expert in ``[0, E)`` or -1.
        num_ranks: N, dividing P.

    Raises:
        ValueError: naming the value and the rule: shapes, N not dividing P, ids outside ``[-1, E)``,
            a negative or non-finite load, or an expert with load that no slot holds.
    """
    load = _load_array(weight_LE)
    placement = _placement_array("physical_to_logical_LP", physical_to_logical_LP)
    if placement.shape[0] != load.shape[0]:
        raise ValueError(
            f"load {load.shape} and physical_to_logical_LP {placement.shape}: must have the same L"
        )
    num_ranks = _check_num_ranks(num_ranks, placement.shape[1])
    _check_ids("physical_to_logical_LP", placement, load.shape[1])
    counts = _replica_counts(placement, load.shape[1])
    lost = (counts == 0) & (load > 0)
    if lost.any():
        layer, expert = (int(i[0]) for i in np.nonzero(lost))
        raise ValueError(
            f"layer {layer}: logical expert {expert} has load {load[layer, expert]} but no slot: "
            "every expert with load must be placed"
        )
    return torch.from_numpy(_balancedness(_rank_loads(load, placement, counts, num_ranks)))


def _holdings(placement: np.ndarray, num_ranks: int, num_logical_experts: int) -> np.ndarray:
    """int32 ``(L, N, E)``: how many slots of each rank hold each logical expert."""
    num_layers, num_physical = placement.shape
    held = np.zeros((num_layers, num_ranks, num_logical_experts + 1), dtype=np.int32)
    rows = np.broadcast_to(np.arange(num_layers)[:, None], placement.shape)
    ranks = np.broadcast_to(np.arange(num_physical) // (num_physical // num_ranks), placement.shape)
    np.add.at(held, (rows, ranks, placement + 1), 1)
    return held[:, :, 1:]


def moved_experts(
    old_LP: torch.Tensor,  # noqa: N803 (DESIGN.md shape letters)
    new_LP: torch.Tensor,  # noqa: N803
    num_ranks: int,
) -> torch.Tensor:
    """Experts each layer's rearrangement ``old -> new`` transfers between ranks: int64 ``(L,)``, CPU.

    Per layer, the sum over ranks ``r`` of ``|set(new[l, r]) - set(old[l, r])|``, where ``x[l, r]`` is
    rank ``r``'s slots ``r * p .. (r + 1) * p - 1``: a logical expert the rank already held is a local
    copy, not a transfer; two new slots of one expert on a rank are one transfer. ``-1`` slots hold
    nothing. ``.sum()`` is the rearrangement's total.

    Args:
        old_LP, new_LP: integer ``(L, P)`` placements, ids in ``[0, E)`` or -1.
        num_ranks: N, dividing P.

    Raises:
        ValueError: naming the value and the rule: shapes differ or are not 2-D, N does not divide P,
            an id below -1.
    """
    old = _placement_array("old_LP", old_LP)
    new = _placement_array("new_LP", new_LP)
    if old.shape != new.shape:
        raise ValueError(f"old_LP {old.shape} and new_LP {new.shape}: must have the same shape (L, P)")
    num_ranks = _check_num_ranks(num_ranks, old.shape[1])
    num_logical = int(max(old.max(initial=-1), new.max(initial=-1))) + 1
    _check_ids("old_LP", old, num_logical)
    _check_ids("new_LP", new, num_logical)
    gained = (_holdings(new, num_ranks, num_logical) > 0) & (_holdings(old, num_ranks, num_logical) == 0)
    return torch.from_numpy(gained.sum(axis=(1, 2), dtype=np.int64))


# ----------------------------------------------------------------------------------------------------
# The policy


class MigrationAwarePolicy(AbstractEplbPolicy):
    """Upstream's policy interface; from the placement in force, the fewest moves for upstream's balance.

    Per call (``rebalance_experts``, vLLM's classmethod signature):

    1. Upstream's ``DefaultEplbPolicy.rebalance_experts`` on the same input gives, per layer, the
       balancedness to reach (``b_up``). Without an old placement its result is returned as it is.
    2. A local search from the old placement, all layers in lockstep (one change per layer and
       iteration, numpy over whole tensors, no loop over slots): the donor is the heaviest rank ``h``;
       the candidates are (a) re-point one slot whose expert keeps another replica to ``h``'s hottest
       expert per replica (every rank holding it gets lighter; at most 1 move) and (b) swap a slot of
       ``h`` with a slot of another rank (at most 2 moves). The objective is the excess over the target
       peak ``T = mean rank load / (b_up - balancedness_tolerance)``, summed over ranks; the change with
       the largest excess reduction per move is applied (a local copy or a change that undoes an earlier
       move counts as half a move). A layer stops when its peak is at most ``T`` or no change reduces
       the excess; every applied change reduces it, so the search ends (and is capped at ``4 P``
       iterations).
    3. A layer left more than ``fallback_margin`` below ``b_up`` takes upstream's layer, its nodes,
       ranks and slots aligned to the old placement (greedy overlap) to keep what it can.

    Hierarchical placement (``num_groups % num_nodes == 0`` and ``num_nodes > 1``): upstream packs expert
    groups (``E / num_groups`` consecutive experts) onto nodes and keeps every replica of an expert on
    its group's node. A layer whose old placement does so changes only slots within the donor's node,
    for experts of that node's groups (the group-to-node assignment is kept); a layer whose old
    placement does not (upstream's initial placement with appended redundant slots), or one with empty
    (-1) slots (elastic scale-up), takes upstream's layer, aligned.

    Deterministic (ties go to the lowest index; float64 host arithmetic in a fixed order: every rank's
    worker gets the same answer), valid (every logical expert placed in every layer, int64 CPU
    ``(L, P)``), about 0.3 s at DeepSeek-V3 size on one thread (``benchmarks/bench_policy.py``).
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

        Raises:
            ValueError: naming the value and the rule, before anything is computed.
        """
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


def _follows_node_grouping(
    placement: np.ndarray, num_groups: int, num_nodes: int, num_logical: int
) -> np.ndarray:
    """bool ``(L,)``: every slot of each expert group lies on one node (and no slot is empty)."""
    num_layers, num_physical = placement.shape
    groups = np.maximum(placement, 0) // (num_logical // num_groups)
    nodes = np.broadcast_to(np.arange(num_physical) // (num_physical // num_nodes), placement.shape)
    present = np.zeros((num_layers, num_groups, num_nodes), dtype=bool)
    present[np.arange(num_layers)[:, None], groups, nodes] = True
    return (present.sum(axis=2) == 1).all(axis=1) & (placement >= 0).all(axis=1)


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
    searchable = (old >= 0).all(axis=1)
    if num_nodes > 1:
        searchable &= _follows_node_grouping(old, num_groups, num_nodes, num_logical)
    new = old.copy()
    layers = np.nonzero(searchable)[0]
    if layers.size:
        new[layers] = _local_search(
            load[layers], old[layers], target[layers] - tolerance, num_ranks, num_nodes
        )
    reached = _balancedness(_rank_loads(load, new, _replica_counts(new, num_logical), num_ranks))
    fallback = np.nonzero(~searchable | (reached < target - fallback_margin))[0]
    if fallback.size:
        new[fallback] = _align_to_old(upstream[fallback], old[fallback], num_ranks, num_nodes, num_logical)
    return new


def _local_search(
    load: np.ndarray, old: np.ndarray, target: np.ndarray, num_ranks: int, num_nodes: int
) -> np.ndarray:
    """The search of :class:`MigrationAwarePolicy` step 2 on layers without empty slots: ``(L, P)``."""
    num_physical = old.shape[1]
    num_logical = load.shape[1]
    slots_per_rank = num_physical // num_ranks
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = num_physical // num_nodes
    placement = old.copy()
    counts = _replica_counts(old, num_logical)
    held = _holdings(old, num_ranks, num_logical)
    held_before = held > 0
    # The peak rank load each layer must reach: mean / target balancedness; a layer without load is done.
    peak_target = load.sum(axis=1) / num_ranks / np.maximum(target, 1e-12)
    active = load.sum(axis=1) > 0
    slot_rank = np.arange(slots_per_node) // slots_per_rank  # rank of a node-local slot, within the node
    own = slot_rank[None, :] == np.arange(ranks_per_node)[:, None]  # (ranks_per_node, slots_per_node)
    h_slot = np.arange(slots_per_rank)
    for _ in range(4 * num_physical):
        layer = np.nonzero(active)[0]
        if not layer.size:
            break
        w = load[layer]
        cnt = counts[layer]
        per_replica = w / cnt
        loads = (
            np.take_along_axis(per_replica, placement[layer], axis=1)
            .reshape(layer.size, num_ranks, -1)
            .sum(2)
        )
        heaviest = loads.argmax(axis=1)
        peak = loads[np.arange(layer.size), heaviest]
        cap = peak_target[layer]
        go = peak > cap * (1 + 1e-12)
        active[layer[~go]] = False
        if not go.any():
            break
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
        node_held = held[layer[:, None], node_ranks]  # (n, R, E)
        node_before = held_before[layer[:, None], node_ranks]
        excess = np.maximum(node_loads - cap[:, None], 0.0)
        excess_sum = excess.sum(axis=1)
        donor_slots = donor[:, None] * slots_per_rank + h_slot  # (n, p), node-local
        donor_experts = np.take_along_axis(experts, donor_slots, axis=1)
        donor_per_replica = np.take_along_axis(per_replica, donor_experts, axis=1)
        hot = donor_experts[row, donor_per_replica.argmax(axis=1)]  # (n,)

        # (a) re-point slot s (expert y, keeps another replica) to the donor's hottest expert x.
        cnt_y = np.take_along_axis(cnt, experts, axis=1)
        w_y = np.take_along_axis(w, experts, axis=1)
        repointable = (cnt_y >= 2) & (experts != hot[:, None])
        cnt_y = np.where(repointable, cnt_y, 2)
        cnt_x, w_x = cnt[row, hot], w[row, hot]
        d_x = w_x / (cnt_x + 1) - w_x / cnt_x
        d_y = w_y / (cnt_y - 1) - w_y / cnt_y
        held_x = node_held[row, :, hot]  # (n, R)
        held_y = np.take_along_axis(
            node_held, np.broadcast_to(experts[:, None, :], (n, ranks_per_node, slots_per_node)), axis=2
        )
        own_delta = (w_x / (cnt_x + 1))[:, None] - w_y / (cnt_y - 1)  # the slot's own rank: x in, y out
        after = (
            node_loads[:, :, None]
            + held_x[:, :, None] * d_x[:, None, None]
            + held_y * d_y[:, None, :]
            + own[None] * own_delta[:, None, :]
        )
        gain_a = excess_sum[:, None] - np.maximum(after - cap[:, None, None], 0.0).sum(axis=1)
        x_there = node_held[row[:, None], slot_rank[None, :], hot[:, None]] > 0
        x_before = node_before[row[:, None], slot_rank[None, :], hot[:, None]]
        y_held = node_held[row[:, None], slot_rank[None, :], experts]
        y_before = node_before[row[:, None], slot_rank[None, :], experts]
        cost_a = (~(x_there | x_before)).astype(np.int64) - ((~y_before) & (y_held == 1))
        gain_a = np.where(repointable, gain_a, -np.inf)

        # (b) swap donor slot i (expert a) with slot j (expert b) of another rank of the node.
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
        gain_b = np.where(swappable, gain_b, -np.inf)
        b_to_donor = node_held[row[:, None], donor[:, None], experts] > 0
        b_to_donor |= node_before[row[:, None], donor[:, None], experts]
        a_leaves_donor = (~node_before[row[:, None], donor[:, None], donor_experts]) & (
            node_held[row[:, None], donor[:, None], donor_experts] == 1
        )
        a_to_other = node_held[row[:, None, None], slot_rank[None, None, :], donor_experts[:, :, None]] > 0
        a_to_other |= node_before[row[:, None, None], slot_rank[None, None, :], donor_experts[:, :, None]]
        cost_b = (
            (~b_to_donor).astype(np.int64)[:, None, :]
            - a_leaves_donor[:, :, None]
            + (~a_to_other)
            - ((~y_before) & (y_held == 1))[:, None, :]
        )

        # The largest excess reduction per move (a free or undoing change: ``_FREE_CHANGE_COST``).
        floor = 1e-9 * cap[:, None]
        score = np.concatenate(
            [
                np.where(gain_a > floor, gain_a / np.maximum(cost_a, _FREE_CHANGE_COST), -np.inf),
                np.where(
                    gain_b.reshape(n, -1) > floor,
                    gain_b.reshape(n, -1) / np.maximum(cost_b.reshape(n, -1), _FREE_CHANGE_COST),
                    -np.inf,
                ),
            ],
            axis=1,
        )
        best = score.argmax(axis=1)
        stuck = ~np.isfinite(score[row, best])
        active[layer[stuck]] = False
        base = node * slots_per_node
        # Apply (a): slot s gets x.
        pick = ~stuck & (best < slots_per_node)
        if pick.any():
            lay, s = layer[pick], best[pick]
            x, y = hot[pick], experts[pick, s]
            rank = node_ranks[pick, slot_rank[s]]
            placement[lay, base[pick] + s] = x
            np.add.at(counts, (lay, x), 1)
            np.add.at(counts, (lay, y), -1)
            held[lay, rank, x] += 1
            held[lay, rank, y] -= 1
        # Apply (b): donor slot i and slot j exchange their experts.
        pick = ~stuck & (best >= slots_per_node)
        if pick.any():
            i, j = np.divmod(best[pick] - slots_per_node, slots_per_node)
            lay = layer[pick]
            a, b = donor_experts[pick, i], experts[pick, j]
            rank_h, rank_r = heaviest[pick], node_ranks[pick, slot_rank[j]]
            placement[lay, base[pick] + donor_slots[pick, i]] = b
            placement[lay, base[pick] + j] = a
            held[lay, rank_h, a] -= 1
            held[lay, rank_h, b] += 1
            held[lay, rank_r, b] -= 1
            held[lay, rank_r, a] += 1
    return placement


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

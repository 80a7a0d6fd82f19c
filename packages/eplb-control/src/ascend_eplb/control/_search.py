"""The local search of :class:`~ascend_eplb.control.policy.MigrationAwarePolicy` (its step 2).

One iteration makes at most one change per layer, all layers in lockstep, in three parts:
:func:`candidates` (the changes the heaviest rank, the donor, may make), :func:`score` (each change's
reduction of the excess load over the cap and its moves; :func:`best_change` ranks them) and
:func:`apply` (the chosen change, in place).

Ids are shifted by one inside (0: an empty slot, no load, never moved by a swap). Shapes: L layers, E
logical experts, P slots, N ranks, p slots per rank; a *node* of R ranks and S slots (the whole layer
when not hierarchical); n layers in an iteration; X = p donor experts; K re-pointable slots; Q swaps
scored (their donor slot and node slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ascend_eplb.control.measures import _holdings, _rank_loads, _replica_counts

#: The search ranks a change by its excess reduction per move; a change that moves nothing (a local copy)
#: or undoes an earlier move counts as this many moves (measured on the benchmark's ESFT windows: 0.25,
#: 0.5 and 1.0 give 213, 216 and 226 moves; 0.25 prefers a useless local duplicate to a real fix).
FREE_CHANGE_COST = 0.5
#: A swap's other slot lies on one of the node's this many lightest ranks (on any rank of a node with
#: no more): a bound on the work, not on the balance (figures in the control CHANGELOG).
PARTNER_RANKS = 8


@dataclass
class SearchState:
    """What the search changes, in place (ids shifted by one).

    Attributes:
        load: float64 ``(L, E)``.
        placement: int64 ``(L, P)``, shifted ids (0: empty).
        counts: int64 ``(L, E)``, replicas per logical expert.
        held: int32 ``(L, 1 + E, N)``, slots of each expert (row 0: empty slots) on each rank.
        held_before: bool ``(L, 1 + E, N)``, held by the old placement (row 0 True: leaving an empty
            slot costs nothing).
        node_cap: float64 ``(L, nodes)``, the peak rank load each layer's node must reach.
        active: bool ``(L,)``, layers still searched.
    """

    load: np.ndarray
    placement: np.ndarray
    counts: np.ndarray
    held: np.ndarray
    held_before: np.ndarray
    node_cap: np.ndarray
    active: np.ndarray
    num_ranks: int
    num_nodes: int

    @classmethod
    def begin(
        cls,
        load: np.ndarray,
        start: np.ndarray,
        old: np.ndarray,
        target: np.ndarray,
        num_ranks: int,
        num_nodes: int,
    ) -> SearchState:
        """The state at ``start`` ``(L, P)`` (moves counted from ``old``), aiming at ``target`` ``(L,)``.

        A layer's cap is its mean rank load / ``target``, or its node's own mean rank load where the
        node's groups carry more (moves stay in the node); a layer without load starts inactive.
        """
        num_logical = load.shape[1]
        counts = _replica_counts(start, num_logical)
        held_before = _holdings(old, num_ranks, num_logical, with_empty=True).transpose(0, 2, 1) > 0
        held_before[:, 0] = True
        node_mean = _rank_loads(load, start, counts, num_nodes) / (num_ranks // num_nodes)  # (L, nodes)
        mean = load.sum(axis=1, keepdims=True) / num_ranks
        return cls(
            load=load,
            placement=start + 1,
            counts=counts,
            held=np.ascontiguousarray(
                _holdings(start, num_ranks, num_logical, with_empty=True).transpose(0, 2, 1)
            ),
            held_before=np.ascontiguousarray(held_before),
            node_cap=np.maximum(mean / np.maximum(target, 1e-12)[:, None], node_mean),
            active=load.sum(axis=1) > 0,
            num_ranks=num_ranks,
            num_nodes=num_nodes,
        )

    @property
    def slots_per_rank(self) -> int:
        return self.placement.shape[1] // self.num_ranks

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    @property
    def slots_per_node(self) -> int:
        return self.placement.shape[1] // self.num_nodes

    def row(self, layer: np.ndarray, expert: np.ndarray) -> np.ndarray:
        """The flat index of ``(layer, expert, rank 0)`` in ``held`` and ``held_before`` (broadcast index
        arrays): add a rank."""
        _, num_experts, num_ranks = self.held.shape
        return (layer * num_experts + expert) * num_ranks

    def leaves(self, flat: np.ndarray) -> np.ndarray:
        """Whether the expert was not on the rank before and is there once, at ``flat`` (:meth:`row` plus
        the rank): taking it away undoes a move."""
        return ~np.take(self.held_before.reshape(-1), flat) & (np.take(self.held.reshape(-1), flat) == 1)

    def there(self, flat: np.ndarray) -> np.ndarray:
        """Whether the expert is on the rank now or was there before, at ``flat`` (:meth:`row` plus the
        rank): bringing it costs no move."""
        return (np.take(self.held.reshape(-1), flat) > 0) | np.take(self.held_before.reshape(-1), flat)


@dataclass(frozen=True)
class Donors:
    """The layers of one iteration whose heaviest rank (the donor) is above its cap.

    Attributes:
        layer: ``(n,)`` layer ids. heaviest: ``(n,)`` the donor's rank. cap, peak: ``(n,)`` its cap and load.
        w, cnt, per_replica: ``(n, 1 + E)`` load, replicas (2 for column 0), load per replica.
        node_ranks: ``(n, R)`` the ranks of the donor's node. node_loads: ``(n, R)`` their loads.
        experts: ``(n, S)`` the node's slots' experts. slot_ranks: ``(n, S)`` each node slot's rank.
        donor: ``(n,)`` the donor's index in its node. donor_slots: ``(n, p)`` its node-local slots.
        donor_experts: ``(n, p)`` their experts.
    """

    layer: np.ndarray
    heaviest: np.ndarray
    cap: np.ndarray
    peak: np.ndarray
    w: np.ndarray
    cnt: np.ndarray
    per_replica: np.ndarray
    node_ranks: np.ndarray
    node_loads: np.ndarray
    experts: np.ndarray
    slot_ranks: np.ndarray
    donor: np.ndarray
    donor_slots: np.ndarray
    donor_experts: np.ndarray


def _along(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values`` at ``index`` along the last axis, the leading axes broadcast (``np.take_along_axis``
    without its index building: one ``np.take`` of the flat array)."""
    *lead, last = values.shape
    offsets = np.arange(0, math.prod(lead) * last, last).reshape(*lead, 1)
    return values.reshape(-1).take(index + offsets)


def _with_empty(values: np.ndarray, fill: float) -> np.ndarray:
    """``(n, E)`` -> ``(n, 1 + E)``: column 0 stands for an empty slot (expert id -1, index 0)."""
    return np.concatenate([np.full((values.shape[0], 1), fill, dtype=values.dtype), values], axis=1)


def rank_view(state: SearchState, layer: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(w, cnt, per_replica, loads)`` of ``layer`` ``(n,)``: ``(n, 1 + E)`` each (an empty slot: no
    load, 2 replicas, so that taking it costs nothing) and the rank loads ``(n, N)``."""
    w = _with_empty(state.load[layer], 0.0)
    cnt = _with_empty(state.counts[layer], 2)
    per_replica = w / np.maximum(cnt, 1)
    loads = _along(per_replica, state.placement[layer])
    return w, cnt, per_replica, loads.reshape(layer.size, state.num_ranks, -1).sum(axis=2)


def donors(
    state: SearchState,
    layer: np.ndarray,
    w: np.ndarray,
    cnt: np.ndarray,
    per_replica: np.ndarray,
    loads: np.ndarray,
) -> Donors:
    """The :class:`Donors` of ``layer`` ``(n,)`` from their :func:`rank_view`."""
    ranks_per_node, slots_per_node = state.ranks_per_node, state.slots_per_node
    slots_per_rank = state.slots_per_rank
    heaviest = loads.argmax(axis=1)
    node = heaviest // ranks_per_node
    node_ranks = node[:, None] * ranks_per_node + np.arange(ranks_per_node)
    slot_ranks = node_ranks[:, np.arange(slots_per_node) // slots_per_rank]
    experts = state.placement[layer].reshape(layer.size, state.num_nodes, slots_per_node)[
        np.arange(layer.size), node
    ]
    donor = heaviest - node * ranks_per_node
    donor_slots = donor[:, None] * slots_per_rank + np.arange(slots_per_rank)
    return Donors(
        layer=layer,
        heaviest=heaviest,
        cap=state.node_cap[layer, node],
        peak=loads[np.arange(layer.size), heaviest],
        w=w,
        cnt=cnt,
        per_replica=per_replica,
        node_ranks=node_ranks,
        node_loads=_along(loads, node_ranks),
        experts=experts,
        slot_ranks=slot_ranks,
        donor=donor,
        donor_slots=donor_slots,
        donor_experts=_along(experts, donor_slots),
    )


@dataclass(frozen=True)
class Candidates:
    """One iteration's changes per layer, in the order of :func:`score`'s columns.

    Re-point ``(n, X, K)`` first: node slot ``slot[k]`` (expert ``y[k]``, empty or keeping another
    replica) takes donor expert ``x[i]`` where ``repointable[i, k]``; at most one move. Then swap ``(n,
    p, T)``: donor slot ``i`` and node slot ``partner[t]`` of another rank exchange their experts where
    ``swappable[i, t]``; at most two moves. A swap's other slot lies on one of the node's
    :data:`PARTNER_RANKS` lightest ranks.

    Attributes:
        x: ``(n, X)`` the donor's experts. slot: ``(n, K)`` re-pointable node slots, in slot order (padded).
        y: ``(n, K)`` their experts. y_count: ``(n, K)`` their replicas (2 for an empty slot or a pad).
        repointable: bool ``(n, X, K)``.
        partner: ``(n, T)`` the node slots a donor slot may swap with, in slot order. swappable: bool
            ``(n, p, T)``.
    """

    x: np.ndarray
    slot: np.ndarray
    y: np.ndarray
    y_count: np.ndarray
    repointable: np.ndarray
    partner: np.ndarray
    swappable: np.ndarray


def candidates(d: Donors, *, partner_ranks: int = PARTNER_RANKS) -> Candidates:
    """The changes of :class:`Candidates` open to each layer's donor."""
    n, p = d.donor_slots.shape
    num_ranks = d.node_ranks.shape[1]
    if partner_ranks < num_ranks:  # the lightest ranks (lowest index on a tie), in rank order
        light = np.sort(np.argsort(d.node_loads, axis=1, kind="stable")[:, :partner_ranks], axis=1)
    else:
        light = np.broadcast_to(np.arange(num_ranks), (n, num_ranks))
    slot_rank = np.arange(d.experts.shape[1]) // p
    cnt_s = _along(d.cnt, d.experts)
    free = (cnt_s >= 2) | (d.experts == 0)
    # The free slots, then the others, each in slot order (a sort of distinct keys: a stable sort by
    # freedom without its cost), as many columns as the layer with the most free slots needs.
    num_slots = free.shape[1]
    key = np.where(free, np.int32(0), np.int32(num_slots)) + np.arange(num_slots, dtype=np.int32)
    key.sort(axis=1)
    slot = np.remainder(key[:, : max(int(free.sum(axis=1).max()), 1)], num_slots, dtype=np.int64)
    y = _along(d.experts, slot)
    is_free = _along(free, slot)
    x = d.donor_experts
    repointable = is_free[:, None, :] & (y[:, None, :] != x[:, :, None]) & (x > 0)[:, :, None]
    partner = (light[:, :, None] * p + np.arange(p)).reshape(n, -1)
    b = _along(d.experts, partner)
    swappable = (slot_rank[partner] != d.donor[:, None])[:, None, :] & (x[:, :, None] != b[:, None, :])
    swappable &= (x > 0)[:, :, None] & (b > 0)[:, None, :]
    return Candidates(
        x=x,
        slot=slot,
        y=y,
        y_count=np.where(is_free, _along(d.cnt, y), 2),
        repointable=repointable,
        partner=partner,
        swappable=swappable,
    )


def _reduction(base: np.ndarray, excess: np.ndarray, cap: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """How much a rank's excess over ``cap`` drops when its load ``base`` changes by ``delta``."""
    return excess - np.maximum(base + delta - cap, 0.0)


def _reduction_in(base: np.ndarray, excess: np.ndarray, cap: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """:func:`_reduction` written over ``delta`` (a new array of the result's shape): the same
    operations in the same order, without temporaries."""
    np.add(base, delta, out=delta)
    np.subtract(delta, cap, out=delta)
    np.maximum(delta, 0.0, out=delta)
    return np.subtract(excess, delta, out=delta)


def _repoint_gains(
    state: SearchState, d: Donors, c: Candidates, gain_out: np.ndarray, cost_out: np.ndarray
) -> None:
    """Writes ``gain_out`` and ``cost_out`` ``(n, X, K)`` of the re-points (:func:`score`).

    Re-pointing slot ``s`` from ``y`` to ``x`` makes the ranks holding ``x`` lighter, those holding
    ``y`` heavier and changes the slot's own rank by both and by the slot's load; the reduction is
    summed per expert over its ranks (``y``'s: over the candidate slots, each rank once), then put right
    on the slot's rank and on the other ranks holding both (the donor, where ``y`` has a replica there,
    and the rare other ranks of ``x``), so that no ``(n, X, K, R)`` array is formed. The corrections
    of one change are added in rank order.
    """
    n = d.layer.size
    base, cap = d.node_loads, d.cap[:, None]
    excess = np.maximum(base - cap, 0.0)  # (n, R)
    x, y = c.x, c.y
    w_x, c_x = _along(d.w, x), _along(d.cnt, x)  # (n, X)
    w_y, c_y = _along(d.w, y), c.y_count  # (n, K)
    d_x = w_x / (c_x + 1) - w_x / c_x  # each replica of x gets lighter
    d_y = w_y / (c_y - 1) - w_y / c_y  # each other replica of y gets heavier
    own = (w_x / (c_x + 1))[:, :, None] - (w_y / (c_y - 1))[:, None, :]  # (n, X, K): the slot, x in, y out
    held = state.held.reshape(-1)
    row_x, row_y = state.row(d.layer[:, None], x), state.row(d.layer[:, None], y)  # (n, X), (n, K)
    h_x = np.take(held, row_x[:, :, None] + d.node_ranks[:, None, :])  # (n, X, R)
    dx_r = h_x * d_x[:, :, None]  # (n, X, R)
    gain_x = _reduction(base[:, None], excess[:, None], cap[:, None], dx_r).sum(axis=2)  # (n, X)
    # y: its ranks are those of the candidate slots of y (every slot of an expert with another replica
    # is a candidate), each counted once.
    slot_rank = _along(d.slot_ranks, c.slot)  # (n, K)
    s = slot_rank - d.node_ranks[:, :1]  # the slot's rank in the node
    h_y = np.take(held, row_y + slot_rank)  # (n, K): y's slots on the slot's rank
    dy_s = h_y * d_y
    b_s, e_s = _along(base, s), _along(excess, s)
    num_ranks, num_experts = d.node_ranks.shape[1], d.w.shape[1]
    once = h_y == 1  # y's one slot on the slot's rank; of two or more there, the first counts
    row, k = np.nonzero(h_y > 1)
    if row.size:
        _, first = np.unique((row * num_experts + y[row, k]) * num_ranks + s[row, k], return_index=True)
        once[row[first], k[first]] = True
    groups = np.arange(n)[:, None] * num_experts + y  # (n, K): the layer's expert y
    per_expert = np.bincount(
        groups.ravel(), weights=(_reduction(b_s, e_s, cap, dy_s) * once).ravel(), minlength=n * num_experts
    )
    gain = gain_x[:, :, None] + np.take(per_expert, groups)[:, None, :]
    # The slot's rank s: its true reduction in place of the two counted.
    at_s = row_x[:, :, None] + slot_rank[:, None, :]  # (n, X, K): x on the slot's rank
    h_xs = np.take(held, at_s)
    dx_s = h_xs * d_x[:, :, None]
    b_s, e_s, dy_s = b_s[:, None], e_s[:, None], dy_s[:, None]
    both = dx_s + dy_s
    both += own
    both = _reduction_in(b_s, e_s, cap[:, None], both)
    both -= _reduction_in(b_s, e_s, cap[:, None], dx_s)
    both -= _reduction(b_s, e_s, cap[:, None], dy_s)
    gain = np.add(gain, both, out=gain_out)
    # The other ranks r holding both x and y, each put right in rank order: the donor (every x is
    # there) where y has a replica there, and the ranks of x's other replicas (rare) before and after.
    h_yh = np.take(held, row_y + d.heaviest[:, None])  # (n, K): y's slots on the donor
    row_h, k_h = np.nonzero((h_yh > 0) & (s != d.donor[:, None]))  # (M,)
    row, i = np.nonzero((c_x >= 2) & (x > 0))  # x with another replica: where?
    a, r = np.nonzero((h_x[row, i] > 0) & (np.arange(num_ranks) != d.donor[row, None]))
    row, i = row[a], i[a]
    if row.size:  # (A,) x's replicas off the donor; (H,) those on y's ranks other than the slot's
        h_yr = np.take(held, row_y[row] + d.node_ranks[row, r][:, None])  # (A, K)
        a, k = np.nonzero((h_yr > 0) & (s[row] != r[:, None]))
        row, i, r, dy = row[a], i[a], r[a], h_yr[a, k] * d_y[row[a], k]
        b_r, e_r, cap_r, dx = base[row, r], excess[row, r], d.cap[row], dx_r[row, i, r]
        fix = (
            _reduction(b_r, e_r, cap_r, dx + dy)
            - _reduction(b_r, e_r, cap_r, dx)
            - _reduction(b_r, e_r, cap_r, dy)
        )
        before = r < d.donor[row]
        np.add.at(gain, (row[before], i[before], k[before]), fix[before])
    if row_h.size:  # (M, X): each (layer, k) once
        donor = d.donor[row_h]
        b_h, e_h, cap_h = base[row_h, donor, None], excess[row_h, donor, None], d.cap[row_h, None]
        dx_h, dy_h = dx_r[row_h, :, donor], (h_yh[row_h, k_h] * d_y[row_h, k_h])[:, None]
        gain[row_h, :, k_h] += (
            _reduction(b_h, e_h, cap_h, dx_h + dy_h)
            - _reduction(b_h, e_h, cap_h, dx_h)
            - _reduction(b_h, e_h, cap_h, dy_h)
        )
    if row.size:
        np.add.at(gain, (row[~before], i[~before], k[~before]), fix[~before])
    np.copyto(gain, -np.inf, where=~c.repointable)
    held_before = state.held_before.reshape(-1)
    x_there = (h_xs > 0) | np.take(held_before, at_s)  # (n, X, K)
    y_leaves = ~np.take(held_before, row_y + slot_rank) & (h_y == 1)
    np.subtract(~x_there, y_leaves[:, None, :], dtype=np.int64, out=cost_out)


def _swap_gains(
    state: SearchState, d: Donors, c: Candidates, gain_out: np.ndarray, cost_out: np.ndarray
) -> None:
    """Writes ``gain_out`` and ``cost_out`` ``(n, p, T)`` of the swaps (:func:`score`): only the donor
    and the other slot's rank change, by the difference of the two experts' loads per replica."""
    p = d.donor_slots.shape[1]
    cap = d.cap[:, None, None]
    a, b = d.donor_experts, _along(d.experts, c.partner)
    moved = _along(d.per_replica, a)[:, :, None] - _along(d.per_replica, b)[:, None, :]
    rank = c.partner // p  # (n, T): the other slot's rank in the node
    other = _along(d.node_loads, rank)[:, None, :]  # (n, 1, T)
    gain = (d.peak - d.cap)[:, None, None] + np.maximum(other - cap, 0.0)
    drop = np.subtract(d.peak[:, None, None], moved)  # (n, p, T), then the gain, in place
    drop -= cap
    gain = np.subtract(gain, np.maximum(drop, 0.0, out=drop), out=drop)
    rise = np.add(other, moved, out=moved)
    rise -= cap
    gain = np.subtract(gain, np.maximum(rise, 0.0, out=rise), out=gain_out)
    np.copyto(gain, -np.inf, where=~c.swappable)
    held, held_before = state.held.reshape(-1), state.held_before.reshape(-1)
    row_a, row_b = state.row(d.layer[:, None], a), state.row(d.layer[:, None], b)  # (n, p), (n, T)
    heaviest, other_rank = d.heaviest[:, None], _along(d.slot_ranks, c.partner)  # (n, 1), (n, T)
    b_there = state.there(row_b + heaviest)
    a_leaves = state.leaves(row_a + heaviest)
    at = row_a[:, :, None] + other_rank[:, None, :]  # (n, p, T): a on the other slot's rank
    a_there = (np.take(held, at) > 0) | np.take(held_before, at)
    y_leaves = state.leaves(row_b + other_rank)
    cost = (~b_there).astype(np.int8)[:, None, :] - a_leaves[:, :, None] + ~a_there - y_leaves[:, None, :]
    np.copyto(cost_out, cost)


def score(state: SearchState, d: Donors, c: Candidates) -> tuple[np.ndarray, np.ndarray]:
    """``(gain, cost)`` ``(n, X K + p T)``, the columns in :class:`Candidates`' order: each change's
    reduction of the summed excess of the node's ranks over the cap (float64, ``-inf`` where it is no
    candidate) and its moves (int64, as :func:`~ascend_eplb.control.measures.moved_experts` counts them;
    -1 for a change that undoes one)."""
    n, (num_x, k), (p, t) = d.layer.size, c.repointable.shape[1:], c.swappable.shape[1:]
    gain = np.empty((n, num_x * k + p * t))
    cost = np.empty(gain.shape, dtype=np.int64)
    split = num_x * k
    _repoint_gains(state, d, c, gain[:, :split].reshape(n, num_x, k), cost[:, :split].reshape(n, num_x, k))
    _swap_gains(state, d, c, gain[:, split:].reshape(n, p, t), cost[:, split:].reshape(n, p, t))
    return gain, cost


def best_change(
    gain: np.ndarray, cost: np.ndarray, cap: np.ndarray, *, by_gain: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``(best, stuck)`` ``(n,)``: each layer's column of the largest excess reduction per move (a free
    or undoing change counts :data:`FREE_CHANGE_COST` moves; ``by_gain``: the largest reduction, fewer
    moves only on a tie), the lowest column among equal ones; ``stuck`` where no change reduces the
    excess by more than ``1e-9 cap``."""
    if by_gain:
        ranked = gain * (1 - 1e-9 * cost)
    else:
        ranked = np.maximum(cost, FREE_CHANGE_COST)
        np.divide(gain, ranked, out=ranked)
    np.copyto(ranked, -np.inf, where=~(gain > 1e-9 * cap[:, None]))
    best = ranked.argmax(axis=1)
    return best, ~np.isfinite(ranked[np.arange(best.size), best])


def apply(state: SearchState, d: Donors, c: Candidates, best: np.ndarray, pick: np.ndarray) -> None:
    """Make change ``best`` ``(n,)`` (a column of :func:`score`) in the layers where ``pick``."""
    num_a = c.repointable.shape[1] * c.repointable.shape[2]
    base = (d.node_ranks[:, 0] // state.ranks_per_node) * state.slots_per_node  # the node's first slot
    repoint = pick & (best < num_a)
    if repoint.any():  # node slot `slot` gets donor expert `add`
        k, col = np.divmod(best[repoint], c.repointable.shape[2])
        slot = c.slot[repoint, col]
        lay, add, drop = d.layer[repoint], c.x[repoint, k], d.experts[repoint, slot]
        rank = d.slot_ranks[repoint, slot]
        state.placement[lay, base[repoint] + slot] = add
        state.counts[lay, add - 1] += 1
        filled = drop > 0
        state.counts[lay[filled], drop[filled] - 1] -= 1
        state.held[lay, add, rank] += 1
        state.held[lay, drop, rank] -= 1
    swap = pick & (best >= num_a)
    if swap.any():  # donor slot i and node slot j exchange their experts
        i, t = np.divmod(best[swap] - num_a, c.partner.shape[1])
        j = c.partner[swap, t]
        lay = d.layer[swap]
        a, b = d.donor_experts[swap, i], d.experts[swap, j]
        rank_h, rank_r = d.heaviest[swap], d.slot_ranks[swap, j]
        state.placement[lay, base[swap] + d.donor_slots[swap, i]] = b
        state.placement[lay, base[swap] + j] = a
        state.held[lay, a, rank_h] -= 1
        state.held[lay, b, rank_h] += 1
        state.held[lay, b, rank_r] -= 1
        state.held[lay, a, rank_r] += 1


def fill_one(state: SearchState, layer: np.ndarray) -> None:
    """In each of ``layer``, the empty slot of the lightest rank (first slot on a tie) takes the expert
    of its node with the largest load per replica (upstream's ``replicate_experts`` rule, within the
    node; lowest id on a tie)."""
    if not layer.size:
        return
    slots_per_rank, slots_per_node = state.slots_per_rank, state.slots_per_node
    shifted = state.placement[layer]
    w, cnt = state.load[layer], state.counts[layer]
    per_replica = _with_empty(w / np.maximum(cnt, 1), 0.0)
    loads = _along(per_replica, shifted).reshape(layer.size, state.num_ranks, -1).sum(axis=2)
    slot_load = np.where(shifted == 0, np.repeat(loads, slots_per_rank, axis=1), np.inf)
    slot = slot_load.argmin(axis=1)
    node_slots = (slot // slots_per_node)[:, None] * slots_per_node + np.arange(slots_per_node)
    on_node = _replica_counts(_along(shifted, node_slots) - 1, state.load.shape[1]) > 0
    expert = np.where(on_node, w / np.maximum(cnt, 1), -np.inf).argmax(axis=1)
    rank = slot // slots_per_rank
    state.placement[layer, slot] = expert + 1
    state.counts[layer, expert] += 1
    state.held[layer, expert + 1, rank] += 1
    state.held[layer, 0, rank] -= 1


def local_search(
    load: np.ndarray,
    start: np.ndarray,
    old: np.ndarray,
    target: np.ndarray,
    num_ranks: int,
    num_nodes: int,
    *,
    by_gain: bool = False,
) -> np.ndarray:
    """The placement ``(L, P)`` the search reaches from ``start`` (moves counted from ``old``) for the
    balancedness ``target`` ``(L,)``; ``by_gain``: the largest excess reduction wins, fewer moves only
    on a tie. A layer stops at its cap, or when no change reduces its excess and no slot is empty
    (empty slots are filled by :func:`fill_one`); at most ``5 P`` iterations."""
    state = SearchState.begin(load, start, old, target, num_ranks, num_nodes)
    for _ in range(5 * start.shape[1]):
        layer = np.nonzero(state.active)[0]
        if not layer.size:
            break
        w, cnt, per_replica, loads = rank_view(state, layer)
        heaviest = loads.argmax(axis=1)
        peak = loads[np.arange(layer.size), heaviest]
        go = peak > state.node_cap[layer, heaviest // state.ranks_per_node] * (1 + 1e-12)
        has_empty = (state.placement[layer] == 0).any(axis=1)
        state.active[layer[~go & ~has_empty]] = False
        fill_one(state, layer[~go & has_empty])
        if not go.any():
            continue
        d = donors(state, layer[go], w[go], cnt[go], per_replica[go], loads[go])
        c = candidates(d)
        best, stuck = best_change(*score(state, d, c), d.cap, by_gain=by_gain)
        has_empty = has_empty[go]
        state.active[d.layer[stuck & ~has_empty]] = False
        fill_one(state, d.layer[stuck & has_empty])
        apply(state, d, c, best, ~stuck)
    while (left := np.nonzero((state.placement == 0).any(axis=1))[0]).size:  # only if iterations ran out
        fill_one(state, left)
    return state.placement - 1

"""The placement measures, each defined once (``shared/notes/placement-cost.md``; GLOSSARY's letters).

A placement is ``physical_to_logical`` int64 ``(L, P)`` (``-1``: an empty slot of elastic padding); slot
``s`` lives on rank ``s // p``. :func:`rank_loads` ``(L, N)`` splits each logical expert's load evenly
over its replicas (upstream ``DefaultEplbPolicy``'s model); :func:`layer_balancedness` ``(L,)`` and
:func:`mean_balancedness` (the one float the events file, ``plan`` and ``simulate`` report) are read from
it; :func:`received_experts` ``(L, N)`` and :func:`moved_experts` ``(L,)`` count transfers as upstream's
``move_to_buffer`` receives them. numpy and torch only, so the tools import it without vLLM. Torch
tensors in (host or device, never modified), CPU tensors or floats out; ``ValueError`` naming the value
and the rule for bad input.
"""

from __future__ import annotations

import numpy as np
import torch

from ascend_eplb.control.values import is_int

__all__ = [
    "balancedness",
    "hottest_rank_share",
    "layer_balancedness",
    "mean_balancedness",
    "moved_experts",
    "rank_loads",
    "received_experts",
    "split_bound",
    "upstream_initial_placement",
]

#: :func:`split_bound` enumerates the rank sets up to this many ranks (``2**N - 1`` sets), and solves a
#: maximum closure (a min cut) per step of Dinkelbach's method above it.
SPLIT_BOUND_ENUMERATED_RANKS = 12


def _placement_array(name: str, placement: object) -> np.ndarray:
    """int64 ``(L, P)`` host copy of a placement; ``ValueError`` unless it is a 2-D integer tensor."""
    if not isinstance(placement, torch.Tensor):
        raise ValueError(f"{name} is a {type(placement).__name__}: it must be a torch.Tensor (L, P)")
    if placement.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(placement.shape)}: it must be 2-D (L, P)")
    if placement.dtype.is_floating_point or placement.dtype.is_complex or placement.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {placement.dtype}: it must hold integer expert ids")
    return placement.detach().to("cpu", torch.int64).numpy()


def _load_array(weight: object, name: str = "load", shape: str = "(L, E)") -> np.ndarray:
    """float64 host copy of a 2-D load ``shape``; ``ValueError`` naming ``name`` unless 2-D with a
    non-empty second axis, finite and non-negative."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} is a {type(weight).__name__}: it must be a torch.Tensor {shape}")
    if weight.dim() != 2 or weight.shape[1] < 1:
        raise ValueError(f"{name} has shape {tuple(weight.shape)}: it must be {shape}, the second axis >= 1")
    if weight.dtype == torch.bool or weight.dtype.is_complex:
        raise ValueError(f"{name} has dtype {weight.dtype}: it must be an integer or float count")
    load = weight.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(load).all():
        raise ValueError(f"{name} holds a non-finite value: every load must be finite")
    if load.size and load.min() < 0:
        raise ValueError(f"{name} holds {load.min()}: every load must be >= 0")
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


def rank_loads(
    weight_LE: torch.Tensor,  # noqa: N803 (DESIGN.md shape letters)
    physical_to_logical_LP: torch.Tensor,  # noqa: N803
    num_ranks: int,
) -> torch.Tensor:
    """The load each rank's slots carry under a placement: float64 ``(L, N)``, CPU.

    Each logical expert's load is split evenly over its replicas (the model upstream's
    ``DefaultEplbPolicy`` optimises: ``tokens_per_mlog / mlogcnt``); rank ``r``'s load is the sum over its
    slots ``r * p .. (r + 1) * p - 1``. ``-1`` slots (elastic padding) hold nothing.

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
    return torch.from_numpy(_rank_loads(load, placement, counts, num_ranks))


def layer_balancedness(rank_loads_LN: torch.Tensor) -> torch.Tensor:  # noqa: N803 (DESIGN.md letters)
    """Per layer, mean rank load / max rank load: float64 ``(L,)``, CPU, in ``[0, 1]``.

    A layer without load is 1.0 (even: nothing to balance). The rank loads may be a placement's
    (:func:`rank_loads`) or recorded ones (a window's physical load summed per rank).

    Raises:
        ValueError: ``rank_loads_LN`` is not a 2-D tensor with N >= 1, or holds a negative or non-finite
            value.
    """
    return torch.from_numpy(_balancedness(_load_array(rank_loads_LN, "rank_loads_LN", "(L, N)")))


def mean_balancedness(rank_loads_LN: torch.Tensor) -> float:  # noqa: N803 (DESIGN.md letters)
    """:func:`layer_balancedness` averaged over the layers (every layer counts equally; upstream's
    ``EPLB step ... balancedness`` log sums the loads over layers before dividing instead).

    Raises:
        ValueError: as :func:`layer_balancedness`.
    """
    return float(layer_balancedness(rank_loads_LN).mean())


def balancedness(
    weight_LE: torch.Tensor,  # noqa: N803 (DESIGN.md shape letters)
    physical_to_logical_LP: torch.Tensor,  # noqa: N803
    num_ranks: int,
) -> torch.Tensor:
    """``layer_balancedness(rank_loads(weight_LE, physical_to_logical_LP, num_ranks))``: float64 ``(L,)``.

    Kept for :mod:`ascend_eplb.control.policy` and :mod:`ascend_eplb.control.gate`, which call it by this
    name; new code composes the two.

    Raises:
        ValueError: as :func:`rank_loads`.
    """
    return layer_balancedness(rank_loads(weight_LE, physical_to_logical_LP, num_ranks))


def split_bound(
    weight_LE: torch.Tensor,  # noqa: N803 (DESIGN.md shape letters)
    physical_to_logical_LP: torch.Tensor,  # noqa: N803
    num_ranks: int,
) -> torch.Tensor:
    """The balancedness a split of each expert's load among its replicas can reach: float64 ``(L,)``.

    With replicas free to take any share, the least max rank load is the max over rank sets ``A`` of
    the load of the experts whose replicas all lie in ``A``, divided by ``|A|`` (max-flow min-cut); the
    bound is the mean rank load over it (1.0 for a layer without load). Exact: the rank sets are
    enumerated up to :data:`SPLIT_BOUND_ENUMERATED_RANKS` ranks; above, Dinkelbach's method over a
    maximum closure (experts worth their load, each needing its ranks at the current ratio), solved as
    a min cut (networkx), ends on the maximizing set. The batch split of the data plane
    (``ascend_eplb.dataplane.split``) approaches it with whole selections.

    Raises:
        ValueError: as :func:`rank_loads`.
    """
    load = _load_array(weight_LE)
    placement = _placement_array("physical_to_logical_LP", physical_to_logical_LP)
    rank_loads(weight_LE, physical_to_logical_LP, num_ranks)  # the same rules, one message each
    held = _holdings(placement, num_ranks, load.shape[1]) > 0  # (L, N, E)
    if num_ranks <= SPLIT_BOUND_ENUMERATED_RANKS:
        peak = _enumerated_peak(load, held)
    else:
        peak = np.array([_closure_peak(load[i], held[i]) for i in range(load.shape[0])])
    mean = load.sum(axis=1) / num_ranks
    return torch.from_numpy(np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0))


def _enumerated_peak(load: np.ndarray, held: np.ndarray) -> np.ndarray:
    """``(L,)``: max over the ``2**N - 1`` rank sets of (load inside) / |A|."""
    num_ranks = held.shape[1]
    sets = (np.arange(1, 2**num_ranks)[:, None] >> np.arange(num_ranks)) & 1  # (S, N)
    outside = np.matmul((1 - sets).astype(np.float32), held.astype(np.float32))  # (L, S, E)
    inside = np.einsum("lse,le->ls", (outside == 0).astype(np.float64), load)
    return (inside / sets.sum(axis=1)).max(axis=1)


def _closure_peak(load: np.ndarray, held: np.ndarray) -> float:
    """max over rank sets A of (load inside A) / |A| for one layer, by Dinkelbach's method: from the
    mean, take the set maximizing (load inside) - ratio |A| (a maximum closure: source -> expert at its
    load, expert -> its ranks unbounded, rank -> sink at the ratio) until it gains nothing."""
    # local: only above the enumerated sizes
    import networkx as nx

    num_ranks, num_experts = held.shape
    loaded = [e for e in range(num_experts) if load[e] > 0]
    ratio = load.sum() / num_ranks
    best = ratio
    for _ in range(4 * num_ranks):
        graph = nx.DiGraph()
        for e in loaded:
            graph.add_edge("s", ("e", e), capacity=float(load[e]))
            for r in np.nonzero(held[:, e])[0]:
                graph.add_edge(("e", e), ("r", int(r)))
        for r in range(num_ranks):
            graph.add_edge(("r", r), "t", capacity=float(ratio))
        _, (source_side, _) = nx.minimum_cut(graph, "s", "t")
        ranks = [node[1] for node in source_side if node != "s" and node[0] == "r"]
        if not ranks:
            break
        inside = sum(load[e] for e in loaded if set(np.nonzero(held[:, e])[0]) <= set(ranks))
        if inside / len(ranks) <= ratio * (1 + 1e-12):
            break
        ratio = best = inside / len(ranks)
    return float(best)


def hottest_rank_share(rank_loads_LN: torch.Tensor) -> float:  # noqa: N803 (DESIGN.md letters)
    """The largest rank load of any layer as a share of that layer's total load, over the layers with
    load (0.0 when none has any).

    Raises:
        ValueError: as :func:`layer_balancedness`.
    """
    loads = _load_array(rank_loads_LN, "rank_loads_LN", "(L, N)")
    total = loads.sum(axis=1)
    loaded = total > 0
    if not loaded.any():
        return 0.0
    return float((loads.max(axis=1)[loaded] / total[loaded]).max())


def upstream_initial_placement(
    num_logical_experts: int, num_redundant_experts: int, num_moe_layers: int
) -> torch.Tensor:
    """Upstream's initial placement, int64 ``(L, P)``, every layer alike: slot ``i < E`` holds logical
    expert ``i``, redundant slot ``E + j`` holds ``j % E`` (vLLM 0.33.0's
    ``EplbState.build_initial_global_physical_to_logical_map``, restated so that the tools need not
    import vLLM; its body is pinned by a row of :mod:`ascend_eplb.control.upstream`).

    Raises:
        ValueError: E < 1, a negative redundancy or L.
    """
    for name, value, low in (
        ("num_logical_experts", num_logical_experts, 1),
        ("num_redundant_experts", num_redundant_experts, 0),
        ("num_moe_layers", num_moe_layers, 0),
    ):
        if not is_int(value) or value < low:
            raise ValueError(f"{name}={value!r}: must be an int >= {low}")
    row = torch.arange(num_logical_experts + num_redundant_experts, dtype=torch.int64) % num_logical_experts
    return row.unsqueeze(0).repeat(num_moe_layers, 1)


def _holdings(
    placement: np.ndarray, num_ranks: int, num_logical_experts: int, *, with_empty: bool = False
) -> np.ndarray:
    """int32 ``(L, N, E)``: how many slots of each rank hold each logical expert (``with_empty``:
    ``(L, N, 1 + E)``, column 0 counting the empty slots)."""
    num_layers, num_physical = placement.shape
    held = np.zeros((num_layers, num_ranks, num_logical_experts + 1), dtype=np.int32)
    rows = np.broadcast_to(np.arange(num_layers)[:, None], placement.shape)
    ranks = np.broadcast_to(np.arange(num_physical) // (num_physical // num_ranks), placement.shape)
    np.add.at(held, (rows, ranks, placement + 1), 1)
    return held if with_empty else held[:, :, 1:]


def received_experts(
    old_LP: torch.Tensor,  # noqa: N803 (DESIGN.md shape letters)
    new_LP: torch.Tensor,  # noqa: N803
    num_ranks: int,
) -> torch.Tensor:
    """The logical experts each rank receives in a rearrangement ``old -> new``: int64 ``(L, N)``, CPU.

    Per layer and rank ``r``, ``|set(new[l, r]) - set(old[l, r])|``, where ``x[l, r]`` is rank ``r``'s
    slots ``r * p .. (r + 1) * p - 1``: a logical expert the rank already held is a local copy, not a
    transfer; two new slots of one expert on a rank are one transfer (upstream's ``move_to_buffer``
    receives one primary copy per expert and copies it locally). ``-1`` slots hold nothing.

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
    return torch.from_numpy(gained.sum(axis=2, dtype=np.int64))


def moved_experts(
    old_LP: torch.Tensor,  # noqa: N803 (DESIGN.md shape letters)
    new_LP: torch.Tensor,  # noqa: N803
    num_ranks: int,
) -> torch.Tensor:
    """Experts each layer's rearrangement ``old -> new`` transfers between ranks: int64 ``(L,)``, CPU.

    :func:`received_experts` summed over the ranks; ``.sum()`` is the rearrangement's total.

    Raises:
        ValueError: as :func:`received_experts`.
    """
    return received_experts(old_LP, new_LP, num_ranks).sum(dim=1)

"""Placement metrics shared by the events file and ``ascend-eplb plan`` (one definition of each).

Shape letters: L MoE layers, E logical experts, P physical experts, N EP ranks. Every function takes
and returns host tensors in float64 (loads) or int64 (placements) and does not modify its inputs.

- rank load: a logical expert's load split evenly over its replicas (the policy's own model,
  ``tokens_per_mlog / mlogcnt`` in upstream ``DefaultEplbPolicy.rebalance_experts_hierarchical``),
  summed over the slots of each rank (slot ``p`` on rank ``p // (P / N)``);
- balancedness: mean rank load / max rank load per layer, averaged over the layers (upstream's
  ``EPLB step ... balancedness`` log sums over layers before dividing; the per-layer mean makes every
  layer count equally); a layer without load counts as 1.0 (nothing to balance);
- experts crossing ranks: over all layers and ranks, the logical experts a rank holds after a
  rearrangement that it did not hold before, i.e. expert weights that travel between ranks; per rank:
  the experts that rank receives;
- expert bytes: per MoE layer, the bytes of one expert's weights (every tensor a rearrangement moves);
- bytes received: what this rank's communicator received over all its transfers so far.

Rank loads, balancedness and received experts are :mod:`ascend_eplb.control.measures`' (one definition
each, shared with the migration-aware policy and the gain gate; numpy and torch only, so the tools read
them without importing vLLM); this module names them for the events file and the tools.
"""

from __future__ import annotations

import torch

from ascend_eplb.control import measures

__all__ = [
    "balancedness",
    "bytes_received",
    "expert_bytes",
    "experts_crossing_ranks",
    "experts_received_per_rank",
    "hottest_rank_share",
    "rank_loads",
]


def rank_loads(load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """float64 ``(L, N)``: per layer and rank, the load its slots carry under the placement.

    :func:`ascend_eplb.control.measures.rank_loads` (the one definition), on ``load`` ``(L, E)`` and
    ``physical_to_logical`` int ``(L, P)``.

    Raises:
        ValueError: as that function (shapes, N not dividing P, ids outside ``[-1, E)``, an expert with
            load that no slot holds).
    """
    return measures.rank_loads(torch.as_tensor(load), torch.as_tensor(physical_to_logical), num_ranks)


def balancedness(loads: torch.Tensor) -> float:
    """``loads`` ``(L, N)``: mean over layers of (mean rank load / max rank load); a layer without
    load counts 1.0 (:func:`ascend_eplb.control.measures.rank_balancedness`, averaged)."""
    return float(measures.rank_balancedness(torch.as_tensor(loads)).mean())


def hottest_rank_share(loads: torch.Tensor) -> float:
    """The largest rank load of any layer, as a share of that layer's total load (layers with load)."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    total = loads.sum(dim=1)
    loaded = total > 0
    if not bool(loaded.any()):
        return 0.0
    return float((loads.max(dim=1).values[loaded] / total[loaded]).max())


def experts_crossing_ranks(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> int:
    """Experts the rearrangement ``old -> new`` (``(L, P)`` each) transfers, over layers and ranks."""
    return int(experts_received_per_rank(old, new, num_ranks).sum())


def experts_received_per_rank(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """int64 ``(L, N)``: per layer, the logical experts each rank receives in the rearrangement
    ``old -> new`` (``(L, P)`` each): :func:`ascend_eplb.control.measures.received_experts` (an expert the
    rank held is a local copy; two new slots of one expert are one transfer, as upstream's
    ``move_to_buffer`` receives it).

    Raises:
        ValueError: the placements differ in shape, are not 2-D, or N does not divide P.
    """
    return measures.received_experts(torch.as_tensor(old), torch.as_tensor(new), num_ranks)


def expert_bytes(expert_weights) -> list[int]:
    """Per MoE layer, the bytes one expert's weights occupy: what moving one expert transfers.

    Args:
        expert_weights: upstream's ``MixtureOfExperts.expert_weights``, per layer a sequence of weight
            views ``(p, ...)`` (stacked tensors, or quant_views' per-expert ``ExpertTensorList`` s): the
            tensors upstream's transaction moves, scales included.

    Returns:
        ``[sum over the layer's views of view[0].numel() * view[0].element_size()]`` per layer.
    """
    return [sum(int(view[0].numel()) * view[0].element_size() for view in layer) for layer in expert_weights]


def bytes_received(model_state) -> int | None:
    """Bytes this rank has received over all the model's transfers so far, or None when not counted.

    Args:
        model_state: upstream's ``EplbModelState``; its ``communicator``'s ``cumulative_stats``
            (movement's :class:`~ascend_eplb.movement.stats.TransferStats`) is read.

    Returns:
        ``cumulative_stats.bytes_received``; None when the communicator keeps no statistics (one of
        upstream's own communicators).
    """
    stats = getattr(model_state.communicator, "cumulative_stats", None)
    return None if stats is None else int(stats.bytes_received)

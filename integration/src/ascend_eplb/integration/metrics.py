"""Placement metrics shared by the events file and ``ascend-eplb plan`` (one definition of each).

Shape letters: L MoE layers, E logical experts, P physical experts, N EP ranks. Every function takes
and returns host tensors in float64 (loads) or int64 (placements) and does not modify its inputs.

- rank load: a logical expert's load split evenly over its replicas (the policy's own model,
  ``tokens_per_mlog / mlogcnt`` in upstream ``DefaultEplbPolicy.rebalance_experts_hierarchical``),
  summed over the slots of each rank (slot ``p`` on rank ``p // (P / N)``);
- balancedness: mean rank load / max rank load per layer, averaged over the layers (upstream's
  ``EPLB step ... balancedness`` log sums over layers before dividing; the per-layer mean makes every
  layer count equally); a layer without load counts as 1.0 (nothing to balance);
- experts crossing ranks: slots, over all layers, whose new logical expert was not on that slot's rank
  before, i.e. expert weights that travel between ranks; per rank: the experts that rank receives;
- expert bytes: per MoE layer, the bytes of one expert's weights (every tensor a rearrangement moves).
"""

from __future__ import annotations

import torch

__all__ = [
    "balancedness",
    "expert_bytes",
    "experts_crossing_ranks",
    "experts_received_per_rank",
    "hottest_rank_share",
    "rank_loads",
]


def rank_loads(load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """float64 ``(L, N)``: per layer and rank, the load its slots carry under the placement.

    Args:
        load: ``(L, E)`` load per logical expert (any non-negative unit).
        physical_to_logical: int ``(L, P)``, each slot's logical expert in ``[0, E)``.
        num_ranks: N; must divide P.

    Raises:
        ValueError: shapes disagree, N does not divide P, or a slot names an expert outside ``[0, E)``.
    """
    load = torch.as_tensor(load, dtype=torch.float64)
    p2l = torch.as_tensor(physical_to_logical, dtype=torch.int64)
    if load.dim() != 2 or p2l.dim() != 2 or load.shape[0] != p2l.shape[0]:
        raise ValueError(
            f"load {tuple(load.shape)} and placement {tuple(p2l.shape)} must be (L, E) and (L, P) of one L"
        )
    num_moe_layers, num_experts = load.shape
    if num_ranks < 1 or p2l.shape[1] % num_ranks:
        raise ValueError(f"num_ranks={num_ranks} must divide P={p2l.shape[1]}")
    if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_experts):
        raise ValueError(f"the placement names experts outside [0, {num_experts})")
    replicas = torch.zeros(num_moe_layers, num_experts, dtype=torch.float64)
    replicas.scatter_add_(1, p2l, torch.ones_like(p2l, dtype=torch.float64))
    per_slot = torch.gather(load / replicas.clamp(min=1.0), 1, p2l)
    return per_slot.view(num_moe_layers, num_ranks, -1).sum(dim=-1)


def balancedness(loads: torch.Tensor) -> float:
    """``loads`` ``(L, N)``: mean over layers of (mean rank load / max rank load); a layer without
    load counts 1.0."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    peak = loads.max(dim=1).values
    ratio = torch.where(peak > 0, loads.mean(dim=1) / peak.clamp(min=torch.finfo(torch.float64).tiny), 1.0)
    return float(ratio.mean())


def hottest_rank_share(loads: torch.Tensor) -> float:
    """The largest rank load of any layer, as a share of that layer's total load (layers with load)."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    total = loads.sum(dim=1)
    loaded = total > 0
    if not bool(loaded.any()):
        return 0.0
    return float((loads.max(dim=1).values[loaded] / total[loaded]).max())


def experts_crossing_ranks(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> int:
    """Slots of ``new`` ``(L, P)`` whose logical expert was not held by that slot's rank under ``old``."""
    return int(experts_received_per_rank(old, new, num_ranks).sum())


def experts_received_per_rank(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """int64 ``(L, N)``: per layer, the slots of each rank whose new logical expert the rank did not
    hold under ``old`` (``(L, P)`` each), i.e. the experts the rank receives in that rearrangement.

    Raises:
        ValueError: the placements differ in shape, are not 2-D, or N does not divide P.
    """
    old = torch.as_tensor(old, dtype=torch.int64)
    new = torch.as_tensor(new, dtype=torch.int64)
    if old.shape != new.shape or old.dim() != 2 or old.shape[1] % num_ranks:
        raise ValueError(f"placements {tuple(old.shape)} and {tuple(new.shape)} must be (L, P), N | P")
    num_moe_layers, num_physical = old.shape
    p = num_physical // num_ranks
    old_r = old.view(num_moe_layers, num_ranks, p)
    new_r = new.view(num_moe_layers, num_ranks, p)
    held = (new_r.unsqueeze(-1) == old_r.unsqueeze(-2)).any(dim=-1)  # (L, N, p)
    return (~held).sum(dim=-1)


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

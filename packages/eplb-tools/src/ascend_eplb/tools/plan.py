"""``ascend-eplb plan``: offline what-if of upstream vLLM's default EPLB policy on recorded load.

For each redundancy level the placement comes from one call of upstream
``vllm.distributed.eplb.policy.default.DefaultEplbPolicy.rebalance_experts`` (vLLM 0.33.0), with the
initial placement upstream's ``EplbState.add_model`` builds (``EplbState.
build_initial_global_physical_to_logical_map``: experts ``0..E-1`` then ``i % E`` for the redundant
slots, slot ``p`` on rank ``p // (P / N)``) as the "before" and as ``old_global_expert_indices``, exactly
as ``EplbState.rearrange`` passes the current map. Nothing here computes a placement itself.

Metrics (float64, the unit of the input load): rank load, balancedness, hottest rank share and
experts moved (crossing ranks) as :mod:`ascend_eplb.integration.metrics` defines them, the one
definition the serving events file uses too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

__all__ = [
    "PlanLevel",
    "PlanResult",
    "format_plan",
    "linear_placement",
    "plan",
    "rank_loads",
    "validate_plan_args",
]


@dataclass(frozen=True)
class PlanLevel:
    """Result of one redundancy level (see the module docstring for each metric's definition)."""

    num_redundant_experts: int
    num_physical_experts: int
    balancedness_before: float
    balancedness_after: float
    hottest_rank_share_before: float
    hottest_rank_share_after: float
    experts_moved: int
    physical_to_logical_map: list[list[int]]  # [L_loaded, P], the policy's placement


@dataclass(frozen=True)
class PlanResult:
    num_ranks: int
    num_nodes: int
    num_expert_groups: int
    num_layers: int
    num_logical_experts: int
    layers_excluded: list[int]  # indices into the input's L with zero total load
    levels: list[PlanLevel]

    def to_json(self) -> dict:
        return asdict(self)


def validate_plan_args(
    shape: tuple[int, ...], num_ranks: int, num_nodes: int, num_expert_groups: int, redundancy: Sequence[int]
) -> None:
    """Raise ``ValueError`` listing every violated rule (shape ``[L, E]``; policy preconditions of
    ``DefaultEplbPolicy.rebalance_experts_hierarchical``)."""
    errors = []
    if len(shape) != 2:
        errors.append(f"load shape {shape}: must be [L, E]")
        raise ValueError("; ".join(errors))
    num_experts = shape[1]
    if num_ranks < 1:
        errors.append(f"ranks={num_ranks}: must be >= 1")
    if num_nodes < 1 or (num_ranks >= 1 and num_ranks % num_nodes):
        errors.append(f"nodes={num_nodes}: must be >= 1 and divide ranks={num_ranks}")
    if num_expert_groups < 1 or num_experts % num_expert_groups:
        errors.append(f"expert groups={num_expert_groups}: must be >= 1 and divide E={num_experts}")
    if not redundancy:
        errors.append("redundancy levels: give at least one")
    for r in redundancy:
        if r < 0:
            errors.append(f"redundant experts={r}: must be >= 0")
        elif num_ranks >= 1 and (num_experts + r) % num_ranks:
            errors.append(
                f"redundant experts={r}: E + redundant = {num_experts + r} physical experts must divide "
                f"evenly over ranks={num_ranks}"
            )
    if errors:
        raise ValueError("; ".join(errors))


def linear_placement(num_logical_experts: int, num_redundant_experts: int, num_layers: int) -> torch.Tensor:
    """int64 ``[L, P]``: upstream's initial placement, repeated per layer."""
    from vllm.distributed.eplb.eplb_state import EplbState

    row = EplbState.build_initial_global_physical_to_logical_map(num_logical_experts, num_redundant_experts)
    return torch.tensor(row, dtype=torch.int64).unsqueeze(0).repeat(num_layers, 1)


def rank_loads(load_le: np.ndarray, phy2log_lp: np.ndarray, num_ranks: int) -> np.ndarray:
    """float64 ``[L, N]`` (:func:`ascend_eplb.integration.metrics.rank_loads` on numpy arrays)."""
    from ascend_eplb.integration.metrics import rank_loads as loads_of

    return loads_of(
        torch.from_numpy(np.asarray(load_le)), torch.from_numpy(np.asarray(phy2log_lp)), num_ranks
    ).numpy()


def plan(
    load_le: np.ndarray,
    *,
    num_ranks: int,
    redundancy: Sequence[int],
    num_nodes: int = 1,
    num_expert_groups: int = 1,
) -> PlanResult:
    """Run upstream's default policy on ``load_le`` (float ``[L, E]``, >= 0) for each redundancy level.

    Layers whose load sums to 0 are excluded (their indices are in ``layers_excluded``); raises
    ``ValueError`` if every layer is empty, or with every violated rule of :func:`validate_plan_args`.
    """
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    from ascend_eplb.integration import metrics

    load = np.asarray(load_le, dtype=np.float64)
    validate_plan_args(load.shape, num_ranks, num_nodes, num_expert_groups, redundancy)
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load: must be finite and >= 0")
    loaded = load.sum(axis=1) > 0
    excluded = [int(i) for i in np.flatnonzero(~loaded)]
    if not loaded.any():
        raise ValueError(f"load: all {load.shape[0]} layers have zero load; nothing to plan")
    load = load[loaded]
    num_layers, num_experts = load.shape
    levels = []
    for r in redundancy:
        old = linear_placement(num_experts, r, num_layers)
        new = DefaultEplbPolicy.rebalance_experts(
            torch.from_numpy(load), num_experts + r, num_expert_groups, num_nodes, num_ranks, old
        ).numpy()
        before, after = rank_loads(load, old.numpy(), num_ranks), rank_loads(load, new, num_ranks)
        before_t, after_t = torch.from_numpy(before), torch.from_numpy(after)
        levels.append(
            PlanLevel(
                num_redundant_experts=int(r),
                num_physical_experts=num_experts + int(r),
                balancedness_before=metrics.balancedness(before_t),
                balancedness_after=metrics.balancedness(after_t),
                hottest_rank_share_before=metrics.hottest_rank_share(before_t),
                hottest_rank_share_after=metrics.hottest_rank_share(after_t),
                experts_moved=metrics.experts_crossing_ranks(old, torch.from_numpy(new), num_ranks),
                physical_to_logical_map=new.tolist(),
            )
        )
    return PlanResult(
        num_ranks, num_nodes, num_expert_groups, int(loaded.size), num_experts, excluded, levels
    )


def format_plan(result: PlanResult) -> str:
    """Human-readable table of a :class:`PlanResult`."""
    lines = [
        f"upstream DefaultEplbPolicy: {result.num_layers} layers x {result.num_logical_experts} "
        f"logical experts, ranks={result.num_ranks} nodes={result.num_nodes} "
        f"expert groups={result.num_expert_groups}",
    ]
    if result.layers_excluded:
        lines.append(f"excluded (no load): layers {result.layers_excluded}")
    lines.append(
        f"{'redundant':>9} {'physical':>8} {'balancedness':>21} {'hottest rank share':>21} "
        f"{'experts moved':>13}"
    )
    lines.append(f"{'':>9} {'':>8} {'before':>10} {'after':>10} {'before':>10} {'after':>10}")
    for lv in result.levels:
        lines.append(
            f"{lv.num_redundant_experts:>9} {lv.num_physical_experts:>8} {lv.balancedness_before:>10.4f} "
            f"{lv.balancedness_after:>10.4f} {lv.hottest_rank_share_before:>10.4f} "
            f"{lv.hottest_rank_share_after:>10.4f} {lv.experts_moved:>13}"
        )
    return "\n".join(lines)

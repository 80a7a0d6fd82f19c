"""``ascend-eplb plan``: offline what-if of upstream vLLM's default EPLB policy on recorded load.

For each redundancy level the placement comes from one call of upstream
``vllm.distributed.eplb.policy.default.DefaultEplbPolicy.rebalance_experts`` (vLLM 0.33.0, see
:func:`upstream_policy`), with the initial placement upstream's ``EplbState.add_model`` builds
(``EplbState.build_initial_global_physical_to_logical_map``: experts ``0..E-1`` then ``i % E`` for the
redundant slots, slot ``p`` on rank ``p // (P / N)``) as the "before" and as
``old_global_expert_indices``, exactly as ``EplbState.rearrange`` passes the current map. That two-line
initial map is restated in :func:`linear_placement` (importing ``EplbState`` imports all of vLLM) and
checked equal to upstream's by the tests; every other placement is the policy's own.

Metrics (float64, the unit of the input load): rank load, balancedness, hottest rank share and
experts moved (crossing ranks; per rank: experts received) as :mod:`ascend_eplb.integration.metrics`
defines them, the one definition the serving events file uses too.

Export (:func:`export_placement`): one level's placement as a placement file
(:mod:`ascend_eplb.integration.placement_file`, version 1: vLLM Ascend's ``expert_map_path`` JSON plus
the model facts), every MoE layer of the load included (a layer without load keeps upstream's initial
placement), for ``additional_config.eplb_config.initial_placement``. On a serving events file that
records its configuration (:func:`recorded_configuration`), the level exported without
``--redundant-experts`` is the recorded ``num_redundant_experts``: the file fits the server that
recorded it.

Levels: by default a sweep (:func:`sweep_levels`): every ``R`` in ``[0, E]`` with ``(E + R)`` divisible by
the ranks, i.e. 0 and the multiples of ``N`` when ``N`` divides ``E``. Policies: the one upstream runs for
the given nodes and expert groups (hierarchical when the groups divide over the nodes, otherwise global)
and, whenever ``nodes > 1``, the global policy beside it (``rebalance_experts(..., num_groups=1,
num_nodes=1, ...)``, the branch upstream takes when the groups do not divide): node-local placement
limits the balance it can reach, and the operator sees that trade. Recommendation
(:func:`recommend`): the smallest level whose balancedness after is within ``margin`` of the best level's.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "DEFAULT_MARGIN",
    "PlanLevel",
    "PlanResult",
    "export_placement",
    "format_plan",
    "level_error",
    "linear_placement",
    "plan",
    "rank_loads",
    "recommend",
    "recorded_configuration",
    "sweep_levels",
    "upstream_policy",
    "validate_plan_args",
]

#: Recommendation margin: a level within 0.01 balancedness of the best counts as the best (the noise
#: between windows of one workload is larger: the ESFT tasks' 0.9935-0.9976 at level 0, SIMULATE.md).
DEFAULT_MARGIN = 0.01


@dataclass(frozen=True)
class PlanLevel:
    """Result of one redundancy level under one policy (see the module docstring for each metric).

    ``policy``: ``"hierarchical"`` or ``"global"``; ``busiest_rank_experts_received``: the most experts
    one rank receives over all loaded layers when moving from the initial placement to this one.
    """

    num_redundant_experts: int
    num_physical_experts: int
    balancedness_before: float
    balancedness_after: float
    hottest_rank_share_before: float
    hottest_rank_share_after: float
    experts_moved: int
    physical_to_logical_map: list[list[int]]  # [L_loaded, P], the policy's placement
    policy: str = "global"
    busiest_rank_experts_received: int = 0


@dataclass(frozen=True)
class PlanResult:
    num_ranks: int
    num_nodes: int
    num_expert_groups: int
    num_moe_layers: int
    num_logical_experts: int
    layers_excluded: list[int]  # indices into the input's L with zero total load
    levels: list[PlanLevel]
    invalid_levels: list[dict] = field(default_factory=list)  # {"num_redundant_experts", "error"}
    policy: str = "global"  # the policy upstream runs for these nodes / groups
    margin: float = DEFAULT_MARGIN
    recommended: int | None = None  # num_redundant_experts of the recommendation (configured policy)
    costs: dict | None = None  # per level (str key), :class:`~ascend_eplb.tools.costs.CostEstimate`

    def to_json(self) -> dict:
        return asdict(self)

    def level(self, num_redundant_experts: int, policy: str | None = None) -> PlanLevel:
        """The level of ``num_redundant_experts`` under ``policy`` (default: the configured one)."""
        want = policy or self.policy
        for lv in self.levels:
            if lv.num_redundant_experts == num_redundant_experts and lv.policy == want:
                return lv
        raise KeyError(f"no valid level {num_redundant_experts} under the {want} policy")


#: Upstream ``EplbState.add_model``'s ``MAX_EXPERT_REDUNDANCY``: replicas beyond the first per logical
#: expert its maps can hold.
MAX_REDUNDANT_PER_EXPERT = 1023


def level_error(num_logical_experts: int, num_redundant_experts: int, num_ranks: int) -> str | None:
    """Why one redundancy level cannot be planned, or None."""
    from ascend_eplb.integration.rules import experts_divisibility_error

    if num_redundant_experts < 0:
        return f"redundant experts={num_redundant_experts}: must be >= 0"
    if num_redundant_experts > MAX_REDUNDANT_PER_EXPERT * num_logical_experts:
        return (
            f"redundant experts={num_redundant_experts}: must be <= {MAX_REDUNDANT_PER_EXPERT} x E = "
            f"{MAX_REDUNDANT_PER_EXPERT * num_logical_experts} (upstream EplbState keeps at most "
            f"{MAX_REDUNDANT_PER_EXPERT} + 1 replicas of a logical expert)"
        )
    reason = experts_divisibility_error(num_logical_experts, num_redundant_experts, num_ranks)
    return None if reason is None else f"redundant experts={num_redundant_experts}: {reason}"


def sweep_levels(num_logical_experts: int, num_ranks: int) -> list[int]:
    """The default levels: every ``R`` in ``[0, E]`` (the bound: one extra replica per logical expert)
    with ``E + R`` divisible by ``N``."""
    return [r for r in range(num_logical_experts + 1) if (num_logical_experts + r) % num_ranks == 0]


def validate_plan_args(
    shape: tuple[int, ...],
    num_ranks: int,
    num_nodes: int,
    num_expert_groups: int,
    redundancy: Sequence[int] | None = None,
) -> None:
    """Raise ``ValueError`` listing every violated rule (shape ``[L, E]``; policy preconditions of
    ``DefaultEplbPolicy.rebalance_experts_hierarchical``). Redundancy levels are judged one by one
    (:func:`level_error`): only when every given level is invalid is that an error here."""
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
    if redundancy is None and num_ranks >= 1 and not sweep_levels(num_experts, num_ranks):
        errors.append(
            f"ranks={num_ranks}: no redundancy level in [0, E={num_experts}] makes E + level divisible by "
            "the ranks; give --redundant-experts"
        )
    if redundancy is not None:
        if not redundancy:
            errors.append("redundancy levels: give at least one")
        elif num_ranks >= 1:
            level_errors = [level_error(num_experts, r, num_ranks) for r in redundancy]
            if all(level_errors):
                errors.extend(level_errors)  # type: ignore[arg-type]
    if errors:
        raise ValueError("; ".join(errors))


def linear_placement(
    num_logical_experts: int, num_redundant_experts: int, num_moe_layers: int
) -> torch.Tensor:
    """int64 ``[L, P]``: upstream's initial placement, repeated per layer.

    Upstream's ``EplbState.build_initial_global_physical_to_logical_map`` (vLLM 0.33.0): the logical
    experts in order, then ``i % E`` for redundant slot ``i``; ``tests/test_plan.py`` checks the two
    are equal."""
    row = list(range(num_logical_experts)) + [i % num_logical_experts for i in range(num_redundant_experts)]
    return torch.tensor(row, dtype=torch.int64).unsqueeze(0).repeat(num_moe_layers, 1)


#: Upstream's policy module (vLLM 0.33.0).
UPSTREAM_POLICY_MODULE = "vllm.distributed.eplb.policy.default"
# The private package upstream's policy files run in when vLLM is not imported (a top-level name,
# so a relative import reaching above ``policy/`` fails instead of finding one of our modules).
_POLICY_FILES_PACKAGE = "_ascend_eplb_vllm_eplb_policy"


def upstream_policy() -> type:
    """Upstream ``DefaultEplbPolicy``, the class of :data:`UPSTREAM_POLICY_MODULE`.

    When that module is imported already, its class. Otherwise upstream's ``policy/abstract.py`` and
    ``policy/default.py`` are run from vLLM's installed files, unchanged, as the modules of a private
    package (:data:`_POLICY_FILES_PACKAGE`), without the ``__init__`` of ``vllm`` and of its
    subpackages: importing the module by name imports vLLM's config, distributed and model layers,
    about 6.6 s of the 8.1 s one ``ascend-eplb plan`` call took on a 2-core CPU host (``python -X
    importtime``). Those two files import only numpy, torch and each other; should a later vLLM's files
    import anything else, loading them alone fails and the module is imported by name (slower,
    the same code). ``tests/test_plan.py`` checks that a ``plan`` call imports no ``vllm`` module and
    prints what the by-name import gives.
    """
    loaded = sys.modules.get(UPSTREAM_POLICY_MODULE) or sys.modules.get(f"{_POLICY_FILES_PACKAGE}.default")
    if loaded is None:
        try:
            loaded = _load_policy_files()
        except Exception:
            for name in [n for n in sys.modules if n.split(".")[0] == _POLICY_FILES_PACKAGE]:
                del sys.modules[name]
            loaded = importlib.import_module(UPSTREAM_POLICY_MODULE)
    return loaded.DefaultEplbPolicy


def _load_policy_files() -> types.ModuleType:
    spec = importlib.util.find_spec("vllm")  # locates the installed package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vllm is not installed")
    package = types.ModuleType(_POLICY_FILES_PACKAGE, f"vLLM's {UPSTREAM_POLICY_MODULE} files, run alone")
    package.__path__ = [f"{spec.submodule_search_locations[0]}/distributed/eplb/policy"]
    sys.modules[_POLICY_FILES_PACKAGE] = package
    return importlib.import_module(f"{_POLICY_FILES_PACKAGE}.default")


def rank_loads(load_le: np.ndarray, phy2log_lp: np.ndarray, num_ranks: int) -> np.ndarray:
    """float64 ``[L, N]`` (:func:`ascend_eplb.integration.metrics.rank_loads` on numpy arrays)."""
    from ascend_eplb.integration.metrics import rank_loads as loads_of

    return loads_of(
        torch.from_numpy(np.asarray(load_le)), torch.from_numpy(np.asarray(phy2log_lp)), num_ranks
    ).numpy()


def recommend(levels: Sequence[PlanLevel], margin: float = DEFAULT_MARGIN) -> PlanLevel | None:
    """The smallest-redundancy level whose ``balancedness_after`` is within ``margin`` of the best."""
    if not levels:
        return None
    best = max(lv.balancedness_after for lv in levels)
    return min((lv for lv in levels if lv.balancedness_after >= best - margin),
               key=lambda lv: lv.num_redundant_experts)  # fmt: skip


def plan(
    load_le: np.ndarray,
    *,
    num_ranks: int,
    redundancy: Sequence[int] | None = None,
    num_nodes: int = 1,
    num_expert_groups: int = 1,
    margin: float = DEFAULT_MARGIN,
) -> PlanResult:
    """Run upstream's default policy on ``load_le`` (float ``[L, E]``, >= 0) for each redundancy level
    (``None``: :func:`sweep_levels`), under the configured policy and, when ``num_nodes > 1``, the
    global one too.

    Layers whose load sums to 0 are excluded (their indices are in ``layers_excluded``). An invalid level
    is reported in ``invalid_levels`` beside the valid ones. Raises ``ValueError`` if every layer is
    empty, or with every violated rule of :func:`validate_plan_args` (every level invalid included).
    """
    from ascend_eplb.integration import metrics

    policy = upstream_policy()

    load = np.asarray(load_le, dtype=np.float64)
    validate_plan_args(load.shape, num_ranks, num_nodes, num_expert_groups, redundancy)
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load: must be finite and >= 0")
    loaded = load.sum(axis=1) > 0
    excluded = [int(i) for i in np.flatnonzero(~loaded)]
    if not loaded.any():
        raise ValueError(f"load: all {load.shape[0]} layers have zero load; nothing to plan")
    load = load[loaded]
    num_moe_layers, num_experts = load.shape
    levels_in = sweep_levels(num_experts, num_ranks) if redundancy is None else list(redundancy)
    # Upstream's branch: hierarchical when the groups divide over the nodes; on one node that packs every
    # group onto the one node, the same as global, so it is named global there.
    configured = "hierarchical" if num_nodes > 1 and num_expert_groups % num_nodes == 0 else "global"
    # (name, groups, nodes) as passed to rebalance_experts; global = upstream's own fallback branch.
    policies = [(configured, num_expert_groups, num_nodes)]
    if num_nodes > 1 and configured != "global":
        policies.append(("global", 1, 1))
    levels, invalid = [], []
    for r in levels_in:
        error = level_error(num_experts, r, num_ranks)
        if error is not None:
            invalid.append({"num_redundant_experts": int(r), "error": error})
            continue
        old = linear_placement(num_experts, r, num_moe_layers)
        before = rank_loads(load, old.numpy(), num_ranks)
        before_t = torch.from_numpy(before)
        for name, groups, nodes in policies:
            new = policy.rebalance_experts(
                torch.from_numpy(load), num_experts + r, groups, nodes, num_ranks, old
            ).numpy()
            after_t = torch.from_numpy(rank_loads(load, new, num_ranks))
            received = metrics.experts_received_per_rank(old, torch.from_numpy(new), num_ranks)
            levels.append(
                PlanLevel(
                    num_redundant_experts=int(r),
                    num_physical_experts=num_experts + int(r),
                    balancedness_before=metrics.balancedness(before_t),
                    balancedness_after=metrics.balancedness(after_t),
                    hottest_rank_share_before=metrics.hottest_rank_share(before_t),
                    hottest_rank_share_after=metrics.hottest_rank_share(after_t),
                    experts_moved=int(received.sum()),
                    physical_to_logical_map=new.tolist(),
                    policy=name,
                    busiest_rank_experts_received=int(received.sum(dim=0).max()),
                )
            )
    chosen = recommend([lv for lv in levels if lv.policy == configured], margin)
    return PlanResult(
        num_ranks, num_nodes, num_expert_groups, int(loaded.size), num_experts, excluded, levels,
        invalid_levels=invalid, policy=configured, margin=margin,
        recommended=None if chosen is None else chosen.num_redundant_experts,
    )  # fmt: skip


def export_placement(result: PlanResult, level: PlanLevel, *, source: str = "") -> Any:
    """One level's placement for every MoE layer of the load, as a
    :class:`~ascend_eplb.integration.placement_file.Placement` (``write_placement`` writes it).

    ``layer_id`` counts the MoE layers of the load (dense layers have none); a layer without load (in
    ``result.layers_excluded``) keeps upstream's initial placement (:func:`linear_placement`), the
    others hold the level's policy placement.

    Raises:
        PlacementFileError: the placement breaks a rule of the format (not for a policy's result).
    """
    from ascend_eplb.integration.placement_file import placement_from_map

    e, r = result.num_logical_experts, level.num_redundant_experts
    rows = linear_placement(e, r, result.num_moe_layers).tolist()
    loaded = [i for i in range(result.num_moe_layers) if i not in set(result.layers_excluded)]
    for layer, row in zip(loaded, level.physical_to_logical_map, strict=True):
        rows[layer] = list(row)
    return placement_from_map(rows, num_logical_experts=e, num_ranks=result.num_ranks, source=source)


def recorded_configuration(path: str | Path) -> tuple[int, int] | None:
    """``(num_physical_experts, num_ranks)`` a serving events file records (its last ``window`` record
    of its first model stating both), or None: not an events file (``.jsonl``), or one recorded before
    the configuration was (an earlier ascend-eplb-integration).

    Raises:
        ValueError: the events file cannot be read (naming the file and the line).
    """
    if Path(path).suffix.lower() != ".jsonl":
        return None
    from ascend_eplb.control.values import is_int
    from ascend_eplb.integration.events import read_records

    found, model = None, None
    for _, record in read_records(path, stacklevel=3):
        if record["event"] != "window":
            continue
        model = record.get("model") if model is None else model
        p, n = record.get("num_physical_experts"), record.get("num_ranks")
        if record.get("model") == model and is_int(p) and is_int(n):
            found = (p, n)
    return found


def format_plan(result: PlanResult) -> str:
    """Human-readable table of a :class:`PlanResult`: one row per level and policy, invalid levels with
    their reason, the recommendation and, with costs, each level's memory and rearrangement cost."""
    from ascend_eplb.tools.costs import format_bytes

    lines = [
        f"upstream DefaultEplbPolicy: {result.num_moe_layers} layers x {result.num_logical_experts} "
        f"logical experts, ranks={result.num_ranks} nodes={result.num_nodes} "
        f"expert groups={result.num_expert_groups} (policy upstream runs: {result.policy})",
        "balancedness = mean rank load / max rank load per layer, averaged over layers (1.0 = even)",
    ]
    if result.layers_excluded:
        lines.append(f"excluded (no load): layers {result.layers_excluded}")
    costs = result.costs or {}
    cost_head = f" {'memory/rank':>12} {'busiest rx':>11} {'time':>8}" if costs else ""
    lines.append(
        f"{'redundant':>9} {'physical':>8} {'policy':>12} {'balancedness':>21} {'hottest rank share':>21} "
        f"{'experts moved':>13}{cost_head}"
    )
    lines.append(f"{'':>9} {'':>8} {'':>12} {'before':>10} {'after':>10} {'before':>10} {'after':>10}")
    rows = [(lv.num_redundant_experts, 0, lv) for lv in result.levels]
    rows += [(d["num_redundant_experts"], 1, d) for d in result.invalid_levels]
    for r, kind, item in sorted(rows, key=lambda x: (x[0], x[1])):
        if kind == 1:
            lines.append(f"{r:>9}  invalid: {item['error']}")
            continue
        lv = item
        extra = ""
        c = costs.get(str(r), {}).get(lv.policy)
        if c:
            t = "n/a" if c["transfer_seconds"] is None else f"{c['transfer_seconds']:.1f} s"
            extra = (
                f" {format_bytes(c['redundant_nbytes_per_rank']):>12} "
                f"{format_bytes(c['busiest_rank_nbytes_received']):>11} {t:>8}"
            )
        lines.append(
            f"{lv.num_redundant_experts:>9} {lv.num_physical_experts:>8} {lv.policy:>12} "
            f"{lv.balancedness_before:>10.4f} {lv.balancedness_after:>10.4f} "
            f"{lv.hottest_rank_share_before:>10.4f} {lv.hottest_rank_share_after:>10.4f} "
            f"{lv.experts_moved:>13}{extra}"
        )
    if result.recommended is not None:
        lv = result.level(result.recommended)
        best = max(x.balancedness_after for x in result.levels if x.policy == result.policy)
        c = costs.get(str(lv.num_redundant_experts), {}).get(lv.policy)
        mem = (
            f", {format_bytes(c['redundant_nbytes_per_rank'])} of device memory per rank for its "
            f"{c['redundant_slots_per_rank_per_layer']} extra slot(s) per layer"
            if c
            else f", {lv.num_redundant_experts // result.num_ranks} extra expert slot(s) per rank per MoE "
            "layer (pass --model-config for bytes)"
        )
        lines.append(
            f"recommended: num_redundant_experts={lv.num_redundant_experts} ({result.policy} policy): the "
            f"smallest level within {result.margin} of the best balancedness after ({best:.4f}), reaching "
            f"{lv.balancedness_after:.4f}{mem}"
        )
    if costs:
        c0 = next(iter(next(iter(costs.values())).values()))
        lines.append(
            f"costs: one expert {format_bytes(c0['expert_nbytes'])} in {c0['quant_format']}; memory/rank = "
            "redundant slots beyond EPLB-off over the model's MoE layers; busiest rx = what the rank "
            f"receiving most gets moving from the initial placement; time at {c0['link_gbps']:g} Gbit/s"
        )
    return "\n".join(lines)

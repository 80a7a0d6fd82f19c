"""``ascend-eplb plan``'s level sweep: upstream vLLM's default EPLB policy on recorded load, per level.

Per redundancy level (:func:`sweep_levels`: every ``R`` in ``[0, E]`` with ``E + R`` divisible by the
ranks) and policy, one call of upstream's ``DefaultEplbPolicy.rebalance_experts`` (vLLM 0.33.0,
:func:`upstream_policy`) from upstream's initial placement, passed as ``old_global_expert_indices`` as
``EplbState.rearrange`` does; with ``nodes > 1`` the global policy beside the hierarchical one.
:func:`recommend` picks the smallest level within ``margin`` of the best balancedness after;
:func:`export_placement` writes a placement file (:mod:`ascend_eplb.integration.placement_file`).
Measures are :mod:`ascend_eplb.control.measures`' on one float64 tensor; grouping comes from an events
file's ``window`` records (:func:`planned_grouping`). The policies compared window by window are
:mod:`ascend_eplb.tools.plan_compare`'s, the batch split :mod:`ascend_eplb.tools.plan_batch_split`'s,
the printed text :mod:`ascend_eplb.tools.plan_text`'s. The operator's view, with figures:
``SIMULATE.md``, section "plan".
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ascend_eplb.control import measures
from ascend_eplb.integration.events.reader import RecordedLoad
from ascend_eplb.integration.model_facts import MAX_REDUNDANT_EXPERTS, experts_divisibility_error
from ascend_eplb.integration.placement_file import placement_from_map

__all__ = [
    "DEFAULT_MARGIN",
    "PlanLevel",
    "PlanResult",
    "export_placement",
    "level_error",
    "plan",
    "planned_grouping",
    "recommend",
    "recorded_configuration",
    "recorded_grouping",
    "sweep_levels",
    "upstream_policy",
    "validate_plan_args",
]

#: Recommendation margin: a level within 0.01 balancedness of the best counts as the best (the noise
#: between windows of one workload is larger: the ESFT tasks' 0.9935-0.9976 at level 0, SIMULATE.md).
DEFAULT_MARGIN = 0.01


@dataclass(frozen=True)
class PlanLevel:
    """Result of one redundancy level under one policy, each measure :mod:`ascend_eplb.control.measures`'
    (balancedness: mean over layers; ``experts_moved``: experts ranks receive, summed over ranks, layers).

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


def level_error(num_logical_experts: int, num_redundant_experts: int, num_ranks: int) -> str | None:
    """Why one redundancy level cannot be planned, or None."""

    if num_redundant_experts < 0:
        return f"redundant experts={num_redundant_experts}: must be >= 0"
    if num_redundant_experts > MAX_REDUNDANT_EXPERTS:
        return (
            f"redundant experts={num_redundant_experts}: must be <= {MAX_REDUNDANT_EXPERTS} (upstream's "
            f"EplbState.add_model asserts num_redundant_experts <= {MAX_REDUNDANT_EXPERTS})"
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
    policy = upstream_policy()

    load = torch.as_tensor(np.asarray(load_le) if not isinstance(load_le, torch.Tensor) else load_le)
    load = load.to(torch.float64)
    validate_plan_args(tuple(load.shape), num_ranks, num_nodes, num_expert_groups, redundancy)
    if not bool(torch.isfinite(load).all()) or bool((load < 0).any()):
        raise ValueError("load: must be finite and >= 0")
    loaded = load.sum(dim=1) > 0
    excluded = [int(i) for i in torch.nonzero(~loaded).flatten()]
    if not bool(loaded.any()):
        raise ValueError(f"load: all {load.shape[0]} layers have zero load; nothing to plan")
    load = load[loaded]
    num_moe_layers, num_experts = (int(d) for d in load.shape)
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
        old = measures.upstream_initial_placement(num_experts, r, num_moe_layers)
        before = measures.rank_loads(load, old, num_ranks)
        for name, groups, nodes in policies:
            new = policy.rebalance_experts(load, num_experts + r, groups, nodes, num_ranks, old)
            after = measures.rank_loads(load, new, num_ranks)
            received = measures.received_experts(old, new, num_ranks)
            levels.append(
                PlanLevel(
                    num_redundant_experts=int(r),
                    num_physical_experts=num_experts + int(r),
                    balancedness_before=measures.mean_balancedness(before),
                    balancedness_after=measures.mean_balancedness(after),
                    hottest_rank_share_before=measures.hottest_rank_share(before),
                    hottest_rank_share_after=measures.hottest_rank_share(after),
                    experts_moved=int(received.sum()),
                    physical_to_logical_map=new.tolist(),
                    policy=name,
                    busiest_rank_experts_received=int(received.sum(dim=0).max()),
                )
            )
    chosen = recommend([lv for lv in levels if lv.policy == configured], margin)
    return PlanResult(
        num_ranks, num_nodes, num_expert_groups, int(loaded.numel()), num_experts, excluded, levels,
        invalid_levels=invalid, policy=configured, margin=margin,
        recommended=None if chosen is None else chosen.num_redundant_experts,
    )  # fmt: skip


def export_placement(result: PlanResult, level: PlanLevel, *, source: str = "") -> Any:
    """One level's placement for every MoE layer of the load, as a
    :class:`~ascend_eplb.integration.placement_file.Placement` (``write_placement`` writes it).

    ``layer_id`` counts the MoE layers of the load (dense layers have none); a layer without load (in
    ``result.layers_excluded``) keeps upstream's initial placement
    (``measures.upstream_initial_placement``), the others hold the level's policy placement.

    Raises:
        PlacementFileError: the placement breaks a rule of the format (not for a policy's result).
    """

    e, r = result.num_logical_experts, level.num_redundant_experts
    rows = measures.upstream_initial_placement(e, r, result.num_moe_layers).tolist()
    loaded = [i for i in range(result.num_moe_layers) if i not in set(result.layers_excluded)]
    for layer, row in zip(loaded, level.physical_to_logical_map, strict=True):
        rows[layer] = list(row)
    return placement_from_map(rows, num_logical_experts=e, num_ranks=result.num_ranks, source=source)


def recorded_configuration(recorded: RecordedLoad | None) -> tuple[int, int] | None:
    """``(num_physical_experts, num_ranks)`` a serving events file records (``recorded``: its windows read
    by :func:`ascend_eplb.tools.trace.load_recorded`; the last window stating both), or None: no events
    file, or one recorded before the configuration was (an earlier ascend-eplb-integration)."""
    if recorded is None or recorded.num_physical_experts is None or recorded.num_ranks is None:
        return None
    return recorded.num_physical_experts, recorded.num_ranks


def recorded_grouping(recorded: RecordedLoad | None) -> tuple[int | None, int | None]:
    """``(num_expert_groups, num_nodes)`` a serving events file records: what upstream passed its policy
    (the last window stating each). Each is None when not recorded: no events file, or one recorded before
    these fields (an earlier ascend-eplb-integration)."""
    if recorded is None:
        return None, None
    return recorded.num_expert_groups, recorded.num_nodes


def planned_grouping(
    recorded: RecordedLoad | None,
    *,
    num_ranks: int,
    num_expert_groups: int | None = None,
    num_nodes: int | None = None,
) -> tuple[int, int]:
    """``(num_expert_groups, num_nodes)`` to plan with: the given ones (None: not given), else what a
    serving events file records (:func:`recorded_grouping` of ``recorded``), else 1.

    The expert groups are the model's (upstream's ``num_expert_groups``, DeepSeek's ``n_group``): a given
    value must equal the recorded one. The nodes are the deployment's: a given value other than the
    recorded one is planned with, and a ``UserWarning`` names both.

    Raises:
        ValueError: ``num_expert_groups`` differs from the recorded value (both named), or the recorded
            nodes do not divide ``num_ranks`` and no ``num_nodes`` is given.
    """
    recorded_groups, recorded_nodes = recorded_grouping(recorded)
    path = None if recorded is None else recorded.source
    if num_expert_groups is not None and recorded_groups is not None and num_expert_groups != recorded_groups:
        raise ValueError(
            f"expert groups={num_expert_groups}: {path} records num_expert_groups={recorded_groups} (the "
            f"model's, which upstream passed its policy); give --expert-groups {recorded_groups} or leave it "
            "out"
        )
    if num_expert_groups is None:
        num_expert_groups = 1 if recorded_groups is None else recorded_groups
    if num_nodes is None:
        if recorded_nodes is not None and recorded_nodes >= 1 and num_ranks % recorded_nodes:
            raise ValueError(
                f"ranks={num_ranks}: {path} records num_nodes={recorded_nodes}, which does not divide them; "
                "give --nodes"
            )
        return num_expert_groups, 1 if recorded_nodes is None else recorded_nodes
    if recorded_nodes is not None and num_nodes != recorded_nodes:
        warnings.warn(
            f"{path} records {recorded_nodes} node(s); planned for --nodes {num_nodes}", stacklevel=2
        )
    return num_expert_groups, num_nodes

"""``ascend-eplb plan``: offline what-if of upstream vLLM's default EPLB policy on recorded load.

Per redundancy level (:func:`sweep_levels`: every ``R`` in ``[0, E]`` with ``E + R`` divisible by the
ranks) and policy, one call of upstream's ``DefaultEplbPolicy.rebalance_experts`` (vLLM 0.33.0,
:func:`upstream_policy`) from upstream's initial placement, passed as ``old_global_expert_indices`` as
``EplbState.rearrange`` does; with ``nodes > 1`` the global policy beside the hierarchical one.
:func:`recommend` picks the smallest level within ``margin`` of the best balancedness after;
:func:`export_placement` writes a placement file (:mod:`ascend_eplb.integration.placement_file`).
:func:`compare_policies` runs serving's gate (:func:`ascend_eplb.control.gate.decide`) window by window
and imports vLLM. Measures are :mod:`ascend_eplb.control.measures`' on one float64 tensor; grouping
comes from an events file's ``window`` records (:func:`planned_grouping`). The operator's view, with
figures: ``SIMULATE.md``, section "plan".
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import sys
import tempfile
import types
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ascend_eplb.control import measures
from ascend_eplb.control.estimate import LoadEstimate
from ascend_eplb.control.policy_config import SKIP_REASONS, PolicySettings
from ascend_eplb.control.values import is_int
from ascend_eplb.integration import metrics
from ascend_eplb.integration.events import RecordedLoad
from ascend_eplb.integration.model_facts import MAX_REDUNDANT_EXPERTS, experts_divisibility_error
from ascend_eplb.integration.placement_file import placement_from_map
from ascend_eplb.tools import trace
from ascend_eplb.tools.costs import format_bytes

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_WINDOW_SEQUENCES",
    "BatchSplitReport",
    "BatchSplitRow",
    "Candidates",
    "Choice",
    "Deployment",
    "ExpertBytes",
    "GateRecommendation",
    "PlanLevel",
    "PlanResult",
    "PolicyComparison",
    "PolicyRun",
    "WindowOutcome",
    "Windows",
    "batch_split_figures",
    "choose",
    "compare_policies",
    "export_placement",
    "format_batch_split",
    "format_comparison",
    "format_plan",
    "level_error",
    "load_windows",
    "plan",
    "planned_grouping",
    "recommend",
    "recommend_gate",
    "recorded_configuration",
    "recorded_grouping",
    "sweep_levels",
    "trace_windows",
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


def format_plan(result: PlanResult) -> str:
    """Human-readable table of a :class:`PlanResult`: one row per level and policy, invalid levels with
    their reason, the recommendation and, with costs, each level's memory and rearrangement cost."""

    lines = [
        f"upstream DefaultEplbPolicy: {result.num_moe_layers} layers x {result.num_logical_experts} "
        f"logical experts, ranks={result.num_ranks} nodes={result.num_nodes} "
        f"expert groups={result.num_expert_groups} (policy upstream runs: {result.policy})",
        "balancedness = mean rank load / max rank load per layer, averaged over layers (1.0 = even); before: "
        "upstream's initial placement, after: the policy's",
        "experts moved = experts a rank receives that it did not hold, summed over ranks and layers (a slot "
        "refilled with an expert its rank already holds is a copy on the rank: not moved)",
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
    worse = sorted({lv.num_redundant_experts for lv in result.levels
                    if round(lv.balancedness_after, 4) < round(lv.balancedness_before, 4)})  # fmt: skip
    if worse:
        lines.append(
            f"after < before at num_redundant_experts={','.join(map(str, worse))}: upstream's policy plans "
            "from the load alone (replicas to the hottest experts, then packing), not from the placement in "
            "force, so it can balance a load less than upstream's initial placement did (which, with "
            "num_redundant_experts = E on 2 ranks, gives each rank one replica of every expert: an even "
            "split of any load); a server at that level would rearrange into the worse placement"
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


# ----------------------------------------------------------------------------------------------------
# Policies compared on a sequence of windows

#: Sequences per window when the load is a routing trace: the ESFT windows of SIMULATE.md (and the policy
#: benchmark's, ``packages/eplb-control/benchmarks/bench_policy.py``).
DEFAULT_WINDOW_SEQUENCES = 4
#: Decimals of the recommended gate values.
GATE_DECIMALS = 3


@dataclass(frozen=True)
class WindowOutcome:
    """What one run did at one closed window (one rearrangement), figures on the ``(L, E)`` loads.

    ``balancedness_before``: the window under the placement in force when it closed;
    ``balancedness_after``: the window under the placement in force after the rearrangement (the kept one
    when skipped); ``balancedness_planned``: the window under the policy's placement (None when the
    policy did not run: ``"balanced"``, ``"no_load"``); ``estimate_balancedness_before`` and
    ``estimate_balancedness_planned``: the load estimate the policy planned on under the committed and
    the policy's placement (what the gate judged; None on the window, or where the policy did not run);
    ``balancedness_realised``: the next window under the placement in force after this one (what it
    served until the next rearrangement; None for the last window); ``experts_moved``:
    :func:`ascend_eplb.control.measures.moved_experts` summed over layers (0 when skipped);
    ``bytes_moved``: ``experts_moved`` x one expert's bytes, estimated (None without a model size);
    ``skipped``: None or the gate's reason (:data:`ascend_eplb.control.policy_config.SKIP_REASONS`).
    """

    window: int  # 1-based, as the events file's ``rearrangement``
    skipped: str | None
    balancedness_before: float
    balancedness_after: float
    balancedness_planned: float | None
    estimate_balancedness_before: float | None
    estimate_balancedness_planned: float | None
    balancedness_realised: float | None
    experts_moved: int
    bytes_moved: int | None


@dataclass(frozen=True)
class PolicyRun:
    """One policy on one load estimate (and a gate) through every window, each decision
    :func:`ascend_eplb.control.gate.decide`'s.

    ``load_estimate``: what the policy planned on (``additional_config.eplb_config.load_estimate``).
    ``gate``: ``"off"``, ``"given"`` (the command's ``--min-balancedness-gain`` /
    ``--target-balancedness``) or ``"recommended"`` (:func:`recommend_gate` on the same policy and
    estimate's run with the gate off). Totals: ``rearranged`` (windows that moved to the policy's
    placement), ``skipped`` (by reason, every reason listed), ``experts_moved`` and ``bytes_moved``
    (sums), ``mean_balancedness_after`` and ``mean_balancedness_realised`` (means over the windows that
    have the figure).
    """

    label: str
    policy: str
    load_estimate: str
    gate: str
    min_balancedness_gain: float
    target_balancedness: float | None
    windows: list[WindowOutcome]
    rearranged: int
    skipped: dict[str, int]
    experts_moved: int
    bytes_moved: int | None
    mean_balancedness_after: float
    mean_balancedness_realised: float | None

    def ascend_keys(self) -> dict[str, Any]:
        """The ``additional_config.eplb_config`` keys that serve this run, each only where it differs
        from its default (upstream's policy, on the window, gate off)."""
        keys: dict[str, Any] = {}
        if self.policy != "default":
            keys["policy"] = self.policy
        if self.load_estimate != "window":
            keys["load_estimate"] = self.load_estimate
        if self.min_balancedness_gain > 0:
            keys["min_balancedness_gain"] = self.min_balancedness_gain
        if self.target_balancedness is not None:
            keys["target_balancedness"] = self.target_balancedness
        return keys


@dataclass(frozen=True)
class GateRecommendation:
    """Gate values for one policy on one load estimate (:func:`recommend_gate` gives the rule)."""

    policy: str
    load_estimate: str
    min_balancedness_gain: float
    target_balancedness: float
    mean_in_force: float  # the figure target_balancedness is rounded from
    mean_drift: float  # the figure min_balancedness_gain is rounded from


@dataclass(frozen=True)
class Choice:
    """The run to serve with (:func:`choose`): its label, its ``additional_config.eplb_config`` keys
    (``ascend_keys``: the differences from the defaults), its mean realised balancedness and experts
    moved, and the margin of the rule."""

    label: str
    ascend_keys: dict[str, Any]
    mean_balancedness_realised: float
    experts_moved: int
    margin: float


@dataclass(frozen=True)
class PolicyComparison:
    """The runs of :func:`compare_policies` side by side on one sequence of windows."""

    source: str
    window: str  # what one window is ("4 sequences", "an events-file window", "the whole load")
    evidence: str  # what the load estimate took in per window
    num_windows: int
    num_ranks: int
    num_nodes: int
    num_expert_groups: int
    num_moe_layers: int
    num_logical_experts: int
    num_redundant_experts: int
    expert_nbytes: int | None
    bytes_note: str  # where expert_nbytes comes from, or why bytes are not given
    load_estimates: list[str]
    runs: list[PolicyRun]
    recommended_gates: list[GateRecommendation]
    recommendation_note: str | None = None  # why no gate is recommended
    choice: Choice | None = None  # None: one window, no placement was seen serving a next one

    def to_json(self) -> dict:
        return asdict(self)

    def run(self, policy: str, gate: str = "off", load_estimate: str = "window") -> PolicyRun:
        """The run of ``policy`` on ``load_estimate`` with ``gate`` (``"off"``, ``"given"``,
        ``"recommended"``)."""
        for r in self.runs:
            if r.policy == policy and r.gate == gate and r.load_estimate == load_estimate:
                return r
        raise KeyError(f"no run of the {policy} policy on the {load_estimate} load with the gate {gate}")


@dataclass(frozen=True)
class Windows:
    """Closed load windows, oldest first (:func:`load_windows` reads them from a file).

    Attributes:
        loads: ``[L, E]`` each, >= 0 (int64 counts or float64).
        source: where they come from (a file), for messages and the report.
        window: what one window is (``"4 sequences (of 40)"``, ``"an events-file window ..."``).
        new_selections: ``[L, E]`` per window, the selections recorded since the previous window that
            serving's load estimate took in (an events file recorded with the estimate on); None: each
            window's own load is its new evidence (a trace's windows do not overlap).
        evidence: what the load estimate takes in per window, in words.
    """

    loads: tuple[np.ndarray, ...]
    source: str = ""
    window: str = ""
    new_selections: tuple[np.ndarray, ...] | None = None
    evidence: str = "each window's load"


@dataclass(frozen=True)
class Deployment:
    """What upstream's ``EplbState.rearrange`` passes its policy beside the load: EP ranks N, the
    redundancy level (P = E + ``num_redundant_experts``), nodes and the model's expert groups."""

    num_ranks: int
    num_redundant_experts: int
    num_nodes: int = 1
    num_expert_groups: int = 1


@dataclass(frozen=True)
class Candidates:
    """What :func:`compare_policies` runs: each policy (``additional_config.eplb_config.policy``) on each
    load estimate (``load_estimate``) with the gate off, and with the given gate
    (``min_balancedness_gain`` > 0 or ``target_balancedness`` set)."""

    policies: tuple[str, ...] = ("default", "migration_aware")
    min_balancedness_gain: float = 0.0
    target_balancedness: float | None = None
    load_estimates: tuple[str, ...] = ("window", "pooled")


@dataclass(frozen=True)
class ExpertBytes:
    """One expert's bytes (:func:`ascend_eplb.quant_views.get_format`'s ``expert_nbytes`` at the model's
    size; None: not computed) and where they come from, or why not (``note``)."""

    nbytes: int | None = None
    note: str = ""


def trace_windows(routing: Any, window_sequences: int) -> list[np.ndarray]:
    """int64 ``[L, E]`` per window of ``window_sequences`` consecutive sequences of a routing trace
    (:class:`~ascend_eplb.tools.trace.RoutingTrace`; the last window may hold fewer): each layer's
    top-k selections per logical expert over the window's tokens."""

    if not is_int(window_sequences) or window_sequences < 1:
        raise ValueError(f"window sequences={window_sequences!r}: must be an integer >= 1")
    offsets = np.asarray(routing.seq_offsets)
    bounds = [*offsets[:-1:window_sequences].tolist(), int(offsets[-1])]
    e = routing.num_logical_experts
    out = []
    for start, end in itertools.pairwise(bounds):
        ids = routing.topk_ids[:, start:end].reshape(routing.num_moe_layers, -1)
        out.append(np.stack([np.bincount(row, minlength=e) for row in ids]).astype(np.int64))
    return out


def load_windows(
    path: str | Path,
    *,
    window_sequences: int | None = None,
    last: int | None = None,
    recorded: RecordedLoad | None = None,
) -> Windows:
    """The closed windows of a load file, oldest first (each ``[L, E]``, int64 when the file holds
    counts, else float64):

    - a serving events file (``.jsonl``): the ``window`` records of one model in its last run (the
      ``last`` ones; ``recorded``: the file as :func:`~ascend_eplb.tools.trace.load_recorded` read it);
    - a routing trace (a compact ``.npz`` or ESFT's ``expert_weights_<layer>.txt`` folder, ESFT's 64
      experts, top-6): windows of ``window_sequences`` sequences (:func:`trace_windows`; None:
      :data:`DEFAULT_WINDOW_SEQUENCES`);
    - any other load matrix (:func:`~ascend_eplb.tools.trace.load_load_matrix`): one window.

    :attr:`Windows.new_selections` (the load estimate's evidence: selections since the previous
    rearrangement) is an events file's recorded ``new_selections`` when every window holds them, else
    each window's load; :attr:`Windows.evidence` says which.

    Raises:
        ValueError: the file cannot be read as such, or ``window_sequences`` given for a file other than
            a trace or ``last`` for a file other than an events file (naming it and the rule).
    """

    path = Path(path)
    suffix = path.suffix.lower()
    is_trace = suffix == ".npz" or path.is_dir()
    if window_sequences is not None and not is_trace:
        raise ValueError(
            f"window sequences={window_sequences}: is only for a routing trace (.npz or a folder of ESFT "
            "expert_weights_<layer>.txt); an events file's windows are its own"
        )
    if suffix == ".jsonl":
        recorded = trace.load_recorded(path) if recorded is None else recorded
        trace.load_load_matrix(path, last=last, recorded=recorded)  # its checks of the values
        chosen = slice(-last, None) if last is not None else slice(None)
        windows = tuple(w.numpy() for w in recorded.windows[chosen])
        what = "an events-file window (one rearrangement of the server that recorded it)"
        if recorded.new_selections is not None:
            return Windows(
                windows,
                str(path),
                what,
                tuple(w.numpy() for w in recorded.new_selections[chosen]),
                "the selections each window record holds since the previous one, as serving's estimate "
                "took them in",
            )
        return Windows(
            windows,
            str(path),
            what,
            evidence="each window's load (the file records no selections since each rearrangement: it "
            "was served with load_estimate=window; where upstream's windows overlapped, window_size > "
            "step_interval, their tokens count more than once)",
        )
    if last is not None:
        raise ValueError(f"last={last}: is only for an events file (.jsonl)")
    if is_trace:
        window_sequences = DEFAULT_WINDOW_SEQUENCES if window_sequences is None else window_sequences
        if suffix == ".npz":
            routing = trace.load_trace(path)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                routing = trace.load_trace(trace.convert(path, Path(scratch) / "trace.npz"))
        sequences = int(len(routing.seq_offsets) - 1)
        return Windows(
            tuple(trace_windows(routing, window_sequences)),
            str(path),
            f"{window_sequences} sequences (of {sequences})",
            evidence="each window's tokens (a trace's windows do not overlap)",
        )
    load = trace.load_load_matrix(path)
    if np.array_equal(load, np.round(load)) and load.max() < 2**53:
        load = load.astype(np.int64)
    return Windows((load,), str(path), "the whole load (one window)")


def _run_policy(
    windows: Windows,
    deployment: Deployment,
    settings: Any,
    expert_bytes: ExpertBytes,
    *,
    label: str,
    gate: str,
) -> PolicyRun:
    """``settings`` through ``windows`` as serving runs them: with a load estimate, a
    :class:`~ascend_eplb.control.estimate.LoadEstimate` takes in each window's new selections before
    its decision (``AscendEplbState.rearrange``), and :func:`ascend_eplb.control.gate.decide` plans and
    judges on its load (the gated policy's call)."""
    from ascend_eplb.control.gate import decide  # imports vLLM: only plan --policies needs it

    d = deployment
    loads = [torch.from_numpy(np.asarray(w)) for w in windows.loads]
    evidence = (
        loads if windows.new_selections is None else [torch.from_numpy(w) for w in windows.new_selections]
    )
    num_moe_layers, num_experts = loads[0].shape
    placement = measures.upstream_initial_placement(num_experts, d.num_redundant_experts, num_moe_layers)
    expert_nbytes = expert_bytes.nbytes
    estimate = LoadEstimate() if settings.estimating else None

    def mean_balancedness(load: torch.Tensor, p: torch.Tensor) -> float:
        return measures.mean_balancedness(measures.rank_loads(load, p, d.num_ranks))

    outcomes = []
    for i, load in enumerate(loads):
        before = mean_balancedness(load, placement)
        if estimate is not None:
            estimate.update(evidence[i])
        new, decision = decide(
            settings, load, num_experts + d.num_redundant_experts, d.num_expert_groups, d.num_nodes,
            d.num_ranks, placement, estimate=None if estimate is None else estimate.load,
        )  # fmt: skip
        moved = int(decision.experts_moved or 0)
        realised = mean_balancedness(loads[i + 1], new) if i + 1 < len(loads) else None
        on_estimate = estimate is not None
        outcomes.append(
            WindowOutcome(
                window=i + 1,
                skipped=decision.skipped,
                balancedness_before=before,
                balancedness_after=mean_balancedness(load, new),
                balancedness_planned=decision.window_balancedness_planned,
                estimate_balancedness_before=decision.balancedness_before if on_estimate else None,
                estimate_balancedness_planned=decision.balancedness_planned if on_estimate else None,
                balancedness_realised=realised,
                experts_moved=moved,
                bytes_moved=None if expert_nbytes is None else metrics.bytes_moved(moved, expert_nbytes),
            )
        )
        placement = new
    realised = [o.balancedness_realised for o in outcomes if o.balancedness_realised is not None]
    return PolicyRun(
        label=label,
        policy=settings.policy,
        load_estimate=settings.load_estimate,
        gate=gate,
        min_balancedness_gain=float(settings.min_balancedness_gain),
        target_balancedness=settings.target_balancedness,
        windows=outcomes,
        rearranged=sum(o.skipped is None for o in outcomes),
        skipped={reason: sum(o.skipped == reason for o in outcomes) for reason in SKIP_REASONS},
        experts_moved=sum(o.experts_moved for o in outcomes),
        bytes_moved=None if expert_nbytes is None else sum(o.bytes_moved or 0 for o in outcomes),
        mean_balancedness_after=float(np.mean([o.balancedness_after for o in outcomes])),
        mean_balancedness_realised=float(np.mean(realised)) if realised else None,
    )


def recommend_gate(run: PolicyRun) -> GateRecommendation | None:
    """Gate values for ``run``'s policy and load estimate from its run with the gate off (None: fewer
    than 2 windows, so no placement was seen serving a next one).

    The rule, in the gate's own measure (the balancedness of the load it judges: the window, or the load
    estimate), both figures over the windows that have a next one, rounded to :data:`GATE_DECIMALS`:

    - ``target_balancedness`` = the mean balancedness of the placement in force at each next window
      (on the window: what the run's placements realise on the next window): what rearranging at every
      window keeps on average. A window whose placement in force is at least this balanced has, on
      average, nothing to gain (skip ``"balanced"``).
    - ``min_balancedness_gain`` = the mean drop of a fresh placement from its planned figure to the next
      window's judgement of it (``planned - before`` of the next window for each rearranged window, the
      mean clipped at 0): how much of a placement's fit the load's drift takes away before it serves.
      A planned gain below it does not survive into the window the placement serves (skip
      ``"min_gain"``).

    The values are clipped into the keys' ranges (``[0, 0.999]``, ``[0.001, 1]``).
    """
    windows = run.windows
    if len(windows) < 2:
        return None
    if run.load_estimate == "window":
        # The next window under the placement in force after this one; bit for bit the decision's
        # figures (after = planned where the policy's placement was taken).
        judged = [(o.balancedness_realised, o.balancedness_after) for o in windows[:-1]]
    else:
        judged = [
            (nxt.estimate_balancedness_before, o.estimate_balancedness_planned)
            for o, nxt in itertools.pairwise(windows)
        ]
    kept = [before for before, _ in judged if before is not None]  # None: the next window had no load
    in_force = float(np.mean(kept)) if kept else 1.0
    drops = [
        planned - before
        for o, (before, planned) in zip(windows, judged, strict=False)
        if o.skipped is None and before is not None and planned is not None
    ]
    drift = max(0.0, float(np.mean(drops))) if drops else 0.0
    step = 10.0**-GATE_DECIMALS
    return GateRecommendation(
        policy=run.policy,
        load_estimate=run.load_estimate,
        min_balancedness_gain=min(round(drift, GATE_DECIMALS), 1 - step),
        target_balancedness=min(max(round(in_force, GATE_DECIMALS), step), 1.0),
        mean_in_force=in_force,
        mean_drift=drift,
    )


def choose(runs: Sequence[PolicyRun], margin: float) -> Choice | None:
    """The run to serve with: the highest mean realised balancedness (the next window under each
    placement: what serving sees); among the runs within ``margin`` of it, the one that moves the fewest
    experts (the first in ``runs`` on a tie). None: no run has a realised figure (one window)."""
    judged = [r for r in runs if r.mean_balancedness_realised is not None]
    if not judged:
        return None
    best = max(r.mean_balancedness_realised for r in judged)  # type: ignore[type-var]
    near = [r for r in judged if r.mean_balancedness_realised >= best - margin]  # type: ignore[operator]
    chosen = min(near, key=lambda r: r.experts_moved)
    assert chosen.mean_balancedness_realised is not None
    return Choice(chosen.label, chosen.ascend_keys(), chosen.mean_balancedness_realised, chosen.experts_moved,
                  margin)  # fmt: skip


def _label(policy: str, load_estimate: str, estimates: Sequence[str]) -> str:
    """A run's name: its policy, and its load estimate where more than one is compared."""
    return policy if len(estimates) == 1 else f"{policy} ({load_estimate})"


def compare_policies(
    windows: Windows,
    deployment: Deployment,
    candidates: Candidates = Candidates(),
    expert_bytes: ExpertBytes = ExpertBytes(),
) -> PolicyComparison:
    """Each policy of ``candidates`` on each of its load estimates through ``windows`` from upstream's
    initial placement (``measures.upstream_initial_placement``), each window decided by serving's own
    gate function (:func:`ascend_eplb.control.gate.decide`: upstream's ``DefaultEplbPolicy`` for
    ``"default"``, :class:`ascend_eplb.control.policy.MigrationAwarePolicy` for ``"migration_aware"``,
    the all-zero window skipped as ``"no_load"``; with the load estimate, serving's
    :class:`~ascend_eplb.control.estimate.LoadEstimate` fed each window's new selections) and given the
    placement the previous decision left in force.

    Runs, in order: every policy and estimate with the gate off; with the given gate (if any); with the
    gate :func:`recommend_gate` gives for it (unless no window has a next one). The choice
    (:func:`choose`) takes the margin of the migration-aware policy's own tolerance
    (``MigrationAwarePolicy.balancedness_tolerance``: the balance it counts as upstream's).

    Raises:
        ValueError: naming the value and the rule: no window, windows of different shapes, a policy,
            load estimate or gate value breaking start-up's rules (``ascend_eplb.control.policy_config``),
            an invalid redundancy level or ranks, nodes and expert groups (:func:`validate_plan_args`).
    """
    from ascend_eplb.control.policy import MigrationAwarePolicy  # imports vLLM: only plan --policies

    d, c = deployment, candidates
    if not windows.loads:
        raise ValueError(f"{windows.source or 'load'}: no window to rearrange on")
    arrays = [np.asarray(w) for w in windows.loads]
    shape = arrays[0].shape
    for i, w in enumerate(arrays):
        if w.shape != shape:
            raise ValueError(f"window {i + 1} has shape {w.shape}: every window must be {shape} [L, E]")
        if w.size and (not np.isfinite(w).all() or w.min() < 0):
            raise ValueError(f"window {i + 1}: load must be finite and >= 0")
    if windows.new_selections is not None and len(windows.new_selections) != len(arrays):
        raise ValueError(
            f"new selections: {len(windows.new_selections)} given for {len(arrays)} windows: one per window"
        )
    validate_plan_args(shape, d.num_ranks, d.num_nodes, d.num_expert_groups, [d.num_redundant_experts])
    if not c.policies:
        raise ValueError("policies: give at least one of default, migration_aware")
    if not c.load_estimates:
        raise ValueError("load estimates: give at least one of window, pooled")
    for estimate in c.load_estimates:
        PolicySettings(load_estimate=estimate)  # start-up's rule, naming the value
    gate_given = PolicySettings(c.policies[0], c.min_balancedness_gain, c.target_balancedness).gate_on
    estimates = list(dict.fromkeys(c.load_estimates))
    combos = [(p, e) for e in estimates for p in dict.fromkeys(c.policies)]

    def run(policy: str, estimate: str, gain: float, target: float | None, gate: str) -> PolicyRun:
        settings = PolicySettings(policy, gain, target, estimate)
        suffix = {"off": "", "given": " + gate", "recommended": " + recommended gate"}[gate]
        label = _label(policy, estimate, estimates) + suffix
        return _run_policy(windows, d, settings, expert_bytes, label=label, gate=gate)

    runs = [run(p, e, 0.0, None, "off") for p, e in combos]
    if gate_given:
        runs += [run(p, e, c.min_balancedness_gain, c.target_balancedness, "given") for p, e in combos]
    recommended = []
    for p, e in combos:
        rec = recommend_gate(next(r for r in runs if (r.policy, r.load_estimate, r.gate) == (p, e, "off")))
        if rec is None:
            continue
        recommended.append(rec)
        if PolicySettings(p, rec.min_balancedness_gain, rec.target_balancedness).gate_on:
            runs.append(run(p, e, rec.min_balancedness_gain, rec.target_balancedness, "recommended"))
    return PolicyComparison(
        source=windows.source, window=windows.window, evidence=windows.evidence, num_windows=len(arrays),
        num_ranks=d.num_ranks, num_nodes=d.num_nodes, num_expert_groups=d.num_expert_groups,
        num_moe_layers=int(shape[0]), num_logical_experts=int(shape[1]),
        num_redundant_experts=d.num_redundant_experts, expert_nbytes=expert_bytes.nbytes,
        bytes_note=expert_bytes.note, load_estimates=estimates, runs=runs, recommended_gates=recommended,
        recommendation_note=None if recommended else "one window: no placement was seen serving a next one",
        choice=choose(runs, MigrationAwarePolicy.balancedness_tolerance),
    )  # fmt: skip


def _gate_text(min_gain: float, target: float | None) -> str:
    target_text = "off" if target is None else f"{target:g}"
    return f"min_balancedness_gain={min_gain:g} target_balancedness={target_text}"


def format_comparison(result: PolicyComparison) -> str:
    """Human-readable :class:`PolicyComparison`: per load estimate, per window the runs side by side (the
    gate-off runs and the gated ones: the given gate, else the recommended one), the totals of every run,
    the recommended gate values with their rule and their effect, and the run to choose."""

    with_bytes = result.expert_nbytes is not None
    several = len(result.load_estimates) > 1
    compared = f"policies and load estimates ({', '.join(result.load_estimates)})" if several else "policies"
    on = "" if result.load_estimates == ["window"] else f" on the load estimate {result.load_estimates[0]}"
    lines = [
        f"{compared} compared{'' if several else on} on {result.num_windows} window(s) of {result.source} "
        f"(a window: {result.window}): "
        f"{result.num_moe_layers} layers x {result.num_logical_experts} logical experts, ranks="
        f"{result.num_ranks} nodes={result.num_nodes} expert groups={result.num_expert_groups}, "
        f"num_redundant_experts={result.num_redundant_experts}; every run starts from upstream's initial "
        "placement, each window decided by serving's gate (ascend_eplb.control.gate.decide)",
    ]
    if result.load_estimates != ["window"]:
        lines.append(
            "load estimate: window = the closed window (upstream's); pooled = serving's "
            f"ascend_eplb.control.estimate.LoadEstimate, taking in {result.evidence}"
        )
    lines += [
        "balancedness = mean rank load / max rank load per layer, averaged over layers (1.0 = even); after: "
        "the window under the placement in force after its rearrangement; realised: the next window under "
        "it (what serving sees)",
        "moved = experts a rank receives that it did not hold, summed over ranks and layers; "
        + (f"bytes = moved x {result.bytes_note}" if with_bytes else f"bytes: {result.bytes_note}"),
    ]
    gated = "given" if any(r.gate == "given" for r in result.runs) else "recommended"
    for estimate in result.load_estimates:
        shown = [r for r in result.runs if r.gate in ("off", gated) and r.load_estimate == estimate]
        if several:
            lines.append(f"load estimate {estimate}:")
        lines += _window_table(result, shown, with_bytes)
    lines.append("totals:")
    label_w = max(len(r.label) for r in result.runs)
    lines.append(
        f"  {'run':<{label_w}} {'rearranged':>10} {'skipped (balanced/min_gain/no_load)':>36} "
        f"{'experts moved':>13} {'bytes moved':>11} {'mean after':>10} {'mean realised':>13}"
    )
    for r in result.runs:
        skipped = "/".join(str(r.skipped[k]) for k in ("balanced", "min_gain", "no_load"))
        realised = "n/a" if r.mean_balancedness_realised is None else f"{r.mean_balancedness_realised:.4f}"
        lines.append(
            f"  {r.label:<{label_w}} {r.rearranged:>10} {skipped:>36} {r.experts_moved:>13} "
            f"{format_bytes(r.bytes_moved):>11} {r.mean_balancedness_after:>10.4f} {realised:>13}"
        )
    for r in result.runs:
        if r.gate == "given":
            lines.append(f"  {r.label}: {_gate_text(r.min_balancedness_gain, r.target_balancedness)}")
    if not result.recommended_gates:
        lines.append(f"recommended gate: none ({result.recommendation_note})")
    for rec in result.recommended_gates:
        off = result.run(rec.policy, load_estimate=rec.load_estimate)
        lines.append(
            f"recommended gate for {_label(rec.policy, rec.load_estimate, result.load_estimates)}: "
            f"{_gate_text(rec.min_balancedness_gain, rec.target_balancedness)}"
        )
        if rec.load_estimate == "window":
            kept = "its gate-off placements realise on the next window"
            drop = "its window to the next"
        else:
            kept = "of the load estimate under its gate-off run's placement in force at each next window"
            drop = "the estimate it was planned on to the next window's estimate"
        lines.append(
            f"  rule: target_balancedness = the mean balancedness {kept} ({rec.mean_in_force:.4f}): a window "
            "the placement in force already serves that well has nothing to gain on average; "
            f"min_balancedness_gain = the mean drop of a fresh placement from {drop} ({rec.mean_drift:.4f}): "
            "a planned gain below it does not survive into the window it serves (both rounded to "
            f"{GATE_DECIMALS} decimals)"
        )
        gated_run = next(
            (
                r
                for r in result.runs
                if (r.policy, r.load_estimate, r.gate) == (rec.policy, rec.load_estimate, "recommended")
            ),
            None,
        )
        if gated_run is None:
            lines.append("  with it: the gate is off (both values 0 / unset)")
            continue
        skips = ", ".join(f"{k} {v}" for k, v in gated_run.skipped.items() if v) or "none"
        saved = ""
        if with_bytes:
            saved = (
                f", bytes {format_bytes(gated_run.bytes_moved)} (gate off: {format_bytes(off.bytes_moved)})"
            )
        realised = (
            ""
            if gated_run.mean_balancedness_realised is None
            else f"; mean realised {gated_run.mean_balancedness_realised:.4f} (gate off: "
            f"{off.mean_balancedness_realised:.4f})"
        )
        lines.append(
            f"  with it: {result.num_windows - gated_run.rearranged} of {result.num_windows} windows skipped "
            f"({skips}); experts moved {gated_run.experts_moved} (gate off: {off.experts_moved}){saved}"
            f"{realised}"
        )
    lines += _choice_lines(result)
    return "\n".join(lines)


def _window_table(result: PolicyComparison, shown: list[PolicyRun], with_bytes: bool) -> list[str]:
    """Per window, each run of ``shown`` side by side: balancedness after, then experts moved (and
    bytes), or the skip reason in their place."""

    rest_w = 18 if with_bytes else 13  # "skip min_gain"; "  moved      bytes"
    sub = f"{'after':>6} " + (f"{'moved':>7} {'bytes':>10}" if with_bytes else f"{'moved':>{rest_w}}")
    widths = [max(len(sub), len(r.label)) for r in shown]
    lines = [
        f"{'window':>6} "
        + " ".join(f"| {r.label:<{w}}" for r, w in zip(shown, widths, strict=True)).rstrip(),
        (f"{'':>6} " + " ".join(f"| {sub:<{w}}" for w in widths)).rstrip(),
    ]
    for i in range(result.num_windows):
        cells = []
        for r, width in zip(shown, widths, strict=True):
            o = r.windows[i]
            if o.skipped is not None:
                rest = f"skip {o.skipped}"
            elif with_bytes:
                rest = f"{o.experts_moved:>7} {format_bytes(o.bytes_moved):>10}"
            else:
                rest = str(o.experts_moved)
            cells.append(f"| {f'{o.balancedness_after:>6.4f} {rest:>{rest_w}}':<{width}}")
        lines.append((f"{i + 1:>6} " + " ".join(cells)).rstrip())
    return lines


def _choice_lines(result: PolicyComparison) -> list[str]:
    """The run to choose, its keys, beside upstream's default on the window with the gate off (when it
    ran), and the rule."""
    choice = result.choice
    if choice is None:
        return ["choose: nothing to judge (one window: no placement was seen serving a next one)"]
    keys = json.dumps(choice.ascend_keys) if choice.ascend_keys else "{} (upstream's defaults)"
    upstream = next(
        (r for r in result.runs if (r.policy, r.load_estimate, r.gate) == ("default", "window", "off")), None
    )
    beside = ""
    if upstream is not None and upstream.label != choice.label:
        beside = (
            f" (upstream's default on the window, gate off: {upstream.mean_balancedness_realised:.4f}, "
            f"{upstream.experts_moved} experts moved)"
        )
    return [
        f"choose: {choice.label}: additional_config.eplb_config {keys}; mean realised "
        f"{choice.mean_balancedness_realised:.4f}, {choice.experts_moved} experts moved{beside}",
        "  rule: the highest mean realised balancedness (the next window under each placement: what serving "
        f"sees); of the runs within {choice.margin:g} of it (the migration-aware policy's tolerance of "
        "upstream's balance), the one that moves the fewest experts",
    ]


# ----------------------------------------------------------------------------------------------------
# The batch split (``--batch-split``): what each batch executes, today's rule beside the split


@dataclass(frozen=True)
class BatchSplitRow:
    """One batch of a routing trace: its sequences ``[first, last]`` and tokens, and its balancedness
    (mean rank load / max rank load, mean over the MoE layers): ``equal`` (each replica ``c / count``),
    ``today`` and ``split`` (what today's rule and the batch split execute, as the data plane's ops record
    it), ``bound`` (the most any split of the batch among the replicas reaches)."""

    batch: int
    first_sequence: int
    last_sequence: int
    tokens: int
    equal: float
    today: float
    split: float
    bound: float


@dataclass(frozen=True)
class BatchSplitReport:
    """``plan --batch-split``: every batch of a routing trace under upstream's default placement of one
    redundancy level planned on the whole trace."""

    source: str
    num_ranks: int
    num_redundant_experts: int
    window_sequences: int
    steps: int
    rows: tuple[BatchSplitRow, ...]

    def means(self) -> dict[str, float]:
        """The columns' means over the batches."""
        return {
            k: float(np.mean([getattr(r, k) for r in self.rows]))
            for k in ("equal", "today", "split", "bound")
        }

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows], "means": self.means()}


def batch_split_figures(
    routing: trace.RoutingTrace,
    source: str,
    *,
    num_ranks: int,
    num_redundant_experts: int,
    window_sequences: int,
) -> BatchSplitReport:
    """Each batch of ``window_sequences`` consecutive sequences of ``routing`` routed through the data
    plane's ops (``ascend_eplb.dataplane.executed_rank_loads``: today's rule and the batch split, every
    row real) under upstream's ``DefaultEplbPolicy`` placement planned on the whole trace from its initial
    placement, beside the equal split and the bound (``ascend_eplb.control.measures``)."""
    from ascend_eplb.dataplane import DEFAULT_SPLIT_STEPS, ReplicaLookup, executed_rank_loads, replica_maps

    num_experts, num_layers = routing.num_logical_experts, routing.num_moe_layers
    num_physical = num_experts + num_redundant_experts
    (whole,) = trace_windows(routing, len(routing.seq_offsets) - 1)
    initial = measures.upstream_initial_placement(num_experts, num_redundant_experts, num_layers)
    placement = upstream_policy().rebalance_experts(
        torch.from_numpy(whole).double(), num_physical, 1, 1, num_ranks, initial
    )
    lookups = []
    for layer in range(num_layers):
        lookup = ReplicaLookup(num_experts, "cpu", num_physical_experts=num_physical, num_ranks=num_ranks)
        lookup.refresh_(*replica_maps(placement[layer], num_experts))
        lookups.append(lookup)
    offsets = np.asarray(routing.seq_offsets)
    num_sequences = len(offsets) - 1
    rows = []
    for batch, first in enumerate(range(0, num_sequences, window_sequences)):
        last = min(first + window_sequences, num_sequences) - 1
        ids = torch.from_numpy(np.ascontiguousarray(routing.topk_ids[:, offsets[first] : offsets[last + 1]]))
        load = torch.stack([torch.bincount(layer.flatten(), minlength=num_experts) for layer in ids])
        figures = {"today": [], "split": []}
        for layer, lookup in enumerate(lookups):
            for name in figures:
                ranks = executed_rank_loads(ids[layer], lookup, split=name == "split").double()
                figures[name].append(float(ranks.mean() / ranks.max()) if ranks.max() > 0 else 1.0)
        rows.append(
            BatchSplitRow(
                batch,
                first,
                last,
                int(ids.shape[1]),
                float(measures.balancedness(load, placement, num_ranks).mean()),
                float(np.mean(figures["today"])),
                float(np.mean(figures["split"])),
                float(measures.split_bound(load, placement, num_ranks).mean()),
            )
        )
    return BatchSplitReport(
        source, num_ranks, num_redundant_experts, window_sequences, DEFAULT_SPLIT_STEPS, tuple(rows)
    )


def format_batch_split(report: BatchSplitReport) -> str:
    """The report's table: a line per batch, then the means."""
    lines = [
        f"batch split on {report.source}: {report.num_ranks} ranks, {report.num_redundant_experts} "
        "redundant experts (upstream's default policy planned on the whole trace), batches of "
        f"{report.window_sequences} sequences, the split's solve {report.steps} steps",
        "balancedness per batch (mean over MoE layers): equal = each replica count/replicas; today = today's "
        "rule executed; split = the batch split executed (replica_split=batch); bound = the most any split "
        "reaches",
        f"{'batch':>5} {'sequences':>10} {'tokens':>7} {'equal':>7} {'today':>7} {'split':>7} {'bound':>7}",
    ]
    for r in report.rows:
        seqs = f"{r.first_sequence}-{r.last_sequence}"
        lines.append(
            f"{r.batch:>5} {seqs:>10} {r.tokens:>7} {r.equal:>7.4f} {r.today:>7.4f} {r.split:>7.4f} "
            f"{r.bound:>7.4f}"
        )
    m = report.means()
    means = " ".join(f"{m[k]:>7.4f}" for k in ("equal", "today", "split", "bound"))
    lines.append(f"{'mean':>5} {'':>10} {'':>7} {means}")
    return "\n".join(lines)

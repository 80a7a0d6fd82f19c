"""Ascend EPLB control adaptation over vLLM 0.33.0's ``EPLBController`` and ``EplbState``.

Upstream owns the control plane; this package adapts its boundaries: the controller's load-collection
phase (:mod:`.phase`), a replica lookup per MoE layer refreshed at each commit (:mod:`.state`), the
placement policy and gain gate (:mod:`.policy_config`, :mod:`.gate`), the event bus (:mod:`.bus`), the
router adaptation, the measures, and the specs of the upstream patches it needs (:mod:`.commit_hooks`,
:mod:`.host_adaptation`, applied by :mod:`.patching`; installed by the integration, never here), and
the one :class:`~.surface.Surface` type every owner of upstream rows declares them in (:mod:`.upstream`).
"""

from __future__ import annotations

import importlib
from typing import Any

from ascend_eplb.control.__about__ import __version__
from ascend_eplb.control.bus import (
    CommitEvent,
    ControllerEvent,
    DecisionEvent,
    Event,
    EventBus,
    RearrangementEvent,
    RegistrationEvent,
    ShutdownEvent,
    StepEvent,
)
from ascend_eplb.control.patching import Patch, PatchSet, check_signature
from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES, LoadCollectionPhase, is_phase_matched
from ascend_eplb.control.policy_config import PlacementDecision, PolicySettings

# Names whose modules import torch or vLLM, loaded on first use: the standard-library modules above
# (settings read by `ascend-eplb check` and start-up's rules) import without torch (2 s) or vLLM.
_LAZY_EXPORTS = {
    "AscendEPLBController": "controller",
    "AscendEplbLayerState": "state",
    "AscendEplbState": "state",
    "MigrationAwarePolicy": "policy",
    "SplitAwarePolicy": "policy",
    "adapt_layer_routers": "router_adaptation",
    "commit_hooks_installed": "commit_hooks",
    **dict.fromkeys(
        [
            "balancedness",
            "hottest_rank_share",
            "layer_balancedness",
            "mean_balancedness",
            "moved_experts",
            "rank_loads",
            "received_experts",
            "split_bound",
            "upstream_initial_placement",
        ],
        "measures",
    ),
}

__all__ = [
    "LOAD_COLLECTION_PHASES",
    "AscendEPLBController",
    "AscendEplbLayerState",
    "AscendEplbState",
    "CommitEvent",
    "ControllerEvent",
    "DecisionEvent",
    "Event",
    "EventBus",
    "LoadCollectionPhase",
    "MigrationAwarePolicy",
    "Patch",
    "PatchSet",
    "PlacementDecision",
    "PolicySettings",
    "RearrangementEvent",
    "RegistrationEvent",
    "ShutdownEvent",
    "SplitAwarePolicy",
    "StepEvent",
    "__version__",
    "adapt_layer_routers",
    "balancedness",
    "check_signature",
    "commit_hooks_installed",
    "hottest_rank_share",
    "is_phase_matched",
    "layer_balancedness",
    "mean_balancedness",
    "moved_experts",
    "rank_loads",
    "received_experts",
    "split_bound",
    "upstream_initial_placement",
]


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ascend_eplb.control' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ascend_eplb.control.{module}"), name)
    globals()[name] = value
    return value

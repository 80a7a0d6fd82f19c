"""Ascend EPLB control adaptation over vLLM 0.33.0's ``EPLBController`` and ``EplbState``.

Upstream vLLM owns the control plane (load windows, policy, placement state, async worker, the
rearrangement transaction). This package adapts its boundaries only:

* :class:`AscendEPLBController`: batch load-collection phase (``all`` / ``prefill`` / ``decode``);
* :class:`AscendEplbState` / :class:`AscendEplbLayerState`: a stable device replica lookup per MoE layer,
  refreshed in place when (and only when) the layer's placement commits, before the async worker's
  staging buffer is acknowledged; no rearrangement on an all-zero window;
* :class:`PolicySettings` (:mod:`~ascend_eplb.control.policy_config`, standard library only) and
  :mod:`~ascend_eplb.control.gate`: the placement policy the state selects and the gain gate around it
  (skipped rearrangements move nothing; each decision a :class:`DecisionEvent` on the bus);
* :class:`EventBus` (:mod:`~ascend_eplb.control.bus`): the controller's one typed event bus
  (registration, step, rearrangement, commit phases, shutdown) the serving guardrails subscribe to;
* :func:`adapt_layer_routers`: each MoE layer's router gets an :class:`AscendEplbLayerState` and
  dataplane's mapping, before the model is registered;
* :mod:`~ascend_eplb.control.commit_hooks` and :mod:`~ascend_eplb.control.host_adaptation`: the specs
  of the upstream patches this plane needs (installed by the integration's ``apply_patches()``, never
  by this package), with :mod:`~ascend_eplb.control.patching`, the one patch applier and signature
  checker.
"""

from __future__ import annotations

import importlib
from typing import Any

from ascend_eplb.control.__about__ import __version__

#: Public name -> submodule: the one list of this package's names (``__all__`` is made of it). The
#: submodules load on first use, so ``ascend_eplb.control.phase``, ``ascend_eplb.control.policy_config``,
#: ``ascend_eplb.control.measures`` and ``ascend_eplb.control.patching`` import without vLLM; a static
#: type checker sees these names through ``__getattr__`` (as ``Any``).
_EXPORTS = {
    "CommitEvent": "bus",
    "ControllerEvent": "bus",
    "DecisionEvent": "bus",
    "Event": "bus",
    "EventBus": "bus",
    "RearrangementEvent": "bus",
    "RegistrationEvent": "bus",
    "ShutdownEvent": "bus",
    "StepEvent": "bus",
    "commit_hooks_installed": "commit_hooks",
    "AscendEPLBController": "controller",
    "Patch": "patching",
    "PatchSet": "patching",
    "check_signature": "patching",
    "LOAD_COLLECTION_PHASES": "phase",
    "LoadCollectionPhase": "phase",
    "is_phase_matched": "phase",
    "PlacementDecision": "policy_config",
    "PolicySettings": "policy_config",
    "MigrationAwarePolicy": "policy",
    "balancedness": "measures",
    "hottest_rank_share": "measures",
    "layer_balancedness": "measures",
    "mean_balancedness": "measures",
    "moved_experts": "measures",
    "rank_loads": "measures",
    "received_experts": "measures",
    "upstream_initial_placement": "measures",
    "adapt_layer_routers": "router_adaptation",
    "AscendEplbLayerState": "state",
    "AscendEplbState": "state",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ascend_eplb.control' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ascend_eplb.control.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

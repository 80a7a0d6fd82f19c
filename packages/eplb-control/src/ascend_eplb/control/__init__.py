"""Ascend EPLB control adaptation over vLLM 0.33.0's ``EPLBController`` and ``EplbState``.

Upstream vLLM owns the control plane (load windows, policy, placement state, async worker, the
rearrangement transaction). This package adapts its boundaries only:

* :class:`AscendEPLBController`: batch load-collection phase (``all`` / ``prefill`` / ``decode``);
* :class:`AscendEplbState` / :class:`AscendEplbLayerState`: a stable device replica lookup per MoE layer,
  refreshed in place when (and only when) the layer's placement commits, before the async worker's
  staging buffer is acknowledged; no rearrangement on an all-zero window;
* :mod:`~ascend_eplb.control.commit_hooks`: the narrow hooks of upstream's commit functions;
* :mod:`~ascend_eplb.control.host_adaptation`: upstream EPLB on hosts without an accelerator.
"""

from ascend_eplb.control.__about__ import __version__
from ascend_eplb.control.commit_hooks import (
    commit_hooks_installed,
    install_commit_hooks,
    uninstall_commit_hooks,
)
from ascend_eplb.control.controller import AscendEPLBController
from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES, LoadCollectionPhase, is_phase_matched
from ascend_eplb.control.state import AscendEplbLayerState, AscendEplbState, CommitEvent

__all__ = [
    "LOAD_COLLECTION_PHASES",
    "AscendEPLBController",
    "AscendEplbLayerState",
    "AscendEplbState",
    "CommitEvent",
    "LoadCollectionPhase",
    "__version__",
    "commit_hooks_installed",
    "install_commit_hooks",
    "is_phase_matched",
    "uninstall_commit_hooks",
]

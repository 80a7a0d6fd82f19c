"""Test support of the ascend-eplb packages: the oracles, tagged expert weights, the launcher's names.

Used by every package's tests; never by product code (the serving planes and the tools). The multi-rank
launcher is ``ascend_eplb.launch``'s (``ascend-eplb simulate`` runs it too); it is re-exported here, where
every package's tests import it from (``from ascend_eplb.testing import run_ranks``). This module
imports only the standard library and torch.
"""

from ascend_eplb.launch import (
    RANK_ENV,
    LauncherInterruptedError,
    RankContext,
    RankFailureError,
    load_module,
    reap_child,
    run_ranks,
    signals_raise,
    stop_fork_server,
)

__all__ = [
    "RANK_ENV",
    "LauncherInterruptedError",
    "RankContext",
    "RankFailureError",
    "load_module",
    "reap_child",
    "run_ranks",
    "signals_raise",
    "stop_fork_server",
]

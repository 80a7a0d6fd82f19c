"""Test support: the multi-rank launcher (:func:`run_ranks`), the oracles and tagged expert weights.

Used by every package's tests and by ``ascend-eplb simulate``; never by the serving planes. This module
imports only the standard library and torch.
"""

from ascend_eplb.testing.multirank import (
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

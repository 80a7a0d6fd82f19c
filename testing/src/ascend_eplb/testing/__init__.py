"""Test support of the ascend-eplb packages: the oracles, tagged expert weights, the launcher's names.

Used by every package's tests, never by product code. Re-exports ``ascend_eplb.launch``'s multi-rank
launcher (``from ascend_eplb.testing import run_ranks``). Imports only the standard library and torch.
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

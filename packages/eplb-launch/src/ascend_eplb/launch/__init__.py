"""The one multi-rank launcher of ascend-eplb: :func:`run_ranks` and what it reports.

Run by ``ascend-eplb simulate`` (the operator tool starts its ranks with it) and, through the test
support's re-export (``ascend_eplb.testing``), by every package's multi-rank tests. Standard library and
torch only: no vLLM, nothing of the serving planes.
"""

from ascend_eplb.launch.multirank import (
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

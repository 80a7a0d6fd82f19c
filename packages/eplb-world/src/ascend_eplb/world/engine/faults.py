"""Faults the engine world puts into vLLM's workers, through the engine's own RPC, for the tests that show
the serving guardrails catch them.

Each function takes vLLM's worker first and runs on every worker when passed to
:meth:`~.host.EngineWorld.run_on_workers`; its result is plain data.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rank_dependent_replicas"]


def rank_dependent_replicas(worker: Any) -> dict[str, list[int]]:
    """Issue 19's bug put back: every registered model's row-layout tensor (``AscendEplbState.row_layouts``,
    int64 ``(4,)``: replica offset, slices, recording slice, local chunk) gets this rank's EP rank as its
    replica offset (vLLM Ascend's ``row + ep_rank + e``), so ranks that route the same rows (TP peers in the
    ``replicated`` layout) choose different replicas of a token's logical expert: its output is computed on
    two ranks or on none. The controller's layout for the configuration is put in force first (as its
    first ``prepare_forward`` would); the offset then stays while that layout is in force (the controller
    writes the tensor only on a change).

    Returns:
        per model (upstream's model name), its row-layout tensor after the change.

    Raises:
        RuntimeError: EPLB is off on this worker.
    """
    # local: runs in vLLM's workers; the processes that name this function (the engine tests) import no vLLM
    from vllm.distributed.parallel_state import get_ep_group

    controller = worker.model_runner.eplb
    state = controller.state
    if state is None or not state.row_layouts:
        raise RuntimeError("EPLB is off on this worker (no registered model has a row layout)")
    state.set_row_layout(controller.row_layout_for())
    ep_rank = get_ep_group().rank_in_group
    out = {}
    for key, tensor in state.row_layouts.items():
        tensor[0] = ep_rank
        out[state.model_states[key].model_name] = tensor.tolist()
    return out

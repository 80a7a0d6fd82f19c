"""The faults ``simulate --fault`` injects into one rank, each to show its check fire.

The async worker's (:data:`WORKER_FAULTS`, :func:`inject_worker_fault`, on the last rank) and a stale
lookup refresh (:func:`inject_stale_lookup`); the view list that forgets a scale tensor is the replay
world's (``replay_world.QuantExperts``).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

__all__ = ["FAULTS", "FAULT_DESCRIPTIONS", "WORKER_FAULTS", "inject_stale_lookup", "inject_worker_fault"]


#: The faults of the async worker (:func:`inject_worker_fault`), injected on the last rank.
WORKER_FAULTS = ("worker-dies", "worker-stalls", "worker-never-publishes")
#: Every fault ``--fault`` takes.
FAULTS = ("wrong-lookup-refresh", "view-skips-scale", *WORKER_FAULTS)
#: What each fault does (``--fault``'s help and SIMULATE.md).
FAULT_DESCRIPTIONS = {
    "wrong-lookup-refresh": "layer 0's lookup keeps the pre-commit placement after its commit (lookups)",
    "view-skips-scale": (
        "the weight views forget a scale tensor, so it is never moved (fingerprints; replay only)"
    ),
    "worker-dies": "the last rank's async worker raises in layer 1's transfer (worker)",
    "worker-stalls": "the last rank's async worker never returns from layer 1's transfer (worker)",
    "worker-never-publishes": (
        "the last rank's async worker moves layer 1 but never publishes it, while the other ranks' "
        "workers wait for theirs to be consumed: upstream's silent stop, vllm-project/vllm#57883 (worker)"
    ),
}


def inject_worker_fault(communicator: Any, fault: str, rank: int) -> None:
    """Fault injection in this rank's async worker, at its second transfer (layer 1 of the first
    rearrangement): it raises (``worker-dies``), never returns (``worker-stalls``: the peers wait in
    their transfer), or completes and then never returns (``worker-never-publishes``: the peers'
    transfers complete and their workers publish layer 1 and wait for it to be consumed, this rank
    never publishes it, so upstream's step counter runs past its interval: vllm-project/vllm#57883)."""
    execute = communicator.execute
    calls = itertools.count(1)

    def faulty_execute(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 2:
            if fault == "worker-dies":
                raise RuntimeError(f"injected fault: the expert transfer of layer 1 failed on rank {rank}")
            if fault == "worker-never-publishes":
                execute(*args, **kwargs)
            time.sleep(3600)
        return execute(*args, **kwargs)

    communicator.execute = faulty_execute


def inject_stale_lookup(layer_state: Any) -> None:
    """Fault injection: the layer's lookup keeps serving the pre-commit placement after its commit."""
    stale = (layer_state.logical_to_physical_map.clone(), layer_state.logical_replica_count.clone())
    layer_state.refresh_replica_lookup = lambda: layer_state.replica_lookup.refresh_(*stale)

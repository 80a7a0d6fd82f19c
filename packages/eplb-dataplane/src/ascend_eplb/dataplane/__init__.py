"""Ascend EPLB data plane: what a forward runs to route a selection to a physical expert.

The device replica lookup (fixed shape, refreshed in place), logical-to-physical mapping fused with load
recording (graph-safe, padding excluded), post-compute recording from kernel token counts, the batch
split of a replicated expert's selections by the batch's own counts, and the per-instance router
adapter. Pure torch (Triton optional); never imports vLLM. See the package README for the contracts.
"""

from ascend_eplb.dataplane.__about__ import __version__
from ascend_eplb.dataplane.graphs import GraphInput, GraphObserver, TracedGraph, trace_once
from ascend_eplb.dataplane.lookup import (
    DEFAULT_ROWS,
    ReplicaLookup,
    build_replica_table,
    replica_maps,
    split_inputs,
    table_checksum,
    validate_placement,
)
from ascend_eplb.dataplane.ops import (
    GROUP_LIST_COUNTS,
    GROUP_LIST_CUMSUM,
    map_to_physical,
    map_to_physical_and_record,
    record_expert_tokens,
)
from ascend_eplb.dataplane.router import (
    LAYER_STATE_FIELDS,
    UPSTREAM_MAPPING_METHOD,
    bind_router,
    is_bound,
    unbind_router,
)
from ascend_eplb.dataplane.split import (
    DEFAULT_SPLIT_STEPS,
    SPLIT_STATS_SIZE,
    BatchSplit,
    executed_rank_loads,
    map_to_physical_split_and_record,
    split_boundaries,
    split_counts,
    split_rank_loads,
)

__all__ = [
    "DEFAULT_ROWS",
    "DEFAULT_SPLIT_STEPS",
    "GROUP_LIST_COUNTS",
    "GROUP_LIST_CUMSUM",
    "LAYER_STATE_FIELDS",
    "SPLIT_STATS_SIZE",
    "UPSTREAM_MAPPING_METHOD",
    "BatchSplit",
    "GraphInput",
    "GraphObserver",
    "ReplicaLookup",
    "TracedGraph",
    "__version__",
    "bind_router",
    "build_replica_table",
    "executed_rank_loads",
    "is_bound",
    "map_to_physical",
    "map_to_physical_and_record",
    "map_to_physical_split_and_record",
    "record_expert_tokens",
    "replica_maps",
    "split_boundaries",
    "split_counts",
    "split_inputs",
    "split_rank_loads",
    "table_checksum",
    "trace_once",
    "unbind_router",
    "validate_placement",
]

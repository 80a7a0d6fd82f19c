"""``ascend-eplb plan --batch-split``: what each batch of a routing trace executes, today's rule beside
the batch split, under upstream's default placement planned on the whole trace. The text is
:func:`ascend_eplb.tools.plan_text.format_batch_split`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ascend_eplb.control import measures
from ascend_eplb.tools import trace
from ascend_eplb.tools.plan import upstream_policy
from ascend_eplb.tools.plan_compare import trace_windows

__all__ = ["BatchSplitReport", "BatchSplitRow", "batch_split_figures"]


@dataclass(frozen=True)
class BatchSplitRow:
    """One batch of a routing trace: its sequences ``[first, last]`` and tokens, and its balancedness
    (mean rank load / max rank load, mean over the MoE layers): ``equal`` (each replica ``c / count``),
    ``today`` and ``split`` (what today's rule and the batch split execute, as the data plane's ops record
    it), ``bound`` (the most any split of the batch among the replicas reaches)."""

    batch: int
    first_sequence: int
    last_sequence: int
    tokens: int
    equal: float
    today: float
    split: float
    bound: float


@dataclass(frozen=True)
class BatchSplitReport:
    """``plan --batch-split``: every batch of a routing trace under upstream's default placement of one
    redundancy level planned on the whole trace."""

    source: str
    num_ranks: int
    num_redundant_experts: int
    window_sequences: int
    steps: int
    rows: tuple[BatchSplitRow, ...]

    def means(self) -> dict[str, float]:
        """The columns' means over the batches."""
        return {
            k: float(np.mean([getattr(r, k) for r in self.rows]))
            for k in ("equal", "today", "split", "bound")
        }

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows], "means": self.means()}


def batch_split_figures(
    routing: trace.RoutingTrace,
    source: str,
    *,
    num_ranks: int,
    num_redundant_experts: int,
    window_sequences: int,
) -> BatchSplitReport:
    """Each batch of ``window_sequences`` consecutive sequences of ``routing`` routed through the data
    plane's ops (``ascend_eplb.dataplane.executed_rank_loads``: today's rule and the batch split, every
    row real) under upstream's ``DefaultEplbPolicy`` placement planned on the whole trace from its initial
    placement, beside the equal split and the bound (``ascend_eplb.control.measures``)."""
    # local: the data plane imports Triton, which only `plan --batch-split` needs
    from ascend_eplb.dataplane import DEFAULT_SPLIT_STEPS, ReplicaLookup, executed_rank_loads, replica_maps

    num_experts, num_layers = routing.num_logical_experts, routing.num_moe_layers
    num_physical = num_experts + num_redundant_experts
    (whole,) = trace_windows(routing, len(routing.seq_offsets) - 1)
    initial = measures.upstream_initial_placement(num_experts, num_redundant_experts, num_layers)
    placement = upstream_policy().rebalance_experts(
        torch.from_numpy(whole).double(), num_physical, 1, 1, num_ranks, initial
    )
    lookups = []
    for layer in range(num_layers):
        lookup = ReplicaLookup(num_experts, "cpu", num_physical_experts=num_physical, num_ranks=num_ranks)
        lookup.refresh_(*replica_maps(placement[layer], num_experts))
        lookups.append(lookup)
    offsets = np.asarray(routing.seq_offsets)
    num_sequences = len(offsets) - 1
    rows = []
    for batch, first in enumerate(range(0, num_sequences, window_sequences)):
        last = min(first + window_sequences, num_sequences) - 1
        ids = torch.from_numpy(np.ascontiguousarray(routing.topk_ids[:, offsets[first] : offsets[last + 1]]))
        load = torch.stack([torch.bincount(layer.flatten(), minlength=num_experts) for layer in ids])
        figures = {"today": [], "split": []}
        for layer, lookup in enumerate(lookups):
            for name in figures:
                ranks = executed_rank_loads(ids[layer], lookup, split=name == "split").double()
                figures[name].append(float(ranks.mean() / ranks.max()) if ranks.max() > 0 else 1.0)
        rows.append(
            BatchSplitRow(
                batch,
                first,
                last,
                int(ids.shape[1]),
                float(measures.balancedness(load, placement, num_ranks).mean()),
                float(np.mean(figures["today"])),
                float(np.mean(figures["split"])),
                float(measures.split_bound(load, placement, num_ranks).mean()),
            )
        )
    return BatchSplitReport(
        source, num_ranks, num_redundant_experts, window_sequences, DEFAULT_SPLIT_STEPS, tuple(rows)
    )

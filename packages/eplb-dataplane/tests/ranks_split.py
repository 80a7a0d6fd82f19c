"""Rank functions of the batch split's multi-rank tests (not a test module; ``load_module`` loads it).

Every rank builds the same lookup and the same batch (deterministic), routes its rows through a router
bound to a layer state with a ``BatchSplit``, and returns what it chose and recorded.
"""

from __future__ import annotations

from typing import Any

import torch

E, P, TOP_K, NUM_TOKENS = 12, 20, 3, 96


def placement() -> tuple[torch.Tensor, torch.Tensor]:
    """12 experts over 20 slots on 4 ranks of 5; experts 0 and 1 (hot) have 3 replicas, 2..5 have 2."""
    slots = {0: [0, 9, 16], 1: [5, 14, 19], 2: [1, 18], 3: [6, 13], 4: [11, 17], 5: [15, 2]}
    free = [s for s in range(P) if all(s not in v for v in slots.values())]
    for e in range(6, E):
        slots[e] = [free.pop(0)]
    l2p = torch.full((E, 3), -1, dtype=torch.int64)
    for e, s in slots.items():
        l2p[e, : len(s)] = torch.tensor(s)
    return l2p, (l2p >= 0).sum(1)


def batch() -> torch.Tensor:
    """int32 ``(NUM_TOKENS, TOP_K)``: distinct experts per row, experts 0 and 1 in most rows."""
    gen = torch.Generator().manual_seed(7)
    weights = torch.tensor([8.0, 6.0] + [1.0] * (E - 2))
    return torch.stack([torch.multinomial(weights, TOP_K, generator=gen) for _ in range(NUM_TOKENS)]).int()


class Router:
    def __init__(self):
        self.eplb_state = None

    def _apply_eplb_mapping(self, topk_ids):
        return topk_ids


class LayerState:
    def __init__(self, lookup, num_real, layout, split):
        self.replica_lookup = lookup
        self.expert_load_view = torch.zeros(P, dtype=torch.int64)
        self.should_record_tensor = torch.tensor(True)
        self.num_unpadded_tokens_tensors = [torch.tensor(num_real)]
        self.row_layout = torch.tensor(layout)
        self.batch_split = split


def split_world(ctx: Any, rows: str) -> dict[str, Any]:
    """Route the batch in ``rows`` layout on this rank: ``replicated`` (every rank all rows, the last 6
    padding), ``split`` (rank r its quarter, global counts all-gathered over Gloo) or ``split-local``
    (its quarter, its own counts)."""
    import torch.distributed as dist

    from ascend_eplb.dataplane import BatchSplit, ReplicaLookup, bind_router

    ctx.init_gloo()
    lookup = ReplicaLookup(E, "cpu", rows=32, num_physical_experts=P, num_ranks=ctx.world_size)
    lookup.refresh_(*placement())
    ids = batch()

    def gather(local: torch.Tensor) -> torch.Tensor:  # as vLLM's GroupCoordinator.all_gather(dim=0)
        every = local.new_empty(ctx.world_size, local.shape[0])
        dist.all_gather_into_tensor(every, local.unsqueeze(0))
        return every

    stats = torch.zeros(3)
    if rows == "replicated":
        mine, real, layout = ids, NUM_TOKENS - 6, [ctx.rank % 2, 1, 0 if ctx.rank == 0 else -1, 0]
        split = BatchSplit(stats=stats)
    else:
        size = NUM_TOKENS // ctx.world_size
        mine, real, layout = ids[ctx.rank * size : (ctx.rank + 1) * size], size, [ctx.rank, 1, 0, 0]
        split = BatchSplit(gather_counts=gather if rows == "split" else None, rank=ctx.rank, stats=stats)
    state = LayerState(lookup, real, layout, split)
    router = Router()
    bind_router(router, state)
    out = router._apply_eplb_mapping(mine)
    dist.destroy_process_group()
    return {"out": out, "load": state.expert_load_view, "stats": stats}

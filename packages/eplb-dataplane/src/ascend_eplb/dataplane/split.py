"""The batch split: a replicated expert's selections shared among its replicas by the batch's own load.

Today's rule (:mod:`ascend_eplb.dataplane.lookup`) gives each replica an equal share whatever the batch
holds. The split (opt-in, issue 44) counts the batch's selections per logical expert ``c (E,)`` on the
device, solves integer shares of each replicated expert's selections among its replicas that lower the
batch's max rank load, and sends each selection to a replica by its occurrence rank within its expert
(row order): replica ``m`` of expert ``e`` takes ranks ``[b[e, m - 1], b[e, m])`` of the cumulative
boundaries ``b (E, M)`` (``b[e, M - 1] = c[e]``). Integer arithmetic throughout, so ranks that route the
same rows, the Triton kernel and the torch form choose the same replicas.

The solve (:func:`split_boundaries`), in units of ``1 / SPLIT_SCALE`` selection: start from the equal
split; ``steps`` times, each replicated expert computes its water-filling target (its selections poured
over its replicas' ranks given the others' load, the remainder to the lowest replica index), and moves
``ceil(d / k)`` of each decrease ``d``, ``k`` the replicated experts decreasing on that rank, pouring
what it took back by water-filling; then boundaries ``b = round(cumsum(shares) / SPLIT_SCALE)``
(half up). The bound it approaches is the fractional optimum ``max over rank sets A of (selections of
experts whose replicas all lie in A) / |A|`` (max-flow min-cut); ``benchmarks/bench_batch_split.py``
measures the distance on the ESFT trace (README "Batch split").

Inputs beside the lookup's table, refreshed in place (:meth:`ReplicaLookup.refresh_`): ``replica_slots``
int32 ``(E, M)`` (the placement's replica slots, -1 padded, ``M = P - E + 1``), ``slot_rank`` int32
``(P,)`` and ``split_experts`` int32 ``(X,)`` (the replicated experts, ascending, -1 padded,
``X = max(P - E, 1)``). Which rows take shares (padding takes none and shifts no rank): with one slice
(``replicated``, ``split`` rows) the first ``num_unpadded_tokens``; with several (``gathered``
layouts) every row, since a rank does not know its peers' padding without communication.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ascend_eplb.dataplane import _triton_split
from ascend_eplb.dataplane.lookup import ReplicaLookup, split_inputs
from ascend_eplb.dataplane.ops import (
    TRITON_DISPATCH_KEYS,
    _check_map_args,
    _check_record_args,
    _map_generic,
    _recorded_rows,
    map_to_physical_and_record,
)

__all__ = [
    "DEFAULT_SPLIT_STEPS",
    "SPLIT_SCALE",
    "SPLIT_STATS_SIZE",
    "BatchSplit",
    "executed_rank_loads",
    "map_to_physical_split_and_record",
    "split_boundaries",
    "split_counts",
    "split_inputs",
    "split_rank_loads",
]

#: Units of one selection in the solve (fixed point: the shares move by 1/16 selection, so a chain of
#: ranks one selection apart still converges; rounded to whole selections at the end).
SPLIT_SCALE = 16
#: Jacobi steps of the solve (README "Batch split": within 0.006 of the bound on the ESFT trace at 72
#: and 80 slots, 8 ranks, 1 to 8 sequences; 4 steps: within 0.012).
DEFAULT_SPLIT_STEPS = 8
#: Entries of ``split_stats``: executed balancedness summed over batches, the equal split's on the same
#: counts summed, batches counted (float32; a batch without selections is not counted).
SPLIT_STATS_SIZE = 3

_ID_DTYPES = (torch.int32, torch.int64)


@dataclass
class BatchSplit:
    """How a bound router splits each batch: ``layer_state.batch_split`` (``bind_router`` reads it at
    each call; None there is today's equal split).

    Attributes:
        steps: the solve's steps (:data:`DEFAULT_SPLIT_STEPS`).
        gather_counts: for ``split`` rows with global counts: maps this rank's :func:`split_counts`
            ``(E,)`` to every rank's ``(N, E)`` (an all-gather over the EP group that a traced forward
            keeps: vLLM's ``GroupCoordinator.all_gather``); None: each rank splits by its own rows' counts
            (every layout but ``split`` rows, or their rank-local split).
        rank: this rank's row in the gathered counts (its prefix is the sum of the rows above).
        stats: optional float32 ``(SPLIT_STATS_SIZE,)`` on the device, the op's ``split_stats``.
    """

    steps: int = DEFAULT_SPLIT_STEPS
    gather_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
    rank: int = 0
    stats: torch.Tensor | None = None

    def global_counts(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """``(global_counts, rank_prefix)`` of this rank's local counts, or ``(None, None)`` without
        ``gather_counts``."""
        if self.gather_counts is None:
            return None, None
        every = self.gather_counts(local)
        return every.sum(0), every[: self.rank].sum(0)


def _share_limit(num_tokens: int, num_unpadded_tokens: torch.Tensor, row_layout: torch.Tensor | None):
    """Device scalar: rows ``t`` below it take shares (module docstring)."""
    if row_layout is None:
        return num_unpadded_tokens
    gathered = row_layout[1] > 1
    return torch.where(gathered, num_tokens, num_unpadded_tokens)


def split_counts(
    topk_ids: torch.Tensor,
    num_experts: int,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 ``(E,)``: the selections per logical expert of the rows that take shares (on device).

    What a rank of ``split`` rows all-gathers before :func:`map_to_physical_split_and_record` (the sum
    over ranks is ``global_counts``, the sum over lower ranks its ``rank_prefix``). Ids outside
    ``[0, E)`` are not counted. No host read.
    """
    num_tokens = topk_ids.shape[0]
    token = torch.arange(num_tokens, device=topk_ids.device)
    takes = (token < _share_limit(num_tokens, num_unpadded_tokens, row_layout)).unsqueeze(1)
    ids = topk_ids.to(torch.int64)
    key = torch.where(takes & (ids >= 0) & (ids < num_experts), ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
    counts.index_add_(0, key.view(-1), torch.ones_like(key.view(-1)))
    return counts[:num_experts]


#: Added to the level of a padding column in the solve: above any real level (at most
#: ``T * K * SPLIT_SCALE``), and ``M`` of them still sum within int64.
_PAD_LEVEL = 1 << 48


def _waterfill(level: torch.Tensor, amount: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """int64 ``(X, M)``: ``amount (X,)`` poured over each row's entries at ``level`` (padding columns at
    ``_PAD_LEVEL`` or above take nothing); ``k`` is ``1 .. M``.

    The level ``h = min_k floor((amount + S_k) / k)`` (``S_k`` the ``k`` lowest entries' sum) gives
    ``max(h - level, 0)``; the rest, fewer than the entries at or below ``h``, one each to the first of
    them by index.
    """
    prefix = level.sort(dim=1).values.cumsum(1)
    top = ((amount.unsqueeze(1) + prefix) // k).amin(1, keepdim=True)
    base = (top - level).clamp_min(0)
    below = level <= top
    rest = (amount - base.sum(1)).unsqueeze(1)
    return base + (below & (below.cumsum(1) <= rest))


def _solve(
    counts: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of the solve: the replicated experts' boundaries ``(X, M)`` (rows of
    ``split_experts``; padding rows 0) and the replicas' ranks ``(X, M)``."""
    width = replica_slots.shape[1]
    slots = replica_slots.to(torch.int64)
    rank_of = slot_rank.to(torch.int64)
    counts = counts.to(torch.int64)
    single = slots[:, 1] < 0 if width > 1 else torch.ones_like(counts, dtype=torch.bool)
    base = torch.zeros(rank_of.shape[0], dtype=torch.int64, device=counts.device)
    base.index_add_(0, rank_of[slots[:, 0]], counts * single * SPLIT_SCALE)
    experts = split_experts.to(torch.int64)
    listed = experts >= 0
    row_slots = slots[experts.clamp_min(0)]
    valid = (row_slots >= 0) & listed.unsqueeze(1)
    ranks = rank_of[row_slots.clamp_min(0)]
    pad = (~valid).to(torch.int64) * _PAD_LEVEL
    amount = counts[experts.clamp_min(0)] * listed * SPLIT_SCALE
    num = valid.sum(1).clamp_min(1)
    column = torch.arange(width, device=counts.device)
    k = column + 1
    shares = ((amount // num).unsqueeze(1) + (column < (amount % num).unsqueeze(1))) * valid
    for _ in range(steps):
        others = base.index_add(0, ranks.view(-1), shares.view(-1))[ranks] - shares + pad
        delta = _waterfill(others, amount, k) - shares
        movers = torch.zeros_like(base).index_add_(0, ranks.view(-1), (delta < 0).view(-1).to(torch.int64))
        # ceil(-delta / per) where delta < 0, as -floor(delta / per) (the kernels: on non-negatives)
        taken = -(delta.clamp_max(0) // movers[ranks].clamp_min(1))
        rising = delta.clamp_min(0)
        before = rising.cumsum(1) - rising
        given = torch.minimum(rising, (taken.sum(1, keepdim=True) - before).clamp_min(0))
        shares = shares - taken + given
    ends = (shares.cumsum(1) + SPLIT_SCALE // 2) // SPLIT_SCALE
    return ends * listed.unsqueeze(1), ranks


def _boundaries(counts, replica_slots, ends, split_experts) -> torch.Tensor:
    """int64 ``(E, M)``: every expert's boundaries from the replicated experts' ``ends``."""
    num_experts, width = replica_slots.shape
    experts = split_experts.to(torch.int64)
    rows = torch.where(experts >= 0, experts, num_experts)
    full = counts.to(torch.int64).unsqueeze(1).expand(num_experts, width)
    return torch.cat([full, full[:1]]).index_copy(0, rows, ends)[:num_experts]


def split_boundaries(
    counts: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    steps: int = DEFAULT_SPLIT_STEPS,
) -> torch.Tensor:
    """The solve (module docstring): int64 ``(E, M)`` cumulative boundaries of the split of ``counts``.

    Args:
        counts: integer ``(E,)`` selections per logical expert (``>= 0``).
        replica_slots, slot_rank, split_experts: :func:`split_inputs`' (or a lookup's) on ``counts``'
            device.
        steps: solve steps, ``>= 0`` (0: the equal split, rounded).

    Replica ``m`` of expert ``e`` takes the selections of occurrence ranks ``[b[e, m - 1], b[e, m])``;
    ``b[e, M - 1] == counts[e]``; an expert with one replica has ``b[e] == counts[e]``. No host read.
    """
    ends = _solve(counts, replica_slots, slot_rank, split_experts, steps)[0]
    return _boundaries(counts, replica_slots, ends, split_experts)


def split_rank_loads(
    boundaries: torch.Tensor, replica_slots: torch.Tensor, slot_rank: torch.Tensor
) -> torch.Tensor:
    """int64 ``(P,)``: the selections each rank executes under ``boundaries`` (entry ``r`` for rank
    ``r``, the rest 0): each replica's share ``b[e, m] - b[e, m - 1]`` at its slot's rank."""
    shares = torch.diff(boundaries, dim=1, prepend=torch.zeros_like(boundaries[:, :1]))
    slots = replica_slots.to(torch.int64)
    ranks = slot_rank.to(torch.int64)[slots.clamp_min(0)]
    load = torch.zeros(slot_rank.shape[0], dtype=torch.int64, device=boundaries.device)
    return load.index_add_(0, ranks.view(-1), (shares * (slots >= 0)).view(-1))


def executed_rank_loads(
    topk_ids: torch.Tensor, lookup: ReplicaLookup, *, split: bool, steps: int = DEFAULT_SPLIT_STEPS
) -> torch.Tensor:
    """int64 ``(N,)``: the selections each rank executes when every row of ``topk_ids`` (``(T, K)``,
    real) is routed through ``lookup`` (built with ``num_ranks``) by today's rule (``split=False``,
    ``map_to_physical_and_record``) or the batch split, as the op records them. For what-ifs on recorded
    routing (``ascend-eplb plan --batch-split``, ``benchmarks/bench_batch_split.py``).

    Raises:
        ValueError: the lookup keeps no split inputs (built without ``num_ranks``).
    """
    if lookup.split_inputs is None:
        raise ValueError(f"{lookup!r} keeps no split inputs: build it with num_ranks")
    load = torch.zeros(lookup.physical_id_bound, dtype=torch.int64, device=lookup.device)
    flag = torch.ones((), dtype=torch.bool, device=lookup.device)
    real = torch.tensor(topk_ids.shape[0], device=lookup.device)
    if split:
        map_to_physical_split_and_record(
            topk_ids, lookup.table, *lookup.split_inputs, load, flag, real, steps=steps
        )
    else:
        map_to_physical_and_record(topk_ids, lookup.table, load, flag, real)
    return load.view(lookup.num_ranks, -1).sum(1)


def _batch_balancedness(
    counts: torch.Tensor, boundaries: torch.Tensor, replica_slots: torch.Tensor, slot_rank: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 0-d: the split's executed balancedness (mean / max rank load) and the equal split's
    (each replica ``c[e] / count[e]``) on the same counts; 1 for a batch without selections."""
    num_ranks = slot_rank[-1].to(torch.float32) + 1
    total = counts.sum().to(torch.float32)
    executed = split_rank_loads(boundaries, replica_slots, slot_rank).amax().to(torch.float32)
    slots = replica_slots.to(torch.int64)
    valid = slots >= 0
    per = counts.to(torch.float32) / valid.sum(1).clamp_min(1)
    equal = torch.zeros(slot_rank.shape[0], dtype=torch.float32, device=counts.device)
    ranks = slot_rank.to(torch.int64)[slots.clamp_min(0)]
    equal.index_add_(0, ranks.view(-1), (per.unsqueeze(1) * valid).view(-1))
    mean = total / num_ranks
    return (
        torch.where(executed > 0, mean / executed.clamp_min(1), 1.0),
        torch.where(total > 0, mean / equal.amax().clamp_min(1e-30), 1.0),
    )


# ---------------------------------------------------------------------------------------------------
# The op


def _check_split_args(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    global_counts: torch.Tensor | None,
    rank_prefix: torch.Tensor | None,
    split_stats: torch.Tensor | None,
    steps: int,
) -> None:
    """The metadata rules of the split's arguments; ``ValueError`` naming the value and the rule."""
    num_experts = table.shape[1]
    if (
        replica_slots.dim() != 2
        or replica_slots.dtype != torch.int32
        or replica_slots.shape[0] != num_experts
    ):
        raise ValueError(
            f"replica_slots must be int32 (E, M) with the table's E = {num_experts}, got "
            f"{replica_slots.dtype} {tuple(replica_slots.shape)}"
        )
    if replica_slots.shape[1] < 1:
        raise ValueError(f"replica_slots must have M >= 1 columns, got {tuple(replica_slots.shape)}")
    if slot_rank.dim() != 1 or slot_rank.dtype != torch.int32 or slot_rank.shape[0] < num_experts:
        raise ValueError(
            f"slot_rank must be int32 (P,) with P >= E = {num_experts}, got {slot_rank.dtype} "
            f"{tuple(slot_rank.shape)}"
        )
    if split_experts.dim() != 1 or split_experts.dtype != torch.int32 or split_experts.shape[0] < 1:
        raise ValueError(
            f"split_experts must be int32 (X,) with X >= 1, got {split_experts.dtype} "
            f"{tuple(split_experts.shape)}"
        )
    for name, t in (("global_counts", global_counts), ("rank_prefix", rank_prefix)):
        if t is not None and (t.dim() != 1 or t.dtype not in _ID_DTYPES or t.shape[0] != num_experts):
            raise ValueError(
                f"{name} must be int32 or int64 (E,) with E = {num_experts}, got {t.dtype} {tuple(t.shape)}"
            )
    if (rank_prefix is None) != (global_counts is None):
        raise ValueError("global_counts and rank_prefix go together (split rows): give both or neither")
    if split_stats is not None and (
        split_stats.dim() != 1
        or split_stats.dtype != torch.float32
        or split_stats.shape[0] != SPLIT_STATS_SIZE
    ):
        raise ValueError(
            f"split_stats must be float32 ({SPLIT_STATS_SIZE},), got {split_stats.dtype} "
            f"{tuple(split_stats.shape)}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= 64:
        raise ValueError(f"steps must be an int in [0, 64], got {steps!r}")
    for name, t in (
        ("replica_slots", replica_slots),
        ("slot_rank", slot_rank),
        ("split_experts", split_experts),
        ("global_counts", global_counts),
        ("rank_prefix", rank_prefix),
        ("split_stats", split_stats),
    ):
        if t is not None and t.device != topk_ids.device:
            raise ValueError(f"{name} is on {t.device}, topk_ids on {topk_ids.device}; they must match")


def _check_all(
    topk_ids,
    table,
    replica_slots,
    slot_rank,
    split_experts,
    expert_load_view,
    record_enabled,
    num_unpadded_tokens,
    row_layout,
    global_counts,
    rank_prefix,
    split_stats,
    steps,
) -> None:
    _check_map_args(topk_ids, table)
    _check_record_args(topk_ids, table, expert_load_view, record_enabled, num_unpadded_tokens, row_layout)
    _check_split_args(
        topk_ids,
        table,
        replica_slots,
        slot_rank,
        split_experts,
        global_counts,
        rank_prefix,
        split_stats,
        steps,
    )


def _record(
    out: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    counted_row: torch.Tensor,
) -> None:
    num_counters = expert_load_view.shape[0]
    skipped = ~counted_row | ~record_enabled
    uncounted = (out < 0) | (out >= num_counters) | skipped.unsqueeze(1)
    bins = out.masked_fill(uncounted, num_counters).to(torch.int64)
    scratch = expert_load_view.new_zeros(num_counters + 1)
    scratch.index_add_(0, bins.view(-1), scratch.new_ones(1).expand(bins.numel()))
    expert_load_view.add_(scratch[:num_counters])


def _accumulate_stats(split_stats, record_enabled, counts, boundaries, replica_slots, slot_rank) -> None:
    executed, equal = _batch_balancedness(counts, boundaries, replica_slots, slot_rank)
    counted = (record_enabled & (counts.sum() > 0)).to(torch.float32)
    split_stats.add_(torch.stack([executed, equal, torch.ones_like(executed)]) * counted)


def _split_generic(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
    global_counts: torch.Tensor | None = None,
    rank_prefix: torch.Tensor | None = None,
    split_stats: torch.Tensor | None = None,
    steps: int = DEFAULT_SPLIT_STEPS,
) -> torch.Tensor:
    _check_all(
        topk_ids,
        table,
        replica_slots,
        slot_rank,
        split_experts,
        expert_load_view,
        record_enabled,
        num_unpadded_tokens,
        row_layout,
        global_counts,
        rank_prefix,
        split_stats,
        steps,
    )
    num_tokens = topk_ids.shape[0]
    num_experts, width = replica_slots.shape
    num_rows = split_experts.shape[0]
    device = topk_ids.device
    token = torch.arange(num_tokens, device=device)
    offset = None if row_layout is None else row_layout[0]
    equal = _map_generic(topk_ids, table, replica_offset=offset)  # padding rows, invalid ids, singles
    ids = topk_ids.to(torch.int64)
    takes = (token < _share_limit(num_tokens, num_unpadded_tokens, row_layout)).unsqueeze(1)
    takes = takes & (ids >= 0) & (ids < num_experts)
    if global_counts is None:
        key = torch.where(takes, ids, num_experts).view(-1)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
        counts = counts.index_add_(0, key, torch.ones_like(key))[:num_experts]
    else:
        counts = global_counts.to(torch.int64)
    ends, _ = _solve(counts, replica_slots, slot_rank, split_experts, steps)
    # Each replicated expert's row x of split_experts (num_rows: not replicated or not taking a share).
    experts = split_experts.to(torch.int64)
    row_of = torch.full((num_experts + 1,), num_rows, dtype=torch.int64, device=device)
    listed_rows = torch.where(experts >= 0, experts, num_experts)
    row_of = row_of.index_copy(0, listed_rows, torch.arange(num_rows, device=device))[:num_experts]
    row = torch.where(takes, row_of[ids.clamp(0, num_experts - 1)], num_rows)  # (T, K)
    # Occurrence rank in row order: the expert's selections in earlier rows, then earlier in this row.
    # Counts laid out (X + 1, T), int32, so the running sum runs along contiguous memory.
    flat = (row * num_tokens + token.unsqueeze(1)).view(-1)
    per_token = torch.zeros((num_rows + 1) * num_tokens, dtype=torch.int32, device=device)
    per_token.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    running = per_token.view(num_rows + 1, num_tokens).cumsum(1, dtype=torch.int32).view(-1)
    before = torch.ones(row.shape[1], row.shape[1], dtype=torch.bool, device=device).tril(-1)
    same = ((row.unsqueeze(2) == row.unsqueeze(1)) & before).sum(2, dtype=torch.int32)
    rank = (running[flat] - per_token[flat]).view(row.shape) + same
    if rank_prefix is not None:
        prefix = torch.cat([rank_prefix.to(torch.int64), rank_prefix.new_zeros(1, dtype=torch.int64)])
        rank = rank + prefix[torch.where(takes, ids, num_experts).clamp_max(num_experts)]
    # The replica: the boundaries of row x at or below the rank, one search in rows laid end to end.
    stride = ends.new_tensor(1 << 40)
    ends_all = torch.cat([ends, ends.new_zeros(1, width)])
    laid = (torch.arange(num_rows + 1, device=device).unsqueeze(1) * stride + ends_all).view(-1)
    found = torch.searchsorted(laid, row * stride + rank, right=True) - row * width
    slots = torch.cat([replica_slots[experts.clamp_min(0)], replica_slots.new_zeros(1, width)])
    last = (slots >= 0).sum(1).to(torch.int64) - 1
    replica = torch.minimum(found, last[row]).clamp_min(0)
    chosen = slots.view(-1)[row * width + replica]
    out = torch.where(row < num_rows, chosen.to(equal.dtype), equal)
    if row_layout is None:
        counted_row = token < num_unpadded_tokens
    else:
        counted_row = _recorded_rows(token, num_tokens, row_layout, num_unpadded_tokens)
    _record(out, expert_load_view, record_enabled, counted_row)
    if split_stats is not None:
        boundaries = _boundaries(counts, replica_slots, ends, split_experts)
        _accumulate_stats(split_stats, record_enabled, counts, boundaries, replica_slots, slot_rank)
    return out


def _split_triton(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
    global_counts: torch.Tensor | None = None,
    rank_prefix: torch.Tensor | None = None,
    split_stats: torch.Tensor | None = None,
    steps: int = DEFAULT_SPLIT_STEPS,
) -> torch.Tensor:
    _check_all(
        topk_ids,
        table,
        replica_slots,
        slot_rank,
        split_experts,
        expert_load_view,
        record_enabled,
        num_unpadded_tokens,
        row_layout,
        global_counts,
        rank_prefix,
        split_stats,
        steps,
    )
    out, counts, ends = _triton_split.launch(
        topk_ids,
        table,
        replica_slots,
        slot_rank,
        split_experts,
        expert_load_view,
        record_enabled,
        num_unpadded_tokens,
        row_layout,
        global_counts,
        rank_prefix,
        steps,
        SPLIT_SCALE,
    )
    if split_stats is not None:
        boundaries = _boundaries(counts, replica_slots, ends, split_experts)
        _accumulate_stats(split_stats, record_enabled, counts, boundaries, replica_slots, slot_rank)
    return out


def _split_fake(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
    global_counts: torch.Tensor | None = None,
    rank_prefix: torch.Tensor | None = None,
    split_stats: torch.Tensor | None = None,
    steps: int = DEFAULT_SPLIT_STEPS,
) -> torch.Tensor:
    _check_all(
        topk_ids,
        table,
        replica_slots,
        slot_rank,
        split_experts,
        expert_load_view,
        record_enabled,
        num_unpadded_tokens,
        row_layout,
        global_counts,
        rank_prefix,
        split_stats,
        steps,
    )
    return torch.empty_like(topk_ids, memory_format=torch.contiguous_format)


_LIB = torch.library.Library("ascend_eplb", "FRAGMENT")
_LIB.define(
    "map_to_physical_split_and_record(Tensor topk_ids, Tensor table, Tensor replica_slots, "
    "Tensor slot_rank, Tensor split_experts, Tensor(a!) expert_load_view, Tensor record_enabled, "
    "Tensor num_unpadded_tokens, Tensor? row_layout=None, Tensor? global_counts=None, "
    "Tensor? rank_prefix=None, Tensor(b!)? split_stats=None, int steps=8) -> Tensor"
)


def _register_triton(lib: torch.library.Library, dispatch_key: str) -> None:
    """Register the split's Triton path for ``dispatch_key`` in ``lib`` (``FRAGMENT`` or ``IMPL``)."""
    lib.impl("map_to_physical_split_and_record", _split_triton, dispatch_key)


_LIB.impl("map_to_physical_split_and_record", _split_generic, "CompositeExplicitAutograd")
if _triton_split.HAS_TRITON:
    for _key in TRITON_DISPATCH_KEYS:
        _register_triton(_LIB, _key)
torch.library.register_fake("ascend_eplb::map_to_physical_split_and_record", _split_fake, lib=_LIB)


def map_to_physical_split_and_record(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None = None,
    global_counts: torch.Tensor | None = None,
    rank_prefix: torch.Tensor | None = None,
    split_stats: torch.Tensor | None = None,
    steps: int = DEFAULT_SPLIT_STEPS,
) -> torch.Tensor:
    """:func:`~ascend_eplb.dataplane.ops.map_to_physical_and_record` with the batch split (module docstring).

    Op ``ascend_eplb::map_to_physical_split_and_record``. The rows that take shares (module docstring)
    go to replicas by the split of the batch's counts; the other rows (padding) and every argument
    shared with the map-and-record op keep its rules (``table`` rows for padding, ``-1`` for ids outside
    ``[0, E)``, the recorded rows of ``row_layout``), so the recorded load is the executed one.

    Args:
        replica_slots, slot_rank, split_experts: the lookup's split inputs (:func:`split_inputs`).
        global_counts, rank_prefix: ``split`` rows with global counts: int ``(E,)`` the batch's counts
            summed over the ranks and over the lower ranks only (:func:`split_counts` all-gathered); the
            rank's selections then take global occurrence ranks. None (both): the counts of these rows.
        split_stats: optional float32 ``(SPLIT_STATS_SIZE,)``: when ``record_enabled``, adds this batch's
            executed and equal-split balancedness and 1 (on device).
        steps: the solve's steps, an int in ``[0, 64]``.

    Raises ``ValueError`` for any argument of the wrong dtype, shape or device (metadata only, the same
    message on every path), before anything is written.
    """
    return torch.ops.ascend_eplb.map_to_physical_split_and_record(
        topk_ids,
        table,
        replica_slots,
        slot_rank,
        split_experts,
        expert_load_view,
        record_enabled,
        num_unpadded_tokens,
        row_layout,
        global_counts,
        rank_prefix,
        split_stats,
        steps,
    )

"""The Triton kernels of the batch split (:mod:`ascend_eplb.dataplane.split`): three launches.

1. ``_count_kernel`` (one program per ``block_t`` tokens): the selections that take shares, counted per
   logical expert (``tl.atomic_add``), each one's row ``x`` of ``split_experts`` and occurrence rank
   within its block, and the block's count per row.
2. ``_solve_kernel`` (one program): the solve of the torch form, step for step in int64 (rank loads
   through a scratch vector: atomic adds between barriers), writing the replicated experts' boundaries.
3. ``_assign_kernel`` (one program per block): occurrence rank = block rank + the earlier blocks' counts
   (a ``cumsum`` between launches) + the rank prefix; the replica whose boundaries hold it; padding rows
   and experts with one replica read the table; recording as the map-and-record kernel.

Integer arithmetic only, on non-negative operands (Triton's division truncates, torch's floors: equal
there), so the replicas are the torch form's, bit for bit (tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from ascend_eplb.dataplane._triton import triton

tl = None if triton is None else triton.language

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "launch"]

# Selections per program of the count and assign kernels (block_t tokens times K padded).
_SELECTIONS_PER_PROGRAM = 256
_PAD_LEVEL = 1 << 48

if triton is not None:

    @triton.jit
    def _share_limit(unpadded_ptr, layout_ptr, layout_stride, num_tokens, has_layout: tl.constexpr):
        unpadded = tl.load(unpadded_ptr).to(tl.int64)
        if has_layout:
            gathered = tl.load(layout_ptr + layout_stride).to(tl.int64) > 1
            unpadded = tl.where(gathered, num_tokens, unpadded)
        return unpadded

    @triton.jit(do_not_specialize=["num_tokens"])
    def _count_kernel(
        ids_ptr,
        experts_ptr,
        unpadded_ptr,
        layout_ptr,
        layout_stride,
        counts_ptr,
        row_ptr,
        rank_ptr,
        hist_ptr,
        num_tokens,
        top_k,
        num_experts,
        num_rows,
        ids_stride_t,
        ids_stride_k,
        has_layout: tl.constexpr,
        block_t: tl.constexpr,
        block_k: tl.constexpr,
        block_x: tl.constexpr,
    ):
        block = tl.program_id(0).to(tl.int64)
        token = block * block_t + tl.arange(0, block_t).to(tl.int64)
        column = tl.arange(0, block_k).to(tl.int64)
        token_2d = token[:, None]
        column_2d = column[None, :]
        in_range = (token_2d < num_tokens) & (column_2d < top_k)
        expert = tl.load(
            ids_ptr + token_2d * ids_stride_t + column_2d * ids_stride_k, mask=in_range, other=-1
        ).to(tl.int64)
        limit = _share_limit(unpadded_ptr, layout_ptr, layout_stride, num_tokens, has_layout)
        takes = in_range & (expert >= 0) & (expert < num_experts) & (token_2d < limit)
        tl.atomic_add(
            counts_ptr + expert, tl.full((block_t, block_k), 1, tl.int64), mask=takes, sem="relaxed"
        )
        # The row x of split_experts holding the expert (num_rows: none, or no share).
        selections: tl.constexpr = block_t * block_k
        flat = tl.reshape(expert, (selections,))
        flat_takes = tl.reshape(takes, (selections,))
        xs = tl.arange(0, block_x).to(tl.int64)
        listed = tl.load(experts_ptr + xs, mask=xs < num_rows, other=-1).to(tl.int64)
        hit = (flat[:, None] == listed[None, :]) & (listed[None, :] >= 0) & flat_takes[:, None]
        row = tl.where(
            tl.max(hit.to(tl.int32), axis=1) > 0, tl.sum(tl.where(hit, xs[None, :], 0), axis=1), num_rows
        )
        # Occurrence rank within the block, in row order (the flat index).
        index = tl.arange(0, selections)
        earlier = (row[:, None] == row[None, :]) & (index[None, :] < index[:, None])
        rank = tl.sum(earlier.to(tl.int64), axis=1)
        out = tl.reshape(token_2d * top_k + column_2d, (selections,))
        flat_in = tl.reshape(in_range, (selections,))
        tl.store(row_ptr + out, row.to(tl.int32), mask=flat_in)
        tl.store(rank_ptr + out, rank.to(tl.int32), mask=flat_in)
        per_row = tl.sum((row[:, None] == xs[None, :]).to(tl.int64), axis=0)
        tl.store(hist_ptr + block * num_rows + xs, per_row, mask=xs < num_rows)

    @triton.jit
    def _waterfill(level, amount, block_m: tl.constexpr):
        prefix = tl.cumsum(tl.sort(level, dim=1), axis=1)
        k = tl.arange(0, block_m).to(tl.int64)[None, :] + 1
        top = tl.min((amount[:, None] + prefix) // k, axis=1)[:, None]
        base = tl.maximum(top - level, 0)
        below = level <= top
        rest = (amount - tl.sum(base, axis=1))[:, None]
        return base + (below & (tl.cumsum(below.to(tl.int64), axis=1) <= rest)).to(tl.int64)

    @triton.jit
    def _solve_kernel(
        counts_ptr,
        slots_ptr,
        slot_rank_ptr,
        experts_ptr,
        ends_ptr,
        base_ptr,
        load_ptr,
        movers_ptr,
        num_experts,
        width,
        num_rows,
        num_slots,
        steps,
        scale: tl.constexpr,
        pad_level: tl.constexpr,
        block_e: tl.constexpr,
        block_p: tl.constexpr,
        block_x: tl.constexpr,
        block_m: tl.constexpr,
    ):
        slot_index = tl.arange(0, block_p).to(tl.int64)
        for first in range(0, num_slots, block_p):
            tl.store(
                base_ptr + first + slot_index,
                tl.zeros((block_p,), tl.int64),
                mask=first + slot_index < num_slots,
            )
        tl.debug_barrier()
        # Experts with one replica: their selections are fixed load on their slot's rank.
        expert_index = tl.arange(0, block_e).to(tl.int64)
        for first in range(0, num_experts, block_e):
            e = first + expert_index
            inside = e < num_experts
            slot0 = tl.load(slots_ptr + e * width, mask=inside, other=0).to(tl.int64)
            # One replica: no second column, or -1 there (a masked load reads -1).
            # (A block mask: a scalar ANDed in makes an int32 mask that Triton's interpreter rejects.)
            second = inside & (e * 0 + width > 1)
            single = tl.load(slots_ptr + e * width + 1, mask=second, other=-1) < 0
            count = tl.load(counts_ptr + e, mask=inside, other=0).to(tl.int64)
            rank0 = tl.load(slot_rank_ptr + slot0, mask=inside, other=0).to(tl.int64)
            tl.atomic_add(base_ptr + rank0, count * scale, mask=inside & single, sem="relaxed")
        xs = tl.arange(0, block_x).to(tl.int64)
        ms = tl.arange(0, block_m).to(tl.int64)
        expert = tl.load(experts_ptr + xs, mask=xs < num_rows, other=-1).to(tl.int64)
        listed = expert >= 0
        row_expert = tl.maximum(expert, 0)
        in_row = listed[:, None] & (ms[None, :] < width)
        slot = tl.load(slots_ptr + row_expert[:, None] * width + ms[None, :], mask=in_row, other=-1).to(
            tl.int64
        )
        valid = slot >= 0
        ranks = tl.load(slot_rank_ptr + tl.maximum(slot, 0), mask=valid, other=0).to(tl.int64)
        pad = tl.where(valid, 0, pad_level)
        amount = tl.load(counts_ptr + row_expert, mask=listed, other=0).to(tl.int64) * scale
        num = tl.maximum(tl.sum(valid.to(tl.int64), axis=1), 1)
        shares = tl.where(
            valid, (amount // num)[:, None] + (ms[None, :] < (amount % num)[:, None]).to(tl.int64), 0
        )
        for _ in range(steps):
            tl.debug_barrier()
            for first in range(0, num_slots, block_p):
                inside = first + slot_index < num_slots
                tl.store(
                    load_ptr + first + slot_index,
                    tl.load(base_ptr + first + slot_index, mask=inside),
                    mask=inside,
                )
                tl.store(movers_ptr + first + slot_index, tl.zeros((block_p,), tl.int64), mask=inside)
            tl.debug_barrier()
            tl.atomic_add(load_ptr + ranks, shares, mask=valid, sem="relaxed")
            tl.debug_barrier()
            others = tl.load(load_ptr + ranks, mask=valid, other=0) - shares + pad
            delta = _waterfill(others, amount, block_m) - shares
            falling = delta < 0
            tl.atomic_add(movers_ptr + ranks, falling.to(tl.int64), mask=valid, sem="relaxed")
            tl.debug_barrier()
            per = tl.maximum(tl.load(movers_ptr + ranks, mask=valid, other=0), 1)
            taken = (tl.maximum(-delta, 0) + per - 1) // per
            rising = tl.maximum(delta, 0)
            before = tl.cumsum(rising, axis=1) - rising
            given = tl.minimum(rising, tl.maximum(tl.sum(taken, axis=1)[:, None] - before, 0))
            shares = shares - taken + given
        ends = (tl.cumsum(shares, axis=1) + scale // 2) // scale
        ends = tl.where(listed[:, None], ends, 0)
        tl.store(
            ends_ptr + xs[:, None] * width + ms[None, :],
            ends,
            mask=(xs[:, None] < num_rows) & (ms[None, :] < width),
        )

    @triton.jit(do_not_specialize=["num_tokens"])
    def _assign_kernel(
        ids_ptr,
        table_ptr,
        slots_ptr,
        ends_ptr,
        row_ptr,
        rank_ptr,
        before_ptr,
        prefix_ptr,
        out_ptr,
        load_ptr,
        record_ptr,
        unpadded_ptr,
        layout_ptr,
        layout_stride,
        num_tokens,
        top_k,
        rows,
        num_experts,
        width,
        num_rows,
        num_load,
        ids_stride_t,
        ids_stride_k,
        table_stride_row,
        table_stride_expert,
        load_stride,
        has_layout: tl.constexpr,
        has_prefix: tl.constexpr,
        block_t: tl.constexpr,
        block_k: tl.constexpr,
    ):
        block = tl.program_id(0).to(tl.int64)
        token = block * block_t + tl.arange(0, block_t).to(tl.int64)
        column = tl.arange(0, block_k).to(tl.int64)
        token_2d = token[:, None]
        column_2d = column[None, :]
        in_range = (token_2d < num_tokens) & (column_2d < top_k)
        expert = tl.load(
            ids_ptr + token_2d * ids_stride_t + column_2d * ids_stride_k, mask=in_range, other=-1
        ).to(tl.int64)
        valid = in_range & (expert >= 0) & (expert < num_experts)
        where = token_2d * top_k + column_2d
        row = tl.load(row_ptr + where, mask=in_range, other=0).to(tl.int64)
        shared = in_range & (row < num_rows)
        rank = tl.load(rank_ptr + where, mask=shared, other=0).to(tl.int64)
        rank += tl.load(before_ptr + block * num_rows + row, mask=shared, other=0)
        if has_prefix:
            rank += tl.load(prefix_ptr + expert, mask=shared, other=0).to(tl.int64)
        replica = tl.zeros((block_t, block_k), tl.int64)
        last = tl.zeros((block_t, block_k), tl.int64) - 1
        for m in range(0, width):
            end = tl.load(ends_ptr + row * width + m, mask=shared, other=0)
            replica += (end <= rank).to(tl.int64)
            last += (tl.load(slots_ptr + expert * width + m, mask=shared, other=-1) >= 0).to(tl.int64)
        replica = tl.maximum(tl.minimum(replica, last), 0)
        chosen = tl.load(slots_ptr + expert * width + replica, mask=shared, other=-1).to(tl.int64)
        if has_layout:  # noqa: SIM108 (a constexpr branch of the Triton kernel)
            offset = tl.load(layout_ptr).to(tl.int64)
        else:
            offset = 0
        table_row = (((token + offset) % rows + rows) % rows)[:, None]
        equal = tl.load(
            table_ptr + table_row * table_stride_row + expert * table_stride_expert, mask=valid, other=-1
        ).to(tl.int64)
        physical = tl.where(shared, chosen, equal)
        tl.store(out_ptr + where, physical.to(out_ptr.dtype.element_ty), mask=in_range)
        # Recording: the map-and-record kernel's rows (the flag and a negative slice fold into the limit).
        unpadded = tl.load(unpadded_ptr).to(tl.int64)
        if has_layout:
            num_slices = tl.maximum(tl.load(layout_ptr + layout_stride).to(tl.int64), 1)
            recording_slice = tl.load(layout_ptr + 2 * layout_stride).to(tl.int64)
            size = num_tokens // num_slices
            first = recording_slice * size
            real = tl.maximum(unpadded - tl.load(layout_ptr + 3 * layout_stride).to(tl.int64) * size, 0)
            limit = first + tl.minimum(real, size)
            limit = tl.where(recording_slice >= 0, limit, first)
        else:
            first = 0
            limit = unpadded
        limit = tl.where(tl.load(record_ptr) != 0, limit, first)
        counted = valid & (token_2d >= first) & (token_2d < limit) & (physical >= 0) & (physical < num_load)
        ones = tl.full((block_t, block_k), 1, dtype=load_ptr.dtype.element_ty)
        tl.atomic_add(load_ptr + physical * load_stride, ones, mask=counted, sem="relaxed")


def launch(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    replica_slots: torch.Tensor,
    slot_rank: torch.Tensor,
    split_experts: torch.Tensor,
    expert_load_view: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
    row_layout: torch.Tensor | None,
    global_counts: torch.Tensor | None,
    rank_prefix: torch.Tensor | None,
    steps: int,
    scale: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the three kernels on checked arguments: ``(ids (T, K), counts (E,) int64, ends (X, M) int64)``,
    ``counts`` the solve's (``global_counts`` when given). Requires :data:`HAS_TRITON`."""
    if triton is None:
        raise RuntimeError("the Triton kernel needs the optional extra ascend-eplb-dataplane[triton]")
    num_tokens, top_k = topk_ids.shape
    rows, num_experts = table.shape
    width = replica_slots.shape[1]
    num_rows = split_experts.shape[0]
    num_slots = slot_rank.shape[0]
    device = topk_ids.device
    out = torch.empty((num_tokens, top_k), dtype=topk_ids.dtype, device=device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    ends = torch.empty((num_rows, width), dtype=torch.int64, device=device)
    block_k = triton.next_power_of_2(max(top_k, 1))
    block_t = max(1, _SELECTIONS_PER_PROGRAM // block_k)
    num_blocks = triton.cdiv(num_tokens, block_t)
    block_x = triton.next_power_of_2(num_rows + 1)
    has_layout = row_layout is not None
    layout, layout_stride = (row_layout, row_layout.stride(0)) if has_layout else (num_unpadded_tokens, 0)
    row = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    rank = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    hist = torch.zeros((max(num_blocks, 1), num_rows), dtype=torch.int64, device=device)
    if out.numel():
        _count_kernel[(num_blocks,)](
            topk_ids,
            split_experts,
            num_unpadded_tokens,
            layout,
            layout_stride,
            counts,
            row,
            rank,
            hist,
            num_tokens,
            top_k,
            num_experts,
            num_rows,
            topk_ids.stride(0),
            topk_ids.stride(1),
            has_layout=has_layout,
            block_t=block_t,
            block_k=block_k,
            block_x=block_x,
        )
    solved = counts if global_counts is None else global_counts
    scratch = torch.empty((3, num_slots), dtype=torch.int64, device=device)
    _solve_kernel[(1,)](
        solved,
        replica_slots,
        slot_rank,
        split_experts,
        ends,
        scratch[0],
        scratch[1],
        scratch[2],
        num_experts,
        width,
        num_rows,
        num_slots,
        steps,
        scale=scale,
        pad_level=_PAD_LEVEL,
        block_e=min(triton.next_power_of_2(num_experts), 1024),
        block_p=min(triton.next_power_of_2(num_slots), 1024),
        block_x=triton.next_power_of_2(num_rows),
        block_m=triton.next_power_of_2(width),
    )
    if out.numel() == 0:
        return out, solved.to(torch.int64), ends
    before = hist.cumsum(0) - hist
    record = (expert_load_view, expert_load_view.stride(0))
    prefix = rank_prefix if rank_prefix is not None else counts
    _assign_kernel[(num_blocks,)](
        topk_ids,
        table,
        replica_slots,
        ends,
        row,
        rank,
        before,
        prefix,
        out,
        record[0],
        record_enabled,
        num_unpadded_tokens,
        layout,
        layout_stride,
        num_tokens,
        top_k,
        rows,
        num_experts,
        width,
        num_rows,
        expert_load_view.shape[0],
        topk_ids.stride(0),
        topk_ids.stride(1),
        table.stride(0),
        table.stride(1),
        record[1],
        has_layout=has_layout,
        has_prefix=rank_prefix is not None,
        block_t=block_t,
        block_k=block_k,
    )
    return out, solved.to(torch.int64), ends

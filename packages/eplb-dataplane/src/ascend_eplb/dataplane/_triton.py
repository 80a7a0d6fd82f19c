"""The Triton kernel of the map-and-record ops: range check, gather, ``-1`` fill and count in one launch.

``triton`` is the optional extra ``[triton]`` (triton-ascend provides the module on Ascend); without it
:data:`HAS_TRITON` is false, nothing else is defined, and the ops keep their torch form. One program
handles ``block_t`` tokens times ``K`` padded to a power of two; the record flag, unpadded count and row
layout are read on the device, counts added with ``tl.atomic_add``; offsets are int64. Semantics are the
torch form's (:mod:`ascend_eplb.dataplane.ops`, bit-identical ids and counts in tests).
``TRITON_INTERPRET=1`` set before the first import runs the kernel on CPU tensors (``triton.jit`` reads it
at import).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the optional extra is not installed: the torch form serves every device
    triton = None
    tl = None

HAS_TRITON = triton is not None
#: ``triton.__version__``, or ``None`` without triton.
TRITON_VERSION: str | None = triton.__version__ if triton is not None else None

__all__ = ["HAS_TRITON", "TRITON_VERSION", "launch"]

# Selections per program: block_t * block_k = _ELEMENTS_PER_PROGRAM (K <= _ELEMENTS_PER_PROGRAM).
_ELEMENTS_PER_PROGRAM = 1024

if triton is not None:

    @triton.jit(do_not_specialize=["num_tokens"])
    def _map_and_record_kernel(
        ids_ptr,
        table_ptr,
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
        num_load,
        ids_stride_t,
        ids_stride_k,
        table_stride_row,
        table_stride_expert,
        load_stride,
        record_counts: tl.constexpr,
        has_layout: tl.constexpr,
        block_t: tl.constexpr,
        block_k: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64) * block_t + tl.arange(0, block_t).to(tl.int64)
        column = tl.arange(0, block_k).to(tl.int64)
        token_2d = token[:, None]
        column_2d = column[None, :]
        in_range = (token_2d < num_tokens) & (column_2d < top_k)
        expert = tl.load(
            ids_ptr + token_2d * ids_stride_t + column_2d * ids_stride_k, mask=in_range, other=-1
        ).to(tl.int64)
        valid = in_range & (expert >= 0) & (expert < num_experts)
        if has_layout:  # noqa: SIM108 (a constexpr branch of the Triton kernel)
            offset = tl.load(layout_ptr).to(tl.int64)
        else:
            offset = 0
        # Python's modulo (never negative), as torch.remainder in the torch form.
        row = (((token + offset) % rows + rows) % rows)[:, None]
        physical = tl.load(
            table_ptr + row * table_stride_row + expert * table_stride_expert, mask=valid, other=-1
        ).to(tl.int64)
        tl.store(out_ptr + token_2d * top_k + column_2d, physical.to(out_ptr.dtype.element_ty), mask=in_range)
        if record_counts:
            # The record flag folds into the row limit (a scalar select), not the block mask: ANDed there
            # it made an int32 mask that Triton 3.9's interpreter rejects in atomic_add.
            unpadded = tl.load(unpadded_ptr).to(tl.int64)
            if has_layout:
                num_slices = tl.maximum(tl.load(layout_ptr + layout_stride).to(tl.int64), 1)
                recording_slice = tl.load(layout_ptr + 2 * layout_stride).to(tl.int64)
                size = num_tokens // num_slices
                first = recording_slice * size
                real = tl.maximum(unpadded - tl.load(layout_ptr + 3 * layout_stride).to(tl.int64) * size, 0)
                limit = first + tl.minimum(real, size)
                # A negative slice records nothing: an empty range, folded into the limit as the flag is.
                limit = tl.where(recording_slice >= 0, limit, first)
            else:
                first = 0
                limit = unpadded
            limit = tl.where(tl.load(record_ptr) != 0, limit, first)
            counted = (
                valid & (token_2d >= first) & (token_2d < limit) & (physical >= 0) & (physical < num_load)
            )
            ones = tl.full((block_t, block_k), 1, dtype=load_ptr.dtype.element_ty)
            tl.atomic_add(load_ptr + physical * load_stride, ones, mask=counted, sem="relaxed")


def launch(
    topk_ids: torch.Tensor,
    table: torch.Tensor,
    expert_load_view: torch.Tensor | None,
    record_enabled: torch.Tensor | None,
    num_unpadded_tokens: torch.Tensor | None,
    row_layout: torch.Tensor | None,
) -> torch.Tensor:
    """Run the kernel on arguments the ops have already checked; returns the new ``(T, K)`` ids.

    ``expert_load_view``, ``record_enabled`` and ``num_unpadded_tokens`` all ``None``: map only
    (``map_to_physical``). ``row_layout`` ``None``: offset 0, the first ``num_unpadded_tokens`` rows
    recorded. Requires :data:`HAS_TRITON`.
    """
    if triton is None:
        raise RuntimeError("the Triton kernel needs the optional extra ascend-eplb-dataplane[triton]")
    num_tokens, top_k = topk_ids.shape
    rows, num_experts = table.shape
    out = torch.empty((num_tokens, top_k), dtype=topk_ids.dtype, device=topk_ids.device)
    if out.numel() == 0:
        return out  # nothing to map or count: no launch (a zero-size grid is not a valid launch)
    record = expert_load_view is not None
    if record:
        load, flag, unpadded = expert_load_view, record_enabled, num_unpadded_tokens
        num_load, load_stride = expert_load_view.shape[0], expert_load_view.stride(0)
    else:  # never read: record_counts is a compile-time false
        load, flag, unpadded, num_load, load_stride = out, out, out, 0, 0
    has_layout = row_layout is not None
    layout, layout_stride = (row_layout, row_layout.stride(0)) if has_layout else (out, 0)
    block_k = triton.next_power_of_2(top_k)
    block_t = max(1, _ELEMENTS_PER_PROGRAM // block_k)
    grid = (triton.cdiv(num_tokens, block_t),)
    _map_and_record_kernel[grid](
        topk_ids,
        table,
        out,
        load,
        flag,
        unpadded,
        layout,
        layout_stride,
        num_tokens,
        top_k,
        rows,
        num_experts,
        num_load,
        topk_ids.stride(0),
        topk_ids.stride(1),
        table.stride(0),
        table.stride(1),
        load_stride,
        record_counts=record,
        has_layout=has_layout,
        block_t=block_t,
        block_k=block_k,
    )
    return out

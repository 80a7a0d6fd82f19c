"""The pieces of the batched reference kernel behind `ExpertWeightFormat.apply`; it imports no format.

`Selection` sorts a call's (token, k) selections by local row, stably (the per-expert loop's order), so
each present row's selections form one segment; `grouped_mm` multiplies each segment by its row's
weights. Results are bit-identical to `per_expert.per_expert_apply` (tested; README "Reference kernel
speed"). ``selections``: the (token, k) pairs routed to a local row; ``rows``: the distinct local rows
present (at most p); ``in_features`` / ``out_features``: a GEMM's reduction / output dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["INT4_X_INT4", "INT8_X_INT8", "Selection", "grouped_mm"]

#: ``|a * w|`` bounds of the integer GEMMs: int8 activations (|q| <= 127) times int8 / int4 weights.
INT8_X_INT8 = 127 * 128
INT4_X_INT4 = 8 * 8


@dataclass(frozen=True)
class Selection:
    """The (token, k) selections of one `ExpertWeightFormat.apply` call routed to a local row.

    Sorted by local row, then by flat index ``t * K + k`` (the order of the per-expert loop), so each
    present row's selections form one contiguous segment.

    Attributes:
        token: int64 (selections,) token of each selection.
        weight: float64 (selections,) its top-k weight.
        group: int64 (selections,) index into ``rows`` of its local row.
        rows: int64 (num_rows,) the distinct local rows present, ascending.
        rows_list: ``rows`` as Python ints.
        counts: selections per present row (num_rows ints), the segment lengths.
    """

    token: torch.Tensor
    weight: torch.Tensor
    group: torch.Tensor
    rows: torch.Tensor
    rows_list: list[int]
    counts: list[int]

    @staticmethod
    def of(local_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> Selection | None:  # noqa: N803
        """The selections of ``local_ids_TK`` (T, K) with ids >= 0; None when there are none."""
        flat = local_ids_TK.reshape(-1).to(torch.int64)
        chosen = (flat >= 0).nonzero().squeeze(1)  # ascending flat index
        if chosen.numel() == 0:
            return None
        row_sorted, perm = torch.sort(flat[chosen], stable=True)
        order = chosen[perm]
        rows, counts = torch.unique_consecutive(row_sorted, return_counts=True)
        count_list = counts.tolist()
        return Selection(
            token=order // local_ids_TK.shape[1],
            weight=topk_weights_TK.reshape(-1)[order].to(torch.float64),
            group=torch.repeat_interleave(torch.arange(len(count_list), device=flat.device), counts),
            rows=rows,
            rows_list=rows.tolist(),
            counts=count_list,
        )

    def split(self, max_rows: int) -> list[Selection]:
        """Consecutive sub-selections of at most ``max_rows`` present rows each (order kept)."""
        if len(self.counts) <= max_rows:
            return [self]
        parts, start = [], 0
        for first in range(0, len(self.counts), max_rows):
            counts = self.counts[first : first + max_rows]
            stop = start + sum(counts)
            parts.append(
                Selection(
                    token=self.token[start:stop],
                    weight=self.weight[start:stop],
                    group=self.group[start:stop] - first,
                    rows=self.rows[first : first + max_rows],
                    rows_list=self.rows_list[first : first + max_rows],
                    counts=counts,
                )
            )
            start = stop
        return parts


def grouped_mm(
    a: torch.Tensor, w: torch.Tensor, sel: Selection, *, int_bound: int | None = None
) -> torch.Tensor:
    """Segment-wise ``a[segment] @ w[row]``, one segment of ``sel`` per present row.

    ``a`` (selections, in_features) in ``sel`` order, ``w`` (rows, in_features, out_features); returns
    float64 (selections, out_features), in ``sel`` order.

    Float operands (``int_bound=None``, float64): one ``torch.mm`` per present row, the per-expert
    GEMM (BLAS rounding depends on the row count, so no padded batch). Integer-valued operands
    (``int_bound`` bounds ``|a_ij * w_jn|``): one exact ``torch.bmm`` over zero-padded segments, in
    float32 when ``in_features * int_bound <= 2**24``, else float64.

    Raises:
        ValueError: ``in_features * int_bound > 2**53`` (no exact float GEMM exists).
    """
    num_rows = len(sel.counts)
    if int_bound is None:
        out = a.new_empty(a.shape[0], w.shape[2])
        start = 0
        for g, n in enumerate(sel.counts):
            torch.mm(a[start : start + n], w[g], out=out[start : start + n])
            start += n
        return out
    in_features = a.shape[1]
    if in_features * int_bound > 2**53:
        raise ValueError(
            f"integer GEMM with in_features={in_features} and |a*w| <= {int_bound} is not exact in float64"
        )
    dtype = torch.float32 if in_features * int_bound <= 2**24 else torch.float64
    a, w = a.to(dtype), w.to(dtype)
    if num_rows == 1:
        return torch.mm(a, w[0]).to(torch.float64)
    starts = torch.cumsum(torch.tensor([0, *sel.counts[:-1]], device=a.device), 0)
    pos = torch.arange(a.shape[0], device=a.device) - starts[sel.group]
    padded = a.new_zeros(num_rows, max(sel.counts), in_features)
    padded[sel.group, pos] = a
    return torch.bmm(padded, w)[sel.group, pos].to(torch.float64)

"""The per-expert reference kernel: the plainly readable form of `ExpertWeightFormat.apply`.

One Python iteration per local row (the format's ``_forward_expert``); `apply` computes the same batched,
bit for bit (tested; timed by ``benchmarks/bench_apply.py``). A test and benchmark helper, not in ``__all__``.
"""

from __future__ import annotations

import torch

from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views.formats.base import ExpertWeightFormat, check_apply_inputs

__all__ = ["per_expert_apply"]


def per_expert_apply(
    fmt: ExpertWeightFormat,
    storage: ExpertStorage,
    hidden_TH: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
    topk_weights_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
    local_ids_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
    *,
    comm_path: str = "standard",
) -> torch.Tensor:
    """``fmt.apply(storage, hidden_TH, topk_weights_TK, local_ids_TK, comm_path=...)``, one expert at a time.

    Same arguments, checks, ``ValueError`` and ``(T, H)`` result as `ExpertWeightFormat.apply`.
    """
    fmt._check_storage(storage)
    check_apply_inputs(storage, hidden_TH, topk_weights_TK, local_ids_TK)
    fused = fmt._fused_scales_path(storage, comm_path)
    x = hidden_TH.to(torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    ids = local_ids_TK.to(torch.int64)
    for row in range(storage.num_local_experts):
        tokens, ks = (ids == row).nonzero(as_tuple=True)  # in flat (t, k) order
        if tokens.numel() == 0:
            continue
        y = fmt._forward_expert(storage, row, x[tokens], fused)
        out.index_add_(0, tokens, y * topk_weights_TK[tokens, ks].to(torch.float64).unsqueeze(1))
    return out.to(hidden_TH.dtype)

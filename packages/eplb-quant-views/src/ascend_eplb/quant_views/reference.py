"""Deterministic expert weights, a float64 fused-MoE reference and the quantization-error measure.

Used by this package's tests and benchmark and by the EPLB simulator (slot fingerprints after commits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views.formats import ExpertWeightFormat
from ascend_eplb.quant_views.registry import get_format

__all__ = [
    "LAYER_SEED_STRIDE",
    "SEED_STRIDE",
    "build_expert_storage",
    "expert_seed",
    "quantization_error",
    "reference_expert_weights",
    "reference_moe",
]

#: Strides of the weight seed scheme (`expert_seed`): the seed's, a prime, so a seed and an expert id
#: below it never collide; and the MoE layer's, for weights that differ per layer.
SEED_STRIDE = 1_000_003
LAYER_SEED_STRIDE = 1009


def expert_seed(seed: int, expert: int, *, layer: int = 0) -> int:
    """``seed * 1_000_003 + layer * 1009 + expert``: the project's one weight seed scheme, per MoE layer.

    Distinct for every expert below 1_000_003 at layer 0, and for every ``(layer, expert)`` with
    ``expert < 1009`` and ``layer < 991``. A Python int: the caller keeps it within torch's seed range.
    """
    return seed * SEED_STRIDE + layer * LAYER_SEED_STRIDE + expert


def reference_expert_weights(
    logical_expert_ids: Sequence[int],
    hidden_size: int,
    intermediate_size: int,
    *,
    seed: int = 0,
    with_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Float32 checkpoint-layout weights, one row per entry of ``logical_expert_ids`` (CPU).

    A generator seeded with ``expert_seed(seed, e)`` draws ``w13 (2I, H) ~ N(0, 1/H)``, ``w2 (H, I) ~
    N(0, 1/I)`` and, with ``with_bias``, biases ``~ N(0, 0.01)``: an expert id gives bit-identical rows
    in any slot, on any rank.

    Returns:
        ``(w13 (n, 2I, H), w2 (n, H, I), w13_bias (n, 2I) | None, w2_bias (n, H) | None)``,
        n = ``len(logical_expert_ids)``.

    Raises:
        ValueError: an id outside ``[0, 1_000_003)``, non-positive sizes, an empty id list.
    """
    ids = [int(e) for e in logical_expert_ids]
    if not ids:
        raise ValueError("logical_expert_ids is empty")
    if hidden_size < 1 or intermediate_size < 1:
        raise ValueError(f"hidden_size={hidden_size} and intermediate_size={intermediate_size} must be >= 1")
    bad = [e for e in ids if not 0 <= e < SEED_STRIDE]
    if bad:
        raise ValueError(f"logical expert ids must be in [0, {SEED_STRIDE}), got {bad[:5]}")
    h, i = hidden_size, intermediate_size
    w13, w2, b13, b2 = [], [], [], []
    for e in ids:
        g = torch.Generator().manual_seed(expert_seed(seed, e))
        w13.append(torch.randn(2 * i, h, generator=g) / h**0.5)
        w2.append(torch.randn(h, i, generator=g) / i**0.5)
        if with_bias:
            b13.append(torch.randn(2 * i, generator=g) * 0.1)
            b2.append(torch.randn(h, generator=g) * 0.1)
    return (
        torch.stack(w13),
        torch.stack(w2),
        torch.stack(b13) if with_bias else None,
        torch.stack(b2) if with_bias else None,
    )


def build_expert_storage(
    fmt: ExpertWeightFormat | str,
    logical_expert_ids: Sequence[int],
    hidden_size: int,
    intermediate_size: int,
    *,
    seed: int = 0,
    per_expert_lists: bool = False,
    with_bias: bool = False,
    device: torch.device | str = "cpu",
    **options: Any,
) -> ExpertStorage:
    """Storage whose row ``r`` holds logical expert ``logical_expert_ids[r]`` (`reference_expert_weights`).

    ``with_bias`` adds ``w13_bias``/``w2_bias`` (``bf16``/``fp16`` only); ``options`` go to
    `ExpertWeightFormat.create_storage` (e.g. ``fused_scales=True``). Example: slots of a rank holding
    logical experts ``[3, 0, 3]``: ``build_expert_storage("w8a8_dynamic", [3, 0, 3], 128, 64)``; rows 0 and
    2 then have equal `expert_fingerprint` s, equal to row 0 of ``build_expert_storage(..., [3], ...)``.
    """
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    w13, w2, b13, b2 = reference_expert_weights(
        logical_expert_ids, hidden_size, intermediate_size, seed=seed, with_bias=with_bias
    )
    if with_bias:
        options = {**options, "w13_bias": b13.to(device), "w2_bias": b2.to(device)}
    return f.create_storage(w13.to(device), w2.to(device), per_expert_lists=per_expert_lists, **options)


def reference_moe(
    w13: torch.Tensor,
    w2: torch.Tensor,
    hidden_TH: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
    topk_weights_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
    local_ids_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 fused MoE on checkpoint-layout weights ``w13 (p, 2I, H)``, ``w2 (p, H, I)``.

    ``out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(gate) * up)``, ``gate, up = split(w13[e] @ x_t)``,
    ``e = local_ids[t, k]``, ``-1`` skipped. Returns float64 ``(T, H)``.
    """
    inter = w2.shape[2]
    x = hidden_TH.to(torch.float64)
    out = torch.zeros_like(x)
    ids = local_ids_TK.to(torch.int64)
    for e in range(w13.shape[0]):
        tok, kk = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].to(torch.float64).T
        if w13_bias is not None:
            h = h + w13_bias[e].to(torch.float64)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = a @ w2[e].to(torch.float64).T
        if w2_bias is not None:
            y = y + w2_bias[e].to(torch.float64)
        out.index_add_(0, tok, y * topk_weights_TK[tok, kk].to(torch.float64).unsqueeze(1))
    return out


def quantization_error(
    fmt: ExpertWeightFormat | str,
    *,
    num_experts: int = 8,
    hidden_size: int = 256,
    intermediate_size: int = 128,
    num_tokens: int = 64,
    top_k: int = 2,
    seed: int = 0,
    per_expert_lists: bool = False,
    hidden_dtype: torch.dtype = torch.float32,
) -> float:
    """Relative Frobenius error ``||apply - reference_moe|| / ||reference_moe||`` on random weights.

    Weights from `reference_expert_weights` (experts ``0..num_experts-1``), hidden ``N(0, 1)``, top-k
    distinct experts per token uniformly at random, softmax routing weights; all from ``seed``. The
    reference runs in float64 on the unquantized float32 weights and the same hidden states.
    """
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    g = torch.Generator().manual_seed(seed)
    ids = list(range(num_experts))
    w13, w2, _, _ = reference_expert_weights(ids, hidden_size, intermediate_size, seed=seed)
    storage = f.create_storage(w13, w2, per_expert_lists=per_expert_lists)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(hidden_dtype)
    local_ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=-1)
    out = f.apply(storage, hidden, weights, local_ids).to(torch.float64)
    ref = reference_moe(w13, w2, hidden, weights, local_ids)
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))

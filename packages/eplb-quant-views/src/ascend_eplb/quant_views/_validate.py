"""`validate_weight_views`: the weight-view contract upstream EPLB movement relies on."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ascend_eplb.quant_views._tensor_list import ExpertTensorList

__all__ = ["BOTH_OR_NEITHER", "is_int", "validate_weight_views"]

BOTH_OR_NEITHER: tuple[tuple[str, str], ...] = (
    ("fused_w1_scale", "fused_w2_scale"),
    ("w13_scale_bias", "w2_scale_bias"),
)
"""Pairs of per-expert tensors that exist together or not at all (vllm-ascend ``w8a8_dynamic.py`` /
``w4a8.py`` ``get_eplb_weight_views``: "must be present or absent together")."""


def is_int(value: object) -> bool:
    """Whether ``value`` is a ``numbers.Integral`` (numpy integers included) and not a ``bool``.

    Each of quant_views, dataplane, movement and control keeps one copy (no package all four may
    import); ``tests/test_one_home.py`` checks that they agree.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _base(name: str) -> str:
    return name.removesuffix("_list")


def _label(index: int, names: Sequence[str] | None) -> str:
    if names is not None and index < len(names):
        return f"weight view {index} ({names[index]!r})"
    return f"weight view {index}"


def validate_weight_views(
    views: Sequence[torch.Tensor | ExpertTensorList],
    num_local_experts: int,
    *,
    names: Sequence[str] | None = None,
) -> None:
    """Check that ``views`` can be moved expert by expert by upstream EPLB without a copy.

    ``views``: `weight_views`' entries, each a stacked tensor of first dimension ``p`` or a list of
    ``p`` tensors; ``names``: their vllm-ascend names, for errors and the `BOTH_OR_NEITHER` pairs.
    Rules (vllm-ascend ``get_expert_weights``, fixes #13414/#16806): at least one view, ``p >= 1``; a
    stacked tensor is at least 1-D with ``shape[0] == p`` and contiguous non-overlapping expert rows
    (``view(p, -1)`` copies nothing); a list has exactly ``p`` contiguous tensors of one shape, dtype
    and device, none sharing memory (a shorter scale list is the #16806 crash); one device for all;
    with ``names``, no name twice and each pair complete or absent.

    Raises ``ValueError`` naming the first offending view (index and name) and the rule.
    """
    if not is_int(num_local_experts) or num_local_experts < 1:
        raise ValueError(f"num_local_experts must be a positive int, got {num_local_experts!r}")
    if not isinstance(views, Sequence) or isinstance(views, torch.Tensor | ExpertTensorList) or not views:
        raise ValueError(
            "weight views must be a non-empty list of per-expert tensors or tensor lists, "
            f"got {type(views).__name__}"
        )
    if names is not None and len(names) != len(views):
        raise ValueError(f"{len(names)} names given for {len(views)} weight views")
    p = num_local_experts
    devices: set[torch.device] = set()
    for index, view in enumerate(views):
        label = _label(index, names)
        if isinstance(view, torch.Tensor):
            if view.dim() < 1:
                raise ValueError(f"{label} is a 0-d tensor; expected an expert-first tensor (p={p}, ...)")
            if view.shape[0] != p:
                raise ValueError(
                    f"{label} has first dimension {view.shape[0]} (shape {tuple(view.shape)}); "
                    f"expected num_local_experts={p} expert rows"
                )
            row_numel = view[0].numel()
            if not view[0].is_contiguous():
                raise ValueError(
                    f"{label}: expert rows are not contiguous (shape {tuple(view.shape)}, stride "
                    f"{tuple(view.stride())}); a weight view must undo any transpose so each expert's "
                    "row is one contiguous block"
                )
            if p > 1 and row_numel > 0 and view.stride(0) < row_numel:
                raise ValueError(
                    f"{label}: expert rows overlap (stride(0)={view.stride(0)} < row size {row_numel}); "
                    "moving one expert would overwrite another"
                )
            devices.add(view.device)
        elif isinstance(view, list | tuple):
            if len(view) != p:
                raise ValueError(
                    f"{label} is a list of {len(view)} tensors; expected num_local_experts={p}, one per "
                    "expert like every other view (a shorter per-expert scale list breaks the grouped matmul)"
                )
            first = None
            ptrs: set[int] = set()
            for row, t in enumerate(view):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"{label}[{row}] is a {type(t).__name__}, expected a tensor")
                if not t.is_contiguous():
                    raise ValueError(
                        f"{label}[{row}] is not contiguous "
                        f"(shape {tuple(t.shape)}, stride {tuple(t.stride())})"
                    )
                if first is None:
                    first = t
                elif (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
                    raise ValueError(
                        f"{label}[{row}] has shape {tuple(t.shape)} {t.dtype} on {t.device}; "
                        f"element 0 has {tuple(first.shape)} {first.dtype} on {first.device}"
                    )
                if t.numel() > 0:
                    if t.data_ptr() in ptrs:
                        raise ValueError(f"{label}[{row}] shares memory with another expert of the same list")
                    ptrs.add(t.data_ptr())
                devices.add(t.device)
        else:
            raise ValueError(f"{label} is a {type(view).__name__}; expected a tensor or a list of tensors")
    if len(devices) > 1:
        raise ValueError(f"weight views are on several devices: {sorted(str(d) for d in devices)}")
    if names is not None:
        bases = [_base(n) for n in names]
        seen: set[str] = set()
        for n in bases:
            if n in seen:
                raise ValueError(f"weight view {n!r} appears twice")
            seen.add(n)
        for a, b in BOTH_OR_NEITHER:
            if (a in seen) != (b in seen):
                present, missing = (a, b) if a in seen else (b, a)
                raise ValueError(
                    f"weight view {present!r} is present but its pair {missing!r} is missing; "
                    "the two must be moved together (both or neither)"
                )

"""A FusedMoE layer's expert storage read from its parameters by their vllm-ascend names.

`layer_weight_views` is what a vllm-ascend quantization method's ``get_eplb_weight_views(layer)`` returns
to upstream's ``EplbState``: the layer's attributes (duck-typed, no vLLM import), checked against the
format's layout, viewed as `ExpertWeightFormat.weight_views` views them. A layer holds every kernel
tensor either stacked, attribute ``name`` ``(p, ...)``, or as a per-expert list, ``name + "_list"``
(vllm-ascend's NZ layout with EPLB); sizes come from ``local_num_experts`` (p), ``hidden_size`` (H) and
``intermediate_size_per_partition`` (I).
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views._tensor_list import ExpertTensorList
from ascend_eplb.quant_views._validate import BOTH_OR_NEITHER, is_int
from ascend_eplb.quant_views.formats.base import ExpertWeightFormat
from ascend_eplb.quant_views.registry import get_format

__all__ = ["layer_storage", "layer_view_names", "layer_weight_views"]

_SIZE_ATTRS = (("local_num_experts", "p"), ("hidden_size", "H"), ("intermediate_size_per_partition", "I"))
#: W8A8's optional fused scale pair (vllm-ascend's fused MC2 mode): both or neither.
_FUSED_SCALES = BOTH_OR_NEITHER[0]


def _resolve(fmt: ExpertWeightFormat | str) -> ExpertWeightFormat:
    return fmt if isinstance(fmt, ExpertWeightFormat) else get_format(fmt)


def _sizes(layer: Any) -> tuple[int, int, int]:
    out = []
    for attr, letter in _SIZE_ATTRS:
        value = getattr(layer, attr, None)
        if not is_int(value) or value < 1:
            raise ValueError(
                f"{type(layer).__name__}.{attr} ({letter}) must be a positive int, got {value!r} "
                "(a vLLM RoutedExperts layer sets it)"
            )
        out.append(value)
    return out[0], out[1], out[2]


def _read(layer: Any, name: str) -> tuple[Any, bool] | None:
    """``(tensor or list, is_list)`` of kernel tensor ``name`` on ``layer``; None when absent."""
    stacked = getattr(layer, name, None)
    listed = getattr(layer, name + "_list", None)
    if stacked is not None and listed is not None:
        raise ValueError(
            f"{type(layer).__name__} has both {name!r} and {name + '_list'!r}: a kernel tensor is stacked "
            "or per-expert lists, not both"
        )
    if listed is not None:
        if not isinstance(listed, (list, tuple)):
            raise ValueError(
                f"{type(layer).__name__}.{name}_list must be a list of tensors, got {type(listed).__name__}"
            )
        return ExpertTensorList(listed), True
    if stacked is not None:
        if not isinstance(stacked, torch.Tensor):
            raise ValueError(f"{type(layer).__name__}.{name} must be a tensor, got {type(stacked).__name__}")
        return stacked, False
    return None


def layer_storage(layer: Any, fmt: ExpertWeightFormat | str) -> ExpertStorage:
    """The `ExpertStorage` over ``layer``'s own kernel tensors of format ``fmt`` (no copy).

    ``layer``: a FusedMoE layer after ``process_weights_after_loading``; ``fmt``: a format or its name.
    Options follow what the layer holds (both ``fused_w*_scale``: ``fused_scales=True``; ``w13_bias`` /
    ``w2_bias``: biases); unread tensors (W8A8 offsets) are included when present. The kernel tensors are
    the layer's attributes themselves, so `expert_fingerprint` and `apply` read what its kernel reads.

    Raises:
        UnsupportedFormatError: ``fmt`` is a rejected or unknown format name.
        ValueError: a size attribute missing or not a positive int; one fused scale without the
            other; a kernel tensor of the format missing, held both stacked and as a list, in another
            mode than the others, or of another shape, dtype or memory layout (strides) than the
            format lays out for p, H, I (naming the attribute and both).
    """
    fmt = _resolve(fmt)
    p, hidden, inter = _sizes(layer)
    fmt.check_sizes(hidden, inter)
    opts: dict[str, Any] = dict(fmt._options)
    if "fused_scales" in opts:
        present = [n for n in _FUSED_SCALES if _read(layer, n) is not None]
        if len(present) == 1:
            (absent,) = set(_FUSED_SCALES) - set(present)
            raise ValueError(
                f"{type(layer).__name__} has {present[0]!r} but neither {absent!r} nor {absent + '_list'!r}: "
                f"the fused scales of format {fmt.name} are both or neither"
            )
        opts["fused_scales"] = bool(present)
    meta = torch.device("meta")
    for name, shape in (("w13_bias", (p, 2 * inter)), ("w2_bias", (p, hidden))):
        if name in opts and _read(layer, name) is not None:
            opts[name] = torch.empty(shape, device=meta)
    expected, expected_unread = fmt._meta_quantize(p, hidden, inter, opts)
    kernel: dict[str, Any] = {}
    modes: dict[str, bool] = {}
    for name, meta_t in expected.items():
        found = _read(layer, name)
        if found is None:
            raise ValueError(
                f"{type(layer).__name__} has neither {name!r} nor {name + '_list'!r}; format {fmt.name} "
                f"reads {list(expected)}"
            )
        t, is_list = found
        modes[name] = is_list
        _check_tensor(layer, fmt, name, t, is_list, meta_t, p)
        kernel[name] = t
    if len(set(modes.values())) > 1:
        listed = sorted(n for n, m in modes.items() if m)
        raise ValueError(
            f"{type(layer).__name__} mixes stacked and per-expert list kernel tensors (lists: {listed}); "
            f"format {fmt.name} needs one mode for {list(expected)}"
        )
    per_expert_lists = next(iter(modes.values()))
    unread = {}
    for name in expected_unread:
        found = _read(layer, name)
        if found is not None:
            unread[name] = found[0]
    return fmt._storage_record(kernel, unread, p, hidden, inter, per_expert_lists, opts)


def _check_tensor(
    layer: Any, fmt: ExpertWeightFormat, name: str, t: Any, is_list: bool, meta_t: torch.Tensor, p: int
) -> None:
    where = f"{type(layer).__name__}.{name}{'_list' if is_list else ''}"
    if not is_list:
        if tuple(t.shape) != tuple(meta_t.shape) or t.dtype != meta_t.dtype:
            raise ValueError(
                f"{where} must be {tuple(meta_t.shape)} {meta_t.dtype} for format {fmt.name}, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
        _check_layout(where, fmt, t, meta_t)
        return
    element = fmt._to_list(name, meta_t[:1])[0]
    if len(t) != p:
        raise ValueError(f"{where} must hold p={p} tensors (one per local expert), got {len(t)}")
    for row, r in enumerate(t):
        if (
            not isinstance(r, torch.Tensor)
            or tuple(r.shape) != tuple(element.shape)
            or r.dtype != element.dtype
        ):
            raise ValueError(
                f"{where}[{row}] must be {tuple(element.shape)} {element.dtype} for format {fmt.name}, "
                f"got {tuple(getattr(r, 'shape', ()))} {getattr(r, 'dtype', type(r).__name__)}"
            )
        _check_layout(f"{where}[{row}]", fmt, r, element)


def _check_layout(where: str, fmt: ExpertWeightFormat, t: torch.Tensor, meta_t: torch.Tensor) -> None:
    """Refuse a tensor whose strides differ from the format's layout (``meta_t``, laid out as
    ``process_weights_after_loading`` does) in a dimension of size > 1: the kernel reads that layout,
    and the expert-first views are taken over it."""
    differs = [d for d, size in enumerate(t.shape) if size > 1 and t.stride(d) != meta_t.stride(d)]
    if differs:
        raise ValueError(
            f"{where} must have the strides {tuple(meta_t.stride())} of format {fmt.name}'s kernel layout "
            f"(dimensions of size 1 aside), got {tuple(t.stride())}"
        )


def layer_weight_views(layer: Any, fmt: ExpertWeightFormat | str) -> list[torch.Tensor | ExpertTensorList]:
    """What a vllm-ascend quantization method's ``get_eplb_weight_views(layer)`` returns.

    ``fmt.weight_views(layer_storage(layer, fmt))``: the layer's kernel tensors expert-first over its
    own memory, in `layer_view_names` order. Raises as `layer_storage` and `validate_weight_views`.
    """
    fmt = _resolve(fmt)
    return fmt.weight_views(layer_storage(layer, fmt))


def layer_view_names(layer: Any, fmt: ExpertWeightFormat | str) -> list[str]:
    """The attribute names of `layer_weight_views` entries (``*_list`` in per-expert-list mode)."""
    fmt = _resolve(fmt)
    return fmt.view_names(layer_storage(layer, fmt))

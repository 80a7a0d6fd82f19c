"""The format support registry: `get_format`, the support table and the rejected names.

Six formats are supported (`supported_formats`); three known names are rejected with the reason
(``w4a16``, ``w4a16_mxfp4``, ``w4a8_mxfp4``), and so is per-group ``w4a8_dynamic``; any other name is
unknown. Every rejection raises `UnsupportedFormatError` (a ``ValueError``). Integration's start-up
validation and ``ascend-eplb check`` read `FORMAT_SUPPORT`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ascend_eplb.quant_views.formats import (
    Bf16Format,
    ExpertWeightFormat,
    Fp16Format,
    Mxfp4Format,
    Mxfp8Format,
    UnsupportedFormatError,
    W4A8DynamicFormat,
    W8A8DynamicFormat,
)
from ascend_eplb.quant_views.formats.w4a8 import check_w4a8_group_size

__all__ = ["FORMAT_SUPPORT", "FormatSupport", "UnsupportedFormatError", "get_format", "supported_formats"]


@dataclass(frozen=True)
class FormatSupport:
    """One row of the EPLB weight-format support table.

    Attributes:
        name: format name as `get_format` takes it.
        supports_eplb: whether EPLB may be enabled with this format.
        reason: for a supported format, what moves; for a rejected one, why it is rejected.
        ascend_source: the vllm-ascend file and class whose layout this row describes.
    """

    name: str
    supports_eplb: bool
    reason: str
    ascend_source: str


_FORMATS: dict[str, ExpertWeightFormat] = {
    f.name: f
    for f in (
        Bf16Format(),
        Fp16Format(),
        W8A8DynamicFormat(),
        W4A8DynamicFormat(),
        Mxfp8Format(),
        Mxfp4Format(),
    )
}

_REJECTED: dict[str, FormatSupport] = {
    "w4a16": FormatSupport(
        "w4a16",
        False,
        "int32-packed weights (8 x int4) with per-group antiquant scale/offset and a weight_shape tensor; "
        "the layout has no validated expert-first views (vllm-ascend: supports_eplb=False)",
        "vllm_ascend/quantization/methods/w4a16.py",
    ),
    "w4a16_mxfp4": FormatSupport(
        "w4a16_mxfp4",
        False,
        "MXFP4 weights with bf16 activations: layout not validated for expert movement "
        "(vllm-ascend: supports_eplb=False; not supported with EPLB on Ascend 950)",
        "vllm_ascend/quantization/methods/w4a16_mxfp4.py",
    ),
    "w4a8_mxfp4": FormatSupport(
        "w4a8_mxfp4",
        False,
        "MXFP4 weights with fp8 activations: layout not validated for expert movement "
        "(vllm-ascend: supports_eplb=False; the V1 adaptor raises RuntimeError for W4A8MXFP)",
        "vllm_ascend/quantization/methods/w4a8_mxfp4.py",
    ),
}

_SUPPORTED_REASONS = {
    "bf16": "w13_weight, w2_weight (+ w13_bias, w2_bias) moved as they are",
    "fp16": "w13_weight, w2_weight (+ w13_bias, w2_bias) moved as they are",
    "w8a8_dynamic": "int8 weights and float32 per-channel scales (+ fused int64 scale pair) move together; "
    "unread offsets stay",
    "w4a8_dynamic": "per-channel only: packed int4 weights, int64 scale words and scale_bias move together",
    "mxfp8": "fp8 e4m3 weights and e8m0 block scales, transposed views undone",
    "mxfp4": "packed fp4 e2m1 weights and e8m0 block scales, transposed views undone",
}

FORMAT_SUPPORT: Mapping[str, FormatSupport] = MappingProxyType(
    {
        **{n: FormatSupport(n, True, _SUPPORTED_REASONS[n], f.ascend_source) for n, f in _FORMATS.items()},
        **_REJECTED,
    }
)
"""Every known format name -> `FormatSupport` (six supported, three rejected); for startup validation
and the README matrix. Per-group ``w4a8_dynamic`` is rejected through `get_format`'s ``group_size``."""


def supported_formats() -> tuple[str, ...]:
    """Names of the formats EPLB supports, in table order."""
    return tuple(n for n, s in FORMAT_SUPPORT.items() if s.supports_eplb)


def get_format(name: str, *, group_size: int | None = None) -> ExpertWeightFormat:
    """The `ExpertWeightFormat` called ``name`` (case-insensitive).

    ``name``: one of `supported_formats`; ``group_size``: ``w4a8_dynamic``'s, None or 0 per-channel.

    Raises:
        UnsupportedFormatError: a known format EPLB rejects (``w4a16``, ``w4a16_mxfp4``,
            ``w4a8_mxfp4``, per-group ``w4a8_dynamic``) with the reason; an unknown name, listing the
            known ones; ``group_size`` given for a format that has none.
    """
    if not isinstance(name, str):
        raise UnsupportedFormatError(f"format name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _REJECTED:
        raise UnsupportedFormatError(
            f"quantization format {name!r} does not support EPLB: {_REJECTED[key].reason}"
        )
    fmt = _FORMATS.get(key)
    if fmt is None:
        raise UnsupportedFormatError(
            f"unknown quantization format {name!r}; supported: {', '.join(supported_formats())}; "
            f"known but rejected: {', '.join(_REJECTED)}"
        )
    if key == "w4a8_dynamic":
        check_w4a8_group_size(group_size)
    elif group_size is not None:
        raise UnsupportedFormatError(f"format {key!r} has no group_size option (got {group_size!r})")
    return fmt

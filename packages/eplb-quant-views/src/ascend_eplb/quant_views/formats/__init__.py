"""The expert weight formats, one module per format family; instances come from `get_format`.

Each turns float checkpoint weights ``w13 (p, 2I, H)`` (gate rows, then up rows) and ``w2 (p, H, I)`` into
the tensors vllm-ascend's fused MoE kernel reads after ``process_weights_after_loading``, exposes them
expert-first (`ExpertWeightFormat.weight_views`) and computes a fused MoE from them
(`ExpertWeightFormat.apply`): `unquantized` (``bf16``, ``fp16``), `w8a8`, `w4a8` (per-channel), `mx`
(``mxfp8``, ``mxfp4``); `base` holds what they share.
"""

from ascend_eplb.quant_views.formats.base import ExpertWeightFormat, UnsupportedFormatError
from ascend_eplb.quant_views.formats.mx import Mxfp4Format, Mxfp8Format
from ascend_eplb.quant_views.formats.unquantized import Bf16Format, Fp16Format
from ascend_eplb.quant_views.formats.w4a8 import W4A8DynamicFormat
from ascend_eplb.quant_views.formats.w8a8 import W8A8DynamicFormat

__all__ = [
    "Bf16Format",
    "ExpertWeightFormat",
    "Fp16Format",
    "Mxfp4Format",
    "Mxfp8Format",
    "UnsupportedFormatError",
    "W4A8DynamicFormat",
    "W8A8DynamicFormat",
]

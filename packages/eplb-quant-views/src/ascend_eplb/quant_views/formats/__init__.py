"""The expert weight formats, one module per format family.

Every supported format turns float checkpoint-layout weights ``w13 (p, 2I, H)`` (gate rows, then up rows)
and ``w2 (p, H, I)`` into the tensors vllm-ascend's fused MoE kernel reads after
``process_weights_after_loading``, exposes exactly those tensors expert-first through
`ExpertWeightFormat.weight_views`, and computes a fused MoE from exactly those tensors in
`ExpertWeightFormat.apply`.

- `base`: `ExpertWeightFormat` (storage, views, the checked ``apply``), `UnsupportedFormatError`;
- `unquantized`: ``bf16``, ``fp16``;
- `w8a8`: ``w8a8_dynamic``;
- `w4a8`: ``w4a8_dynamic`` (per-channel);
- `mx`: ``mxfp8``, ``mxfp4``.

Get instances through `ascend_eplb.quant_views.get_format` (module `ascend_eplb.quant_views.registry`).
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

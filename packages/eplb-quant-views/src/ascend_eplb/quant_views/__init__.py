"""Quantization-owned expert weight views for Ascend EPLB: the exact storage each fused MoE kernel reads.

Public names (DESIGN §4): `get_format`, `ExpertWeightFormat`, `ExpertStorage`, `ExpertTensorList`,
`UnsupportedFormatError`, `validate_weight_views`; plus the support table (`FORMAT_SUPPORT`,
`FormatSupport`, `supported_formats`), `expert_fingerprint`, a FusedMoE layer's storage and views read
from its parameters (`layer_storage`, `layer_weight_views`, `layer_view_names`), and the deterministic
test weights of `ascend_eplb.quant_views.reference`. Never imports vllm.
"""

from ascend_eplb.quant_views.__about__ import __version__
from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views._tensor_list import ExpertTensorList
from ascend_eplb.quant_views._validate import BOTH_OR_NEITHER, validate_weight_views
from ascend_eplb.quant_views.fingerprint import expert_fingerprint
from ascend_eplb.quant_views.formats import ExpertWeightFormat
from ascend_eplb.quant_views.layer import layer_storage, layer_view_names, layer_weight_views
from ascend_eplb.quant_views.reference import (
    build_expert_storage,
    quantization_error,
    reference_expert_weights,
    reference_moe,
)
from ascend_eplb.quant_views.registry import (
    FORMAT_SUPPORT,
    FormatSupport,
    UnsupportedFormatError,
    get_format,
    supported_formats,
)

__all__ = [
    "BOTH_OR_NEITHER",
    "FORMAT_SUPPORT",
    "ExpertStorage",
    "ExpertTensorList",
    "ExpertWeightFormat",
    "FormatSupport",
    "UnsupportedFormatError",
    "__version__",
    "build_expert_storage",
    "expert_fingerprint",
    "get_format",
    "layer_storage",
    "layer_view_names",
    "layer_weight_views",
    "quantization_error",
    "reference_expert_weights",
    "reference_moe",
    "supported_formats",
    "validate_weight_views",
]

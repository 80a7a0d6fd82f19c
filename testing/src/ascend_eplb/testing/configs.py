"""Config files shared by the tests of several packages (one copy each).

:data:`VALID_EPLB_CONFIG`: a config in the schema ``ascend-eplb check`` reads that every start-up rule
accepts (Model Runner V2, EP at TP 2, window 8 in interval 16, 64 logical + 2 redundant experts over 2
ranks, ``w8a8_dynamic``, eager). ``copy.deepcopy`` it before changing a field.
"""

from __future__ import annotations

from typing import Any

__all__ = ["VALID_EPLB_CONFIG"]

VALID_EPLB_CONFIG: dict[str, Any] = {
    "use_v2_model_runner": True,
    "parallel_config": {
        "enable_eplb": True,
        "enable_expert_parallel": True,
        "tensor_parallel_size": 2,
        "eplb_config": {"window_size": 8, "step_interval": 16, "num_redundant_experts": 2},
    },
    "model": {"num_logical_experts": 64, "quantization": "w8a8_dynamic"},
    # vLLM captures graphs unless told otherwise (its default cudagraph_mode); Ascend EPLB runs eager.
    "compilation_config": {"cudagraph_mode": "NONE"},
}

"""The public names of ascend_eplb.quant_views (DESIGN §4 and the README table), pinned."""

import inspect

import ascend_eplb.quant_views as qv
from ascend_eplb.quant_views import ExpertWeightFormat, UnsupportedFormatError, get_format

PUBLIC = [
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
    "quantization_error",
    "reference_expert_weights",
    "reference_moe",
    "supported_formats",
    "validate_weight_views",
]


def test_all_is_exactly_the_public_names_and_each_imports():
    assert qv.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(qv, name) is not None, name
    # test helpers stay out: the per-expert reference kernel lives in its module only
    assert not hasattr(qv, "per_expert_apply")


def test_contract_signatures_are_unchanged():
    def params(fn):
        return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]

    empty = inspect.Parameter.empty
    assert params(get_format) == [
        ("name", "POSITIONAL_OR_KEYWORD", empty),
        ("group_size", "KEYWORD_ONLY", None),
    ]
    assert params(ExpertWeightFormat.create_storage) == [
        ("self", "POSITIONAL_OR_KEYWORD", empty),
        ("w13", "POSITIONAL_OR_KEYWORD", empty),
        ("w2", "POSITIONAL_OR_KEYWORD", empty),
        ("per_expert_lists", "KEYWORD_ONLY", False),
        ("options", "VAR_KEYWORD", empty),
    ]
    assert params(ExpertWeightFormat.apply) == [
        ("self", "POSITIONAL_OR_KEYWORD", empty),
        ("storage", "POSITIONAL_OR_KEYWORD", empty),
        ("hidden_TH", "POSITIONAL_OR_KEYWORD", empty),
        ("topk_weights_TK", "POSITIONAL_OR_KEYWORD", empty),
        ("local_ids_TK", "POSITIONAL_OR_KEYWORD", empty),
        ("comm_path", "KEYWORD_ONLY", "standard"),
    ]
    assert [p[0] for p in params(qv.validate_weight_views)] == ["views", "num_local_experts", "names"]
    assert [p[0] for p in params(ExpertWeightFormat.weight_views)] == ["self", "storage"]
    assert [p[0] for p in params(ExpertWeightFormat.check_sizes)] == [
        "self",
        "hidden_size",
        "intermediate_size",
    ]
    assert [p[0] for p in params(qv.expert_fingerprint)] == ["storage", "local_row"]
    assert issubclass(UnsupportedFormatError, ValueError)
    assert get_format("bf16").supports_eplb is True

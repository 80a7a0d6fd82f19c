"""The public names of ascend_eplb.quant_views (DESIGN §4, the README table): ``check_public_names``."""

import inspect

import pytest

import ascend_eplb.quant_views as qv
from ascend_eplb.quant_views import ExpertWeightFormat, UnsupportedFormatError, get_format
from ascend_eplb.testing.api import check_public_names


def test_each_public_name_is_the_packages_own():
    # Each name is the object a quant_views module defines or binds; __version__ is the installed one.
    check_public_names("ascend_eplb.quant_views", "ascend-eplb-quant-views")
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
    assert [p[0] for p in params(qv.layer_weight_views)] == ["layer", "fmt"]
    assert [p[0] for p in params(ExpertWeightFormat.storage_from_checkpoint)] == [
        "self",
        "tensors",
        "hidden_size",
        "intermediate_size",
        "per_expert_lists",
        "options",
    ]
    assert issubclass(UnsupportedFormatError, ValueError)
    assert get_format("bf16").supports_eplb is True


@pytest.mark.parametrize("name", ["bf16", "fp16", "w8a8_dynamic", "w4a8_dynamic", "mxfp8", "mxfp4"])
def test_storage_nbytes_equals_the_bytes_create_storage_allocates(name):
    import torch

    fmt = get_format(name)
    num_local, hidden, inter = 3, 128, 64
    storage = fmt.create_storage(
        torch.randn(num_local, 2 * inter, hidden), torch.randn(num_local, hidden, inter)
    )
    tensors = [*storage.kernel_tensors.values(), *storage.unread_tensors.values()]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert fmt.storage_nbytes(num_local, hidden, inter) == allocated
    assert fmt.storage_nbytes(5 * num_local, hidden, inter) == 5 * allocated  # per expert, linear
    # Nothing allocated: sizes far beyond this host's memory come at once (at least 4 bits a weight).
    assert fmt.storage_nbytes(10**6, 2**16, 2**16) >= 10**6 * 3 * 2**16 * 2**16 // 2
    with pytest.raises(ValueError, match=rf"^{name}: num_local_experts=0 must be a positive int$"):
        fmt.storage_nbytes(0, hidden, inter)

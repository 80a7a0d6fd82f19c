"""validate_weight_views rejections, format rejections and bad-input errors name the value and the rule."""

from pathlib import Path

import pytest
import torch

from ascend_eplb.quant_views import (
    FORMAT_SUPPORT,
    ExpertTensorList,
    UnsupportedFormatError,
    get_format,
    supported_formats,
    validate_weight_views,
)
from ascend_eplb.testing import load_module

C = load_module(Path(__file__).with_name("cases.py"))
_one_torch_thread = pytest.fixture(autouse=True)(C.one_torch_thread)


def _variant(case):
    return next(v for v in C.VARIANTS if v[0] == case)


def test_wrong_first_dimension_is_rejected_naming_the_tensor():
    fmt, storage = C.build(_variant("w8a8"), False)
    views, names = fmt.weight_views(storage), fmt.view_names(storage)
    views[2] = views[2][:3]
    with pytest.raises(ValueError, match=r"weight view 2 \('w13_weight_scale_fp32'\) has first dimension 3"):
        validate_weight_views(views, 4, names=names)


def test_non_contiguous_expert_rows_are_rejected_naming_the_tensor():
    fmt, storage = C.build(_variant("mxfp8"), False)
    views, names = fmt.weight_views(storage), fmt.view_names(storage)
    views[1] = storage.kernel_tensors["w2_weight"]  # the kernel's transposed view, transpose not undone
    with pytest.raises(ValueError, match=r"weight view 1 \('w2_weight'\): expert rows are not contiguous"):
        validate_weight_views(views, 4, names=names)
    fmt, storage = C.build(_variant("mxfp8"), True)
    views = fmt.weight_views(storage)
    views[2] = ExpertTensorList(storage.kernel_tensors["w13_weight_scale"])
    with pytest.raises(ValueError, match=r"weight view 2 \('w13_weight_scale_list'\)\[0\] is not contiguous"):
        validate_weight_views(views, 4, names=fmt.view_names(storage))


def test_missing_half_of_a_pair_is_rejected_naming_both():
    fmt, storage = C.build(_variant("w8a8-fused"), False)
    views, names = fmt.weight_views(storage), fmt.view_names(storage)
    with pytest.raises(
        ValueError, match=r"'fused_w1_scale' is present but its pair 'fused_w2_scale' is missing"
    ):
        validate_weight_views(views[:5], 4, names=names[:5])
    fmt, storage = C.build(_variant("w4a8"), True)
    views, names = fmt.weight_views(storage), fmt.view_names(storage)
    with pytest.raises(
        ValueError, match=r"'w2_scale_bias' is present but its pair 'w13_scale_bias' is missing"
    ):
        validate_weight_views(views[:4] + views[5:], 4, names=names[:4] + names[5:])


def test_list_lengths_and_elements_must_match():
    fmt, storage = C.build(_variant("w8a8"), True)
    views, names = fmt.weight_views(storage), fmt.view_names(storage)
    short = list(views)
    short[2] = ExpertTensorList(views[2][:3])  # per-expert scale list shorter than the weight list
    with pytest.raises(
        ValueError, match=r"weight view 2 \('w13_weight_scale_fp32_list'\) is a list of 3 tensors; expected"
    ):
        validate_weight_views(short, 4, names=names)
    odd = list(views)
    odd[3] = ExpertTensorList([*views[3][:3], torch.zeros(5)])
    with pytest.raises(ValueError, match=r"'w2_weight_scale_list'\)\[3\] has shape \(5,\)"):
        validate_weight_views(odd, 4, names=names)
    shared = list(views)
    shared[0] = ExpertTensorList([views[0][0], views[0][0], views[0][2], views[0][3]])
    with pytest.raises(ValueError, match=r"'w13_weight_list'\)\[1\] shares memory"):
        validate_weight_views(shared, 4, names=names)


def test_other_view_contract_violations():
    t = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="expert rows overlap"):
        validate_weight_views([torch.zeros(8).expand(4, 8)], 4)
    with pytest.raises(ValueError, match="several devices"):
        validate_weight_views([t, torch.zeros(4, 8, device="meta")], 4)
    with pytest.raises(ValueError, match="non-empty list"):
        validate_weight_views([], 4)
    with pytest.raises(ValueError, match="non-empty list"):
        validate_weight_views(t, 4)
    with pytest.raises(ValueError, match="num_local_experts must be a positive int"):
        validate_weight_views([t], 0)
    with pytest.raises(ValueError, match="weight view 0 is a 0-d tensor"):
        validate_weight_views([torch.tensor(1.0)], 4)
    with pytest.raises(ValueError, match="'w2_weight' appears twice"):
        validate_weight_views([t, t.clone()], 4, names=["w2_weight", "w2_weight_list"])
    with pytest.raises(ValueError, match="1 names given for 2 weight views"):
        validate_weight_views([t, t], 4, names=["a"])
    validate_weight_views([t, ExpertTensorList(torch.zeros(3) for _ in range(4))], 4, names=["a", "b"])


def test_rejected_formats_say_why():
    for name, words in (
        ("w4a16", "per-group antiquant"),
        ("w4a16_mxfp4", "supports_eplb=False"),
        ("w4a8_mxfp4", "W4A8MXFP"),
    ):
        with pytest.raises(UnsupportedFormatError, match=rf"'{name}' does not support EPLB: .*{words}"):
            get_format(name)
        assert FORMAT_SUPPORT[name].supports_eplb is False
    with pytest.raises(UnsupportedFormatError, match=r"group_size=128 \(per-group\) does not support EPLB"):
        get_format("w4a8_dynamic", group_size=128)
    w13, w2 = torch.randn(1, 2 * C.I, C.H), torch.randn(1, C.H, C.I)
    with pytest.raises(UnsupportedFormatError, match="per-group"):
        get_format("w4a8_dynamic").create_storage(w13, w2, group_size=64)
    with pytest.raises(UnsupportedFormatError, match="has no group_size option"):
        get_format("bf16", group_size=128)
    assert issubclass(UnsupportedFormatError, ValueError)


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(
        UnsupportedFormatError,
        match=r"unknown quantization format 'int3'; supported: bf16, fp16, w8a8_dynamic, w4a8_dynamic, "
        r"mxfp8, mxfp4; known but rejected: w4a16, w4a16_mxfp4, w4a8_mxfp4",
    ):
        get_format("int3")


def test_support_table_agrees_with_get_format():
    assert supported_formats() == ("bf16", "fp16", "w8a8_dynamic", "w4a8_dynamic", "mxfp8", "mxfp4")
    assert set(FORMAT_SUPPORT) == {*supported_formats(), "w4a16", "w4a16_mxfp4", "w4a8_mxfp4"}
    for name in supported_formats():
        fmt = get_format(name.upper())
        assert fmt.name == name
        assert fmt.supports_eplb is True
        assert FORMAT_SUPPORT[name].ascend_source == fmt.ascend_source
        assert FORMAT_SUPPORT[name].name == name


def test_create_storage_rejects_bad_weights_and_options():
    w13, w2 = torch.randn(2, 2 * C.I, C.H), torch.randn(2, C.H, C.I)
    bf16 = get_format("bf16")
    with pytest.raises(ValueError, match=r"w2 must be \(p, H, I\) = \(2, 192, 64\)"):
        bf16.create_storage(w13, w2[:, :, :32])
    with pytest.raises(ValueError, match="w13 must be floating point"):
        bf16.create_storage(w13.to(torch.int8), w2)
    bad = w2.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="w2 contains non-finite values"):
        bf16.create_storage(w13, bad)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['fused_scales'\]"):
        bf16.create_storage(w13, w2, fused_scales=True)
    with pytest.raises(ValueError, match=r"w13_bias must be a floating tensor of shape \(2, 128\)"):
        bf16.create_storage(w13, w2, w13_bias=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="mxfp4: I=96 must be a multiple of 64"):
        get_format("mxfp4").create_storage(torch.randn(2, 192, 192), torch.randn(2, 192, 96))
    with pytest.raises(ValueError, match="w4a8_dynamic: I=6 must be a multiple of 4"):
        get_format("w4a8_dynamic").create_storage(torch.randn(2, 12, 16), torch.randn(2, 16, 6))


def test_apply_and_views_reject_bad_input():
    fmt, storage = C.build(_variant("w8a8"), False)
    x = C.hidden()
    w, ids = C.route_to(0)
    with pytest.raises(ValueError, match=r"local_ids_TK values must be in \[-1, p=4\), got min -1 max 4"):
        fmt.apply(storage, x, w, torch.full_like(ids, 4).index_fill_(1, torch.tensor([1]), -1))
    with pytest.raises(ValueError, match=r"hidden_TH must be floating \(T, H=192\)"):
        fmt.apply(storage, x[:, :10], w, ids)
    with pytest.raises(ValueError, match="local_ids_TK must be an integer tensor"):
        fmt.apply(storage, x, w, ids.float())
    with pytest.raises(ValueError, match="comm_path='fused_mc2' needs storage built with fused_scales=True"):
        fmt.apply(storage, x, w, ids, comm_path="fused_mc2")
    with pytest.raises(ValueError, match="storage was built by format 'w8a8_dynamic', not 'bf16'"):
        get_format("bf16").weight_views(storage)
    with pytest.raises(IndexError, match=r"local_row=4 is outside \[0, num_local_experts=4\)"):
        storage.expert_tensors("w2_weight", 4)


def test_check_sizes_applies_create_storage_rules_without_weights():
    # The rules create_storage enforces, checkable before any weight exists (simulate validates with it).
    get_format("mxfp8").check_sizes(128, 64)
    get_format("w4a8_dynamic").check_sizes(16, 4)
    get_format("bf16").check_sizes(33, 1)
    with pytest.raises(ValueError, match="mxfp8: I=32") as err:
        get_format("mxfp8").check_sizes(64, 32)
    assert str(err.value) == (
        "mxfp8: I=32 must be a multiple of 64 "
        "(one e8m0 scale per 32 elements along I, w2's reduction dimension, stored in pairs)"
    )
    with pytest.raises(ValueError, match="mxfp4: H=96 must be a multiple of 64"):
        get_format("mxfp4").check_sizes(96, 64)
    with pytest.raises(ValueError, match="w4a8_dynamic: H=12 must be a multiple of 8"):
        get_format("w4a8_dynamic").check_sizes(12, 4)
    with pytest.raises(ValueError, match=r"bf16: I=0 must be a positive int"):
        get_format("bf16").check_sizes(64, 0)
    with pytest.raises(ValueError, match=r"bf16: H=True must be a positive int"):
        get_format("bf16").check_sizes(True, 8)

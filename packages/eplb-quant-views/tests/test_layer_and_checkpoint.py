"""The checkpoint layout, `storage_from_checkpoint` and the layer-level API (`layer_weight_views`)."""

import re
from pathlib import Path

import pytest
import torch

from ascend_eplb.quant_views import (
    ExpertTensorList,
    expert_fingerprint,
    get_format,
    layer_storage,
    layer_view_names,
    layer_weight_views,
    reference_expert_weights,
)
from ascend_eplb.testing import load_module

C = load_module(Path(__file__).with_name("cases.py"))


def _weights(variant, ids=(0, 1, 2, 3), seed=7):
    _, name, options, with_bias = variant
    w13, w2, b13, b2 = reference_expert_weights(list(ids), C.H, C.I, seed=seed, with_bias=with_bias)
    bias = {"w13_bias": b13, "w2_bias": b2} if with_bias else {}
    runtime = {k: v for k, v in options.items()}
    return get_format(name), w13, w2, bias, runtime


def _checkpoint(variant):
    fmt, w13, w2, bias, runtime = _weights(variant)
    ckpt = fmt.quantize_checkpoint(w13, w2, **bias)
    return fmt, ckpt, runtime


class FakeLayer(torch.nn.Module):
    """What a vllm-ascend quantization method leaves on a RoutedExperts layer after loading."""

    def __init__(self, storage, p=C.p, hidden=C.H, inter=C.I):
        super().__init__()
        self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition = p, hidden, inter
        tensors = {**storage.kernel_tensors, **storage.unread_tensors}
        for name, t in tensors.items():
            if isinstance(t, ExpertTensorList):
                setattr(self, name + "_list", t)
            else:
                self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_storage_from_checkpoint_equals_create_storage_bit_for_bit(variant, lists):
    fmt, w13, w2, bias, runtime = _weights(variant)
    ckpt = fmt.quantize_checkpoint(w13, w2, **bias)
    layout = fmt.checkpoint_layout(C.p, C.H, C.I, with_bias=bool(bias))
    assert {n: (tuple(t.shape), t.dtype) for n, t in ckpt.items()} == layout
    loaded = fmt.storage_from_checkpoint(ckpt, C.H, C.I, per_expert_lists=lists, **runtime)
    direct = fmt.create_storage(w13, w2, per_expert_lists=lists, **bias, **runtime)
    assert list(loaded.kernel_tensors) == list(direct.kernel_tensors)
    assert list(loaded.unread_tensors) == list(direct.unread_tensors)
    for name in direct.kernel_tensors:
        for row in range(C.p):
            a, b = loaded.expert_tensors(name, row), direct.expert_tensors(name, row)
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, row)
    for row in range(C.p):
        assert expert_fingerprint(loaded, row) == expert_fingerprint(direct, row)
    # fresh memory: freeing (zeroing) the checkpoint tensors changes nothing the kernel reads
    before = [expert_fingerprint(loaded, r) for r in range(C.p)]
    for t in ckpt.values():
        t.zero_()
    assert [expert_fingerprint(loaded, r) for r in range(C.p)] == before


def test_checkpoint_layout_names_the_msmodelslim_tensors_of_each_format():
    w8a8 = get_format("w8a8_dynamic").checkpoint_layout(2, 64, 32)
    assert w8a8 == {
        "w13_weight": ((2, 64, 64), torch.int8),
        "w13_weight_scale": ((2, 64, 1), torch.float32),
        "w13_weight_offset": ((2, 64, 1), torch.float32),
        "w2_weight": ((2, 64, 32), torch.int8),
        "w2_weight_scale": ((2, 64, 1), torch.float32),
        "w2_weight_offset": ((2, 64, 1), torch.float32),
    }
    assert get_format("mxfp4").checkpoint_layout(2, 64, 64) == {
        "w13_weight": ((2, 128, 32), torch.uint8),
        "w13_weight_scale": ((2, 128, 2), torch.float8_e8m0fnu),
        "w2_weight": ((2, 64, 32), torch.uint8),
        "w2_weight_scale": ((2, 64, 2), torch.float8_e8m0fnu),
    }
    assert get_format("bf16").checkpoint_layout(2, 64, 32, with_bias=True) == {
        "w13_weight": ((2, 64, 64), torch.bfloat16),
        "w2_weight": ((2, 64, 32), torch.bfloat16),
        "w13_bias": ((2, 64), torch.bfloat16),
        "w2_bias": ((2, 64), torch.bfloat16),
    }
    with pytest.raises(
        ValueError, match=r"w8a8_dynamic: with_bias=True, but this format has no expert biases"
    ):
        get_format("w8a8_dynamic").checkpoint_layout(2, 64, 32, with_bias=True)


def test_storage_from_checkpoint_names_the_tensor_and_the_rule():
    fmt, ckpt, _ = _checkpoint(("w8a8", "w8a8_dynamic", {}, False))
    missing = {k: v for k, v in ckpt.items() if k != "w2_weight_offset"}
    with pytest.raises(ValueError, match=r"missing \['w2_weight_offset'\], unexpected \[\]"):
        fmt.storage_from_checkpoint(missing, C.H, C.I)
    wrong = {**ckpt, "w13_weight_scale": ckpt["w13_weight_scale"].double()}
    with pytest.raises(
        ValueError,
        match=r"checkpoint tensor 'w13_weight_scale' must be \(4, 128, 1\) torch.float32, "
        r"got \(4, 128, 1\) torch.float64",
    ):
        fmt.storage_from_checkpoint(wrong, C.H, C.I)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'w13_weight' must be \(4, 128, 96\)"):
        fmt.storage_from_checkpoint(ckpt, 96, C.I)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bogus'\]"):
        fmt.storage_from_checkpoint(ckpt, C.H, C.I, bogus=1)


@pytest.mark.parametrize(("variant", "lists"), C.CASES, ids=C.CASE_IDS)
def test_layer_weight_views_are_the_format_views_over_the_layer_parameters(variant, lists):
    fmt, storage = C.build(variant, lists)
    layer = FakeLayer(storage)
    views = layer_weight_views(layer, fmt.name)
    expected = fmt.weight_views(storage)
    assert layer_view_names(layer, fmt) == fmt.view_names(storage)
    assert len(views) == len(expected)
    for got, want in zip(views, expected, strict=True):
        if lists:
            assert isinstance(got, ExpertTensorList)
            assert [(g.data_ptr(), g.shape) for g in got] == [(w.data_ptr(), w.shape) for w in want]
        else:
            assert (got.data_ptr(), got.shape, got.stride()) == (want.data_ptr(), want.shape, want.stride())
    read = layer_storage(layer, fmt)
    assert read.per_expert_lists is lists
    assert dict(read.options) == dict(storage.options)
    assert list(read.unread_tensors) == list(storage.unread_tensors)
    assert [expert_fingerprint(read, r) for r in range(C.p)] == [
        expert_fingerprint(storage, r) for r in range(C.p)
    ]
    # a move through the layer's views (row 0 <- row 2) is what the layer's kernel then reads
    for v in views:
        v[0].copy_(v[2])
    assert expert_fingerprint(read, 0) == expert_fingerprint(read, 2) == expert_fingerprint(storage, 2)


def test_layer_storage_errors_name_the_attribute_and_the_rule():
    fmt, storage = C.build(("w8a8", "w8a8_dynamic", {}, False), False)
    layer = FakeLayer(storage)
    del layer.w2_weight_scale
    with pytest.raises(
        ValueError,
        match=r"FakeLayer has neither 'w2_weight_scale' nor 'w2_weight_scale_list'; format w8a8_dynamic "
        r"reads "
        r"\['w13_weight', 'w2_weight', 'w13_weight_scale_fp32', 'w2_weight_scale'\]",
    ):
        layer_storage(layer, fmt)

    layer = FakeLayer(storage)
    layer.w13_weight_scale_fp32 = torch.nn.Parameter(
        storage.kernel_tensors["w13_weight_scale_fp32"].half(), False
    )
    with pytest.raises(
        ValueError,
        match=r"FakeLayer.w13_weight_scale_fp32 must be \(4, 128\) torch.float32 for format w8a8_dynamic, "
        r"got \(4, 128\) torch.float16",
    ):
        layer_storage(layer, fmt)

    layer = FakeLayer(storage)
    layer.intermediate_size_per_partition = 0
    with pytest.raises(
        ValueError, match=r"FakeLayer.intermediate_size_per_partition \(I\) must be a positive int"
    ):
        layer_storage(layer, fmt)

    _, lists = C.build(("w8a8", "w8a8_dynamic", {}, False), True)
    mixed = FakeLayer(storage)
    del mixed.w2_weight
    mixed.w2_weight_list = lists.kernel_tensors["w2_weight"]
    with pytest.raises(
        ValueError, match=r"mixes stacked and per-expert list kernel tensors \(lists: \['w2_weight'\]\)"
    ):
        layer_storage(mixed, fmt)

    short = FakeLayer(lists)
    short.w2_weight_scale_list = ExpertTensorList(list(lists.kernel_tensors["w2_weight_scale"])[:3])
    with pytest.raises(ValueError, match=r"FakeLayer.w2_weight_scale_list must hold p=4 tensors .*, got 3"):
        layer_storage(short, fmt)

    both = FakeLayer(storage)
    both.w2_weight_list = lists.kernel_tensors["w2_weight"]
    with pytest.raises(ValueError, match=r"has both 'w2_weight' and 'w2_weight_list'"):
        layer_storage(both, fmt)

    with pytest.raises(ValueError, match=r"w4a16"):
        layer_storage(FakeLayer(storage), "w4a16")


@pytest.mark.parametrize("kept", ["fused_w1_scale", "fused_w2_scale"])
def test_one_fused_scale_without_the_other_is_refused(kept):
    fmt, storage = C.build(("w8a8-fused", "w8a8_dynamic", {"fused_scales": True}, False), False)
    layer = FakeLayer(storage)
    (dropped,) = {"fused_w1_scale", "fused_w2_scale"} - {kept}
    delattr(layer, dropped)
    message = (
        f"FakeLayer has '{kept}' but neither '{dropped}' nor '{dropped}_list': the fused scales of format "
        "w8a8_dynamic are both or neither"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        layer_weight_views(layer, fmt)


def test_a_tensor_of_the_right_shape_in_another_memory_layout_is_refused_naming_both_strides():
    fmt, storage = C.build(("w8a8", "w8a8_dynamic", {}, False), False)
    layer = FakeLayer(storage)
    w13 = storage.kernel_tensors["w13_weight"]  # (p, H, 2I) = (4, 192, 128) int8, contiguous
    layer.w13_weight = torch.nn.Parameter(w13.transpose(1, 2).contiguous().transpose(1, 2), False)
    message = (
        "FakeLayer.w13_weight must have the strides (24576, 128, 1) of format w8a8_dynamic's kernel layout "
        "(dimensions of size 1 aside), got (24576, 1, 192)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        layer_weight_views(layer, fmt)

    mx, mx_storage = C.build(("mxfp8", "mxfp8", {}, False), False)
    layer = FakeLayer(mx_storage)
    kernel = mx_storage.kernel_tensors["w13_weight"]  # the kernel's transposed view
    assert (tuple(kernel.shape), kernel.stride()) == ((4, 192, 128), (24576, 1, 192))
    layer.w13_weight = torch.nn.Parameter(kernel.contiguous(), False)
    with pytest.raises(ValueError, match=r"^FakeLayer.w13_weight must have the strides \(24576, 1, 192\) "):
        layer_weight_views(layer, mx)

    _, lists = C.build(("w8a8", "w8a8_dynamic", {}, False), True)
    layer = FakeLayer(lists)
    rows = list(lists.kernel_tensors["w13_weight"])
    rows[2] = rows[2].t().contiguous().t()
    layer.w13_weight_list = ExpertTensorList(rows)
    with pytest.raises(
        ValueError, match=r"^FakeLayer.w13_weight_list\[2\] must have the strides \(128, 1\) "
    ):
        layer_weight_views(layer, fmt)
    # dimensions of size 1 may have any stride
    one = FakeLayer(storage, p=1)
    for name, t in storage.kernel_tensors.items():
        setattr(
            one, name, torch.nn.Parameter(t[:1].clone().as_strided(t[:1].shape, (7, *t.stride()[1:])), False)
        )
    assert layer_view_names(one, fmt) == fmt.view_names(storage)


def test_a_list_view_whose_tensors_share_memory_is_rejected_as_today():
    fmt, lists = C.build(("bf16", "bf16", {}, False), True)
    layer = FakeLayer(lists)
    shared = layer.w2_weight_list[0]
    layer.w2_weight_list = ExpertTensorList([shared, shared, shared, shared])
    with pytest.raises(ValueError, match=r"weight view 1 \('w2_weight_list'\)"):
        layer_weight_views(layer, fmt)


def test_expert_tensor_list_views_as_uint8_like_upstream_set_eplb_state():
    _, lists = C.build(("w8a8", "w8a8_dynamic", {}, False), True)
    w = lists.kernel_tensors["w13_weight"]
    assert w.element_size() == 1
    u = w.view(torch.uint8)
    assert isinstance(u, ExpertTensorList)
    assert u.dtype == torch.uint8
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(u, w, strict=True))
    with pytest.raises(TypeError, match=r"takes a torch.dtype"):
        w.view((2, -1))

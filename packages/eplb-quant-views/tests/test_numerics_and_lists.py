"""Packing conventions, the W4A8 scale_bias model, ExpertTensorList in upstream buffer code, error bounds."""

from pathlib import Path

import pytest
import torch

from ascend_eplb.quant_views import (
    ExpertTensorList,
    get_format,
    quantization_error,
    reference_expert_weights,
    supported_formats,
)
from ascend_eplb.quant_views import _numerics as nx
from ascend_eplb.testing import load_module

C = load_module(Path(__file__).with_name("cases.py"))
_one_torch_thread = pytest.fixture(autouse=True)(C.one_torch_thread)


def test_int4_packing_puts_element_2j_in_the_low_nibble():
    packed = nx.pack_int4(torch.tensor([1, -2, 7, -8], dtype=torch.int8))
    assert packed.tolist() == [-31, -121]  # 0xE1, 0x87 as int8
    q = torch.randint(-8, 8, (5, 12), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(nx.unpack_int4(nx.pack_int4(q)), q)


def test_fp4_packing_codes_and_values():
    codes = torch.tensor([1, 6, 15, 0], dtype=torch.uint8)  # 0.5, 4.0, -6.0, 0.0
    assert nx.pack_fp4(codes).tolist() == [0x61, 0x0F]
    assert nx.fp4_codes_to_float(codes).tolist() == [0.5, 4.0, -6.0, 0.0]
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6] * 2 + [0.0, 0.0])
    packed, scale = nx.quantize_mxfp4(grid)  # amax 6 -> scale 2**0: every grid value is exact
    assert nx.e8m0_to_float(scale).tolist() == [1.0]
    assert torch.equal(nx.dequantize_mxfp4(packed, scale), grid.to(torch.float64))


def test_scale_words_and_e8m0_bytes():
    assert nx.float_to_scale_word(torch.tensor([1.0, 0.5])).tolist() == [0x3F800000, 0x3F000000]
    s = torch.rand(7, generator=torch.Generator().manual_seed(1)) + 1e-3
    assert torch.equal(nx.scale_word_to_float(nx.float_to_scale_word(s)), s)
    assert nx.exponent_to_e8m0(torch.tensor([0, -3, 5])).view(torch.uint8).tolist() == [127, 124, 132]
    x = torch.tensor([448.0, -3.5, 0.0625] + [0.0] * 29)
    q, scale = nx.quantize_mxfp8(x)  # amax 448 -> scale 2**0; values representable in e4m3
    assert torch.equal(nx.dequantize_mxfp8(q, scale), x.to(torch.float64))


def test_w4a8_scale_bias_model_equals_the_plain_int_gemm():
    """scale_bias = 8 * sum_k w * s (vllm-ascend formula) makes the split int4 GEMM equal s * (x_q @ w)."""
    fmt = get_format("w4a8_dynamic")
    w13, w2, _, _ = reference_expert_weights([4], C.H, C.I, seed=2)
    storage = fmt.create_storage(w13, w2)
    kt = storage.kernel_tensors
    w = nx.unpack_int4(kt["w13_weight"][0].view(torch.int8)).to(torch.float64)  # (H, 2I)
    s = nx.scale_word_to_float(kt["w13_weight_scale"][0]).to(torch.float64)
    assert torch.allclose(kt["w13_scale_bias"][0].to(torch.float64), 8 * (w * s).sum(0), rtol=1e-6, atol=0)
    x = C.hidden().to(torch.float64)
    xq, xs = nx.quantize_per_token(x)
    h = xs.unsqueeze(1) * s * (xq @ w)
    a_q, a_s = nx.quantize_per_token(torch.nn.functional.silu(h[:, : C.I]) * h[:, C.I :])
    w_down = nx.unpack_int4(kt["w2_weight"][0].view(torch.int8)).to(torch.float64)
    s_down = nx.scale_word_to_float(kt["w2_weight_scale"][0]).reshape(-1).to(torch.float64)
    plain = a_s.unsqueeze(1) * s_down * (a_q @ w_down)
    out = fmt.apply(
        storage, x, torch.ones(C.T, 1, dtype=torch.float64), torch.zeros(C.T, 1, dtype=torch.long)
    )
    assert torch.allclose(out, plain, rtol=1e-5, atol=1e-6)
    kt["w13_scale_bias"][0].zero_()  # the reference kernel really reads scale_bias
    assert not torch.allclose(
        fmt.apply(storage, x, torch.ones(C.T, 1, dtype=torch.float64), torch.zeros(C.T, 1, dtype=torch.long)),
        plain,
        rtol=1e-3,
    )


def test_expert_tensor_list_under_upstream_buffer_code():
    """The indexing upstream rebalance_execute.py (vllm 0.33.0) does on expert_weights[layer] entries."""
    fmt, storage = C.build(C.VARIANTS[5], True)  # w4a8, per-expert lists
    layer_weights = fmt.weight_views(storage)
    expert_weights = [layer_weights]
    # eplb_state.py: expert_buffer = [torch.empty_like(w) for w in model.expert_weights[0]]
    expert_buffer = [torch.empty_like(w) for w in expert_weights[0]]
    assert all(isinstance(b, ExpertTensorList) for b in expert_buffer)
    # rearrange_expert_weights_inplace: num_local_physical_experts = expert_weights[0][0].shape[0]
    assert expert_weights[0][0].shape[0] == 4
    for w, b in zip(layer_weights, expert_buffer, strict=True):
        assert b.shape == w.shape
        assert b.dtype == w.dtype
        assert b.device == w.device
        assert len({t.data_ptr() for t in b} | {t.data_ptr() for t in w}) == 8
    # move_to_buffer: expert_tensors = [w[src] for w in expert_weights]; b[dst].copy_(w[src_local])
    sent = [w[3] for w in layer_weights]
    for w, b in zip(layer_weights, expert_buffer, strict=True):
        b[0].copy_(w[3])
    # move_from_buffer: w[dst].copy_(b[dst])
    for w, b in zip(layer_weights, expert_buffer, strict=True):
        w[0].copy_(b[0])
    assert all(torch.equal(w[0], t) for w, t in zip(layer_weights, sent, strict=True))
    assert ExpertTensorList([torch.zeros(2)]).shape == (1, 2)
    with pytest.raises(ValueError, match="ExpertTensorList is empty"):
        _ = ExpertTensorList().shape


@pytest.mark.parametrize("lists", [False, True], ids=["stacked", "lists"])
@pytest.mark.parametrize("name", supported_formats())
def test_quantization_error_within_documented_bound(name, lists):
    fmt = get_format(name)
    errors = [
        quantization_error(
            fmt,
            num_experts=4,
            hidden_size=128,
            intermediate_size=64,
            num_tokens=24,
            seed=s,
            per_expert_lists=lists,
        )
        for s in (0, 1)
    ]
    assert max(errors) <= fmt.error_bound, errors
    assert min(errors) > 0.0  # every format really quantizes (bf16/fp16 round weights and activations)


def test_the_weight_seed_scheme_is_the_one_reference_weights_draw_from():
    """``expert_seed`` is the one seed scheme: the reference weights (layer 0) and the simulator's
    per-layer weights are drawn from a generator seeded with it."""
    from ascend_eplb.quant_views.reference import LAYER_SEED_STRIDE, SEED_STRIDE, expert_seed

    assert (SEED_STRIDE, LAYER_SEED_STRIDE) == (1_000_003, 1009)
    assert expert_seed(3, 5) == 3 * 1_000_003 + 5
    assert expert_seed(3, 5, layer=2) == 3 * 1_000_003 + 2 * 1009 + 5
    w13, w2, _, _ = reference_expert_weights([5, 0], C.H, C.I, seed=3)
    g = torch.Generator().manual_seed(expert_seed(3, 5))
    assert torch.equal(w13[0], torch.randn(2 * C.I, C.H, generator=g) / C.H**0.5)
    assert torch.equal(w2[0], torch.randn(C.H, C.I, generator=g) / C.I**0.5)
    with pytest.raises(ValueError, match=r"logical expert ids must be in \[0, 1000003\), got \[1000003\]"):
        reference_expert_weights([SEED_STRIDE], C.H, C.I)

"""``ExpertWeightFormat.expert_nbytes``: bytes of one expert's kernel storage at any (H, I) without
allocating it, checked against real storages at sizes the probes never use."""

from __future__ import annotations

import pytest
import torch

from ascend_eplb.quant_views import get_format, supported_formats


def _real_nbytes(name: str, hidden: int, inter: int, p: int = 3, **options) -> int:
    fmt = get_format(name)
    g = torch.Generator().manual_seed(1)
    storage = fmt.create_storage(
        torch.randn(p, 2 * inter, hidden, generator=g), torch.randn(p, hidden, inter, generator=g), **options
    )
    total = sum(v.numel() * v.element_size() for v in fmt.weight_views(storage))
    assert total % p == 0
    return total // p


@pytest.mark.parametrize("name", supported_formats())
@pytest.mark.parametrize(("hidden", "inter"), [(448, 192), (512, 384)])
def test_expert_nbytes_equals_a_real_storage(name, hidden, inter):
    assert get_format(name).expert_nbytes(hidden, inter) == _real_nbytes(name, hidden, inter)


def test_expert_nbytes_at_deepseek_v3_size_and_with_options():
    # DeepSeek-V3: H=7168, moe_intermediate_size I=2048. bf16: 3*H*I*2 bytes.
    assert get_format("bf16").expert_nbytes(7168, 2048) == 3 * 7168 * 2048 * 2 == 88_080_384
    # w8a8_dynamic: int8 weights 3*H*I + fp32 scales (2I + H) * 4.
    assert get_format("w8a8_dynamic").expert_nbytes(7168, 2048) == 3 * 7168 * 2048 + (2 * 2048 + 7168) * 4
    # mxfp4: 4-bit weights (1.5*H*I bytes) + one e8m0 byte per 32 elements (3*H*I/32).
    assert get_format("mxfp4").expert_nbytes(7168, 2048) == 7168 * 2048 * 3 // 2 + 3 * 7168 * 2048 // 32
    assert get_format("w8a8_dynamic").expert_nbytes(448, 192, fused_scales=True) == _real_nbytes(
        "w8a8_dynamic", 448, 192, fused_scales=True
    )


def test_expert_nbytes_rejects_sizes_the_layout_cannot_hold():
    with pytest.raises(ValueError, match=r"mxfp4: H=100 must be a multiple of 64"):
        get_format("mxfp4").expert_nbytes(100, 64)

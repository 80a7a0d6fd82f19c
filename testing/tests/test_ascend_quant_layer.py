"""The quantized FusedMoE stand-in's hot path: its layer storage is validated once, then reused."""

from __future__ import annotations

import pytest
import torch

import ascend_eplb.quant_views as quant_views
from ascend_eplb.world.quant_method import apply_layer, lay_out_experts

NUM_LOCAL, HIDDEN, INTER = 4, 64, 32
DTYPE = {"bf16": torch.bfloat16, "w8a8_dynamic": torch.float32}


def _laid_out_layer(fmt: str) -> torch.nn.Module:
    """A layer as the method's ``process_weights_after_loading`` leaves it (``lay_out_experts``)."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_LOCAL, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(NUM_LOCAL, HIDDEN, INTER, generator=g) / INTER**0.5
    layer = torch.nn.Module()
    layer.local_num_experts, layer.hidden_size, layer.intermediate_size_per_partition = (
        NUM_LOCAL,
        HIDDEN,
        INTER,
    )
    layer.expert_map = None
    checkpoint = quant_views.get_format(fmt).quantize_checkpoint(w13, w2)
    for name, t in checkpoint.items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    lay_out_experts(layer, fmt, tuple(checkpoint))
    return layer


def _inputs(fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, HIDDEN, generator=g).to(DTYPE[fmt])
    return x, torch.ones(3, 1), torch.tensor([[0], [1], [2]])


@pytest.mark.parametrize("per_expert_lists", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "w8a8_dynamic"])
def test_apply_layer_reuses_the_storage_validated_at_load_and_reads_in_place_writes(
    fmt, per_expert_lists, monkeypatch
):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1" if per_expert_lists else "0")
    layer = _laid_out_layer(fmt)
    calls = []
    validate = quant_views.layer_storage
    monkeypatch.setattr(quant_views, "layer_storage", lambda *a, **k: calls.append(a) or validate(*a, **k))
    x, weights, ids = _inputs(fmt)
    before = apply_layer(layer, fmt, x, weights, ids)
    assert calls == []  # no validation per call
    assert not torch.equal(before[0], before[1])
    # EPLB moves expert weights in place: row 1 takes row 0's tensors; the kept storage sees it.
    storage = validate(layer, fmt)
    assert storage.per_expert_lists is per_expert_lists
    for t in storage.kernel_tensors.values():
        t[1].copy_(t[0])
    after = apply_layer(layer, fmt, x[[0, 0, 2]], weights, ids)
    assert torch.equal(after[1], before[0])
    assert torch.equal(after[2], before[2])


@pytest.mark.parametrize("per_expert_lists", [False, True])
def test_apply_layer_fails_loudly_when_a_kernel_tensor_was_replaced(per_expert_lists, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1" if per_expert_lists else "0")
    layer = _laid_out_layer("w8a8_dynamic")
    x, weights, ids = _inputs("w8a8_dynamic")
    apply_layer(layer, "w8a8_dynamic", x, weights, ids)
    if per_expert_lists:
        layer.w2_weight_list[3] = layer.w2_weight_list[3].clone()  # one element rebound
        name = "w2_weight_list"
    else:
        layer.w2_weight = torch.nn.Parameter(layer.w2_weight.data.clone(), requires_grad=False)
        name = "w2_weight"
    with pytest.raises(
        RuntimeError, match=rf"Module\.{name} was replaced after process_weights_after_loading"
    ):
        apply_layer(layer, "w8a8_dynamic", x, weights, ids)


def test_apply_layer_refuses_a_layer_not_laid_out_for_the_format():
    layer = _laid_out_layer("bf16")
    x, weights, ids = _inputs("bf16")
    with pytest.raises(RuntimeError, match=r"not laid out for format 'fp16' by lay_out_experts .* 'bf16'"):
        apply_layer(layer, "fp16", x, weights, ids)
    del layer.__dict__["_ascend_eplb_layer_storage"]
    with pytest.raises(RuntimeError, match=r"not laid out for format 'bf16' .* laid out for: None"):
        apply_layer(layer, "bf16", x, weights, ids)

"""``bf16`` and ``fp16``: unquantized experts (vllm-ascend ``AscendUnquantizedFusedMoEMethod``)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from ascend_eplb.quant_views import _numerics as nx
from ascend_eplb.quant_views._batched import Selection, grouped_mm
from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views.formats.base import ExpertWeightFormat

__all__ = ["Bf16Format", "Fp16Format"]


class _UnquantizedFormat(ExpertWeightFormat):
    """Unquantized experts (vllm-ascend ``routed_experts.py`` ``AscendUnquantizedFusedMoEMethod``).

    Kernel tensors = views, in the weight dtype (after loading ``transpose(1, 2).contiguous()``):
    ``w13_weight`` (p, H, 2I), ``w2_weight`` (p, I, H), and with the options ``w13_bias`` (float (p, 2I))
    / ``w2_bias`` (float (p, H)) the biases ``w13_bias`` (p, 2I), ``w2_bias`` (p, H).
    Checkpoint: ``w13_weight`` (p, 2I, H), ``w2_weight`` (p, H, I) (+ the biases).
    Reference: ``h = x @ w13_weight[e] + w13_bias[e]``, SiLU(gate) * up rounded to the weight dtype,
    ``y = a @ w2_weight[e] + w2_bias[e]``; activations rounded to the weight dtype first.
    """

    dtype: ClassVar[torch.dtype]
    ascend_source = "vllm_ascend/ops/fused_moe/routed_experts.py AscendUnquantizedFusedMoEMethod"
    _options = MappingProxyType({"w13_bias": None, "w2_bias": None})

    def _public_options(self, opts: Mapping[str, Any]) -> list[str]:
        return []

    def _checkpoint(self, w13, w2, p, opts):
        ckpt = {"w13_weight": w13.to(self.dtype), "w2_weight": w2.to(self.dtype)}
        inter, hidden = w2.shape[2], w2.shape[1]
        for name, shape in (("w13_bias", (p, 2 * inter)), ("w2_bias", (p, hidden))):
            bias = opts[name]
            if bias is None:
                continue
            if (
                not isinstance(bias, torch.Tensor)
                or tuple(bias.shape) != shape
                or not bias.is_floating_point()
            ):
                raise ValueError(
                    f"{self.name}: {name} must be a floating tensor of shape {shape}, "
                    f"got {getattr(bias, 'shape', bias)!r}"
                )
            if bias.device != w13.device:
                raise ValueError(f"{self.name}: {name} is on {bias.device}, weights on {w13.device}")
            ckpt[name] = bias.to(self.dtype)
        return ckpt

    def _after_loading(self, ckpt, p, opts):
        kernel = {
            "w13_weight": ckpt["w13_weight"].transpose(1, 2).to(self.dtype).contiguous(),
            "w2_weight": ckpt["w2_weight"].transpose(1, 2).to(self.dtype).contiguous(),
        }
        for name in ("w13_bias", "w2_bias"):
            if name in ckpt:
                kernel[name] = ckpt[name].to(self.dtype).contiguous()
        return kernel, {}

    def _forward_expert(self, storage: ExpertStorage, row: int, x: torch.Tensor, fused: bool) -> torch.Tensor:
        kt, dt = storage.kernel_tensors, self.dtype
        w13 = self._expert_row(storage, "w13_weight", row).to(torch.float64)  # (H, 2I)
        w2 = self._expert_row(storage, "w2_weight", row).to(torch.float64)  # (I, H)
        h = x.to(dt).to(torch.float64) @ w13
        if "w13_bias" in kt:
            h = h + self._expert_row(storage, "w13_bias", row).to(torch.float64)
        a = nx.silu_and_mul(h, storage.intermediate_size).to(dt).to(torch.float64)
        y = a @ w2
        if "w2_bias" in kt:
            y = y + self._expert_row(storage, "w2_bias", row).to(torch.float64)
        return y

    def _forward_batched(
        self, storage: ExpertStorage, x: torch.Tensor, sel: Selection, fused: bool
    ) -> torch.Tensor:
        kt, dt = storage.kernel_tensors, self.dtype
        w13 = self._selected_rows(storage, "w13_weight", sel).to(torch.float64)  # (rows, H, 2I)
        w2 = self._selected_rows(storage, "w2_weight", sel).to(torch.float64)  # (rows, I, H)
        h = grouped_mm(x.to(dt).to(torch.float64)[sel.token], w13, sel)
        if "w13_bias" in kt:
            h = h + self._selected_rows(storage, "w13_bias", sel).to(torch.float64)[sel.group]
        a = nx.silu_and_mul(h, storage.intermediate_size).to(dt).to(torch.float64)
        y = grouped_mm(a, w2, sel)
        if "w2_bias" in kt:
            y = y + self._selected_rows(storage, "w2_bias", sel).to(torch.float64)[sel.group]
        return y


class Bf16Format(_UnquantizedFormat):
    __doc__ = _UnquantizedFormat.__doc__
    name = "bf16"
    dtype = torch.bfloat16
    error_bound = 1e-2


class Fp16Format(_UnquantizedFormat):
    __doc__ = _UnquantizedFormat.__doc__
    name = "fp16"
    dtype = torch.float16
    error_bound = 2e-3

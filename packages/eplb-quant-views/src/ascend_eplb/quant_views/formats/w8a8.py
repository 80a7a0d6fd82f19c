"""``w8a8_dynamic``: int8 weights, per-token int8 activations (vllm-ascend ``w8a8_dynamic.py``)."""

from __future__ import annotations

from types import MappingProxyType

import torch

from ascend_eplb.quant_views import _numerics as nx
from ascend_eplb.quant_views._batched import INT8_X_INT8, Selection, grouped_mm
from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views.formats.base import ExpertWeightFormat

__all__ = ["W8A8DynamicFormat"]


class W8A8DynamicFormat(ExpertWeightFormat):
    """W8A8 dynamic (vllm-ascend ``w8a8_dynamic.py`` ``AscendW8A8DynamicFusedMoEMethod``).

    Int8 weights, symmetric per output channel; activations int8 per token at run time
    (``npu_dynamic_quant``), also between the GEMMs. Kernel tensors = views, in order:

    - ``w13_weight`` int8 (p, H, 2I) (transposed for the grouped matmul), ``w2_weight`` int8 (p, I, H);
    - ``w13_weight_scale_fp32`` float32 (p, 2I), ``w2_weight_scale`` float32 (p, H), per output channel;
    - with option ``fused_scales=True``, ``fused_w1_scale`` int64 (p, 2I), ``fused_w2_scale`` int64 (p, H):
      float32 bits zero-extended (``scale_from_float_to_int64``; fused MC2 / MegaMoE), both or neither.

    Unread, not views: ``w13_weight_offset`` (p, 2I), ``w2_weight_offset`` (p, H), float32 zeros.
    Checkpoint (msModelSlim ``W8A8_DYNAMIC``): ``w13_weight`` (p, 2I, H), ``w2_weight`` (p, H, I) int8;
    ``w13_weight_scale``/``_offset`` (p, 2I, 1), ``w2_weight_scale``/``_offset`` (p, H, 1) float32.
    Reference: ``h = (q(x) @ w13_weight[e]) * s_x * scale13``; SiLU(gate) * up;
    ``y = (q(a) @ w2_weight[e]) * s_a * scale2``; ``comm_path="fused_mc2"`` reads the fused words.
    """

    name = "w8a8_dynamic"
    ascend_source = "vllm_ascend/quantization/methods/w8a8_dynamic.py AscendW8A8DynamicFusedMoEMethod"
    error_bound = 5e-2
    _options = MappingProxyType({"fused_scales": False})

    def _checkpoint(self, w13, w2, p, opts):
        q13, s13 = nx.quantize_per_channel(w13, 127)  # (p, 2I, H), (p, 2I)
        q2, s2 = nx.quantize_per_channel(w2, 127)  # (p, H, I), (p, H)
        return {
            "w13_weight": q13,
            "w13_weight_scale": s13.unsqueeze(-1),
            "w13_weight_offset": torch.zeros_like(s13).unsqueeze(-1),
            "w2_weight": q2,
            "w2_weight_scale": s2.unsqueeze(-1),
            "w2_weight_offset": torch.zeros_like(s2).unsqueeze(-1),
        }

    def _after_loading(self, ckpt, p, opts):
        if not isinstance(opts["fused_scales"], bool):
            raise ValueError(f"w8a8_dynamic: fused_scales must be a bool, got {opts['fused_scales']!r}")
        s13 = ckpt["w13_weight_scale"].reshape(p, -1).to(torch.float32)  # (p, 2I)
        s2 = ckpt["w2_weight_scale"].reshape(p, -1).to(torch.float32)  # (p, H)
        kernel = {
            "w13_weight": ckpt["w13_weight"].transpose(1, 2).contiguous(),
            "w2_weight": ckpt["w2_weight"].transpose(1, 2).contiguous(),
            "w13_weight_scale_fp32": s13.contiguous(),
            "w2_weight_scale": s2.contiguous(),
        }
        if opts["fused_scales"]:
            kernel["fused_w1_scale"] = nx.float_to_scale_word(s13)
            kernel["fused_w2_scale"] = nx.float_to_scale_word(s2)
        unread = {
            "w13_weight_offset": ckpt["w13_weight_offset"].reshape(p, -1).contiguous(),
            "w2_weight_offset": ckpt["w2_weight_offset"].reshape(p, -1).contiguous(),
        }
        return kernel, unread

    def _fused_scales_path(self, storage, comm_path):
        if comm_path == "standard":
            return False
        if comm_path == "fused_mc2":
            if "fused_w1_scale" not in storage.kernel_tensors:
                raise ValueError(
                    "w8a8_dynamic: comm_path='fused_mc2' needs storage built with fused_scales=True"
                )
            return True
        raise ValueError(
            f"w8a8_dynamic: comm_path={comm_path!r} is not supported; use 'standard' or 'fused_mc2'"
        )

    @staticmethod
    def _scale_names(fused: bool) -> tuple[str, str]:
        """(w13 scale, w2 scale) kernel tensors the chosen path reads."""
        return ("fused_w1_scale", "fused_w2_scale") if fused else ("w13_weight_scale_fp32", "w2_weight_scale")

    @staticmethod
    def _decode_scale(name: str, t: torch.Tensor) -> torch.Tensor:
        """float64 scales of kernel tensor ``name`` (the fused int64 words hold float32 bits)."""
        return (nx.scale_word_to_float(t) if name.startswith("fused_") else t).to(torch.float64)

    def _forward_expert(self, storage: ExpertStorage, row: int, x: torch.Tensor, fused: bool) -> torch.Tensor:
        w13 = self._expert_row(storage, "w13_weight", row).to(torch.float64)  # int8 values (H, 2I)
        w2 = self._expert_row(storage, "w2_weight", row).to(torch.float64)  # (I, H)
        s13, s2 = (self._decode_scale(n, self._expert_row(storage, n, row)) for n in self._scale_names(fused))
        xq, xs = nx.quantize_per_token(x)
        h = (xq @ w13) * xs.unsqueeze(1) * s13  # integer GEMM: exact in float64
        aq, as_ = nx.quantize_per_token(nx.silu_and_mul(h, storage.intermediate_size))
        return (aq @ w2) * as_.unsqueeze(1) * s2

    def _forward_batched(
        self, storage: ExpertStorage, x: torch.Tensor, sel: Selection, fused: bool
    ) -> torch.Tensor:
        w13 = self._selected_rows(storage, "w13_weight", sel)  # int8 (rows, H, 2I)
        w2 = self._selected_rows(storage, "w2_weight", sel)  # int8 (rows, I, H)
        s13, s2 = (  # float64 (selections, 2I), (selections, H)
            self._decode_scale(n, self._selected_rows(storage, n, sel))[sel.group]
            for n in self._scale_names(fused)
        )
        xq, xs = nx.quantize_per_token(x)  # per token, as npu_dynamic_quant
        xq, xs = xq[sel.token], xs[sel.token]
        h = grouped_mm(xq, w13, sel, int_bound=INT8_X_INT8) * xs.unsqueeze(1) * s13
        aq, as_ = nx.quantize_per_token(nx.silu_and_mul(h, storage.intermediate_size))
        return grouped_mm(aq, w2, sel, int_bound=INT8_X_INT8) * as_.unsqueeze(1) * s2

"""``w4a8_dynamic`` (per-channel): packed int4 weights, int8 activations (vllm-ascend ``w4a8.py``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import MappingProxyType
from typing import Any

import torch

from ascend_eplb.quant_views import _numerics as nx
from ascend_eplb.quant_views._batched import INT4_X_INT4, Selection, grouped_mm
from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views._tensor_list import ExpertTensorList
from ascend_eplb.quant_views._validate import is_int
from ascend_eplb.quant_views.formats.base import ExpertWeightFormat, UnsupportedFormatError

__all__ = ["W4A8DynamicFormat", "check_w4a8_group_size"]


class W4A8DynamicFormat(ExpertWeightFormat):
    """W4A8 dynamic, per-channel (vllm-ascend ``w4a8.py`` ``AscendW4A8DynamicFusedMoEMethod``).

    Int4 weights (-8..7), symmetric per output channel, packed two per int8 along the output dimension
    (element 2j in the low nibble, ``_pack_int4_to_int8``), read as int32 (``_pack_to_int32``; lists
    keep int8, viewed as int32 per call). Kernel tensors = views, in order (scale_bias: both or neither):

    - ``w13_weight`` int32 (p, H, I/4) [list: int8 (H, I)], ``w2_weight`` int32 (p, I, H/8) [list: (I, H/2)];
    - ``w13_weight_scale`` int64 (p, 2I), ``w2_weight_scale`` int64 (p, 1, H): float32 bits zero-extended
      (``_process_scale``), w2's unsqueezed for ``npu_grouped_matmul``;
    - ``w13_scale_bias`` float32 (p, 2I) ``= 8 * sum_j w[j, n] * scale[n]`` (j over H), ``w2_scale_bias``
      float32 (p, H) (``update_bias_compressed_tensors``).

    Checkpoint (msModelSlim ``W4A8_DYNAMIC``): ``w13_weight`` (p, 2I, H), ``w2_weight`` (p, H, I) int8 of
    int4, ``w13_weight_scale`` (p, 2I, 1), ``w2_weight_scale`` (p, H, 1) float32. Needs ``I % 4 == 0``,
    ``H % 8 == 0``; option ``group_size > 0`` raises `UnsupportedFormatError`. Reference: int8 activations
    per token, the GEMM split as ``x = 16 * hi + (lo - 8) + 8`` whose constant term is ``scale_bias``:
    ``h = s_x * (scale * (16 * hi @ w + (lo - 8) @ w) + scale_bias)`` (our reading of the kernel's
    ``weight_assist_matrix``; its internals are not public).
    """

    name = "w4a8_dynamic"
    ascend_source = "vllm_ascend/quantization/methods/w4a8.py AscendW4A8DynamicFusedMoEMethod"
    error_bound = 0.32
    _options = MappingProxyType({"group_size": 0})
    _size_rules = (
        ("I", 4, "w13_weight packs 2I int4 into I int8, read as int32"),
        ("H", 8, "w2_weight packs H int4 into H/2 int8, read as int32"),
    )

    def _checkpoint(self, w13, w2, p, opts):
        check_w4a8_group_size(opts["group_size"])
        q13, s13 = nx.quantize_per_channel(w13, 7)  # (p, 2I, H) int8 in [-8, 7], (p, 2I)
        q2, s2 = nx.quantize_per_channel(w2, 7)  # (p, H, I), (p, H)
        return {
            "w13_weight": q13,
            "w13_weight_scale": s13.unsqueeze(-1),
            "w2_weight": q2,
            "w2_weight_scale": s2.unsqueeze(-1),
        }

    def _after_loading(self, ckpt, p, opts):
        check_w4a8_group_size(opts["group_size"])
        s13 = ckpt["w13_weight_scale"].reshape(p, -1).to(torch.float32)  # (p, 2I)
        s2 = ckpt["w2_weight_scale"].reshape(p, -1).to(torch.float32)  # (p, H)
        k13 = ckpt["w13_weight"].transpose(1, 2).contiguous()  # (p, H, 2I): (p, in_features, out_features)
        k2 = ckpt["w2_weight"].transpose(1, 2).contiguous()  # (p, I, H)
        bias13 = 8.0 * (k13.to(torch.float64) * s13.to(torch.float64).unsqueeze(1)).sum(dim=1)
        bias2 = 8.0 * (k2.to(torch.float64) * s2.to(torch.float64).unsqueeze(1)).sum(dim=1)
        kernel = {
            "w13_weight": nx.pack_int4(k13).view(torch.int32),
            "w2_weight": nx.pack_int4(k2).view(torch.int32),
            "w13_weight_scale": nx.float_to_scale_word(s13),
            "w2_weight_scale": nx.float_to_scale_word(s2).unsqueeze(1).contiguous(),
            "w13_scale_bias": bias13.to(torch.float32),
            "w2_scale_bias": bias2.to(torch.float32),
        }
        return kernel, {}

    def _to_list(self, name, stacked):
        if name in ("w13_weight", "w2_weight"):
            # vllm-ascend keeps per-expert int8 clones and views them as int32 for each call.
            return ExpertTensorList(r.view(torch.int8).clone() for r in stacked.unbind(0))
        return super()._to_list(name, stacked)

    @staticmethod
    def _split_int4_gemm(
        xq: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor, mm: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """``s * (16 * mm(hi, w) + mm(lo - 8, w)) + b`` for int8-valued ``xq``, int4-valued ``w``."""
        hi = torch.floor(xq / 16.0)
        lo_s = xq - 16.0 * hi - 8.0  # hi and lo - 8 both in [-8, 7]
        return s * (16.0 * mm(hi, w) + mm(lo_s, w)) + b

    def _forward_expert(self, storage: ExpertStorage, row: int, x: torch.Tensor, fused: bool) -> torch.Tensor:
        def weight(name: str) -> torch.Tensor:  # int32 (in, out/8) or int8 list row -> float64 (in, out)
            packed = self._expert_row(storage, name, row).contiguous().view(torch.int8)
            return nx.unpack_int4(packed).to(torch.float64)

        def vector(name: str, decode: bool) -> torch.Tensor:  # one float64 value per output channel
            t = self._expert_row(storage, name, row)
            return (nx.scale_word_to_float(t) if decode else t).reshape(-1).to(torch.float64)

        w13, w2 = weight("w13_weight"), weight("w2_weight")  # (H, 2I), (I, H)
        s13, s2 = vector("w13_weight_scale", True), vector("w2_weight_scale", True)
        b13, b2 = vector("w13_scale_bias", False), vector("w2_scale_bias", False)
        xq, xs = nx.quantize_per_token(x)
        h = self._split_int4_gemm(xq, w13, s13, b13, torch.matmul) * xs.unsqueeze(1)  # exact in float64
        aq, as_ = nx.quantize_per_token(nx.silu_and_mul(h, storage.intermediate_size))
        return self._split_int4_gemm(aq, w2, s2, b2, torch.matmul) * as_.unsqueeze(1)

    def _forward_batched(
        self, storage: ExpertStorage, x: torch.Tensor, sel: Selection, fused: bool
    ) -> torch.Tensor:
        num_rows = len(sel.rows_list)

        def weight(
            name: str,
        ) -> torch.Tensor:  # int32 (rows, in, out/8) or int8 list rows -> int8 (rows, in, out)
            return nx.unpack_int4(self._selected_rows(storage, name, sel).contiguous().view(torch.int8))

        def per_selection(name: str, decode: bool) -> torch.Tensor:  # -> float64 (selections, out)
            t = self._selected_rows(storage, name, sel)
            t = nx.scale_word_to_float(t) if decode else t
            return t.reshape(num_rows, -1).to(torch.float64)[sel.group]

        w13, w2 = weight("w13_weight"), weight("w2_weight")  # (rows, H, 2I), (rows, I, H)
        s13, s2 = per_selection("w13_weight_scale", True), per_selection("w2_weight_scale", True)
        b13, b2 = per_selection("w13_scale_bias", False), per_selection("w2_scale_bias", False)
        xq, xs = nx.quantize_per_token(x)  # per token, as npu_dynamic_quant
        xq, xs = xq[sel.token], xs[sel.token]
        mm = partial(grouped_mm, sel=sel, int_bound=INT4_X_INT4)
        h = self._split_int4_gemm(xq, w13, s13, b13, mm) * xs.unsqueeze(1)
        aq, as_ = nx.quantize_per_token(nx.silu_and_mul(h, storage.intermediate_size))
        return self._split_int4_gemm(aq, w2, s2, b2, mm) * as_.unsqueeze(1)


def check_w4a8_group_size(group_size: Any) -> None:
    """Raise `UnsupportedFormatError` unless ``group_size`` means per-channel W4A8 (None or 0)."""
    if group_size is None or (is_int(group_size) and group_size == 0):
        return
    raise UnsupportedFormatError(
        f"w4a8_dynamic with group_size={group_size!r} (per-group) does not support EPLB: vllm-ascend "
        "rejects per-group W4A8 (group_size > 0) for expert movement; only per-channel (group_size=0) "
        "W4A8 storage has validated weight views"
    )

"""``mxfp8`` and ``mxfp4``: MX block-scaled weights and activations (vllm-ascend, Ascend 950)."""

from __future__ import annotations

import abc

import torch

from ascend_eplb.quant_views import _numerics as nx
from ascend_eplb.quant_views._batched import Selection, grouped_mm
from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views.formats.base import ExpertWeightFormat

__all__ = ["Mxfp4Format", "Mxfp8Format"]


class _MxFormat(ExpertWeightFormat):
    """Shared MX layout (vllm-ascend ``w8a8_mxfp8.py`` / ``w4a4_mxfp4.py``, Ascend 950).

    The checkpoint layout ``(p, out_features, in_features)`` stays in memory; after loading the e8m0
    block scales ``(p, out_features, in_features/32)`` become ``(p, out_features, in_features/64, 2)`` and
    all four parameters ``transpose(1, 2)`` strided views (``*``: halved for packed fp4):

    - ``w13_weight`` (p, H*, 2I) over (p, 2I, H*), ``w2_weight`` (p, I*, H) over (p, H, I*): subclass dtype;
    - ``w13_weight_scale`` (p, H/64, 2I, 2) over (p, 2I, H/64, 2), ``w2_weight_scale`` (p, I/64, H, 2)
      over (p, H, I/64, 2): torch.float8_e8m0fnu.

    Checkpoint (msModelSlim ``W8A8_MXFP8`` / ``W4A4_MXFP4``): ``w13_weight`` (p, 2I, H*), ``w2_weight``
    (p, H, I*), ``w13_weight_scale`` (p, 2I, H/32), ``w2_weight_scale`` (p, H, I/32). Views: the four with
    the transpose undone, ``(p, -1)``. Needs ``H % 64 == 0``, ``I % 64 == 0``. Reference: weights
    dequantized block-wise (value * 2 ** (byte - 127)); activations MX-quantized in blocks of 32 along
    ``in_features`` (``npu_dynamic_mx_quant``), also between the GEMMs.
    """

    _transposed = frozenset({"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"})
    _size_rules = (
        ("H", 64, "one e8m0 scale per 32 elements along H, w13's reduction dimension, stored in pairs"),
        ("I", 64, "one e8m0 scale per 32 elements along I, w2's reduction dimension, stored in pairs"),
    )

    @staticmethod
    @abc.abstractmethod
    def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @staticmethod
    @abc.abstractmethod
    def _dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    @abc.abstractmethod
    def _fake_quantize_act(x: torch.Tensor) -> torch.Tensor: ...

    def _checkpoint(self, w13, w2, p, opts):
        q13, s13 = self._quantize_weight(w13)  # (p, 2I, H[/2]), (p, 2I, H/32)
        q2, s2 = self._quantize_weight(w2)
        return {"w13_weight": q13, "w13_weight_scale": s13, "w2_weight": q2, "w2_weight_scale": s2}

    def _after_loading(self, ckpt, p, opts):
        kernel = {}
        s13, s2 = ckpt["w13_weight_scale"], ckpt["w2_weight_scale"]
        for name, t in (
            ("w13_weight", ckpt["w13_weight"]),
            ("w2_weight", ckpt["w2_weight"]),
            ("w13_weight_scale", s13.reshape(p, s13.shape[1], -1, 2)),
            ("w2_weight_scale", s2.reshape(p, s2.shape[1], -1, 2)),
        ):
            kernel[name] = t.contiguous().transpose(1, 2)
        # view order: weights then scales, as get_eplb_weight_views returns them
        return {n: kernel[n] for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")}, {}

    def _forward_expert(self, storage: ExpertStorage, row: int, x: torch.Tensor, fused: bool) -> torch.Tensor:
        def weight(name: str) -> torch.Tensor:  # float64 (out_features, in_features)
            q = self._expert_row(storage, name, row)  # (out_features, in_features[/2])
            s = self._expert_row(storage, name + "_scale", row)  # (out_features, in_features/64, 2)
            return self._dequantize_weight(q, s.reshape(s.shape[0], -1))

        w13, w2 = weight("w13_weight"), weight("w2_weight")  # (2I, H), (H, I)
        h = self._fake_quantize_act(x) @ w13.T
        return self._fake_quantize_act(nx.silu_and_mul(h, storage.intermediate_size)) @ w2.T

    def _forward_batched(
        self, storage: ExpertStorage, x: torch.Tensor, sel: Selection, fused: bool
    ) -> torch.Tensor:
        def weight(name: str) -> torch.Tensor:  # float64 (rows, out_features, in_features)
            q = self._selected_rows(storage, name, sel)  # (rows, out_features, in_features[/2])
            s = self._selected_rows(storage, name + "_scale", sel)  # (rows, out_features, in_features/64, 2)
            return self._dequantize_weight(q, s.reshape(*s.shape[:2], -1))

        w13 = weight("w13_weight").transpose(1, 2)  # (rows, H, 2I) view: w13[row].T of the per-expert form
        w2 = weight("w2_weight").transpose(1, 2)  # (rows, I, H)
        xa = self._fake_quantize_act(x)[sel.token]  # MX blocks along H, per token
        h = grouped_mm(xa, w13, sel)
        return grouped_mm(self._fake_quantize_act(nx.silu_and_mul(h, storage.intermediate_size)), w2, sel)


class Mxfp8Format(_MxFormat):
    """MXFP8 (vllm-ascend ``w8a8_mxfp8.py`` ``AscendW8A8MXFP8DynamicFusedMoEMethod``, Ascend 950).

    Weights torch.float8_e4m3fn, one element per byte, e8m0 block scales of 32; layout in `_MxFormat`.
    """

    __doc__ = (__doc__ or "") + (_MxFormat.__doc__ or "")
    name = "mxfp8"
    ascend_source = "vllm_ascend/quantization/methods/w8a8_mxfp8.py AscendW8A8MXFP8DynamicFusedMoEMethod"
    error_bound = 0.1
    _quantize_weight = staticmethod(nx.quantize_mxfp8)
    _dequantize_weight = staticmethod(nx.dequantize_mxfp8)
    _fake_quantize_act = staticmethod(nx.fake_quantize_mxfp8)


class Mxfp4Format(_MxFormat):
    """MXFP4 (vllm-ascend ``w4a4_mxfp4.py`` ``AscendW4A4MXFP4DynamicFusedMoEMethod``, Ascend 950).

    Weights fp4 e2m1 packed two per uint8 along ``in_features`` (element 2j in the low nibble; the kernel's
    ``float4_e2m1fn_x2``), so weight ``in_features`` extents are halved; e8m0 block scales of 32; layout
    in `_MxFormat`.
    """

    __doc__ = (__doc__ or "") + (_MxFormat.__doc__ or "")
    name = "mxfp4"
    ascend_source = "vllm_ascend/quantization/methods/w4a4_mxfp4.py AscendW4A4MXFP4DynamicFusedMoEMethod"
    error_bound = 0.45
    _quantize_weight = staticmethod(nx.quantize_mxfp4)
    _dequantize_weight = staticmethod(nx.dequantize_mxfp4)
    _fake_quantize_act = staticmethod(nx.fake_quantize_mxfp4)

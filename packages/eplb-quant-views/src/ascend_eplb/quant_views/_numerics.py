"""Quantization arithmetic shared by the formats (pure torch, any device); conventions in the README.

``in_features`` / ``out_features``: a GEMM's reduction / output dimension (``w13``: H, 2I; ``w2``: I, H);
``rows``: independent rows (tokens, channels). int4 and fp4 e2m1 pack two per byte along the last
dimension, element ``2j`` in the low nibble (vllm-ascend ``_pack_int4_to_int8``); an fp4 code is
``sign << 3 | exponent << 1 | mantissa`` (OCP MX v1.0). MX scales: one e8m0 per 32 elements along
``in_features``, ``2 ** ceil(log2(amax / max_elem))`` (``max_elem`` 448 for e4m3, 6 for e2m1), so nothing
saturates (NVIDIA's and torchao's "round scale up"; OCP's section 6.3 example clips up to 12.5 % of
e4m3's range). 64-bit scale words: the float32 bits zero-extended (vllm-ascend ``_process_scale``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MX_BLOCK = 32
"""Elements per MX block scale (OCP MX v1.0; vllm-ascend ``group_size`` 32)."""

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127

_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
_FP4_MIDPOINTS = (_FP4_MAGNITUDES[1:] + _FP4_MAGNITUDES[:-1]) / 2


def quantize_per_channel(w: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of ``w`` (..., out_features, in_features).

    Reduces over ``in_features``. Returns ``(q, scale)``: ``q`` int8 with values in ``[-qmax - 1, qmax]``
    and float32 ``scale`` (..., out_features),
    ``scale = amax / qmax`` (1.0 where a channel is all zero).
    """
    w64 = w.to(torch.float64)
    amax = w64.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).to(torch.float32)
    q = torch.round(w64 / scale.to(torch.float64).unsqueeze(-1)).clamp(-qmax - 1, qmax)
    return q.to(torch.int8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization per row of ``x`` (rows, in_features) as ``npu_dynamic_quant`` does.

    Returns float64 ``(q, scale)``: integer-valued ``q`` (rows, in_features) in ``[-127, 127]`` and
    ``scale`` (rows,).
    """
    x64 = x.to(torch.float64)
    amax = x64.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x64 / scale.unsqueeze(-1)).clamp(-127, 127)
    return q, scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 values (int8 tensor, last dim even) two per int8; element 2j in the low nibble."""
    lo = q[..., 0::2].to(torch.int16) & 0x0F
    hi = q[..., 1::2].to(torch.int16) & 0x0F
    packed = (hi << 4) | lo
    return torch.where(packed > 127, packed - 256, packed).to(torch.int8).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4` on an int8 tensor: returns int8 values in ``[-8, 7]``, last dim doubled."""
    p = packed.to(torch.int16) & 0xFF
    lo = p & 0x0F
    hi = p >> 4
    lo = torch.where(lo > 7, lo - 16, lo)
    hi = torch.where(hi > 7, hi - 16, hi)
    out = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return out.to(torch.int8)


def float_to_scale_word(scale: torch.Tensor) -> torch.Tensor:
    """float32 scale -> int64 holding its bit pattern zero-extended (vllm-ascend ``_process_scale``)."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return bits & 0xFFFFFFFF


def scale_word_to_float(word: torch.Tensor) -> torch.Tensor:
    """Inverse of `float_to_scale_word`: int64 bit-pattern words -> float32 scales."""
    low = word & 0xFFFFFFFF
    low = torch.where(low >= 2**31, low - 2**32, low)
    return low.to(torch.int32).contiguous().view(torch.float32)


def _mx_block_exponents(x64: torch.Tensor, max_elem: float) -> torch.Tensor:
    """Shared exponent per block: x64 (..., blocks, 32) -> int64 (..., blocks).

    ``ceil(log2(amax / max_elem))``, clamped to the e8m0 range.
    """
    amax = x64.abs().amax(dim=-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exp = torch.ceil(torch.log2(safe / max_elem)).to(torch.int64)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP))
    return exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def exponent_to_e8m0(exp: torch.Tensor) -> torch.Tensor:
    """int exponents in [-127, 127] -> torch.float8_e8m0fnu holding ``2 ** exp`` (biased byte exp + 127)."""
    return (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """torch.float8_e8m0fnu (or its uint8 bytes) -> float64 ``2 ** (byte - 127)``."""
    byte = scale.contiguous().view(torch.uint8).to(torch.float64)
    return torch.exp2(byte - 127.0)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    in_features = x.shape[-1]
    if in_features % MX_BLOCK:
        raise ValueError(
            f"MX quantization needs in_features={in_features} (the reduction dimension) to be a multiple "
            f"of {MX_BLOCK}"
        )
    return x.to(torch.float64).reshape(*x.shape[:-1], in_features // MX_BLOCK, MX_BLOCK)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (e4m3) quantization of ``x`` (..., in_features) in blocks of 32 along ``in_features``.

    Returns ``(q, scale)``: ``q`` torch.float8_e4m3fn (..., in_features), ``scale`` torch.float8_e8m0fnu
    (..., in_features/32).
    """
    xb = _blocks(x)
    exp = _mx_block_exponents(xb, E4M3_MAX)
    scaled = (xb / torch.exp2(exp.to(torch.float64)).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    q = scaled.to(torch.float32).to(torch.float8_e4m3fn).reshape(x.shape)
    return q, exponent_to_e8m0(exp)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (..., in_features), e8m0 scales (..., in_features/32) -> float64 (..., in_features)."""
    in_features = q.shape[-1]
    vals = q.to(torch.float64).reshape(*q.shape[:-1], in_features // MX_BLOCK, MX_BLOCK)
    return (vals * e8m0_to_float(scale).unsqueeze(-1)).reshape(q.shape)


def _fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """float64 values already divided by the block scale -> e2m1 codes (uint8 0..15), nearest, saturating."""
    mag_idx = torch.bucketize(v.abs().clamp(max=6.0), _FP4_MIDPOINTS.to(v.device), right=False)
    sign = (v < 0) & (mag_idx > 0)
    return (mag_idx | (sign.to(torch.int64) << 3)).to(torch.uint8)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> float64 values."""
    c = codes.to(torch.int64)
    mag = _FP4_MAGNITUDES.to(codes.device)[c & 0x7]
    return torch.where((c & 0x8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 codes (uint8 (..., in_features), in_features even) two per uint8; element 2j low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: uint8 (..., in_features/2) -> codes uint8 (..., in_features)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (e2m1) quantization of ``x`` (..., in_features) in blocks of 32 along ``in_features``.

    Returns ``(packed, scale)``: ``packed`` uint8 (..., in_features/2) (two codes per byte, element 2j in
    the low nibble), ``scale`` torch.float8_e8m0fnu (..., in_features/32).
    """
    xb = _blocks(x)
    exp = _mx_block_exponents(xb, E2M1_MAX)
    scaled = xb / torch.exp2(exp.to(torch.float64)).unsqueeze(-1)
    codes = _fp4_codes(scaled).reshape(x.shape)
    return pack_fp4(codes), exponent_to_e8m0(exp)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize MXFP4: packed e2m1 uint8 (..., in_features/2) -> float64 (..., in_features).

    ``scale``: torch.float8_e8m0fnu (..., in_features/32), one per block of 32 elements.
    """
    vals = fp4_codes_to_float(unpack_fp4(packed))
    in_features = vals.shape[-1]
    vals = vals.reshape(*vals.shape[:-1], in_features // MX_BLOCK, MX_BLOCK)
    return (vals * e8m0_to_float(scale).unsqueeze(-1)).reshape(*packed.shape[:-1], in_features)


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP8 activation quantization (``npu_dynamic_mx_quant``), returned dequantized in float64."""
    return dequantize_mxfp8(*quantize_mxfp8(x))


def fake_quantize_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """Dynamic MXFP4 activation quantization (``npu_dynamic_mx_quant``), returned dequantized in float64."""
    return dequantize_mxfp4(*quantize_mxfp4(x))


#: Elements below which a TensorIterator kernel runs on one thread (ATen ``internal::GRAIN_SIZE``).
_SERIAL_NUMEL = 32768


def silu_and_mul(h: torch.Tensor, inter: int) -> torch.Tensor:
    """``SiLU(h[:, :I]) * h[:, I:]`` for ``h`` (rows, 2I), each row computed alone.

    Row chunks under ATen's grain size keep every row one inner loop (ATen's SIMD body and scalar tail
    round differently), so a row's result never depends on the others: the batched and per-expert
    kernels agree bit for bit (README "Reference kernel speed").
    """
    rows = max(1, _SERIAL_NUMEL // max(inter, 1) - 1)
    if h.shape[0] <= rows:
        return F.silu(h[:, :inter]) * h[:, inter:]
    return torch.cat([F.silu(c[:, :inter]) * c[:, inter:] for c in h.split(rows)])

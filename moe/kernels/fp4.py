"""FP4 (MXFP4 / NVFP4) expert weights inside the Triton kernels: decoding in registers, the weight tile of a
grouped GEMM's K loop, and a standalone dequantize kernel (tests, fallbacks).

Packed layout (quant/fp4.py): qdata uint8 [E, O, I/2] (element 2j in the low nibble), scale uint8 [E, O, I/B]
(e8m0 bits, B = 32, or e4m3 bits, B = 16), NVFP4 tensor_scale fp32 [E]. The kernels read the logical weight
W [E, N, K] = the stored [E, O, I] (transposed=False: the forward) or its transpose (the backward's W^T),
element by element from the codes: value = e2m1 * 2^(s - 127) (MXFP4) or e2m1 * (tensor_scale * e4m3)
(NVFP4, fp32, in that order), then rounded to the activations' dtype: torchao's dequantized values, bit for
bit. Decoding is integer arithmetic and bit casts (no fp8 types: the interpreter lacks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu.launch import cdiv, launch
from quant import FP4Weight

FMT_CODES = {"dense": 0, "mxfp4": 1, "nvfp4": 2}
_BLOCK = {"mxfp4": 32, "nvfp4": 16}


@dataclass(frozen=True)
class PackedWeight:
    """A packed FP4 weight as the kernels read it: the logical [E, N, K] is the stored [E, O, I], or its
    transpose when `transposed` (a view: nothing is copied)."""
    qdata: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    fmt: str
    transposed: bool = False

    @classmethod
    def of(cls, weight: FP4Weight) -> PackedWeight:
        p = weight.packed
        return cls(p.qdata, p.scale, p.tensor_scale, p.fmt)

    @property
    def shape(self) -> tuple[int, int, int]:
        E, O, I2 = self.qdata.shape
        return (E, 2 * I2, O) if self.transposed else (E, O, 2 * I2)

    @property
    def block_size(self) -> int:
        return _BLOCK[self.fmt]

    def t(self) -> PackedWeight:
        return PackedWeight(self.qdata, self.scale, self.tensor_scale, self.fmt, not self.transposed)


@triton.jit
def e2m1_to_float(code):
    """e2m1 codes (int32, 0..15) -> fp32: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = (code >> 3) & 1
    exponent = (code >> 1) & 3
    mantissa = code & 1
    bits = tl.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
    return (bits | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_float(s):
    """e8m0 scale bytes (int32) -> 2^(s - 127) in fp32 (s = 0: the subnormal 2^-127; 255: NaN)."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_float(b):
    """e4m3fn bytes (int32) -> fp32: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0."""
    sign = (b >> 7) & 1
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20) | (sign << 31)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2^-9
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def fp4_values(q_ptr, s_ptr, ts_ptr, e64, o, i, mask, s_q_e, s_q_o, s_s_e, s_s_o,
               FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The fp32 values of stored elements (e64, o, i) (broadcastable int index tensors), 0 where masked."""
    byte = tl.load(q_ptr + e64 * s_q_e + o * s_q_o + i // 2, mask=mask, other=0).to(tl.int32)
    value = e2m1_to_float((byte >> ((i % 2) * 4)) & 15)
    s = tl.load(s_ptr + e64 * s_s_e + o * s_s_o + i // BLOCK_SIZE, mask=mask, other=127).to(tl.int32)
    if FMT == 1:
        scale = e8m0_to_float(s)
    else:
        scale = tl.load(ts_ptr + e64) * e4m3_to_float(s)
    return tl.where(mask, value * scale, 0.0)


@triton.jit
def fp4_weight_tile(q_ptr, s_ptr, ts_ptr, e64, n_N, mask_N, k_K, mask_K, s_q_e, s_q_o, s_s_e, s_s_o,
                    FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Tile [BLOCK_K, BLOCK_N] of the logical W_e^T (rows k, columns n) in fp32, from the packed weight:
    W[n, k] is stored at (o, i) = (n, k), or (k, n) when TRANSPOSED."""
    mask = mask_K[:, None] & mask_N[None, :]
    if TRANSPOSED:
        return fp4_values(q_ptr, s_ptr, ts_ptr, e64, k_K[:, None], n_N[None, :], mask, s_q_e, s_q_o, s_s_e, s_s_o,
                          FMT, BLOCK_SIZE)
    return fp4_values(q_ptr, s_ptr, ts_ptr, e64, n_N[None, :], k_K[:, None], mask, s_q_e, s_q_o, s_s_e, s_s_o,
                      FMT, BLOCK_SIZE)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, ts_ptr, experts_ptr, out_ptr, O, I, s_q_e, s_q_o, s_s_e, s_s_o,
                       FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    j = tl.program_id(0)
    e64 = tl.load(experts_ptr + j).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    i = tl.program_id(2) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (o < O)[:, None] & (i < I)[None, :]
    w = fp4_values(q_ptr, s_ptr, ts_ptr, e64, o[:, None], i[None, :], mask, s_q_e, s_q_o, s_s_e, s_s_o,
                   FMT, BLOCK_SIZE)
    out = out_ptr + j.to(tl.int64) * O * I + o[:, None] * I + i[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp4(weight: FP4Weight, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The stored [E, O, I] weight (or only `experts`, [E', O, I]) in `dtype`, by a Triton kernel."""
    p = PackedWeight.of(weight)
    E, O, I = weight.shape
    if experts is None:
        experts = torch.arange(E, device=p.qdata.device)
    out = torch.empty(experts.numel(), O, I, dtype=dtype, device=p.qdata.device)
    if experts.numel() == 0:
        return out
    block_o, block_i = 16, 64
    launch(_dequantize_kernel, (experts.numel(), cdiv(O, block_o), cdiv(I, block_i)), (
        p.qdata, p.scale, p.tensor_scale, experts.to(torch.int32), out, O, I, p.qdata.stride(0), p.qdata.stride(1),
        p.scale.stride(0), p.scale.stride(1)), {
        "FMT": FMT_CODES[p.fmt], "BLOCK_SIZE": p.block_size, "BLOCK_O": block_o, "BLOCK_I": block_i})
    return out

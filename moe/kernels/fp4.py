"""FP4 (MXFP4 / NVFP4) expert weights inside the Triton kernels: decoding in registers, the weight tile of a
grouped GEMM's K loop (the one way the scattermoe kernels read packed weights), and a standalone dequantize
kernel of all or some experts (tests: the decode checked bit for bit against torchao).

Packed layout (quant/fp4.py): qdata uint8 [E, O, I/2] (element 2j in the low nibble), scale uint8 [E, O, I/B]
(e8m0 bits, B = 32, or e4m3 bits, B = 16), NVFP4 tensor_scale fp32 [E]. The kernels read the logical weight
W [E, N, K] = the stored [E, O, I] (transposed=False: the forward) or its transpose (the backward's W^T),
byte by byte from the codes (one contiguous byte load and one block-scale decode per pair of elements, the
pairs interleaved into the tile by join + permute + reshape): value = e2m1 * 2^(s - 127) (MXFP4) or
e2m1 * (tensor_scale * e4m3) (NVFP4, fp32, in that order), then rounded to the activations' dtype: torchao's
dequantized values, bit for bit. Codes and scales are decoded by shifts, masks and bit casts to fp32 and exact
multiplications by powers of two (no fp8 types: the interpreter lacks them); e2m1 times the scale is the one
rounding, as in torchao. MXFP4 into bf16 on the GPU takes a shorter road, equally exact: e2m1 to bf16 by byte
tables (PTX prmt) and one bf16 multiplication by the scale (_MXFP4_BF16_PTX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.target_info import cuda_capability_geq

from gpu.launch import cdiv, launch
from moe.kernels.tuning import INTERPRET
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


# A minifloat code with its exponent bits at fp32's lowest exponent bits and its mantissa bits at fp32's
# highest mantissa bits reads, as fp32, as its value times 2^(bias - 127), subnormals too (exponent 0 is
# fp32's subnormal as well): shifts and a mask, then an exact multiplication by 2^(127 - bias).
_E2M1_BITS = tl.constexpr(-0x7E400000)  # 0x81C00000 (int32): the sign (bit 31), e2m1 e1 e0 m (24-22)
_E4M3_BITS = tl.constexpr(-0x78100000)  # 0x87F00000 (int32): the sign (bit 31), e4m3 e3-e0 m2-m0 (26-20)
_E2M1_UNBIAS = tl.constexpr(2.0 ** 126)
_E4M3_UNBIAS = tl.constexpr(2.0 ** 120)


# MXFP4 to bf16 on the GPU, 8 codes per call (pack=4: four bytes in $4, their four bf16 scales in $5, $6):
# each code's magnitude (3 bits) indexes byte tables of bf16(|e2m1|) through prmt (the high and the low byte of
# 0, 0.5, 1, 1.5, 2, 3, 4, 6), its sign bit a table of 0x00 / 0x80, another prmt interleaves the bytes into
# bf16x2 pairs ($0, $1: the bytes' low nibbles, elements 2j; $2, $3: the high ones), and one exact mul.bf16x2
# by the scale (a power of two) ends it: ~2.6 instructions per element against ~6 through fp32 bits.
_MXFP4_BF16_PTX = tl.constexpr("""{
.reg .b32 m0, m1, g0, g1, h0, h1, l0, l1;
and.b32 m0, $4, 0x77777777;
and.b32 g0, $4, 0x88888888;
shr.u32 g0, g0, 3;
shr.u32 m1, m0, 16;
shr.u32 g1, g0, 16;
prmt.b32 h0, 0x3F3F3F00, 0x40404040, m0;
prmt.b32 l0, 0xC0800000, 0xC0804000, m0;
prmt.b32 h1, 0x3F3F3F00, 0x40404040, m1;
prmt.b32 l1, 0xC0800000, 0xC0804000, m1;
prmt.b32 g0, 0x00008000, 0, g0;
prmt.b32 g1, 0x00008000, 0, g1;
or.b32 h0, h0, g0;
or.b32 h1, h1, g1;
prmt.b32 $0, l0, h0, 0x6240;
prmt.b32 $2, l0, h0, 0x7351;
prmt.b32 $1, l1, h1, 0x6240;
prmt.b32 $3, l1, h1, 0x7351;
mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, $6;
mul.rn.bf16x2 $2, $2, $5;
mul.rn.bf16x2 $3, $3, $6;
}""")
_PTX_DECODE = tl.constexpr(not INTERPRET)  # and sm_90 or later (mul.bf16x2): cuda_capability_geq in the kernel


@triton.jit
def fp4_pairs(q_ptrs, s_ptrs, ts, mask, FMT: tl.constexpr, DTYPE: tl.constexpr):
    """The values in DTYPE of the two elements of the stored bytes at q_ptrs (a byte holds elements i = 2j
    (returned first) and 2j + 1), their block scales at s_ptrs (ts: the NVFP4 tensor scale, fp4_tensor_scale),
    0 where masked. One byte and one scale load per pair (equal scale pointers are loaded and decoded once)."""
    byte = tl.load(q_ptrs, mask=mask, other=0)
    # other=0: a masked element is code 0 times a finite scale (e4m3 0 or e8m0 2^-127), +0.
    s = tl.load(s_ptrs, mask=mask, other=0)
    if FMT == 1 and DTYPE == tl.bfloat16 and _PTX_DECODE and cuda_capability_geq(9, 0):
        # e8m0 to bf16: s << 7 is 2^(s - 127) for s in 1..254; s = 0 the subnormal 2^-127, 255 NaN.
        bits = tl.maximum(s.to(tl.int16) << 7, 0x40).to(tl.int16)
        scale = tl.where(s == 255, 0x7FC0, bits).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.inline_asm_elementwise(_MXFP4_BF16_PTX, "=r,=r,=r,=r,r,r,r", [byte, scale],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    byte = byte.to(tl.int32)
    s = s.to(tl.int32)
    if FMT == 1:
        # e8m0: 2^(s - 127) is s << 23 for s in 1..254, s = 0 the subnormal 2^-127 (bit 22); 255 (NaN) reads
        # as inf, which inf * 0 + inf turns into NaN (a finite scale passes unchanged).
        scale = tl.maximum(s << 23, 0x00400000).to(tl.float32, bitcast=True)
        scale = scale * 0.0 + scale
    else:
        # e4m3fn (bits 6-0 to 26-20, the sign through an arithmetic shift): its NaNs 0x7F / 0xFF read as
        # +-480, beyond its largest finite value (448).
        e4m3 = (((s << 24) >> 4) & _E4M3_BITS).to(tl.float32, bitcast=True) * _E4M3_UNBIAS
        e4m3 = tl.where(tl.abs(e4m3) == 480.0, float("nan"), e4m3)
        scale = ts * e4m3  # torchao's order
    # A code to bits 31-28, then an arithmetic shift: its sign stays at 31 (its copies in 30-25 are masked).
    lo = (((byte << 28) >> 6) & _E2M1_BITS).to(tl.float32, bitcast=True) * _E2M1_UNBIAS
    hi = (((byte << 24) >> 6) & _E2M1_BITS).to(tl.float32, bitcast=True) * _E2M1_UNBIAS
    # The exact e2m1 values times the scale (torchao's one rounding), then DTYPE's.
    return (lo * scale).to(DTYPE), (hi * scale).to(DTYPE)


@triton.jit
def fp4_tensor_scale(ts_ptr, e64, FMT: tl.constexpr):
    """Expert e64's NVFP4 tensor scale (fp32), for fp4_pairs; MXFP4 has none (1.0, unused)."""
    if FMT == 2:
        return tl.load(ts_ptr + e64)
    return 1.0


@triton.jit
def fp4_weight_ptrs(q_ptr, s_ptr, e64, wrow_N, mask_N, n0, N, s_q_e, s_q_o, s_s_e, s_s_o,
                    BLOCK_SIZE: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """The byte and scale pointers of the pairs of the first K tile (k0 = 0) of fp4_weight_tile and their mask
    over N: once per output tile, fp4_weight_tile moves them to k0 by a scalar. W[n, k] is stored at
    (o, i) = (n, k): the columns are the weight rows wrow_N (any row indices, mask_N); or, TRANSPOSED, at
    (k, n): the columns are n0 + [0, BLOCK_N) (n0 even). Pairs are [BLOCK_N / 2, BLOCK_K] when TRANSPOSED,
    else [BLOCK_K / 2, BLOCK_N]."""
    if TRANSPOSED:
        k_K = tl.arange(0, BLOCK_K)
        j_J = n0 // 2 + tl.arange(0, BLOCK_N // 2)
        q_ptrs = q_ptr + e64 * s_q_e + k_K[None, :] * s_q_o + j_J[:, None]
        s_ptrs = s_ptr + e64 * s_s_e + k_K[None, :] * s_s_o + (j_J // (BLOCK_SIZE // 2))[:, None]
        # j < N / 2 per run of BLOCK_SIZE / 2 bytes (exact: N, the stored I, is a multiple of the block): a
        # mask Triton sees constant over runs lets it load the bytes as vectors through the async-copy
        # pipeline (elementwise: single synchronous byte loads; offline sm90, a K step of MXFP4 dx 431 -> 222 SASS).
        mask = ((j_J // (BLOCK_SIZE // 2)) * (BLOCK_SIZE // 2) < N // 2)[:, None]
    else:
        j_J = tl.arange(0, BLOCK_K // 2)
        q_ptrs = q_ptr + e64 * s_q_e + wrow_N[None, :] * s_q_o + j_J[:, None]
        s_ptrs = s_ptr + e64 * s_s_e + wrow_N[None, :] * s_s_o + (j_J // (BLOCK_SIZE // 2))[:, None]
        mask = mask_N[None, :]
    return q_ptrs, s_ptrs, mask


@triton.jit
def fp4_weight_tile(q_ptrs, s_ptrs, ts, mask, k0, K, s_q_o, s_s_o, FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    TRANSPOSED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Tile [BLOCK_K, BLOCK_N] of the logical W_e^T (rows k0 + [0, BLOCK_K), k0 a multiple of BLOCK_K) in DTYPE,
    from fp4_weight_ptrs' pointers and mask (ts: fp4_tensor_scale); 0 outside [K, N] (EVEN_K: K % BLOCK_K == 0,
    no K mask). The pairs are decoded [BLOCK / 2, ..] and interleaved by join + permute + reshape: Triton 3.6
    fails to compile (sm90, "Illegal shared layout") a dot operand made by join + reshape alone, or followed by
    a transpose."""
    if TRANSPOSED:
        if not EVEN_K:
            mask = mask & (tl.arange(0, BLOCK_K) < K - k0)[None, :]
        lo, hi = fp4_pairs(q_ptrs + k0 * s_q_o, s_ptrs + k0 * s_s_o, ts, mask, FMT, DTYPE)
        return tl.reshape(tl.permute(tl.join(lo, hi), (1, 0, 2)), (BLOCK_K, BLOCK_N))
    if not EVEN_K:
        mask = mask & (tl.arange(0, BLOCK_K // 2) < (K - k0) // 2)[:, None]
    # Pair j of the tile at k0 has scale (k0 / 2 + j) // (BLOCK_SIZE / 2) = k0 // BLOCK_SIZE + j // (BLOCK_SIZE
    # / 2), both powers of two: BLOCK_K a multiple of BLOCK_SIZE, or a divisor (then j // (BLOCK_SIZE / 2) = 0).
    lo, hi = fp4_pairs(q_ptrs + k0 // 2, s_ptrs + k0 // BLOCK_SIZE, ts, mask, FMT, DTYPE)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, ts_ptr, experts_ptr, out_ptr, O, I, s_q_e, s_q_o, s_s_e, s_s_o,
                       FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    j = tl.program_id(0)
    e64 = tl.load(experts_ptr + j).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    b = tl.program_id(2) * (BLOCK_I // 2) + tl.arange(0, BLOCK_I // 2)
    mask = (o < O)[:, None] & (b < I // 2)[None, :]
    q_ptrs = q_ptr + e64 * s_q_e + o[:, None] * s_q_o + b[None, :]
    s_ptrs = s_ptr + e64 * s_s_e + o[:, None] * s_s_o + (b // (BLOCK_SIZE // 2))[None, :]
    lo, hi = fp4_pairs(q_ptrs, s_ptrs, fp4_tensor_scale(ts_ptr, e64, FMT), mask, FMT, out_ptr.dtype.element_ty)
    w = tl.reshape(tl.join(lo, hi), (BLOCK_O, BLOCK_I))
    i = tl.program_id(2) * BLOCK_I + tl.arange(0, BLOCK_I)
    out = out_ptr + j.to(tl.int64) * O * I + o[:, None] * I + i[None, :]
    tl.store(out, w, mask=(o < O)[:, None] & (i < I)[None, :])


# (BLOCK_O, BLOCK_I) of the dequantize kernel: small under the interpreter.
_DEQUANT_TILE = (16, 64) if INTERPRET else (32, 256)


def dequantize_fp4(weight: FP4Weight, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The stored [E, O, I] weight (or only `experts`, [E', O, I]) in `dtype`, by a Triton kernel."""
    p = PackedWeight.of(weight)
    E, O, I = weight.shape
    if experts is None:
        experts = torch.arange(E, device=p.qdata.device)
    out = torch.empty(experts.numel(), O, I, dtype=dtype, device=p.qdata.device)
    if experts.numel() == 0:
        return out
    block_o, block_i = _DEQUANT_TILE
    launch(_dequantize_kernel, (experts.numel(), cdiv(O, block_o), cdiv(I, block_i)), (
        p.qdata, p.scale, p.tensor_scale, experts.to(torch.int32), out, O, I, p.qdata.stride(0), p.qdata.stride(1),
        p.scale.stride(0), p.scale.stride(1)), {
        "FMT": FMT_CODES[p.fmt], "BLOCK_SIZE": p.block_size, "BLOCK_O": block_o, "BLOCK_I": block_i})
    return out

"""MXFP4 and NVFP4: quantization (torchao's own routines, so its layouts by construction) and a plain-torch
dequantization that gives torchao's values bit for bit.

Layouts, for a weight w [E, N, K] quantized in blocks along K (the input dim, as torchao's MXTensor /
NVFP4Tensor block the last dim):
    qdata  uint8 [E, N, K/2]   two e2m1 codes per byte: element 2j in the low nibble, 2j+1 in the high
    scale  uint8 [E, N, K/B]   the bits of one e8m0 (MXFP4, B = 32) or e4m3 (NVFP4, B = 16) scale per block
    tensor_scale fp32 [E]      NVFP4 only: one per expert (amax / (448 * 6)), each expert quantized as
                               its own tensor, so an expert's codes do not depend on which rank holds it
    value(e, n, k) = e2m1(code) * 2^(scale - 127)                                  MXFP4
                   = e2m1(code) * (tensor_scale[e] * e4m3(scale))   (fp32, that order)     NVFP4
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("mxfp4", "nvfp4")
BLOCK_SIZE = {"mxfp4": 32, "nvfp4": 16}
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The 16 e2m1 codes: sign bit 3, two exponent bits (bias 1), one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class PackedFP4:
    """The three tensors of one quantized [E, N, K] weight (tensor_scale None for MXFP4)."""
    fmt: str
    qdata: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None


def check_format(fmt: str, in_features: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP4 format {fmt!r}; choose one of {FORMATS}")
    if in_features % BLOCK_SIZE[fmt]:
        raise ValueError(f"{fmt} scales blocks of {BLOCK_SIZE[fmt]} along the input dim, which is "
                         f"{in_features} here; use a format whose block divides it")


def packed_shapes(fmt: str, E: int, N: int, K: int) -> dict[str, tuple[int, ...]]:
    """Shapes of qdata, scale and (NVFP4) tensor_scale of an [E, N, K] weight."""
    check_format(fmt, K)
    shapes = {"qdata": (E, N, K // 2), "scale": (E, N, K // BLOCK_SIZE[fmt])}
    if fmt == "nvfp4":
        shapes["tensor_scale"] = (E,)
    return shapes


def quantize(w_ENK: torch.Tensor, fmt: str) -> PackedFP4:
    """w [E, N, K] (any float dtype) -> packed FP4, by torchao (FLOOR scale rounding for MXFP4, per-expert
    tensor scale for NVFP4). Runs on w's device; holds one expert's temporaries at a time beyond w."""
    check_format(fmt, w_ENK.shape[-1])
    if fmt == "mxfp4":
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        mx = MXTensor.to_mx(w_ENK, torch.float4_e2m1fn_x2, block_size=BLOCK_SIZE[fmt])
        return PackedFP4(fmt, mx.qdata.view(torch.uint8), mx.scale.view(torch.uint8), None)
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    qdata, scale, tensor_scale = [], [], []
    for w_NK in w_ENK:
        ts = per_tensor_amax_to_scale(w_NK.abs().amax())
        nv = NVFP4Tensor.to_nvfp4(w_NK, block_size=BLOCK_SIZE[fmt], per_tensor_scale=ts)
        qdata.append(nv.qdata.view(torch.uint8))
        scale.append(nv.scale.view(torch.uint8))
        tensor_scale.append(ts.reshape(()))
    return PackedFP4(fmt, torch.stack(qdata), torch.stack(scale), torch.stack(tensor_scale).float())


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> their fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def block_scales(packed: PackedFP4, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 scale of every block [E', N, K/B] (NVFP4: tensor_scale times the e4m3 block scale)."""
    scale = packed.scale if experts is None else packed.scale.index_select(0, experts)
    if packed.fmt == "mxfp4":
        exponent = scale.to(torch.int32) - 127
        s = torch.pow(torch.full_like(exponent, 2, dtype=torch.float32), exponent)
        return torch.where(scale == 255, float("nan"), s)  # e8m0 255 is NaN
    ts = packed.tensor_scale if experts is None else packed.tensor_scale.index_select(0, experts)
    return ts.view(-1, 1, 1) * scale.view(torch.float8_e4m3fn).to(torch.float32)


def dequantize(packed: PackedFP4, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The [E, N, K] weight in `dtype`, or only the experts listed in `experts` ([E', N, K], selective
    dequantization). Equal to torchao's dequantize bit for bit."""
    qdata = packed.qdata if experts is None else packed.qdata.index_select(0, experts)
    E, N, K2 = qdata.shape
    codes = torch.stack((qdata & 0xF, qdata >> 4), dim=-1).view(E, N, 2 * K2)
    values = e2m1_to_float(codes)
    scales = block_scales(packed, experts)
    blocks = scales.shape[-1]
    w = values.view(E, N, blocks, 2 * K2 // blocks) * scales.unsqueeze(-1)
    return w.view(E, N, 2 * K2).to(dtype)

"""FP8 (e4m3) with rowwise scales: the format of the FP8 frozen expert base and of FP8 expert training,
and the scaled grouped GEMM both run on.

Rowwise, for a matrix t [R, K] quantized along K (the reduction dim of the GEMM that reads it):
    codes  float8_e4m3fn [R, K]     round-to-nearest of t / scale, saturated at +-448
    scale  fp32 [R]                 amax(|t[r, :]|) / 448 (a row of zeros gets scale 1)
    value(r, k) = float(codes[r, k]) * scale[r]
A weight [E, N, K] is quantized per expert and per output row (scale [E, N]): an expert's codes do not
depend on which rank holds it. Hopper's FP8 MMA reads both operands K-major, so the operand a GEMM
reduces along K must be stored contiguous in K (`scaled_grouped_mm` takes b as [E, K, N] with K innermost:
the transpose view of an [E, N, K] weight).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# The smallest amax given its own scale: below it a row is treated as zeros (scale 1), so no scale is
# subnormal or zero (a division by it would overflow).
_TINY_AMAX = 1e-12


def row_scales(t_RK: torch.Tensor) -> torch.Tensor:
    """fp32 [R]: amax of each row over the last dim / 448 (1 for an all-zero row)."""
    amax_R = t_RK.abs().amax(dim=-1).float()
    return torch.where(amax_R > _TINY_AMAX, amax_R / E4M3_MAX, torch.ones_like(amax_R))


def quantize_rows(t_RK: torch.Tensor, scale_R: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [..., R, K], fp32 scales [..., R]) of t quantized along its last dim; `scale_R` given, with
    those scales (values past +-448 x scale saturate)."""
    scale_R = row_scales(t_RK) if scale_R is None else scale_R
    scaled = t_RK.float() / scale_R.unsqueeze(-1)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale_R


def group_of_rows(offs_E: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the group of each row of a grouped layout whose group e ends at offs_E[e] (E for the rows
    past the last group). No host sync."""
    row_N = torch.arange(rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, row_N, right=True)


def dequantize_rows(codes_RK: torch.Tensor, scale_R: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values [..., R, K] in `dtype` (computed in fp32)."""
    return (codes_RK.float() * scale_R.unsqueeze(-1)).to(dtype)


def gemm_out_dtype(t: torch.Tensor) -> torch.dtype:
    """The output dtype of the scaled GEMMs on t's device: bf16 on CUDA (torch._scaled_grouped_mm's only one),
    fp32 on the CPU (exact emulation); callers cast to the dtype they return."""
    return torch.float32 if t.device.type == "cpu" else torch.bfloat16


def scaled_grouped_mm(a_MK: torch.Tensor, scale_a_M: torch.Tensor, b_EKN: torch.Tensor, scale_b_EN: torch.Tensor,
                      offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of a sorted by group (group e ends at offs_E[e], int32) times b[e]:
        out[m, n] = sum_k a[m, k] * scale_a[m] * b[e(m), k, n] * scale_b[e(m), n]
    a and b in e4m3, a contiguous in K, b K-innermost (an [E, N, K] tensor's .transpose(-2, -1)). Rows past the
    last group are left unwritten on CUDA (torch._scaled_grouped_mm, sm90+) and zero on the CPU, where a
    per-group loop stands in (tests and CPU runs). One opaque op on every device, so a compiled graph holds the
    same call on each, and the stand-in's host loop traces."""
    return torch.ops.moert.fp8_grouped_mm(a_MK, scale_a_M, b_EKN, scale_b_EN, offs_E, out_dtype)


def scaled_mm_on_cpu(a_MK: torch.Tensor, b_KN: torch.Tensor, scale_a_M1: torch.Tensor, scale_b_1N: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm's rowwise product for the CPU stand-ins: the e4m3 products are exact in fp32, summed in
    fp32, then scaled (torch's CPU _scaled_mm takes rowwise scales only from torch 2.13)."""
    return ((a_MK.float() @ b_KN.float()) * scale_a_M1 * scale_b_1N).to(out_dtype)


def _cuda_grouped_mm(a_MK, scale_a_M, b_EKN, scale_b_EN, offs_E, out_dtype):
    # also the fake kernel's, on fake / meta tensors: torch's own shape, layout and dtype checks of the call
    return torch._scaled_grouped_mm(a_MK, b_EKN, scale_a_M, scale_b_EN, offs=offs_E, out_dtype=out_dtype)


@torch.library.custom_op("moert::fp8_grouped_mm", mutates_args=())
def _grouped_mm(a_MK: torch.Tensor, scale_a_M: torch.Tensor, b_EKN: torch.Tensor, scale_b_EN: torch.Tensor,
                offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a_MK.device.type != "cpu":
        return _cuda_grouped_mm(a_MK, scale_a_M, b_EKN, scale_b_EN, offs_E, out_dtype)
    out_MN = a_MK.new_zeros(a_MK.shape[0], b_EKN.shape[-1], dtype=out_dtype)
    start = 0
    for e, end in enumerate(offs_E.tolist()):  # a host sync: the CPU stand-in only
        if end > start:
            out_MN[start:end] = scaled_mm_on_cpu(a_MK[start:end], b_EKN[e], scale_a_M[start:end].unsqueeze(-1),
                                                 scale_b_EN[e].unsqueeze(0), out_dtype)
        start = end
    return out_MN


@_grouped_mm.register_fake
def _(a_MK, scale_a_M, b_EKN, scale_b_EN, offs_E, out_dtype):
    if a_MK.device.type == "cpu":
        return a_MK.new_empty(a_MK.shape[0], b_EKN.shape[-1], dtype=out_dtype)
    return _cuda_grouped_mm(a_MK, scale_a_M, b_EKN, scale_b_EN, offs_E, out_dtype)

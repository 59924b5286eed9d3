"""The grouped GEMM of a frozen FP8 expert base (quant.FP8Weight), for LoRA on top of it: y = x @ W_e^T on FP8
tensor cores, the activations quantized on the fly (rowwise), the gradient flowing to x only.

    y_NO = fp8_base_grouped_linear(x_NI, weight, offs_E)     # rows sorted by expert, group e ends at offs_E[e]

Forward: x rowwise along I, the stored codes [E, O, I] (K-major as they are) with their per-(expert, output
row) scales. Backward: dX = dY @ W_e reduces along O, where the weight's scales sit: they are folded into
dY's rows (dY[n, o] * s[e(n), o], exact), which are then quantized rowwise, and the codes are read as
[E, O, I] with O innermost (one transposed copy of the codes per backward: Hopper's FP8 MMA reads K-major
operands only; keeping that copy would double the weight's bytes). Nothing of x is saved for the backward.
"""

from __future__ import annotations

import torch

from quant.fp8 import gemm_out_dtype, group_of_rows, quantize_rows, scaled_grouped_mm
from quant.weight import FP8Weight


def quantize_rows_by_expert_scales(t_NO: torch.Tensor, scales_EO: torch.Tensor, offs_E: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of t[n, o] * scales[e(n), o] (rows sorted by expert, group e ending at offs_E[e]; rows past
    the last group take the last expert's scales): the operand of a GEMM that reduces along the weight's scaled
    dim O, whose scales are folded into the rows first (exact)."""
    expert_N = group_of_rows(offs_E, t_NO.shape[0]).clamp_(max=offs_E.numel() - 1)
    return quantize_rows(t_NO.float() * scales_EO.index_select(0, expert_N))


class _FrozenFP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, offs_E: torch.Tensor, weight: FP8Weight) -> torch.Tensor:
        ctx.save_for_backward(offs_E)
        ctx.weight = weight
        xq_NI, xs_N = quantize_rows(x_NI)
        y_NO = scaled_grouped_mm(xq_NI, xs_N, weight.codes.transpose(-2, -1), weight.scales, offs_E,
                                 gemm_out_dtype(x_NI))
        return y_NO.to(x_NI.dtype)

    @staticmethod
    def backward(ctx, dy_NO: torch.Tensor):
        (offs_E,) = ctx.saved_tensors
        weight: FP8Weight = ctx.weight
        dyq_NO, dys_N = quantize_rows_by_expert_scales(dy_NO, weight.scales, offs_E)
        codes_EIO = weight.codes.transpose(-2, -1).contiguous()
        ones_EI = torch.ones(codes_EIO.shape[:2], dtype=torch.float32, device=dy_NO.device)
        dx_NI = scaled_grouped_mm(dyq_NO, dys_N, codes_EIO.transpose(-2, -1), ones_EI, offs_E,
                                  gemm_out_dtype(dy_NO))
        return dx_NI.to(dy_NO.dtype), None, None


def fp8_base_grouped_linear(x_NI: torch.Tensor, weight: FP8Weight, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows x_NI sorted by expert times the frozen W_e^T in FP8 (differentiable in x); rows past offs_E[-1]
    are left unwritten on CUDA and zero on the CPU (quant.fp8.scaled_grouped_mm)."""
    return _FrozenFP8GroupedLinear.apply(x_NI, offs_E, weight)

"""FP8 (e4m3) training of one grouped expert projection: `fp8_grouped_linear(x_NI, w_EOI, offs_E) -> y_NO`,
y[n] = x[n] @ w[e(n)]^T, differentiable in x and w, with the forward and both backward GEMMs on e4m3 operands
whose rowwise scales (quant.fp8) are computed on the fly from the current tensors: nothing is stored between
steps and the weight is never kept twice.

Shapes: N rows sorted by expert, E experts, O out, I in. offs_E: int32 cumulative group ends (group e holds rows
offs_E[e-1]..offs_E[e]-1). Rows past offs_E[-1] (the -1 slots of the compiled layout) are never read (they may
hold anything, NaN included): their output rows are 0, their dx rows are 0 and they add nothing to dw.

    GEMM                     a (reduction dim innermost)            b (reduction dim innermost)
    y    = x @ W_e^T         x rowwise along I: scale [N]           W along I: scale [E, O]
    dx   = dy @ W_e          dy rowwise along O: scale [N]          W^T [E, I, O] along O: scale [E, I]
    dW_e = dy_e^T @ x_e      dy^T [O, N] per (group, o) along the   x^T [I, N] per (group, i) along the
                             group's tokens: scale [E, O]           group's tokens: scale [E, I]

The backward keeps x, w and offs_E only: dW quantizes x along the tokens, another axis than the forward's, so
the forward's codes cannot serve. On CUDA the GEMMs output bf16 (the only output dtype of
torch._scaled_grouped_mm), cast to x's dtype (y, dx) and w's dtype (dw); on the CPU they output fp32.
dW copies dy and x into groups padded to multiples of 16 rows (the 2d-2d kernel's alignment), a static-size
buffer of N + 16 E rows, so that nothing depends on the group sizes on the host (torch.compile). The CUDA path is
not yet validated on a GPU (tests/gpu/test_fp8_training_gpu.py is written for it).
"""

from __future__ import annotations

import torch

from quant.fp8 import (
    E4M3,
    E4M3_MAX,
    gemm_out_dtype,
    group_of_rows,
    quantize_rows,
    row_scales,
    scaled_grouped_mm,
    scaled_mm_on_cpu,
)

# Rows per group of the 2d-2d GEMM's operands on CUDA: a group's start along the reduction dim must be 16-byte
# aligned for TMA (16 e4m3 values), and CUTLASS cannot run an empty group.
GROUP_ALIGN = 16


def fp8_grouped_linear(x_NI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """y_NO in x's dtype (rows past offs_E[-1] are 0); dx in x's dtype, dw in w's dtype (fp32 or bf16 masters)."""
    return _FP8GroupedLinear.apply(x_NI, w_EOI, offs_E)


class _FP8GroupedLinear(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_NI, w_EOI, offs_E):
        ctx.save_for_backward(x_NI, w_EOI, offs_E)
        xq_NI, xs_N = quantize_rows(x_NI.contiguous())
        wq_EOI, ws_EO = quantize_rows(w_EOI.contiguous())
        y_NO = scaled_grouped_mm(xq_NI, xs_N, wq_EOI.transpose(-2, -1), ws_EO, offs_E, gemm_out_dtype(x_NI))
        return _zero_tail(y_NO, offs_E).to(x_NI.dtype)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, w_EOI, offs_E = ctx.saved_tensors
        dy_NO = dy_NO.contiguous()
        dx_NI = _grad_input(dy_NO, w_EOI, offs_E).to(x_NI.dtype) if ctx.needs_input_grad[0] else None
        dw_EOI = _grad_weight(dy_NO, x_NI, offs_E).to(w_EOI.dtype) if ctx.needs_input_grad[1] else None
        return dx_NI, dw_EOI, None


def _zero_tail(t_NC: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows past the last group set to 0 (torch._scaled_grouped_mm leaves them unwritten)."""
    rows_N = torch.arange(t_NC.shape[0], device=t_NC.device)
    return torch.where((rows_N < offs_E[-1]).unsqueeze(-1), t_NC, 0)


def quantize_transposed(w_EOI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes of W^T [E, I, O], contiguous, scales [E, I]): W quantized along O per (expert, input column), the
    reduction dim of dx = dy @ W_e innermost for the MMA (the quantization itself keeps w's layout)."""
    codes_EIO, scales_EI = quantize_rows(w_EOI.transpose(-2, -1))
    return codes_EIO.contiguous(), scales_EI


def _grad_input(dy_NO: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """dx = dy @ W_e per group, W quantized along O per (expert, input column i)."""
    dyq_NO, dys_N = quantize_rows(dy_NO)
    wq_EIO, ws_EI = quantize_transposed(w_EOI)
    dx_NI = scaled_grouped_mm(dyq_NO, dys_N, wq_EIO.transpose(-2, -1), ws_EI, offs_E, gemm_out_dtype(dy_NO))
    return _zero_tail(dx_NI, offs_E)


def _grad_weight(dy_NO: torch.Tensor, x_NI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """dW_e = dy_e^T @ x_e [E, O, I] (scaled_grouped_mm_2d2d on grad_weight_operands)."""
    return scaled_grouped_mm_2d2d(*grad_weight_operands(dy_NO, x_NI, offs_E), gemm_out_dtype(x_NI))


def grad_weight_operands(dy_NO: torch.Tensor, x_NI: torch.Tensor, offs_E: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """scaled_grouped_mm_2d2d's operands for dW: (dy^T codes [O, P], scales [E, O], x^T codes viewed [P, I], scales
    [E, I], padded group ends [E]); both quantized per (group, column) along the group's tokens, on groups padded
    with zero rows to a non-zero multiple of GROUP_ALIGN (zeros change neither a scale nor a sum)."""
    E = offs_E.shape[0]
    dest_N, gid_P, offs_pad_E = _padded_layout(offs_E, x_NI.shape[0])
    dyq_OP, dys_EO = quantize_along_groups(_pad_rows(dy_NO, dest_N, gid_P.shape[0]), gid_P, E)
    xq_IP, xs_EI = quantize_along_groups(_pad_rows(x_NI, dest_N, gid_P.shape[0]), gid_P, E)
    return dyq_OP, dys_EO, xq_IP.t(), xs_EI, offs_pad_E


def _padded_layout(offs_E: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row goes when every group is padded to a non-zero multiple of GROUP_ALIGN rows: (dest_N,
    group id of each padded row gid_P (E past the last group), padded group ends offs_pad_E). Static size P
    (no host sync): P covers the worst case N + GROUP_ALIGN * E, one more row where the rows past offs_E[-1]
    land (outside every group), rounded up to GROUP_ALIGN (the row stride of the GEMM's [O, P] operand)."""
    E = offs_E.shape[0]
    P = -(-(N + GROUP_ALIGN * E + 1) // GROUP_ALIGN) * GROUP_ALIGN
    counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    padded_E = torch.clamp(-(-counts_E // GROUP_ALIGN) * GROUP_ALIGN, min=GROUP_ALIGN)
    offs_pad_E = torch.cumsum(padded_E, 0, dtype=torch.int32)
    gid_N = group_of_rows(offs_E, N)
    g_N = gid_N.clamp(max=E - 1)
    shift_N = (offs_pad_E - padded_E)[g_N] - (offs_E - counts_E)[g_N]
    rows_N = torch.arange(N, device=offs_E.device)
    dest_N = torch.where(gid_N < E, rows_N + shift_N, P - 1).long()
    gid_P = group_of_rows(offs_pad_E, P)
    return dest_N, gid_P, offs_pad_E


def _pad_rows(t_NC: torch.Tensor, dest_N: torch.Tensor, P: int) -> torch.Tensor:
    """t's rows at dest_N of a zero [P, C]; the rows past offs_E[-1] all land on the last row, outside every group
    (its scale and codes are never read)."""
    return t_NC.new_zeros(P, t_NC.shape[1]).index_copy_(0, dest_N, t_NC)


def quantize_along_groups(t_PC: torch.Tensor, gid_P: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes of t^T [C, P], contiguous: the tokens innermost; fp32 scales [E, C]): t quantized per (group,
    column) along the group's rows by quant.fp8's rowwise rule."""
    C = t_PC.shape[1]
    abs_PC = t_PC.abs().float()
    amax_EC = abs_PC.new_zeros(E + 1, C).scatter_reduce_(0, gid_P.unsqueeze(-1).expand(-1, C), abs_PC, "amax")[:E]
    scale_EC = row_scales(amax_EC.unsqueeze(-1))  # the rule of quant.fp8 on each group's amax
    scale_PC = torch.cat([scale_EC, scale_EC.new_ones(1, C)])[gid_P]
    codes_PC = (t_PC.float() / scale_PC).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes_PC.t().contiguous(), scale_EC


def scaled_grouped_mm_2d2d(a_ON: torch.Tensor, scale_a_EO: torch.Tensor, b_NI: torch.Tensor,
                           scale_b_EI: torch.Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Grouped along the reduction dim N (group e ends at offs_E[e], int32): out [E, O, I] with
        out[e, o, i] = sum_{n in group e} a[o, n] * scale_a[e, o] * b[n, i] * scale_b[e, i]
    a and b e4m3, a row-major, b column-major (the .t() of a contiguous [I, N]); an empty group gives 0.
    CUDA (sm90+): torch._scaled_grouped_mm in its 2d-2d form, out_dtype bf16; it needs every group non-empty and,
    but the last, a multiple of 16 rows (kernel asserts), N, O and I multiples of 16 (fp8_grouped_linear pads its
    groups to meet this). CPU: a per-group loop (a host sync). One opaque op on every device, as
    quant.fp8.scaled_grouped_mm."""
    return torch.ops.moert.fp8_grouped_mm_2d2d(a_ON, scale_a_EO, b_NI, scale_b_EI, offs_E, out_dtype)


def _cuda_grouped_mm_2d2d(a_ON, scale_a_EO, b_NI, scale_b_EI, offs_E, out_dtype):
    # also the fake kernel's, as quant.fp8's
    return torch._scaled_grouped_mm(a_ON, b_NI, scale_a_EO.reshape(-1), scale_b_EI.reshape(-1), offs=offs_E,
                                    out_dtype=out_dtype)


@torch.library.custom_op("moert::fp8_grouped_mm_2d2d", mutates_args=())
def _grouped_mm_2d2d(a_ON: torch.Tensor, scale_a_EO: torch.Tensor, b_NI: torch.Tensor,
                     scale_b_EI: torch.Tensor, offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a_ON.device.type != "cpu":
        return _cuda_grouped_mm_2d2d(a_ON, scale_a_EO, b_NI, scale_b_EI, offs_E, out_dtype)
    out_EOI = a_ON.new_zeros(offs_E.shape[0], a_ON.shape[0], b_NI.shape[1], dtype=out_dtype)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            out_EOI[e] = scaled_mm_on_cpu(a_ON[:, start:end], b_NI[start:end], scale_a_EO[e].unsqueeze(-1),
                                          scale_b_EI[e].unsqueeze(0), out_dtype)
        start = end
    return out_EOI


@_grouped_mm_2d2d.register_fake
def _(a_ON, scale_a_EO, b_NI, scale_b_EI, offs_E, out_dtype):
    if a_ON.device.type == "cpu":
        return a_ON.new_empty(offs_E.shape[0], a_ON.shape[0], b_NI.shape[1], dtype=out_dtype)
    return _cuda_grouped_mm_2d2d(a_ON, scale_a_EO, b_NI, scale_b_EI, offs_E, out_dtype)

"""FP8 training of a grouped expert projection (quant.fp8_training) on the CPU.

Two references: an fp64 emulation built from operands quantized here with quant.fp8's rowwise primitives (per
group, along each GEMM's reduction dim) — the FP8 path must equal it to fp32 rounding; and the unquantized
grouped linear (autograd over a per-group loop) — the FP8 path must be within FP8 error of it and measurably
off it (so FP8 is really used).
"""

from __future__ import annotations

import pytest
import torch

from quant.fp8 import dequantize_rows, quantize_rows
from quant.fp8_training import GROUP_ALIGN, _padded_layout, fp8_grouped_linear, scaled_grouped_mm_2d2d

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
I, O = 32, 48
COUNTS = (5, 0, 17, 9, 16)
# e4m3 keeps 3 mantissa bits: about 2-3% rms error per operand, so <= 8% by norm on a product of two; more than
# 0.1% off the unquantized result shows the operands were quantized.
FP8_TOL, FP8_VISIBLE = 0.08, 1e-3
# A bf16 result is the emulation rounded to bf16 (relative step 2^-8).
BF16_TOL = 4e-3


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def make_case(counts=COUNTS, tail=3, x_dtype=F32, w_dtype=F32, seed=0):
    """x [N, I] (leaf), w [E, O, I] (leaf), offs_E, dy [N, O]; the `tail` rows past the last group hold NaN."""
    g = torch.Generator().manual_seed(seed)
    valid, E = sum(counts), len(counts)
    x = torch.randn(valid + tail, I, generator=g).to(x_dtype)
    dy = torch.randn(valid + tail, O, generator=g).to(x_dtype)
    x[valid:], dy[valid:] = float("nan"), float("nan")
    w = (torch.randn(E, O, I, generator=g) * 0.1).to(w_dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x.requires_grad_(), w.requires_grad_(), offs, dy


def run_fp8(x, w, offs, dy):
    x.grad = w.grad = None
    y = fp8_grouped_linear(x, w, offs)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def groups(offs):
    starts = [0] + offs.tolist()[:-1]
    return list(enumerate(zip(starts, offs.tolist())))


def deq(t_RK: torch.Tensor) -> torch.Tensor:
    """t quantized along its last dim with quant.fp8, dequantized in fp64."""
    return dequantize_rows(*quantize_rows(t_RK), F64)


def emulated(x, w, offs, dy):
    """y, dx, dw in fp64 from operands quantized here, group by group, along each GEMM's reduction dim."""
    x, w = x.detach(), w.detach()
    y = torch.zeros(x.shape[0], O, dtype=F64)
    dx = torch.zeros(x.shape[0], I, dtype=F64)
    dw = torch.zeros(w.shape, dtype=F64)
    valid = int(offs[-1])
    x_d, dy_d = deq(x[:valid]), deq(dy[:valid])  # rowwise along I, along O
    w_d, wt_d = deq(w), deq(w.transpose(1, 2))  # along I per (e, o), along O per (e, i)
    for e, (s, t) in groups(offs):
        if t > s:
            y[s:t] = x_d[s:t] @ w_d[e].T
            dx[s:t] = dy_d[s:t] @ wt_d[e].T
            dw[e] = deq(dy[s:t].T) @ deq(x[s:t].T).T  # both along the group's tokens
    return y, dx, dw


def unquantized(x, w, offs, dy):
    """y, dx, dw of the fp64 grouped linear by autograd over a per-group loop."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = torch.zeros(x.shape[0], O, dtype=F64)
    for e, (s, t) in groups(offs):
        y = y.index_add(0, torch.arange(s, t), x64[s:t] @ w64[e].T)
    y.backward(torch.nan_to_num(dy.double(), nan=0.0))
    return y.detach(), x64.grad, w64.grad


@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (F32, BF16), (BF16, F32), (BF16, BF16)])
def test_equals_emulation_on_dequantized_operands(x_dtype, w_dtype):
    x, w, offs, dy = make_case(x_dtype=x_dtype, w_dtype=w_dtype)
    y, dx, dw = run_fp8(x, w, offs, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (x_dtype, x_dtype, w_dtype)
    for ours, ref in zip((y, dx, dw), emulated(x, w, offs, dy)):
        assert rel_err(ours, ref) <= (1e-5 if ours.dtype == F32 else BF16_TOL)


def test_close_to_unquantized_but_fp8():
    x, w, offs, dy = make_case(counts=(40, 0, 70, 33, 57), tail=5, seed=1)
    for name, ours, ref in zip(("y", "dx", "dw"), run_fp8(x, w, offs, dy), unquantized(x, w, offs, dy)):
        assert FP8_VISIBLE < rel_err(ours, ref) <= FP8_TOL, name


@pytest.mark.parametrize("counts", [(0, 7, 0, 20, 0), (0, 0, 0, 0, 11), (13, 0, 0, 0, 0)])
def test_empty_groups_and_tail(counts):
    """Empty groups get dw 0; the NaN rows past the last group give 0 output, 0 dx and leave dw as without them."""
    x, w, offs, dy = make_case(counts=counts, tail=4)
    y, dx, dw = run_fp8(x, w, offs, dy)
    valid = sum(counts)
    assert torch.all(y[valid:] == 0) and torch.all(dx[valid:] == 0)
    assert all(torch.isfinite(t).all() for t in (y, dx, dw))
    for e, (s, t) in groups(offs):
        if t == s:
            assert torch.all(dw[e] == 0)
    x_v = x.detach()[:valid].clone().requires_grad_()
    y_v, dx_v, dw_v = run_fp8(x_v, w, offs, dy[:valid])
    assert torch.equal(y_v, y[:valid]) and torch.equal(dx_v, dx[:valid]) and torch.equal(dw_v, dw)


@pytest.mark.parametrize("counts", [(5, 0, 17, 9, 16), (0, 0, 33, 1, 0), (0, 0, 0)])
def test_dw_groups_padded_for_the_cuda_kernel(counts):
    """The 2d-2d GEMM on CUDA asserts non-empty groups of a multiple of 16 rows and a 16-aligned row stride: the
    padded layout has them, and moves each valid row, in order, into its own group, the tail rows past all."""
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    N = sum(counts) + 3
    dest_N, gid_P, offs_pad = _padded_layout(offs, N)
    sizes = torch.diff(offs_pad, prepend=offs_pad.new_zeros(1))
    assert torch.all(sizes > 0) and torch.all(sizes % GROUP_ALIGN == 0) and gid_P.shape[0] % GROUP_ALIGN == 0
    assert int(offs_pad[-1]) < gid_P.shape[0]
    for e, (s, t) in groups(offs):
        start = int(offs_pad[e]) - int(sizes[e])
        assert dest_N[s:t].tolist() == list(range(start, start + t - s)) and torch.all(gid_P[dest_N[s:t]] == e)
    assert torch.all(gid_P[dest_N[sum(counts):]] == len(counts))


def test_scaled_grouped_mm_2d2d_per_group():
    """The CPU loop against fp64 products of the dequantized operands, an empty group included."""
    g = torch.Generator().manual_seed(2)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)
    a_ON, a_s = quantize_rows(torch.randn(O, 48, generator=g))
    b_IN, b_s = quantize_rows(torch.randn(I, 48, generator=g))
    scale_a_EO = torch.stack([a_s, a_s * 2, a_s / 4])  # distinct per-group scales, to check which one is used
    scale_b_EI = torch.stack([b_s, b_s / 2, b_s * 3])
    out = scaled_grouped_mm_2d2d(a_ON, scale_a_EO, b_IN.t(), scale_b_EI, offs, F32)
    assert torch.all(out[1] == 0)
    for e, (s, t) in [(0, (0, 16)), (2, (16, 48))]:
        ref = dequantize_rows(a_ON[:, s:t], scale_a_EO[e], F64) @ dequantize_rows(b_IN[:, s:t], scale_b_EI[e], F64).T
        assert rel_err(out[e], ref) <= 1e-6


def test_scaled_grouped_mm_2d2d_cuda_call_passes_torch_checks():
    """On meta tensors the CUDA branch meets torch._scaled_grouped_mm's layout, scale-size and dtype checks."""
    E, N = 3, 64
    a_ON = torch.empty(O, N, dtype=torch.float8_e4m3fn, device="meta")
    b_NI = torch.empty(I, N, dtype=torch.float8_e4m3fn, device="meta").t()
    out = scaled_grouped_mm_2d2d(a_ON, torch.empty(E, O, device="meta"), b_NI, torch.empty(E, I, device="meta"),
                                 torch.empty(E, dtype=torch.int32, device="meta"), BF16)
    assert out.shape == (E, O, I) and out.dtype == BF16

"""FP8 training of a grouped expert projection on CUDA (torch._scaled_grouped_mm, sm90+) against the same function
on the CPU (per-group torch._scaled_mm: the emulation that tests/unit/test_fp8_training.py checks exactly), eager
and under torch.compile(fullgraph=True), with uneven groups (not multiples of 16), an empty group and NaN rows
past the last group.
"""

from __future__ import annotations

import pytest
import torch

from quant.fp8_training import fp8_grouped_linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA device of sm90+ (FP8 grouped GEMM)")]

T, I, O = 512, 256, 512
COUNTS = (37, 0, 101, 64, 3, 150, 77, 50)  # 482 valid rows, 30 past the last group
# The CUDA GEMMs output bf16 (relative step 2^-8); the CPU emulation outputs fp32.
TOL = 1e-2


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def make_case(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(0)
    valid = sum(COUNTS)
    x = torch.randn(T, I, generator=g).to(x_dtype)
    dy = torch.randn(T, O, generator=g).to(x_dtype)
    x[valid:], dy[valid:] = float("nan"), float("nan")
    w = (torch.randn(len(COUNTS), O, I, generator=g) * 0.05).to(w_dtype)
    return x, w, torch.tensor(COUNTS).cumsum(0).to(torch.int32), dy


def run(fn, x, w, offs, dy, device):
    # leaves of their own: .to("cpu") of a CPU tensor is that tensor, whose grad a later CUDA copy would feed
    x = x.detach().to(device).requires_grad_()
    w = w.detach().to(device).requires_grad_()
    y = fn(x, w, offs.to(device))
    y.backward(dy.to(device))
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32)])
def test_cuda_equals_cpu_emulation(x_dtype, w_dtype):
    x, w, offs, dy = make_case(x_dtype, w_dtype)
    cpu = run(fp8_grouped_linear, x, w, offs, dy, "cpu")
    cuda = run(fp8_grouped_linear, x, w, offs, dy, "cuda")
    valid = sum(COUNTS)
    y, dx, dw = cuda
    assert (y.dtype, dx.dtype, dw.dtype) == (x_dtype, x_dtype, w_dtype)
    assert torch.all(y[valid:] == 0) and torch.all(dx[valid:] == 0) and torch.all(dw[1] == 0)
    for name, ours, ref in zip(("y", "dx", "dw"), cuda, cpu):
        assert torch.isfinite(ours).all(), name
        assert rel_err(ours, ref) <= TOL, name


@pytest.mark.xfail(strict=True, reason="compiled, dX came out all zero on an H200 (torch 2.11), eager is right: "
                   "FP8 training runs eager (Capabilities.compile_train_fp8=False on every backend)")
def test_compiled_equals_eager():
    x, w, offs, dy = make_case(torch.bfloat16, torch.float32)
    eager = run(fp8_grouped_linear, x, w, offs, dy, "cuda")
    compiled = run(torch.compile(fp8_grouped_linear, fullgraph=True), x, w, offs, dy, "cuda")
    for name, ours, ref in zip(("y", "dx", "dw"), compiled, eager):
        assert rel_err(ours, ref) <= TOL, name

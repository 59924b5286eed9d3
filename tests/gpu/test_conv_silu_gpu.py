"""GPU tests of the GDN conv's input-gradient kernel (attention/kernels/conv_silu.py), at Qwen3.5's conv width
(8192 channels, window 4), packed documents and plain rows:

- against FLA's causal_conv1d_bwd (dx of the same inputs) in bf16 and fp32, and against autograd through the
  torch op set's conv in fp32;
- through op set fla: a frozen conv weight's backward takes the kernel (gdn::conv_bwd_dx) and gives the dx the
  trainable weight's backward (FLA's) gives; torch.library.opcheck of the op.

Needs fla (its conv kernels are Triton; TileLang is not used here)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    pytest.importorskip("fla", reason="op set fla needs flash-linear-attention")
    from fla.modules.causal_conv1d import causal_conv1d_bwd

    from attention import gdn_ops_fla, gdn_ops_torch
    from attention.kernels.conv_silu import conv_silu_input_grad

D, W = 8192, 4
CU_SEQLENS = [0, 1, 3, 130, 700, 1000, 1063, 2000, 3000]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def inputs(dtype, tokens=3000, rows=1, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, tokens, D, device="cuda", generator=g).to(dtype)
    w = (torch.randn(D, W, device="cuda", generator=g) * 0.5).to(dtype)
    dy = torch.randn(rows, tokens, D, device="cuda", generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["docs", "rows"])
def test_dx_matches_fla(dtype, tol, packed):
    x, w, dy = inputs(dtype, rows=1 if packed else 3, tokens=3000 if packed else 700)
    cu = torch.tensor(CU_SEQLENS, device="cuda", dtype=torch.int32) if packed else None
    ours = conv_silu_input_grad(x, w, dy, cu)
    fla_dx = causal_conv1d_bwd(x=x, dy=dy, dht=None, weight=w, bias=None, residual=None, activation="silu",
                               cu_seqlens=cu, chunk_indices=gdn_ops_fla.chunk_indices(cu),
                               chunk_size=gdn_ops_fla.CHUNK)[0]
    assert rel_err(ours, fla_dx) <= tol


def test_dx_matches_the_torch_op_set_fp32():
    x, w, dy = inputs(torch.float32)
    cu = torch.tensor(CU_SEQLENS, device="cuda", dtype=torch.int32)
    xr = x.clone().requires_grad_(True)
    starts = gdn_ops_torch.prepare_docs(cu, 1, x.shape[1], x.device)
    gdn_ops_torch.causal_conv1d_silu(xr, w, starts).backward(dy)
    assert rel_err(conv_silu_input_grad(x, w, dy, cu), xr.grad) <= 1e-5


@pytest.mark.parametrize("packed", [True, False], ids=["docs", "rows"])
def test_a_frozen_weight_takes_the_kernel_with_flas_dx(packed):
    x, w, dy = inputs(torch.bfloat16, rows=1 if packed else 2, tokens=3000 if packed else 1000)
    cu = torch.tensor(CU_SEQLENS, device="cuda", dtype=torch.int32) if packed else None
    grads, ops = [], []
    for trainable in (False, True):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(trainable)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            gdn_ops_fla.causal_conv1d_silu(xr, wr, cu).backward(dy)
        grads.append(xr.grad)
        ops.append({e.name for e in prof.events()} & {"gdn::conv_bwd_dx", "gdn::conv_bwd"})
    assert ops == [{"gdn::conv_bwd_dx"}, {"gdn::conv_bwd"}]
    assert rel_err(grads[0], grads[1]) <= 1e-2
    torch.library.opcheck(gdn_ops_fla.conv_bwd_dx, (x, w, dy, cu))

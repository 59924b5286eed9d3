"""attention/kernels/conv_silu.py under TRITON_INTERPRET=1 (fp32, tiny shapes): the GDN conv's input gradient
against autograd through transformers' causal_conv1d_fn (torch path), run per document; whole rows without
cu_seqlens, and packed documents of length 1, 2, shorter and longer than the window, and across tiles."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from attention.kernels import conv_silu

pytestmark = pytest.mark.skipif(conv_silu.triton is None, reason="triton is not installed")
TOL = 1e-5


def hf_conv(x_1TD: torch.Tensor, w_DW: torch.Tensor) -> torch.Tensor:
    return hf_next.causal_conv1d_fn(x_1TD.transpose(1, 2), w_DW, None, activation="silu").transpose(1, 2)


def reference_dx(x_BTD, w_DW, dy_BTD, cu_seqlens):
    """autograd's dx of transformers' conv, each document (or row) on its own."""
    x = x_BTD.detach().clone().requires_grad_(True)
    bounds = [(b, s, e) for b in range(x.shape[0]) for s, e in [(0, x.shape[1])]] if cu_seqlens is None else \
        [(0, s, e) for s, e in pairwise(cu_seqlens.tolist())]
    for b, start, end in bounds:
        y = hf_conv(x[b:b + 1, start:end], w_DW)
        y.backward(dy_BTD[b:b + 1, start:end])
    return x.grad


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("cu", [None, [0, 1, 3, 6, 40, 41, 70, 100], [0, 100]], ids=["rows", "docs", "one_doc"])
@pytest.mark.parametrize("width", [4, 2])
def test_input_grad_matches_transformers_per_document(cu, width):
    g = torch.Generator().manual_seed(0)
    rows = 2 if cu is None else 1
    x = torch.randn(rows, 100 if cu else 45, 70, generator=g)  # 70 channels: a partial channel tile
    w = torch.randn(70, width, generator=g) * 0.5
    dy = torch.randn(x.shape, generator=g)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    dx = conv_silu.conv_silu_input_grad(x, w, dy, cu_seqlens)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert rel_err(dx, reference_dx(x, w, dy, cu_seqlens)) < TOL


def test_document_positions():
    cu = torch.tensor([0, 1, 3, 7], dtype=torch.int32)
    assert conv_silu.document_positions(cu, 7).tolist() == [0, 0, 1, 0, 1, 2, 3]


def test_packed_rows_need_one_flattened_row():
    x = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match=r"\[1, T, D\]"):
        conv_silu.conv_silu_input_grad(x, torch.zeros(3, 4), x, torch.tensor([0, 8], dtype=torch.int32))

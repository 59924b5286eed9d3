"""Triton kernel of the GDN conv's input gradient when its weight is frozen (LoRA): the dx of
y = silu(depthwise causal conv(x)), with no weight gradient and no stored pre-activation.

    dx_BTD = conv_silu_input_grad(x_BTD, weight_DW, dy_BTD, cu_seqlens)

x, dy [B, T, D] (B = 1 with cu_seqlens: FLA's flattened varlen layout), weight [D, W] (tap W-1 reads the token
itself, tap W-1-s the token s back), cu_seqlens int [N+1] or None (then every row is one document). Windows never
cross a document start, as in attention/gdn_ops_torch.py's reference:

    pre[v] = sum_{r <= pos(v)} w[W-1-r] * x[v-r]     pos(v): v's offset from its document's start
    dx[t]  = sum_{s : t+s in t's document} w[W-1-s] * dy[t+s] * silu'(pre[t+s])

t+s lies in t's document exactly when pos(t+s) >= s, so one int32 table of positions describes the documents.
Each program recomputes the pre-activations of its tile's next W-1 tokens (W^2 loads of shifted x tiles, which
the cache serves): the kernel reads x and dy once from memory and writes dx, where FLA's general backward also
recomputes the forward and reduces a weight gradient. fp32 arithmetic whatever the input dtype.
"""

from __future__ import annotations

import torch

from gpu.launch import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:  # the op sets that need this kernel are refused where triton is missing
    triton = None

BLOCK_T = 32  # tokens per program
BLOCK_D = 64  # channels per program
NUM_WARPS = 4


def document_positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """pos [tokens] int32: each token's offset from the start of its document (no host sync)."""
    idx = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens, idx, right=True) - 1
    return (idx - cu_seqlens[doc]).to(torch.int32)


def conv_silu_input_grad(x_BTD: torch.Tensor, weight_DW: torch.Tensor, dy_BTD: torch.Tensor,
                         cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """dx [B, T, D] in x's dtype (see the module docstring)."""
    if triton is None:
        raise RuntimeError("the GDN conv's input gradient kernel needs the triton package")
    B, T, D = x_BTD.shape
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the rows are one flattened sequence [1, T, D]; got B = {B}")
    x, w, dy = x_BTD.contiguous(), weight_DW.contiguous(), dy_BTD.contiguous()
    dx = torch.empty_like(x)
    pos = x if cu_seqlens is None else document_positions(cu_seqlens, T)  # unread without documents
    grid = (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D), B)
    _conv_silu_dx_kernel[grid](x, w, dy, pos, dx, T, D, W=w.shape[1], HAS_DOCS=cu_seqlens is not None,
                               BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=NUM_WARPS)
    return dx


if triton is not None:

    @triton.jit
    def _conv_silu_dx_kernel(x_ptr, w_ptr, dy_ptr, pos_ptr, dx_ptr, T, D, W: tl.constexpr,
                             HAS_DOCS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # int64: T * D may pass 2^31
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        row = tl.program_id(2).to(tl.int64) * T * D
        d_ok = d < D
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for s in tl.static_range(W):  # dy[t+s] reaches dx[t] through tap W-1-s
            v = t + s
            if HAS_DOCS:
                pos_v = tl.load(pos_ptr + v, mask=v < T, other=0)
            else:
                pos_v = v
            same_doc = (v < T) & (pos_v >= s)
            pre = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for r in tl.static_range(W):  # pre[v]; r <= pos(v) keeps the window inside v's document
                live = (same_doc & (pos_v >= r))[:, None] & d_ok[None, :]
                x_r = tl.load(x_ptr + row + (v - r)[:, None] * D + d[None, :], mask=live, other=0.0)
                w_r = tl.load(w_ptr + d * W + (W - 1 - r), mask=d_ok, other=0.0)
                pre += x_r.to(tl.float32) * w_r.to(tl.float32)[None, :]
            dy_v = tl.load(dy_ptr + row + v[:, None] * D + d[None, :], mask=same_doc[:, None] & d_ok[None, :],
                           other=0.0).to(tl.float32)
            sig = tl.sigmoid(pre)
            w_s = tl.load(w_ptr + d * W + (W - 1 - s), mask=d_ok, other=0.0).to(tl.float32)
            acc += dy_v * sig * (1.0 + pre * (1.0 - sig)) * w_s[None, :]
        tl.store(dx_ptr + row + t[:, None] * D + d[None, :], acc.to(dx_ptr.dtype.element_ty),
                 mask=(t < T)[:, None] & d_ok[None, :])

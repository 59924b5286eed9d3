"""Triton kernels of the GDN conv's input gradient when its weight is frozen (LoRA): the dx of
y = silu(depthwise causal conv(x)), with no weight gradient and no stored pre-activation.

    dx_BTD = conv_silu_input_grad(x_BTD, weight_DW, dy_BTD, cu_seqlens)

x, dy [B, T, D] (B = 1 with cu_seqlens: FLA's flattened varlen layout), weight [D, W] (tap W-1 reads the token
itself, tap W-1-s the token s back), cu_seqlens int [N+1] or None (then every row is one document). Windows never
cross a document start, as in attention/gdn_ops_torch.py's reference:

    pre[v] = sum_{r <= pos(v)} w[W-1-r] * x[v-r]     pos(v): v's offset from its document's start
    g[v]   = dy[v] * silu'(pre[v])
    dx[t]  = sum_{s : t+s in t's document} w[W-1-s] * g[t+s]

t+s lies in t's document exactly when pos(t+s) >= s, so one int32 table of positions describes the documents.
Two launches: g (W shifted loads of x per token, in x's dtype), then dx (W shifted loads of g). Where FLA's
general backward also recomputes the forward and reduces a weight gradient. fp32 arithmetic whatever the dtype.
"""

from __future__ import annotations

import torch

from gpu.launch import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:  # the op sets that need this kernel are refused where triton is missing
    triton = None

BLOCK_T = 64  # tokens per program
BLOCK_D = 128  # channels per program
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
    g, dx = torch.empty_like(x), torch.empty_like(x)
    pos = x if cu_seqlens is None else document_positions(cu_seqlens, T)  # unread without documents
    grid = (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D), B)
    meta = {"W": w.shape[1], "HAS_DOCS": cu_seqlens is not None, "BLOCK_T": BLOCK_T, "BLOCK_D": BLOCK_D,
            "num_warps": NUM_WARPS}
    _silu_grad_kernel[grid](x, w, dy, pos, g, T, D, **meta)
    _conv_transpose_kernel[grid](g, w, pos, dx, T, D, **meta)
    return dx


if triton is not None:

    @triton.jit
    def _tile(pid_t, pid_d, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """(tokens int64, channels, channel mask) of a program's tile (int64: T * D may pass 2^31)."""
        t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        return t, d, d < D

    @triton.jit
    def _positions(pos_ptr, v, T, HAS_DOCS: tl.constexpr):
        """pos(v) (tokens past T read 0); without documents each row is one."""
        if HAS_DOCS:
            return tl.load(pos_ptr + v, mask=v < T, other=0)
        return v

    @triton.jit
    def _silu_grad_kernel(x_ptr, w_ptr, dy_ptr, pos_ptr, g_ptr, T, D, W: tl.constexpr, HAS_DOCS: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        v, d, d_ok = _tile(tl.program_id(0), tl.program_id(1), D, BLOCK_T, BLOCK_D)
        row = tl.program_id(2).to(tl.int64) * T * D
        pos_v = _positions(pos_ptr, v, T, HAS_DOCS)
        live_v = (v < T)[:, None] & d_ok[None, :]
        pre = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for r in tl.static_range(W):  # r <= pos(v) keeps the window inside v's document
            x_r = tl.load(x_ptr + row + (v - r)[:, None] * D + d[None, :], mask=live_v & (pos_v >= r)[:, None],
                          other=0.0)
            w_r = tl.load(w_ptr + d * W + (W - 1 - r), mask=d_ok, other=0.0)
            pre += x_r.to(tl.float32) * w_r.to(tl.float32)[None, :]
        dy = tl.load(dy_ptr + row + v[:, None] * D + d[None, :], mask=live_v, other=0.0).to(tl.float32)
        sig = tl.sigmoid(pre)
        g = dy * sig * (1.0 + pre * (1.0 - sig))
        tl.store(g_ptr + row + v[:, None] * D + d[None, :], g.to(g_ptr.dtype.element_ty), mask=live_v)

    @triton.jit
    def _conv_transpose_kernel(g_ptr, w_ptr, pos_ptr, dx_ptr, T, D, W: tl.constexpr, HAS_DOCS: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t, d, d_ok = _tile(tl.program_id(0), tl.program_id(1), D, BLOCK_T, BLOCK_D)
        row = tl.program_id(2).to(tl.int64) * T * D
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for s in tl.static_range(W):  # g[t+s] reaches dx[t] through tap W-1-s, within t's document
            v = t + s
            same_doc = (v < T) & (_positions(pos_ptr, v, T, HAS_DOCS) >= s)
            g_s = tl.load(g_ptr + row + v[:, None] * D + d[None, :], mask=same_doc[:, None] & d_ok[None, :],
                          other=0.0)
            w_s = tl.load(w_ptr + d * W + (W - 1 - s), mask=d_ok, other=0.0)
            acc += g_s.to(tl.float32) * w_s.to(tl.float32)[None, :]
        tl.store(dx_ptr + row + t[:, None] * D + d[None, :], acc.to(dx_ptr.dtype.element_ty),
                 mask=(t < T)[:, None] & d_ok[None, :])

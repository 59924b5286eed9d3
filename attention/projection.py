"""Linear projections of one input, LoRA included, as one GEMM forward and one for the input's gradient.

    q, k, v = fused_linear(x, [linear_part(m) for m in (q_proj, k_proj, v_proj)])
    y, = fused_linear(x, [LinearPart(weight, bias, lora_A, lora_B, scaling)])   # one LoRA linear

Each part computes x W^T + b + scaling x A^T B^T (W [O, K], A [r, K], B [O, r]; no LoRA: A = B = None).
Why one node: q, k and v read the same input, and a LoRA branch added to its base output costs a pass over that
output (plus a copy of it in an out-of-place addmm). Here the rank-sized products join the GEMM along K:
    forward   y   = [x | x A^T] @ [W | blockdiag(s B)]^T           (A, B, s: every part's, stacked)
    backward  dx  = [dy | dy blockdiag(s B)] @ [W ; A]
so base and LoRA leave one GEMM with one write of y (of dx), and q, k, v's input gradients need no sum.
Computes in autocast's dtype where autocast is on (casting the parameters itself), else in x's; keeps for
backward what the separate linears kept: x, x A^T and the (cast) parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from gpu.device import compute_dtype


class LinearPart(NamedTuple):
    """What one projection computes: x W^T + b + scaling x A^T B^T (None: no bias, no LoRA)."""
    weight: torch.Tensor  # [O, K]
    bias: torch.Tensor | None = None  # [O]
    lora_A: torch.Tensor | None = None  # [r, K]
    lora_B: torch.Tensor | None = None  # [O, r]
    scaling: float = 1.0


def joins_fused_projection(m: nn.Module) -> bool:
    """Whether linear_part(m) is what m's forward computes: a plain nn.Linear, or a module whose
    `joins_fused_projection` says so (runtime.lora.LoRALinear without dropout). Any other module (torchao's
    Float8Linear, LoRA with dropout) runs its own forward."""
    return type(m) is nn.Linear or getattr(m, "joins_fused_projection", False)


def linear_part(m: nn.Module) -> LinearPart:
    """The part a projection module computes: a plain nn.Linear's weight and bias, or what a module with
    `linear_part()` (runtime.lora.LoRALinear) names. Any other module has a forward of its own (e.g. torchao's
    Float8Linear) and cannot join a fused projection: the caller must not fuse it."""
    if type(m) is nn.Linear:
        return LinearPart(m.weight, m.bias)
    own = getattr(m, "linear_part", None)
    if own is None:
        raise TypeError(f"{type(m).__name__} has its own forward and cannot join a fused projection")
    return own()


def fused_linear(x: torch.Tensor, parts: Sequence[LinearPart]) -> tuple[torch.Tensor, ...]:
    """[x W_i^T + b_i + s_i x A_i^T B_i^T for every part]: views of one [..., sum O_i] output."""
    flat = [t for p in parts for t in (p.weight, p.bias, p.lora_A, p.lora_B)]
    y = _FusedLinear.apply(x, tuple(p.scaling for p in parts), *flat)
    return y.split([p.weight.shape[0] for p in parts], dim=-1)


def _cat_mm(lhs: list[torch.Tensor], rhs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(lhs, 1) @ torch.cat(rhs)


@torch.library.custom_op("attention::stacked_mm", mutates_args=())
def _stacked_mm_op(lhs: list[torch.Tensor], rhs: list[torch.Tensor]) -> torch.Tensor:
    return _cat_mm(lhs, rhs)


@_stacked_mm_op.register_fake
def _(lhs, rhs):
    return lhs[0].new_empty(lhs[0].shape[0], rhs[0].shape[1])


def _stacked_mm(lhs: list[torch.Tensor], rhs: list[torch.Tensor]) -> torch.Tensor:
    """[lhs_0 | lhs_1 ...] @ [rhs_0 ; rhs_1 ...]. Compiled, an opaque op: the partitioner would otherwise keep the
    parameters' concatenation (an mm operand it may not recompute) from forward to backward, a copy of the
    weights per layer; inside the op it is a transient of backward, as in eager."""
    if len(lhs) == 1 and len(rhs) == 1:
        return lhs[0] @ rhs[0]
    return (_stacked_mm_op if torch.compiler.is_compiling() else _cat_mm)(lhs, rhs)


def _scaled_block_diagonal(Bs: Sequence[torch.Tensor | None], scalings: Sequence[float], sizes: Sequence[int],
                           like: torch.Tensor) -> torch.Tensor:
    """blockdiag(s_i B_i) [sum O_i, sum r_i]; a part without LoRA is a block of zero columns."""
    return torch.block_diag(*(like.new_zeros(o, 0) if b is None else b * s for b, s, o in zip(Bs, scalings, sizes)))


class _FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scalings, *flat):
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            ws, bs, As, Bs = ([None if t is None else t.to(dtype) for t in flat[i::4]] for i in range(4))
            x_ = x.to(dtype)
            x2 = x_.flatten(0, -2)
            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            lora = any(a is not None for a in As)
            xa = None
            if lora:
                xa = x2 @ torch.cat([a for a in As if a is not None]).t()  # [N, R]
                b_s = _scaled_block_diagonal(Bs, scalings, [t.shape[0] for t in ws], w)
                lhs, rhs = torch.cat([x2, xa], 1), torch.cat([w, b_s], 1)
            else:
                lhs, rhs = x2, w
            if any(b is not None for b in bs):
                bias = torch.cat([w.new_zeros(t.shape[0]) if b is None else b for b, t in zip(bs, ws)])
                y = torch.addmm(bias, lhs, rhs.t())
            else:
                y = lhs @ rhs.t()
        # A's copy only where backward takes x's gradient (the first block's input needs none)
        ctx.save_for_backward(x_, xa, *ws, *(As if x.requires_grad else [None] * len(As)), *Bs)
        ctx.scalings, ctx.x_dtype = scalings, x.dtype
        ctx.param_dtypes = [None if t is None else t.dtype for t in flat]
        ctx.has_bias = [b is not None for b in bs]
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_y):
        x_, xa, *params = ctx.saved_tensors
        n = len(ctx.scalings)
        ws, As, Bs = params[:n], params[n:2 * n], params[2 * n:]
        need_x, _, *need = ctx.needs_input_grad
        sizes = [w.shape[0] for w in ws]
        ranks = [0 if b is None else b.shape[1] for b in Bs]
        gy = grad_y.flatten(0, -2).to(x_.dtype)
        x2 = x_.flatten(0, -2)
        lora = xa is not None
        gyb = gy @ _scaled_block_diagonal(Bs, ctx.scalings, sizes, ws[0]) if lora else None  # [N, R]
        grad_x = None
        if need_x:
            lhs, rhs = ([gy, gyb], [*ws, *(a for a in As if a is not None)]) if lora else ([gy], list(ws))
            grad_x = _stacked_mm(lhs, rhs).view(x_.shape).to(ctx.x_dtype)
        grads = [None] * (4 * n)
        need_w, need_b, need_a, need_bb = (need[i::4] for i in range(4))
        gys = gy.split(sizes, 1)
        if any(need_w):  # one GEMM over every part (a full fine-tune trains all), its rows split
            for i, g in enumerate((gy.t() @ x2).split(sizes)):
                grads[4 * i] = g if need_w[i] else None
        if any(need_a):
            for i, g in zip([i for i in range(n) if ranks[i]], (gyb.t() @ x2).split([r for r in ranks if r])):
                grads[4 * i + 2] = g if need_a[i] else None
        for i in range(n):
            if need_b[i] and ctx.has_bias[i]:
                grads[4 * i + 1] = gys[i].sum(0)
            if need_bb[i] and ranks[i]:
                grads[4 * i + 3] = (gys[i].t() @ xa.narrow(1, sum(ranks[:i]), ranks[i])) * ctx.scalings[i]
        grads = [g if g is None else g.to(dt) for g, dt in zip(grads, ctx.param_dtypes)]
        return (grad_x, None, *grads)

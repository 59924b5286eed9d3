"""GDN op set `fla`: flash-linear-attention 0.6.0 CUDA kernels as opaque torch.library custom ops.

Same contract as attention/gdn_ops_torch.py (see attention/gdn.py):
    docs = prepare_docs(cu_seqlens, B, S, device)       # the collator's cu_seqlens (or None), unchanged
    y_BSD = causal_conv1d_silu(x_BSD, weight_DW, docs)
    o_BSHV = chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, docs)

With cu_seqlens the B rows are flattened to one varlen sequence [1, B*S] (FLA's packed layout); without,
the rows stay a batch of independent sequences. Forward and backward are separate custom ops
(gdn::conv_fwd/conv_bwd, gdn::gdr_fwd/gdr_bwd) with fake implementations, so torch.compile keeps them
as opaque nodes: what FLA does with cu_seqlens on the host (chunk indices, a device sync) never enters
a traced graph. gdr_fwd returns its backward residuals (normalized q/k, their inverse norms, the
chunk-local cumulative decay and the WY matrix A) as extra outputs, so backward recomputes nothing.

Numerics are FLA's own: the delta rule here returns bit for bit what FLA's public
fla.ops.gated_delta_rule.chunk_gated_delta_rule returns (o and every input gradient, fp32 and bf16;
tests/gpu/test_precision_gpu.py). Upstream in FLA 0.6.0 on Hopper, fp32 inputs: its GEMMs take fp32
operands as TF32 (o and input grads ~2e-3 from fp64), and the gradient of g degrades as the decay
strengthens: norm-relative 2.6e-3 for g ~ U(-1, -0.05) per token, 1.3e-2 for U(-5, -1), 1.4 for
U(-20, -5); at strongly decayed tokens it is rounding noise (~1e-4 where the exact value is < 1e-9),
which A_log's gradient (sum of dg * g) multiplies by |g|. At HF's initial decays (A up to 16, g down to
-470) A_log's gradient is off by 1.5..5 norm-relative. bf16 inputs are unaffected (<= 5e-3 at every
decay). For exact fp32 decay gradients use op set torch (docs/validation.md, 2026-11-23 FLA diagnosis).

FLA internals used (their signatures changed between 0.4 and 0.6; tests/gpu/test_gdn_gpu.py guards them):
l2norm_fwd/l2norm_bwd, chunk_gated_delta_rule_fwd/chunk_gated_delta_rule_bwd, causal_conv1d_fwd/
causal_conv1d_bwd, prepare_chunk_indices. On Hopper with Triton < 3.7.1 FLA routes the gated backward
to its TileLang kernel (FLA issue #640), so tilelang must be installed there.
"""

import torch
from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd
from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from fla.ops.utils.index import prepare_chunk_indices
from torch import Tensor

CHUNK = 64  # FLA's gated delta rule chunk size; also the row count of its A matrix per token


def chunk_indices(cu_seqlens: Tensor | None) -> Tensor | None:
    # FLA memoizes this on the identity of cu_seqlens, so fwd and bwd of every layer share one result.
    return None if cu_seqlens is None else prepare_chunk_indices(cu_seqlens, CHUNK)


# ---- causal conv1d + SiLU -------------------------------------------------------------------------

@torch.library.custom_op("gdn::conv_fwd", mutates_args=(), device_types="cuda")
def conv_fwd(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    with torch.cuda.device(x.device):
        y, _ = causal_conv1d_fwd(x=x.contiguous(), weight=weight.contiguous(), bias=None, residual=None,
                                 activation="silu", cu_seqlens=cu_seqlens,
                                 chunk_indices=chunk_indices(cu_seqlens), chunk_size=CHUNK)
    return y


@conv_fwd.register_fake
def _(x, weight, cu_seqlens):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("gdn::conv_bwd", mutates_args=(), device_types="cuda")
def conv_bwd(x: Tensor, weight: Tensor, dy: Tensor, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    with torch.cuda.device(x.device):
        dx, dw, _, _, _ = causal_conv1d_bwd(x=x.contiguous(), dy=dy.contiguous(), dht=None,
                                            weight=weight.contiguous(), bias=None, residual=None,
                                            activation="silu", cu_seqlens=cu_seqlens,
                                            chunk_indices=chunk_indices(cu_seqlens), chunk_size=CHUNK)
    return dx, dw


@conv_bwd.register_fake
def _(x, weight, dy, cu_seqlens):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format))


def _conv_setup(ctx, inputs, output):
    x, weight, cu_seqlens = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)


def _conv_backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = conv_bwd(x, weight, dy, cu_seqlens)
    return dx, dw, None


conv_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)


# ---- gated delta rule (q/k L2 norm inside) -------------------------------------------------------

@torch.library.custom_op("gdn::gdr_fwd", mutates_args=(), device_types="cuda")
def gdr_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None,
            scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, A): o and the residuals of gdr_bwd."""
    with torch.cuda.device(q.device):
        q_n, q_rstd = l2norm_fwd(q.contiguous())
        k_n, k_rstd = l2norm_fwd(k.contiguous())
        g_cum, o, A, _, _, _ = chunk_gated_delta_rule_fwd(
            q=q_n, k=k_n, v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(), scale=scale,
            initial_state=None, output_final_state=False, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(cu_seqlens), chunk_size=CHUNK)
    return o.to(v.dtype), q_n, q_rstd, k_n, k_rstd, g_cum, A


@gdr_fwd.register_fake
def _(q, k, v, g, beta, cu_seqlens, scale):
    B, T, HV, _ = v.shape
    return (v.new_empty(v.shape), q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32),
            k.new_empty(k.shape), k.new_empty(k.shape[:-1], dtype=torch.float32),
            g.new_empty(g.shape, dtype=torch.float32), k.new_empty(B, T, HV, CHUNK))


@torch.library.custom_op("gdn::gdr_bwd", mutates_args=(), device_types="cuda")
def gdr_bwd(do: Tensor, q_n: Tensor, q_rstd: Tensor, k_n: Tensor, k_rstd: Tensor, v: Tensor, g_cum: Tensor,
            beta: Tensor, A: Tensor, cu_seqlens: Tensor | None, scale: float
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta); dg in fp32."""
    # v and beta are the caller's tensors (saved from gdr_fwd's inputs): possibly strided views.
    v, beta = v.contiguous(), beta.contiguous()
    with torch.cuda.device(do.device):
        dq, dk, dv, dbeta, dg, _, _, _ = chunk_gated_delta_rule_bwd(
            q=q_n, k=k_n, v=v, g=g_cum, beta=beta, A=A, scale=scale, initial_state=None,
            do=do.contiguous(), dht=None, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices(cu_seqlens),
            chunk_size=CHUNK)
        dq = l2norm_bwd(q_n, q_rstd, dq)
        dk = l2norm_bwd(k_n, k_rstd, dk)
    return dq.to(q_n.dtype), dk.to(k_n.dtype), dv.to(v.dtype), dg.float(), dbeta.to(beta.dtype)


@gdr_bwd.register_fake
def _(do, q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, cu_seqlens, scale):
    return (q_n.new_empty(q_n.shape), k_n.new_empty(k_n.shape), v.new_empty(v.shape),
            g_cum.new_empty(g_cum.shape), beta.new_empty(beta.shape))


def _gdr_setup(ctx, inputs, output):
    _, _, v, g, beta, cu_seqlens, scale = inputs
    _, q_n, q_rstd, k_n, k_rstd, g_cum, A = output
    ctx.save_for_backward(q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, cu_seqlens)
    ctx.scale, ctx.g_dtype = scale, g.dtype


def _gdr_backward(ctx, do, *residual_grads):
    # Residual outputs only feed gdr_bwd; nothing differentiates through them.
    q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dg, dbeta = gdr_bwd(do, q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, cu_seqlens, ctx.scale)
    return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, None


gdr_fwd.register_autograd(_gdr_backward, setup_context=_gdr_setup)


# ---- op-set contract ------------------------------------------------------------------------------

def prepare_docs(cu_seqlens: Tensor | None, batch: int, seq: int, device) -> Tensor | None:
    return cu_seqlens


def _as_varlen(x: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    """[B, S, ...] -> [1, B*S, ...] when packed (FLA's varlen layout); unchanged otherwise."""
    return x if cu_seqlens is None else x.reshape(1, -1, *x.shape[2:])


def causal_conv1d_silu(x_BSD: Tensor, weight_DW: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    return conv_fwd(_as_varlen(x_BSD, cu_seqlens), weight_DW, cu_seqlens).view(x_BSD.shape)


def chunk_gated_delta_rule(q_BSHK: Tensor, k_BSHK: Tensor, v_BSHV: Tensor, g_BSH: Tensor, beta_BSH: Tensor,
                           cu_seqlens: Tensor | None) -> Tensor:
    q, k, v, g, beta = (_as_varlen(t, cu_seqlens) for t in (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH))
    o = gdr_fwd(q, k, v, g, beta, cu_seqlens, q_BSHK.shape[-1] ** -0.5)[0]
    return o.view(v_BSHV.shape)

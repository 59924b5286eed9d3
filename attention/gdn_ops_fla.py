"""GDN op set `fla`: flash-linear-attention 0.6.0 CUDA kernels as opaque torch.library custom ops.

Same contract as attention/gdn_ops_torch.py (see attention/gdn.py):
    docs = prepare_docs(cu_seqlens, B, S, device)       # the collator's cu_seqlens (or None), unchanged
    y_BSD = causal_conv1d_silu(x_BSD, weight_DW, docs)
    o_BSHV = chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, docs)
    o_BSHV, S_BHKV = chunk_gated_delta_rule(..., docs, initial_state=S0_BHKV, output_final_state=True)

With cu_seqlens the B rows are flattened to one varlen sequence [1, B*S] (FLA's packed layout); without,
the rows stay a batch of independent sequences. Forward and backward are separate custom ops
(gdn::conv_fwd/conv_bwd, gdn::gdr_fwd/gdr_bwd) with fake implementations, so torch.compile keeps them
as opaque nodes: what FLA does with cu_seqlens on the host (chunk indices, a device sync) never enters
a traced graph. gdr_fwd returns its backward residuals (normalized q/k, their inverse norms, the
chunk-local cumulative decay and the WY matrix A) as extra outputs, so backward recomputes nothing.

Initial and final states are FLA's, per sequence: [N, HV, K, V] for the N documents of cu_seqlens (B
without), read as fp32, the final state and dh0 fp32. The contract's per-row states map onto them outside
the ops (differentiable index ops of static shape): row b's state initializes the sequence that starts at
column 0 (every row start is a boundary of the collator's cu_seqlens), other sequences start from zeros,
and row b's final state is its last sequence's. gdr_fwd's final-state output is empty (0 elements) without
output_final_state, gdr_bwd's dh0 without an initial state: tensors, not None, so the schemas stay plain.

Numerics are FLA's own: the delta rule here returns bit for bit what FLA's public
fla.ops.gated_delta_rule.chunk_gated_delta_rule returns (o and every input gradient, fp32 and bf16;
tests/gpu/test_precision_gpu.py). Upstream FLA on Hopper with fp32 inputs takes fp32 GEMM operands as TF32,
so the gradient of g, formed from terms that cancel, degrades as the decay strengthens, down to rounding
noise at strongly decayed tokens, which A_log's gradient (sum of dg * g) multiplies by |g|: at HF's initial
decays A_log's gradient is wrong. bf16 inputs are unaffected. For exact fp32 decay gradients use op set torch
(docs/benchmarks.md#precision).

FLA internals used (their signatures changed between 0.4 and 0.6; tests/gpu/test_gdn_gpu.py guards them):
l2norm_fwd/l2norm_bwd, chunk_gated_delta_rule_fwd/chunk_gated_delta_rule_bwd, causal_conv1d_fwd/
causal_conv1d_bwd, prepare_chunk_indices. A frozen conv weight (LoRA) takes our input-gradient kernel
(attention/kernels/conv_silu.py) instead of causal_conv1d_bwd, which always recomputes the forward and reduces
the weight's gradient. On Hopper with Triton 3.4 to 3.7.0 FLA routes the gated backward
to its TileLang kernel (FLA issue #640) and raises at the first backward where that backend cannot run;
`backward_refusal()` asks FLA's own flags beforehand, so the op set is refused (or `auto` passed over) at
build time instead.
"""

import torch
import triton
from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd
from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
from fla.ops.common.backends.tilelang import CommonTileLangBackend
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from fla.ops.utils.index import prepare_chunk_indices
from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
from torch import Tensor

from attention.kernels.conv_silu import conv_silu_input_grad

CHUNK = 64  # FLA's gated delta rule chunk size; also the row count of its A matrix per token


def backward_refusal() -> str | None:
    """Why FLA would refuse the gated delta rule's backward on this device, with the fix; None when it runs.
    The same test as FLA's chunk_bwd_dqkwg (Triton 3.4 to 3.7.0 on Hopper) and its backend dispatch (the
    TileLang backend installed, nvcc usable, not disabled by FLA_TILELANG=0)."""
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    if CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled():
        return None
    return (f"flash-linear-attention's gated backward refuses Triton {triton.__version__} on Hopper (FLA issue "
            "#640) unless its TileLang backend can run: pip install tilelang (nvcc on PATH, FLA_TILELANG not 0), "
            "or Triton >= 3.7.1; or use op set 'torch'")


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


@torch.library.custom_op("gdn::conv_bwd_dx", mutates_args=(), device_types="cuda")
def conv_bwd_dx(x: Tensor, weight: Tensor, dy: Tensor, cu_seqlens: Tensor | None) -> Tensor:
    with torch.cuda.device(x.device):
        return conv_silu_input_grad(x, weight, dy, cu_seqlens)


@conv_bwd_dx.register_fake
def _(x, weight, dy, cu_seqlens):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _conv_setup(ctx, inputs, output):
    x, weight, cu_seqlens = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)


def _conv_backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:  # a frozen conv (LoRA): FLA's backward would still reduce dw
        return conv_bwd_dx(x, weight, dy, cu_seqlens), None, None
    dx, dw = conv_bwd(x, weight, dy, cu_seqlens)
    return dx, dw, None


conv_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)


# ---- gated delta rule (q/k L2 norm inside) -------------------------------------------------------

@torch.library.custom_op("gdn::gdr_fwd", mutates_args=(), device_types="cuda")
def gdr_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
            cu_seqlens: Tensor | None, scale: float, output_final_state: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final_state, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, A): o, the final states [N, HV, K, V] fp32
    (empty without output_final_state) and the residuals of gdr_bwd."""
    with torch.cuda.device(q.device):
        q_n, q_rstd = l2norm_fwd(q.contiguous())
        k_n, k_rstd = l2norm_fwd(k.contiguous())
        g_cum, o, A, final_state, _, _ = chunk_gated_delta_rule_fwd(
            q=q_n, k=k_n, v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(), scale=scale,
            initial_state=None if initial_state is None else initial_state.contiguous(),
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(cu_seqlens), chunk_size=CHUNK)
    if final_state is None:
        final_state = v.new_empty(0, dtype=torch.float32)
    return o.to(v.dtype), final_state, q_n, q_rstd, k_n, k_rstd, g_cum, A


def _num_states(v: Tensor, cu_seqlens: Tensor | None):
    """N of FLA's per-sequence states: the documents of cu_seqlens, else the rows."""
    return v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@gdr_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state):
    B, T, HV, V = v.shape
    state_shape = (_num_states(v, cu_seqlens), HV, k.shape[-1], V) if output_final_state else (0,)
    return (v.new_empty(v.shape), v.new_empty(state_shape, dtype=torch.float32), q.new_empty(q.shape),
            q.new_empty(q.shape[:-1], dtype=torch.float32), k.new_empty(k.shape),
            k.new_empty(k.shape[:-1], dtype=torch.float32), g.new_empty(g.shape, dtype=torch.float32),
            k.new_empty(B, T, HV, CHUNK))


@torch.library.custom_op("gdn::gdr_bwd", mutates_args=(), device_types="cuda")
def gdr_bwd(do: Tensor, dht: Tensor | None, q_n: Tensor, q_rstd: Tensor, k_n: Tensor, k_rstd: Tensor, v: Tensor,
            g_cum: Tensor, beta: Tensor, A: Tensor, initial_state: Tensor | None, cu_seqlens: Tensor | None,
            scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta, dh0); dg and dh0 in fp32, dh0 empty without an initial state. dht: the final
    states' gradient [N, HV, K, V] (None: the final state was not asked for)."""
    # v and beta are the caller's tensors (saved from gdr_fwd's inputs): possibly strided views.
    v, beta = v.contiguous(), beta.contiguous()
    with torch.cuda.device(do.device):
        dq, dk, dv, dbeta, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
            q=q_n, k=k_n, v=v, g=g_cum, beta=beta, A=A, scale=scale,
            initial_state=None if initial_state is None else initial_state.contiguous(),
            do=do.contiguous(), dht=None if dht is None else dht.contiguous(), cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices(cu_seqlens), chunk_size=CHUNK)
        dq = l2norm_bwd(q_n, q_rstd, dq)
        dk = l2norm_bwd(k_n, k_rstd, dk)
    if dh0 is None:
        dh0 = v.new_empty(0, dtype=torch.float32)
    return dq.to(q_n.dtype), dk.to(k_n.dtype), dv.to(v.dtype), dg.float(), dbeta.to(beta.dtype), dh0.float()


@gdr_bwd.register_fake
def _(do, dht, q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, initial_state, cu_seqlens, scale):
    dh0_shape = (0,) if initial_state is None else initial_state.shape
    return (q_n.new_empty(q_n.shape), k_n.new_empty(k_n.shape), v.new_empty(v.shape),
            g_cum.new_empty(g_cum.shape), beta.new_empty(beta.shape), v.new_empty(dh0_shape, dtype=torch.float32))


def _gdr_setup(ctx, inputs, output):
    _, _, v, g, beta, initial_state, cu_seqlens, scale, output_final_state = inputs
    _, _, q_n, q_rstd, k_n, k_rstd, g_cum, A = output
    ctx.save_for_backward(q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, initial_state, cu_seqlens)
    ctx.scale, ctx.g_dtype, ctx.output_final_state = scale, g.dtype, output_final_state


def _gdr_backward(ctx, do, dht, *residual_grads):
    # Residual outputs only feed gdr_bwd; nothing differentiates through them.
    q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, initial_state, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0 = gdr_bwd(do, dht if ctx.output_final_state else None, q_n, q_rstd, k_n, k_rstd, v,
                                         g_cum, beta, A, initial_state, cu_seqlens, ctx.scale)
    dh0 = None if initial_state is None else dh0.to(initial_state.dtype)
    return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, dh0, None, None, None


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
                           cu_seqlens: Tensor | None, initial_state: Tensor | None = None,
                           output_final_state: bool = False):
    """o_BSHV, or (o_BSHV, S_BHKV fp32) with output_final_state; initial_state S0_BHKV (None: zeros) as in
    attention/gdn_ops_torch.py: row b's state before its first token, read up to its first document start."""
    B, S = v_BSHV.shape[:2]
    q, k, v, g, beta = (_as_varlen(t, cu_seqlens) for t in (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH))
    first_seq_B = last_seq_B = None
    if cu_seqlens is not None and (initial_state is not None or output_final_state):
        # the sequences starting and ending each row: every row start and end is a boundary of cu_seqlens
        row_starts = torch.arange(B + 1, device=cu_seqlens.device, dtype=cu_seqlens.dtype) * S
        seq_B1 = torch.searchsorted(cu_seqlens, row_starts)
        first_seq_B, last_seq_B = seq_B1[:-1], seq_B1[1:] - 1
    h0 = initial_state
    if initial_state is not None and first_seq_B is not None:
        h0 = initial_state.new_zeros(cu_seqlens.shape[0] - 1, *initial_state.shape[1:]).index_copy(
            0, first_seq_B, initial_state)
    o, final_state = gdr_fwd(q, k, v, g, beta, h0, cu_seqlens, q_BSHK.shape[-1] ** -0.5, output_final_state)[:2]
    o_BSHV = o.view(v_BSHV.shape)
    if not output_final_state:
        return o_BSHV
    return o_BSHV, final_state if last_seq_B is None else final_state.index_select(0, last_seq_B)

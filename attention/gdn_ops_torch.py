"""GDN op set `torch`: causal conv and chunked gated delta rule in plain PyTorch, exact for packed rows.

The CPU path and the numerical reference of the `fla` op set (same three functions, same contract):

    docs = prepare_docs(cu_seqlens, B, S, device)       # what the ops need to reset at document starts
    y_BSD = causal_conv1d_silu(x_BSD, weight_DW, docs)   # depthwise causal conv, window reset per document
    o_BSHV = chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, docs)
    o_BSHV, S_BHKV = chunk_gated_delta_rule(..., docs, initial_state=S0_BHKV, output_final_state=True)

Shapes: B rows, S tokens per row, D conv channels, W conv width, H key heads, HV value heads (a
multiple of H; key head h serves value heads h*HV/H .. (h+1)*HV/H - 1), K / V head dims.
q and k are L2-normalized inside (eps 1e-6, fp32) and q is scaled by K^-0.5; g is the log decay (<= 0)
and beta the write strength, per token and value head. Math runs in fp32, outputs have the input dtype.

Documents: `docs` is starts_BS, True where a document starts (cu_seqlens over the flattened B*S
tokens, which never crosses a row; cu_seqlens None = one document per row). Resets are masks, not
control flow, so torch.compile sees fixed shapes and no data-dependent op:
- conv: tap s of token t is used only if t sits at least s tokens into its document;
- delta rule: inside a chunk, token j influences token i only when both lie in the same document,
  and token i reads the state carried into the chunk only when no document starts between the chunk
  start and i. The chunked (WY) algebra is unchanged otherwise, so the result is exactly that of the
  token-by-token recurrence with the state zeroed at every document start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2_EPS = 1e-6


def prepare_docs(cu_seqlens: torch.Tensor | None, batch: int, seq: int, device) -> torch.Tensor:
    """starts_BS: True at every document start (always at column 0)."""
    starts = torch.zeros(batch * seq, dtype=torch.bool, device=device)
    if cu_seqlens is not None:
        starts[cu_seqlens[:-1].long()] = True
    starts_BS = starts.view(batch, seq)
    starts_BS[:, 0] = True
    return starts_BS


def position_in_doc(starts_BS: torch.Tensor) -> torch.Tensor:
    """Offset of every token from the start of its document, [B, S] long."""
    idx_S = torch.arange(starts_BS.shape[1], device=starts_BS.device)
    last_start_BS = torch.where(starts_BS, idx_S, 0).cummax(dim=-1).values
    return idx_S - last_start_BS


def causal_conv1d_silu(x_BSD: torch.Tensor, weight_DW: torch.Tensor, starts_BS: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) with the window cut at document starts: y[t] = sum_s w[W-1-s] x[t-s]."""
    S, W = x_BSD.shape[1], weight_DW.shape[1]
    pos_BS1 = position_in_doc(starts_BS).unsqueeze(-1)
    x = x_BSD.float()
    w = weight_DW.float()
    y = x * w[:, W - 1]
    for s in range(1, W):
        shifted = F.pad(x, (0, 0, s, 0))[:, :S]  # x[t - s], zeros before the row start
        y = y + torch.where(pos_BS1 >= s, shifted, 0.0) * w[:, W - 1 - s]
    return F.silu(y).to(x_BSD.dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def to_chunks(x_BSHF: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[B, S, H, F] -> [B, H, N, C, F] in fp32, zero-padded to N * C tokens."""
    pad = num_chunks * CHUNK - x_BSHF.shape[1]
    x = F.pad(x_BSHF.float(), (0, 0, 0, 0, 0, pad))
    return x.transpose(1, 2).unflatten(2, (num_chunks, CHUNK))


def chunk_masks(starts_BS: torch.Tensor, num_chunks: int):
    """Document masks per chunk, [B, 1, N, ...] (broadcast over heads).

    same_doc_ij: i and j in one document and j <= i; carry_i: i still sees the state entering the chunk;
    to_end_j: j lies in the chunk's last document (its update reaches the state leaving the chunk).
    """
    pad = num_chunks * CHUNK - starts_BS.shape[1]
    starts = F.pad(starts_BS, (0, pad)).view(starts_BS.shape[0], 1, num_chunks, CHUNK)
    seg = starts.int().cumsum(-1)  # document index inside the chunk; 0 = continues from before
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=starts.device).tril()
    same_doc = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal
    return same_doc, seg == 0, seg == seg[..., -1:]


def segment_sums(g_BHNC: torch.Tensor) -> torch.Tensor:
    """seg_ij = g_{j+1} + ... + g_i (0 for i <= j), [B, H, N, C, C]: the log decay from token j to i.

    Summed per pair rather than taken as c_i - c_j of the cumsum c: c reaches ~-1000 per chunk at the
    initial decays, where one fp32 ulp (~6e-5) is already a 6e-5 error in every decay exp(c_i - c_j).
    """
    C = g_BHNC.shape[-1]
    strict_lower = torch.ones(C, C, dtype=torch.bool, device=g_BHNC.device).tril(-1)
    g_tj = g_BHNC.unsqueeze(-1).expand(*g_BHNC.shape, C).masked_fill(~strict_lower, 0.0)  # g_t where t > j
    return g_tj.cumsum(-2)


def chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, starts_BS, initial_state=None,
                           output_final_state: bool = False):
    """o_BSHV of the gated delta rule, state S [K, V] per value head:
      S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,  o_t = S_t^T q_t.

    initial_state: S_0 [B, HV, K, V] (None: zeros), the state before each row's first token: its tokens up to
    the first document start after column 0 continue it (pass zeros for a row that starts a document; the fla
    op set's contract too). output_final_state: return (o_BSHV, S_BHKV fp32), the state after the last token.

    a_t = exp(g_t), zero at document starts. Per chunk of C tokens (WY form, cumulative log decay c):
      u = T beta v,  w = T (beta k * exp(c) * carry),  T = (I + strict_lower(beta K K^T * P))^-1
      v' = u - w S,  o = (q * exp(c) * carry) S + (Q K^T * P) v',
      S <- S exp(c_C) carry_C + (K * exp(c_C - c) * to_end)^T v'
    with P_ij = exp(c_i - c_j) where same_doc_ij, else 0; every c_i - c_j is a segment sum of g.
    """
    B, S, HV, _ = v_BSHV.shape
    if initial_state is not None:  # column 0 continues the initial state's document
        starts_BS = torch.cat([torch.zeros_like(starts_BS[:, :1]), starts_BS[:, 1:]], dim=1)
    group = HV // q_BSHK.shape[2]
    num_chunks = -(-S // CHUNK)
    q_BSHK = l2_normalize(q_BSHK.float()).repeat_interleave(group, dim=2) * q_BSHK.shape[-1] ** -0.5
    k_BSHK = l2_normalize(k_BSHK.float()).repeat_interleave(group, dim=2)
    q, k, v = (to_chunks(t, num_chunks) for t in (q_BSHK, k_BSHK, v_BSHV))
    g, beta = (to_chunks(t.unsqueeze(-1), num_chunks).squeeze(-1) for t in (g_BSH, beta_BSH))
    same_doc, carry, to_end = chunk_masks(starts_BS, num_chunks)

    c = g.cumsum(-1)  # [B, HV, N, C], log decay from the chunk start
    seg = segment_sums(g)
    pair_decay = seg.masked_fill(~same_doc, float("-inf")).exp()
    from_start = c.exp() * carry  # decay from the chunk start, 0 after a document start
    to_chunk_end = seg[..., -1, :].exp() * to_end
    chunk_decay = (c[..., -1].exp() * carry[..., -1])[..., None, None]

    k_beta = k * beta.unsqueeze(-1)
    kkt = (k_beta @ k.transpose(-1, -2)) * pair_decay
    u = torch.linalg.solve_triangular(kkt, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(kkt, k_beta * from_start.unsqueeze(-1), upper=False, unitriangular=True)
    qkt = (q @ k.transpose(-1, -2)) * pair_decay
    q_in = q * from_start.unsqueeze(-1)
    k_out = k * to_chunk_end.unsqueeze(-1)

    state = q.new_zeros(B, HV, q.shape[-1], v.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    for n in range(num_chunks):
        v_new = u[:, :, n] - w[:, :, n] @ state
        outs.append(q_in[:, :, n] @ state + qkt[:, :, n] @ v_new)
        state = state * chunk_decay[:, :, n] + k_out[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :S].transpose(1, 2).to(v_BSHV.dtype)
    return (o, state) if output_final_state else o

"""Gated DeltaNet (the linear-attention layer of Qwen3.5 / Qwen3-Next) over packed sequences.

    gdn = GatedDeltaNet(hidden, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel, eps,
                        layout="qwen3_5" | "qwen3_next", op_set="torch" | "fla", device=None, dtype=None)
    y_BSH = gdn(x_BSH, meta)      # meta: attention.attention.AttnMeta or None

Computation (per token t, value head h, key head h * num_k_heads // num_v_heads):
    q, k, v = silu(depthwise causal conv1d(in-projection))     window `conv_kernel`, reset per document
    beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(l2norm(q) * head_k_dim^-0.5, l2norm(k), v, g, beta)   state reset per document
    y = out_proj(rmsnorm(o) * norm.weight * silu(z))

Packed input: B rows of S tokens; `meta.cu_seqlens` (int32 [docs + 1], boundaries over the flattened
B*S tokens, never crossing a row: what the collator builds) says where documents start. Rows that hold
several documents REQUIRE meta.cu_seqlens: the layer sees no position_ids, and without cu_seqlens
(meta None, or meta.cu_seqlens None as in an SDPA-only AttnMeta) every row is one document.
meta.max_seqlen and meta.sdpa_mask_B1SS are not used.

Context parallelism (meta.cp, zigzag pieces: attention/context_parallel.py), exact either way, by meta.cp.gdn_mode:
- heads: after the (token-wise) projections one all-to-all gives each cp rank whole rows for num_k_heads/cp
  key heads and their value heads; conv and delta rule run on them unchanged over the whole rows' documents,
  the output comes back by the reverse exchange. Needs num_k_heads % cp == 0; either op set.
- state: each rank runs its two pieces (batched as 2B rows of S/(2cp) tokens). The conv of a piece reads its
  predecessor's last conv_kernel-1 pre-conv tokens (one all-gather of every piece's tail). The delta rule is
  linear in (initial state, values), so one pass with values [v | 0_K] from the state [0 | I_K] gives every
  output as o0 + o_I S_in and the piece's state map S_end = P S_in + S0_end ([S0_end | P] is the final
  state; a piece that starts a document starts from 0 instead, and a document start inside a piece makes
  P = 0). The maps of all pieces (one all-gather, [B, HV, K, V+K] each) composed in row order give each
  piece's incoming state S_in. Autograd runs through the collectives and the composition. Any cp; costs
  about (V+K)/V of a delta-rule pass; either op set (the pieces' document tables come from the CPShard).

Op sets (attention/gdn_ops_torch.py, attention/gdn_ops_fla.py) in `GDN_OP_SETS` (config key
model.gdn_op_set; runtime.plan resolves "auto": fla on CUDA when installed and its backward can run here, else
torch, with a warning naming the fix; runtime.plan also holds the cp checks), given to the layer by name, one
contract:
    docs = ops.prepare_docs(cu_seqlens, B, S, device)
    y_BSD = ops.causal_conv1d_silu(x_BSD, weight_DW, docs)
    o_BSHV = ops.chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, docs)
    o_BSHV, S_BHKV = ops.chunk_gated_delta_rule(..., docs, initial_state=S0_BHKV, output_final_state=True)
(initial_state: each row's state before its first token, read up to its first document start after column 0;
zeros for a row that starts a document. S_BHKV: the state after each row's last token, fp32.)
`torch` is plain PyTorch (CPU path, reference); `fla` wraps flash-linear-attention's CUDA kernels in
opaque torch.library custom ops and is imported only when chosen.

Parameters carry the HF names (conv1d.weight, dt_bias, A_log, norm.weight, out_proj.weight and
in_proj_qkv/z/b/a for qwen3_5, in_proj_qkvz/ba for qwen3_next), so checkpoints load by name and the
projections are plain nn.Linear children that LoRA can swap. The qwen3_next projections interleave per
key-head group ([q, k, v_group, z_group] and [b_group, a_group] for each of num_k_heads groups).

Shapes: x_BSH [B, S, hidden], conv channels D = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim,
q/k_BSHK [B, S, num_k_heads, head_k_dim], v/z/o_BSHV [B, S, num_v_heads, head_v_dim], g/beta_BSH
[B, S, num_v_heads].
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from attention.attention import AttnMeta
from attention.context_parallel import CPShard, gather_pieces, heads_to_seq, seq_to_heads
from gpu.registry import Capabilities, Registry

GDN_LAYOUTS = ("qwen3_5", "qwen3_next")


def _fla_missing() -> str | None:
    """Why op set fla cannot train here (not installed, or its backward refused on this CUDA device:
    attention/gdn_ops_fla.py), None when it can."""
    if importlib.util.find_spec("fla") is None:
        return "it needs flash-linear-attention==0.6.0 (pip install 'moe-runtime[gdn]'); or use op set 'torch'"
    return importlib.import_module("attention.gdn_ops_fla").backward_refusal()


def _op_set(module: str):
    return lambda: importlib.import_module(module)


# name -> the op-set module, imported when a layer is built: `fla` stays off CPU-only runs.
GDN_OP_SETS: Registry = Registry("GDN op set", "model.gdn_op_set", auto=True)
GDN_OP_SETS.declare("torch", Capabilities(auto_on=("cpu", "cuda"), reference=True), _op_set("attention.gdn_ops_torch"))
GDN_OP_SETS.declare("fla", Capabilities(devices=("cuda",), unavailable=_fla_missing, auto_on=("cuda",), priority=1),
                    _op_set("attention.gdn_ops_fla"))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """F.softplus (beta 1, threshold 20) from pointwise ops: under torch.compile, softplus_backward's
    fake-tensor strides disagree with the real ones for strided gradients, and the linear backward
    that views them then fails. The clamp keeps exp finite in the unselected branch (else NaN grads
    for x > 88)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


class GatedRMSNorm(nn.Module):
    """rmsnorm(o) * weight * silu(z) over the head dim, with the HF rounding: fp32 norm, weight applied
    in the input dtype, gate in fp32, result in the input dtype."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        o32 = o.float()
        normed = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(o.dtype) * F.silu(z.float())).to(o.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, layout: str = "qwen3_5", op_set: str = "torch",
                 device=None, dtype=None):
        super().__init__()
        if layout not in GDN_LAYOUTS:
            raise ValueError(f"unknown GDN layout {layout!r}; choose one of {list(GDN_LAYOUTS)}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.op_set, self.ops = op_set, GDN_OP_SETS.get(op_set)  # a concrete name: runtime.plan resolved "auto"
        self.layout = layout
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        factory = {"device": device, "dtype": dtype}
        if layout == "qwen3_5":
            self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False, **factory)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False, **factory)
            self.in_proj_b = nn.Linear(hidden, num_v_heads, bias=False, **factory)
            self.in_proj_a = nn.Linear(hidden, num_v_heads, bias=False, **factory)
        else:
            self.in_proj_qkvz = nn.Linear(hidden, conv_dim + self.value_dim, bias=False, **factory)
            self.in_proj_ba = nn.Linear(hidden, 2 * num_v_heads, bias=False, **factory)
        # Only its weight [D, 1, W] is used (by the op set); nn.Conv1d keeps the HF name and init.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, padding=conv_kernel - 1,
                                bias=False, **factory)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.norm = GatedRMSNorm(head_v_dim, eps, **factory)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF init of the decay parameters: dt_bias = 1, A = exp(A_log) ~ U(0.01, 16)."""
        if self.A_log.is_meta:
            return
        with torch.no_grad():
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(0.01, 16).log())

    def project(self, x_BSH: torch.Tensor):
        """(conv input qkv_BSD in [q | k | v] channel order, z_BSHV, b_BSH, a_BSH)."""
        B, S, _ = x_BSH.shape
        if self.layout == "qwen3_5":
            z_BSHV = self.in_proj_z(x_BSH).view(B, S, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x_BSH), z_BSHV, self.in_proj_b(x_BSH), self.in_proj_a(x_BSH)
        group = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x_BSH).view(B, S, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, group * self.head_v_dim,
                                 group * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x_BSH).view(B, S, self.num_k_heads, 2 * group).split([group, group], dim=-1)
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        return (qkv, z.reshape(B, S, self.num_v_heads, self.head_v_dim),
                b.reshape(B, S, self.num_v_heads), a.reshape(B, S, self.num_v_heads))

    def forward(self, x_BSH: torch.Tensor, meta: AttnMeta | None = None) -> torch.Tensor:
        qkv_BSD, z_BSHV, b_BSH, a_BSH = self.project(x_BSH)
        cp = meta.cp if meta is not None else None
        if cp is not None and cp.gdn_mode == "state":
            o_BSHV = self._mix_state_passing(qkv_BSD, b_BSH, a_BSH, cp)
        elif cp is not None:
            o_BSHV = self._mix_head_parallel(qkv_BSD, b_BSH, a_BSH, cp)
        else:
            cu_seqlens = meta.cu_seqlens if meta is not None else None
            o_BSHV = self._mix(qkv_BSD, b_BSH, a_BSH, cu_seqlens, slice(None), self.num_k_heads)
        return self.out_proj(self.norm(o_BSHV, z_BSHV).flatten(2))

    def _mix(self, qkv_BSD, b_BSH, a_BSH, cu_seqlens, heads: slice, num_k_heads: int) -> torch.Tensor:
        """conv + delta rule over whole rows for key heads `heads` (all, or a cp rank's) and their value
        heads; qkv_BSD holds those heads' channels in [q | k | v] order."""
        B, S, _ = qkv_BSD.shape
        group = self.num_v_heads // self.num_k_heads
        v_heads = slice(None) if heads == slice(None) else slice(heads.start * group, heads.stop * group)
        docs = self.ops.prepare_docs(cu_seqlens, B, S, qkv_BSD.device)
        qkv_BSD = self.ops.causal_conv1d_silu(qkv_BSD, self._conv_weight(heads), docs)
        key_dim, value_dim = num_k_heads * self.head_k_dim, num_k_heads * group * self.head_v_dim
        q, k, v = qkv_BSD.split([key_dim, key_dim, value_dim], dim=-1)
        g_BSH, beta_BSH = self._decay_and_strength(b_BSH, a_BSH, v_heads)
        k_heads, v_shape = (num_k_heads, self.head_k_dim), (num_k_heads * group, self.head_v_dim)
        return self.ops.chunk_gated_delta_rule(q.unflatten(-1, k_heads), k.unflatten(-1, k_heads),
                                               v.unflatten(-1, v_shape), g_BSH, beta_BSH, docs)

    def _decay_and_strength(self, b_BSH, a_BSH, v_heads: slice):
        """(g_BSH log decay, beta_BSH write strength) of value heads `v_heads`."""
        # fp32 decay: exp(A_log) overflows fp16 and the decay's cumsum needs the precision
        g_BSH = -self.A_log[v_heads].float().exp() * softplus(a_BSH.float() + self.dt_bias[v_heads])
        return g_BSH, b_BSH.sigmoid()

    def _conv_weight(self, heads: slice) -> torch.Tensor:
        """The depthwise conv weight [D, W] of key heads `heads` and their value heads, [q | k | v] order."""
        w_DW = self.conv1d.weight.squeeze(1)
        if heads == slice(None):
            return w_DW
        kd, vd = self.head_k_dim, self.head_v_dim * self.num_v_heads // self.num_k_heads
        q_rows = slice(heads.start * kd, heads.stop * kd)
        k_rows = slice(self.key_dim + heads.start * kd, self.key_dim + heads.stop * kd)
        v_rows = slice(2 * self.key_dim + heads.start * vd, 2 * self.key_dim + heads.stop * vd)
        return torch.cat([w_DW[q_rows], w_DW[k_rows], w_DW[v_rows]])

    def _mix_head_parallel(self, qkv_BsD, b_BsH, a_BsH, cp: CPShard) -> torch.Tensor:
        """_mix on whole rows for this cp rank's key heads: one exchange of every key head's q, k, its
        value heads' v, b and a (sequence -> heads), one of the output back (heads -> sequence)."""
        B, s, _ = qkv_BsD.shape
        Hk, group = self.num_k_heads, self.num_v_heads // self.num_k_heads
        q, k, v = qkv_BsD.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        per_key_head = [q.view(B, s, Hk, -1), k.view(B, s, Hk, -1), v.view(B, s, Hk, -1),
                        b_BsH.view(B, s, Hk, group), a_BsH.view(B, s, Hk, group)]
        sizes = [t.shape[-1] for t in per_key_head]
        packed_BShF = seq_to_heads(torch.cat(per_key_head, dim=-1), cp)
        q, k, v, b, a = packed_BShF.split(sizes, dim=-1)
        hk = Hk // cp.size
        heads = slice(cp.rank * hk, (cp.rank + 1) * hk)
        qkv_BSd = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        o_BShV = self._mix(qkv_BSd, b.flatten(2), a.flatten(2), cp.meta.cu_seqlens, heads, hk)
        return heads_to_seq(o_BShV, cp)

    def _mix_state_passing(self, qkv_BsD, b_BsH, a_BsH, cp: CPShard) -> torch.Tensor:
        """_mix of this rank's two zigzag pieces, exactly as on whole rows, every head: the pieces run as 2B
        rows (n = B*2, batch-major: a view of the local order), each from its predecessor's conv tail and the
        recurrent state entering it."""
        B, s, D = qkv_BsD.shape
        n, P = 2 * B, s // 2
        qkv_nPD = self._conv_pieces(qkv_BsD.reshape(n, P, D), cp)
        q, k, v = qkv_nPD.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g_nPH, beta_nPH = self._decay_and_strength(b_BsH.reshape(n, P, -1), a_BsH.reshape(n, P, -1), slice(None))
        k_heads, v_shape = (self.num_k_heads, self.head_k_dim), (self.num_v_heads, self.head_v_dim)
        docs = self.ops.prepare_docs(cp.piece_cu_seqlens, n, P, qkv_BsD.device)
        o_nPHW, maps_nHKW = delta_rule_state_maps(self.ops, q.unflatten(-1, k_heads), k.unflatten(-1, k_heads),
                                                  v.unflatten(-1, v_shape), g_nPH, beta_nPH, docs, cp.continues_n)
        maps_pBHKW = gather_pieces(maps_nHKW.unflatten(0, (B, 2)).transpose(0, 1), cp)
        state_in_nHKV = incoming_states(maps_pBHKW, self.head_v_dim, cp.pieces).transpose(0, 1).flatten(0, 1)
        return with_incoming_state(o_nPHW, state_in_nHKV).to(v.dtype).reshape(B, s, *v_shape)

    def _conv_pieces(self, x_nPD, cp: CPShard):
        """silu(causal conv) of every local piece: each piece is prefixed with its predecessor's last W-1 pre-conv
        tokens (zeros before piece 0), so the window reaches back across the piece boundary unless a document
        starts (cp.conv_cu_seqlens: the documents of the extended pieces)."""
        n, P = x_nPD.shape[:2]
        W = self.conv1d.kernel_size[0]
        if cp.gdn_conv_tail != W - 1:
            raise ValueError(f"the CPShard's document tables are for a conv tail of {cp.gdn_conv_tail} tokens, this "
                             f"GDN layer's conv window reads {W - 1}: build the CPShard with gdn_conv_tail={W - 1}")
        tails_2BTD = x_nPD[:, P - (W - 1):].unflatten(0, (n // 2, 2)).transpose(0, 1)
        tails_pBTD = gather_pieces(tails_2BTD, cp)
        # predecessor of piece p at index p: a zero tail before piece 0
        tails_pBTD = torch.cat([torch.zeros_like(tails_pBTD[:1]), tails_pBTD])
        pred_nTD = tails_pBTD.index_select(0, cp.pieces_2).transpose(0, 1).flatten(0, 1)
        docs = self.ops.prepare_docs(cp.conv_cu_seqlens, n, P + W - 1, x_nPD.device)
        y_nTD = self.ops.causal_conv1d_silu(torch.cat([pred_nTD, x_nPD], dim=1), self._conv_weight(slice(None)), docs)
        return y_nTD[:, W - 1:]


def delta_rule_state_maps(ops, q_nPHK, k_nPHK, v_nPHV, g_nPH, beta_nPH, docs, continues_n):
    """(o_nPHW, maps_nHKW) of the delta rule on n pieces, W = V + K: one pass with values [v | 0_K] from the state
    [0 | I_K] (0 for a piece that starts a document, continues_n False) gives the outputs [o0 | o_I] for a zero
    and a unit incoming state and the final state [S0_end | P], the piece's state map S_end = S0_end + P S_in.
    The values stay in v's dtype (zeros are exact), the initial state in fp32."""
    n, P, HV, V = v_nPHV.shape
    K = q_nPHK.shape[-1]
    v_aug_nPHW = torch.cat([v_nPHV, v_nPHV.new_zeros(n, P, HV, K)], dim=-1)
    eye_nHKK = torch.eye(K, device=v_nPHV.device) * continues_n.view(n, 1, 1, 1)
    init_nHKW = torch.cat([eye_nHKK.new_zeros(n, HV, K, V), eye_nHKK.expand(n, HV, K, K)], dim=-1)
    return ops.chunk_gated_delta_rule(q_nPHK, k_nPHK, v_aug_nPHW, g_nPH, beta_nPH, docs, initial_state=init_nHKW,
                                      output_final_state=True)


def with_incoming_state(o_nPHW: torch.Tensor, state_in_nHKV: torch.Tensor) -> torch.Tensor:
    """o = o0 + o_I S_in (fp32) from delta_rule_state_maps' outputs and the pieces' incoming states."""
    V = state_in_nHKV.shape[-1]
    with torch.autocast(o_nPHW.device.type, enabled=False):  # autocast would run the product in bf16
        return o_nPHW[..., :V].float() + torch.einsum("nphk,nhkv->nphv", o_nPHW[..., V:].float(),
                                                      state_in_nHKV.float())


def incoming_states(maps_pBHKW: torch.Tensor, value_dim: int, pieces: tuple[int, ...]) -> torch.Tensor:
    """The states entering `pieces` [len(pieces), B, HV, K, V] (fp32), from every piece's state map
    [S0_end | P] [2*cp, B, HV, K, V+K] in row order: S_in(0) = 0, S_in(p+1) = S0_end(p) + P(p) S_in(p)."""
    maps_pBHKW = maps_pBHKW.float()
    states = [maps_pBHKW.new_zeros(*maps_pBHKW.shape[1:-1], value_dim)]
    with torch.autocast(maps_pBHKW.device.type, enabled=False):  # the chain of products rounds at each piece in bf16
        for p in range(max(pieces)):
            states.append(maps_pBHKW[p, ..., :value_dim] + maps_pBHKW[p, ..., value_dim:] @ states[-1])
    return torch.stack([states[p] for p in pieces])

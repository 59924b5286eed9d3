"""Qwen3 GQA attention with per-head q/k RMSNorm + RoPE, over packed sequences.

Shapes: x_BSH [B, S, hidden], q_BSHD [B, S, Hq, D], k/v_BSKD [B, S, Hkv, D].
Packed rows hold several documents; `AttnMeta` (built once per batch) carries what the backends
need so that no document attends to another: a block-diagonal causal mask for SDPA, cu_seqlens and
max_seqlen for the varlen flash backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attention.norm import RMSNorm
from attention.norm_rope import qk_norm_rope


@dataclass
class AttnMeta:
    """Per-batch attention metadata; None fields mean one causal document per row."""
    sdpa_mask_B1SS: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None  # int32 [docs + 1] over the flattened B*S tokens
    max_seqlen: int | None = None


def document_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Document index of every token: a new document starts wherever the position restarts at 0."""
    return torch.cumsum((position_ids_BS == 0).to(torch.int32), dim=-1)


def packed_causal_mask(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i sees key j iff j <= i and both lie in the same document."""
    doc_BS = document_ids(position_ids_BS)
    S = position_ids_BS.shape[-1]
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=position_ids_BS.device).tril()
    same_doc_BSS = doc_BS.unsqueeze(-1) == doc_BS.unsqueeze(-2)
    return (same_doc_BSS & causal_SS).unsqueeze(1)


def build_attn_meta(position_ids_BS: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                    max_seqlen: int | None = None, backend: str = "sdpa") -> AttnMeta:
    if position_ids_BS is None or backend == "flash":
        return AttnMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    # cu_seqlens ride along for the GDN layers of hybrid models
    return AttnMeta(sdpa_mask_B1SS=packed_causal_mask(position_ids_BS), cu_seqlens=cu_seqlens,
                    max_seqlen=max_seqlen)


def sdpa_attention(q_BSHD, k_BSKD, v_BSKD, meta: AttnMeta, scale: float) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))
    mask = meta.sdpa_mask_B1SS
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def flash_varlen_attention(q_BSHD, k_BSKD, v_BSKD, meta: AttnMeta, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # optional dependency, checked at build time

    B, S = q_BSHD.shape[:2]
    if meta.cu_seqlens is None:  # unpacked rows: every row is one document
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q_BSHD.device)
        meta = AttnMeta(cu_seqlens=cu, max_seqlen=S)
    out = flash_attn_varlen_func(q_BSHD.flatten(0, 1), k_BSKD.flatten(0, 1), v_BSKD.flatten(0, 1),
                                 meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen,
                                 softmax_scale=scale, causal=True)
    return out.view(B, S, *out.shape[1:])


ATTN_BACKENDS = {"sdpa": sdpa_attention, "flash": flash_varlen_attention}


def check_attn_backend(name: str) -> None:
    if name not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(ATTN_BACKENDS)}")
    if name == "flash":
        try:
            import flash_attn
        except ImportError:
            raise ValueError("attention backend 'flash' needs flash-attn installed; "
                             "set model.attn_backend: sdpa or pip install flash-attn") from None


class Qwen3Attention(nn.Module):
    """Qwen3 attention. `gated=True` is the Qwen3.5 / Qwen3-Next form: q_proj yields a query and a
    gate per head ([q | gate] per head), the output is multiplied by sigmoid(gate) before o_proj, the
    q/k norms use (1 + w), and RoPE may cover only the first `rotary_dim` dims."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 bias: bool = False, backend: str = "sdpa", norm_rope_impl: str = "auto", gated: bool = False,
                 rotary_dim: int | None = None, o_bias: bool = False, device=None, dtype=None):
        super().__init__()
        check_attn_backend(backend)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.backend, self.norm_rope_impl = eps, backend, norm_rope_impl
        self.gated, self.rotary_dim = gated, rotary_dim
        self.scale = head_dim ** -0.5
        factory = dict(device=device, dtype=dtype)
        q_out = num_heads * head_dim * (2 if gated else 1)
        self.q_proj = nn.Linear(hidden, q_out, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias, **factory)
        self.q_norm = RMSNorm(head_dim, eps, unit_offset=gated, **factory)
        self.k_norm = RMSNorm(head_dim, eps, unit_offset=gated, **factory)

    def forward(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q_BSHD = self.q_proj(x_BSH).view(B, S, self.num_heads, -1)
        if self.gated:
            q_BSHD, gate_BSHD = q_BSHD.chunk(2, dim=-1)
        k_BSKD = self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        v_BSKD = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        q_BSHD, k_BSKD = qk_norm_rope(q_BSHD, k_BSKD, self.q_norm.weight, self.k_norm.weight, cos, sin,
                                      self.eps, unit_offset=self.gated, rotary_dim=self.rotary_dim,
                                      impl=self.norm_rope_impl)
        out_BSHD = ATTN_BACKENDS[self.backend](q_BSHD, k_BSKD, v_BSKD, meta, self.scale)
        if self.gated:
            out_BSHD = out_BSHD * torch.sigmoid(gate_BSHD)
        return self.o_proj(out_BSHD.reshape(B, S, -1))

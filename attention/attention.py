"""Qwen3 GQA attention with per-head q/k RMSNorm + RoPE, over packed sequences.

Shapes: x_BSH [B, S, hidden], q_BSHD [B, S, Hq, D], k/v_BSKD [B, S, Hkv, D].
Packed rows hold several documents; `AttnMeta` (built once per batch) carries what the backends
need so that no document attends to another: a block-diagonal causal mask for SDPA, cu_seqlens and
max_seqlen for the varlen flash backend.

Backends (`ATTN_BACKENDS`, config key model.attn_backend; runtime.plan resolves "auto": flash on CUDA where a
varlen kernel is installed, else sdpa), one contract:
    out_BSHD = ATTN_BACKENDS.get(name)(q_BSHD, k_BSKD, v_BSKD, meta, scale)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from attention.context_parallel import (
    CPShard,
    VarlenSegments,
    gather_sequence,
    heads_to_seq,
    repeat_kv_for_cp,
    seq_to_heads,
)
from attention.norm import RMSNorm
from attention.norm_rope import NORM_ROPE_IMPLS, qk_norm_rope
from attention.projection import fused_linear, joins_fused_projection, linear_part
from gpu.device import compute_dtype
from gpu.registry import Capabilities, Registry


@dataclass
class AttnMeta:
    """Per-batch attention metadata; None fields mean one causal document per row."""
    sdpa_mask_B1SS: torch.Tensor | None = None
    # int32 [docs + 1] over the flattened B*S tokens; every row start is a boundary (so B + 1 entries
    # mean one document per row)
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    # context parallelism: this rank holds a share of every row; the whole rows' metadata is cp.meta
    cp: CPShard | None = None
    # built for the varlen kernel (backend flash); context parallelism's allgather mode then runs it too
    varlen: bool = False


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


def cu_seqlens_from_position_ids(position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries (int32 [docs + 1]) over the flattened B*S tokens and the longest document.
    A document starts where the position is 0 and at every row start. Data-dependent (a host sync):
    the collator passes cu_seqlens instead; this serves direct calls with position_ids only."""
    B, S = position_ids_BS.shape
    starts_BS = position_ids_BS == 0
    starts_BS[:, 0] = True
    begin = torch.nonzero(starts_BS.flatten()).flatten()
    cu = torch.cat([begin, begin.new_tensor([B * S])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def build_attn_meta(position_ids_BS: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                    max_seqlen: int | None = None, backend: str = "sdpa") -> AttnMeta:
    """The metadata `backend` needs. position_ids None: one causal document per row. For "flash",
    packed position_ids without cu_seqlens get their boundaries derived here, so that no caller can
    silently attend across documents by forgetting cu_seqlens."""
    if backend == "flash":
        if position_ids_BS is not None and cu_seqlens is None:
            cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(position_ids_BS)
        return AttnMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, varlen=True)
    if position_ids_BS is None:
        return AttnMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    # cu_seqlens ride along for the GDN layers of hybrid models
    return AttnMeta(sdpa_mask_B1SS=packed_causal_mask(position_ids_BS), cu_seqlens=cu_seqlens,
                    max_seqlen=max_seqlen)


QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # the projections Qwen3Attention runs as one GEMM (fuse_qkv)

AttnBackend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnMeta, float], torch.Tensor]


ATTN_BACKENDS: Registry[AttnBackend] = Registry("attention backend", "model.attn_backend", auto=True)


@ATTN_BACKENDS.register("sdpa", Capabilities(auto_on=("cpu", "cuda"), reference=True))
def sdpa_attention(q_BSHD, k_BSKD, v_BSKD, meta: AttnMeta, scale: float) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))
    mask = meta.sdpa_mask_B1SS
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


# --- varlen flash backend ---------------------------------------------------------------------------
# Two implementations of the same contract, VarlenFn(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen,
# scale, cu_seqlens_k=None, max_seqlen_k=None) -> out_THD (causal within each document of cu_seqlens,
# GQA: q head h reads kv head h // (Hq / Hkv)): flash-attn's flash_attn_varlen_func when installed, else
# torch's own torch.nn.attention.varlen.varlen_attn (torch >= 2.10), whose keywords changed between
# releases. Keys with their own boundaries (cu_seqlens_k, max_seqlen_k; default: those of q) may outnumber
# a sequence's queries: both kernels are FlashAttention-2's, which aligns causal bottom-right (the last
# query sees the last key; torch's copy: aten/src/ATen/native/transformers/cuda/flash_attn/mask.h).

VarlenFn = Callable[..., torch.Tensor]


class VarlenImpl(NamedTuple):
    name: str  # "flash_attn" | "torch"
    fn: VarlenFn


def _import_flash_attn_varlen() -> Callable | None:
    """flash-attn's flash_attn_varlen_func, or None when the package is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _import_torch_varlen() -> Callable | None:
    """torch.nn.attention.varlen.varlen_attn, or None on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def repeat_kv_heads(kv_TKD: torch.Tensor, n_rep: int, dim: int = 1) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv * n_rep, D] (heads at `dim`) with kv head j at heads j*n_rep .. j*n_rep +
    n_rep - 1, the GQA grouping of SDPA's enable_gqa (q head h reads kv head h // n_rep). Autograd sums
    the grads of the copies back into kv."""
    return kv_TKD if n_rep == 1 else kv_TKD.repeat_interleave(n_rep, dim=dim)


def _key_bounds(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k) -> tuple[torch.Tensor, int]:
    """The keys' boundaries and longest sequence: their own where given, else the queries'."""
    return (cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
            max_seqlen if max_seqlen_k is None else max_seqlen_k)


def _flash_attn_caller(fn: Callable) -> VarlenFn:
    """flash-attn takes GQA natively and causal as a flag."""
    def call(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, cu_seqlens_k=None, max_seqlen_k=None):
        cu_seqlens_k, max_seqlen_k = _key_bounds(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
        return fn(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                  softmax_scale=scale, causal=True)
    return call


def _torch_varlen_caller(fn: Callable) -> VarlenFn | None:
    """Adapts torch's varlen_attn to VarlenFn from its signature; None when it cannot do causal.

    Known signatures: torch 2.10 `is_causal: bool`; later `window_size=(left, right)` with causal
    = (-1, 0); newer ones add `enable_gqa` (older ones require Hq == Hkv, so the kv heads are
    repeated here) and `scale` (without it the kernel uses 1/sqrt(D), so other scales are refused)."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        # a tuple, not a list: torch tests `window_size == (-1, 0)` to set is_causal
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    native_gqa, takes_scale = "enable_gqa" in params, "scale" in params

    def call(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, cu_seqlens_k=None, max_seqlen_k=None):
        n_rep = q_THD.shape[1] // k_TKD.shape[1]
        kwargs = dict(causal)
        if native_gqa:
            kwargs["enable_gqa"] = n_rep > 1
        else:
            k_TKD, v_TKD = repeat_kv_heads(k_TKD, n_rep), repeat_kv_heads(v_TKD, n_rep)
        if takes_scale:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q_THD.shape[-1] ** -0.5, rel_tol=1e-6):
            raise ValueError(f"this torch's varlen_attn has no scale argument and uses 1/sqrt(head_dim); "
                             f"got scale {scale}")
        cu_seqlens_k, max_seqlen_k = _key_bounds(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
        return fn(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **kwargs)
    return call


def choose_varlen_impl() -> VarlenImpl | None:
    """flash-attn when installed, else torch's varlen_attn when it exists and can do causal, else None
    (the flash backend is unavailable)."""
    flash_attn_fn = _import_flash_attn_varlen()
    if flash_attn_fn is not None:
        return VarlenImpl("flash_attn", _flash_attn_caller(flash_attn_fn))
    torch_fn = _import_torch_varlen()
    caller = None if torch_fn is None else _torch_varlen_caller(torch_fn)
    return None if caller is None else VarlenImpl("torch", caller)


_UNCHOSEN = object()
_varlen_choice = _UNCHOSEN  # a plain global, not functools.cache: dynamo reads it as a constant


def varlen_impl() -> VarlenImpl | None:
    """choose_varlen_impl() on the first call (layer construction), the same answer afterwards."""
    global _varlen_choice
    if _varlen_choice is _UNCHOSEN:
        _varlen_choice = choose_varlen_impl()
    return _varlen_choice


def choose_dense_causal() -> bool:
    """Whether rows that hold one document each go to cuDNN's fused attention (SDPA's cuDNN kernel) rather
    than the varlen kernel: on Hopper and newer, where it runs the same causal attention faster than torch's
    FA2 (docs/benchmarks.md#attention)."""
    return (torch.cuda.is_available() and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability() >= (9, 0))


_dense_causal_choice = _UNCHOSEN  # a plain global, as _varlen_choice


def dense_causal() -> bool:
    """choose_dense_causal() on the first call (layer construction), the same answer afterwards."""
    global _dense_causal_choice
    if _dense_causal_choice is _UNCHOSEN:
        _dense_causal_choice = choose_dense_causal()
    return _dense_causal_choice


def cudnn_causal_attention(q_BSHD, k_BSKD, v_BSKD, scale: float) -> torch.Tensor:
    """Causal attention of whole rows with cuDNN's fused kernel, on the kv heads as they are (cuDNN reads each
    for its group of query heads and reduces their gradients itself; repeated heads would cost a copy in
    forward, a reduction in backward and Hq / Hkv times the k, v bytes kept for it). Returns [B, S, Hq, D]."""
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))
    out_BHSD = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                  scale=scale)[0]
    return out_BHSD.transpose(1, 2)


def _check_varlen_inputs(q_BSHD: torch.Tensor, dtype: torch.dtype) -> None:
    """Both varlen kernels are CUDA-only and half precision only; the device is first known here."""
    if q_BSHD.device.type != "cuda":
        raise ValueError(f"attention backend 'flash' runs on CUDA only (got tensors on {q_BSHD.device}); "
                         "set model.attn_backend: sdpa")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend 'flash' needs bfloat16/float16 activations (got {dtype}); "
                         "use model.dtype: bfloat16 or bf16 autocast, or set model.attn_backend: sdpa")


def _varlen_missing() -> str | None:
    """Why the flash backend cannot run on this install, None when it can."""
    if varlen_impl() is None:
        return ("it needs flash-attn installed or a torch with torch.nn.attention.varlen.varlen_attn (>= 2.10); "
                "pip install flash-attn")
    return None


def _varlen_kernel() -> VarlenImpl:
    """The varlen implementation; runtime.plan checked it exists, this guards direct callers."""
    impl = varlen_impl()
    if impl is None:
        raise ValueError(f"attention backend 'flash' {_varlen_missing()}; or set model.attn_backend: sdpa")
    return impl


# No [B,1,S,S] mask and no attention over padding or across documents: the default where it runs.
@ATTN_BACKENDS.register("flash", Capabilities(devices=("cuda",), unavailable=_varlen_missing, auto_on=("cuda",),
                                              priority=1))
def flash_varlen_attention(q_BSHD, k_BSKD, v_BSKD, meta: AttnMeta, scale: float) -> torch.Tensor:
    """Causal attention within the documents of meta.cu_seqlens (over the flattened B*S tokens; None:
    every row is one document). Returns [B, S, Hq, D] in the compute dtype. Rows of one document each go
    to cuDNN where it is faster (dense_causal); the count of boundaries decides, a shape, so no sync
    (dense_causal asked first: elsewhere a compiled region does not branch, so guard, on that count)."""
    B, S = q_BSHD.shape[:2]
    dtype = compute_dtype(q_BSHD)
    _check_varlen_inputs(q_BSHD, dtype)
    if dense_causal() and (meta.cu_seqlens is None or meta.cu_seqlens.numel() == B + 1):
        return cudnn_causal_attention(*(t.to(dtype) for t in (q_BSHD, k_BSKD, v_BSKD)), scale)
    impl = _varlen_kernel()
    cu_seqlens, max_seqlen = meta.cu_seqlens, meta.max_seqlen
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q_BSHD.device)
        max_seqlen = S
    elif max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q_THD, k_TKD, v_TKD = (t.flatten(0, 1).to(dtype) for t in (q_BSHD, k_BSKD, v_BSKD))
    out_THD = impl.fn(q_THD, k_TKD, v_TKD, cu_seqlens.to(torch.int32), max_seqlen, scale)
    return out_THD.unflatten(0, (B, S))


def cp_masked_attention(q_BsHD, k_BSKD, v_BSKD, mask_B1sS: torch.Tensor, scale: float) -> torch.Tensor:
    """Context parallelism, allgather mode without a varlen kernel: this rank's queries [B, S_loc, Hq, D] over the
    whole rows' keys [B, S, Hkv, D] through SDPA with CPShard.mask_B1sS. Returns [B, S_loc, Hq, D]."""
    q, k, v = (t.transpose(1, 2) for t in (q_BsHD, k_BSKD, v_BSKD))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1sS, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def cp_varlen_attention(q_BsHD, k_BSKD, v_BSKD, segments: VarlenSegments, scale: float) -> torch.Tensor:
    """Context parallelism, allgather mode on the varlen kernel: this rank's queries [B, S_loc, Hq, D] over the
    whole rows' keys [B, S, Hkv, D], one call over CPShard.segments (no mask). Returns [B, S_loc, Hq, D] in the
    compute dtype."""
    B, s = q_BsHD.shape[:2]
    dtype = compute_dtype(q_BsHD)
    _check_varlen_inputs(q_BsHD, dtype)
    impl = _varlen_kernel()
    q_THD = q_BsHD.flatten(0, 1).to(dtype)
    # a document in both local pieces has its keys copied into both segments: one packed run each
    k_TKD, v_TKD = (t.flatten(0, 1).to(dtype).index_select(0, segments.key_index_T) for t in (k_BSKD, v_BSKD))
    out_THD = impl.fn(q_THD, k_TKD, v_TKD, segments.cu_seqlens_q, segments.max_seqlen_q, scale,
                      cu_seqlens_k=segments.cu_seqlens_k, max_seqlen_k=segments.max_seqlen_k)
    return out_THD.unflatten(0, (B, s))


class Qwen3Attention(nn.Module):
    """Qwen3 attention. `gated=True` is the Qwen3.5 / Qwen3-Next form: q_proj yields a query and a
    gate per head ([q | gate] per head), the output is multiplied by sigmoid(gate) before o_proj, the
    q/k norms use (1 + w), and RoPE may cover only the first `rotary_dim` dims."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 bias: bool = False, backend: str = "sdpa", norm_rope_impl: str = "torch", gated: bool = False,
                 rotary_dim: int | None = None, o_bias: bool = False, device=None, dtype=None):
        super().__init__()
        # Concrete names (runtime.plan resolved "auto"); fetched now, outside any compiled region.
        ATTN_BACKENDS.get(backend)
        NORM_ROPE_IMPLS.get(norm_rope_impl)
        if backend == "flash":
            dense_causal()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.backend, self.norm_rope_impl = eps, backend, norm_rope_impl
        self.gated, self.rotary_dim = gated, rotary_dim
        self.scale = head_dim ** -0.5
        factory = {"device": device, "dtype": dtype}
        q_out = num_heads * head_dim * (2 if gated else 1)
        self.q_proj = nn.Linear(hidden, q_out, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias, **factory)
        self.q_norm = RMSNorm(head_dim, eps, unit_offset=gated, **factory)
        self.k_norm = RMSNorm(head_dim, eps, unit_offset=gated, **factory)

    @property
    def fuse_qkv(self) -> bool:
        """q, k, v as one GEMM (attention/projection.py), unless a transform gave one of them a forward of its
        own (runtime.float8's Float8Linear, LoRA with dropout): read from the modules, so no transform can
        leave it stale."""
        return all(joins_fused_projection(getattr(self, name)) for name in QKV_PROJECTIONS)

    def project_qkv(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, S, q_out], k, v [B, S, Hkv * D]."""
        projs = [getattr(self, name) for name in QKV_PROJECTIONS]
        if self.fuse_qkv:
            return fused_linear(x_BSH, [linear_part(m) for m in projs])
        return tuple(m(x_BSH) for m in projs)

    def forward(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q, k, v = self.project_qkv(x_BSH)
        q_BSHD = q.view(B, S, self.num_heads, -1)
        if self.gated:
            q_BSHD, gate_BSHD = q_BSHD.chunk(2, dim=-1)
        k_BSKD = k.view(B, S, self.num_kv_heads, self.head_dim)
        v_BSKD = v.view(B, S, self.num_kv_heads, self.head_dim)
        q_BSHD, k_BSKD = qk_norm_rope(q_BSHD, k_BSKD, self.q_norm.weight, self.k_norm.weight, cos, sin,
                                      self.eps, unit_offset=self.gated, rotary_dim=self.rotary_dim,
                                      impl=self.norm_rope_impl)
        if meta.cp is not None:
            out_BSHD = self._context_parallel(q_BSHD, k_BSKD, v_BSKD, meta.cp)
        else:
            out_BSHD = ATTN_BACKENDS.get(self.backend)(q_BSHD, k_BSKD, v_BSKD, meta, self.scale)
        if self.gated:
            out_BSHD = out_BSHD * torch.sigmoid(gate_BSHD)
        return self.o_proj(out_BSHD.reshape(B, S, -1))

    def _context_parallel(self, q_BsHD, k_BsKD, v_BsKD, cp: CPShard) -> torch.Tensor:
        """Attention of this rank's queries over the whole rows (attention/context_parallel.py)."""
        if cp.mode == "ulysses":
            k_BsKD, v_BsKD = (repeat_kv_for_cp(t, self.num_heads, cp.size) for t in (k_BsKD, v_BsKD))
            q_BShD, k_BSkD, v_BSkD = (seq_to_heads(t, cp) for t in (q_BsHD, k_BsKD, v_BsKD))
            return heads_to_seq(ATTN_BACKENDS.get(self.backend)(q_BShD, k_BSkD, v_BSkD, cp.meta, self.scale), cp)
        k_BSKD, v_BSKD = gather_sequence(k_BsKD, cp), gather_sequence(v_BsKD, cp)
        if cp.segments is not None:
            return cp_varlen_attention(q_BsHD, k_BSKD, v_BSKD, cp.segments, self.scale)
        return cp_masked_attention(q_BsHD, k_BSKD, v_BSKD, cp.mask_B1sS, self.scale)

"""GPU test of context parallelism's allgather mode on the varlen kernel (attention/attention.py
cp_varlen_attention over CPShard.segments) against the masked-SDPA path (cp_masked_attention with
CPShard.mask_B1sS) in fp32, on one GPU with no process group: this rank's queries and whole-row K/V as if
gathered. bf16 through every varlen implementation installed (flash-attn's, torch's varlen_attn): output and
the grads of q, k, v, norm-relative <= 1e-2. GQA (8 q heads on 2 kv heads), head_dim 64 and 128, cp 2 and 4,
packed rows whose documents cross piece boundaries, start at one, fit in one piece, fill a row.

Shapes: q_BsHD [B, S_loc, Hq, D] (this rank's tokens), k/v_BSKD [B, S, Hkv, D] (whole rows).
"""

from __future__ import annotations

import pytest
import torch

import attention.attention as attn_mod
from attention.attention import VarlenImpl, build_attn_meta, cp_masked_attention, cp_varlen_attention
from attention.context_parallel import CPShard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HQ, HKV = 8, 2
TOL = 1e-2
S = 2048  # pieces of 512 at cp 2, 256 at cp 4
ROWS = [[300, 212, 1, 1, 510, 700, 324], [2048], [1024, 3, 509, 512]]


def _implementations() -> list[VarlenImpl]:
    """Every varlen implementation importable here, each through our adapter."""
    flash_attn_fn, torch_fn = attn_mod._import_flash_attn_varlen(), attn_mod._import_torch_varlen()
    impls = [] if flash_attn_fn is None else [VarlenImpl("flash_attn", attn_mod._flash_attn_caller(flash_attn_fn))]
    caller = None if torch_fn is None else attn_mod._torch_varlen_caller(torch_fn)
    return impls + ([] if caller is None else [VarlenImpl("torch", caller)])


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def _shards(size: int, rank: int) -> tuple[CPShard, CPShard]:
    """(varlen shard, mask shard) of ROWS for cp rank `rank` of `size`, on the GPU."""
    pos_BS = torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in ROWS]).cuda()
    cu, max_len = attn_mod.cu_seqlens_from_position_ids(pos_BS)
    varlen = CPShard(None, rank, size, build_attn_meta(pos_BS, cu, max_len, "flash"), pos_BS)
    masked = CPShard(None, rank, size, build_attn_meta(pos_BS, cu, max_len, "sdpa"), pos_BS)
    return varlen, masked


def _out_and_grads(fn, q_BsHD, k_BSKD, v_BSKD, grad_BsHD) -> dict[str, torch.Tensor]:
    q_BsHD, k_BSKD, v_BSKD = (t.detach().requires_grad_() for t in (q_BsHD, k_BSKD, v_BSKD))
    out = fn(q_BsHD, k_BSKD, v_BSKD)
    grads = torch.autograd.grad(out, (q_BsHD, k_BSKD, v_BSKD), grad_BsHD.to(out.dtype))
    return {"out": out.detach(), **dict(zip("qkv", grads))}


@pytest.mark.parametrize("impl", _implementations(), ids=lambda impl: impl.name)
@pytest.mark.parametrize("size,rank", [(2, 0), (2, 1), (4, 1), (4, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_varlen_path_matches_fp32_masked_path(monkeypatch, impl, size, rank, head_dim):
    monkeypatch.setattr(attn_mod, "_varlen_choice", impl)
    varlen, masked = _shards(size, rank)
    assert varlen.mask_B1sS is None
    B, s = len(ROWS), S // size
    gen = torch.Generator(device="cuda").manual_seed(rank)
    q_BsHD = torch.randn(B, s, HQ, head_dim, device="cuda", generator=gen)
    k_BSKD, v_BSKD = (torch.randn(B, S, HKV, head_dim, device="cuda", generator=gen) for _ in range(2))
    grad_BsHD = torch.randn(B, s, HQ, head_dim, device="cuda", generator=gen)
    scale = head_dim ** -0.5
    bf16 = [t.bfloat16() for t in (q_BsHD, k_BSKD, v_BSKD)]
    ours = _out_and_grads(lambda q, k, v: cp_varlen_attention(q, k, v, varlen.segments, scale), *bf16, grad_BsHD)
    # the reference sees the same (bf16-rounded) inputs: what is compared is the kernels' arithmetic
    ref = _out_and_grads(lambda q, k, v: cp_masked_attention(q, k, v, masked.mask_B1sS, scale),
                         *(t.float() for t in bf16), grad_BsHD)
    assert ours["out"].dtype == torch.bfloat16
    errors = {name: rel_err(ours[name], ref[name]) for name in ref}
    assert max(errors.values()) <= TOL, errors

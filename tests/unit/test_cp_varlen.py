"""Context parallelism's allgather mode on the varlen kernel (attention/context_parallel.py VarlenSegments,
attention/attention.py cp_varlen_attention), on the CPU: the segment tables of every cp rank partition its local
queries, each segment's queries lie in one document and its keys run from that document's start to its last
query; a reference "varlen" kernel written here (per segment SDPA, causal aligned bottom-right) over the tables
equals the masked-SDPA path (CPShard.mask_B1sS) on the same local queries and whole-row K/V, forward and grads.
Rows hold documents that cross piece boundaries, start exactly at one, fit inside one piece (1 token), fill a
whole row, and padding. No process group: CPShard builds its tables without one.

Shapes: q_BsHD [B, S_loc, Hq, D] (this rank's tokens), k/v_BSKD [B, S, Hkv, D] (whole rows, as gathered).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import attention.attention as attn_mod
from attention.attention import (
    AttnMeta,
    Qwen3Attention,
    VarlenImpl,
    build_attn_meta,
    cp_masked_attention,
    cp_varlen_attention,
    cu_seqlens_from_position_ids,
    document_ids,
)
from attention.context_parallel import CPShard
from attention.rope import RopeConfig, RotaryEmbedding

S = 48
HQ, HKV, D = 4, 2, 8
# with S = 48 the pieces are 12 long at cp 2 and 6 at cp 4
ROWS = {
    "crossing_and_at_boundaries": [[5, 7, 1, 1, 16, 18], [48], [1, 2, 3, 20, 22]],
    "tiny_documents": [[1] * 12 + [24, 1, 1, 10], [47, 1]],
}


def _random_rows(seed: int, batch: int = 3) -> list[list[int]]:
    """Document lengths of `batch` rows, each cut at up to 8 random places."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(S - 1, generator=g)[:int(torch.randint(0, 9, (), generator=g))].add(1).sort().values
        bounds = [0, *cuts.tolist(), S]
        rows.append([hi - lo for lo, hi in itertools.pairwise(bounds)])
    return rows


CASES = {**ROWS, "random_0": _random_rows(0), "random_1": _random_rows(1)}


def _position_ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in rows])


def _shards(rows: list[list[int]], size: int, rank: int) -> tuple[CPShard, CPShard]:
    """(varlen shard, mask shard) of the same whole rows, as ContextParallel.shard builds them per backend."""
    pos_BS = _position_ids(rows)
    cu, max_len = cu_seqlens_from_position_ids(pos_BS)
    varlen = CPShard(None, rank, size, build_attn_meta(pos_BS, cu, max_len, "flash"), pos_BS)
    masked = CPShard(None, rank, size, build_attn_meta(pos_BS, cu, max_len, "sdpa"), pos_BS)
    return varlen, masked


def _reference_varlen(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, cu_seqlens_k=None, max_seqlen_k=None):
    """VarlenFn by definition: per segment SDPA, causal aligned bottom-right (query i of n_q sees keys
    0 .. i + n_k - n_q); the max lengths must be the longest segments, as a kernel sizes its tiles by them."""
    cu_q, cu_k = cu_seqlens.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen == max(b - a for a, b in itertools.pairwise(cu_q))
    assert max_seqlen_k == max(b - a for a, b in itertools.pairwise(cu_k))
    outs = []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        n_q, n_k = q1 - q0, k1 - k0
        mask_qk = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
        q, k, v = (t.transpose(0, 1) for t in (q_THD[q0:q1], k_TKD[k0:k1], v_TKD[k0:k1]))
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask_qk, scale=scale,
                                                   enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture
def reference_kernel(monkeypatch):
    """The varlen path on the CPU: the device guard lifted, _reference_varlen playing the kernel."""
    monkeypatch.setattr(attn_mod, "_varlen_choice", VarlenImpl("reference", _reference_varlen))
    monkeypatch.setattr(attn_mod, "_check_varlen_inputs", lambda q, dtype: None)


PARAMS = [(name, size, rank) for name in CASES for size in (2, 4) for rank in range(size)]
IDS = [f"{name}-cp{size}-rank{rank}" for name, size, rank in PARAMS]


@pytest.mark.parametrize("name,size,rank", PARAMS, ids=IDS)
def test_segments_partition_local_queries_within_documents(name, size, rank):
    rows = CASES[name]
    varlen, masked = _shards(rows, size, rank)
    assert varlen.mask_B1sS is None and masked.segments is None  # the varlen path builds no mask
    seg = varlen.segments
    B = len(rows)
    s = S // size
    cu_q, cu_k, key_index = seg.cu_seqlens_q.tolist(), seg.cu_seqlens_k.tolist(), seg.key_index_T.tolist()
    # every local token in exactly one segment: boundaries strictly increasing from 0 to B * S_loc
    assert cu_q[0] == 0 and cu_q[-1] == B * s and all(a < b for a, b in itertools.pairwise(cu_q))
    assert cu_k[0] == 0 and cu_k[-1] == len(key_index) and len(cu_k) == len(cu_q)
    # the flattened whole-row position of every local token, and its document
    q_pos_T = (torch.arange(B).unsqueeze(1) * S + varlen.index_S).flatten().tolist()
    doc_T = (document_ids(varlen.position_ids_BS) + torch.arange(B).unsqueeze(1) * S).flatten().tolist()
    doc_start = {d: min(t for t in range(B * S) if doc_T[t] == d) for d in set(doc_T)}
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k)):
        queries = q_pos_T[q0:q1]
        assert queries == list(range(queries[0], queries[-1] + 1))  # consecutive row positions
        (doc,) = {doc_T[t] for t in queries}
        assert key_index[k0:k1] == list(range(doc_start[doc], queries[-1] + 1))
    assert seg.max_seqlen_q == max(b - a for a, b in itertools.pairwise(cu_q))
    assert seg.max_seqlen_k == max(b - a for a, b in itertools.pairwise(cu_k))


def _inputs(B: int, size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q_BsHD = torch.randn(B, S // size, HQ, D, generator=g, requires_grad=True)
    k_BSKD, v_BSKD = (torch.randn(B, S, HKV, D, generator=g, requires_grad=True) for _ in range(2))
    grad_BsHD = torch.randn(B, S // size, HQ, D, generator=g)
    return q_BsHD, k_BSKD, v_BSKD, grad_BsHD


def _out_and_grads(fn, q_BsHD, k_BSKD, v_BSKD, grad_BsHD) -> dict[str, torch.Tensor]:
    out = fn(q_BsHD, k_BSKD, v_BSKD)
    grads = torch.autograd.grad(out, (q_BsHD, k_BSKD, v_BSKD), grad_BsHD)
    return {"out": out.detach(), **dict(zip("qkv", grads))}


@pytest.mark.parametrize("name,size,rank", PARAMS, ids=IDS)
def test_varlen_path_equals_masked_path(reference_kernel, name, size, rank):
    rows = CASES[name]
    varlen, masked = _shards(rows, size, rank)
    inputs = _inputs(len(rows), size, seed=rank)
    scale = D ** -0.5
    ours = _out_and_grads(lambda q, k, v: cp_varlen_attention(q, k, v, varlen.segments, scale), *inputs)
    ref = _out_and_grads(lambda q, k, v: cp_masked_attention(q, k, v, masked.mask_B1sS, scale), *inputs)
    errors = {n: float((ours[n] - ref[n]).norm() / ref[n].norm()) for n in ref}
    assert max(errors.values()) <= 1e-6, errors


def test_one_document_per_row_without_cu_seqlens():
    """No cu_seqlens in the metadata: every row is one document (AttnMeta's contract)."""
    pos_BS = torch.arange(S).expand(2, S)
    shard = CPShard(None, 1, 2, AttnMeta(varlen=True), pos_BS)
    # rank 1 of cp 2: pieces 1 and 2 of each row, keys from the row's start
    assert shard.segments.cu_seqlens_q.tolist() == [0, 12, 24, 36, 48]
    assert shard.segments.cu_seqlens_k.tolist() == [0, 24, 60, 84, 120]


@pytest.mark.parametrize("gated", [False, True])
def test_layer_takes_the_varlen_path(reference_kernel, monkeypatch, gated):
    """Qwen3Attention under cp with varlen metadata equals the layer over whole rows (sdpa backend). One cp rank
    (its pieces 0 and 1 are the whole row, cut in the middle), so the all-gather is the identity."""
    monkeypatch.setattr(attn_mod, "gather_sequence", lambda t, shard: t)
    rows = CASES["crossing_and_at_boundaries"]
    pos_BS = _position_ids(rows)
    varlen, _ = _shards(rows, 1, 0)
    assert len(varlen.segments.cu_seqlens_q) - 1 > sum(len(docs) for docs in rows)  # documents cut at S / 2
    torch.manual_seed(0)
    layer = Qwen3Attention(32, HQ, HKV, D, 1e-6, gated=gated, rotary_dim=4 if gated else None,
                           norm_rope_impl="torch")
    x_BSH = torch.randn(len(rows), S, 32)
    cos, sin = RotaryEmbedding(RopeConfig(partial_rotary_factor=0.5 if gated else 1.0), D)(pos_BS, x_BSH.dtype)
    out = layer(x_BSH, cos, sin, AttnMeta(cp=varlen))
    ref = layer(x_BSH, cos, sin, build_attn_meta(pos_BS))
    assert float((out - ref).detach().norm() / ref.detach().norm()) <= 1e-6


def test_callers_pass_the_keys_own_boundaries():
    """Both adapters hand cu_seqlens_k / max_seqlen_k to the kernel, and the queries' when none are given."""
    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        calls.append((cu_q, cu_k, max_q, max_k, causal))
        return q

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        calls.append((cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0)))
        return query

    q_THD = torch.randn(6, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 5, 11], dtype=torch.int32)
    for call in (attn_mod._flash_attn_caller(flash_attn_varlen_func), attn_mod._torch_varlen_caller(varlen_attn)):
        calls.clear()
        call(q_THD, q_THD, q_THD, cu_q, 4, 8 ** -0.5, cu_seqlens_k=cu_k, max_seqlen_k=6)
        call(q_THD, q_THD, q_THD, cu_q, 4, 8 ** -0.5)
        assert calls == [(cu_q, cu_k, 4, 6, True), (cu_q, cu_q, 4, 4, True)]

"""GPU tests of GDN state passing (parallelism.cp_gdn: state) on the `fla` op set, on one device, no process group.

- The delta rule of pieces: rows cut into 8 pieces as cp=4 ranks would hold them, all pieces run at once with
  attention/gdn.py's own functions (delta_rule_state_maps from the state [0 | I_K], incoming_states composed in
  row order, with_incoming_state), the pieces' document tables from piece_documents (documents crossing piece
  boundaries and several whole pieces, one starting exactly at a piece boundary, a 1-token document, partial
  chunks: pieces of 150 tokens). Output and gradients of q, k, v, g, beta against the whole-row fla call and the
  whole-row torch op set in fp32; bf16 and fp32 inputs (fp32: FLA's GEMMs take TF32).
- The conv of pieces extended back by the conv tail (CPShard.conv_cu_seqlens' layout) against the whole rows.
- The layer with a CPShard of cp size 1 (both pieces of every row on one rank, gather_pieces the identity):
  the real state path (conv tails, state maps, composition) against the fla layer and the torch layer (fp32) on
  whole rows, output and every gradient; torch.compile(fullgraph=True) of it without graph breaks.
- A plain initial state: our op set against FLA's public chunk_gated_delta_rule(initial_state=...,
  output_final_state=True), o, final state and every gradient including dh0 (rows and varlen), and against the
  torch op set in fp32 (the contract: row b's state read up to its first document start after column 0).

Tolerances (norm-relative): bf16 2e-2 (tests/gpu/test_gdn_gpu.py's: the fla kernels store o, the chunk states
and v' in bf16; the bf16 layer against the fp32 one 3e-2, LAYER_VS_FP32), fp32 inputs 1e-2 (TF32 GEMMs, ~2e-3
expected: attention/gdn_ops_fla.py), our op against FLA's public function 1e-6 (the same kernels). The errors
are printed (pytest -rA shows them).
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    pytest.importorskip("fla", reason="op set fla needs flash-linear-attention")
    from attention import gdn_ops_fla, gdn_ops_torch
    if refusal := gdn_ops_fla.backward_refusal():
        pytest.skip(refusal, allow_module_level=True)
    from attention.attention import AttnMeta, build_attn_meta
    from attention.context_parallel import CPShard, piece_documents
    from attention.gdn import delta_rule_state_maps, incoming_states, with_incoming_state
    from tests.gpu.test_gdn_gpu import HEADS, layer_pair, leaves, rel_err

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-2}
# Rows of 1200 tokens in 8 pieces of 150 (piece starts 150, 300, ..., 1050). Row 0: a 1-token document, one
# starting exactly at the piece boundary 300, a 2-token one across 450, one over pieces 4..7; row 1: one document.
SEQ, NUM_PIECES = 1200, 8
CU_SEQLENS = [0, 1, 130, 300, 449, 451, 700, 1200, 2400]


def check(name, actual, expected, tol, errors):
    errors[name] = rel_err(actual, expected)
    assert errors[name] <= tol, f"{name}: norm-relative error {errors[name]:.2e} > {tol:.0e} ({errors})"


def inputs(batch, seq, dtype, g_max=0.02, seed=0):
    """q, k, v as strided views of one fused tensor (like the layer's conv output), g fp32, beta; weak decays
    (g ~ U(-g_max, 0)) so that the state crosses whole pieces."""
    hk, hv, dk, dv = HEADS["hk"], HEADS["hv"], HEADS["dk"], HEADS["dv"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, seq, 2 * hk * dk + hv * dv, device="cuda", generator=gen).to(dtype)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -torch.rand(batch, seq, hv, device="cuda", generator=gen) * g_max
    beta = torch.rand(batch, seq, hv, device="cuda", generator=gen).to(dtype)
    return [q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv)), g, beta]


def doc_bounds(cu, batch, seq):
    return sorted(set(cu) | set(range(0, batch * seq + 1, seq)))


def pieces_delta_rule(ops, q, k, v, g, beta, cu, num_pieces):
    """The state path of attention/gdn.py on all num_pieces pieces of every row at once (one rank holding every
    piece, so the gathered maps are the local ones): [B, S, ...] -> o_BSHV."""
    B, S, HV, V = v.shape
    n, P = B * num_pieces, S // num_pieces
    piece_cu, continues = piece_documents(doc_bounds(cu, B, S), B, S, num_pieces, tuple(range(num_pieces)))
    docs = ops.prepare_docs(torch.tensor(piece_cu, dtype=torch.int32, device="cuda"), n, P, "cuda")
    q, k, v, g, beta = (t.reshape(n, P, *t.shape[2:]) for t in (q, k, v, g, beta))
    o_nPHW, maps_nHKW = delta_rule_state_maps(ops, q, k, v, g, beta, docs, torch.tensor(continues, device="cuda"))
    maps_pBHKW = maps_nHKW.unflatten(0, (B, num_pieces)).transpose(0, 1)
    state_in_nHKV = incoming_states(maps_pBHKW, V, tuple(range(num_pieces))).transpose(0, 1).flatten(0, 1)
    return with_incoming_state(o_nPHW, state_in_nHKV).to(v.dtype).reshape(B, S, HV, V)


def whole_rows(ops, q, k, v, g, beta, cu):
    B, S = v.shape[:2]
    return ops.chunk_gated_delta_rule(q, k, v, g, beta, ops.prepare_docs(cu_tensor(cu), B, S, "cuda"))


def cu_tensor(cu):
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def outputs_and_grads(fn, leaf_inputs, seed=1):
    out = fn(*leaf_inputs)
    grad_out = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    return out, torch.autograd.grad(out, leaf_inputs, grad_out.to(out.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pieces_delta_rule_equals_whole_rows(dtype):
    x = inputs(2, SEQ, dtype)
    ours, ours_grads = outputs_and_grads(
        lambda *t: pieces_delta_rule(gdn_ops_fla, *t, CU_SEQLENS, NUM_PIECES), leaves(x))
    fla, fla_grads = outputs_and_grads(lambda *t: whole_rows(gdn_ops_fla, *t, CU_SEQLENS), leaves(x))
    ref, ref_grads = outputs_and_grads(lambda *t: whole_rows(gdn_ops_torch, *t, CU_SEQLENS), leaves(x, upcast=True))
    # the torch op set's pieces in fp32: the math itself, to fp32 rounding
    ref_pieces, ref_pieces_grads = outputs_and_grads(
        lambda *t: pieces_delta_rule(gdn_ops_torch, *t, CU_SEQLENS, NUM_PIECES), leaves(x, upcast=True))
    errors = {}
    assert ours.dtype == dtype
    for name, a, b, c, d in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (ours, *ours_grads), (fla, *fla_grads),
                                (ref, *ref_grads), (ref_pieces, *ref_pieces_grads)):
        check(f"{name} vs fla whole rows", a, b, TOL[dtype], errors)
        check(f"{name} vs torch fp32", a, c, TOL[dtype], errors)
        check(f"{name} torch pieces vs torch fp32", d, c, 1e-4, errors)
    print(f"pieces delta rule {dtype}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


def test_conv_on_extended_pieces_equals_whole_rows():
    """Each piece with the conv_tail pre-conv tokens before it (zeros before a row) and the extended pieces'
    documents (piece_documents with back=conv_tail, as CPShard.conv_cu_seqlens): the pieces' outputs and the
    gradients (the tails' flowing back to their tokens) are the whole rows'."""
    B, tail, P = 2, 3, SEQ // NUM_PIECES
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, SEQ, 8192, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(8192, tail + 1, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    cols = torch.stack([torch.arange(p * P - tail, (p + 1) * P, device="cuda") for p in range(NUM_PIECES)])
    conv_cu, _ = piece_documents(doc_bounds(CU_SEQLENS, B, SEQ), B, SEQ, NUM_PIECES, tuple(range(NUM_PIECES)), tail)
    ext_docs = gdn_ops_fla.prepare_docs(cu_tensor(conv_cu), B * NUM_PIECES, P + tail, "cuda")

    def pieces(x, w):
        x_ext = torch.where((cols >= 0)[None, :, :, None], x[:, cols.clamp_min(0)], 0).flatten(0, 1)
        return gdn_ops_fla.causal_conv1d_silu(x_ext, w, ext_docs)[:, tail:].reshape(B, SEQ, -1)

    ours, ours_grads = outputs_and_grads(pieces, leaves([x, w]))
    ref, ref_grads = outputs_and_grads(lambda x, w: gdn_ops_fla.causal_conv1d_silu(x, w, cu_tensor(CU_SEQLENS)),
                                       leaves([x, w]))
    errors = {}
    # the same taps over the same tokens; dx adds a tail's gradient in bf16, dw sums in another order
    for name, a, b, tol in zip(("y", "dx", "dw"), (ours, *ours_grads), (ref, *ref_grads), (1e-3, 5e-3, 2e-2)):
        check(name, a, b, tol, errors)
    print("conv on extended pieces: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


# ---- the layer, cp size 1 -----------------------------------------------------------------------------------

LAYER_SEQ = 1000
# Rows of 1000 tokens, pieces of 500. Row 0: a 2-token document across the boundary 500 (a conv tail holding a
# document start); row 1: a document starting exactly at 500; row 2: one document across it.
LAYER_CU = [0, 130, 499, 501, 700, 1000, 1500, 2000, 3000]
# the bf16 layer (weights, projections, norm in bf16) against the fp32 one: dt_bias and A_log's gradients (sums of
# dg * g over every token, small |g| here) are 1.5e-2 off from the bf16 activations alone (measured on the CPU
# with the delta rule in fp32), before the fla kernels' own rounding
LAYER_VS_FP32 = 3e-2


def layer_case(layout):
    """(fla layer bf16, torch layer fp32, x, whole rows' meta, cp size 1 shard) with weak decays (A = 0.01..0.05)
    so that the state crosses the piece boundary."""
    fla_layer, ref_layer = layer_pair(layout)
    with torch.no_grad():
        for layer in (fla_layer, ref_layer):
            layer.A_log.copy_(torch.linspace(0.01, 0.05, layer.num_v_heads).log())
    B = 3
    pos = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(LAYER_CU)]).view(B, LAYER_SEQ).cuda()
    meta = build_attn_meta(pos, cu_tensor(LAYER_CU), 1000, "sdpa")
    shard = CPShard(None, 0, 1, meta, pos, gdn_mode="state", gdn_conv_tail=fla_layer.conv1d.kernel_size[0] - 1)
    x = torch.randn(B, LAYER_SEQ, fla_layer.out_proj.out_features, device="cuda").to(torch.bfloat16)
    return fla_layer, ref_layer, x, meta, shard


def layer_outputs_and_grads(layer, x, meta):
    return outputs_and_grads(lambda x, *_: layer(x, meta), [x, *layer.parameters()])


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
def test_layer_state_path_equals_whole_rows(layout):
    fla_layer, ref_layer, x, meta, shard = layer_case(layout)
    ours, ours_grads = layer_outputs_and_grads(fla_layer, x.clone().requires_grad_(), AttnMeta(cp=shard))
    fla, fla_grads = layer_outputs_and_grads(fla_layer, x.clone().requires_grad_(), meta)
    ref, ref_grads = layer_outputs_and_grads(ref_layer, x.float().requires_grad_(), meta)
    errors = {}
    names = ["y", "x", *(n for n, _ in fla_layer.named_parameters())]
    for name, a, b, c in zip(names, (ours, *ours_grads), (fla, *fla_grads), (ref, *ref_grads)):
        check(f"{name} vs fla whole rows", a, b, TOL[torch.bfloat16], errors)
        check(f"{name} vs torch fp32", a, c, LAYER_VS_FP32, errors)
    print(f"layer {layout} state path: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


def test_compile_fullgraph_state_path():
    """Inductor around the state path on the fla ops (the new op signatures, the row/sequence index maps): no graph
    break, and the same numbers as eager."""
    from torch._dynamo.utils import counters

    fla_layer, _, x, _, shard = layer_case("qwen3_5")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fla_layer, fullgraph=True)
    ours, ours_grads = layer_outputs_and_grads(compiled, x.clone().requires_grad_(), AttnMeta(cp=shard))
    ref, ref_grads = layer_outputs_and_grads(fla_layer, x.clone().requires_grad_(), AttnMeta(cp=shard))
    assert not counters["graph_break"], dict(counters["graph_break"])
    errors = {}
    for name, a, b in zip(["y", "x", *(n for n, _ in fla_layer.named_parameters())], (ours, *ours_grads),
                          (ref, *ref_grads)):
        check(name, a, b, 1e-2, errors)


# ---- a plain initial state against FLA's public function ------------------------------------------------------

INIT_SEQ = 300
INIT_CU = [0, 100, 300, 450, 451, 600]  # row 1's first document (reading its initial state) ends at 450


def fla_public(q, k, v, g, beta, h0_BHKV, cu):
    """FLA's own autograd function: rows packed to [1, B*S] with cu_seqlens, h0 per sequence (row b's state on the
    sequence starting at column 0, zeros elsewhere), the final state of each row's last sequence."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, S = v.shape[:2]
    kw = {"scale": q.shape[-1] ** -0.5, "use_qk_l2norm_in_kernel": True, "output_final_state": True}
    if cu is None:
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0_BHKV, **kw)
        return o, ht
    first = [cu.index(b * S) for b in range(B)]
    last = [cu.index((b + 1) * S) - 1 for b in range(B)]
    h0_N = h0_BHKV.new_zeros(len(cu) - 1, *h0_BHKV.shape[1:]).index_copy(0, torch.tensor(first, device="cuda"),
                                                                        h0_BHKV)
    packed = (t.reshape(1, -1, *t.shape[2:]) for t in (q, k, v, g, beta))
    o, ht = chunk_gated_delta_rule(*packed, initial_state=h0_N, cu_seqlens=cu_tensor(cu), **kw)
    return o.view(v.shape), ht[last]


def ours_with_state(ops, q, k, v, g, beta, h0_BHKV, cu):
    B, S = v.shape[:2]
    docs = ops.prepare_docs(None if cu is None else cu_tensor(cu), B, S, "cuda")
    return ops.chunk_gated_delta_rule(q, k, v, g, beta, docs, initial_state=h0_BHKV, output_final_state=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cu", [INIT_CU, None], ids=["packed", "rows"])
def test_initial_state_matches_fla_public(cu, dtype):
    x = inputs(2, INIT_SEQ, dtype, g_max=0.05)
    h0 = torch.randn(2, HEADS["hv"], HEADS["dk"], HEADS["dv"], device="cuda",
                     generator=torch.Generator(device="cuda").manual_seed(5))
    gen = torch.Generator(device="cuda").manual_seed(6)
    do = torch.randn(x[2].shape, device="cuda", generator=gen)
    dht = torch.randn(h0.shape, device="cuda", generator=gen)

    def run(fn, upcast=False):
        leaf = leaves([*x, h0], upcast=upcast)
        o, ht = fn(*leaf, cu)
        loss = (o.float() * do).sum() + (ht * dht).sum()
        return (o, ht, *torch.autograd.grad(loss, leaf))

    ours = run(lambda *t: ours_with_state(gdn_ops_fla, *t))
    public = run(fla_public)
    ref = run(lambda *t: ours_with_state(gdn_ops_torch, *t), upcast=True)
    errors = {}
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    for name, a, b, c in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), ours, public, ref):
        check(f"{name} vs FLA public", a, b, 1e-6, errors)
        check(f"{name} vs torch fp32", a, c, TOL[dtype], errors)
    print(f"initial state {dtype} {'packed' if cu else 'rows'}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))

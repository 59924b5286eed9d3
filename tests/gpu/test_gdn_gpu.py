"""GPU tests of the GDN `fla` op set (attention/gdn_ops_fla.py) against the `torch` op set.

- Signature guard: the FLA 0.6.0 internals the op set calls still take the keywords it passes (they
  changed between 0.4 and 0.6); the functional tests below then check what they return.
- Ops in bf16 vs the torch op set in fp32 on the same (bf16-representable) inputs, packed rows (several
  documents per row, several rows, cu_seqlens) and plain rows, strided q/k/v views as the layer passes
  them: forward and every input gradient, norm-relative <= 2e-2.
- torch.library.opcheck of the four custom ops (schema, fake tensors, autograd registration, AOT); the delta
  rule with and without initial / final states (state passing: tests/gpu/test_cp_gdn_gpu.py).
- The layer (both layouts) with op set fla vs op set torch on the same weights, packed: forward and all
  parameter gradients; torch.compile(fullgraph=True) of the fla layer: zero graph breaks, same results.

Shapes: q/k_BSHK [B, S, Hk, K], v_BSHV [B, S, Hv, V], g/beta_BSH [B, S, Hv], conv x_BSD [B, S, D].
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    pytest.importorskip("fla", reason="op set fla needs flash-linear-attention")
    from attention import gdn_ops_fla, gdn_ops_torch
    if refusal := gdn_ops_fla.backward_refusal():
        pytest.skip(refusal, allow_module_level=True)
    from attention.attention import AttnMeta
    from attention.gdn import GatedDeltaNet

TOL = 2e-2
# Qwen3.5 GDN head dims; rows of 1000 tokens with documents crossing chunk (64) boundaries, a 1-token
# document and a row that is a single document.
HEADS = {"hk": 16, "hv": 32, "dk": 128, "dv": 128}
CU_SEQLENS = [0, 1, 130, 700, 1000, 1063, 2000, 3000]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, tol, name):
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: norm-relative error {err:.2e} > {tol:.0e}"


def cu_tensor(cu):
    return None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")


def delta_rule_inputs(batch, seq, hk, hv, dk, dv, dtype=torch.bfloat16, seed=0):
    """q, k, v as strided views of one fused tensor (like the layer's conv output), g fp32, beta."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, seq, 2 * hk * dk + hv * dv, device="cuda", generator=gen).to(dtype)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -torch.rand(batch, seq, hv, device="cuda", generator=gen) * 0.3
    beta = torch.rand(batch, seq, hv, device="cuda", generator=gen).to(dtype)
    return q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv)), g, beta


def leaves(tensors, upcast=False):
    """Grad-requiring copies keeping the strides (fp32 copies on the reference side)."""
    out = []
    for t in tensors:
        t = t.float() if upcast else t
        leaf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
        out.append(leaf.requires_grad_())
    return out


def outputs_and_grads(fn, inputs, seed=1):
    out = fn(*inputs)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grad_out = torch.randn(out.shape, device="cuda", generator=gen)
    return out, torch.autograd.grad(out, inputs, grad_out.to(out.dtype))


# ---- signature guard -----------------------------------------------------------------------------

def test_fla_internal_signatures():
    import fla
    from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
    from fla.ops.utils.index import prepare_chunk_indices

    assert fla.__version__ == "0.6.0", "gdn_ops_fla was written against FLA 0.6.0; re-check its internals"
    needed = {
        l2norm_fwd: ["x"],
        l2norm_bwd: ["y", "rstd", "dy"],
        prepare_chunk_indices: ["cu_seqlens", "chunk_size"],
        chunk_gated_delta_rule_fwd: ["q", "k", "v", "g", "beta", "scale", "initial_state",
                                     "output_final_state", "cu_seqlens", "chunk_indices", "chunk_size"],
        chunk_gated_delta_rule_bwd: ["q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht",
                                     "cu_seqlens", "chunk_indices", "chunk_size"],
        causal_conv1d_fwd: ["x", "weight", "bias", "residual", "activation", "cu_seqlens", "chunk_indices",
                            "chunk_size"],
        causal_conv1d_bwd: ["x", "dy", "dht", "weight", "bias", "residual", "activation", "cu_seqlens",
                            "chunk_indices", "chunk_size"],
    }
    for fn, names in needed.items():
        params = inspect.signature(fn).parameters
        missing = [n for n in names if n not in params]
        assert not missing, f"{fn.__module__}.{fn.__name__} lost parameters {missing}"
    # Positional order matters where gdn_ops_fla passes positionally.
    assert list(inspect.signature(l2norm_bwd).parameters)[:3] == ["y", "rstd", "dy"]
    assert list(inspect.signature(prepare_chunk_indices).parameters)[:2] == ["cu_seqlens", "chunk_size"]


# ---- ops: fla bf16 vs torch fp32 -----------------------------------------------------------------

@pytest.mark.parametrize("batch,seq,cu", [(3, 1000, CU_SEQLENS), (2, 300, None)], ids=["packed", "rows"])
def test_delta_rule_bf16_matches_torch(batch, seq, cu):
    inputs = delta_rule_inputs(batch, seq, **HEADS)
    cu_seqlens = cu_tensor(cu)
    fla_docs = gdn_ops_fla.prepare_docs(cu_seqlens, batch, seq, "cuda")
    torch_docs = gdn_ops_torch.prepare_docs(cu_seqlens, batch, seq, "cuda")
    ours, ours_grads = outputs_and_grads(lambda *t: gdn_ops_fla.chunk_gated_delta_rule(*t, fla_docs),
                                         leaves(inputs))
    ref, ref_grads = outputs_and_grads(lambda *t: gdn_ops_torch.chunk_gated_delta_rule(*t, torch_docs),
                                       leaves(inputs, upcast=True))
    assert ours.dtype == torch.bfloat16
    assert_close(ours, ref, TOL, "o")
    for name, a, b, x in zip(("dq", "dk", "dv", "dg", "dbeta"), ours_grads, ref_grads, inputs):
        assert a.dtype == x.dtype, name
        assert_close(a, b, TOL, name)


@pytest.mark.parametrize("batch,seq,cu", [(3, 1000, CU_SEQLENS), (2, 300, None)], ids=["packed", "rows"])
def test_conv_bf16_matches_torch(batch, seq, cu):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, seq, 8192, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(8192, 4, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    cu_seqlens = cu_tensor(cu)
    fla_docs = gdn_ops_fla.prepare_docs(cu_seqlens, batch, seq, "cuda")
    torch_docs = gdn_ops_torch.prepare_docs(cu_seqlens, batch, seq, "cuda")
    ours, ours_grads = outputs_and_grads(lambda x, w: gdn_ops_fla.causal_conv1d_silu(x, w, fla_docs),
                                         leaves([x, w]))
    ref, ref_grads = outputs_and_grads(lambda x, w: gdn_ops_torch.causal_conv1d_silu(x, w, torch_docs),
                                       leaves([x, w], upcast=True))
    assert_close(ours, ref, TOL, "y")
    for name, a, b in zip(("dx", "dw"), ours_grads, ref_grads):
        assert_close(a, b, TOL, name)


# ---- opcheck --------------------------------------------------------------------------------------

@pytest.mark.parametrize("state", [False, True], ids=["no state", "initial and final state"])
@pytest.mark.parametrize("cu", [CU_SEQLENS, None], ids=["packed", "rows"])
def test_opcheck(cu, state):
    batch, seq = (1, CU_SEQLENS[-1]) if cu else (2, 300)
    cu_seqlens = cu_tensor(cu)
    q, k, v, g, beta = (t.contiguous() for t in delta_rule_inputs(batch, seq, hk=2, hv=4, dk=64, dv=64))
    scale = 64 ** -0.5
    num_states = len(cu) - 1 if cu else batch
    h0 = torch.randn(num_states, 4, 64, 64, device="cuda") if state else None
    fwd_args = (*leaves([q, k, v, g, beta]), h0 if h0 is None else leaves([h0])[0], cu_seqlens, scale, state)
    torch.library.opcheck(gdn_ops_fla.gdr_fwd, fwd_args)
    _, ht, q_n, q_rstd, k_n, k_rstd, g_cum, A = gdn_ops_fla.gdr_fwd(q, k, v, g, beta, h0, cu_seqlens, scale, state)
    assert ht.shape == ((num_states, 4, 64, 64) if state else (0,))
    dht = torch.randn_like(ht) if state else None
    bwd_args = (torch.randn_like(v), dht, q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, h0, cu_seqlens, scale)
    torch.library.opcheck(gdn_ops_fla.gdr_bwd, bwd_args)
    if state:
        return
    x = torch.randn(batch, seq, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(gdn_ops_fla.conv_fwd, (*leaves([x, w]), cu_seqlens))
    torch.library.opcheck(gdn_ops_fla.conv_bwd, (x, w, torch.randn_like(x), cu_seqlens))


# ---- the layer --------------------------------------------------------------------------------------

LAYER = {"hidden": 1024, "num_k_heads": 4, "num_v_heads": 8, "head_k_dim": 128, "head_v_dim": 128, "conv_kernel": 4,
             "eps": 1e-6}


def layer_pair(layout, seed=0):
    """(fla layer in bf16, torch layer in fp32 holding the same bf16 values)."""
    torch.manual_seed(seed)
    fla_layer = GatedDeltaNet(**LAYER, layout=layout, op_set="fla", device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in fla_layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.randn_like(p) * 0.5 - 1.0)  # decays that let the state carry across chunks
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if name == "conv1d.weight" else p.shape[-1] ** -0.5))
    ref_layer = GatedDeltaNet(**LAYER, layout=layout, op_set="torch", device="cuda", dtype=torch.float32)
    ref_layer.load_state_dict({k: v.float() for k, v in fla_layer.state_dict().items()})
    return fla_layer, ref_layer


def packed_batch():
    x = torch.randn(3, 1000, LAYER["hidden"], device="cuda").to(torch.bfloat16)
    return x, AttnMeta(cu_seqlens=cu_tensor(CU_SEQLENS), max_seqlen=570)


def layer_outputs_and_grads(layer, x, meta):
    params = [x, *layer.parameters()]
    return outputs_and_grads(lambda x, *_: layer(x, meta), params)


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
def test_layer_fla_matches_torch(layout):
    fla_layer, ref_layer = layer_pair(layout)
    x, meta = packed_batch()
    ours, ours_grads = layer_outputs_and_grads(fla_layer, x.clone().requires_grad_(), meta)
    ref, ref_grads = layer_outputs_and_grads(ref_layer, x.float().requires_grad_(), meta)
    assert_close(ours, ref, TOL, "y")
    for name, a, b in zip(["x", *(n for n, _ in fla_layer.named_parameters())], ours_grads, ref_grads):
        assert_close(a, b, TOL, name)


def test_compile_fullgraph_fla_layer():
    """Inductor around the opaque FLA ops: no graph break, and the same numbers as eager (bf16 fusion
    rounding only)."""
    from torch._dynamo.utils import counters

    fla_layer, _ = layer_pair("qwen3_5")
    x, meta = packed_batch()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fla_layer, fullgraph=True)
    ours, ours_grads = layer_outputs_and_grads(compiled, x.clone().requires_grad_(), meta)
    ref, ref_grads = layer_outputs_and_grads(fla_layer, x.clone().requires_grad_(), meta)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_close(ours, ref, 1e-2, "y")
    for name, a, b in zip(["x", *(n for n, _ in fla_layer.named_parameters())], ours_grads, ref_grads):
        assert_close(a, b, 1e-2, name)

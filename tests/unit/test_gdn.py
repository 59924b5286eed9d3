"""CPU tests of the Gated DeltaNet layer (attention/gdn.py) and its `torch` op set (gdn_ops_torch.py).

1. Ops vs transformers' reference functions (qwen3_next): the chunked gated delta rule against
   torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule, the conv against causal_conv1d_fn;
   fp32, forward and every input gradient.
2. Packed rows (several documents per row, several rows, cu_seqlens over B*S) equal the documents run
   one by one through the transformers recurrence: ops and the whole layer, forward and gradients.
3. The layer vs transformers' Qwen3NextGatedDeltaNet and Qwen3_5GatedDeltaNet on the same weights
   (loaded by state_dict, so the names match exactly): forward and all parameter / input gradients.
4. torch.compile(fullgraph=True) traces the layer (packed) without graph breaks; `fla` is never
   imported on CPU and is refused there with a clear message.
5. fp32 gradients of the decay parameters at HF's initial decays vs an fp64 token-by-token recurrence
   (written here, independent of the op set), 1e-5.

Shapes: x_BSH [B, S, hidden], q/k_BSHK [B, S, Hk, K], v_BSHV [B, S, Hv, V], g/beta_BSH [B, S, Hv].
Tolerances (norm-relative): forward <= 1e-5, gradients <= 1e-4.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from attention.attention import AttnMeta
from attention.gdn import GatedDeltaNet
from attention.gdn_ops_torch import causal_conv1d_silu, chunk_gated_delta_rule, prepare_docs

FWD_TOL, GRAD_TOL = 1e-5, 1e-4
TINY = {"hidden": 32, "num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 8, "conv_kernel": 4, "eps": 1e-6}
# Several documents per row, one crossing a 64-token chunk boundary, one of length 1, rows of 150 tokens.
CU_SEQLENS = [0, 10, 70, 150, 214, 215, 300]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, tol, name=""):
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: norm-relative error {err:.2e} > {tol:.0e}"


def delta_rule_inputs(batch=2, seq=150, hk=2, hv=4, dk=16, dv=8, seed=0):
    """Leaf tensors (q, k, v, g, beta) with decays spread so the carried state matters."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, hk, dk, generator=gen)
    k = torch.randn(batch, seq, hk, dk, generator=gen)
    v = torch.randn(batch, seq, hv, dv, generator=gen)
    g = -torch.rand(batch, seq, hv, generator=gen) * 0.3
    beta = torch.rand(batch, seq, hv, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def outputs_and_grads(fn, inputs, seed=1):
    out = fn(*inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(out, inputs, grad_out)
    return out, grads


# transformers routes these functions to FLA's CUDA kernels when fla is installed; the references here are
# its own torch implementations, under the wrapper.
HF_TORCH_RECURRENT = inspect.unwrap(hf_next.torch_recurrent_gated_delta_rule)
HF_TORCH_CHUNKED = inspect.unwrap(hf_next.torch_chunk_gated_delta_rule)
# Its GDN layers pick their kernels inside forward, so the layer reference is CPU-only where fla is installed.
needs_hf_torch_layer = pytest.mark.skipif(
    importlib.util.find_spec("fla") is not None and torch.cuda.is_available(),
    reason="transformers' GDN layer runs FLA's CUDA kernels where fla is installed; the CPU suite covers it")


def key_heads_per_value_head(q, k, v):
    """q, k repeated to one key head per value head (value head h reads key head h // group), as HF's layer
    does before these functions: not every transformers release takes fewer key than value heads there."""
    group = v.shape[2] // q.shape[2]
    return q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)


def hf_recurrent(q, k, v, g, beta):
    return HF_TORCH_RECURRENT(*key_heads_per_value_head(q, k, v), v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def hf_chunked(q, k, v, g, beta):
    return HF_TORCH_CHUNKED(*key_heads_per_value_head(q, k, v), v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def hf_conv(x_BSD, w_DW):
    return hf_next.causal_conv1d_fn(x_BSD.transpose(1, 2), w_DW, None, activation="silu").transpose(1, 2)


def per_document(fn, cu_seqlens, batch, seq):
    """fn applied to every document of the flattened rows separately, reassembled to [B, S, ...]."""
    def run(*tensors_BS):
        pieces = []
        for start, end in pairwise(cu_seqlens):
            pieces.append(fn(*(t.flatten(0, 1)[start:end].unsqueeze(0) for t in tensors_BS))[0])
        out = torch.cat(pieces)
        return out.view(batch, seq, *out.shape[1:])
    return run


# ---- 1. ops vs transformers ----------------------------------------------------------------------

@pytest.mark.parametrize("seq,hk,hv", [(150, 2, 4), (64, 2, 2), (7, 1, 3)])
@pytest.mark.parametrize("reference", [hf_chunked, hf_recurrent], ids=["hf_chunk", "hf_recurrent"])
def test_delta_rule_matches_transformers(seq, hk, hv, reference):
    inputs = delta_rule_inputs(seq=seq, hk=hk, hv=hv)
    starts = prepare_docs(None, 2, seq, "cpu")
    ours, ours_grads = outputs_and_grads(lambda *t: chunk_gated_delta_rule(*t, starts), inputs)
    ref, ref_grads = outputs_and_grads(reference, inputs)
    assert_close(ours, ref, FWD_TOL, "o")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), ours_grads, ref_grads):
        assert_close(a, b, GRAD_TOL, name)


def test_conv_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 70, 24, generator=gen).requires_grad_()
    w = torch.randn(24, 4, generator=gen).requires_grad_()
    starts = prepare_docs(None, 2, 70, "cpu")
    ours, ours_grads = outputs_and_grads(lambda x, w: causal_conv1d_silu(x, w, starts), [x, w])
    ref, ref_grads = outputs_and_grads(hf_conv, [x, w])
    assert_close(ours, ref, FWD_TOL, "y")
    for name, a, b in zip(("dx", "dw"), ours_grads, ref_grads):
        assert_close(a, b, GRAD_TOL, name)


# ---- 2. packed rows == documents one by one ------------------------------------------------------

def test_packed_delta_rule_equals_per_document():
    inputs = delta_rule_inputs()
    starts = prepare_docs(torch.tensor(CU_SEQLENS, dtype=torch.int32), 2, 150, "cpu")
    ours, ours_grads = outputs_and_grads(lambda *t: chunk_gated_delta_rule(*t, starts), inputs)
    ref, ref_grads = outputs_and_grads(per_document(hf_recurrent, CU_SEQLENS, 2, 150), inputs)
    assert_close(ours, ref, FWD_TOL, "o")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), ours_grads, ref_grads):
        assert_close(a, b, GRAD_TOL, name)


def test_packed_conv_equals_per_document():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 150, 24, generator=gen).requires_grad_()
    w = torch.randn(24, 4, generator=gen).requires_grad_()
    starts = prepare_docs(torch.tensor(CU_SEQLENS, dtype=torch.int32), 2, 150, "cpu")
    ours, ours_grads = outputs_and_grads(lambda x, w: causal_conv1d_silu(x, w, starts), [x, w])
    ref, ref_grads = outputs_and_grads(
        lambda x, w: per_document(lambda x_1TD: hf_conv(x_1TD, w), CU_SEQLENS, 2, 150)(x), [x, w])
    assert_close(ours, ref, FWD_TOL, "y")
    for name, a, b in zip(("dx", "dw"), ours_grads, ref_grads):
        assert_close(a, b, GRAD_TOL, name)


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
def test_packed_layer_equals_per_document(layout):
    torch.manual_seed(0)
    layer = GatedDeltaNet(**TINY, layout=layout)
    perturb_(layer)
    x = torch.randn(2, 150, TINY["hidden"]).requires_grad_()
    meta = AttnMeta(cu_seqlens=torch.tensor(CU_SEQLENS, dtype=torch.int32), max_seqlen=85)
    params = [x, *layer.parameters()]
    ours, ours_grads = outputs_and_grads(lambda x, *_: layer(x, meta), params)
    ref, ref_grads = outputs_and_grads(lambda x, *_: per_document(layer, CU_SEQLENS, 2, 150)(x), params)
    assert_close(ours, ref, FWD_TOL, "y")
    for name, a, b in zip(["x", *(n for n, _ in layer.named_parameters())], ours_grads, ref_grads):
        assert_close(a, b, GRAD_TOL, name)


# ---- 3. the layer vs transformers' modules -------------------------------------------------------

def hf_module(layout: str):
    common = {"hidden_size": TINY["hidden"], "linear_num_key_heads": TINY["num_k_heads"],
                  "linear_num_value_heads": TINY["num_v_heads"], "linear_key_head_dim": TINY["head_k_dim"],
                  "linear_value_head_dim": TINY["head_v_dim"], "linear_conv_kernel_dim": TINY["conv_kernel"],
                  "rms_norm_eps": TINY["eps"], "num_hidden_layers": 1, "layer_types": ["linear_attention"]}
    if layout == "qwen3_next":
        from transformers import Qwen3NextConfig
        return hf_next.Qwen3NextGatedDeltaNet(Qwen3NextConfig(**common), layer_idx=0)
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    return Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**common), layer_idx=0)


def perturb_(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere; decays A = exp(A_log) around 0.4 so the recurrent state carries far."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name == "A_log":
                p.copy_(noise * 0.5 - 1.0)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(noise * (0.3 if name == "conv1d.weight" else 0.1))


@needs_hf_torch_layer
@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
def test_layer_matches_transformers(layout):
    torch.manual_seed(0)
    ref_layer = hf_module(layout)
    perturb_(ref_layer)
    layer = GatedDeltaNet(**TINY, layout=layout)
    assert sorted(layer.state_dict()) == sorted(ref_layer.state_dict())
    layer.load_state_dict(ref_layer.state_dict(), strict=True)

    x = torch.randn(2, 100, TINY["hidden"]).requires_grad_()
    ours, ours_grads = outputs_and_grads(lambda x, *_: layer(x), [x, *layer.parameters()])
    names = ["x", *(n for n, _ in layer.named_parameters())]
    ref_params = dict(ref_layer.named_parameters())
    ref, ref_grads = outputs_and_grads(lambda x, *_: ref_layer(x), [x, *(ref_params[n] for n in names[1:])])
    assert_close(ours, ref, FWD_TOL, "y")
    for name, a, b in zip(names, ours_grads, ref_grads):
        assert_close(a, b, GRAD_TOL, name)


@pytest.mark.parametrize("layout,projections", [
    ("qwen3_5", {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}),
    ("qwen3_next", {"in_proj_qkvz", "in_proj_ba", "out_proj"}),
])
def test_projections_are_plain_linears_for_lora(layout, projections):
    layer = GatedDeltaNet(**TINY, layout=layout, device="meta")
    linears = {name for name, m in layer.named_children() if isinstance(m, torch.nn.Linear)}
    assert linears == projections


# ---- 4. compile and op-set selection -------------------------------------------------------------

@pytest.mark.slow
def test_compile_fullgraph_packed():
    """Dynamo + AOT autograd trace the packed forward and backward with no graph break; same numbers.

    aot_eager_decomp_partition runs the graphs inductor would get (decomposed, partitioned) without
    compiling C++ (~40 s on 2 cores).
    """
    torch.manual_seed(0)
    layer = GatedDeltaNet(**TINY, layout="qwen3_5")
    perturb_(layer)
    x = torch.randn(2, 150, TINY["hidden"])
    meta = AttnMeta(cu_seqlens=torch.tensor(CU_SEQLENS, dtype=torch.int32), max_seqlen=85)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager_decomp_partition", fullgraph=True)
    params = list(layer.parameters())
    ours, ours_grads = outputs_and_grads(lambda *_: compiled(x, meta), params)
    ref, ref_grads = outputs_and_grads(lambda *_: layer(x, meta), params)
    assert_close(ours, ref, FWD_TOL, "y")
    for (name, _), a, b in zip(layer.named_parameters(), ours_grads, ref_grads):
        assert_close(a, b, GRAD_TOL, name)


def test_fla_is_not_imported_and_refused_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    GatedDeltaNet(**TINY, op_set="torch")
    assert "fla" not in sys.modules
    from runtime.choices import Needs, choose
    from runtime.config import ConfigError

    with pytest.raises(ConfigError, match="model.gdn_op_set: fla cannot run here: it runs on cuda only"):
        choose("model.gdn_op_set", "fla", Needs("cpu"))
    with pytest.raises(ValueError, match="unknown GDN op set 'triton'.*model.gdn_op_set"):
        GatedDeltaNet(**TINY, op_set="triton")


def test_auto_op_set_is_resolved_by_the_plan_not_the_layer():
    from runtime.choices import Needs, choose

    expected = "torch"
    if torch.cuda.is_available() and importlib.util.find_spec("fla"):
        from attention import gdn_ops_fla
        expected = "torch" if gdn_ops_fla.backward_refusal() else "fla"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert choose("model.gdn_op_set", "auto", Needs(device))[0] == expected
    with pytest.raises(ValueError, match="resolved by runtime.plan"):
        GatedDeltaNet(**TINY, op_set="auto")


# ---- 5. fp32 decay gradients at the initial decays -------------------------------------------------

def recurrent_delta_rule_fp64(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, starts_BS):
    """Token-by-token gated delta rule in fp64, state zeroed at every document start (the reference):
    S <- a S + beta k (v - a S^T k)^T, o = S^T q, with a = exp(g), q and k L2-normalized, q * K^-0.5."""
    q, k, v, g, beta = (t.double() for t in (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH))
    B, S, HV, V = v.shape
    group, K = HV // q.shape[2], q.shape[-1]
    q = (q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, 2) * K ** -0.5
    k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, 2)
    state_BHKV = q.new_zeros(B, HV, K, V)
    outs = []
    for t in range(S):
        keep_B111 = (~starts_BS[:, t]).double()[:, None, None, None]
        state_BHKV = state_BHKV * g[:, t].exp()[..., None, None] * keep_B111
        k_BHK, v_BHV = k[:, t], v[:, t]
        residual_BHV = v_BHV - (state_BHKV * k_BHK[..., None]).sum(-2)
        state_BHKV = state_BHKV + beta[:, t][..., None, None] * k_BHK[..., None] * residual_BHV[..., None, :]
        outs.append((state_BHKV * q[:, t][..., None]).sum(-2))
    return torch.stack(outs, dim=1).to(v_BSHV.dtype)


def test_fp32_decay_grads_match_recurrence_at_initial_decays():
    """At HF's initial decays (A = exp(A_log) up to 16, dt_bias 1) with token-dependent a (in_proj_a
    spreads softplus(a + dt_bias) over 0..7), the log decay g reaches -100 per token and its cumsum
    ~-1000 per 64-token chunk, while some pairs of tokens have little decay between them. The fp32
    gradients of the decay parameters must match an fp64 token-by-token recurrence to 1e-5: their pair
    decays cannot be differences c_i - c_j of that cumsum (one fp32 ulp there is ~6e-5; that gave
    2e-5..2e-4 here)."""
    torch.manual_seed(1)
    layer = GatedDeltaNet(**TINY, layout="qwen3_5")
    initial_decays_(layer)
    x = torch.randn(2, 150, TINY["hidden"])
    meta = AttnMeta(cu_seqlens=torch.tensor(CU_SEQLENS, dtype=torch.int32), max_seqlen=85)
    ours, *ours_grads = decay_grads(layer, x, meta)
    ref, *ref_grads = decay_grads(with_recurrence(layer), x, meta)
    assert_close(ours, ref, FWD_TOL, "y")
    for name, a, b in zip(DECAY_PARAMS, ours_grads, ref_grads):
        assert_close(a, b, 1e-5, name)


DECAY_PARAMS = ("dt_bias", "A_log", "in_proj_a.weight")


def initial_decays_(layer: GatedDeltaNet) -> None:
    """perturb_, then HF-initial decays (A = 1, 4, 10, 16 per value head, dt_bias = 1) and a token-dependent
    a (in_proj_a x10); the layer must have 4 value heads (qwen3_5 layout)."""
    perturb_(layer)
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([1.0, 4.0, 10.0, 16.0]).log())
        layer.dt_bias.fill_(1.0)
        layer.in_proj_a.weight.mul_(10.0)


def with_recurrence(layer: GatedDeltaNet) -> GatedDeltaNet:
    """The same layer (shared parameters) with the delta rule replaced by the fp64 token-by-token
    recurrence and the torch op set's conv and document masks."""
    ref = copy.copy(layer)
    ref.ops = SimpleNamespace(prepare_docs=prepare_docs, causal_conv1d_silu=causal_conv1d_silu,
                              chunk_gated_delta_rule=recurrent_delta_rule_fp64)
    return ref


def decay_grads(layer: GatedDeltaNet, x_BSH: torch.Tensor, meta) -> tuple[torch.Tensor, ...]:
    """(y, grads of DECAY_PARAMS) after one backward of <y, fixed random dy>."""
    params = [dict(layer.named_parameters())[n] for n in DECAY_PARAMS]
    y = layer(x_BSH, meta)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device)
    return (y, *torch.autograd.grad(y, params, dy))

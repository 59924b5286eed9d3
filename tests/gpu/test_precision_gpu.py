"""fp32 means fp32 on a GPU (issue 23): our Triton kernels and the GDN op sets against fp64 references.

- scattermoe in fp32 (full fine-tune, fused LoRA, split LoRA; sentinel slots) vs the eager backend in
  fp64: y and every gradient, norm-relative <= 1e-5 with torch's default (IEEE) fp32 matmuls, <= 1e-3
  with TF32 allowed (torch's flag set for the test and restored; our dots then run as tf32x3).
  fp32 never reaches torch._grouped_mm.
- qk_norm_rope's Triton kernels in fp32 vs an fp64 RMSNorm + RoPE written here: same bounds.
- The GDN layer in fp32, at HF's initial decays (A 1..16) and at moderate decays (A 0.1..0.4), vs the
  same layer with the fp64 token-by-token recurrence of tests/unit/test_gdn.py: y and the grads of
  dt_bias, A_log, in_proj_a. Op set torch <= 1e-5 at both. Op set fla (if installed), and the same layer
  with FLA's own autograd function in place of our op ("fla_function"): <= 1e-2 at moderate decays; at
  the initial decays FLA 0.6.0's decay gradients are wrong upstream (FLA_EXTREME_DECAYS): strict xfail,
  so a fixed FLA shows as XPASS.
- The delta rule alone (fla installed): our op set equals FLA's public function (fp32 and bf16, the
  layer's inputs at both decays: o and every input gradient, bit for bit on an H200); both are within
  FLA_TOL (fp32 1e-2, bf16 2e-2) of the fp64 recurrence at moderate decays (g ~ U(-1, -0.05)), and in
  bf16 also at the initial decays; fp32 at the initial decays is the upstream strict xfail.

Every test prints its errors (run with -rA or -s to see them). Shapes: x_MH [M, H], ids/weights_Mk
[M, k]; q [B, S, H, D], k [B, S, K, D], cos/sin [B, S, D]; x_BSH [B, S, hidden].
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    from attention.attention import AttnMeta
    from attention.gdn import GatedDeltaNet
    from attention.gdn_ops_torch import prepare_docs
    from attention.norm_rope import qk_norm_rope
    from moe.backends import expert_backend
    from moe.experts import GroupedExperts
    from moe.kernels.grouped_linear import cutlass_ok
    from tests.unit.test_gdn import (
        DECAY_PARAMS,
        decay_grads,
        initial_decays_,
        perturb_,
        recurrent_delta_rule_fp64,
        with_recurrence,
    )
    from tests.unit.test_precision import fp32_matmul

IEEE_TOL, TF32_TOL = 1e-5, 1e-3
PRECISIONS = [pytest.param(False, IEEE_TOL, id="ieee"), pytest.param(True, TF32_TOL, id="tf32")]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def check(errors: dict[str, float], tol: float, label: str, tols: dict[str, float] | None = None) -> None:
    """Every error <= tol, or <= tols[name] for the names it holds."""
    tols = tols or {}
    print(f"{label}: " + " ".join(f"{name} {err:.1e}" for name, err in errors.items()))
    bad = {name: f"{err:.2e} > {tols.get(name, tol):.0e}" for name, err in errors.items()
           if not err <= tols.get(name, tol)}
    assert not bad, f"{label}: norm-relative error over its bound: {bad}"


# ----------------------------------------------------------------------------- scattermoe


def make_experts(E: int, H: int, I: int, rank: int) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(E, H, I, lora_rank=rank, lora_alpha=2 * rank if rank else None).cuda()
    with torch.no_grad():
        for p in experts.parameters():  # LoRA B starts at zero: random everywhere so every path counts
            p.normal_(0, H ** -0.5)
    return experts


def routed_inputs(M: int, E: int, k: int):
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids_Mk = torch.rand(M, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    ids_Mk[::7, 0] = -1  # sentinel slots, as expert parallelism produces
    ids_Mk[3] = -1
    return ids_Mk, torch.rand(M, k, device="cuda", generator=gen)


def backend_run(name: str, experts: GroupedExperts, x_MH, ids_Mk, weights_Mk) -> dict[str, torch.Tensor]:
    """y and every gradient after one backward of <y, dy> (dy fixed)."""
    x_MH = x_MH.detach().requires_grad_()
    weights_Mk = weights_Mk.detach().requires_grad_()
    params = dict(experts.named_parameters())
    y_MH = expert_backend(name)(x_MH, ids_Mk, weights_Mk, experts)
    dy_MH = torch.randn(y_MH.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    grads = torch.autograd.grad(y_MH, [x_MH, weights_Mk, *params.values()], dy_MH.to(y_MH.dtype))
    return {"y": y_MH, **dict(zip(["dx", "dw", *(f"d{n}" for n in params)], grads))}


SCATTER_CASES = [  # E, H, I, rank, split LoRA, M, k
    pytest.param(8, 512, 256, 0, False, 512, 2, id="full-E8-H512-I256"),
    pytest.param(8, 512, 256, 8, False, 512, 2, id="lora-fused-E8-H512-I256"),
    pytest.param(8, 512, 256, 8, True, 512, 2, id="lora-split-E8-H512-I256"),
    pytest.param(32, 2048, 768, 0, False, 1024, 8, id="full-qwen3-30b-dims"),
]


@pytest.mark.parametrize("tf32,tol", PRECISIONS)
@pytest.mark.parametrize("E,H,I,rank,split,M,k", SCATTER_CASES)
def test_scattermoe_fp32_matches_fp64_eager(monkeypatch, E, H, I, rank, split, M, k, tf32, tol):
    if split:
        monkeypatch.setattr("moe.backends.scattermoe._SPLIT_MIN_WEIGHT_ELEMS", 0)
    experts = make_experts(E, H, I, rank)
    ids_Mk, weights_Mk = routed_inputs(M, E, k)
    x_MH = torch.randn(M, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    assert not cutlass_ok(x_MH, experts.gate_up)  # fp32 never takes torch._grouped_mm
    ref = backend_run("eager", copy.deepcopy(experts).double(), x_MH.double(), ids_Mk, weights_Mk.double())
    with fp32_matmul("tf32" if tf32 else None):
        ours = backend_run("scattermoe", experts, x_MH, ids_Mk, weights_Mk)
        torch_eager = backend_run("eager", experts, x_MH, ids_Mk, weights_Mk)  # cuBLAS, for comparison
    mode = "tf32" if tf32 else "ieee"
    print(f"eager (cuBLAS) fp32 {mode}: y {rel_err(torch_eager['y'], ref['y']):.1e}")
    check({name: rel_err(ours[name], ref[name]) for name in ref}, tol, f"scattermoe fp32 {mode}")


# ----------------------------------------------------------------------------- qk_norm_rope


def norm_rope_fp64(x_BSHD, w_D, cos_BSD, sin_BSD, eps: float, unit_offset: bool):
    """RMSNorm over D (x rsqrt(mean x^2 + eps) (w or 1 + w)) then rotate-half RoPE over all of D, in fp64."""
    x = x_BSHD.double()
    w = w_D.double() + 1.0 if unit_offset else w_D.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    half = x.shape[-1] // 2
    rotated = torch.cat([-normed[..., half:], normed[..., :half]], dim=-1)
    return normed * cos_BSD.double()[:, :, None] + rotated * sin_BSD.double()[:, :, None]


@pytest.mark.parametrize("tf32,tol", PRECISIONS)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_norm_rope_triton_fp32_matches_fp64(tf32, tol, unit_offset):
    B, S, HQ, HK, D, eps = 2, 300, 8, 2, 128, 1e-6
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, HQ, D, device="cuda", generator=gen)
    k = torch.randn(B, S, HK, D, device="cuda", generator=gen)
    q_w, k_w = (1.0 + 0.3 * torch.randn(D, device="cuda", generator=gen) for _ in range(2))
    inv_freq = 1e6 ** -(torch.arange(0, D, 2, device="cuda").double() / D)
    angles = torch.arange(S, device="cuda").double()[:, None] * inv_freq
    cos, sin = (f(torch.cat([angles, angles], -1)).float().expand(B, S, D) for f in (torch.cos, torch.sin))
    dq_out, dk_out = (torch.randn(t.shape, device="cuda", generator=gen) for t in (q, k))

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, q_w, k_w)]
        q_out, k_out = fn(*leaves)
        grads = torch.autograd.grad((q_out, k_out), leaves, (dq_out.to(dtype), dk_out.to(dtype)))
        return dict(zip(["q", "k", "dq", "dk", "dq_w", "dk_w"], (q_out, k_out, *grads)))

    ref = run(lambda q, k, q_w, k_w: (norm_rope_fp64(q, q_w, cos, sin, eps, unit_offset),
                                      norm_rope_fp64(k, k_w, cos, sin, eps, unit_offset)), torch.float64)
    with fp32_matmul("tf32" if tf32 else None):
        ours = run(lambda *t: qk_norm_rope(*t, cos, sin, eps, unit_offset, impl="triton"), torch.float32)
    check({name: rel_err(ours[name], ref[name]) for name in ref}, tol,
          f"norm_rope fp32 {'tf32' if tf32 else 'ieee'} unit_offset={unit_offset}")


# ----------------------------------------------------------------------------- GDN op sets

GDN_DIMS = {"hidden": 128, "num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 64, "head_v_dim": 64,
            "conv_kernel": 4, "eps": 1e-6}
# Documents crossing the 64-token chunks, a 1-token one; rows of 200 tokens.
GDN_CU_SEQLENS = [0, 40, 170, 200, 201, 330, 400]
GDN_ROWS, GDN_SEQ = 2, 200
# FLA's fp32 runs its dots in TF32 (Triton's default for fp32, TileLang's gemm), bf16 keeps its chunk
# intermediates (WY factors, chunk states, dh) in bf16: norm-relative bounds for o and the input grads,
# as FLA's own tests allow (fp32 inputs: o 5e-3, grads 5e-3..1e-2; 16-bit: 2e-2 for db/dg) and as
# tests/gpu/test_gdn_gpu.py asserts for bf16 (measured on an H200: fp32 1.5e-3..2.6e-3, bf16 3.7e-3..5.1e-3).
# The decay parameters' grads are sums over tokens of dg * g (partly cancelling): 2e-2 (fp32 measured
# 6.7e-3 for A_log's through the delta rule, 8.7e-3 for the layer's A_log at moderate decays).
FLA_TOL = {torch.float32: 1e-2, torch.bfloat16: 2e-2}
FLA_DECAY_PARAM_TOLS = dict.fromkeys(("dA_log", "dt_bias", "A_log", "in_proj_a.weight"), 2e-2)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
DELTA_RULE_GRADS = ("dq", "dk", "dv", "dg", "dbeta")
# Upstream, FLA 0.6.0 with fp32 inputs (docs/history/validation-log-2026-11.md, 2026-11-23 FLA diagnosis): where a
# token's log decay g is far below 0 (the HF initial decays, A up to 16: g down to -470 per token), the
# exact gradient of g is ~exp(g) ~ 0 (<= 1e-10 here), but FLA returns ~1e-4: its dg sums q.dq - k.dk terms
# of size ~1 that must cancel, and with fp32 operands its GEMMs round them to TF32, so they do not (bf16
# inputs are exact operands: there dg is within 5e-3 at every decay). A_log's gradient sums dg * g: that
# noise times |g| swamps it (norm-relative 1.5 through the delta rule, 1..5 through the layer). Our op set
# computes exactly what FLA's function does (test_fla_op_set_is_flas_own_function); op set torch is exact.
FLA_EXTREME_DECAYS = ("FLA 0.6.0, fp32 inputs: decay gradients at strong decays (g far below -1 per token, "
                      "as at the HF initial decays) are TF32 rounding noise (dg ~1e-4 where the exact one is "
                      "< 1e-9), A_log's gradient off by 1.5..5 norm-relative; upstream")


def moderate_decays_(layer: GatedDeltaNet) -> None:
    """perturb_, then A = 0.1 .. 0.4 per value head and dt_bias 1: g = -A softplus(a + 1) spans about
    -0.02 .. -1.5 per token (a = in_proj_a x ~ N(0, 1.3))."""
    perturb_(layer)
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]).log())
        layer.dt_bias.fill_(1.0)


def gdn_case(op_set: str, decays: str):
    """(layer on CUDA, x_BSH, meta) of the GDN tests: 4 value heads, packed rows (GDN_CU_SEQLENS)."""
    torch.manual_seed(1)
    layer = GatedDeltaNet(**GDN_DIMS, layout="qwen3_5", op_set=op_set)
    (initial_decays_ if decays == "initial" else moderate_decays_)(layer)
    layer.cuda()
    x_BSH = torch.randn(GDN_ROWS, GDN_SEQ, GDN_DIMS["hidden"], generator=torch.Generator().manual_seed(2))
    meta = AttnMeta(cu_seqlens=torch.tensor(GDN_CU_SEQLENS, dtype=torch.int32, device="cuda"), max_seqlen=130)
    return layer, x_BSH.cuda(), meta


def require_fla():
    """Skip unless op set fla can run forward and backward here (installed; FLA's gated backward not refused)."""
    pytest.importorskip("fla", reason="op set fla needs flash-linear-attention")
    from attention import gdn_ops_fla
    if refusal := gdn_ops_fla.backward_refusal():
        pytest.skip(refusal)


def fla_function(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, cu_seqlens):
    """FLA's own public autograd function (no op of ours): rows packed to [1, B*S] as FLA's varlen wants,
    q/k L2-normalized in its kernel, scale K^-0.5, no initial or final state."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    packed = (t.reshape(1, -1, *t.shape[2:]) for t in (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH))
    o, _ = chunk_gated_delta_rule(*packed, scale=q_BSHK.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=cu_seqlens)
    return o.view(v_BSHV.shape)


def fla_op_set(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, cu_seqlens):
    from attention import gdn_ops_fla
    return gdn_ops_fla.chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, cu_seqlens)


def recurrence_fp64(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, cu_seqlens):
    starts_BS = prepare_docs(cu_seqlens, q_BSHK.shape[0], q_BSHK.shape[1], q_BSHK.device)
    return recurrent_delta_rule_fp64(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, starts_BS)


def with_delta_rule(layer: GatedDeltaNet, delta_rule) -> GatedDeltaNet:
    """The same layer (shared parameters, its own conv) with `delta_rule` in place of its delta-rule op."""
    swapped = copy.copy(layer)
    ops = layer.ops
    swapped.ops = SimpleNamespace(prepare_docs=ops.prepare_docs, causal_conv1d_silu=ops.causal_conv1d_silu,
                                  chunk_gated_delta_rule=delta_rule)
    return swapped


def layer_delta_rule_inputs(decays: str) -> list[torch.Tensor]:
    """The (q, k, v, g, beta) that the test layer at these decays hands its delta rule (fp32, detached)."""
    layer, x_BSH, meta = gdn_case("torch", decays)
    captured = []

    def capture(q, k, v, g, beta, docs):
        captured.extend(t.detach().clone() for t in (q, k, v, g, beta))
        return layer.ops.chunk_gated_delta_rule(q, k, v, g, beta, docs)

    with torch.no_grad():
        with_delta_rule(layer, capture)(x_BSH, meta)
    return captured


def band_delta_rule_inputs(g_lo: float, g_hi: float, seed: int = 3) -> list[torch.Tensor]:
    """Random q, k, v (layer shapes), beta = sigmoid(N(0, 1)), g ~ U(g_lo, g_hi) per token and head (fp32)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hk, hv, dk, dv = (GDN_DIMS[n] for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    shape = (GDN_ROWS, GDN_SEQ)
    q, k = (torch.randn(*shape, hk, dk, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(*shape, hv, dv, device="cuda", generator=gen)
    g = g_lo + (g_hi - g_lo) * torch.rand(*shape, hv, device="cuda", generator=gen)
    beta = torch.randn(*shape, hv, device="cuda", generator=gen).sigmoid()
    return [q, k, v, g, beta]


def delta_rule_grads(fn, inputs: list[torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """o and the grads of q, k, v, g, beta after one backward of <o, fixed random do>: q/k/v/beta in
    `dtype`, g in fp32 (as the layer passes it); the fp64 recurrence gets fp64 leaves of those values."""
    cu_seqlens = torch.tensor(GDN_CU_SEQLENS, dtype=torch.int32, device="cuda")
    values = [t if i == 3 else t.to(dtype) for i, t in enumerate(inputs)]
    if fn is recurrence_fp64:
        values = [t.double() for t in values]
    leaves = [t.detach().clone().requires_grad_() for t in values]
    o = fn(*leaves, cu_seqlens)
    do = torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
    out = {"o": o, **dict(zip(DELTA_RULE_GRADS, grads))}
    # A_log's gradient through these g's (g = -exp(A_log) softplus(.) => d/dA_log = sum over tokens dg * g)
    out["dA_log"] = (out["dg"].double() * leaves[3].double()).sum((0, 1))
    return out


def errors_vs(ours: dict, ref: dict) -> dict[str, float]:
    return {name: rel_err(ours[name], ref[name]) for name in ref}


@pytest.mark.parametrize("op_set,decays", [
    ("torch", "initial"), ("torch", "moderate"), ("fla", "moderate"), ("fla_function", "moderate"),
    pytest.param("fla", "initial", marks=pytest.mark.xfail(strict=True, reason=FLA_EXTREME_DECAYS)),
    pytest.param("fla_function", "initial", marks=pytest.mark.xfail(strict=True, reason=FLA_EXTREME_DECAYS)),
])
def test_gdn_fp32_decay_grads_match_recurrence(op_set, decays):
    """The layer in fp32 vs the same layer with the fp64 recurrence: y and the decay parameters' grads.
    fla_function: op set fla with FLA's own autograd function in place of our delta-rule op."""
    if op_set != "torch":
        require_fla()
    layer, x_BSH, meta = gdn_case("torch" if op_set == "torch" else "fla", decays)
    if op_set == "fla_function":
        layer = with_delta_rule(layer, fla_function)
    ours = decay_grads(layer, x_BSH, meta)
    ref = decay_grads(with_recurrence(layer), x_BSH, meta)
    errors = {name: rel_err(a, b) for name, a, b in zip(("y", *DECAY_PARAMS), ours, ref)}
    if op_set == "torch":
        check(errors, IEEE_TOL, f"GDN {op_set} fp32 {decays} decays vs fp64 recurrence")
    else:
        check(errors, FLA_TOL[torch.float32], f"GDN {op_set} fp32 {decays} decays vs fp64 recurrence",
              FLA_DECAY_PARAM_TOLS)


@pytest.mark.parametrize("decays", ["initial", "moderate"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fla_op_set_is_flas_own_function(dtype, decays):
    """Our op set's delta rule (custom ops around FLA's internals) computes what FLA's public autograd
    function computes on the layer's own inputs: o and every input gradient, to rounding (bit-equal here)."""
    require_fla()
    inputs = layer_delta_rule_inputs(decays)
    theirs = delta_rule_grads(fla_function, inputs, dtype)
    ours = delta_rule_grads(fla_op_set, inputs, dtype)
    check(errors_vs(ours, theirs), 1e-6, f"fla op set vs FLA's function {dtype} {decays} decays")


DELTA_RULE_CASES = [  # inputs, dtype: where FLA's delta rule is within bound, and where it is not (upstream)
    pytest.param("moderate", torch.float32, id="moderate-fp32"),
    pytest.param("moderate", torch.bfloat16, id="moderate-bf16"),
    pytest.param("initial", torch.bfloat16, id="initial-bf16"),
    pytest.param("initial", torch.float32, id="initial-fp32",
                 marks=pytest.mark.xfail(strict=True, reason=FLA_EXTREME_DECAYS)),
]


@pytest.mark.parametrize("impl", ["fla", "fla_function"])
@pytest.mark.parametrize("decays,dtype", DELTA_RULE_CASES)
def test_fla_delta_rule_matches_recurrence(decays, dtype, impl):
    """FLA's delta rule, through our op set and as its own function, vs the fp64 recurrence: o, every
    input gradient, and A_log's gradient through g (sum of dg * g). Inputs: moderate = random q/k/v/beta
    with g ~ U(-1, -0.05) per token; initial = what the test layer at HF's initial decays hands its delta
    rule (g down to -470 per token). Within FLA_TOL except fp32 at the initial decays (upstream, xfail)."""
    require_fla()
    inputs = band_delta_rule_inputs(-1.0, -0.05) if decays == "moderate" else layer_delta_rule_inputs(decays)
    ref = delta_rule_grads(recurrence_fp64, inputs, dtype)
    ours = delta_rule_grads(fla_op_set if impl == "fla" else fla_function, inputs, dtype)
    check(errors_vs(ours, ref), FLA_TOL[dtype], f"{impl} {dtype} {decays} decays vs fp64 recurrence",
          FLA_DECAY_PARAM_TOLS)

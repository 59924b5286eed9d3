"""fp32 means fp32 on a GPU (issue 23): our Triton kernels and the GDN op sets against fp64 references.

- scattermoe in fp32 (full fine-tune, fused LoRA, split LoRA; sentinel slots) vs the eager backend in
  fp64: y and every gradient, norm-relative <= 1e-5 with torch's default (IEEE) fp32 matmuls, <= 1e-3
  with TF32 allowed (torch's flag set for the test and restored). fp32 never reaches torch._grouped_mm.
- qk_norm_rope's Triton kernels in fp32 vs an fp64 RMSNorm + RoPE written here: same bounds.
- The GDN layer in fp32 at HF's initial decays: the torch op set and the fla op set (if installed) vs
  the same layer with the fp64 token-by-token recurrence of tests/unit/test_gdn.py: y and the grads of
  dt_bias, A_log, in_proj_a. torch <= 1e-5; fla's errors are printed and bounded at 1e-2 (FLA promises
  no fp32 parity: its dots and its decay differences are its own).

Every test prints its errors (run with -rA or -s to see them). Shapes: x_MH [M, H], ids/weights_Mk
[M, k]; q [B, S, H, D], k [B, S, K, D], cos/sin [B, S, D]; x_BSH [B, S, hidden].
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    from attention.attention import AttnMeta
    from attention.gdn import GatedDeltaNet
    from attention.norm_rope import qk_norm_rope
    from moe.backends import expert_backend
    from moe.experts import GroupedExperts
    from moe.kernels.grouped_linear import cutlass_ok
    from tests.unit.test_gdn import DECAY_PARAMS, decay_grads, initial_decays_, with_recurrence
    from tests.unit.test_precision import fp32_matmul

IEEE_TOL, TF32_TOL = 1e-5, 1e-3
PRECISIONS = [pytest.param(False, IEEE_TOL, id="ieee"), pytest.param(True, TF32_TOL, id="tf32")]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def check(errors: dict[str, float], tol: float, label: str) -> None:
    print(f"{label}: " + " ".join(f"{name} {err:.1e}" for name, err in errors.items()))
    bad = {name: f"{err:.2e}" for name, err in errors.items() if not err <= tol}
    assert not bad, f"{label}: norm-relative error over {tol:.0e}: {bad}"


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


@pytest.mark.parametrize("op_set", ["torch", "fla"])
def test_gdn_fp32_decay_grads_match_recurrence(op_set):
    if op_set == "fla":
        pytest.importorskip("fla", reason="op set fla needs flash-linear-attention")
    torch.manual_seed(1)
    layer = GatedDeltaNet(**GDN_DIMS, layout="qwen3_5", op_set=op_set)
    initial_decays_(layer)
    layer.cuda()
    x_BSH = torch.randn(2, 200, GDN_DIMS["hidden"], generator=torch.Generator().manual_seed(2)).cuda()
    meta = AttnMeta(cu_seqlens=torch.tensor(GDN_CU_SEQLENS, dtype=torch.int32, device="cuda"), max_seqlen=130)
    ours = decay_grads(layer, x_BSH, meta)
    ref = decay_grads(with_recurrence(layer), x_BSH, meta)
    errors = {name: rel_err(a, b) for name, a, b in zip(("y", *DECAY_PARAMS), ours, ref)}
    check(errors, IEEE_TOL if op_set == "torch" else 1e-2, f"GDN {op_set} fp32 vs fp64 recurrence")

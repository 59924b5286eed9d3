"""sonicmoe (the sonic-moe package) in bf16 vs the eager backend in fp32 at real MoE shapes (norm-relative
error <= 1e-2): the suite of tests/gpu/test_scattermoe_gpu.py.

Every case with a rank trains the base weights and a LoRA (B non-zero) at once, so one backward checks dx,
the routing-weight gradient, dW, dA and dB (LoRA runs through the merged per-step weight); rank-0 cases are
a full fine-tune (the base weights go in as views). ep > 1 keeps the experts of the first 1/ep and sets the
other slots to -1; `empty` cases leave the last 4 local experts without rows (their gradients must be 0).
First, at a small shape, the package against `emulate_general_routing` (the torch statement of what its
general-routing call computes): a layout mistake fails there with a clear diff, before the real shapes.
Skipped without CUDA, without sonic-moe (or its CuTe DSL stack), or below sm90.
"""

from __future__ import annotations

import pytest
import torch

from moe.backends import EXPERT_BACKENDS, expert_backend
from moe.experts import GroupedExperts
from tests.gpu.test_scattermoe_gpu import (  # the same shapes, inputs and autocast case
    SHAPES,
    autocast_lora_grads,
    make_experts,
    make_routing,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(EXPERT_BACKENDS.unavailable_reason("sonicmoe", "cuda") is not None,
                       reason="needs the sonic-moe package"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                       reason="SonicMoE needs sm90+"),
]

# (shape, tokens, rank, ep, variant)
CASES = [
    ("qwen3-30b-a3b", 2048, 16, 1, ""), ("qwen3-30b-a3b", 8192, 64, 1, ""), ("qwen3-30b-a3b", 2048, 16, 4, ""),
    ("qwen3-30b-a3b", 2048, 16, 2, "empty"),
    ("qwen3.5-35b-a3b", 2048, 64, 1, ""), ("qwen3.5-35b-a3b", 8192, 16, 1, ""),
    ("olmoe", 2048, 16, 1, ""), ("olmoe", 8192, 64, 2, ""),
    ("mixtral-8x7b", 2048, 16, 1, ""), ("mixtral-8x7b", 2048, 64, 1, ""), ("mixtral-8x7b", 8192, 16, 1, ""),
    ("qwen3-30b-a3b", 8192, 0, 1, ""), ("qwen3-30b-a3b", 2048, 0, 4, ""), ("qwen3.5-35b-a3b", 2048, 0, 2, "empty"),
    ("olmoe", 2048, 0, 1, ""), ("mixtral-8x7b", 2048, 0, 1, ""),
]
TOL = 1e-2


def fwd_bwd(ex: GroupedExperts, backend, x, ids, w, dy) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    for p in ex.parameters():
        p.grad = None
    y = (expert_backend(backend) if isinstance(backend, str) else backend)(x, ids, w, ex)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    out.update({n: p.grad for n, p in ex.named_parameters()})
    return out


def errors(got: dict, ref: dict) -> dict[str, float]:
    return {n: ((got[n].float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
            for n, r in ref.items() if r is not None}


@pytest.mark.parametrize("rank", [0, 16])
def test_package_matches_its_torch_statement_small(rank):
    """The package vs emulate_general_routing (same bf16 operands, same valid pairs) at a small shape with
    -1 slots, a row without valid slots and an expert without rows: catches layout mistakes (w1/w2 views,
    concat gate/up order, token order) before the real shapes."""
    import moe.backends.sonicmoe as sm

    torch.manual_seed(0)
    E, H, I, k, T = 16, 256, 128, 4, 512
    ids, w, _ = make_routing(T, E, k, 2)  # 8 local experts, ~half the slots -1
    ids[7] = -1
    ids = torch.where(ids == 3, -1, ids)
    ex = make_experts(8, H, I, rank)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    got = fwd_bwd(ex, "sonicmoe", x, ids, w, dy)
    ref = fwd_bwd(ex, lambda *a: sm.sonicmoe_forward(*a, sm.emulate_general_routing, "swiglu"), x, ids, w, dy)
    bad = {n: f"{e:.2e}" for n, e in errors(got, ref).items() if not e <= TOL}
    assert not bad, f"norm-relative errors above {TOL} (package vs its torch statement): {bad}"
    assert got["y"][7].abs().max() == 0 and got["dx"][7].abs().max() == 0
    assert got["gate_up"][3].abs().max() == 0 and got["down"][3].abs().max() == 0


@pytest.mark.parametrize("shape,T,rank,ep,variant", CASES,
                         ids=[f"{s}-T{t}-r{r}-ep{e}" + (f"-{v}" if v else "") for s, t, r, e, v in CASES])
def test_bf16_matches_fp32_eager(shape, T, rank, ep, variant):
    torch.manual_seed(0)
    E, H, I, k = SHAPES[shape]
    ids, w, E_local = make_routing(T, E, k, ep)
    if variant == "empty":
        ids = torch.where(ids >= E_local - 4, -1, ids)
    ex = make_experts(E_local, H, I, rank)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    got = {n: t.float() for n, t in fwd_bwd(ex, "sonicmoe", x, ids, w, dy).items()}
    ex.float()
    ref = fwd_bwd(ex, "eager", x.float(), ids, w, dy.float())
    bad = {n: f"{e:.2e}" for n, e in errors(got, ref).items() if not e <= TOL}
    assert not bad, f"norm-relative errors above {TOL}: {bad}"
    if variant == "empty":
        for n in ("gate_up", "down", "gate_up_lora_A", "down_lora_B")[: 4 if rank else 2]:
            assert got[n][-4:].abs().max() == 0, n


def test_autocast_fp32_master_lora_on_frozen_bf16_base():
    autocast_lora_grads("sonicmoe")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_base_lora_matches_eager(fmt):
    """LoRA r=16 on an FP4-packed base (dequantized for the active experts only) vs eager on the same
    packed weights, both bf16."""
    from quant import quantize_experts

    torch.manual_seed(0)
    E, H, I, k = SHAPES["qwen3-30b-a3b"]
    ids, w, E_local = make_routing(2048, E, k, 2)
    ex = make_experts(E_local, H, I, 16)
    quantize_experts(ex, fmt)
    x = torch.randn(2048, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2048, H, device="cuda", dtype=torch.bfloat16)
    got, ref = fwd_bwd(ex, "sonicmoe", x, ids, w, dy), fwd_bwd(ex, "eager", x, ids, w, dy)
    bad = {n: f"{e:.2e}" for n, e in errors(got, ref).items() if not e <= TOL}
    assert not bad, f"norm-relative errors above {TOL}: {bad}"


def test_fp32_without_autocast_is_refused():
    ex = GroupedExperts(8, 256, 128, device="cuda")
    ids, w, _ = make_routing(64, 8, 2, 1)
    with pytest.raises(NotImplementedError, match="bf16"):
        expert_backend("sonicmoe")(torch.randn(64, 256, device="cuda"), ids, w, ex)

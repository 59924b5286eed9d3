"""scattermoe on FP4-packed experts (bf16 activations) vs the eager backend in fp32 on the dequantized weights,
at real MoE shapes (norm-relative error <= 1e-2), and the memory the packed experts hold and need.

LoRA trains on top (B non-zero), so one backward checks dx, the routing-weight gradient, dA and dB; the
packed base is frozen. The Triton dequantize kernel equals quant's torch dequantization bit for bit on the
GPU too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from moe.kernels.fp4 import dequantize_fp4
from quant import FP4Weight, quantize_experts
from tests.gpu.test_scattermoe_gpu import SHAPES  # E, H, I, k of the expert tests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = 1e-2


def packed_experts(shape: str, fmt: str, rank: int = 16):
    """(packed bf16 experts with LoRA, an fp32 frozen dense copy of their dequantized values)."""
    E, H, I, _ = SHAPES[shape]
    torch.manual_seed(0)
    ex = GroupedExperts(E, H, I, lora_rank=rank, lora_alpha=2 * rank, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ex.gate_up_lora_B.normal_(0, 0.02)
        ex.down_lora_B.normal_(0, 0.02)
    quantize_experts(ex, fmt)
    ref = GroupedExperts(E, H, I, lora_rank=rank, lora_alpha=2 * rank, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        for proj in ("gate_up", "down"):
            ref.base_weight(proj).copy_(ex.dense_weight(proj, dtype=torch.float32)).requires_grad_(False)
        for name in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
            getattr(ref, name).copy_(getattr(ex, name).float())
    return ex, ref


def fwd_bwd(ex, backend: str, x, ids, w, dy) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = expert_backend(backend)(x, ids, w, ex)
    y.backward(dy.to(y.dtype))
    out = {"y": y, "x": x.grad, "w": w.grad}
    out.update({name: getattr(ex, name).grad for name in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A",
                                                          "down_lora_B")})
    return out


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_scattermoe_on_packed_experts_matches_eager_fp32(shape, fmt):
    E, H, _, k = SHAPES[shape]
    ex, ref = packed_experts(shape, fmt)
    T = 2048
    logits = torch.randn(T, E, device="cuda")
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    ids[:, -1] = torch.where(ids[:, -1] % 2 == 0, -1, ids[:, -1])  # some slots of other EP ranks
    x = torch.randn(T, H, device="cuda")
    dy = torch.randn(T, H, device="cuda")
    got = fwd_bwd(ex, "scattermoe", x.bfloat16(), ids, w.bfloat16(), dy)
    want = fwd_bwd(ref, "eager", x, ids, w, dy)
    for name, value in want.items():
        err = float((got[name].float() - value).norm() / value.norm())
        assert err <= TOL, f"{shape} {fmt} {name}: {err:.2e}"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_dequantize_kernel_equals_torch_on_gpu(fmt):
    torch.manual_seed(0)
    w = FP4Weight.from_dense(torch.randn(8, 1536, 2048, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
    ours = dequantize_fp4(w, torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), w.dequantize(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_packed_experts_hold_and_need_no_dense_copy(fmt):
    """Persistent bytes of the packed base: codes + scales (+ tensor scales), to the byte. A forward+backward
    at Qwen3-30B-A3B's expert shape (LoRA) peaks less than half the dense bf16 weights above what was
    allocated before: no dequantized copy of the experts exists at any point."""
    E, H, I, k = SHAPES["qwen3-30b-a3b"]
    dense = GroupedExperts(E, H, I, lora_rank=16, lora_alpha=32, device="cuda", dtype=torch.bfloat16)
    packed = copy.deepcopy(dense)
    quantize_experts(packed, fmt)
    del dense
    block = 32 if fmt == "mxfp4" else 16
    expected = sum(E * n * kk // 2 + E * n * kk // block + (4 * E if fmt == "nvfp4" else 0)
                   for n, kk in ((2 * I, H), (H, I)))
    assert sum(packed.base_weight(p).packed_bytes() for p in ("gate_up", "down")) == expected
    T = 2048  # activations ~0.15 GB, against 1.2 GB for one dense copy of the experts
    w, ids = torch.randn(T, E, device="cuda").softmax(-1).topk(k, dim=-1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    expert_backend("scattermoe")(x, ids, w.bfloat16(), packed).sum().backward()
    torch.cuda.synchronize()
    dense_bf16_bytes = 2 * E * 3 * H * I
    assert torch.cuda.max_memory_allocated() - before < dense_bf16_bytes / 2

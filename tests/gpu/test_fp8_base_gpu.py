"""The frozen FP8 expert base on CUDA (quant.fp8_base through the grouped_mm backend, torch._scaled_grouped_mm,
sm90+) at the four expert shapes of benchmarks.harness: the layer with LoRA against the eager backend on the
dequantized weights (FP8's activation error only), and the GEMM against its CPU emulation (which
tests/unit/test_quant_fp8.py checks against fp64), eager and compiled.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import MOE_SHAPES, SHAPES
from moe.backends import expert_backend
from moe.experts import GroupedExperts
from quant import FP8Weight, quantize_experts
from quant.fp8_base import fp8_base_grouped_linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA device of sm90+ (FP8 grouped GEMM)")]

T = 1024
FP8_REL = 0.08  # e4m3 activations against bf16 ones (tests/unit/test_quant_fp8.py)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_lora_layer_on_fp8_base_against_eager_on_the_dequantized_weights(shape):
    s = SHAPES[shape]
    torch.manual_seed(0)
    E = min(s.experts, 32)  # the layer's dims; fewer experts keep the eager reference short
    fp8 = GroupedExperts(E, s.hidden, s.intermediate, lora_rank=16, lora_alpha=32, device="cuda",
                         dtype=torch.bfloat16)
    with torch.no_grad():
        fp8.gate_up_lora_B.normal_(std=0.02)
        fp8.down_lora_B.normal_(std=0.02)
    dense = GroupedExperts(E, s.hidden, s.intermediate, lora_rank=16, lora_alpha=32, device="cuda",
                           dtype=torch.bfloat16)
    dense.load_state_dict(fp8.state_dict())
    quantize_experts(fp8, "fp8")
    with torch.no_grad():
        for proj in ("gate_up", "down"):
            dense.base_weight(proj).copy_(fp8.dense_weight(proj))
    x = torch.randn(T, s.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, E, (T, s.top_k), device="cuda")
    ids[::3, 0] = -1
    w = torch.rand(T, s.top_k, device="cuda", dtype=torch.bfloat16)
    y = expert_backend("grouped_mm")(x, ids, w, fp8)
    y_ref = expert_backend("eager")(x, ids, w, dense)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, fp8.gate_up_lora_A, fp8.down_lora_B], dy)
    grads_ref = torch.autograd.grad(y_ref, [x, dense.gate_up_lora_A, dense.down_lora_B], dy)
    assert 1e-3 < rel_err(y, y_ref) <= FP8_REL
    for g, g_ref in zip(grads, grads_ref):
        assert rel_err(g, g_ref) <= FP8_REL


def _gemm_case():
    s = SHAPES["qwen3-30b-a3b"]
    g = torch.Generator().manual_seed(0)
    weight = FP8Weight.from_dense(torch.randn(8, 2 * s.intermediate, s.hidden, generator=g) * 0.02, "fp8")
    counts = torch.tensor([37, 0, 101, 64, 3, 150, 77, 50])
    offs = counts.cumsum(0).to(torch.int32)
    # bf16 values on both sides: the CPU run's fp32 then quantizes the same numbers as the GPU's bf16
    x = torch.randn(int(counts.sum()), s.hidden, generator=g).bfloat16().float()
    dy = torch.randn(x.shape[0], 2 * s.intermediate, generator=g).bfloat16().float()

    def run(fn, device, dtype):
        xd = x.detach().to(device, dtype).requires_grad_()  # a leaf of its own on every device (no CPU alias)
        y = fn(xd, weight.to(device), offs.to(device))
        y.backward(dy.to(device, dtype))
        return y.detach(), xd.grad

    return run


def test_gemm_equals_cpu_emulation():
    run = _gemm_case()
    for ours, ref in zip(run(fp8_base_grouped_linear, "cuda", torch.bfloat16), run(fp8_base_grouped_linear, "cpu",
                                                                                  torch.float32)):
        assert rel_err(ours, ref) <= 1e-2  # bf16 outputs on CUDA, fp32 on the CPU


@pytest.mark.xfail(strict=True, reason="compiled, y came out all zero on an H200 (torch 2.11), eager is right: "
                   "an FP8 base runs eager on grouped_mm (Capabilities.compile_quantized)")
def test_compiled_gemm_equals_eager():
    run = _gemm_case()
    compiled = run(torch.compile(fp8_base_grouped_linear, fullgraph=True), "cuda", torch.bfloat16)
    for ours, ref in zip(compiled, run(fp8_base_grouped_linear, "cuda", torch.bfloat16)):
        assert rel_err(ours, ref) <= 1e-2

"""The scattermoe kernels on an FP8 frozen base on CUDA (sm90+: FP8 tensor cores) at the Qwen3-30B-A3B expert
shape: the gathered gate_up + SwiGLU, the down projection with split LoRA and the backward's transposed weight
against their exact emulation in fp64 (the dequantized codes of the rowwise-quantized operands, as
tests/unit/test_scattermoe_fp8.py checks under the interpreter), and the whole LoRA layer against the grouped_mm
backend's FP8 path (torch._scaled_grouped_mm), eager and compiled.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import SHAPES
from moe.backends import expert_backend
from moe.experts import GroupedExperts
from moe.kernels import grouped_linear as gl
from moe.kernels.fp8 import FP8View
from moe.kernels.routing import sort_slots
from quant import FP8Weight, quantize_experts
from quant.fp8 import dequantize_rows, quantize_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA device of sm90+ (FP8 tensor cores)")]

SHAPE = SHAPES["qwen3-30b-a3b"]
E, T, R = 32, 2048, 16  # the layer's dims; fewer experts keep the references short
BF16 = 1e-2  # bf16 outputs against fp64
FP8_REL = 0.08  # e4m3 activations against bf16 ones (tests/unit/test_quant_fp8.py)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def _routing():
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, E, (T, SHAPE.top_k), device="cuda", generator=g)
    ids[::3, 0] = -1
    ids[ids == E - 1] = -1  # an expert without rows
    return ids, torch.rand(T, SHAPE.top_k, device="cuda", generator=g)


def _quantized(t: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(*quantize_rows(t.float()), torch.float64)


def _segments(slots):
    offsets = slots.offsets_E1.tolist()
    return [(e, offsets[e], offsets[e + 1]) for e in range(E) if offsets[e + 1] > offsets[e]]


def test_kernels_equal_their_exact_emulation():
    torch.manual_seed(0)
    H, I = SHAPE.hidden, SHAPE.intermediate
    w_gu = FP8Weight.from_dense(torch.randn(E, 2 * I, H, device="cuda") * 0.02, "fp8")
    w_down = FP8Weight.from_dense(torch.randn(E, H, I, device="cuda") * 0.02, "fp8")
    ids, w = _routing()
    slots = sort_slots(ids, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    lora = gl.LoraView(torch.randn(E, R, I, device="cuda", dtype=torch.bfloat16) * 0.05,
                       torch.randn(E, H, R, device="cuda", dtype=torch.bfloat16) * 0.05, 2.0, True)
    gu, hw, _ = gl.gate_up_swiglu(x, slots, FP8View.of(w_gu), None, w.bfloat16())
    z, _ = gl.expert_linear(hw, slots, FP8View.of(w_down), lora, gather=False)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    g, _ = gl.expert_linear(dy, slots, FP8View.of(w_down).t(), None, gather=True)
    xq, hq = _quantized(x), _quantized(hw)
    gu_deq, down_deq = w_gu.dequantize(torch.float64), w_down.dequantize(torch.float64)
    codes_down = w_down.codes.double()
    order = slots.order_S.long()
    for e, lo, hi in _segments(slots)[::4]:
        token = order[lo:hi] // SHAPE.top_k
        assert rel_err(gu[lo:hi], xq[token] @ gu_deq[e].T) <= BF16, e
        a, b = lora.A_ErK[e].double(), lora.B_ENr[e].double()
        z_ref = hq[lo:hi] @ down_deq[e].T + lora.scaling * (hw[lo:hi].double() @ a.T) @ b.T
        assert rel_err(z[lo:hi], z_ref) <= BF16, e
        g_ref = _quantized(dy[token].float() * w_down.scales[e]) @ codes_down[e]
        assert rel_err(g[lo:hi], g_ref) <= BF16, e


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lora_layer_equals_grouped_mms_fp8_path(compiled):
    torch.manual_seed(0)
    fp8 = GroupedExperts(E, SHAPE.hidden, SHAPE.intermediate, lora_rank=R, lora_alpha=2 * R, device="cuda",
                         dtype=torch.bfloat16)
    with torch.no_grad():
        fp8.gate_up_lora_B.normal_(std=0.02)
        fp8.down_lora_B.normal_(std=0.02)
    quantize_experts(fp8, "fp8")
    x = torch.randn(T, SHAPE.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids, w = _routing()
    w = w.bfloat16().requires_grad_()
    params = [x, w, fp8.gate_up_lora_A, fp8.gate_up_lora_B, fp8.down_lora_A, fp8.down_lora_B]
    ours = expert_backend("scattermoe")
    if compiled:
        ours = torch.compile(ours, fullgraph=True)
    results = []
    for fn in (ours, expert_backend("grouped_mm")):
        y = fn(x, ids, w, fp8)
        dy = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=torch.Generator("cuda").manual_seed(7))
        results.append((y, *torch.autograd.grad(y, params, dy)))
    names = ("y", "dx", "dw", "gu_A", "gu_B", "down_A", "down_B")
    errors = {n: rel_err(a, b) for n, a, b in zip(names, *results)}
    # dw: <g, h> from quantized dy rows here, <dy, z> from quantized h rows there (both FP8 approximations)
    assert errors.pop("dw") <= FP8_REL
    assert max(errors.values()) <= BF16, errors

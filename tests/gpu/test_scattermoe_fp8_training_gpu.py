"""quant.train_fp8 on the scattermoe backend on CUDA (sm90+: FP8 tensor cores) at the Qwen3-30B-A3B expert shape:
the full fine-tune layer (bf16 activations, fp32 masters) against the grouped_mm backend's FP8 training
(torch._scaled_grouped_mm) and against scattermoe's own bf16 layer, as tests/unit/test_scattermoe_fp8_training.py
checks under the interpreter.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.harness import SHAPES
from moe.backends import expert_backend
from moe.experts import GroupedExperts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA device of sm90+ (FP8 tensor cores)")]

SHAPE = SHAPES["qwen3-30b-a3b"]
E, T = 32, 2048  # fewer experts keep the references short
SAME_FP8 = 2e-2  # the same quantized products, both stored in bf16
FP8_TO_FP8 = 0.16  # dW_down and routing-weight grads: differently quantized operands (the unit test's bound)
FP8_REL = 0.08  # e4m3 against the bf16 layer
ROUTING_FP8_REL = 0.15  # the routing-weight gradient's short sums (the unit test's bound)
NAMES = ("y", "dx", "d routing weights", "d gate_up", "d down")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def _run(backend, experts, x, ids, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = expert_backend(backend)(x, ids, w, experts)
    return (y, *torch.autograd.grad(y, [x, w, experts.gate_up, experts.down], dy))


def test_full_layer_equals_grouped_mms_fp8_training_and_stays_near_bf16():
    torch.manual_seed(0)
    fp8 = GroupedExperts(E, SHAPE.hidden, SHAPE.intermediate).cuda()
    with torch.no_grad():
        fp8.gate_up.normal_(0, 0.02)
        fp8.down.normal_(0, 0.02)
    bf16 = copy.deepcopy(fp8)
    fp8.fp8_training = True
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, E, (T, SHAPE.top_k), device="cuda", generator=g)
    ids[::3, 0] = -1
    ids[ids == E - 1] = -1  # an expert without rows
    w = torch.rand(T, SHAPE.top_k, device="cuda", generator=g)
    x = torch.randn(T, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    ours = _run("scattermoe", fp8, x, ids, w, dy)
    grouped = _run("grouped_mm", fp8, x, ids, w, dy)
    plain = _run("scattermoe", bf16, x, ids, w, dy)
    assert ours[3].dtype == ours[4].dtype == torch.float32
    assert not ours[3][E - 1].any() and not ours[4][E - 1].any()
    for name, a, b, c in zip(NAMES, ours, grouped, plain):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= (FP8_TO_FP8 if name in ("d routing weights", "d down") else SAME_FP8), name
        assert 1e-3 < rel_err(a, c) <= (ROUTING_FP8_REL if name == "d routing weights" else FP8_REL), name

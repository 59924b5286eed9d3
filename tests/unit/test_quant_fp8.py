"""FP8 (e4m3, rowwise) frozen expert bases (quant.fp8, quant.FP8Weight, quant.fp8_base) on the CPU: torch's
float8_e4m3fn cast is the independent reference of the codes; fp64 products of dequantized operands are the
reference of the scaled GEMMs; the eager backend on the dequantized weights, of the grouped_mm backend's FP8
path (within FP8's error, since that path also quantizes the activations)."""

from __future__ import annotations

import copy

import pytest
import torch

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from quant import FP8Weight, quantize_experts
from quant.fp8 import E4M3, dequantize_rows, quantize_rows, scaled_grouped_mm
from quant.fp8_base import fp8_base_grouped_linear
from tests.conftest import sentinel_routing

# e4m3 keeps 3 mantissa bits: a round-to-nearest code is within 2^-4 of its value, relatively; GEMM results
# over many terms average those errors (norm-relative ~2-3%).
FP8_REL = 0.08


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def test_rowwise_codes_are_the_e4m3_rounding_of_each_row_over_its_amax():
    torch.manual_seed(0)
    t = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 2e4]).unsqueeze(-1)
    codes, scale = quantize_rows(t)
    assert codes.dtype == E4M3 and scale.dtype == torch.float32
    amax = t.abs().amax(-1)
    assert torch.equal(scale[[0, 1, 2, 4]], amax[[0, 1, 2, 4]] / 448)
    assert scale[3] == 1 and not codes[3].float().any()  # a zero row: scale 1, no division by 0
    assert torch.equal(codes.view(torch.uint8), (t / scale.unsqueeze(-1)).to(E4M3).view(torch.uint8))
    assert torch.equal(codes.float().abs().amax(-1)[[0, 1, 2, 4]], torch.full((4,), 448.0))  # amax maps on 448
    back = dequantize_rows(codes, scale, torch.float64)
    assert ((back - t.double()).abs() <= 2 ** -4 * t.double().abs() + 2 ** -9 * scale.double().unsqueeze(-1)).all()


def test_fp8_weight_bytes_scales_per_expert_and_what_a_model_wide_cast_leaves_alone():
    torch.manual_seed(0)
    w = torch.randn(4, 32, 48) * 0.02
    q = FP8Weight.from_dense(w, "fp8")
    assert q.packed_bytes() == 4 * 32 * 48 + 4 * 32 * 4  # a byte a weight plus an fp32 scale a row
    assert q.codes.dtype == E4M3 and q.scales.shape == (4, 32)
    # An expert's codes do not depend on the others (an EP rank quantizes only its own).
    part = FP8Weight.from_dense(w[2:], "fp8")
    assert torch.equal(part.qdata, q.qdata[2:]) and torch.equal(part.scale, q.scale[2:])
    assert torch.equal(q.dequantize(experts=torch.tensor([3, 1])), q.dequantize()[[3, 1]])
    before = q.dequantize()
    q.to(torch.bfloat16)
    assert q.qdata.dtype == torch.uint8 and torch.equal(q.dequantize(), before)
    assert dict(q.state_dict()) == {}
    assert _rel(before, w) < 0.04


def _grouped_reference(a_MK, b_ENK, offs, rows_dtype=torch.float64):
    out = torch.zeros(a_MK.shape[0], b_ENK.shape[1], dtype=rows_dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a_MK[start:end].to(rows_dtype) @ b_ENK[e].to(rows_dtype).T
        start = end
    return out


def test_scaled_grouped_mm_equals_fp64_on_dequantized_operands_empty_groups_and_tail():
    torch.manual_seed(0)
    x, w = torch.randn(40, 64), torch.randn(4, 48, 64) * 0.02
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    offs = torch.tensor([10, 10, 33, 33], dtype=torch.int32)  # groups 1 and 3 empty, rows 33.. past the end
    y = scaled_grouped_mm(xq, xs, wq.transpose(-2, -1), ws, offs, torch.float32)
    ref = _grouped_reference(dequantize_rows(xq, xs, torch.float64), dequantize_rows(wq, ws, torch.float64), offs)
    assert _rel(y, ref) <= 1e-6
    assert not y[33:].any()
    compiled = torch.compile(lambda *a: scaled_grouped_mm(*a, torch.float32), fullgraph=True)
    assert torch.equal(compiled(xq, xs, wq.transpose(-2, -1), ws, offs), y)


def test_fp8_base_linear_forward_and_dx_against_the_dequantized_weight():
    torch.manual_seed(0)
    w = torch.randn(3, 48, 64) * 0.02
    weight = FP8Weight.from_dense(w, "fp8")
    w_deq = weight.dequantize(torch.float64)
    x = torch.randn(30, 64, requires_grad=True)
    offs = torch.tensor([12, 12, 30], dtype=torch.int32)
    y = fp8_base_grouped_linear(x, weight, offs)
    # The forward quantizes x rowwise: exactly the fp64 product of its dequantized rows and the weight's.
    xq, xs = quantize_rows(x.detach())
    assert _rel(y, _grouped_reference(dequantize_rows(xq, xs, torch.float64), w_deq, offs)) <= 1e-6
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    dx_ref = torch.zeros(30, 64, dtype=torch.float64)
    for e, (start, end) in enumerate([(0, 12), (12, 12), (12, 30)]):
        dx_ref[start:end] = dy[start:end].double() @ w_deq[e]
    assert 1e-4 < _rel(dx, dx_ref) <= FP8_REL  # FP8 (dY quantized), and close to the exact product
    assert _rel(y, _grouped_reference(x.detach(), w_deq, offs)) <= FP8_REL


def _experts_pair(rank: int = 4):
    """FP8-based experts (LoRA with B != 0) and a dense copy holding their dequantized base (the reference)."""
    torch.manual_seed(0)
    fp8 = GroupedExperts(4, 64, 32, lora_rank=rank, lora_alpha=2 * rank)
    with torch.no_grad():
        fp8.gate_up.normal_(0, 0.02)
        fp8.down.normal_(0, 0.02)
        fp8.gate_up_lora_B.normal_(std=0.1)
        fp8.down_lora_B.normal_(std=0.1)
    dense = copy.deepcopy(fp8)
    quantize_experts(fp8, "fp8")
    with torch.no_grad():
        for proj in ("gate_up", "down"):
            dense.base_weight(proj).copy_(fp8.dense_weight(proj)).requires_grad_(False)
    return fp8, dense


def _lora_params(experts):
    return [experts.gate_up_lora_A, experts.gate_up_lora_B, experts.down_lora_A, experts.down_lora_B]


@pytest.mark.parametrize("backend,tol", [("eager", 1e-5), ("grouped_mm", FP8_REL)])
def test_backends_on_fp8_experts_against_eager_on_the_dequantized_weights(backend, tol):
    fp8, dense = _experts_pair()
    M, k = 12, 2
    x, ids, w = sentinel_routing(M, k, 64)
    y = expert_backend(backend)(x, ids, w, fp8)
    y_ref = expert_backend("eager")(x, ids, w, dense)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, w, *_lora_params(fp8)], dy)
    grads_ref = torch.autograd.grad(y_ref, [x, w, *_lora_params(dense)], dy)
    assert _rel(y, y_ref) <= tol
    for g, g_ref in zip(grads, grads_ref):
        assert _rel(g, g_ref) <= tol
    if backend == "grouped_mm":
        assert _rel(y, y_ref) > 1e-4  # the FP8 GEMMs ran (activations quantized), not a dequantized copy


def test_grouped_mm_on_fp8_experts_compiles_to_the_eager_result():
    """The FP8 path has no host sync and no data-dependent shape: it runs inside a fullgraph compile (bf16:
    torch._grouped_mm, for the LoRA products, traces only in bf16 on the CPU, at rank 8: 16-byte rows)."""
    fp8, _ = _experts_pair(rank=8)
    fp8.to(torch.bfloat16)
    x = torch.randn(12, 64, dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (12, 2))
    ids[ids == 3] = -1
    w = torch.rand(12, 2, dtype=torch.bfloat16)
    backend = expert_backend("grouped_mm")
    eager = backend(x, ids, w, fp8)
    compiled = torch.compile(lambda x_, i_, w_: backend(x_, i_, w_, fp8), fullgraph=True)(x, ids, w)
    assert _rel(compiled, eager) <= 1e-2


def test_the_cuda_calls_pass_torchs_checks_on_meta_tensors():
    """The FP8 base's forward and backward on meta tensors take the CUDA branch of scaled_grouped_mm: torch's
    checks of torch._scaled_grouped_mm (K-major operands, scale shapes, bf16 output) pass at a real expert shape;
    a row-major weight operand, which Hopper's FP8 MMA cannot read, is refused by the same checks."""
    E, O, I, N = 4, 1536, 2048, 1000
    weight = FP8Weight.empty("fp8", (E, O, I), torch.bfloat16, device="meta")
    x = torch.empty(N, I, dtype=torch.bfloat16, device="meta", requires_grad=True)
    offs = torch.empty(E, dtype=torch.int32, device="meta")
    y = fp8_base_grouped_linear(x, weight, offs)
    y.backward(torch.empty_like(y))
    assert y.shape == (N, O) and x.grad.shape == (N, I) and x.grad.dtype == torch.bfloat16
    row_major = torch.empty(E, I, O, dtype=E4M3, device="meta")
    with pytest.raises(RuntimeError):
        scaled_grouped_mm(torch.empty(N, I, dtype=E4M3, device="meta"), torch.empty(N, device="meta"), row_major,
                          torch.empty(E, O, device="meta"), offs, torch.bfloat16)

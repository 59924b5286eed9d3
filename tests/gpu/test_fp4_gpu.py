"""scattermoe on FP4-packed experts (bf16 activations) vs the eager backend in fp32 on the dequantized weights,
at real MoE shapes (norm-relative error <= 1e-2), every FP4 GEMM config on each packed path, and the memory
the packed experts hold and need.

With LoRA (B non-zero) one backward checks dx, the routing-weight gradient, dA and dB; without (rank 0, the
frozen packed base alone) dx runs through the bare grouped GEMM on the transposed packed view (expert_gemm:
never CUTLASS for a packed weight; the persistent configs' flattened tile loop). The Triton dequantize kernel
equals quant's torch dequantization bit for bit on the GPU too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from moe.kernels import grouped_linear as gl
from moe.kernels.fp4 import PackedWeight, dequantize_fp4
from moe.kernels.tuning import FP4_GEMM_CONFIGS
from quant import FP4Weight, quantize_experts
from tests.gpu.test_grouped_gemm_paths_gpu import one_config, operands, rel_err  # noqa: F401 (fixture)
from tests.gpu.test_scattermoe_gpu import SHAPES  # E, H, I, k of the expert tests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = 1e-2
FORMATS = ["mxfp4", "nvfp4"]
LORA_NAMES = ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B")


def packed_experts(shape: str, fmt: str, rank: int = 16):
    """(packed bf16 experts, LoRA of `rank` if any, and an fp32 frozen dense copy of their dequantized values)."""
    E, H, I, _ = SHAPES[shape]
    torch.manual_seed(0)
    lora = {"lora_rank": rank, "lora_alpha": 2 * rank} if rank else {}
    ex = GroupedExperts(E, H, I, device="cuda", dtype=torch.bfloat16, **lora)
    if rank:
        with torch.no_grad():
            ex.gate_up_lora_B.normal_(0, 0.02)
            ex.down_lora_B.normal_(0, 0.02)
    quantize_experts(ex, fmt)
    ref = GroupedExperts(E, H, I, device="cuda", dtype=torch.float32, **lora)
    with torch.no_grad():
        for proj in ("gate_up", "down"):
            ref.base_weight(proj).copy_(ex.dense_weight(proj, dtype=torch.float32)).requires_grad_(False)
        for name in LORA_NAMES if rank else ():
            getattr(ref, name).copy_(getattr(ex, name).float())
    return ex, ref


def fwd_bwd(ex, backend: str, x, ids, w, dy) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = expert_backend(backend)(x, ids, w, ex)
    y.backward(dy.to(y.dtype))
    out = {"y": y.detach(), "x": x.grad, "w": w.grad}
    out.update({name: getattr(ex, name).grad for name in LORA_NAMES if ex.has_lora})
    return out


@pytest.mark.parametrize("rank", [16, 0], ids=["lora16", "frozen"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_scattermoe_on_packed_experts_matches_eager_fp32(shape, fmt, rank):
    E, H, _, k = SHAPES[shape]
    ex, ref = packed_experts(shape, fmt, rank)
    T = 2048
    logits = torch.randn(T, E, device="cuda")
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    ids[:, -1] = torch.where(ids[:, -1] % 2 == 0, -1, ids[:, -1])  # some slots of other EP ranks
    x = torch.randn(T, H, device="cuda")
    dy = torch.randn(T, H, device="cuda")
    got = fwd_bwd(ex, "scattermoe", x.bfloat16(), ids, w.bfloat16(), dy)
    want = fwd_bwd(ref, "eager", x, ids, w, dy)
    assert got.keys() == want.keys()
    for name, value in want.items():
        err = float((got[name].float() - value).norm() / value.norm())
        assert err <= TOL, f"{shape} {fmt} {name}: {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", FP4_GEMM_CONFIGS, ids=[str(c) for c in FP4_GEMM_CONFIGS])
def test_each_config_on_each_packed_path(config, fmt, one_config):  # noqa: F811 (the fixture)
    """Each FP4 candidate config (tuning.FP4_GEMM_CONFIGS) forced on every GEMM that reads a packed weight
    (Qwen3-30B-A3B shapes), against CUTLASS on the dequantized bf16 weights (the same MMA inputs): gate_up
    (gathered rows, SwiGLU epilogue), down (W), g and dx (the transposed packed view), and down / dx with a split
    and a fused LoRA. Both formats: MXFP4 in bf16 decodes through its own PTX (fp4._MXFP4_BF16_PTX), NVFP4
    through fp32 bits."""
    one_config(config)
    slots, t = operands()
    n, s, R = int(slots.offsets_E1[-1]), 2.0, t["ia"].shape[1]
    E = t["w_gu"].shape[0]
    packed = {name: FP4Weight.from_dense(t[name], fmt) for name in ("w_gu", "w_down")}
    dq = {name: w.dequantize(torch.bfloat16) for name, w in packed.items()}
    gu, down = PackedWeight.of(packed["w_gu"]), PackedWeight.of(packed["w_down"])
    offs = slots.offsets_E1[1:]

    def check(got, in_, dense_ENK, what, lora_B=None, ia=None):
        ref = gl._cutlass_gemm(in_, slots, dense_ENK).float()
        if lora_B is not None:
            ref = ref + s * torch._grouped_mm(ia, lora_B.transpose(1, 2), offs=offs).float()
        assert rel_err(got, ref, n) <= TOL, f"{fmt} {what}"

    weights = torch.rand(t["x"].shape[0], slots.topk, device="cuda")
    gate_up, _, _ = gl.gate_up_swiglu(t["x"], slots, gu, None, weights)
    check(gate_up, t["x"].index_select(0, slots.rows_S), dq["w_gu"], "gate_up (gathered rows, SwiGLU)")
    check(gl.expert_gemm(t["hw"], slots, down), t["hw"], dq["w_down"], "down (W)")
    dy_sorted = torch.randn(t["hw"].shape[0], t["x"].shape[1], device="cuda", dtype=torch.bfloat16)
    check(gl.expert_gemm(dy_sorted, slots, down.t()), dy_sorted, dq["w_down"].transpose(1, 2), "g (W^T view)")
    check(gl.expert_gemm(t["dgu"], slots, gu.t()), t["dgu"], dq["w_gu"].transpose(1, 2), "dx (W^T view)")
    # Split LoRA: ia given (A is not read); fused: ia = in A^T computed in the K loop.
    unread_A = torch.empty(E, R, t["hw"].shape[1], device="cuda", dtype=torch.bfloat16)
    got, _ = gl.expert_linear(t["hw"], slots, down, gl.LoraView(unread_A, t["B_down"], s, True), gather=False,
                              ia_Sr=t["ia"])
    check(got, t["hw"], dq["w_down"], "down + split LoRA", t["B_down"], t["ia"])
    A_down = torch.randn_like(unread_A) * 0.02
    got, ia = gl.expert_linear(t["hw"], slots, down, gl.LoraView(A_down, t["B_down"], s, False), gather=False)
    ia_ref = torch._grouped_mm(t["hw"], A_down.transpose(1, 2), offs=offs)
    assert rel_err(ia, ia_ref, n) <= TOL, f"{fmt} fused LoRA ia"
    check(got, t["hw"], dq["w_down"], "down + fused LoRA", t["B_down"], ia_ref)
    B_T = t["A_gu"].transpose(1, 2)  # dx reads the gate_up LoRA backwards
    unread = torch.empty(E, R, t["dgu"].shape[1], device="cuda", dtype=torch.bfloat16)
    got, _ = gl.expert_linear(t["dgu"], slots, gu.t(), gl.LoraView(unread, B_T, s, True), gather=False,
                              ia_Sr=t["ia"])
    check(got, t["dgu"], dq["w_gu"].transpose(1, 2), "dx + split LoRA", B_T, t["ia"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_equals_torch_on_gpu(fmt):
    torch.manual_seed(0)
    w = FP4Weight.from_dense(torch.randn(8, 1536, 2048, device="cuda", dtype=torch.bfloat16) * 0.02, fmt)
    ours = dequantize_fp4(w, torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), w.dequantize(torch.bfloat16).view(torch.int16))
    some = torch.tensor([5, 1], device="cuda")
    assert torch.equal(dequantize_fp4(w, torch.bfloat16, some).view(torch.int16), ours[some].view(torch.int16))


@pytest.mark.parametrize("fmt", FORMATS)
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
    # A first call tunes the kernels (Triton's do_bench holds a 256 MB cache-flush buffer meanwhile).
    expert_backend("scattermoe")(x, ids, w.bfloat16(), packed).sum().backward()
    x.grad = None
    for p in packed.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    expert_backend("scattermoe")(x, ids, w.bfloat16(), packed).sum().backward()
    torch.cuda.synchronize()
    dense_bf16_bytes = 2 * E * 3 * H * I
    assert torch.cuda.max_memory_allocated() - before < dense_bf16_bytes / 2

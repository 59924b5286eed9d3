"""scattermoe on an FP8 (e4m3, rowwise) frozen base (CPU, Triton interpreter, fp32 activations, tiny shapes).

The kernels against an fp64 reference that emulates them exactly: the dequantized codes of the weight times the
dequantized codes of the rowwise-quantized input (for the backward's transposed weight: of the input rows
scaled by the weight's scales first); the whole backend against the grouped_mm backend's FP8 path
(quant.fp8_base), which quantizes the same operands the same way. H, I of the kernel cases are not multiples
of the interpreter's blocks (partial tiles in N and K, and rows of codes too short for TMA); the backend cases'
are (the TMA path for the down projection)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from moe.backends import expert_backend
from moe.kernels import grouped_linear as gl
from moe.kernels import tuning
from moe.kernels.fp8 import FP8View
from moe.kernels.routing import sort_slots
from quant import FP8Weight
from quant.fp8 import dequantize_rows, quantize_rows
from tests.conftest import nan_slot_buffers, sentinel_routing
from tests.unit.test_quant import _experts_pair

if not tuning.INTERPRET:
    pytest.skip("interpreter tests (CPU); tests/gpu covers the GPU", allow_module_level=True)

E, H, I, R, K_TOP = 4, 40, 24, 4, 2
EXACT = 1e-5  # the kernels against their exact emulation
TO_GROUPED_MM = 1e-4  # two FP8 implementations of the same quantized products
FP8_REL = 0.08  # FP8 against the unquantized products (tests/unit/test_quant_fp8.py)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def _routing(M: int = 13):
    """ids with a row of -1 only, a partly routed row and an expert (E - 1) without rows; routing weights."""
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(M)])
    ids[ids == E - 1] = -1
    ids[2] = -1
    ids[5, 0] = -1
    return ids, torch.rand(M, K_TOP, generator=g)


def _quantized(t: torch.Tensor) -> torch.Tensor:
    """fp64 values of t's rowwise e4m3 codes: what the kernels multiply."""
    return dequantize_rows(*quantize_rows(t), torch.float64)


def _lora(out_features: int, in_features: int, split: bool) -> gl.LoraView:
    g = torch.Generator().manual_seed(5)
    return gl.LoraView(torch.randn(E, R, in_features, generator=g) * 0.2,
                       torch.randn(E, out_features, R, generator=g) * 0.2, 0.5, split)


def _lora_ref(in_rows: torch.Tensor, lora: gl.LoraView, e: int) -> torch.Tensor:
    return lora.scaling * (in_rows.double() @ lora.A_ErK[e].double().T) @ lora.B_ENr[e].double().T


def _segments(slots):
    offsets = slots.offsets_E1.tolist()
    return [(e, offsets[e], offsets[e + 1]) for e in range(E)]


@pytest.mark.parametrize("lora_split", [None, False, True], ids=["no-lora", "lora-fused-asked", "lora-split"])
def test_gate_up_swiglu_gathered_equals_the_exact_emulation(lora_split, monkeypatch):
    """gate_up (gathered rows of x) and hw = w silu(gate) up on FP8 codes; a fused LoRA asked for runs split."""
    made = nan_slot_buffers(monkeypatch)
    torch.manual_seed(0)
    weight = FP8Weight.from_dense(torch.randn(E, 2 * I, H) * 0.2, "fp8")
    ids, w = _routing()
    x = torch.randn(ids.shape[0], H)
    slots = sort_slots(ids, E)
    lora = None if lora_split is None else _lora(2 * I, H, lora_split)
    gu, hw, xa = gl.gate_up_swiglu(x, slots, FP8View.of(weight), lora, w)
    xq, w_deq = _quantized(x), weight.dequantize(torch.float64)
    order = slots.order_S.long()
    for e, lo, hi in _segments(slots):
        if hi == lo:
            continue
        token = order[lo:hi] // K_TOP
        ref = xq[token] @ w_deq[e].T
        if lora is not None:
            ref = ref + _lora_ref(x[token], lora, e)
            assert _rel(xa[lo:hi], x[token].double() @ lora.A_ErK[e].double().T) <= EXACT
        gate, up = ref[:, :I], ref[:, I:]
        hw_ref = w.reshape(-1)[order[lo:hi]].double()[:, None] * torch.nn.functional.silu(gate) * up
        assert _rel(gu[lo:hi], ref) <= EXACT and _rel(hw[lo:hi], hw_ref) <= EXACT, e
    assert slots.offsets_E1[E - 1] == slots.offsets_E1[E]  # the last expert had no rows
    assert not gu[: slots.offsets_E1[E]].isnan().any() and len(made) >= 2


@pytest.mark.parametrize("lora", [False, True], ids=["frozen", "lora-split"])
def test_down_on_expert_sorted_rows_equals_the_exact_emulation(lora):
    torch.manual_seed(0)
    weight = FP8Weight.from_dense(torch.randn(E, H, I) * 0.2, "fp8")
    ids, _ = _routing()
    slots = sort_slots(ids, E)
    hw = torch.randn(slots.capacity, I)
    view = _lora(H, I, True) if lora else None
    out, ia = gl.expert_linear(hw, slots, FP8View.of(weight), view, gather=False)
    hq, w_deq = _quantized(hw), weight.dequantize(torch.float64)
    for e, lo, hi in _segments(slots):
        if hi > lo:
            ref = hq[lo:hi] @ w_deq[e].T + (_lora_ref(hw[lo:hi], view, e) if lora else 0)
            assert _rel(out[lo:hi], ref) <= EXACT, e
    assert (ia is not None) == lora


@pytest.mark.parametrize("gather", [False, True], ids=["sorted-rows", "gathered"])
def test_transposed_weight_folds_its_scales_into_the_input_rows(gather):
    """The backward's W^T [E, I, O]: the reduction along O carries the weight's scales, folded into the input
    rows (in[p, o] * s[e(p), o]) before they are quantized; a gathering launch gathers first."""
    torch.manual_seed(0)
    weight = FP8Weight.from_dense(torch.randn(E, H, I) * 0.2, "fp8")
    weight.scales.mul_(torch.rand(E, H) * 3 + 0.1)  # scales far apart: a missing fold shows
    ids, _ = _routing()
    slots = sort_slots(ids, E)
    dy = torch.randn(ids.shape[0] if gather else slots.capacity, H)
    out, _ = gl.expert_linear(dy, slots, FP8View.of(weight).t(), None, gather=gather)
    codes = weight.codes.double()
    order = slots.order_S.long()
    for e, lo, hi in _segments(slots):
        if hi > lo:
            rows = dy[order[lo:hi] // K_TOP] if gather else dy[lo:hi]
            ref = _quantized(rows * weight.scales[e]) @ codes[e]
            assert _rel(out[lo:hi], ref) <= EXACT, e
            assert _rel(out[lo:hi], rows.double() @ weight.dequantize(torch.float64)[e]) <= FP8_REL


def _lora_params(experts):
    return [experts.gate_up_lora_A, experts.gate_up_lora_B, experts.down_lora_A, experts.down_lora_B]


@pytest.mark.parametrize("split", [False, True], ids=["small-experts", "lora-split"])
def test_scattermoe_on_an_fp8_base_equals_grouped_mms_fp8_path(split, monkeypatch):
    """Output, dx and LoRA factor gradients of the whole backend against grouped_mm's FP8 GEMMs (the same
    quantized operands), and away from the unquantized result (the FP8 GEMMs ran). The routing weights'
    gradient differs by FP8's error: scattermoe takes <g, h> with g = dy W_down from quantized dy rows (the
    weight sits inside hw), grouped_mm <dy, z> with z from quantized h rows; each within FP8's error of the
    exact <dy, z>."""
    monkeypatch.setattr("moe.backends.scattermoe._SPLIT_MIN_WEIGHT_ELEMS", 0 if split else 10 ** 9)
    fp8, dense = _experts_pair("fp8", R, std=0.2)
    torch.manual_seed(3)
    x, ids, w = sentinel_routing(12, K_TOP, 64)
    results = {}
    for name, experts in (("scattermoe", fp8), ("grouped_mm", fp8), ("eager", dense)):
        y = expert_backend(name)(x, ids, w, experts)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
        results[name] = (y, *torch.autograd.grad(y, [x, w, *_lora_params(experts)], dy))
    names = ("y", "dx", "dw", "gu_A", "gu_B", "down_A", "down_B")
    ours, ref, exact = results["scattermoe"], results["grouped_mm"], results["eager"]
    errors = {n: _rel(a, b) for n, a, b in zip(names, ours, ref) if n != "dw"}
    assert max(errors.values()) <= TO_GROUPED_MM, errors
    assert 1e-4 < _rel(ours[0], exact[0]) <= FP8_REL and 1e-4 < _rel(ours[1], exact[1]) <= FP8_REL
    assert _rel(ours[2], exact[2]) <= FP8_REL and _rel(ref[2], exact[2]) <= FP8_REL


def test_compiled_scattermoe_on_an_fp8_base_equals_eager():
    """Under torch.compile the FP8 weight enters the opaque ops as its codes and scales (fmt "fp8")."""
    fp8, _ = _experts_pair("fp8", R, std=0.2)
    torch.manual_seed(3)
    x, ids, w = sentinel_routing(8, K_TOP, 64)
    backend = expert_backend("scattermoe")
    out = {}
    for mode, fn in (("eager", backend), ("compiled", torch.compile(backend, fullgraph=True, backend="aot_eager"))):
        y = fn(x, ids, w, fp8)
        out[mode] = (y, *torch.autograd.grad(y, [x, w, *_lora_params(fp8)], torch.ones_like(y)))
    for a, b in zip(out["eager"], out["compiled"]):
        assert torch.equal(a, b)


def test_an_fp8_launch_never_runs_the_fused_lora():
    lora = _lora(H, I, False)
    weight = FP8View.of(FP8Weight.from_dense(torch.randn(E, H, I), "fp8"))
    assert gl._fp8_lora(lora, weight) == dataclasses.replace(lora, split=True)
    assert gl._fp8_lora(lora, torch.randn(E, H, I)) is lora


def test_custom_op_with_fp8_weights_passes_opcheck():
    """Fake implementation, autograd registration and AOT dispatch with FP8 codes and row scales (the schema
    check compares inputs with arithmetic torch lacks for e4m3 on the CPU; the FP4 opcheck covers the schema)."""
    fp8, _ = _experts_pair("fp8", R, std=0.2)
    g = torch.Generator().manual_seed(2)
    # no -1 slot: the outputs' rows at -1 positions are unspecified, which opcheck would compare
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(5)])
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.rand(5, K_TOP, generator=g).requires_grad_()
    slots = sort_slots(ids, E)
    gu, down = fp8.base_weight("gate_up"), fp8.base_weight("down")
    args = (x, w, gu.codes, down.codes, *fp8.lora("gate_up"), *fp8.lora("down"), gu.scales, None, down.scales, None,
            ids, slots.order_S, slots.inv_S, slots.offsets_E1, slots.rows_S, slots.capacity, fp8.lora_scaling, "fp8")
    torch.library.opcheck(torch.ops.moert.scattermoe_fwd.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

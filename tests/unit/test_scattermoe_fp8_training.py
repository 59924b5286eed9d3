"""quant.train_fp8 on the scattermoe backend (CPU, Triton interpreter, fp32 activations, tiny shapes): forward, g /
dx and dW on FP8 operands, against the grouped_mm backend's FP8 training (quant.fp8_training) and against the
unquantized eager backend.

Where both backends quantize the same operands along the same axes (y, dx, d gate_up: scattermoe's routing weight
multiplies a row before its rowwise quantization, grouped_mm's after it, and a rowwise scale absorbs it) they
agree within TO_GROUPED_MM. dW_down and the routing-weight gradients quantize differently: scattermoe's dW_down
reads w h and dy along the tokens (grouped_mm: h and w dy; a per-token factor inside a per-column quantization
changes the codes), and its routing-weight gradient is <g, h> (grouped_mm: <dy, down(h)>, another FP8 product);
those agree within FP8_TO_FP8, twice the FP8 error bound (measured: 0.07 and 0.03 at most over three seeds;
the others 2e-7)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from moe.kernels import tuning
from moe.kernels.grouped_xty import grouped_xty_fp8
from moe.kernels.routing import sort_slots
from quant.fp8_training import grad_weight_operands, scaled_grouped_mm_2d2d
from tests.conftest import nan_slot_buffers, sentinel_routing

if not tuning.INTERPRET:
    pytest.skip("interpreter tests (CPU); tests/gpu covers the GPU", allow_module_level=True)

E, H, I, M, K_TOP = 4, 32, 16, 12, 2
TO_GROUPED_MM = 1e-4  # the same quantized products, summed in another order
# bf16 masters: dW stored in bf16 by two roundings (the interpreter's fp32 -> bf16 cast truncates)
BF16_DW_TO_GROUPED_MM = 1e-2
FP8_TO_FP8 = 0.16  # two FP8 roundings of different operands: within twice FP8_REL of each other
FP8_REL = 0.08  # e4m3 over a GEMM against the unquantized product (tests/unit/test_quant_fp8.py)
# The routing-weight gradient <g, h> per slot is a short sum with cancellation: grouped_mm's FP8 training
# reaches 0.107 against fp32 on this layer (seed 0), scattermoe 0.097.
ROUTING_FP8_REL = 0.15
VISIBLY_FP8 = 1e-4


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def _layer(seed: int = 0, master_dtype: torch.dtype = torch.float32):
    """(experts with fp8_training, an unquantized copy) and the routing of sentinel_routing: a -1 slot and the
    last expert (E - 1) without rows."""
    torch.manual_seed(seed)
    fp8 = GroupedExperts(E, H, I).to(master_dtype)
    ref = copy.deepcopy(fp8).float()  # the eager reference in fp32, on the masters' values
    fp8.fp8_training = True
    return fp8, ref, sentinel_routing(M, K_TOP, H, E)


def _run(backend: str, experts, x, ids, w, dy, valid_slots=None):
    """(y, dx, d routing weights, d gate_up, d down)."""
    y = expert_backend(backend)(x, ids, w, experts, valid_slots=valid_slots)
    return (y, *torch.autograd.grad(y, [x, w, experts.gate_up, experts.down], dy))


_NAMES = ("y", "dx", "d routing weights", "d gate_up", "d down")


def test_grouped_xty_fp8_equals_quant_fp8_training_dw(monkeypatch):
    """The dW kernel on expert-sorted rows (NaN past the last expert, an empty expert) against
    scaled_grouped_mm_2d2d on grad_weight_operands: the same codes and scales, within float rounding."""
    torch.manual_seed(0)
    ids = torch.randint(0, E - 1, (M, K_TOP))
    ids[3] = -1
    slots = sort_slots(ids, E, None, None)
    S, valid = slots.capacity, int(slots.offsets_E1[-1])
    L = torch.randn(S, 24)
    R = torch.randn(S, 40)
    L[valid:], R[valid:] = float("nan"), float("nan")
    out = grouped_xty_fp8(L, R, slots, torch.float32)
    ref = scaled_grouped_mm_2d2d(*grad_weight_operands(L[:valid], R[:valid], slots.offsets_E1[1:]), torch.float32)
    assert _rel(out, ref) <= 1e-6
    assert not out[E - 1].any()  # the expert without rows
    exact = torch.stack([L[a:b].double().T @ R[a:b].double() for a, b in zip(slots.offsets_E1[:-1].tolist(),
                                                                              slots.offsets_E1[1:].tolist())])
    assert VISIBLY_FP8 < _rel(out, exact) <= FP8_REL


@pytest.mark.parametrize("master_dtype,known_valid", [(torch.float32, False), (torch.float32, True),
                                                      (torch.bfloat16, False)],
                         ids=["fp32-masters", "fp32-masters-valid-slots", "bf16-masters"])
def test_scattermoe_fp8_training_against_grouped_mm_and_eager(master_dtype, known_valid, monkeypatch):
    """y and every gradient: the FP8 math of grouped_mm's FP8 training, within FP8 error of the unquantized
    layer and visibly quantized; NaN in every unwritten slot buffer row would show (buffers of M*k rows, or of
    exactly the valid slots as under EP); the empty expert gets no dW; the gradients keep the masters' dtype."""
    nan_slot_buffers(monkeypatch)
    fp8, ref, (x, ids, w) = _layer(master_dtype=master_dtype)
    dy = torch.randn(M, H)
    got = _run("scattermoe", fp8, x, ids, w, dy, int((ids >= 0).sum()) if known_valid else None)
    fp8_gm = _run("grouped_mm", fp8, x, ids, w, dy)
    exact = _run("eager", ref, x, ids, w, dy)
    for name, a, b, c in zip(_NAMES, got, fp8_gm, exact):
        assert torch.isfinite(a).all(), name
        bound = FP8_TO_FP8 if name in ("d routing weights", "d down") else TO_GROUPED_MM
        if name == "d gate_up" and master_dtype == torch.bfloat16:
            bound = BF16_DW_TO_GROUPED_MM
        assert _rel(a, b) <= bound, (name, _rel(a, b))
        assert VISIBLY_FP8 < _rel(a, c) <= (ROUTING_FP8_REL if name == "d routing weights" else FP8_REL), name
    assert got[3].dtype == got[4].dtype == master_dtype
    assert not got[3][E - 1].any() and not got[4][E - 1].any()
    assert not got[2][ids < 0].any()  # a -1 slot's routing weight gets no gradient


def test_scattermoe_fp8_training_refuses_torch_compile(monkeypatch):
    """The custom ops do not take FP8 training: one clear error inside a trace (runtime.plan refuses the pairing
    before, by Capabilities.compile_train_fp8)."""
    fp8, _, (x, ids, w) = _layer()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(NotImplementedError, match="quant.train_fp8 runs on this backend in eager mode only"):
        expert_backend("scattermoe")(x, ids, w, fp8)

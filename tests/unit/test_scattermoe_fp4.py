"""scattermoe on FP4-packed experts vs the eager reference on the dequantized weights (CPU, Triton interpreter,
fp32 compute, tiny shapes), and the Triton dequantize kernel vs torchao bit for bit.

H and I are multiples of the FP4 blocks (32) but not of the interpreter's kernel blocks in every dim."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from moe.backends import expert_backend
from moe.backends import scattermoe as scattermoe_module
from moe.kernels import tuning
from moe.kernels.fp4 import dequantize_fp4
from quant import FP4Weight
from tests.unit.test_quant import _experts_pair, _torchao_dequantize

if not tuning.INTERPRET:
    pytest.skip("interpreter tests (CPU); tests/gpu/test_fp4_gpu.py covers the GPU", allow_module_level=True)

H, I, R = 64, 32, 4
TOL = 1e-5
FORMATS = ("mxfp4", "nvfp4")


def _int(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_equals_torchao_bit_for_bit(fmt):
    torch.manual_seed(0)
    w = torch.randn(3, 40, 96) * 0.02
    w[1, 3, :32] = 0  # a zero block
    w[2, 0, 5] = 1.0  # an outlier: tiny blocks elsewhere get subnormal e4m3 scales under NVFP4
    w[2, 1, :16] = 1e-5
    packed = FP4Weight.from_dense(w, fmt)
    ours = dequantize_fp4(packed, torch.float32)
    assert torch.equal(_int(ours), _int(_torchao_dequantize(w, fmt, packed.packed)))
    some = torch.tensor([2, 0])
    assert torch.equal(_int(dequantize_fp4(packed, torch.float32, some)), _int(ours[some]))


def _pair(fmt: str, rank: int):
    """Packed experts and a frozen dense copy holding their dequantized values (test_quant's pair)."""
    return _experts_pair(fmt, rank, hidden=H, intermediate=I, std=0.2)


def _routing(M: int, E: int, k: int = 2):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    ids[ids == E - 1] = -1  # the last expert gets no token; its slots belong to another EP rank
    ids[0, 1] = -1
    return ids, torch.rand(M, k, generator=g)


def _check(fmt: str, rank: int, split: bool, monkeypatch, compiled: bool = False):
    if rank:
        monkeypatch.setattr(scattermoe_module, "_SPLIT_MIN_WEIGHT_ELEMS", 0 if split else 10**9)
    packed, dense = _pair(fmt, rank)
    ids, w = _routing(10, 4)
    x = torch.randn(10, H, requires_grad=True)
    w.requires_grad_()
    fn = expert_backend("scattermoe")
    if compiled:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y = fn(x, ids, w, packed)
    y_ref = expert_backend("eager")(x, ids, w, dense)
    dy = torch.randn_like(y)
    def lora(ex):
        return [ex.gate_up_lora_A, ex.gate_up_lora_B, ex.down_lora_A, ex.down_lora_B] if rank else []
    grads = torch.autograd.grad(y, [x, w, *lora(packed)], dy)
    grads_ref = torch.autograd.grad(y_ref, [x, w, *lora(dense)], dy)
    errors = {"y": (y - y_ref).norm() / y_ref.norm()}
    for name, g, g_ref in zip(["x", "w", "gu_A", "gu_B", "down_A", "down_B"], grads, grads_ref):
        errors[name] = (g - g_ref).norm() / g_ref.norm()
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lora", ["frozen", "lora-split", "lora-fused"])
def test_scattermoe_on_packed_experts_equals_eager_on_dequantized(fmt, lora, monkeypatch):
    _check(fmt, 0 if lora == "frozen" else R, lora == "lora-split", monkeypatch)


def test_scattermoe_on_packed_experts_compiles(monkeypatch):
    _check("nvfp4", R, True, monkeypatch, compiled=True)


def test_custom_op_with_packed_weights_passes_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch with packed FP4 operands."""
    from moe.kernels.routing import sort_slots

    packed, _ = _pair("nvfp4", R)
    g = torch.Generator().manual_seed(2)
    # no -1 slot: the outputs' rows at -1 positions are unspecified, which opcheck would compare
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    x = torch.randn(5, H, requires_grad=True)
    w.requires_grad_()
    slots = sort_slots(ids, 4)
    gu, down = packed.base_weight("gate_up").packed, packed.base_weight("down").packed
    args = (x, w, gu.qdata, down.qdata, *packed.lora("gate_up"), *packed.lora("down"), gu.scale, gu.tensor_scale,
            down.scale, down.tensor_scale, ids, slots.order_S, slots.inv_S, slots.offsets_E1, slots.rows_S,
            packed.lora_scaling, "nvfp4")
    torch.library.opcheck(torch.ops.moert.scattermoe_fwd.default, args)

"""scattermoe on FP4-packed experts vs the eager reference on the dequantized weights (CPU, Triton interpreter,
fp32 compute, tiny shapes), and the Triton dequantize kernel vs torchao bit for bit.

H and I are multiples of the FP4 blocks (32, 16); the `ragged` cases force kernel tiles that they are not
multiples of (partial tiles in N, K and the SwiGLU's columns), and the bare packed GEMM is checked on its own
at ragged edges in both orientations (the forward's W, the backward's transposed view)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from gpu import launch as gpu_launch
from moe.backends import expert_backend
from moe.backends import scattermoe as scattermoe_module
from moe.kernels import grouped_linear as gl
from moe.kernels import tuning
from moe.kernels.fp4 import PackedWeight, dequantize_fp4
from moe.kernels.routing import sort_slots
from quant import FP4Weight
from tests.unit.test_quant import (
    _experts_pair,
    _torchao_dequantize,
    assert_same_values,
    every_code_under_every_scale_byte,
)

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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on overflow and NaN: here on purpose
def test_decoding_every_code_and_scale_byte(fmt):
    """Every e2m1 code in either nibble under every scale byte (e8m0 0 = 2^-127 and 255 = NaN; e4m3
    subnormals, -0 and the NaNs 0x7F / 0xFF; NVFP4 tensor scales from subnormal to huge) equals quant's torch
    dequantization (torch's own float8 view for e4m3), in fp32 and rounded to fp16 (bf16 on the GPU alone:
    the interpreter's fp32 -> bf16 cast truncates)."""
    weight = every_code_under_every_scale_byte(fmt)
    for dtype in (torch.float32, torch.float16):
        ours, ref = dequantize_fp4(weight, dtype), weight.dequantize(dtype)
        assert ref.isnan().any() and ref.isinf().any() and (ref == 0).any()
        assert_same_values(ours, ref)


def test_compiled_ops_take_one_format_for_both_weights():
    packed, dense = _pair("mxfp4", 0)
    gu, down = (PackedWeight.of(packed.base_weight(p)) for p in ("gate_up", "down"))
    assert scattermoe_module._op_format(gu, down) == "mxfp4"
    assert scattermoe_module._op_format(dense.gate_up, dense.down) == ""
    with pytest.raises(NotImplementedError, match="different formats"):
        scattermoe_module._op_format(gu, dense.down)


def _pair(fmt: str, rank: int, hidden: int = H, intermediate: int = I):
    """Packed experts and a frozen dense copy holding their dequantized values (test_quant's pair)."""
    return _experts_pair(fmt, rank, hidden=hidden, intermediate=intermediate, std=0.2)


def _routing(M: int, E: int, k: int = 2):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    ids[ids == E - 1] = -1  # the last expert gets no token; its slots belong to another EP rank
    ids[0, 1] = -1
    return ids, torch.rand(M, k, generator=g)


@pytest.fixture
def one_config(monkeypatch):
    """Makes the grouped GEMM's autotuner hold only `config` (and forget what it had chosen)."""
    tuner = gl._grouped_linear_kernel

    def use(config):
        monkeypatch.setattr(tuner, "configs", [config])
        monkeypatch.setattr(tuner, "cache", {})
    return use


# (format, H, I, BLOCK_M, BLOCK_N, BLOCK_K) of the ragged cases: H, I not multiples of BLOCK_N (nor the
# SwiGLU's BLOCK_N / 2 columns for nvfp4) and the reductions H, I, 2I not all multiples of BLOCK_K.
RAGGED = {"mxfp4": (96, 32, 16, 64, 64), "nvfp4": (48, 48, 16, 64, 32)}


def _check(fmt: str, rank: int, split: bool, monkeypatch, compiled: bool = False, shape: tuple = (H, I)):
    if rank:
        monkeypatch.setattr(scattermoe_module, "_SPLIT_MIN_WEIGHT_ELEMS", 0 if split else 10**9)
    packed, dense = _pair(fmt, rank, *shape)
    ids, w = _routing(10, 4)
    x = torch.randn(10, shape[0], requires_grad=True)
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lora", ["frozen", "lora-split", "lora-fused"])
def test_scattermoe_on_packed_experts_with_ragged_tiles(fmt, lora, monkeypatch, one_config):
    H_, I_, *blocks = RAGGED[fmt]
    one_config(tuning._gemm_config(*blocks, 4, 1, persistent=True))
    _check(fmt, 0 if lora == "frozen" else R, lora == "lora-split", monkeypatch, shape=(H_, I_))


@pytest.mark.parametrize("fmt,O,I_", [("mxfp4", 40, 96), ("nvfp4", 40, 48)])
@pytest.mark.parametrize("transposed", [False, True], ids=["W", "W^T"])
@pytest.mark.parametrize("block_k", [16, 64])
def test_bare_packed_gemm_at_ragged_edges(fmt, O, I_, transposed, block_k, one_config):
    """out[p] = in[p] @ W_e^T over expert-sorted rows, W the packed [O, I] weight (forward) or its transposed
    view (backward): partial tiles in N and K, a tile spanning parts of FP4 blocks (16 < 32) or several (64),
    an expert without rows and -1 slots (their rows unspecified)."""
    one_config(tuning._gemm_config(16, 32, block_k, 4, 1, persistent=True))
    torch.manual_seed(0)
    weight = FP4Weight.from_dense(torch.randn(3, O, I_) * 0.1, fmt)
    w_ENK, dense_ENK = PackedWeight.of(weight), weight.dequantize(torch.float32)
    if transposed:
        w_ENK, dense_ENK = w_ENK.t(), dense_ENK.transpose(1, 2)
    assert w_ENK.shape == tuple(dense_ENK.shape)
    E, _, K = w_ENK.shape
    ids = torch.randint(0, 3, (20, 2), generator=torch.Generator().manual_seed(3))
    ids[ids == 1] = -1  # expert 1 gets no row
    slots = sort_slots(ids, E)
    in_SK = torch.randn(slots.num_slots, K)
    out = gl._triton_gemm(in_SK, slots, w_ENK)
    assert gl.expert_gemm(in_SK, slots, w_ENK).shape == out.shape  # the packed weight's one route
    offsets = slots.offsets_E1.tolist()
    for e in range(E):
        lo, hi = offsets[e], offsets[e + 1]
        ref = in_SK[lo:hi] @ dense_ENK[e].T
        assert (out[lo:hi] - ref).norm() <= TOL * ref.norm().clamp_min(1e-30), (e, lo, hi)
    assert offsets[1] == offsets[2]  # expert 1 empty


def test_every_grouped_launch_gives_the_direct_launcher_its_autotune_keys(monkeypatch):
    """On a GPU, gpu.launch's direct launcher keys each autotuned launch by every autotune key, read from
    the launch's arguments: a key neither positional nor among the constexprs (W_FMT on a dense weight, say)
    is a KeyError there, which the interpreter's plain kernel[grid] launch never shows. Dense, FP4-packed and
    FP8, split and fused LoRA (FP8 always splits), forward and backward."""
    missing, launched = set(), set()
    real = gpu_launch.launch

    def spy(kernel, grid, args, constexprs):
        layers = gpu_launch._layers(kernel)
        if layers.autotuner is not None:
            names = list(layers.jit.arg_names)
            launched.add(layers.jit.__name__)
            missing.update((layers.jit.__name__, key) for key in layers.autotuner.keys
                           if names.index(key) >= len(args) and key not in constexprs)
        return real(kernel, grid, args, constexprs)

    import moe.kernels.fp4 as fp4_module
    import moe.kernels.grouped_xty as xty_module
    for module in (gl, xty_module, fp4_module):
        monkeypatch.setattr(module, "launch", spy)
    for fmt in ("mxfp4", "fp8", None):
        for split in (True, False):
            monkeypatch.setattr(scattermoe_module, "_SPLIT_MIN_WEIGHT_ELEMS", 0 if split else 10**9)
            packed, dense = _pair(fmt or "mxfp4", R)
            experts = packed if fmt else dense
            if fmt is None:  # a full fine-tune with LoRA: every dW too
                experts.base_weight("gate_up").requires_grad_(True)
                experts.base_weight("down").requires_grad_(True)
            ids, w = _routing(6, 4)
            x = torch.randn(6, H, requires_grad=True)
            expert_backend("scattermoe")(x, ids, w.requires_grad_(), experts).sum().backward()
    assert "_grouped_linear_kernel" in launched
    assert not missing, missing


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
            slots.capacity, packed.lora_scaling, "nvfp4")
    torch.library.opcheck(torch.ops.moert.scattermoe_fwd.default, args)

"""Quantized expert weights (quant/; FP8's own tests: test_quant_fp8): torchao is the independent reference of
the FP4 formats; the eager backend on the dequantized dense weights is the reference of the backends; a model
built without quantization, then quantized, is the reference of the quantize-at-load and quantize-at-init
paths (every format)."""

from __future__ import annotations

import copy

import pytest
import torch

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from quant import FP4Weight, QuantizedWeight, quantize_experts
from quant.fp4 import dequantize, quantize
from quant.weight import CONTAINERS
from runtime.models import build, from_pretrained, save_pretrained
from runtime.models.hf import config_from_hf
from tests.conftest import TINY_MOE, sentinel_routing

FORMATS = ("mxfp4", "nvfp4")
ALL_FORMATS = (*FORMATS, "fp8")  # the container contract: init, load, EP split


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _torchao_dequantize(w_ENK: torch.Tensor, fmt: str, packed) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    if fmt == "mxfp4":
        return MXTensor.to_mx(w_ENK, torch.float4_e2m1fn_x2, block_size=32).dequantize(w_ENK.dtype)
    return torch.stack([NVFP4Tensor.to_nvfp4(w, block_size=16, per_tensor_scale=packed.tensor_scale[e])
                        .dequantize(w_ENK.dtype) for e, w in enumerate(w_ENK)])


# NVFP4 tensor scales from fp32-subnormal to huge: block scales and values reach subnormals, round to 0 and
# overflow (2^119 * 448 is finite, 2^125 * 448 is not).
EXTREME_TENSOR_SCALES = (0.75, 3e-3, 1e-40, 2.0 ** 119, 2.0 ** 125)


def every_code_under_every_scale_byte(fmt: str) -> FP4Weight:
    """Row r's two blocks take the scale bytes r and 255 - r (e8m0 0 = 2^-127 and 255 = NaN; e4m3
    subnormals, -0 and the NaNs 0x7F / 0xFF), and every block begins with every code: bytes (k, 15 - k) in
    even rows, (15 - k, k) in odd ones, so each scale byte meets each code in either nibble. NVFP4: one
    expert per EXTREME_TENSOR_SCALES."""
    block = 32 if fmt == "mxfp4" else 16
    E = len(EXTREME_TENSOR_SCALES) if fmt == "nvfp4" else 2
    weight = FP4Weight.empty(fmt, (E, 256, 2 * block), torch.float32)
    g = torch.Generator().manual_seed(0)
    weight.qdata.copy_(torch.randint(0, 256, weight.qdata.shape, generator=g, dtype=torch.uint8))
    k = torch.arange(8, dtype=torch.uint8)
    pairs = torch.stack([k | (15 - k) << 4, (15 - k) | k << 4]).repeat(128, 1)  # [256 rows, 8 bytes]
    weight.qdata.view(E, 256, 2, block // 2)[..., :8] = pairs[None, :, None, :]
    weight.scale.copy_(torch.stack([torch.arange(256), torch.arange(256).flip(0)], -1).to(torch.uint8))
    if fmt == "nvfp4":
        weight.tensor_scale.copy_(torch.tensor(EXTREME_TENSOR_SCALES).view(torch.int32))
    return weight


def assert_same_values(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit, signed zeros and infinities too; NaN where ref is NaN (any payload)."""
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(_int_view(ours.nan_to_num(0.0, float("inf"), float("-inf"))),
                       _int_view(ref.nan_to_num(0.0, float("inf"), float("-inf"))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_torchao_bit_for_bit(fmt, dtype):
    torch.manual_seed(0)
    w = (torch.randn(3, 48, 96) * 0.02).to(dtype)
    w[1, 5, :32] = 0  # an all-zero block
    w[2, 7, 3] = 1.0  # an outlier
    packed = quantize(w, fmt)
    ours = dequantize(packed, dtype)
    assert torch.equal(_int_view(ours), _int_view(_torchao_dequantize(w, fmt, packed)))
    some = torch.tensor([2, 0])
    assert torch.equal(_int_view(dequantize(packed, dtype, some)), _int_view(ours[some]))
    assert dequantize(packed, dtype, some[:0]).shape == (0, 48, 96)  # an EP rank whose experts got no token
    rel = ((ours.float() - w.float()).norm() / w.float().norm()).item()
    assert 0.0 < rel < 0.15, rel  # FP4: a lossy but sane approximation


def test_packed_bytes_and_what_a_model_wide_cast_leaves_alone():
    w = FP4Weight.from_dense(torch.randn(4, 64, 96) * 0.02, "nvfp4")
    assert w.packed_bytes() == 4 * 64 * 96 // 2 + 4 * 64 * 96 // 16 + 4 * 4
    before = w.dequantize()
    w.to(torch.bfloat16)  # what model.to(dtype) does to every module
    assert w.qdata.dtype == torch.uint8 and torch.equal(w.dequantize(), before)
    assert dict(w.state_dict()) == {}  # not in checkpoints: re-quantized from the base at resume


def _experts_pair(fmt: str, rank: int, hidden: int = 64, intermediate: int = 32, std: float = 0.02):
    """Packed experts (4, LoRA of `rank` with B != 0) and a frozen dense copy holding their dequantized
    values (the reference)."""
    torch.manual_seed(0)
    packed = GroupedExperts(4, hidden, intermediate, lora_rank=rank, lora_alpha=2 * rank if rank else None)
    with torch.no_grad():
        packed.gate_up.normal_(0, std)
        packed.down.normal_(0, std)
        if rank:
            packed.gate_up_lora_B.normal_(std=0.1)
            packed.down_lora_B.normal_(std=0.1)
    dense = copy.deepcopy(packed)
    quantize_experts(packed, fmt)
    with torch.no_grad():
        for proj in ("gate_up", "down"):
            dense.base_weight(proj).copy_(packed.dense_weight(proj)).requires_grad_(False)
    return packed, dense


@pytest.mark.parametrize("lora", [False, True], ids=["frozen", "lora"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["eager", "grouped_mm"])
def test_backends_on_packed_experts_equal_eager_on_the_dequantized_weights(backend, fmt, lora):
    packed, dense = _experts_pair(fmt, 4 if lora else 0)
    M, k = 12, 2
    x, ids, w = sentinel_routing(M, k, 64)
    y = expert_backend(backend)(x, ids, w, packed)
    y_ref = expert_backend("eager")(x, ids, w, dense)
    dy = torch.randn_like(y)
    wrt = [x, w] + ([packed.gate_up_lora_A, packed.gate_up_lora_B, packed.down_lora_A, packed.down_lora_B]
                    if lora else [])
    wrt_ref = [x, w] + ([dense.gate_up_lora_A, dense.gate_up_lora_B, dense.down_lora_A, dense.down_lora_B]
                        if lora else [])
    grads = torch.autograd.grad(y, wrt, dy)
    grads_ref = torch.autograd.grad(y_ref, wrt_ref, dy)
    assert (y - y_ref).norm() <= 1e-5 * y_ref.norm()
    for g, g_ref in zip(grads, grads_ref):
        assert (g - g_ref).norm() <= 1e-5 * g_ref.norm()


def test_grouped_mm_dequantizes_only_the_experts_with_rows(monkeypatch):
    packed, _ = _experts_pair("mxfp4", 4)
    seen = []
    real = FP4Weight.dequantize

    def spy(self, dtype=None, experts=None):
        seen.append(None if experts is None else experts.tolist())
        return real(self, dtype, experts)
    monkeypatch.setattr(FP4Weight, "dequantize", spy)
    ids = torch.tensor([[0, 2], [2, -1], [0, -1]])
    x = torch.randn(3, 64, requires_grad=True)
    expert_backend("grouped_mm")(x, ids, torch.rand(3, 2), packed).sum().backward()
    assert seen == [[0, 2]] * 4  # gate_up and down, forward and backward: experts 1 and 3 never


def _moe_cfg():
    return config_from_hf({**TINY_MOE, "model_type": "qwen3_moe"}, expert_backend="grouped_mm")


def _assert_packed_equal(a: QuantizedWeight, b: QuantizedWeight) -> None:
    assert type(a) is type(b) and a.fmt == b.fmt and tuple(a.shape) == tuple(b.shape)
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys() and buffers_a
    for name, buffer in buffers_a.items():
        assert torch.equal(buffer, buffers_b[name]), name


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantized_init_equals_the_quantized_dense_init_on_every_ep_rank(fmt):
    cfg = _moe_cfg()
    dense = build(cfg, torch.float32, "cpu", seed=3)
    for block in dense.moe_blocks():
        quantize_experts(block.experts, fmt)
    for ep_rank in range(2):
        model = build(cfg, torch.float32, "cpu", seed=3, ep_rank=ep_rank, ep=2, quant=fmt)
        assert not any(isinstance(p, QuantizedWeight) for p in model.parameters())
        for block, ref in zip(model.moe_blocks(), dense.moe_blocks()):
            lo = block.experts.expert_offset
            for proj in ("gate_up", "down"):
                w, w_ref = block.experts.base_weight(proj), ref.experts.base_weight(proj)
                assert isinstance(w, CONTAINERS[fmt]) and not w.is_meta
                assert torch.equal(w.dequantize(), w_ref.dequantize(experts=torch.arange(lo, lo + 4)))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_at_load_reads_one_projection_of_this_ranks_experts_at_a_time(tiny_moe_ckpt, fmt,
                                                                                monkeypatch):
    full = from_pretrained(tiny_moe_ckpt, expert_backend="grouped_mm")
    filled = []
    real = QuantizedWeight.fill_

    def spy(self, w_ENK):
        filled.append(tuple(w_ENK.shape))
        return real(self, w_ENK)
    monkeypatch.setattr(QuantizedWeight, "fill_", spy)
    part = build(full.config, torch.float32, "cpu", path=tiny_moe_ckpt, ep_rank=1, ep=2, quant=fmt)
    H, I = full.config.hidden_size, full.config.moe_intermediate_size
    assert filled == [(4, 2 * I, H), (4, H, I)] * len(full.moe_blocks())
    for block, ref in zip(part.moe_blocks(), full.moe_blocks()):
        for proj in ("gate_up", "down"):
            expected = CONTAINERS[fmt].from_dense(ref.experts.base_weight(proj)[4:].detach(), fmt)
            _assert_packed_equal(block.experts.base_weight(proj), expected)


def test_hf_export_refuses_packed_experts_unless_asked_to_dequantize(tiny_moe_ckpt, tmp_path):
    import transformers

    model = build(_moe_cfg(), torch.float32, "cpu", path=tiny_moe_ckpt, quant="mxfp4")
    with pytest.raises(ValueError, match="Pass dequantize=True"):
        save_pretrained(model, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    save_pretrained(model, tmp_path / "hf", dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter: test_scattermoe_fp4)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_decode_of_every_code_and_scale_byte(fmt):
    """The Triton decode (moe/kernels/fp4.py) as compiled for the GPU, against the CPU dequantization: its
    exactness rests on the compiled code keeping fp32 subnormals and making inf * 0 + inf NaN."""
    from moe.kernels.fp4 import dequantize_fp4
    weight = every_code_under_every_scale_byte(fmt)
    refs = {dtype: weight.dequantize(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    weight.to("cuda")
    for dtype, ref in refs.items():
        assert_same_values(dequantize_fp4(weight, dtype).cpu(), ref)

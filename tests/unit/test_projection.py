"""attention.projection.fused_linear (projections of one input as one GEMM, LoRA folded along K) against the
parts written out one by one in float64, and the attention's fused q/k/v against its three modules."""

from __future__ import annotations

import math

import pytest
import torch

from attention.attention import QKV_PROJECTIONS, Qwen3Attention
from attention.projection import LinearPart, fused_linear, linear_part
from runtime.config import LoraConfig
from runtime.lora import apply_lora

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")])
# (out features, bias, LoRA rank): a q with LoRA and bias, a k without LoRA, a v with another rank
SPECS = [(10, True, 4), (6, False, 0), (6, False, 2)]


def _parts(dtype=torch.float32, device="cpu", base_trains=True, specs=SPECS, k=12):
    g = torch.Generator().manual_seed(0)

    def leaf(*shape, grad=True):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(grad)
    return [LinearPart(leaf(o, k, grad=base_trains), leaf(o, grad=base_trains) if bias else None,
                       leaf(r, k) if r else None, leaf(o, r) if r else None, 2.0 if r == 4 else 0.5)
            for o, bias, r in specs]


def _formula(x, part: LinearPart):
    """One projection written out: x W^T + b + scaling (x A^T) B^T."""
    y = x @ part.weight.T
    if part.bias is not None:
        y = y + part.bias
    if part.lora_A is not None:
        y = y + part.scaling * (x @ part.lora_A.T) @ part.lora_B.T
    return y


def _leaves(x, parts):
    return [x] + [t for p in parts for t in p[:4] if t is not None]


@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("base_trains", [True, False])
def test_fused_parts_are_the_formula_with_its_gradients(x_grad, base_trains):
    """Outputs and every gradient (input, weights, biases, both factors) against float64 part by part; without an
    input gradient (the first block's projections) or a trained base, those gradients are None."""
    parts = _parts(base_trains=base_trains)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 12, generator=g).requires_grad_(x_grad)
    grads_y = [torch.randn(3, 5, o, generator=g) for o, _, _ in SPECS]
    ys = fused_linear(x, parts)
    torch.autograd.backward(ys, grads_y)
    ref_parts = [LinearPart(*(None if t is None else t.detach().double().requires_grad_(t.requires_grad)
                              for t in p[:4]), p.scaling) for p in parts]
    x64 = x.detach().double().requires_grad_(x_grad)
    refs = [_formula(x64, p) for p in ref_parts]
    trained = [(ref, gy.double()) for ref, gy in zip(refs, grads_y, strict=True) if ref.requires_grad]
    torch.autograd.backward(*zip(*trained))
    for y, ref in zip(ys, refs, strict=True):
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(_leaves(x, parts), _leaves(x64, ref_parts), strict=True):
        if ref.requires_grad:
            torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-5)
        else:
            assert got.grad is None


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fused_parts_under_autocast_compute_in_its_dtype(device):
    """bf16 autocast over fp32 parameters: bf16 outputs within bf16 rounding of the formula, gradients in the
    parameters' and the input's dtypes."""
    parts = _parts(device=device, specs=[(64, False, 8), (32, False, 8), (32, False, 8)], k=48)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        ys = fused_linear(x, parts)
    sum(y.float().sum() for y in ys).backward()
    assert all(y.dtype == torch.bfloat16 for y in ys) and x.grad.dtype == torch.float32
    assert all(t.grad.dtype == torch.float32 for p in parts for t in p[:4] if t is not None)
    for y, p in zip(ys, parts, strict=True):
        ref = _formula(x.detach().double(), LinearPart(*(None if t is None else t.detach().double() for t in p[:4]),
                                                        p.scaling))
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-2 * ref.abs().max().item())


def _attention(gated: bool) -> Qwen3Attention:
    torch.manual_seed(0)
    return Qwen3Attention(hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, eps=1e-6, bias=True, gated=gated)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_attention_fuses_qkv_as_its_three_modules_compute(gated, lora):
    """The attention's fused q/k/v (the default) against its q_proj, k_proj and v_proj called one by one (the path
    a Float8Linear or LoRA dropout takes), with LoRA on q and v only: outputs and every parameter gradient."""
    runs = []
    for fuse in (True, False):
        attn = _attention(gated)
        if lora:
            apply_lora(attn, LoraConfig(enabled=True, rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
            with torch.no_grad():
                for m in (attn.q_proj, attn.v_proj):
                    m.lora_B.normal_(generator=torch.Generator().manual_seed(3))
        assert attn.fuse_qkv
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
        outs = attn.project_qkv(x) if fuse else tuple(getattr(attn, n)(x) for n in QKV_PROJECTIONS)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        runs.append((outs, x.grad, {n: p.grad for n, p in attn.named_parameters() if p.requires_grad}))
    (fused, gx_f, grads_f), (alone, gx_a, grads_a) = runs
    assert grads_f.keys() == grads_a.keys() and any("lora_" in n for n in grads_f) == lora
    for a, b in zip(fused, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_f, gx_a, rtol=1e-5, atol=1e-5)
    for name in grads_f:
        torch.testing.assert_close(grads_f[name], grads_a[name], rtol=1e-5, atol=1e-5, msg=name)


def test_transforms_that_give_a_projection_its_own_forward_stop_the_fusion():
    """LoRA dropout acts on the LoRA input alone: where it targets q, k or v the attention no longer fuses them, and
    such a part refuses to fuse; a module with a forward of its own is refused by name."""
    attn = _attention(gated=False)
    apply_lora(attn, LoraConfig(enabled=True, rank=4, alpha=8, dropout=0.1, target_modules=["q_proj", "k_proj"]))
    assert attn.fuse_qkv is False
    with pytest.raises(ValueError, match="dropout"):
        linear_part(attn.q_proj)
    with pytest.raises(TypeError, match="Identity has its own forward"):
        linear_part(torch.nn.Identity())
    o_only = _attention(gated=False)  # dropout on o_proj alone leaves q, k, v plain: they still fuse
    apply_lora(o_only, LoraConfig(enabled=True, rank=4, alpha=8, dropout=0.1, target_modules=["o_proj"]))
    assert o_only.fuse_qkv is True


def _saved_shapes(fn, x) -> list[tuple[int, ...]]:
    """Shapes of what autograd keeps from fn(x)'s forward for its backward."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return shapes


def test_compiled_fused_lora_keeps_no_stacked_weights():
    """Compiled, backward's stacked weights [W ; A] are built in backward (an opaque op), not kept from forward: a
    copy of the layer's weights per layer otherwise. Forward keeps what eager keeps, give or take the rank-sized
    block-diagonal of the B factors (kept in place of their casts)."""
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(o, 64, generator=g).bfloat16() for o in (128, 32, 32)]  # a frozen bf16 base, as LoRA's
    As = [torch.randn(4, 64, generator=g).requires_grad_() for _ in ws]
    Bs = [torch.randn(w.shape[0], 4, generator=g).requires_grad_() for w in ws]

    def project(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fused_linear(x, [LinearPart(w, None, a, b, 2.0) for w, a, b in zip(ws, As, Bs, strict=True)])
    x = torch.randn(16, 64, generator=g, requires_grad=True)
    compiled = _saved_shapes(torch.compile(project, fullgraph=True), x)
    stacked = {(192, 64), (204, 64), (192, 76)}  # [W_q; W_k; W_v], with the A rows, with the B columns
    assert not stacked & set(compiled), compiled
    eager = _saved_shapes(project, x)
    assert sum(map(math.prod, compiled)) <= sum(map(math.prod, eager)) + 192 * 12

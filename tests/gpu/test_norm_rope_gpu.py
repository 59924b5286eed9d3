"""GPU tests of the fused q/k RMSNorm + RoPE Triton op (attention/norm_rope.py, kernels in
attention/kernels/norm_rope.py).

- bf16 kernel vs the fp32 torch reference on the same (bf16-representable) inputs: forward and the
  grads of q, k, q_weight, k_weight, norm-relative <= 1e-2; fp32 kernel vs fp32 reference <= 1e-5.
- torch.compile(fullgraph=True) of a small attention prologue: zero graph breaks, same results as eager.
- torch.library.opcheck on both ops (schema, fake tensor, autograd registration, AOT dispatch).

Shapes: q [B, S, H, D], k [B, S, K, D] sliced from one fused qkv output [B, S, (H + 2K) * D].
"""

from __future__ import annotations

import pytest
import torch

from attention.kernels.norm_rope import DEFAULT_LAUNCH_SETTINGS
from attention.norm_rope import qk_norm_rope

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EPS = 1e-6


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def make_inputs(batch, seq, heads_q, heads_k, head_dim, rotary_dim, dtype, seed=0):
    """q/k as strided views of one projection output (what the attention layer passes), real rope tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv_BSF = torch.randn(batch, seq, (heads_q + 2 * heads_k) * head_dim, device="cuda", generator=gen).to(dtype)
    q_BSHD = qkv_BSF[..., : heads_q * head_dim].unflatten(-1, (heads_q, head_dim))
    k_BSKD = qkv_BSF[..., heads_q * head_dim: (heads_q + heads_k) * head_dim].unflatten(-1, (heads_k, head_dim))
    q_w = (1.0 + 0.3 * torch.randn(head_dim, device="cuda", generator=gen)).to(dtype)
    k_w = (1.0 + 0.3 * torch.randn(head_dim, device="cuda", generator=gen)).to(dtype)
    positions = torch.arange(seq, device="cuda").float().expand(batch, seq)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2, device="cuda").float() / rotary_dim))
    emb = torch.cat([positions[..., None] * inv_freq] * 2, dim=-1)
    return q_BSHD, k_BSKD, q_w, k_w, emb.cos().to(dtype), emb.sin().to(dtype)


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A grad-requiring copy with the same strides (clone() would make a strided view contiguous)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t).requires_grad_()


def forward_and_grads(inputs, impl, unit_offset, rotary_dim, upcast=False, seed=1):
    """Outputs and grads of (q, k, q_w, k_w); `upcast` runs on fp32 copies (the reference side)."""
    q, k, q_w, k_w, cos, sin = (t.float() if upcast else t for t in inputs)
    leaves = [leaf(t) for t in (q, k, q_w, k_w)]
    q_out, k_out = qk_norm_rope(*leaves, cos, sin, EPS, unit_offset, rotary_dim, impl=impl)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grad_q = torch.randn(q_out.shape, device="cuda", generator=gen).to(q_out.dtype)
    grad_k = torch.randn(k_out.shape, device="cuda", generator=gen).to(k_out.dtype)
    grads = torch.autograd.grad((q_out, k_out), leaves, (grad_q, grad_k))
    return (q_out, k_out, *grads)


NAMES = ("q", "k", "dq", "dk", "dq_w", "dk_w")


@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (256, 256), (128, 64), (256, 64)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_bf16_kernel_matches_fp32_reference(head_dim, rotary_dim, unit_offset):
    inputs = make_inputs(2, 300, 10, 2, head_dim, rotary_dim, torch.bfloat16)
    assert not inputs[0].is_contiguous()
    ours = forward_and_grads(inputs, "triton", unit_offset, rotary_dim)
    ref = forward_and_grads(inputs, "torch", unit_offset, rotary_dim, upcast=True)
    for name, a, b in zip(NAMES, ours, ref):
        assert a.dtype == torch.bfloat16, name
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))


def test_bf16_real_shape_loops_over_tiles_in_backward():
    """Qwen3-14B heads at 8k tokens: dozens of row tiles per backward program, so the dW loop really runs."""
    inputs = make_inputs(1, 8192, 40, 8, 128, 128, torch.bfloat16)
    ours = forward_and_grads(inputs, "triton", False, None)
    ref = forward_and_grads(inputs, "torch", False, None, upcast=True)
    for name, a, b in zip(NAMES, ours, ref):
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))


def test_cuda_graph_capture_of_forward_backward():
    """The benchmark (and CUDA-graph training) captures fwd+bwd; replays must reproduce eager results."""
    inputs = make_inputs(1, 512, 8, 2, 128, 128, torch.bfloat16)
    leaves = [leaf(t) for t in inputs[:4]]
    grads = [torch.randn(t.shape, device="cuda", dtype=t.dtype) for t in leaves[:2]]

    def step():
        outs = qk_norm_rope(*leaves, *inputs[4:], EPS, impl="triton")
        grads_in = torch.autograd.grad(outs, leaves, grads)
        # Detached: an autograd graph kept alive from the eager call would pin the leaves' AccumulateGrad
        # nodes to the default stream, which capture forbids (a property of autograd, not of the op).
        return (*(t.detach() for t in outs), *grads_in)

    expected = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(NAMES, static, expected):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (256, 64)])
def test_fp32_kernel_matches_fp32_reference(head_dim, rotary_dim):
    inputs = make_inputs(3, 257, 5, 1, head_dim, rotary_dim, torch.float32)
    ours = forward_and_grads(inputs, "triton", True, rotary_dim)
    ref = forward_and_grads(inputs, "torch", True, rotary_dim)
    for name, a, b in zip(NAMES, ours, ref):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_auto_picks_triton_on_cuda():
    inputs = make_inputs(1, 64, 4, 2, 128, 128, torch.bfloat16)
    from runtime.choices import Needs, choose

    auto = choose("model.norm_rope_impl", "auto", Needs("cuda"))[0]
    for a, b in zip(forward_and_grads(inputs, auto, False, None), forward_and_grads(inputs, "triton", False, None)):
        assert torch.equal(a, b)


class Prologue(torch.nn.Module):
    """qkv projection -> q/k norm + rope, the way the attention layer uses the op."""

    def __init__(self, hidden, heads_q, heads_k, head_dim):
        super().__init__()
        self.shape = (heads_q, heads_k, head_dim)
        self.qkv = torch.nn.Linear(hidden, (heads_q + 2 * heads_k) * head_dim, bias=False)
        self.q_norm = torch.nn.Parameter(1.0 + 0.1 * torch.randn(head_dim))
        self.k_norm = torch.nn.Parameter(1.0 + 0.1 * torch.randn(head_dim))

    def forward(self, x_BSE, cos, sin):
        heads_q, heads_k, head_dim = self.shape
        q_BSHD, k_BSKD, v_BSKD = self.qkv(x_BSE).unflatten(-1, (-1, head_dim)).split(
            [heads_q, heads_k, heads_k], dim=2)
        q_BSHD, k_BSKD = qk_norm_rope(q_BSHD, k_BSKD, self.q_norm, self.k_norm, cos, sin, EPS,
                                      unit_offset=True, impl="triton")
        return (q_BSHD.float().square().sum() + (k_BSKD.float() * v_BSKD.float()).sum()) / q_BSHD.numel()


def test_torch_compile_fullgraph_no_graph_breaks_and_matches_eager():
    torch.manual_seed(0)
    model = Prologue(256, 8, 2, 128).cuda().to(torch.bfloat16)
    x = torch.randn(2, 96, 256, device="cuda", dtype=torch.bfloat16)
    *_, cos, sin = make_inputs(2, 96, 1, 1, 128, 128, torch.bfloat16)

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(x, cos, sin)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(model)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(x, cos, sin)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = loss_and_grads(torch.compile(model, fullgraph=True))
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    # The op runs the same kernels either way; only the surrounding matmuls/reductions may be fused
    # differently by inductor, hence bf16-level (not bitwise) agreement.
    for a, b in zip(compiled, eager):
        assert rel_err(a, b) <= 1e-2


def test_opcheck_forward_and_backward_ops():
    q, k, q_w, k_w, cos, sin = make_inputs(2, 33, 4, 2, 128, 64, torch.bfloat16)
    leaves = [leaf(t) for t in (q, k, q_w, k_w)]
    settings = DEFAULT_LAUNCH_SETTINGS.as_list()
    torch.library.opcheck(torch.ops.moert.qk_norm_rope_fwd.default, (*leaves, cos, sin, EPS, True, settings))
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    torch.library.opcheck(torch.ops.moert.qk_norm_rope_bwd.default,
                          (q, k, q_w, k_w, cos, sin, grad_q, grad_k, EPS, True, settings))

"""scattermoe in bf16 vs the eager backend in fp32 at real MoE shapes (norm-relative error <= 1e-2).

Every case with a rank trains the base weights and a LoRA (B non-zero) at once, so one backward checks
dx, the routing-weight gradient, dW, dA and dB; rank-0 cases are a full fine-tune without LoRA (the
bare GEMMs run on torch._grouped_mm). Every shape takes the split-LoRA path; `fused` cases force the
fused one, `empty` cases leave the last experts without rows (their gradients must be zeros). ep > 1 cases
pass valid_slots as MoEBlock does under EP (the expert-sorted buffers hold the valid slots only); `guarded`
cases make those buffers with NaN rows past their end and check that no kernel (TMA, CUTLASS) wrote there.
The autocast case runs the experts as training does on one GPU: fp32 master weights for what trains,
a frozen bf16 base, the fp32 residual stream entering under bf16 autocast.
"""

from __future__ import annotations

import pytest
import torch

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from tests.conftest import nan_slot_buffers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {  # E, H, I, k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "qwen3.5-35b-a3b": (256, 2048, 512, 8),
    "olmoe": (64, 2048, 1024, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
# (shape, tokens, rank, ep, variant): ep > 1 keeps the experts of the first 1/ep and sets the other
# slots to -1; variant "fused" forces the fused-LoRA path, "empty" sends no token to the last 4 experts.
CASES = [
    ("qwen3-30b-a3b", 2048, 16, 1, ""), ("qwen3-30b-a3b", 8192, 64, 1, ""), ("qwen3-30b-a3b", 2048, 16, 4, ""),
    ("qwen3-30b-a3b", 2048, 16, 1, "fused"), ("qwen3-30b-a3b", 2048, 16, 2, "empty"),
    ("qwen3.5-35b-a3b", 2048, 64, 1, ""), ("qwen3.5-35b-a3b", 8192, 16, 1, ""),
    ("qwen3.5-35b-a3b", 2048, 16, 1, "fused"),
    ("olmoe", 2048, 16, 1, ""), ("olmoe", 8192, 64, 2, ""),
    ("mixtral-8x7b", 2048, 16, 1, ""), ("mixtral-8x7b", 2048, 64, 1, ""), ("mixtral-8x7b", 8192, 16, 1, ""),
    ("qwen3-30b-a3b", 8192, 0, 1, ""), ("qwen3-30b-a3b", 2048, 0, 4, ""), ("qwen3.5-35b-a3b", 2048, 0, 2, "empty"),
    ("mixtral-8x7b", 2048, 0, 1, ""), ("qwen3-30b-a3b", 8192, 16, 4, "guarded"),
    ("qwen3-30b-a3b", 8192, 0, 4, "guarded"),
]
TOL = 1e-2


def make_experts(E: int, H: int, I: int, rank: int) -> GroupedExperts:
    ex = GroupedExperts(E, H, I, lora_rank=rank, lora_alpha=2 * rank if rank else None, device="cuda",
                        dtype=torch.bfloat16)
    if rank:
        with torch.no_grad():  # B starts at zero: give the LoRA path (and dA) a real contribution
            ex.gate_up_lora_B.normal_(0, 0.02)
            ex.down_lora_B.normal_(0, 0.02)
    return ex


def make_routing(T: int, E: int, k: int, ep: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    logits = torch.randn(T, E, device="cuda")
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    E_local = E // ep
    ids = torch.where(ids < E_local, ids, -1)  # the slots an EP rank owning experts [0, E/ep) gets
    return ids, w, E_local


def fwd_bwd(ex: GroupedExperts, backend: str, x, ids, w, dy, **kwargs) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    for p in ex.parameters():
        p.grad = None
    y = expert_backend(backend)(x, ids, w, ex, **kwargs)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    out.update({n: p.grad for n, p in ex.named_parameters()})
    return out


@pytest.mark.parametrize("shape,T,rank,ep,variant", CASES,
                         ids=[f"{s}-T{t}-r{r}-ep{e}" + (f"-{v}" if v else "") for s, t, r, e, v in CASES])
def test_bf16_matches_fp32_eager(shape, T, rank, ep, variant, monkeypatch):
    torch.manual_seed(0)
    E, H, I, k = SHAPES[shape]
    if variant == "fused":
        monkeypatch.setattr("moe.backends.scattermoe._SPLIT_MIN_WEIGHT_ELEMS", 1 << 62)
    ids, w, E_local = make_routing(T, E, k, ep)
    if variant == "empty":
        ids = torch.where(ids >= E_local - 4, -1, ids)
    ex = make_experts(E_local, H, I, rank)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    guarded = nan_slot_buffers(monkeypatch, guard_rows=64) if variant == "guarded" else []
    valid = {"valid_slots": int((ids >= 0).sum())} if ep > 1 else {}
    got = {n: t.float() for n, t in fwd_bwd(ex, "scattermoe", x, ids, w, dy, **valid).items()}
    assert guarded or variant != "guarded"
    for capacity, whole in guarded:
        assert capacity == -(-valid["valid_slots"] // 8) * 8, capacity
        assert torch.isnan(whole[capacity:]).all(), "written past the rows"
    ex.float()
    ref = fwd_bwd(ex, "eager", x.float(), ids, w, dy.float())
    errors = {n: ((got[n] - r).norm() / r.norm().clamp_min(1e-30)).item() for n, r in ref.items()}
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= TOL}
    assert not bad, f"norm-relative errors above {TOL}: {bad}"
    if variant == "empty":
        for n in ("gate_up", "down", "gate_up_lora_A", "down_lora_B")[: 4 if rank else 2]:
            assert got[n][-4:].abs().max() == 0, n


def autocast_lora_grads(backend: str, tol: float = 2e-2) -> None:
    """As one-GPU training runs it: fp32 LoRA masters, frozen bf16 base, fp32 x, bf16 autocast. The eager
    backend under the same autocast is the reference; grads reach the fp32 leaves in fp32."""
    torch.manual_seed(0)
    E, H, I, k = SHAPES["qwen3-30b-a3b"]
    ids, w, _ = make_routing(2048, E, k, 1)
    ex = make_experts(E, H, I, 16)
    ex.gate_up.requires_grad_(False)
    ex.down.requires_grad_(False)
    for name in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
        getattr(ex, name).data = getattr(ex, name).data.float()
    x = torch.randn(2048, H, device="cuda")
    dy = torch.randn(2048, H, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = fwd_bwd(ex, backend, x, ids, w, dy)
        ref = fwd_bwd(ex, "eager", x, ids, w, dy)
    assert got["y"].dtype == torch.bfloat16
    for n, r in ref.items():
        if r is None:
            assert got[n] is None, n
            continue
        assert got[n].dtype == r.dtype, n
        err = ((got[n].float() - r.float()).norm() / r.float().norm()).item()
        assert err <= tol, (n, err)


def test_autocast_fp32_master_lora_on_frozen_bf16_base():
    autocast_lora_grads("scattermoe")


def compiled_vs_eager(rank: int, mode: str | None, steps: int) -> tuple[dict, dict]:
    """(y and grads of the backend call under torch.compile(mode, fullgraph=True), those of the eager
    call) at the Qwen3-30B-A3B shape with 50% -1 slots. The compiled call runs `steps` fwd+bwd (under CUDA
    graphs: warmup, capture, then replays); the last one is returned. Dynamo's counters start empty."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    E, H, I, k = SHAPES["qwen3-30b-a3b"]
    ids, w, _ = make_routing(2048, E, k, 2)
    ex = make_experts(E // 2, H, I, rank)
    x = torch.randn(2048, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2048, H, device="cuda", dtype=torch.bfloat16)
    eager = fwd_bwd(ex, "scattermoe", x, ids, w, dy)
    torch._dynamo.reset()
    counters.clear()
    backend = expert_backend("scattermoe")
    compiled = torch.compile(lambda *a: backend(*a), mode=mode, fullgraph=True)
    x_c, w_c = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    for _ in range(steps):
        for p in (*ex.parameters(), x_c, w_c):
            p.grad = None
        y = compiled(x_c, ids, w_c, ex)
        y.backward(dy)
    torch.cuda.synchronize()
    got = {"y": y.detach(), "dx": x_c.grad, "dw": w_c.grad, **{n: p.grad for n, p in ex.named_parameters()}}
    return got, eager


@pytest.mark.parametrize("rank", [0, 16])
def test_compiled_inductor_equals_eager(rank):
    """torch.compile(fullgraph=True, inductor) of the backend call (the moert::scattermoe_* ops): zero
    graph breaks, output and gradients equal to the eager path (bf16, Qwen3-30B-A3B shape)."""
    from torch._dynamo.utils import counters

    got, eager = compiled_vs_eager(rank, None, steps=1)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for n, r in eager.items():
        err = ((got[n].float() - r.float()).norm() / r.float().norm()).item()
        assert err <= 1e-3, (n, err)


@pytest.mark.parametrize("rank", [0, 16])
def test_cuda_graphs_reduce_overhead_equals_eager(rank):
    """torch.compile(mode="reduce-overhead"): inductor captures the layer's forward and backward in CUDA
    graphs (no host sync inside, every size from the shapes) and skips no capture; the replayed step
    gives the eager path's output and gradients bit for bit."""
    from torch._dynamo.utils import counters

    got, eager = compiled_vs_eager(rank, "reduce-overhead", steps=3)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    for n, r in eager.items():
        assert (got[n] is None) == (r is None), n
        if r is not None:
            assert torch.equal(got[n], r), n

"""scattermoe backend vs the eager reference on the CPU (Triton interpreter, fp32, tiny shapes).

Shapes are chosen so that H, I and r are not multiples of the kernel blocks. Every case checks the
output and all gradients (x, routing weights, base weights, LoRA factors) by norm-relative error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Must precede the first triton import (the kernels are decorated for the interpreter at import time);
# only without a GPU, so a GPU session keeps compiled kernels for every other test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from moe.kernels import tuning
from moe.kernels.routing import slot_capacity, sort_slots
from tests.conftest import Ahead, lane_environ, nan_slot_buffers

if not tuning.INTERPRET:
    pytest.skip("interpreter tests (CPU); with a GPU, tests/gpu/test_scattermoe_gpu.py covers the kernels",
                allow_module_level=True)

H, I, R = 40, 24, 4  # not multiples of the interpreter blocks (16/32)
TOL = 1e-5


def make_experts(E: int, rank: int, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    ex = GroupedExperts(E, H, I, lora_rank=rank, lora_alpha=2 * rank if rank else None)
    with torch.no_grad():
        ex.gate_up.normal_(0, 0.2)
        ex.down.normal_(0, 0.2)
        if rank:  # B starts at zero; make the LoRA path (and dA) non-trivial
            ex.gate_up_lora_B.normal_(0, 0.2)
            ex.down_lora_B.normal_(0, 0.2)
    return ex


def routing(M: int, E: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    return ids, torch.rand(M, k, generator=g)


def run(name: str, ex: GroupedExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, **kwargs) -> dict:
    """Output and every gradient that exists, after one backward of <y, dy>."""
    x = x.detach().requires_grad_(x.requires_grad)
    w = w.detach().requires_grad_(True)
    for p in ex.parameters():
        p.grad = None
    y = expert_backend(name)(x, ids, w, ex, **kwargs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * dy).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    out.update({n: p.grad for n, p in ex.named_parameters()})
    return out


def assert_matches_eager(ex, x, ids, w, **kwargs):
    got, ref = run("scattermoe", ex, x, ids, w, **kwargs), run("eager", ex, x, ids, w)
    for name, r in ref.items():
        g = got[name]
        if r is None:
            assert g is None, name
            continue
        err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err <= TOL, f"{name}: norm-relative error {err:.2e}"
    return got


@pytest.mark.parametrize("E,k,rank,split",
                         [(4, 1, R, False), (8, 2, R, False), (8, 2, R, True), (4, 2, 0, False)],
                         ids=["E4-k1-lora", "E8-k2-lora", "E8-k2-lora-split", "E4-k2-full"])
def test_matches_eager(E, k, rank, split, monkeypatch):
    if split:  # force the large-experts (split-LoRA) path at tiny shapes
        monkeypatch.setattr("moe.backends.scattermoe._SPLIT_MIN_WEIGHT_ELEMS", 0)
    ex = make_experts(E, rank)
    M = 13
    ids, w = routing(M, E, k)
    ids[2] = -1            # a row whose slots are all -1
    ids[5, 0] = -1         # a partially routed row
    ids[ids == E - 1] = 0  # the last expert receives no tokens
    x = torch.randn(M, H, requires_grad=True)
    got = assert_matches_eager(ex, x, ids, w)
    assert got["y"][2].abs().max() == 0 and got["dx"][2].abs().max() == 0
    assert got["dw"][2].abs().max() == 0 and got["dw"][5, 0] == 0
    assert got["gate_up"][E - 1].abs().max() == 0


def test_all_tokens_to_one_expert():
    E, M = 4, 24
    ex = make_experts(E, R)
    ids = torch.full((M, 2), -1)
    ids[:, 0] = 3
    x = torch.randn(M, H, requires_grad=True)
    got = assert_matches_eager(ex, x, ids, torch.rand(M, 2))
    assert got["down"][:3].abs().max() == 0 and got["down_lora_A"][:3].abs().max() == 0


def test_frozen_base_and_input():
    """LoRA on a frozen base: no base-weight gradients, and x without grad takes the rank-only path."""
    E, M = 4, 11
    ex = make_experts(E, R)
    ex.gate_up.requires_grad_(False)
    ex.down.requires_grad_(False)
    ids, w = routing(M, E, 2)
    got = assert_matches_eager(ex, torch.randn(M, H), ids, w)
    assert got["gate_up"] is None and got["dx"] is None and got["gate_up_lora_A"] is not None


def test_every_slot_invalid():
    ex = make_experts(4, R)
    M = 5
    x = torch.randn(M, H, requires_grad=True)
    got = run("scattermoe", ex, x, torch.full((M, 2), -1), torch.rand(M, 2))
    for name, g in got.items():
        assert g.abs().max() == 0, name


def test_no_rows():
    """An EP rank can receive no tokens at all: empty output, zero weight gradients."""
    ex = make_experts(4, R)
    got = run("scattermoe", ex, torch.randn(0, H, requires_grad=True), torch.empty(0, 2, dtype=torch.long),
              torch.rand(0, 2))
    assert got["y"].shape == (0, H) and got["gate_up"].abs().max() == 0 and got["down_lora_B"].abs().max() == 0


# ----------------------------------------------------------------------------- buffers sized by valid_slots


def ep_routing(M: int, k: int, owned: range, num_experts: int = 16, seed: int = 3):
    """Routing as one EP rank receives it: the local ids of the experts in `owned`, -1 for the others' slots."""
    ids, w = routing(M, num_experts, k, seed)
    return torch.where((ids >= owned.start) & (ids < owned.stop), ids - owned.start, -1), w


@pytest.fixture
def guarded_rows(monkeypatch):
    """Expert-sorted buffers all NaN, with 3 NaN guard rows past their end (tests.conftest.nan_slot_buffers)."""
    return nan_slot_buffers(monkeypatch, guard_rows=3)


@pytest.mark.parametrize("rank,split", [(0, False), (R, False), (R, True)], ids=["full", "lora-fused", "lora-split"])
def test_valid_slots_sizes_the_sorted_buffers(rank, split, monkeypatch, guarded_rows):
    """EP's layout (rank 1 of ep=4: most slots -1). With valid_slots every expert-sorted buffer has that many
    rows rounded up to 16, not M*k; no kernel touches a row past them, nor reads a row it did not write (all
    NaN here); output and every gradient equal eager's. (Without valid_slots, buffers of M*k rows with the
    -1 positions' rows unwritten: test_matches_eager.)"""
    if rank:
        monkeypatch.setattr("moe.backends.scattermoe._SPLIT_MIN_WEIGHT_ELEMS", 0 if split else 10**9)
    M, k = 11, 4
    ex = make_experts(4, rank)
    ids, w = ep_routing(M, k, range(4, 8))
    ids[3] = -1  # a row none of whose experts is here
    valid = int((ids >= 0).sum())
    assert 0 < valid < ids.numel() // 2
    got = assert_matches_eager(ex, torch.randn(M, H, requires_grad=True), ids, w, valid_slots=valid)
    assert got["y"][3].abs().max() == 0 and got["dw"][3].abs().max() == 0
    assert valid % 16 and guarded_rows  # rows past the valid ones inside the buffer too
    assert {capacity for capacity, _ in guarded_rows} == {-(-valid // 16) * 16}
    for capacity, whole in guarded_rows:
        assert torch.isnan(whole[capacity:]).all(), "a kernel wrote past the buffer's rows"


def dropped_past(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """ids with -1 at the valid slots a bound of `rows` drops: those sorted past it, by (expert, slot)."""
    flat = ids.flatten()
    valid = (flat >= 0).nonzero().squeeze(1)
    order = valid[torch.argsort(flat[valid] * flat.numel() + valid)]  # expert-major, slot order within
    kept = flat.clone()
    kept[order[rows:]] = -1
    return kept.view_as(ids)


@pytest.mark.parametrize("rows,rank", [(200, R), (40, R), (40, 0), (1, R)],
                         ids=["fits-lora", "drops-lora", "drops-full", "drops-all-but-16"])
def test_a_bound_sizes_the_buffers_and_drops_what_is_past_it(rows, rank, guarded_rows):
    """A SlotCapacity bound (the all_gather dispatcher's, where the valid count is on the device only): every
    expert-sorted buffer has its rows (rounded up to 16, at most M*k) and no kernel writes past them; the valid
    slots sorted past it are dropped and counted, and everything else equals eager's on the routing with those
    slots removed (-1): outputs, every gradient, zero routing-weight gradient at the dropped slots."""
    from moe.capacity import SlotCapacity

    M, k = 23, 4
    ex = make_experts(4, rank)
    ids, w = ep_routing(M, k, range(4, 8), num_experts=8)  # about half the slots valid
    valid = int((ids >= 0).sum())
    capacity = min(-(-rows // 16) * 16, ids.numel())
    bound = SlotCapacity(rows, torch.zeros((), dtype=torch.int64))
    x = torch.randn(M, H, requires_grad=True)
    got = run("scattermoe", ex, x, ids, w, bound=bound)
    assert int(bound.dropped) == max(0, valid - capacity)
    kept = dropped_past(ids, capacity)
    ref = run("eager", ex, x, kept, w)
    for name, r in ref.items():
        if r is not None:
            assert ((got[name] - r).norm() / r.norm().clamp_min(1e-30)).item() <= TOL, name
    assert (got["dw"][(ids >= 0) & (kept < 0)] == 0).all()
    assert {c for c, _ in guarded_rows} == {capacity}
    for c, whole in guarded_rows:
        assert torch.isnan(whole[c:]).all(), "a kernel wrote past the buffer's rows"


def test_valid_slots_zero_and_out_of_range():
    """A rank whose rows hold no slot of its experts: zeros (a buffer of one row); rows are rounded up to 16 but
    never past M*k; a wrong count is refused."""
    ex = make_experts(4, R)
    M = 5
    got = run("scattermoe", ex, torch.randn(M, H, requires_grad=True), torch.full((M, 2), -1), torch.rand(M, 2),
              valid_slots=0)
    for name, g in got.items():
        assert g.abs().max() == 0, name
    assert sort_slots(torch.full((M, 2), -1), 4, valid_slots=0).capacity == 1
    assert (slot_capacity(64, 17), slot_capacity(10, 9), slot_capacity(0, 0)) == (32, 10, 0)
    with pytest.raises(ValueError, match="valid_slots=11 outside"):
        sort_slots(torch.zeros(M, 2, dtype=torch.long), 4, valid_slots=11)


def test_zero_scaling_equals_base():
    E, M = 4, 9
    ex, base = make_experts(E, R), make_experts(E, 0)
    with torch.no_grad():
        base.gate_up.copy_(ex.gate_up)
        base.down.copy_(ex.down)
    ex.lora_scaling = 0.0
    ids, w = routing(M, E, 2)
    x = torch.randn(M, H, requires_grad=True)
    got, ref = run("scattermoe", ex, x, ids, w), run("scattermoe", base, x, ids, w)
    for name in ("y", "dx", "dw", "gate_up", "down"):
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)


def test_lora_dropout_in_training_raises():
    ex = GroupedExperts(4, H, I, lora_rank=R, lora_dropout=0.1)
    ids, w = routing(3, 4, 2)
    with pytest.raises(NotImplementedError, match="lora_dropout"):
        expert_backend("scattermoe")(torch.randn(3, H), ids, w, ex)


def test_sort_slots_layout():
    ids = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])
    s = sort_slots(ids, num_experts=4)
    assert s.offsets_E1.tolist() == [0, 2, 3, 5, 5]
    assert s.order_S[:5].tolist() == [2, 7, 6, 0, 3]  # by expert, token order within an expert
    assert torch.equal(s.order_S[s.inv_S.long()], torch.arange(8, dtype=torch.int32))


@pytest.mark.parametrize("rank,split", [(4, True), (20, True), (4, False)],
                         ids=["rank4-split", "rank20-split", "rank4-fused"])  # 20: not a multiple of the rank block
def test_gathered_lora_product_through_transposed_views(rank, split):
    """The backward's g = dy[token] W_down_e + s (dy[token] B_down_e) A_down_e: rows gathered in-kernel,
    the weight and both LoRA factors read through the transposed views the backward passes, and the
    rank-sized dy B_down returned (it feeds dA_down); against torch per slot."""
    from moe.kernels.grouped_linear import LoraView, expert_linear
    E, M, s = 4, 11, 0.5
    ids, _ = routing(M, E, 2)
    ids[3] = -1
    slots = sort_slots(ids, E)
    dy = torch.randn(M, H)
    w_down, B_down, A_down = torch.randn(E, H, I), torch.randn(E, H, rank), torch.randn(E, rank, I)
    lora = LoraView(B_down.transpose(1, 2), A_down.transpose(1, 2), s, split)
    g, dyb = expert_linear(dy, slots, w_down.transpose(1, 2), lora, gather=True)
    n = int(slots.offsets_E1[-1])
    rows, e = slots.rows_S[:n].long(), ids.reshape(-1)[slots.order_S[:n].long()]
    ref_dyb = torch.einsum("ph,phr->pr", dy[rows], B_down[e])
    ref_g = torch.einsum("ph,phi->pi", dy[rows], w_down[e]) + s * torch.einsum("pr,pri->pi", ref_dyb, A_down[e])
    torch.testing.assert_close(dyb[:n], ref_dyb, rtol=1e-5, atol=1e-5)  # rows behind the valid slots: unspecified
    torch.testing.assert_close(g[:n], ref_g, rtol=1e-5, atol=1e-4)


def test_frozen_base_without_lora():
    """A frozen base and no LoRA (only dx and the routing-weight gradient): g from the gathered dy."""
    E, M = 4, 11
    ex = make_experts(E, 0)
    ex.gate_up.requires_grad_(False)
    ex.down.requires_grad_(False)
    ids, w = routing(M, E, 2)
    ids[4, 1] = -1
    got = assert_matches_eager(ex, torch.randn(M, H, requires_grad=True), ids, w)
    assert got["gate_up"] is None and got["dx"] is not None


@pytest.mark.parametrize("K", [36, 37], ids=["rows-16B-aligned(TMA)", "rows-unaligned(pointers)"])
@pytest.mark.parametrize("transposed", [False, True], ids=["W", "W^T view"])
def test_expert_gemm_tma_and_pointer_paths(K, transposed):
    """The bare grouped GEMM reads its operands by tensor descriptors where rows and strides are 16-byte
    aligned, else by pointers; both against a per-slot torch product, with an empty expert."""
    from moe.kernels.grouped_linear import _tma_ok, expert_gemm
    E, M, N = 4, 13, 40
    ids, _ = routing(M, E, 2)
    ids[ids == E - 1] = 0
    slots = sort_slots(ids, E)
    in_SK = torch.randn(M * 2, K)
    W = torch.randn(E, K, N).transpose(1, 2) if transposed else torch.randn(E, N, K)
    assert _tma_ok(in_SK, W) == (K == 36)
    out = expert_gemm(in_SK, slots, W)
    n = int(slots.offsets_E1[-1])
    experts = ids.reshape(-1)[slots.order_S[:n].long()]
    torch.testing.assert_close(out[:n], torch.einsum("pk,pnk->pn", in_SK[:n], W[experts]), rtol=1e-5, atol=1e-5)


def test_swiglu_backward_pass(monkeypatch):
    """The row-block pass against torch math: d(gate, up), the routing-weight gradient per slot and
    d gate_up @ B_gu. Its buffers start as NaN, so a -1 slot's dw must be written (zero) and no -1 row
    may leak into a valid one."""
    from moe.kernels import grouped_linear as gl
    E, M, k, r = 4, 13, 2, 4
    ids, w = routing(M, E, k)
    ids[2], ids[5, 0] = -1, -1
    slots = sort_slots(ids, E)
    S, n = M * k, int(slots.offsets_E1[-1])
    g, gu = torch.randn(S, I), torch.randn(S, 2 * I)
    gu_B = torch.randn(E, 2 * I, r)
    g[n:], gu[n:] = float("nan"), float("nan")  # rows of -1 positions are never written upstream
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))  # dw
    nan_slot_buffers(monkeypatch)  # dgu, dgub
    dgu, dgub, dw = gl.swiglu_backward(g, slots, gu, w, gu_B)
    monkeypatch.setattr(torch, "empty", real_empty)

    pos = slots.order_S[:n].long()
    e = ids.reshape(-1)[pos]
    g = g[:n]
    gate, up = gu[:n, :I], gu[:n, I:]
    silu = torch.nn.functional.silu(gate)
    dh = g * w.reshape(-1)[pos, None]
    ref_dgu = torch.cat([dh * up * torch.sigmoid(gate) * (1 + gate * (1 - torch.sigmoid(gate))), dh * silu], 1)
    ref_dw = torch.zeros(S).index_put_((pos,), (g * silu * up).sum(1))
    torch.testing.assert_close(dgu[:n], ref_dgu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw.reshape(-1), ref_dw, rtol=1e-4, atol=1e-4)
    assert (dw.reshape(-1)[ids.reshape(-1) < 0] == 0).all()
    torch.testing.assert_close(dgub[:n], torch.einsum("pj,pjr->pr", ref_dgu, gu_B[e]), rtol=1e-4, atol=1e-4)


# CI time: the importing Python runs beside the in-process tests.
IMPORT_WITHOUT_INTERPRETER = Ahead(lambda tmp: subprocess.run(
    [sys.executable, "-c", "import moe.backends.scattermoe"], capture_output=True, text=True, check=False,
    env={k: v for k, v in lane_environ().items() if k != "TRITON_INTERPRET"},
    cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


@pytest.mark.ahead(IMPORT_WITHOUT_INTERPRETER)
def test_import_without_interpreter():
    done = IMPORT_WITHOUT_INTERPRETER.result()
    assert done.returncode == 0, done.stderr[-3000:]


# ----------------------------------------------------------------------------- torch.compile (opaque ops)


def test_compiled_backend_equals_eager_without_graph_breaks():
    """Under torch.compile(fullgraph=True) the backend runs as the moert::scattermoe_* custom ops: no
    graph break, and the same output and gradients as the eager autograd path (the same kernels). A full
    fine-tune with a bound that drops slots (the sort op's counter is its declared mutation, counted the same);
    LoRA (rank 4) under fullgraph compile, buffers of valid_slots rows:
    test_compiled_backend_takes_valid_slots_that_change_per_call (CI time: rank 4 here was one more compile)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from moe.capacity import SlotCapacity

    ex = make_experts(8, 0)
    ids, w = routing(12, 8, 2)
    ids[1, 0] = -1  # a sentinel slot, as EP produces
    x = torch.randn(12, H, requires_grad=True)
    eager_bound = SlotCapacity(16, torch.zeros((), dtype=torch.int64))
    eager = run("scattermoe", ex, x, ids, w, bound=eager_bound)
    assert int(eager_bound.dropped) == 23 - 16
    torch._dynamo.reset()
    counters.clear()
    backend = expert_backend("scattermoe")
    compiled = torch.compile(lambda *a, **kw: backend(*a, **kw), backend="aot_eager", fullgraph=True)
    x_c = x.detach().clone().requires_grad_(True)
    w_c = w.clone().requires_grad_(True)
    for p in ex.parameters():
        p.grad = None
    bound = SlotCapacity(16, torch.zeros((), dtype=torch.int64))
    y = compiled(x_c, ids, w_c, ex, bound=bound)
    assert int(bound.dropped) == int(eager_bound.dropped)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * dy).sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    got = {"y": y.detach(), "dx": x_c.grad, "dw": w_c.grad, **{n: p.grad for n, p in ex.named_parameters()}}
    for name, ref in eager.items():
        if ref is None:
            assert got[name] is None, name
            continue
        assert torch.allclose(got[name], ref, rtol=1e-5, atol=1e-6), name


def test_compiled_backend_takes_valid_slots_that_change_per_call(guarded_rows):
    """The compiled ops take the buffers' row count as an argument: two EP routings of other M and valid-slot
    counts through one compiled function give eager's output and gradients, buffers of valid_slots rows."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    ex = make_experts(4, R)
    torch._dynamo.reset()
    counters.clear()
    backend = expert_backend("scattermoe")
    compiled = torch.compile(lambda *a, **kw: backend(*a, **kw), backend="aot_eager", fullgraph=True)
    for M, seed in ((9, 3), (14, 5)):
        ids, w = ep_routing(M, 4, range(4, 8), seed=seed)
        valid = int((ids >= 0).sum())
        x = torch.randn(M, H, requires_grad=True)
        ref = run("eager", ex, x, ids, w)
        for p in ex.parameters():
            p.grad = None
        guarded_rows.clear()
        x_c, w_c = x.detach().clone().requires_grad_(True), w.clone().requires_grad_(True)
        torch._dynamo.maybe_mark_dynamic(x_c, 0)
        y = compiled(x_c, ids, w_c, ex, valid_slots=valid)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
        got = {"y": y.detach(), "dx": x_c.grad, "dw": w_c.grad, **{n: p.grad for n, p in ex.named_parameters()}}
        for name, want in ref.items():
            err = ((got[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
            assert err <= TOL, f"M={M} {name}: {err:.2e}"
        assert {capacity for capacity, _ in guarded_rows} == {-(-valid // 8) * 8}
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementations, autograd registration and AOT dispatch of the ops."""
    import moe.backends.scattermoe  # noqa: F401  (registers the ops)
    from moe.kernels.routing import sort_slots

    ex = make_experts(4, 4)
    ids, w = routing(5, 4, 2)
    x = torch.randn(5, H, requires_grad=True)
    w.requires_grad_(True)
    torch.library.opcheck(torch.ops.moert.scattermoe_sort.default, (ids, 4, ids.numel(), None))
    # with a bound: 16 rows of 10 valid slots keep them all; the counter is the op's declared mutation
    torch.library.opcheck(torch.ops.moert.scattermoe_sort.default, (ids, 4, 16, torch.zeros((), dtype=torch.int64)))
    slots = sort_slots(ids, 4)
    params = (ex.gate_up, ex.down, *ex.lora("gate_up"), *ex.lora("down"), None, None, None, None)  # dense: no scales
    tail = (ids, slots.order_S, slots.inv_S, slots.offsets_E1, slots.rows_S, slots.capacity, ex.lora_scaling, "")
    torch.library.opcheck(torch.ops.moert.scattermoe_fwd.default, (x, w, *params, *tail))


def test_compiled_moe_model_blocks_with_scattermoe(tmp_path):
    """apply_compile on a Qwen3-MoE model whose experts run on scattermoe (LoRA on): fullgraph blocks,
    zero graph breaks, loss and grads equal to the eager model (fp32, the interpreted kernels)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from runtime.config import LoraConfig
    from runtime.distributed.compile import apply_compile
    from runtime.lora import apply_lora
    from runtime.models import from_pretrained
    from tests.conftest import label_loss_sum, write_hf_checkpoint

    write_hf_checkpoint(tmp_path, "moe", num_hidden_layers=1)  # one block: every block compiles alike (CI time)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 320, (1, 16), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    labels = torch.randint(0, 320, (1, 16), generator=g)
    results = []
    for compiled in (False, True):
        model = from_pretrained(tmp_path, expert_backend="scattermoe", norm_rope_impl="torch",
                                router_aux_loss_coef=0.01)
        torch.manual_seed(0)  # LoRA A's random init: the same in both models
        apply_lora(model, LoraConfig(enabled=True, rank=4, target_modules=["q_proj", "experts"]))
        for name, p in model.named_parameters():  # LoRA B starts at zero: make every path matter
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {}, backend="aot_eager")
        loss = label_loss_sum(model(ids, position_ids=pos), labels) / labels.numel()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert not counters["graph_break"], dict(counters["graph_break"])
    (eager_loss, eager_grads), (comp_loss, comp_grads) = results
    assert torch.allclose(eager_loss, comp_loss, rtol=1e-5)
    assert eager_grads.keys() == comp_grads.keys() and any("experts" in n for n in eager_grads)
    for name, grad in eager_grads.items():
        err = (grad - comp_grads[name]).norm() / grad.norm().clamp_min(1e-12)
        assert err <= 1e-4, f"{name}: {err:.2e}"


def test_auto_backend_is_scattermoe_on_cuda_only():
    import importlib.util

    from runtime.choices import Needs, choose

    assert choose("model.expert_backend", "auto", Needs("cpu"))[0] == "grouped_mm"
    assert choose("model.expert_backend", "eager", Needs("cuda"))[0] == "eager"
    expected = "scattermoe" if importlib.util.find_spec("triton") else "grouped_mm"
    assert choose("model.expert_backend", "auto", Needs("cuda"))[0] == expected


def test_m_bucket_centres_powers_of_two():
    """Rows near a power of two share its bucket on both sides (balanced routing's T x k varies around one
    under EP); the buckets change at 2^(n + 1/2)."""
    from moe.kernels.tuning import m_bucket

    assert m_bucket(65536) == m_bucket(65536 + 4096) == m_bucket(65536 - 4096) == 65536
    assert m_bucket(92681) == 65536 and m_bucket(92682) == 131072  # 2^16.5 = 92681.9
    assert m_bucket(1) == 16 and m_bucket(0) == 16

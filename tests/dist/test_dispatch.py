"""Dispatchers: LocalDispatcher units, and AllToAllDispatcher against one process with every expert.

Shapes: N tokens of the global batch, T tokens of one rank, H hidden, I intermediate, E experts,
k top-k, M rows a rank computes. Each case builds the same global batch (x_NH, topk_ids_Nk,
topk_w_Nk) on every rank from a seed; rank r takes its slice of the tokens, and its experts are
rows [r*E/ep, (r+1)*E/ep) of the full expert weights. The reference is one process running
LocalDispatcher + the same backend over the whole batch with all E experts: outputs and gradients
(x, topk_w, expert weights) must match it. One process group per world size runs every case,
because starting the processes and the group costs more than the cases themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from moe.backends import expert_backend
from moe.dispatch import AllToAllDispatcher, LocalDispatcher, build_dispatcher
from moe.experts import GroupedExperts

H, I, E = 8, 4, 8  # 16-byte aligned fp32 rows, so grouped_mm runs torch._grouped_mm on the CPU
TOL = 1e-5  # fp32, norm-relative
CPU_BACKENDS = ["eager", "grouped_mm"]  # the expert backends that run on a CPU


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()
    assert err <= TOL, f"{what}: norm-relative error {err:.2e} > {TOL:.0e}"


def identity_backend(x_MH, expert_ids_Mk, weights_Mk, experts, valid_slots=None):
    """Every expert is the identity: y = x * (sum of the valid slots' weights)."""
    valid_w_Mk = torch.where(expert_ids_Mk >= 0, weights_Mk, torch.zeros_like(weights_Mk))
    return valid_w_Mk.sum(-1, keepdim=True) * x_MH


# ---------------------------------------------------------------------------- routing cases

def _pick(pool: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct expert ids drawn from `pool`, like one token's top-k."""
    return pool[torch.randperm(len(pool), generator=gen)[:k]]


@dataclass
class Case:
    name: str
    tokens_per_rank: Callable[[int], list[int]]                 # ep -> T of each rank
    route: Callable[[int, int, torch.Generator], torch.Tensor]  # (source rank, ep, gen) -> one token's ids
    k: int


def _random(src, ep, gen):
    return _pick(torch.arange(E), 3, gen)


def _one_rank(src, ep, gen):
    owner = torch.randint(ep, (1,), generator=gen).item()
    return _pick(torch.arange(E).chunk(ep)[owner], 2, gen)


def _never_last_rank(src, ep, gen):
    return _pick(torch.arange(E - E // ep), 2, gen)


def _next_rank(src, ep, gen):
    return _pick(torch.arange(E).chunk(ep)[(src + 1) % ep], 2, gen)


def _top1(src, ep, gen):
    return _pick(torch.arange(E), 1, gen)


def _skewed(src, ep, gen):
    # Almost every token goes to experts 0 and 1 (both on rank 0); one in eight goes anywhere.
    if torch.rand((), generator=gen) < 0.125:
        return _pick(torch.arange(E), 2, gen)
    return torch.tensor([0, 1])


CASES = [
    Case("random top-3", lambda ep: [5, 7, 4, 6][:ep], _random, 3),
    Case("all experts of a token on one rank", lambda ep: [6, 5, 7, 4][:ep], _one_rank, 2),
    # rank 1 sends nothing and the last rank receives nothing
    Case("idle ranks", lambda ep: [6, 0, 5, 4][:ep], _never_last_rank, 2),
    Case("every slot on the next rank", lambda ep: [4, 6, 5, 3][:ep], _next_rank, 2),
    Case("top-1", lambda ep: [7, 5, 6, 4][:ep], _top1, 1),
    Case("skewed load", lambda ep: [16, 12, 14, 10][:ep], _skewed, 2),
]


@dataclass
class Batch:
    x_NH: torch.Tensor
    topk_ids_Nk: torch.Tensor
    topk_w_Nk: torch.Tensor
    grad_out_NH: torch.Tensor  # the loss is sum((x + out) * grad_out)
    starts: list[int]          # first global token of each rank (plus N at the end)


def make_batch(case: Case, ep: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    counts = case.tokens_per_rank(ep)
    ids = [case.route(src, ep, gen) for src, T in enumerate(counts) for _ in range(T)]
    N = len(ids)
    starts = [sum(counts[:r]) for r in range(ep + 1)]
    return Batch(torch.randn(N, H, generator=gen), torch.stack(ids).reshape(N, case.k),
                 torch.rand(N, case.k, generator=gen) + 0.1, torch.randn(N, H, generator=gen), starts)


def full_experts(seed: int) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(E, H, I)
    with torch.no_grad():  # unit-variance outputs, so the expert path is not lost next to the residual
        experts.gate_up.normal_(std=H ** -0.5)
        experts.down.normal_(std=I ** -0.5)
    return experts


def rank_experts(full: GroupedExperts, rank: int, ep: int) -> GroupedExperts:
    E_local = E // ep
    experts = GroupedExperts(E_local, H, I, expert_offset=rank * E_local)
    with torch.no_grad():
        experts.gate_up.copy_(full.gate_up[rank * E_local:(rank + 1) * E_local])
        experts.down.copy_(full.down[rank * E_local:(rank + 1) * E_local])
    return experts


# ---------------------------------------------------------------------------- one forward + backward

@dataclass
class Result:
    out_TH: torch.Tensor
    grad_x_TH: torch.Tensor
    grad_w_Tk: torch.Tensor
    grad_experts: dict[str, torch.Tensor]


def run_moe(dispatcher, backend, experts, x_TH, topk_ids_Tk, topk_w_Tk, grad_out_TH) -> Result:
    if experts is not None:
        experts.zero_grad()  # the reference experts serve several backends
    x_TH = x_TH.clone().requires_grad_()
    topk_w_Tk = topk_w_Tk.clone().requires_grad_()
    routed = dispatcher.dispatch(x_TH, topk_ids_Tk, topk_w_Tk)
    y_MH = backend(routed.x_MH, routed.expert_ids_Mk, routed.weights_Mk, experts, valid_slots=routed.valid_slots)
    out_TH = dispatcher.combine(y_MH, routed)
    # The residual x + moe(x) keeps every rank's loss differentiable, even a rank whose MoE output has
    # no history (it computed no rows): that rank must still join the backward collectives.
    ((x_TH + out_TH) * grad_out_TH).sum().backward()
    grads = {} if experts is None else {
        name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in experts.named_parameters()}
    return Result(out_TH.detach(), x_TH.grad, topk_w_Tk.grad, grads)


def check_routed_layout(routed, batch: Batch, rank: int, ep: int) -> None:
    """Rows arrive once per (token, rank), grouped by source rank, each source in token order."""
    E_local = E // ep
    owned_Nk = batch.topk_ids_Nk // E_local == rank
    rows_M = owned_Nk.any(-1).nonzero().squeeze(-1)
    assert routed.recv_splits == [int(owned_Nk[batch.starts[s]:batch.starts[s + 1]].any(-1).sum())
                                  for s in range(ep)]
    assert torch.equal(routed.x_MH, batch.x_NH[rows_M])
    assert routed.weights_Mk.dtype == torch.float64  # as given, not x's dtype
    assert torch.equal(routed.weights_Mk, batch.topk_w_Nk[rows_M].double())
    local_ids_Nk = torch.where(owned_Nk, batch.topk_ids_Nk - rank * E_local, -1)
    assert torch.equal(routed.expert_ids_Mk, local_ids_Nk[rows_M])
    # exact (backends size buffers by it): the slots of this rank's experts over every source's tokens
    assert routed.valid_slots == int(owned_Nk.sum())


def check_case(case: Case, rank: int, ep: int, seed: int) -> list[int]:
    """Layout, outputs and gradients of one case on this rank; returns the rows received per source."""
    batch = make_batch(case, ep, seed)
    mine = slice(batch.starts[rank], batch.starts[rank + 1])
    dispatcher = AllToAllDispatcher(dist.group.WORLD, E)
    with torch.no_grad():
        routed = dispatcher.dispatch(batch.x_NH[mine], batch.topk_ids_Nk[mine],
                                     batch.topk_w_Nk[mine].double())
    check_routed_layout(routed, batch, rank, ep)
    check_against_single_process(dispatcher, case, batch, rank, ep, seed)
    check_load_log(dispatcher, batch, ep)
    return routed.recv_splits


def check_against_single_process(dispatcher, case: Case, batch: Batch, rank: int, ep: int, seed: int) -> None:
    """This rank's outputs and gradients through `dispatcher`, for every CPU backend and the identity, against
    one process with every expert (LocalDispatcher over the whole batch)."""
    mine = slice(batch.starts[rank], batch.starts[rank + 1])
    experts_of_rank = slice(rank * (E // ep), (rank + 1) * (E // ep))
    full = full_experts(seed)
    data = (batch.x_NH, batch.topk_ids_Nk, batch.topk_w_Nk, batch.grad_out_NH)
    for backend_name, backend, experts, ref_experts in [
            ("identity", identity_backend, None, None),
            *((name, expert_backend(name), rank_experts(full, rank, ep), full) for name in CPU_BACKENDS)]:
        what = f"{case.name}, ep={ep}, rank {rank}, {backend_name}"
        ref = run_moe(LocalDispatcher(), backend, ref_experts, *data)
        got = run_moe(dispatcher, backend, experts, *(t[mine] for t in data))
        assert_close(got.out_TH, ref.out_TH[mine], f"{what}: out")
        assert_close(got.grad_x_TH, ref.grad_x_TH[mine], f"{what}: grad x")
        assert_close(got.grad_w_Tk, ref.grad_w_Tk[mine], f"{what}: grad topk_w")
        for name, grad in got.grad_experts.items():
            assert_close(grad, ref.grad_experts[name][experts_of_rank], f"{what}: grad {name}")
        if backend is identity_backend:  # the round trip itself: x * sum of the token's weights
            x_TH, w_Tk = batch.x_NH[mine], batch.topk_w_Nk[mine]
            assert_close(got.out_TH, x_TH * w_Tk.sum(-1, keepdim=True), f"{what}: round trip")


def check_load_log(dispatcher: AllToAllDispatcher, batch: Batch, ep: int) -> None:
    """The load log saw this case's training dispatches (the no-grad one above is not logged), all with the
    same counts: its reading is their busiest rank's slots over the mean, from the routing itself; a read empties it."""
    slots_R = [int((batch.topk_ids_Nk // (E // ep) == r).sum()) for r in range(ep)]
    expected = max(slots_R) * ep / sum(slots_R) if sum(slots_R) else 1.0
    reading = dispatcher.load_reading(torch.device("cpu"))
    assert reading.imbalance == pytest.approx(expected, rel=1e-12)
    assert dispatcher.load_reading(torch.device("cpu")) is None


def check_host_skew(rank: int, ep: int, lag_s: float = 0.2, dispatches: int = 3) -> None:
    """The last rank's host reaches each exchange `lag_s` after the others: the reading names it as the
    slowest host on every rank and its skew is about dispatches * lag_s (the others waited that long), while
    the routing imbalance stays what the routing says (every rank sends each rank one slot per token)."""
    dispatcher = AllToAllDispatcher(dist.group.WORLD, E)
    x_TH, w_Tk = torch.randn(4, H, requires_grad=True), torch.rand(4, ep)
    ids_Tk = (torch.arange(ep) * (E // ep)).expand(4, ep)
    for _ in range(dispatches):
        if rank == ep - 1:
            time.sleep(lag_s)
        dispatcher.dispatch(x_TH, ids_Tk, w_Tk)
    reading = dispatcher.load_reading(torch.device("cpu"))
    assert reading.slowest_host == ep - 1, reading
    assert 0.7 * dispatches * lag_s < reading.host_skew_s < dispatches * lag_s + 2.0, reading  # a busy CI host
    assert reading.imbalance == pytest.approx(1.0)


def check_exchange_keeps_indices_only(ep: int) -> None:
    """Dispatch and combine keep integer indices for backward, never rows: the received rows a backend keeps
    are its own business, and the exchange adding a row buffer per layer costs 121 MB per layer at
    Qwen3-30B-A3B dims and ep 4 (the combine's index_add kept its [S, H] source before)."""
    batch = make_batch(CASES[0], ep, seed=7)
    mine = slice(batch.starts[dist.get_rank()], batch.starts[dist.get_rank() + 1])
    x_TH = batch.x_NH[mine].clone().requires_grad_()
    w_Tk = batch.topk_w_Nk[mine].clone().requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        dispatcher = AllToAllDispatcher(dist.group.WORLD, E)
        routed = dispatcher.dispatch(x_TH, batch.topk_ids_Nk[mine], w_Tk)
        out_TH = dispatcher.combine(routed.x_MH * 2.0, routed)  # a scalar product keeps nothing
    assert kept and all(not t.is_floating_point() for t in kept), [(tuple(t.shape), t.dtype) for t in kept]
    out_TH.sum().backward()
    assert x_TH.grad is not None


def check_all(rank: int, ep: int) -> dict[str, list[int]]:
    check_exchange_keeps_indices_only(ep)
    check_host_skew(rank, ep)
    if rank == 0:  # alone: a collective before the check would hang the group
        with pytest.raises(ValueError, match=f"num_experts={E - 1}.*size {ep}"):
            AllToAllDispatcher(dist.group.WORLD, E - 1)
    assert isinstance(build_dispatcher("all_to_all", dist.group.WORLD, E), AllToAllDispatcher)
    singleton = dist.new_group([0])  # every rank must take part in creating it
    if rank == 0:
        assert isinstance(build_dispatcher("all_to_all", singleton, E), LocalDispatcher)
    return {case.name: check_case(case, rank, ep, seed) for seed, case in enumerate(CASES)}


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_matches_single_process(run_dist, world_size):
    recv_splits = run_dist(check_all, world_size)  # [rank][case name] -> rows from each source rank
    # The edge cases are what their names say.
    idle = [splits["idle ranks"] for splits in recv_splits]
    assert sum(idle[-1]) == 0 and all(splits[1] == 0 for splits in idle)
    for rank, splits in enumerate(recv_splits):
        sources = [s for s, n in enumerate(splits["every slot on the next rank"]) if n > 0]
        assert sources == [(rank - 1) % world_size]


# ---------------------------------------------------------------------------- local (ep=1)

def test_local_dispatcher_is_identity():
    x_TH, w_Tk = torch.randn(5, H), torch.rand(5, 2)
    ids_Tk = torch.tensor([[0, 3], [1, 2], [7, 0], [4, 5], [6, 1]])
    assert isinstance(build_dispatcher("all_to_all", None, E), LocalDispatcher)  # no EP group
    dispatcher = build_dispatcher("local", None, E)
    assert isinstance(dispatcher, LocalDispatcher)
    routed = dispatcher.dispatch(x_TH, ids_Tk, w_Tk)
    assert routed.x_MH is x_TH and routed.expert_ids_Mk is ids_Tk and routed.weights_Mk is w_Tk
    y_MH = torch.randn(5, H)
    assert dispatcher.combine(y_MH, routed) is y_MH


def test_local_dispatcher_rejects_mismatched_shapes():
    dispatcher = LocalDispatcher()
    with pytest.raises(ValueError, match="disagree"):
        dispatcher.dispatch(torch.randn(5, H), torch.zeros(5, 2, dtype=torch.long), torch.rand(4, 2))
    routed = dispatcher.dispatch(torch.randn(5, H), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2))
    with pytest.raises(ValueError, match="does not match"):
        dispatcher.combine(torch.randn(4, H), routed)


def test_dispatcher_names_come_from_the_registry():
    """Unknown names fail here; local under EP and an unbuilt DeepEP are refused by runtime.plan (test_plan)."""
    with pytest.raises(ValueError, match=r"unknown dispatcher 'nccl'.*parallelism.dispatcher"):
        build_dispatcher("nccl", None, E)


def test_moe_block_runs_its_dispatcher_and_is_wired_in_one_step():
    """The block is built with a dispatcher and calls it in every forward (not only under EP)."""
    from moe.layer import MoEBlock
    from moe.router import SoftmaxTopKRouter

    calls = []

    class Counting(LocalDispatcher):
        def dispatch(self, *args):
            calls.append("dispatch")
            return super().dispatch(*args)

        def combine(self, *args):
            calls.append("combine")
            return super().combine(*args)

    torch.manual_seed(0)
    block = MoEBlock(SoftmaxTopKRouter(H, E, 2, True), GroupedExperts(E, H, I), build_dispatcher("local", None, E),
                     backend="eager")
    x_BSH = torch.randn(2, 3, H)
    before = block(x_BSH)
    block.wire(Counting(), balance_group=None, aux_grad_scale=0.5)
    assert block.aux_grad_scale == 0.5 and block.gate.balance_group is None
    assert torch.equal(block(x_BSH), before) and calls == ["dispatch", "combine"]

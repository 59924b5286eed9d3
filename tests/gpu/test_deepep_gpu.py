"""The deepep dispatcher on 2 and 4 GPUs (NCCL) against the all_to_all dispatcher on the same inputs.

Shapes: N tokens of the global batch, T of one rank, H hidden, I intermediate, E experts, k top-k,
M rows a rank computes. Every rank builds the same global batch from a seed and takes its slice;
its experts are its E/ep rows of the same full expert weights. Per case, on every rank:
  - DeepEP's layout kernel equals tests/unit/test_deepep_layout.py's dispatch_layout (exactly);
  - the routed rows (x, local ids, weights on valid slots) equal all_to_all's as a set keyed by
    (source rank, source token), -1 slots carry weight 0, and tokens_per_expert counts the valid slots;
  - a whole MoE layer (dispatch -> eager experts -> combine, plus the residual) gives the same output
    and gradients (x, topk_w, expert weights) as with all_to_all: norm-relative <= 1e-2 (bf16);
  - the buffer is made once and reused.
Runs where there are >= 2 CUDA devices and deep_ep imports (benchmarks/build_deepep.sh):
    python3 -m pytest -q tests/gpu/test_deepep_gpu.py
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(N_GPUS < 2, reason="needs >= 2 CUDA devices"),
              pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                                 reason="needs deep_ep (benchmarks/build_deepep.sh)")]

TOL = 1e-2  # bf16, norm-relative

# (name, tokens per rank, H, I, E, k, x dtype, share of tokens routed to experts 0..1 only)
CASES = [
    ("random", 96, 256, 64, 16, 4, torch.bfloat16, 0.0),
    ("skewed", 128, 256, 64, 16, 2, torch.bfloat16, 0.9),
    ("top-1", 64, 128, 32, 8, 1, torch.bfloat16, 0.0),
    ("fp32 x (combine in bf16)", 64, 256, 64, 16, 4, torch.float32, 0.0),
    ("Qwen3-30B-A3B rows", 2048, 2048, 64, 128, 8, torch.bfloat16, 0.0),
]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-12)).item()


def _batch(ep: int, T: int, H: int, E: int, k: int, dtype, skew: float, seed: int, idle_rank: int | None):
    gen = torch.Generator().manual_seed(seed)
    counts = [0 if r == idle_rank else T + 7 * r for r in range(ep)]  # uneven, one rank maybe idle
    N = sum(counts)
    rows = []
    for _ in range(N):
        if k >= 2 and torch.rand((), generator=gen) < skew:  # experts 0 and 1 (both on rank 0) and others
            rows.append(torch.cat([torch.tensor([0, 1]), 2 + torch.randperm(E - 2, generator=gen)[:k - 2]]))
        else:
            rows.append(torch.randperm(E, generator=gen)[:k])
    ids = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)
    x = torch.randn(N, H, generator=gen).to(dtype)
    w = (torch.rand(N, k, generator=gen) + 0.1).to(dtype)
    grad_out = torch.randn(N, H, generator=gen).to(dtype)
    starts = [sum(counts[:r]) for r in range(ep + 1)]
    return x, ids.long(), w, grad_out, starts


def _experts(E: int, H: int, I: int, rank: int, ep: int, dtype, seed: int):
    from moe.experts import GroupedExperts

    torch.manual_seed(seed)
    full = GroupedExperts(E, H, I, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        full.gate_up.normal_(std=H ** -0.5)
        full.down.normal_(std=I ** -0.5)
    E_local = E // ep
    mine = GroupedExperts(E_local, H, I, device="cuda", dtype=dtype, expert_offset=rank * E_local)
    with torch.no_grad():
        mine.gate_up.copy_(full.gate_up[rank * E_local:(rank + 1) * E_local])
        mine.down.copy_(full.down[rank * E_local:(rank + 1) * E_local])
    return mine


def _layer(dispatcher, experts, x_TH, ids_Tk, w_Tk, grad_out_TH):
    experts.zero_grad()
    x_TH = x_TH.clone().requires_grad_()
    w_Tk = w_Tk.clone().requires_grad_()
    routed = dispatcher.dispatch(x_TH, ids_Tk, w_Tk)
    y_MH = experts(routed.x_MH, routed.expert_ids_Mk, routed.weights_Mk, backend="eager")
    out_TH = dispatcher.combine(y_MH, routed)
    ((x_TH + out_TH) * grad_out_TH).float().sum().backward()
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in experts.named_parameters()}
    return out_TH.detach(), x_TH.grad, w_Tk.grad, grads


def _keyed(routed, sources, T_max: int):
    """Rows sorted by (source rank, source token)."""
    src_rank_M, src_tok_M = sources
    order = torch.argsort(src_rank_M.to(routed.x_MH.device) * T_max + src_tok_M.to(routed.x_MH.device))
    return routed.x_MH[order], routed.expert_ids_Mk[order], routed.weights_Mk[order], order


def _check_case(rank: int, ep: int, case, seed: int, idle_rank: int | None) -> dict:
    from moe.dispatch import AllToAllDispatcher, build_dispatcher
    from moe.dispatch import deepep as dd
    from tests.unit.test_deepep_layout import dispatch_layout, tokens_per_local_expert

    name, T, H, I, E, k, dtype, skew = case
    group = dist.group.WORLD
    x_N, ids_N, w_N, g_N, starts = _batch(ep, T, H, E, k, dtype, skew, seed, idle_rank)
    mine = slice(starts[rank], starts[rank + 1])
    x, ids, w, g = (t[mine].cuda() for t in (x_N, ids_N, w_N, g_N))
    E_local = E // ep
    deepep = build_dispatcher("deepep", group, E)
    assert isinstance(deepep, dd.DeepEPDispatcher)
    a2a = AllToAllDispatcher(group, E)
    what = f"{name}, ep={ep}, rank {rank}, idle rank {idle_rank}"

    # Layout kernel vs the torch reference.
    buffer = deepep.buffer_for(x)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids.to(deepep.topk_idx_dtype), E)
    ref = dispatch_layout(ids, E, ep)
    assert torch.equal(per_rank, ref[0]) and torch.equal(per_expert, ref[1]) and torch.equal(in_rank, ref[2]), what

    # Routed rows, as sets keyed by (source rank, source token).
    with torch.no_grad():
        r_d = deepep.dispatch(x, ids, w)
        r_a = a2a.dispatch(x, ids, w)
    assert r_d.x_MH.dtype == x.dtype and r_d.weights_Mk.dtype == w.dtype and r_d.expert_ids_Mk.dtype == ids.dtype
    assert r_d.recv_splits == r_a.recv_splits, what
    a_src_rank = torch.repeat_interleave(torch.arange(ep), torch.tensor(r_a.recv_splits))
    a_src_tok = torch.cat([(ids_N[starts[s]:starts[s + 1]] // E_local == rank).any(-1).nonzero().squeeze(-1)
                           for s in range(ep)])
    T_max = max(starts[s + 1] - starts[s] for s in range(ep)) + 1
    xd, idd, wd, order_d = _keyed(r_d, r_d.sources(), T_max)
    xa, ida, wa, _ = _keyed(r_a, (a_src_rank, a_src_tok), T_max)
    in_order = torch.equal(order_d.cpu(), torch.arange(len(order_d)))
    assert torch.equal(xd, xa) and torch.equal(idd, ida), what
    valid = idd >= 0
    assert torch.equal(wd[valid], wa[valid]) and bool((wd[~valid] == 0).all()), what
    assert r_d.tokens_per_expert == tokens_per_local_expert(r_d.expert_ids_Mk, E_local), what

    # A whole MoE layer, forward and backward.
    experts = _experts(E, H, I, rank, ep, dtype, seed)
    got = _layer(deepep, experts, x, ids, w, g)
    ref = _layer(a2a, experts, x, ids, w, g)
    errs = {"out": _rel(got[0], ref[0]), "grad x": _rel(got[1], ref[1]), "grad topk_w": _rel(got[2], ref[2])}
    errs.update({f"grad {n}": _rel(got[3][n], ref[3][n]) for n in ref[3]})
    for key, err in errs.items():
        assert err <= TOL, f"{what}: {key} norm-relative error {err:.2e} > {TOL:.0e}"
    assert deepep.buffer is buffer, f"{what}: the buffer was made again"
    deepep.close()
    return {"case": name, "rows": r_d.x_MH.shape[0], "same_order_as_all_to_all": in_order,
            **{k: round(v, 6) for k, v in errs.items()}}


def _check_all(rank: int, ep: int) -> list[dict]:
    results = []
    for seed, case in enumerate(CASES):
        results.append(_check_case(rank, ep, case, seed, idle_rank=None))
    results.append(_check_case(rank, ep, CASES[0], 99, idle_rank=ep - 1))  # a rank with no tokens
    return results


def _child(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    try:
        torch.save(_check_all(rank, world), os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _spawn(world: int) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_child, args=(world, port, out_dir), nprocs=world, join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            errs = sorted(f for f in os.listdir(out_dir) if f.endswith(".err"))
            raise RuntimeError("\n".join(Path(out_dir, f).read_text() for f in errs) or "a child failed") from None
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_deepep_matches_all_to_all(world):
    if world > N_GPUS:
        pytest.skip(f"needs {world} CUDA devices, found {N_GPUS}")
    results = _spawn(world)
    for rank, rows in enumerate(results):
        for row in rows:
            print(f"ep={world} rank {rank}: {row}")

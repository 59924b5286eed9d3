"""The chunked dispatcher's streams on 2 and 4 GPUs (NCCL): a MoE layer pipelined over 2 and 3 pieces of
the tokens equals the same layer run whole on the all_to_all dispatcher (itself checked against one
process in tests/dist/test_dispatch.py).

Shapes: T tokens of one rank (uneven over ranks, one case with an idle rank), H hidden, I intermediate,
E experts, k top-k. Per case, three forward+backward passes each way on the same inputs (the caching
allocator reuses blocks from the second pass on, which is where a tensor not recorded on the stream that
reads it would be overwritten): output, grad x, grad topk_w and the expert weights' grads within the
case's tolerance (fp32 eager experts: only the weight gradients' summation order differs; bf16
grouped_mm at Qwen3-30B-A3B dims, where the exchange and the GEMMs are long enough to overlap).
    python3 -m pytest -q tests/gpu/test_overlap_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gpu.nccl import spawn

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(N_GPUS < 2, reason="needs >= 2 CUDA devices")]

# (name, tokens per rank, H, I, E, k, dtype, backend, tolerance (norm-relative), idle rank)
CASES = [
    ("fp32 eager", 2048, 512, 128, 16, 4, torch.float32, "eager", 1e-5, False),
    ("fp32 eager, an idle rank", 1024, 256, 64, 16, 4, torch.float32, "eager", 1e-5, True),
    ("Qwen3-30B-A3B dims, bf16 grouped_mm", 8192, 2048, 768, 128, 8, torch.bfloat16, "grouped_mm", 1e-2, False),
]
PASSES = 3


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-12)).item()


def _inputs(rank: int, ep: int, T: int, H: int, E: int, k: int, dtype, idle: bool, seed: int):
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    T = 0 if idle and rank == ep - 1 else T + 37 * rank
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = (torch.rand(T, k, generator=gen) + 0.1).to(dtype)
    grad_out = torch.randn(T, H, generator=gen).to(dtype)
    return (t.cuda() for t in (x, ids, w, grad_out))


def _experts(E: int, H: int, I: int, rank: int, ep: int, dtype, seed: int):
    from moe.experts import GroupedExperts

    torch.manual_seed(seed)  # the same full weights on every rank; each keeps its own E/ep
    E_local = E // ep
    experts = GroupedExperts(E_local, H, I, device="cuda", dtype=dtype, expert_offset=rank * E_local)
    with torch.no_grad():
        full_gate_up = torch.randn(E, *experts.gate_up.shape[1:], device="cuda") * H ** -0.5
        full_down = torch.randn(E, *experts.down.shape[1:], device="cuda") * I ** -0.5
        experts.gate_up.copy_(full_gate_up[rank * E_local:(rank + 1) * E_local])
        experts.down.copy_(full_down[rank * E_local:(rank + 1) * E_local])
    return experts


def _layer(dispatcher, experts, backend: str, x_TH, ids_Tk, w_Tk, grad_out_TH):
    experts.zero_grad()
    x_TH = x_TH.clone().requires_grad_()
    w_Tk = w_Tk.clone().requires_grad_()
    out_TH = dispatcher.run(x_TH, ids_Tk, w_Tk, lambda r: experts(r.x_MH, r.expert_ids_Mk, r.weights_Mk,
                                                                  backend=backend, valid_slots=r.valid_slots))
    ((x_TH + out_TH) * grad_out_TH).float().sum().backward()
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in experts.named_parameters()}
    return {"out": out_TH.detach(), "grad x": x_TH.grad, "grad topk_w": w_Tk.grad,
            **{f"grad {n}": g for n, g in grads.items()}}


def _check_all(rank: int, ep: int) -> list[dict]:
    from moe.dispatch import AllToAllDispatcher, ChunkedDispatcher

    results = []
    for seed, (name, T, H, I, E, k, dtype, backend, tol, idle) in enumerate(CASES):
        whole = AllToAllDispatcher(dist.group.WORLD, E)
        experts = _experts(E, H, I, rank, ep, dtype, seed)
        inputs = list(_inputs(rank, ep, T, H, E, k, dtype, idle, seed))
        ref = _layer(whole, experts, backend, *inputs)
        for chunks in (2, 3):
            chunked = ChunkedDispatcher(whole, chunks)
            worst = {}
            for _ in range(PASSES):
                got = _layer(chunked, experts, backend, *inputs)
                for key, expected in ref.items():
                    worst[key] = max(worst.get(key, 0.0), _rel(got[key], expected))
            what = f"{name}, ep={ep}, rank {rank}, {chunks} chunks"
            for key, err in worst.items():
                assert err <= tol, f"{what}: {key} norm-relative error {err:.2e} > {tol:.0e}"
            results.append({"case": name, "chunks": chunks, **{key: f"{err:.1e}" for key, err in worst.items()}})
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_chunked_dispatch_matches_whole(world):
    if world > N_GPUS:
        pytest.skip(f"needs {world} CUDA devices, found {N_GPUS}")
    for rank, rows in enumerate(spawn(_check_all, world)):
        for row in rows:
            print(f"ep={world} rank {rank}: {row}")

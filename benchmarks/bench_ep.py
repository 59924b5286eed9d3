"""Expert-parallel MoE layer benchmark (run under torchrun on 2 or 4 GPUs):

    torchrun --nproc_per_node 4 benchmarks/bench_ep.py [--tokens 8192] [--out DIR]

At Qwen3-30B-A3B dims (E=128, H=2048, I=768, k=8), T tokens per rank, bf16: one MoE layer
(all_to_all dispatch -> grouped_mm experts -> combine) fwd+bwd with sentinel-skip vs compute-and-mask
(-1 slots sent to local expert 0 with weight 0, so every slot is computed), for every ep that divides
the world; time and peak memory; and dispatch+combine alone vs the NCCL all_to_all bus bandwidth
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from moe.dispatch import AllToAllDispatcher
from moe.experts import GroupedExperts

E, H, I, K = 128, 2048, 768, 8


def timed(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of fn() over iters, after warmup, synchronized across ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def ep_group(ep: int):
    """The EP group of this rank: consecutive runs of `ep` ranks (every rank must create every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, ep):
        g = dist.new_group(list(range(start, start + ep)))
        if start <= rank < start + ep:
            mine = g
    return mine


def mask_to_compute(ids_Mk: torch.Tensor, w_Mk: torch.Tensor):
    """Compute-and-mask: -1 slots go to local expert 0 with weight 0 (computed, then discarded)."""
    invalid = ids_Mk < 0
    return ids_Mk.masked_fill(invalid, 0), w_Mk.masked_fill(invalid, 0)


def layer_step(dispatcher, experts, x_TH, ids_Tk, w_Tk, mask: bool):
    routed = dispatcher.dispatch(x_TH, ids_Tk, w_Tk)
    ids, w = routed.expert_ids_Mk, routed.weights_Mk
    if mask:
        ids, w = mask_to_compute(ids, w)
    y = experts(routed.x_MH, ids, w, backend="grouped_mm")
    out = dispatcher.combine(y, routed)
    out.float().square().mean().backward()


def dispatch_combine_step(dispatcher, x_TH, ids_Tk, w_Tk):
    routed = dispatcher.dispatch(x_TH, ids_Tk, w_Tk)
    # y = x * sum of valid weights: what an identity expert returns; keeps weights in the graph
    y = routed.x_MH * routed.weights_Mk.masked_fill(routed.expert_ids_Mk < 0, 0).sum(-1, keepdim=True)
    dispatcher.combine(y, routed).float().square().mean().backward()


def all_to_all_busbw(nbytes_per_rank: int, group) -> float:
    """GB/s of all_to_all_single with equal splits (nccl-tests' busbw: algbw * (n-1)/n)."""
    n = dist.get_world_size(group)
    buf = torch.empty(nbytes_per_rank // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(buf)
    ms = timed(lambda: dist.all_to_all_single(out, buf, group=group))
    return nbytes_per_rank / (ms / 1e3) / 1e9 * (n - 1) / n


def bench(ep: int, tokens: int) -> dict:
    group = ep_group(ep)
    rank_in_group = dist.get_rank(group)
    torch.manual_seed(1234 + dist.get_rank())
    experts = GroupedExperts(E // ep, H, I, device="cuda", dtype=torch.bfloat16,
                             expert_offset=rank_in_group * E // ep)
    dispatcher = AllToAllDispatcher(group, E)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(tokens, E, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), K)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16).requires_grad_()
    row = {"ep": ep, "tokens_per_rank": tokens}
    for name, mask in (("skip", False), ("mask", True)):
        torch.cuda.reset_peak_memory_stats()
        row[f"{name}_ms"] = timed(lambda mask=mask: layer_step(dispatcher, experts, x, ids, w, mask))
        row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["dispatch_combine_ms"] = timed(lambda: dispatch_combine_step(dispatcher, x, ids, w))
    routed = dispatcher.dispatch(x.detach(), ids, w.detach())
    row["rows_received"] = routed.x_MH.shape[0]
    sent_bytes = routed.x_MH.shape[0] * H * 2  # about what this rank sends, too (balanced routing)
    # fwd + bwd move the rows four times (dispatch, combine, and their backward)
    row["dispatch_combine_GBps"] = 4 * sent_bytes / (row["dispatch_combine_ms"] / 1e3) / 1e9
    row["a2a_busbw_GBps"] = all_to_all_busbw(sent_bytes, group)
    row["a2a_busbw_128MiB_GBps"] = all_to_all_busbw(128 * 2**20, group)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = dist.get_world_size()
    rows = [bench(ep, args.tokens) for ep in (2, 4, 8) if ep <= world and world % ep == 0]
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name()} x{world}, E={E} H={H} I={I} k={K}, bf16, fwd+bwd of one MoE layer")
        print(f"{'ep':>3} {'skip ms':>8} {'mask ms':>8} {'skip/mask':>9} {'skip GiB':>8} {'mask GiB':>8} "
              f"{'d+c ms':>7} {'d+c GB/s':>9} {'a2a busbw':>9} {'@128MiB':>8}")
        for r in rows:
            print(f"{r['ep']:>3} {r['skip_ms']:>8.2f} {r['mask_ms']:>8.2f} {r['skip_ms'] / r['mask_ms']:>9.2f} "
                  f"{r['skip_peak_gib']:>8.2f} {r['mask_peak_gib']:>8.2f} {r['dispatch_combine_ms']:>7.2f} "
                  f"{r['dispatch_combine_GBps']:>9.1f} {r['a2a_busbw_GBps']:>9.1f} {r['a2a_busbw_128MiB_GBps']:>8.1f}")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_ep.json").write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Expert-parallel MoE layer: sentinel-skip vs compute-and-mask, and dispatch+combine vs NCCL all_to_all.

    torchrun --standalone --nproc_per_node 4 -m benchmarks.bench_ep [--shape qwen3-30b-a3b] [--tokens 8192] [--compile]
        [--out DIR]
    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_ep --dry   # gloo on the CPU, tiny shape
    torchrun --standalone --nproc_per_node 4 -m benchmarks.bench_ep --dispatcher deepep   # DeepEP's kernels
    torchrun --standalone --nproc_per_node 4 -m benchmarks.bench_ep --dispatcher deepep --deepep-sms 20,24,32
    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_ep --trace DIR   # + a traced layer step per rank

At one MoE shape (harness.SHAPES), T tokens per rank, bf16: one MoE layer (all_to_all dispatch ->
grouped_mm experts -> combine) fwd+bwd with sentinel-skip vs compute-and-mask (-1 slots sent to local
expert 0 with weight 0, so every slot is computed), for every ep that divides the world, and at ep 1 (all
experts on each rank, nothing exchanged: the baseline of a weak-scaling reading, at balanced routing); time (median
over ranks' medians: the slowest rank) and peak memory; and dispatch+combine alone vs the NCCL
all_to_all bus bandwidth measured in the same run. `--dry` runs the same code on gloo CPU ranks in
fp32 (eager experts): a smoke test, its numbers mean nothing. `--compile` compiles the expert compute as
training does under EP (runtime.distributed.compile.compile_experts: fullgraph, rows dynamic), dispatch
and combine staying eager; with `--dry` the experts are then grouped_mm in bf16 (the only dtype
torch._grouped_mm traces on the CPU). `--deepep-sms` gives DeepEP's kernels each of these SM counts in turn
(one row per ep and count; moe/dispatch/deepep.py's DEFAULT_NUM_SMS otherwise).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.harness import SHAPES, Column, Report, median_ms
from moe.dispatch import build_dispatcher
from moe.experts import GroupedExperts
from runtime.distributed.compile import compile_experts


@dataclass
class Row:
    ep: int
    tokens_per_rank: int
    skip_ms: float | None = None
    mask_ms: float | None = None
    skip_over_mask: float | None = None
    skip_peak_gib: float | None = None
    mask_peak_gib: float | None = None
    dispatch_combine_ms: float | None = None
    rows_received: int | None = None
    dispatch_combine_GBps: float | None = None
    a2a_busbw_GBps: float | None = None  # all_to_all of the same bytes per rank
    a2a_busbw_128MiB_GBps: float | None = None
    note: str = ""


COLUMNS = [Column("ep", "ep", "d"), Column("skip_ms", "skip ms", ".2f"), Column("mask_ms", "mask ms", ".2f"),
           Column("skip_over_mask", "skip/mask", ".2f"), Column("skip_peak_gib", "skip GiB", ".2f"),
           Column("mask_peak_gib", "mask GiB", ".2f"), Column("dispatch_combine_ms", "d+c ms", ".2f"),
           Column("dispatch_combine_GBps", "d+c GB/s", ".1f"), Column("a2a_busbw_GBps", "a2a busbw", ".1f"),
           Column("a2a_busbw_128MiB_GBps", "@128MiB", ".1f")]


@dataclass
class Run:
    device: str
    dtype: torch.dtype
    backend: str
    compile: bool
    dispatcher: str = "all_to_all"
    trace: str | None = None  # a folder: one traced layer step per ep


def timed(fn, run: Run) -> float:
    """ms of fn(): each rank's median over 10 calls (after a barrier each), the slowest rank's."""
    ms = median_ms(fn, iters=10, warmup=3, before=dist.barrier)
    t = torch.tensor(ms, device=run.device)
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


def layer_step(dispatcher, experts, x_TH, ids_Tk, w_Tk, mask: bool, backend: str):
    routed = dispatcher.dispatch(x_TH, ids_Tk, w_Tk)
    ids, w = routed.expert_ids_Mk, routed.weights_Mk
    if mask:
        ids, w = mask_to_compute(ids, w)
    y = experts(routed.x_MH, ids, w, backend=backend)
    out = dispatcher.combine(y, routed)
    out.float().square().mean().backward()


def dispatch_combine_step(dispatcher, x_TH, ids_Tk, w_Tk):
    routed = dispatcher.dispatch(x_TH, ids_Tk, w_Tk)
    # y = x * sum of valid weights: what an identity expert returns; keeps weights in the graph
    y = routed.x_MH * routed.weights_Mk.masked_fill(routed.expert_ids_Mk < 0, 0).sum(-1, keepdim=True)
    dispatcher.combine(y, routed).float().square().mean().backward()


def all_to_all_busbw(nbytes_per_rank: int, group, run: Run) -> float:
    """GB/s of all_to_all_single with equal splits (nccl-tests' busbw: algbw * (n-1)/n)."""
    n = dist.get_world_size(group)
    buf = torch.empty(nbytes_per_rank // 2, dtype=torch.bfloat16, device=run.device)
    out = torch.empty_like(buf)
    ms = timed(lambda: dist.all_to_all_single(out, buf, group=group), run)
    return nbytes_per_rank / (ms / 1e3) / 1e9 * (n - 1) / n


def trace(folder: str, tag: str, step) -> None:
    """One step under torch.profiler, as each rank's Chrome trace FOLDER/TAG-rankR.json.gz (runtime.timeline
    reads it: the compute stream's busy time, its idle gaps and what launched the kernels after them)."""
    step()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, f"{tag}-rank{dist.get_rank()}.json.gz"))


def peak_gib(run: Run) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if run.device == "cuda" else None


def make_dispatcher(run: Run, group, num_experts: int, tokens: int, num_sms: int | None):
    if num_sms is None:
        return build_dispatcher(run.dispatcher, group, num_experts, tokens_per_rank=tokens)
    from moe.dispatch.deepep import DeepEPDispatcher

    return DeepEPDispatcher(group, num_experts, num_sms=num_sms)


def bench(ep: int, shape: str, tokens: int, run: Run, num_sms: int | None = None) -> Row:
    s = SHAPES[shape]
    E, H, I, K = s.experts, s.hidden, s.intermediate, s.top_k
    group = ep_group(ep)
    rank_in_group = dist.get_rank(group)
    torch.manual_seed(1234 + dist.get_rank())
    experts = GroupedExperts(E // ep, H, I, device=run.device, dtype=run.dtype, expert_offset=rank_in_group * E // ep)
    if run.compile:
        compile_experts(experts)
    dispatcher = make_dispatcher(run, group, E, tokens, num_sms)
    x = torch.randn(tokens, H, device=run.device, dtype=run.dtype, requires_grad=True)
    logits = torch.randn(tokens, E, device=run.device)
    w, ids = torch.topk(torch.softmax(logits, -1), K)
    w = (w / w.sum(-1, keepdim=True)).to(run.dtype).requires_grad_()
    row = Row(ep, tokens, note="" if num_sms is None else f"{num_sms} SMs")
    # ep 1: every expert here and nothing exchanged (no -1 slots to mask): the layer's baseline
    for name, mask in (("skip", False),) if ep == 1 else (("skip", False), ("mask", True)):
        if run.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = timed(lambda mask=mask: layer_step(dispatcher, experts, x, ids, w, mask, run.backend), run)
        setattr(row, f"{name}_ms", ms)
        setattr(row, f"{name}_peak_gib", peak_gib(run))
    if run.trace:
        trace(run.trace, f"ep{ep}", lambda: layer_step(dispatcher, experts, x, ids, w, False, run.backend))
    if ep == 1:
        return row
    row.skip_over_mask = row.skip_ms / row.mask_ms
    row.dispatch_combine_ms = timed(lambda: dispatch_combine_step(dispatcher, x, ids, w), run)
    routed = dispatcher.dispatch(x.detach(), ids, w.detach())
    row.rows_received = routed.x_MH.shape[0]
    # About what each rank sends, too (balanced routing); all ranks must agree on one size for the
    # equal-split all_to_all below, so the largest, rounded to a whole bf16 element per peer.
    sent = torch.tensor(routed.x_MH.shape[0] * H * 2, device=run.device)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=group)
    sent_bytes = -(-int(sent) // (2 * ep)) * 2 * ep
    # fwd + bwd move the rows four times (dispatch, combine, and their backward)
    row.dispatch_combine_GBps = 4 * sent_bytes / (row.dispatch_combine_ms / 1e3) / 1e9
    row.a2a_busbw_GBps = all_to_all_busbw(sent_bytes, group, run)
    row.a2a_busbw_128MiB_GBps = all_to_all_busbw((1 if run.device == "cpu" else 128) * 2**20, group, run)
    if hasattr(dispatcher, "close"):  # deepep: its NVLink buffer (a collective over the group)
        dispatcher.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", help="a MoE shape in benchmarks.harness.SHAPES")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--backend", default="grouped_mm", help="expert backend of the layer")
    p.add_argument("--compile", action="store_true", help="compile the expert compute as training does under EP")
    p.add_argument("--dry", action="store_true", help="gloo on the CPU, tiny shape, fp32, eager experts")
    p.add_argument("--dispatcher", default="all_to_all", help="all_to_all | all_gather | deepep (parallelism.dispatcher)")
    p.add_argument("--deepep-sms", type=lambda s: [int(x) for x in s.split(",")], default=[None],
                   help="with --dispatcher deepep: SM counts for its kernels, comma-separated (even numbers)")
    p.add_argument("--trace", help="a folder for one traced layer step per ep (GPU): a Chrome trace per rank")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    if args.deepep_sms != [None] and args.dispatcher != "deepep":
        p.error("--deepep-sms sets DeepEP's SM count: it needs --dispatcher deepep")
    if args.dry:
        cpu = (torch.bfloat16, "grouped_mm") if args.compile else (torch.float32, "eager")
        run, shape, tokens = Run("cpu", *cpu, args.compile, args.dispatcher), "tiny", 32
        dist.init_process_group("gloo")
    else:
        run, shape, tokens = (Run("cuda", torch.bfloat16, args.backend, args.compile, args.dispatcher, args.trace),
                              args.shape, args.tokens)
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world, rank = dist.get_world_size(), dist.get_rank()
    report = Report("bench_ep", COLUMNS, args.out if rank == 0 else None, printing=rank == 0)
    report.meta.update(world=world, shape=shape, backend=run.backend, dtype=str(run.dtype), compile=run.compile,
                       dispatcher=run.dispatcher)
    s = SHAPES[shape]
    report.header(f"EP MoE layer fwd+bwd, x{world}, {shape} (E={s.experts} H={s.hidden} I={s.intermediate} "
                  f"k={s.top_k}), {tokens} tokens per rank, {run.backend} experts{' (compiled)' if run.compile else ''}, "
                  f"{run.dispatcher} dispatcher,")
    for ep in (1, 2, 4, 8):
        if ep <= world and world % ep == 0:
            for num_sms in args.deepep_sms:
                report.add(bench(ep, shape, tokens, run, num_sms))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

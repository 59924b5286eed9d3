"""Compiled vs eager hybrid decoder stack (issue 6 benchmark):

    python benchmarks/bench_hybrid_compile.py [--tokens 8192] [--backend grouped_mm] [--gdn-op-set fla] [--out DIR]

A 4-layer Qwen3.5-35B-A3B-shaped stack (3 Gated DeltaNet + 1 gated attention block, 256 experts top-8
with a gated shared expert), random bf16 weights, one packed row of `--tokens` tokens (documents of
random lengths, cu_seqlens from the collator's rule), fwd+bwd of the blocks: tokens/s eager vs
torch.compile (blocks compiled with fullgraph=True), graph count, graph breaks, peak memory.
Target: zero graph breaks and compiled >= 1.15x eager.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.distributed.compile import apply_compile
from runtime.models.hf import config_from_hf
from runtime.models.qwen import QwenForCausalLM, cu_seqlens_from_position_ids, init_weights

QWEN3_5_35B_A3B_4L = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 4096, "hidden_size": 2048, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}


def packed_positions(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pos, left = [], tokens
    while left:
        n = min(left, int(torch.randint(256, 2048, (1,), generator=g)))
        pos.append(torch.arange(n))
        left -= n
    return torch.cat(pos).unsqueeze(0)


def time_step(model, ids, pos, cu, max_len, iters: int) -> float:
    def step():
        h = model.hidden_states(ids, pos, cu, max_len)
        h.float().square().mean().backward()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--backend", default="grouped_mm")
    ap.add_argument("--gdn-op-set", default="fla")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    cfg = config_from_hf(dict(QWEN3_5_35B_A3B_4L), expert_backend=args.backend, gdn_op_set=args.gdn_op_set)
    pos = packed_positions(args.tokens).cuda()
    ids = torch.randint(0, cfg.vocab_size, pos.shape, device="cuda")
    cu, max_len = cu_seqlens_from_position_ids(pos)
    rows = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = QwenForCausalLM(cfg, device="cuda", dtype=torch.bfloat16)
        init_weights(model)
        if mode == "compiled":
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {})
        torch.cuda.reset_peak_memory_stats()
        ms = time_step(model, ids, pos, cu, max_len, args.iters)
        rows[mode] = {"ms": ms, "tok_s": args.tokens / ms * 1e3,
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "graphs": counters["stats"]["unique_graphs"] if mode == "compiled" else 0,
                      "graph_breaks": sum(counters["graph_break"].values()) if mode == "compiled" else 0}
        del model
    speedup = rows["compiled"]["tok_s"] / rows["eager"]["tok_s"]
    print(f"{torch.cuda.get_device_name()}: 4-layer Qwen3.5-35B-A3B stack (3 GDN + 1 gated attention), "
          f"{args.tokens} packed tokens, experts={args.backend}, gdn={args.gdn_op_set}, bf16, fwd+bwd")
    print("| mode | ms | tokens/s | peak GiB | graphs | graph breaks |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['ms']:.2f} | {r['tok_s']:.0f} | {r['peak_gib']:.2f} | {r['graphs']} | {r['graph_breaks']} |")
    ok = rows["compiled"]["graph_breaks"] == 0 and speedup >= 1.15
    print(f"compiled / eager = {speedup:.2f}x (target >= 1.15x, zero graph breaks): {'PASS' if ok else 'FAIL'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_hybrid_compile.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

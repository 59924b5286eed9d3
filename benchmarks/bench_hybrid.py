"""Hybrid (Gated DeltaNet + gated attention) decoder stack: compiled vs eager, and the GDN layer alone.

    python -m benchmarks.bench_hybrid [--tokens 8192] [--backend grouped_mm] [--gdn-op-set fla] [--out DIR]
    python -m benchmarks.bench_hybrid --gdn-layer [--out DIR]
    python -m benchmarks.bench_hybrid --gdn-state [--gdn-op-set fla] [--out DIR]
    python -m benchmarks.bench_hybrid --gdn-conv [--tokens 8192] [--out DIR]
    python -m benchmarks.bench_hybrid --dry          # CPU smoke run, tiny stack, eager only

Stack: 4 Qwen3.5-35B-A3B-shaped blocks (harness.SHAPES; 3 Gated DeltaNet + 1 gated attention block, 256
experts top-8 with a gated shared expert), random bf16 weights, one packed row of `--tokens` tokens
(documents of random lengths, cu_seqlens from the collator's rule), fwd+bwd of the blocks: tokens/s
eager vs torch.compile (blocks compiled with fullgraph=True), graph count, graph breaks, peak memory.
Target: zero graph breaks and compiled >= 1.15x eager.

--gdn-layer: one GDN layer at Qwen3.5 dimensions, 4 rows x 4096 tokens packed with documents of 1000
tokens, fwd+bwd per op set (fla eager, fla compiled, each also with the conv weight frozen as under LoRA; torch).
The fla op set needs the GDN wheels (pyproject extra `gdn`; on the GPU machines the two-call install in
benchmarks/gpu_hybrid.sh).

--gdn-conv: the GDN conv's backward alone (Qwen3.5's 8192 channels, window 4, one packed row, bf16): FLA's
causal_conv1d_bwd (forward recomputed, dx, weight gradient) against the frozen weight's input-gradient kernel
(attention/kernels/conv_silu.py, LoRA's path), FLA's forward and the HBM time of dx's bytes beside them. Needs fla
only (no TileLang).

--gdn-state: the delta rule of GDN state passing (parallelism.cp_gdn: state) against a plain delta rule over the
same tokens, Qwen3.5-35B-A3B GDN dims, one row of 16384 tokens (one document), bf16, fwd+bwd: the row cut into
2, 4, 8, 16 pieces (2*cp), each run from the state [0 | I_K] with values [v | 0_K] and the pieces' maps composed
(attention/gdn.py's functions, all pieces on one GPU: per token what every cp rank computes; the all-gathers of
a real cp run are not in it).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from benchmarks.harness import SHAPES, Column, Report, steady_ms
from runtime.distributed.compile import apply_compile
from runtime.models.hf import config_from_hf
from runtime.models.qwen import QwenForCausalLM, cu_seqlens_from_position_ids, init_weights

# The GDN dimensions of Qwen3.5-35B-A3B (its linear-attention layers); the rest comes from the preset.
GDN_DIMS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def hybrid_config(shape: str, layers: int = 4, vocab: int = 4096) -> dict:
    """A HF config of a Qwen3.5-MoE stack at `shape`'s dims: GDN blocks, every fourth one gated attention."""
    s = SHAPES[shape]
    gdn = GDN_DIMS if shape != "tiny" else {"linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                            "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                            "linear_conv_kernel_dim": 4}
    return {"model_type": "qwen3_5_moe_text", "vocab_size": vocab, "hidden_size": s.hidden,
            "num_hidden_layers": layers, "layer_types": ["linear_attention"] * (layers - 1) + ["full_attention"],
            "num_attention_heads": s.q_heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
            "moe_intermediate_size": s.intermediate, "shared_expert_intermediate_size": s.intermediate,
            "num_experts": s.experts, "num_experts_per_tok": s.top_k, **gdn, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}


@dataclass
class Row:
    mode: str
    ms: float
    tok_s: float
    peak_gib: float | None
    graphs: int
    graph_breaks: int
    note: str = ""


COLUMNS = [Column("mode", "mode", width=8), Column("ms", "ms", ".2f", 8), Column("tok_s", "tokens/s", ".0f"),
           Column("peak_gib", "peak GiB", ".2f"), Column("graphs", "graphs", "d"),
           Column("graph_breaks", "graph breaks", "d")]


def packed_positions(tokens: int, seed: int = 0, lengths: tuple[int, int] = (256, 2048)) -> torch.Tensor:
    """position_ids [1, tokens] of documents of random lengths packed into one row."""
    g = torch.Generator().manual_seed(seed)
    pos, left = [], tokens
    while left:
        n = min(left, int(torch.randint(*lengths, (1,), generator=g)))
        pos.append(torch.arange(n))
        left -= n
    return torch.cat(pos).unsqueeze(0)


def stack(args, device: str, dtype: torch.dtype, report: Report) -> None:
    shape = "tiny" if args.dry else "qwen3.5-35b-a3b"
    cfg = config_from_hf(hybrid_config(shape), expert_backend=args.backend, gdn_op_set=args.gdn_op_set)
    pos = packed_positions(args.tokens, lengths=(8, 32) if args.dry else (256, 2048)).to(device)
    ids = torch.randint(0, cfg.vocab_size, pos.shape, device=device)
    cu, max_len = cu_seqlens_from_position_ids(pos)
    on_gpu = device == "cuda"
    report.header(f"4-layer {shape} stack (3 GDN + 1 gated attention), {args.tokens} packed tokens, "
                  f"experts={args.backend}, gdn={args.gdn_op_set}, {dtype}, fwd+bwd")
    rows = {}
    for mode in args.modes.split(","):
        torch.manual_seed(0)
        model = QwenForCausalLM(cfg, device=device, dtype=dtype)
        init_weights(model)
        if mode == "compiled":
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {})
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()

        def step(model=model):
            h = model.hidden_states(ids, pos, cu, max_len)
            h.float().square().mean().backward()

        ms = steady_ms(step, args.iters, warmup=3)
        compiled = mode == "compiled"
        rows[mode] = report.add(Row(mode, ms, args.tokens / ms * 1e3,
                                    torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
                                    counters["stats"]["unique_graphs"] if compiled else 0,
                                    sum(counters["graph_break"].values()) if compiled else 0))
        del model
    if {"eager", "compiled"} <= rows.keys():
        speedup = rows["compiled"]["tok_s"] / rows["eager"]["tok_s"]
        ok = rows["compiled"]["graph_breaks"] == 0 and speedup >= 1.15
        report.meta["compiled_over_eager"] = speedup
        report.save()
        print(f"compiled / eager = {speedup:.2f}x (target >= 1.15x, zero graph breaks): {'PASS' if ok else 'FAIL'}")


def gdn_layer(args, report: Report) -> None:
    from attention.attention import AttnMeta
    from attention.gdn import GatedDeltaNet

    B, S, doc = 4, 4096, 1000
    dims = {"hidden": SHAPES["qwen3.5-35b-a3b"].hidden, "num_k_heads": 16, "num_v_heads": 32, "head_k_dim": 128,
            "head_v_dim": 128, "conv_kernel": 4, "eps": 1e-6}
    ends = sorted({*range(0, B * S, doc), *range(0, B * S + 1, S)})
    meta = AttnMeta(cu_seqlens=torch.tensor(ends, dtype=torch.int32, device="cuda"), max_seqlen=doc)
    x = torch.randn(B, S, dims["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    report.header(f"GDN layer fwd+bwd, B={B} S={S} packed (docs <= {doc} tokens), bf16")
    # a frozen conv weight (LoRA's base) takes the input-gradient kernel instead of FLA's conv backward
    for op_set, compiled, frozen_conv in (("fla", False, False), ("fla", False, True), ("fla", True, False),
                                          ("fla", True, True), ("torch", False, False)):
        mode = f"{op_set} {'compiled' if compiled else 'eager'}{', conv frozen' if frozen_conv else ''}"
        try:
            torch.manual_seed(0)
            layer = GatedDeltaNet(**dims, op_set=op_set, device="cuda", dtype=torch.bfloat16)
            layer.conv1d.weight.requires_grad_(not frozen_conv)
            run = torch.compile(layer, fullgraph=True) if compiled else layer
            ms = steady_ms(lambda run=run: run(x, meta).sum().backward(), args.iters, warmup=3)
            report.add({"op_set": op_set, "mode": mode, "ms": ms})
        except Exception as exc:  # noqa: BLE001 (fla missing or failing: the other op sets still run)
            report.add({"op_set": op_set, "mode": mode, "ms": None, "note": f"n/a: {type(exc).__name__}: {exc}"[:120]})


def gdn_conv(args, report: Report) -> None:
    """The GDN conv's backward alone at Qwen3.5's conv width: FLA's (recomputed forward, dx, weight gradient)
    against the frozen weight's input-gradient kernel, with FLA's forward and the bytes' HBM time beside them."""
    from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd

    from attention import gdn_ops_fla
    from attention.kernels.conv_silu import conv_silu_input_grad

    T, D, W = args.tokens, 8192, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    w = (torch.randn(D, W, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    cu, _ = cu_seqlens_from_position_ids(packed_positions(T).cuda())
    chunks = gdn_ops_fla.chunk_indices(cu)
    report.header(f"GDN conv backward, {T} tokens packed, {D} channels, window {W}, bf16")
    fla_kw = {"bias": None, "residual": None, "activation": "silu", "cu_seqlens": cu, "chunk_indices": chunks,
              "chunk_size": gdn_ops_fla.CHUNK}
    base = steady_ms(lambda: causal_conv1d_bwd(x=x, dy=dy, dht=None, weight=w, **fla_kw), args.iters, warmup=3)
    rows = {"FLA forward": steady_ms(lambda: causal_conv1d_fwd(x=x, weight=w, **fla_kw), args.iters, warmup=3),
            "FLA backward (dx, dw)": base,
            "ours, dx only": steady_ms(lambda: conv_silu_input_grad(x, w, dy, cu), args.iters, warmup=3),
            # x, dy read, dx written at H200's 4.8 TB/s
            "HBM floor of dx": 3 * x.numel() * x.element_size() / 4.8e12 * 1e3}
    for mode, ms in rows.items():
        report.add({"mode": mode, "ms": ms, "ratio": None if mode == "FLA forward" else ms / base})


def gdn_state(args, report: Report) -> None:
    import importlib

    from attention.context_parallel import piece_documents
    from attention.gdn import delta_rule_state_maps, incoming_states, with_incoming_state

    ops = importlib.import_module(f"attention.gdn_ops_{args.gdn_op_set}")
    S, Hk, Hv, K, V = 16384, 16, 32, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, S, Hk, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, S, Hv, V, device="cuda", generator=gen).to(torch.bfloat16)
    g = -torch.rand(1, S, Hv, device="cuda", generator=gen) * 0.05
    beta = torch.rand(1, S, Hv, device="cuda", generator=gen).to(torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    report.header(f"GDN delta rule fwd+bwd, {S} tokens (one document), Qwen3.5-35B-A3B GDN dims (Hk {Hk}, Hv {Hv}, "
                  f"K {K}, V {V}), bf16, op set {args.gdn_op_set}: plain vs state passing's pieces")

    def plain():
        docs = ops.prepare_docs(torch.tensor([0, S], dtype=torch.int32, device="cuda"), 1, S, "cuda")
        return lambda: ops.chunk_gated_delta_rule(*leaves, docs)

    def pieces(num):
        P = S // num
        cu, continues = piece_documents([0, S], 1, S, num, tuple(range(num)))
        docs = ops.prepare_docs(torch.tensor(cu, dtype=torch.int32, device="cuda"), num, P, "cuda")
        continues_n = torch.tensor(continues, device="cuda")

        def run():
            o_nPHW, maps_nHKW = delta_rule_state_maps(ops, *(t.view(num, P, *t.shape[2:]) for t in leaves), docs,
                                                      continues_n)
            state_in_nHKV = incoming_states(maps_nHKW.unsqueeze(1), V, tuple(range(num))).squeeze(1)
            return with_incoming_state(o_nPHW, state_in_nHKV).to(v.dtype).view(1, S, Hv, V)
        return run

    base = None
    for mode, fn in [("plain", plain()), *((f"state {n} pieces", pieces(n)) for n in (2, 4, 8, 16))]:
        torch.cuda.reset_peak_memory_stats()
        ms = steady_ms(lambda fn=fn: fn().float().square().mean().backward(), args.iters, warmup=3)
        base = base or ms
        report.add({"mode": mode, "ms": ms, "ratio": ms / base, "peak_gib": torch.cuda.max_memory_allocated() / 2**30})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--backend", default="grouped_mm", help="expert backend")
    ap.add_argument("--gdn-op-set", default="fla")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--gdn-layer", action="store_true", help="instead of the stack: one GDN layer per op set")
    ap.add_argument("--gdn-conv", action="store_true",
                    help="instead of the stack: the GDN conv's backward, FLA's against the frozen weight's kernel")
    ap.add_argument("--gdn-state", action="store_true",
                    help="instead of the stack: state passing's per-piece delta rule vs a plain one")
    ap.add_argument("--dry", action="store_true",
                    help="CPU smoke run: tiny stack, 64 tokens, fp32, eager experts, torch GDN ops, eager only")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.gdn_layer:
        gdn_layer(args, Report("bench_hybrid_gdn_layer", [Column("mode", "mode", width=14),
                                                          Column("ms", "ms", ".2f", 8)], args.out))
        return
    if args.gdn_conv:
        gdn_conv(args, Report("bench_hybrid_gdn_conv", [Column("mode", "mode", width=22), Column("ms", "ms", ".3f", 8),
                                                        Column("ratio", "x FLA bwd", ".2f")], args.out))
        return
    if args.gdn_state:
        gdn_state(args, Report("bench_hybrid_gdn_state", [Column("mode", "mode", width=16), Column("ms", "ms", ".2f", 8),
                                                          Column("ratio", "x plain", ".2f"),
                                                          Column("peak_gib", "peak GiB", ".2f")], args.out))
        return
    device, dtype = "cuda", torch.bfloat16
    if args.dry:
        device, dtype, args.tokens, args.iters = "cpu", torch.float32, 64, 2
        args.backend, args.gdn_op_set = "eager", "torch"
        args.modes = "eager" if args.modes == "eager,compiled" else args.modes
    stack(args, device, dtype, Report("bench_hybrid", COLUMNS, args.out))


if __name__ == "__main__":
    main()

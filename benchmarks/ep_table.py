"""Issue 42's expert-parallel table from the run folders of `gpu_multi.sh epbench`: per mode, ep=1 against ep=N
with forced-balanced and random-init routing, and per layer where the traced step's time went.

    python -m benchmarks.ep_table OUT --layers 8 --eps 1 2 4

Run folders are named `ep-<mode>-L<layers>-ep<E>-<balanced|random>`; a mode `<mode>+<dispatcher>` (ep > 1 on
another dispatcher than all_to_all) is compared to its mode's ep=1 run. Throughput is the median over the run's
second half (after step 6) of metrics.jsonl (tok/s over the world, so tokens per second per GPU); the split reads rank 0's trace of step 6
(runtime.observe.profiling) with runtime.timeline and sorts the compute stream's kernels by name into experts (the
grouped GEMMs and their LoRA products), routing (the dispatch's sort, gather and combine kernels) and the rest.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from runtime.observe.timeline import analyze, load_events

KERNEL_CLASSES = {  # first match wins
    "experts": re.compile(r"grouped_linear|swiglu_backward|grouped_xty|factor_grads|grouped_mm|GroupedGemm|"
                          r"grouped_gemm|cutlass.*[Gg]roup"),
    "routing": re.compile(r"histogram_kernel|_scan_kernel|_scatter_kernel|_combine_kernel|gather_rows|"
                          r"index_(put|select)|indexFunc|scatter_gather|sort|radix"),
    "attention": re.compile(r"flash|fmha|attn|attention", re.IGNORECASE),
}


_BASE = re.compile(r"[+]\w+")  # a mode's dispatcher suffix: its ep=1 run is the mode's


def steady(run: Path, world: int) -> dict | None:
    """Median tok/s/GPU, MFU, step seconds and ep_imbalance over the second half of the run, after the traced
    step 6 (an ep=2 LoRA run still settles over steps 2-8); peak GiB over the run."""
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.open() if '"loss"' in line]
    first = max(7, rows[-1]["step"] // 2 + 1) if rows else 0
    tail = [r for r in rows if r["step"] >= first] or rows
    if not tail:
        return None
    imbalance = [r["ep_imbalance"] for r in tail if r.get("ep_imbalance")]
    return {"tok_s_gpu": statistics.median(r["tok_s"] for r in tail) / world,
            "mfu": statistics.median(r.get("mfu") or 0 for r in tail),
            "step_ms": statistics.median(r["step_s"] for r in tail) * 1e3,
            "peak": max(r.get("peak_mem_gib") or 0 for r in rows),
            "imbalance": statistics.median(imbalance) if imbalance else None,
            "recompiles": rows[-1].get("recompiles")}


def split_per_layer(run: Path, layers: int) -> dict | None:
    """Milliseconds per layer of rank 0's traced step: kernel classes on the compute stream, the compute
    stream's idle time while a collective ran (exchange) and while nothing ran (host), and the window."""
    traces = sorted((run / "profile").glob("step*_rank0.json.gz"))
    if not traces:
        return None
    events = load_events(traces[0])
    timeline = analyze(events)
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X" and "dur" in e]
    per_class = dict.fromkeys([*KERNEL_CLASSES, "nccl", "other"], 0.0)
    for e in kernels:
        name = e["name"]
        cls = "nccl" if "nccl" in name.lower() else next(
            (c for c, pattern in KERNEL_CLASSES.items() if pattern.search(name)), "other")
        per_class[cls] += e["dur"] / 1e3
    out = {c: ms / layers for c, ms in per_class.items()}
    out.update(wait_exchange=timeline.gap_comm_ms / layers, wait_host=timeline.gap_host_ms / layers,
               window=timeline.window_ms / layers)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--eps", type=int, nargs="+", required=True, help="EP sizes of the rows; 1 first")
    args = parser.parse_args(argv)
    runs = sorted(p for p in args.out.glob(f"ep-*-L{args.layers}-ep*-*") if p.is_dir())
    modes = sorted({re.sub(r"-ep\d+-(balanced|random)$", "", p.name) for p in runs})
    print("| run | tok/s/GPU | of ep1 | MFU | step ms | peak GiB | ep_imbalance | per layer ms: experts | routing "
          "| attention | nccl | other | wait exchange | wait host | traced window |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        for routing in ("balanced", "random"):
            base_mode = _BASE.sub("", mode)
            if not any(p.name.startswith(f"{base_mode}-ep") and p.name.endswith(routing) for p in runs):
                continue  # this routing was not run (EPBENCH_ROUTING)
            base = steady(args.out / f"{base_mode}-ep1-{routing}", 1)
            for ep in args.eps if "+" not in mode else args.eps[1:]:
                run = args.out / f"{mode}-ep{ep}-{routing}"
                row = steady(run, ep)
                if row is None:
                    log = args.out / f"{run.name}.log"
                    err = [ln for ln in log.read_text().splitlines() if ln.startswith("error")][:1] if log.exists() else []
                    print(f"| {run.name} | failed: {(err or ['no metrics'])[0][:120]} |")
                    continue
                ratio = f"{row['tok_s_gpu'] / base['tok_s_gpu']:.2f}" if base else "-"
                imb = f"{row['imbalance']:.2f}" if row["imbalance"] else "-"
                split = split_per_layer(run, args.layers)
                cells = " | ".join(f"{split[k]:.2f}" for k in ("experts", "routing", "attention", "nccl", "other",
                                                              "wait_exchange", "wait_host", "window")) \
                    if split else " | ".join("-" * 1 for _ in range(8))
                print(f"| {run.name} | {row['tok_s_gpu']:,.0f} | {ratio} | {row['mfu']:.3f} | {row['step_ms']:.0f} | "
                      f"{row['peak']:.1f} | {imb} | {cells} |")


if __name__ == "__main__":
    main()

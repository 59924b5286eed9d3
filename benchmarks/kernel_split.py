"""Where a training step's GPU time goes, kernel class by kernel class, for several runs side by side (issue 43's
profile of ours against Unsloth and transformers+PEFT).

    python -m benchmarks.kernel_split ours=OUT/ours_trace.json.gz unsloth=OUT/unsloth_trace.json.gz --steps 2

Each trace is a torch.profiler chrome trace of `--steps` steady training steps (bench_e2e `--profile`,
benchmarks/peers/unsloth/unsloth_train.py `--trace`). Every GPU kernel (memcpy and memset included) is put in the
first class of KERNEL_CLASSES its name matches, and in forward or backward by the host thread that launched it:
autograd runs backward on its own device thread, so a kernel launched from any thread but the one that launched
the step's first kernel is backward (the optimizer's kernels, launched by the main thread after backward, are
their own class). Prints one markdown table: ms per step of each class, forward / backward / total, per run,
then each run's largest kernels.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

KERNEL_CLASSES = {  # first match wins; the order puts specific names before the generic GEMM and copy patterns
    "communication (NCCL)": re.compile(r"nccl", re.IGNORECASE),
    "optimizer (AdamW, grad clip)": re.compile(r"multi_tensor|adam|foreach", re.IGNORECASE),
    "loss (lm_head chunks' softmax, CE)": re.compile(r"cross_entropy|log_softmax|nll_loss|logsumexp|_chunked_ce|"
                                                     r"_ce_|softmax_backward_data", re.IGNORECASE),
    # FLA's chunked delta rule (its cumsum before routing's), WY solve, conv and l2norm kernels
    "GDN (delta rule, conv, l2norm)": re.compile(r"chunk_|delta|kkt|solve_tril|inverse_kernel|recompute_w_u|"
                                                 r"wy_repr|conv1d|l2norm|tilelang", re.IGNORECASE),
    "attention core": re.compile(r"flash|fmha|attn|attention|cudnn", re.IGNORECASE),
    "norm, RoPE": re.compile(r"rms|norm|rope|rotary", re.IGNORECASE),
    "experts (grouped GEMMs, their LoRA, SwiGLU)": re.compile(
        r"grouped_linear|grouped_xty|factor_grads|swiglu|GroupedGemm|grouped_gemm|grouped_mm|[Gg]roup(ed)?_?[Gg]emm|"
        r"cutlass.*[Gg]roup|Grouped"),
    "routing (top-k, sort, gather, scatter, combine)": re.compile(
        r"histogram|_scan_kernel|_scatter_kernel|_combine_kernel|gather|scatter|index|sort|radix|topk|bincount|"
        r"histc|cumsum|softmax", re.IGNORECASE),
    "dense GEMMs (projections, router, LoRA, lm_head)": re.compile(r"nvjet|gemm|xmma|cutlass|sm90_|splitK|cublas",
                                                                    re.IGNORECASE),
    "copies, casts, elementwise": re.compile(r"elementwise|copy|memcpy|memset|fill|cat|reduce|triton_", re.IGNORECASE),
}
OTHER = "other"
_KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def classify(name: str) -> str:
    return next((cls for cls, pattern in KERNEL_CLASSES.items() if pattern.search(name)), OTHER)


def split(events: list[dict], steps: int) -> tuple[dict[tuple[str, str], float], dict[str, float], float]:
    """({(class, "fwd" | "bwd"): ms per step}, {kernel name: ms per step}, GPU busy ms per step)."""
    kernels = sorted((e for e in events if e.get("cat") in _KERNEL_CATS and e.get("ph") == "X" and "dur" in e),
                     key=lambda e: e["ts"])
    # Triton launches through the driver API, torch's kernels through the runtime API
    launcher = {e["args"]["correlation"]: e["tid"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    main_tid = next((launcher[k["args"]["correlation"]] for k in kernels
                     if k.get("args", {}).get("correlation") in launcher), None)
    by_class: dict[tuple[str, str], float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for k in kernels:
        tid = launcher.get(k.get("args", {}).get("correlation"), main_tid)
        phase = "fwd" if tid == main_tid else "bwd"
        ms = k["dur"] / 1e3 / steps
        by_class[(classify(k["name"]), phase)] += ms
        by_name[k["name"]] += ms
    return by_class, by_name, _busy_us(kernels) / 1e3 / steps


def _busy_us(kernels: list[dict]) -> float:
    """Time covered by at least one kernel (kernels on several streams that overlap count once)."""
    busy, end = 0.0, float("-inf")
    for k in kernels:  # sorted by start
        start, stop = k["ts"], k["ts"] + k["dur"]
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def table(runs: dict[str, tuple[dict, dict, float]]) -> str:
    """Markdown: a row per kernel class, fwd / bwd / total ms per step for each run; then GPU busy."""
    head = "| kernel class | " + " | ".join(f"{n} fwd | {n} bwd | {n} total" for n in runs) + " |"
    lines = [head, "|---|" + "---:|" * (3 * len(runs))]
    for cls in [*KERNEL_CLASSES, OTHER]:
        cells = []
        for by_class, _, _ in runs.values():
            fwd, bwd = by_class.get((cls, "fwd"), 0.0), by_class.get((cls, "bwd"), 0.0)
            cells += [f"{fwd:.2f}", f"{bwd:.2f}", f"{fwd + bwd:.2f}"]
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    sums = []
    for by_class, _, busy in runs.values():
        fwd = sum(v for (_, p), v in by_class.items() if p == "fwd")
        bwd = sum(v for (_, p), v in by_class.items() if p == "bwd")
        sums += [f"{fwd:.2f}", f"{bwd:.2f}", f"**{fwd + bwd:.2f}** (busy {busy:.2f})"]
    lines.append("| all kernels | " + " | ".join(sums) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="NAME=PATH of a chrome trace")
    ap.add_argument("--steps", type=int, default=2, help="training steps each trace holds")
    ap.add_argument("--top", type=int, default=12, help="largest kernels listed per run")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.traces:
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"{spec!r}: expected NAME=PATH")
        runs[name] = split(load(path), args.steps)
    print(f"ms per step ({args.steps} traced steps each); busy: GPU time covered by any kernel")
    print(table(runs))
    for name, (_, by_name, _) in runs.items():
        print(f"\n{name}: largest kernels, ms per step")
        for kernel, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {ms:7.2f}  {classify(kernel)[:12]:12s}  {kernel[:110]}")


if __name__ == "__main__":
    main()

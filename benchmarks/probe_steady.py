"""Why back-to-back timings of the expert layer exceed its kernel sum: the GPU's clocks under sustained load.

    python benchmarks/probe_steady.py

Qwen3-30B-A3B shapes, T=8192, scattermoe, full and LoRA r=16. For each mode: the mean ms per fwd+bwd of
n calls issued back to back (n = 3, 10, 30, 100, then 10 again) with the SM clock read right after;
10 steps under the profiler (kernel span and kernel sum per step); and the layer captured
in one CUDA graph replayed 10 and 100 times back to back (GPU time alone, no host).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_experts import (
    fwd_bwd_step,
    kernel_sum_and_span,
    make_case,
    profiled_kernels,
    sm_clock_mhz,
    steady_time_ms,
)
from benchmarks.cuda_graphs import capture_graph


def profiled_steps(step, n: int = 10) -> str:
    busy, span = kernel_sum_and_span(profiled_kernels(step, n))
    return f"span {span / n:.3f} ms/step, kernel sum {busy / n:.3f}"


def main() -> None:
    for mode in ("full", "lora16"):
        ex, x, ids, w, _ = make_case("qwen3-30b-a3b", 8192, mode, ep=1)
        step = fwd_bwd_step("scattermoe", ex, x, ids, w)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        for n in (3, 10, 30, 100, 10):
            print(f"== {mode} steady n={n}: {steady_time_ms(step, n, warmup=1):.3f} ms/step, SM clock after "
                  f"{sm_clock_mhz()} MHz", flush=True)
        print(f"== {mode} profiled 10 steps: {profiled_steps(step)}", flush=True)
        graph = capture_graph(step)
        for n in (10, 100):
            ms = steady_time_ms(graph.replay, n, warmup=2)
            print(f"== {mode} graph replays back to back n={n}: {ms:.3f} ms/step, "
                  f"SM clock after {sm_clock_mhz()} MHz", flush=True)
        del graph, step, ex, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""The expert layer under torch.compile(mode="reduce-overhead"): CUDA graphs take the host out of the step.

    python benchmarks/probe_graphs.py

scattermoe at Qwen3-30B-A3B shapes (T=8192), full and LoRA r=16, all slots valid (ep1) and 75% -1 slots
(ep4): steady ms per fwd+bwd (calls back to back) eager and compiled with inductor's CUDA graphs (the
moert::scattermoe_* ops hold no host sync and every size comes from the shapes, so the graphs replay),
the two timed in turns, and the compiled output and gradients against the eager ones.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_experts import fwd_bwd_step, make_case, sm_clock_mhz, steady_time_ms
from moe.backends import expert_backend


def steps(mode: str, ep: int):
    """(eager step, compiled step, the two runs' outputs and gradients) for one case."""
    ex, x, ids, w, _ = make_case("qwen3-30b-a3b", 8192, mode, ep)
    backend = expert_backend("scattermoe")
    compiled = torch.compile(lambda *a: backend(*a), mode="reduce-overhead", fullgraph=True)
    dy = torch.randn_like(x)
    params = [p for p in ex.parameters() if p.requires_grad] + [x, w]

    def results(step):
        y = step()
        torch.cuda.synchronize()
        return [y.detach().clone()] + [p.grad.detach().clone() for p in params]

    eager, graphed = (fwd_bwd_step(fn, ex, x, ids, w, dy) for fn in (backend, compiled))
    return eager, graphed, results(eager), results(graphed)


def main() -> None:
    for mode in ("full", "lora16"):
        cases = {}
        for ep in (1, 4):
            eager, graphed, ref, got = steps(mode, ep)
            errs = [((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
                    for g, r in zip(got, ref)]
            print(f"== {mode} ep{ep}: compiled vs eager, worst norm-relative error over y and grads "
                  f"{max(errs):.1e}", flush=True)
            cases[ep] = {"eager": eager, "graphs": graphed}
            for fn in cases[ep].values():
                steady_time_ms(fn, 3, warmup=3)
        times = {(ep, kind): [] for ep in cases for kind in cases[ep]}
        for _ in range(3):
            for ep, fns in cases.items():
                for kind, fn in fns.items():
                    times[ep, kind].append(steady_time_ms(fn, 10, warmup=1))
        ms = {key: statistics.median(v) for key, v in times.items()}
        for kind in ("eager", "graphs"):
            print(f"== {mode} {kind}: steady ep1 {ms[1, kind]:.3f} ms, ep4 {ms[4, kind]:.3f} ms, ratio "
                  f"{ms[4, kind] / ms[1, kind]:.3f} (SM clock after {sm_clock_mhz()} MHz)", flush=True)
        del cases
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

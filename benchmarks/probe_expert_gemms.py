"""Where the grouped expert GEMMs lose time, at Qwen3-30B-A3B shapes (T=8192, one GPU).

    python benchmarks/probe_expert_gemms.py [--timeline | --host-costs | --kernels | --factor-grads |
                                             --host-gaps]

Default: the host timeline, then 1-3. --timeline: 4 only; --host-costs: 5 only; --kernels: 6 and 3;
--factor-grads: 7 only; --host-gaps: 8 only.

1. Tile-tail waste: each expert's last row block is partly empty (on average BLOCK_M/2 rows of an
   expert's ~512). The same GEMMs timed with random routing (as the benchmark) and with exactly
   S/E rows per expert (a multiple of every BLOCK_M: no tail) show what the tails cost.
2. Config sweep of the gate_up kernel: every candidate config timed alone (the autotuner keeps the best
   of GEMM_CONFIGS; extra ones here are candidates to add).
3. Every CUDA kernel of a fwd+bwd, named (bench_experts.profile_kernels: 3 steps back to back).
4. The host timeline of one fwd+bwd: when each kernel was launched and when it ran, relative to the
   call (GPU idle at the start), the GPU's idle gaps, and the host ops that cost the most.
5. Host us per call of each primitive (T=8192 with the GPU idle or busy; T=64 in a loop), and of the
   whole layer at T=64 split into sort / forward / backward, next to the autograd floor.
6. The SwiGLU-backward pass alone for several tiles, without and with the gate_up LoRA rank product.
7. The LoRA backward's factor-gradient launch for each of a sweep of configs.
8. Host us between consecutive Triton launches of a fwd+bwd (perf_counter at each direct launch, no
   profiler: its CPU tracing inflates the host several times), median over steps issued back to back.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_experts import (
    MODES,
    cuda_time_ms,
    fwd_bwd_step,
    make_case,
    print_cprofile,
    profile_kernels,
)
from moe.backends import expert_backend
from moe.kernels import grouped_linear as gl
from moe.kernels.routing import gather_rows, sort_slots

E, H, I, K_TOP, T = 128, 2048, 768, 8, 8192


def ms(fn) -> float:
    return statistics.median(cuda_time_ms(fn, 20, 5))


def routings():
    gen = torch.Generator(device="cuda").manual_seed(0)
    _, rand_ids = torch.randn(T, E, device="cuda", generator=gen).softmax(-1).topk(K_TOP, dim=-1)
    # Balanced: slot j of row t goes to expert (t*k + j) % E (distinct within a row since k <= E), so every
    # expert gets exactly T*k/E rows.
    base = (torch.arange(T, device="cuda")[:, None] * K_TOP + torch.arange(K_TOP, device="cuda")[None, :]) % E
    return {"random": rand_ids, "balanced": base}


def tail_waste() -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = torch.rand(T, K_TOP, device="cuda")
    hw = torch.randn(T * K_TOP, I, device="cuda", dtype=torch.bfloat16)
    for name, ids in routings().items():
        slots = sort_slots(ids, E)
        counts = slots.offsets_E1.diff()
        out = torch.empty(T * K_TOP, H, device="cuda", dtype=torch.bfloat16)
        t_gu = ms(lambda slots=slots: gl.gate_up_swiglu(x, slots, w_gu, None, weights))
        t_down_ours = ms(lambda slots=slots, out=out: gl._launch(hw, slots, w_down, H, None, None, out, gather=False))
        t_down_cutlass = ms(lambda slots=slots: gl._cutlass_gemm(hw, slots, w_down))
        print(f"== tail {name:8} rows/expert {counts.min().item()}..{counts.max().item()}: gate_up ours "
              f"{t_gu:.3f} ms, down ours {t_down_ours:.3f}, down CUTLASS {t_down_cutlass:.3f}", flush=True)


EXTRA_CONFIGS = [(64, 256, 64, 4, 3), (64, 256, 64, 4, 4), (128, 256, 32, 8, 5), (256, 128, 64, 8, 4),
                 (128, 128, 64, 4, 4), (256, 256, 64, 8, 2), (128, 256, 64, 8, 2)]


def config_sweep() -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = torch.rand(T, K_TOP, device="cuda")
    slots = sort_slots(routings()["random"], E)
    S = slots.num_slots
    gu = torch.empty(S, 2 * I, device="cuda", dtype=torch.bfloat16)
    h = torch.empty(S, I, device="cuda", dtype=torch.bfloat16)
    kernel = gl._grouped_linear_kernel.fn  # below the autotuner
    configs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
               for c in gl.GEMM_CONFIGS if c.kwargs["BLOCK_N"] >= 128] + EXTRA_CONFIGS
    for bm, bn, bk, warps, stages in configs:
        grid = ((triton.cdiv(S, bm) + E) * triton.cdiv(I, bn // 2),)

        def run(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, grid=grid):
            kernel[grid](x, x.stride(0), x.stride(1), slots.order_S, slots.offsets_E1, K_TOP,
                         w_gu, *w_gu.stride(), None, 0, 0, 0, None, 0, 0, 0, None, 0, gu, gu.stride(0),
                         h, h.stride(0), weights.view(-1), 0.0, S, E, I, 0, 1, K=H,
                         GATHER=True, HAS_LORA=False, LORA_IN_LOOP=False, GLU_FWD=True, TMA=False,
                         W_T=False, BLOCK_E=256, BLOCK_R=16, PERSISTENT=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         num_warps=warps, num_stages=stages)
        try:
            t = ms(run)
            print(f"== gate_up config {bm}x{bn}x{bk} w{warps} s{stages}: {t:.3f} ms "
                  f"({2 * S * H * 2 * I / t / 1e9:.0f} TFLOP/s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - a config that does not fit: say so, go on
            print(f"== gate_up config {bm}x{bn}x{bk} w{warps} s{stages}: n/a {type(exc).__name__}", flush=True)


def swiglu_backward_tiles() -> None:
    """The SwiGLU-backward pass alone (its GEMM done beforehand) for several (BLOCK_M, BLOCK_N, warps)."""
    w_down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = torch.rand(T, K_TOP, device="cuda")
    slots = sort_slots(routings()["random"], E)
    S = slots.num_slots
    dyg = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(S, 2 * I, device="cuda", dtype=torch.bfloat16)
    gu_B = torch.randn(E, 2 * I, 16, device="cuda", dtype=torch.bfloat16)
    g = gl.expert_gemm(dyg, slots, w_down.transpose(1, 2))
    saved = gl._SWIGLU_BWD_TILE
    saved_lora = gl._SWIGLU_BWD_TILE_LORA
    for tile in ((64, 64, 4), (32, 128, 4), (64, 128, 8), (128, 64, 8), (32, 64, 4), (64, 32, 4)):
        gl._SWIGLU_BWD_TILE = gl._SWIGLU_BWD_TILE_LORA = tile
        full = ms(lambda: gl.swiglu_backward(g, slots, gu, weights))
        lora = ms(lambda: gl.swiglu_backward(g, slots, gu, weights, gu_B))
        print(f"== swiglu_bwd tile {tile}: pass {full:.3f} ms, with d gate_up B_gu {lora:.3f} ms", flush=True)
    gl._SWIGLU_BWD_TILE, gl._SWIGLU_BWD_TILE_LORA = saved, saved_lora
    dgu = gl.swiglu_backward(g, slots, gu, weights)[0]
    rank = ms(lambda: gl.expert_linear(dgu, slots, gu_B.transpose(1, 2), None, gather=False))
    print(f"== d gate_up B_gu as its own rank product (after the pass without it): {rank:.3f} ms", flush=True)


FACTOR_SWEEP = [(bq, bk, w, st) for bq, bk in ((64, 64), (128, 64), (128, 128), (256, 64), (256, 32), (64, 128))
                for w, st in ((4, 3), (4, 4), (8, 3))]


def factor_grads_sweep() -> None:
    """The LoRA backward's four factor gradients (one launch) for each (BLOCK_Q, BLOCK_K, warps, stages),
    at r=16: dA_gu (x gathered), dB_gu, dA_down, dB_down (dy gathered)."""
    from moe.kernels import grouped_xty as gx
    slots = sort_slots(routings()["random"], E)
    S, r = slots.num_slots, 16

    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    x, dy, dgu, hw = t(T, H), t(T, H), t(S, 2 * I), t(S, I)
    problems = [gx.FactorGrad(t(S, r), x, gather_r=True), gx.FactorGrad(t(S, r), dgu, transposed=True),
                gx.FactorGrad(t(S, r), hw), gx.FactorGrad(t(S, r), dy, gather_r=True, transposed=True)]
    outs = [gx._factor_out(p, E)[1] for p in problems]
    args = [a for p, o in zip(problems, outs) for a in gx._factor_args(p, o)]
    tuned = ms(lambda: gx.lora_factor_grads(problems, slots, 0.5))
    print(f"== factor grads, autotuned: {tuned:.3f} ms", flush=True)
    for bq, bk, warps, stages in FACTOR_SWEEP:
        grid = (sum(triton.cdiv(p.R.shape[1], bq) for p in problems), E)

        def run(bq=bq, bk=bk, warps=warps, stages=stages, grid=grid):
            gx._factor_grads_kernel.fn[grid](*args, slots.rows_S, slots.offsets_E1, 0.5, S, NUM=4, GATHER_0=True,
                                             GATHER_1=False, GATHER_2=False, GATHER_3=True, BLOCK_P=16,
                                             BLOCK_Q=bq, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        try:
            print(f"== factor grads {bq}x{bk} w{warps} s{stages}: {ms(run):.3f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001 - a config that does not fit: say so, go on
            print(f"== factor grads {bq}x{bk} w{warps} s{stages}: n/a {type(exc).__name__}", flush=True)


def host_timeline() -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for mode, ep in (("full", 1), ("full", 4), ("lora16", 1), ("lora16", 4)):
        step = fwd_bwd_step("scattermoe", *make_case("qwen3-30b-a3b", T, mode, ep=ep)[:4])

        def fwd_bwd(step=step):
            with torch.profiler.record_function("fwd_bwd"):
                step()
        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fwd_bwd()
            torch.cuda.synchronize()
        events = prof.events()
        t0 = min(e.time_range.start for e in events if e.name == "fwd_bwd")
        kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
        launches = sorted((e for e in events if e.device_type == DeviceType.CPU and "Launch" in e.name),
                          key=lambda e: e.time_range.start)
        print(f"\n== timeline {mode} ep{ep}: us from the call; kernel start/end, gap before it")
        prev_end = t0
        for e in kernels:
            gap = e.time_range.start - prev_end
            print(f"  {e.time_range.start - t0:8.1f} {e.time_range.end - t0:8.1f}  gap {gap:7.1f}  {e.name[:60]}")
            prev_end = max(prev_end, e.time_range.end)
        print(f"  launches at (us): {[round(e.time_range.start - t0) for e in launches]}")
        cpu_ops = prof.key_averages()
        top = sorted((a for a in cpu_ops if a.self_cpu_time_total > 0), key=lambda a: -a.self_cpu_time_total)[:15]
        for a in top:
            print(f"  host {a.self_cpu_time_total:8.1f} us x{a.count:3d}  {a.key[:70]}")


def host_costs() -> None:
    """Host us per call of each primitive the layer uses, at tiny shapes (the GPU never falls behind)."""
    import time

    from moe.kernels.routing import _combine_kernel, combine
    from gpu.launch import current_device, launch

    def us(fn, n=300) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return dt

    Ts, Es = 64, 128
    ids = torch.randint(0, Es, (Ts, K_TOP), device="cuda")
    slots = sort_slots(ids, Es)
    z = torch.randn(Ts * K_TOP, 64, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(Ts, 64, device="cuda", dtype=torch.bfloat16)
    args = (z, z.stride(0), slots.inv_S, slots.ids_S, None, y, y.stride(0), 64)
    meta = {"TOPK": K_TOP, "HAS_W": False, "BLOCK_H": 64, "num_warps": 4}
    a2 = torch.randn(Ts * K_TOP, 64, device="cuda", dtype=torch.bfloat16)
    w3 = torch.randn(Es, 64, 64, device="cuda", dtype=torch.bfloat16)
    offs = slots.offsets_E1[1:]
    xs = torch.randn(Ts, 64, device="cuda", dtype=torch.bfloat16)
    costs = {
        "torch.empty": lambda: torch.empty(1024, device="cuda"),
        "current_device": current_device,
        "raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "launch() combine": lambda: launch(_combine_kernel, (Ts, 1), args, meta),
        "triton kernel[grid] combine": lambda: _combine_kernel[(Ts, 1)](*args, **meta),
        "combine()": lambda: combine(z, slots, None),
        "sort_slots": lambda: sort_slots(ids, Es),
        "_grouped_mm 2d x 3d": lambda: torch._grouped_mm(a2, w3.transpose(1, 2), offs=offs),
        "_grouped_mm 2d x 2d": lambda: torch._grouped_mm(a2.t(), a2, offs=offs),
        "gather_rows": lambda: gather_rows(xs, slots),
    }
    for name, fn in costs.items():
        print(f"== host {name:28} {us(fn):7.1f} us", flush=True)
    for mode in ("full", "lora16"):
        ex, x, ids_, w, _ = make_case("qwen3-30b-a3b", 64, mode, ep=1)
        backend = expert_backend("scattermoe")
        fwd_bwd = fwd_bwd_step("scattermoe", ex, x, ids_, w)

        def fwd(backend=backend, x=x, ids_=ids_, w=w, ex=ex):
            with torch.no_grad():
                backend(x, ids_, w, ex)

        print(f"== host layer {mode} T=64: fwd {us(fwd, 100):7.1f} us, fwd+bwd {us(fwd_bwd, 100):7.1f} us", flush=True)
        import moe.backends.scattermoe as sm
        spent = {"_forward": [], "_backward": [], "sort_slots": []}

        def timed(name, fn, spent=spent):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                out = fn(*a, **k)
                spent[name].append(time.perf_counter() - t0)
                return out
            return wrapper
        saved = {name: getattr(sm, name) for name in spent}
        for name in spent:
            setattr(sm, name, timed(name, saved[name]))
        total = us(fwd_bwd, 100)
        for name in spent:
            setattr(sm, name, saved[name])
        parts = ", ".join(f"{name} {1e6 * statistics.median(v):.1f}" for name, v in spent.items())
        print(f"== host layer {mode} T=64 split: fwd+bwd {total:.1f} us; {parts} us", flush=True)
        xg = torch.randn(64, device="cuda", requires_grad=True)
        g = torch.ones(64, device="cuda")
        print(f"== host autograd floor (x*2).backward: {us(lambda xg=xg, g=g: (xg * 2).backward(g)):.1f} us",
              flush=True)
        print_cprofile(fwd_bwd, 100, "cumtime", 45, prefix="== ")


def host_costs_big() -> None:
    """Host us of each op at T=8192 (GPU idle before each call): does any host cost grow with size?"""
    import time

    from moe.kernels.routing import combine

    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = torch.rand(T, K_TOP, device="cuda")
    ids = routings()["random"]
    slots = sort_slots(ids, E)
    S = slots.num_slots
    hw = torch.randn(S, I, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(S, 2 * I, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
    ops = {
        "empty [S, 2I]": lambda: torch.empty(S, 2 * I, device="cuda", dtype=torch.bfloat16),
        "sort_slots": lambda: sort_slots(ids, E),
        "gate_up_swiglu": lambda: gl.gate_up_swiglu(x, slots, w_gu, None, weights),
        "grouped_mm down": lambda: gl.expert_gemm(hw, slots, w_down),
        "grouped_mm dW_down": lambda: torch._grouped_mm(z.t(), hw, offs=slots.offsets_E1[1:]),
        "combine": lambda: combine(z, slots, None),
        "gather_rows": lambda: gather_rows(x, slots),
        "swiglu_backward": lambda: gl.swiglu_backward(z[:, :I], slots, gu, weights),
    }
    for name, fn in ops.items():
        fn()
        times = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        busy = []
        for _ in range(7):  # the same call while the GPU is busy (a big GEMM queued first)
            torch.cuda.synchronize()
            gl.gate_up_swiglu(x, slots, w_gu, None, weights)
            t0 = time.perf_counter()
            fn()
            busy.append((time.perf_counter() - t0) * 1e6)
        print(f"== big {name:20} idle GPU {statistics.median(times):7.1f} us, busy GPU "
              f"{statistics.median(busy):7.1f} us", flush=True)


def host_gaps(steps: int = 40) -> None:
    """Host us between consecutive direct Triton launches of the layer's fwd+bwd (section 8)."""
    import time

    import gpu.launch as tl_launch

    direct = tl_launch._launch_compiled
    stamps = []

    def stamped(entry, *args):
        stamps.append((time.perf_counter(), entry.kernel.name))
        direct(entry, *args)

    for mode, ep in (("full", 1), ("lora16", 1), ("lora16", 4)):
        step = fwd_bwd_step("scattermoe", *make_case("qwen3-30b-a3b", T, mode, ep=ep)[:4])
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        tl_launch._launch_compiled = stamped
        try:
            per_step, ends = [], []
            for _ in range(steps):
                stamps.clear()
                t0 = time.perf_counter()
                step()
                ends.append(time.perf_counter() - t0)
                per_step.append([(t - t0, name) for t, name in stamps])
        finally:
            tl_launch._launch_compiled = direct
        torch.cuda.synchronize()
        print(f"\n== host gaps {mode} ep{ep}: median us from the previous Triton launch (the first: from the "
              f"call), over {steps} steps back to back; host per step {1e3 * statistics.median(ends):.3f} ms")
        prev = [0.0] * steps
        for i, (_, name) in enumerate(per_step[0]):
            gaps = [1e6 * (launches[i][0] - prev[j]) for j, launches in enumerate(per_step)]
            prev = [launches[i][0] for launches in per_step]
            print(f"  {statistics.median(gaps):7.1f}  {name}")
        tail_us = 1e6 * statistics.median(e - p for e, p in zip(ends, prev))
        print(f"  {tail_us:7.1f}  (to the end of the call)")


if __name__ == "__main__":
    if "--host-gaps" in sys.argv:
        host_gaps()
        sys.exit(0)
    if "--host-costs" in sys.argv:
        host_costs_big()
        host_costs()
        sys.exit(0)
    if "--factor-grads" in sys.argv:
        factor_grads_sweep()
        sys.exit(0)
    if "--kernels" in sys.argv:
        swiglu_backward_tiles()
        profile_kernels(["qwen3-30b-a3b"], T, ["scattermoe"], list(MODES))
        sys.exit(0)
    host_timeline()
    if "--timeline" not in sys.argv:
        tail_waste()
        config_sweep()
        profile_kernels(["qwen3-30b-a3b"], T, ["scattermoe"], list(MODES))

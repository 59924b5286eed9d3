"""Expert layer (gate_up + SwiGLU + down + routing-weighted combine), forward and forward+backward.

    python -m benchmarks.bench_experts [--quick] [--out DIR] [--backends eager,transformers,grouped_mm,scattermoe]
    python -m benchmarks.bench_experts --dry          # CPU smoke run at a tiny shape; its numbers mean nothing
    python -m benchmarks.bench_experts --quant mxfp4,nvfp4 --modes lora16   # bf16 and packed experts, side by side

Per MoE shape (harness.SHAPES; T=8192 tokens, --quick: T=2048 and two shapes), backend and mode it reports
the median time over CUDA events after warmup (autotuning happens in the warmup; each call starts on an
idle GPU), the fwd+bwd time of calls issued back to back ("steady": the host runs ahead, as in a
training step; also for the forward alone), the peak memory above the resident tensors, and achieved
TFLOP/s (valid slots only) next to a bf16 matmul rate measured in the same run. Modes: `full` (base
weights trained, no LoRA) and `lora16` (LoRA r=16 on a frozen base), each with all slots valid (ep1)
and in the sentinel layout an EP rank sees (ep2/ep4: the rank owns the first 1/ep of the experts,
every other slot is -1); `lora16-mxfp4` / `lora16-nvfp4` / `lora16-fp8` (asked for by --modes, or --quant
mxfp4,nvfp4,fp8, which adds them and the bf16 lora16 rows beside them) run LoRA r=16 on quantized experts, and
`full-fp8` (--quant fp8 adds it beside `full`) the full fine-tune's expert GEMMs in FP8 (the backends declaring
train_fp8: grouped_mm, scattermoe).
Backends: ours (`eager` per-expert loop, `grouped_mm`, `scattermoe`),
`transformers` (its own Qwen3MoeExperts on grouped_mm, LoRA by PEFT: what users would run instead;
benchmarks/baselines/transformers_experts.py) and `scattermoe-fused` (scattermoe's fused-LoRA path
forced; it picks it by itself only for small experts). MHz is the SM clock after the steady timing.
Then it checks the targets (set for one H200 at Qwen3-30B-A3B shapes, T=8192), and times the 75% -1
ratio once more with the ep1 and ep4 cases in turns, at the same clocks: for one layer, and per layer
of 4 layers under one backward call (as in a model). A variant that fails prints its error and the
table goes on. `--out DIR` writes DIR/bench_experts.json (rewritten after every row).

Instead of the table: `--profile` prints the per-kernel CUDA times of fwd+bwd steps (which kernel to work
on), `--host` the host (CPU) time of one fwd+bwd next to its call-to-done and CUDA-graph (GPU-only) times
and a cProfile of the host time, `--graphs` the steady fwd+bwd eager and under
torch.compile(mode="reduce-overhead") (CUDA graphs take the host out of the step), `--clocks` why
back-to-back steps run slower than one: steady time after n = 3..100 steps with the SM clock after,
kernel sum and span of profiled steps, CUDA-graph replays x10 / x100, and NVML (clock, power against
its limit, temperature, the driver's clock reasons) while the graph replays for ~2 s; `--gemms` each GEMM that
reads a packed weight in a LoRA step, on bf16 weights and on MXFP4 / NVFP4 (GPU only); `--fp8-gemms` the layer's
bare grouped GEMMs (forward, dX, dW) in bf16 against FP8 (GPU, sm90+: the ceiling FP8 sets); `--floor` the layer's
GEMMs as plain dense matmuls over all slots (the bound a grouped layer cannot beat) beside scattermoe's layer.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.baselines.transformers_experts import transformers_layer
from benchmarks.harness import (
    MOE_SHAPES,
    SHAPES,
    Column,
    Report,
    capture_graph,
    clocks_under_load,
    event_times_ms,
    kernel_sum_and_span,
    matmul_tflops,
    print_cprofile,
    profiled_kernels,
    sm_clock_mhz,
    steady_ms,
)
from moe.backends import EXPERT_BACKENDS, expert_backend
from moe.experts import GroupedExperts
from quant import quantize_experts

MODES = {"full": 0, "lora16": 16}  # LoRA rank; a LoRA mode freezes the base weights
# LoRA r=16 on quantized experts (quant.base_weights), and the full fine-tune's GEMMs in FP8 (quant.train_fp8),
# run when asked for by --modes or --quant
QUANT_MODES = {"lora16-mxfp4": 16, "lora16-nvfp4": 16, "lora16-fp8": 16, "full-fp8": 0}
QUANT = ("none", "mxfp4", "nvfp4", "fp8")


def with_quant(modes: list[str], quant: str) -> list[str]:
    """--quant none|mxfp4|nvfp4|fp8 (comma-separated): the modes plus the LoRA mode on experts quantized in each
    format (fp8 also: the full fine-tune in FP8), with their bf16 rows in the same run for the comparison."""
    formats = [q for q in quant.split(",") if q != "none"]
    unknown = [q for q in formats if q not in QUANT]
    if unknown:
        raise SystemExit(f"--quant: unknown {unknown}; choose from {','.join(QUANT)}")
    if not formats:
        return modes
    added = ["lora16", *(f"lora16-{fmt}" for fmt in formats)]
    if "fp8" in formats:
        added += ["full", "full-fp8"]
    return modes + [m for m in added if m not in modes]
EAGER_MAX_SECONDS = 5.0  # an eager fwd+bwd slower than this is reported from its one timed call
TRANSFORMERS = "transformers"  # the baseline's row name


@dataclass
class Case:
    """Where and in what precision the layers are built: the GPU in bf16, or the CPU for --dry."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16


CASE = Case()


@dataclass
class Row:
    shape: str
    tokens: int
    mode: str
    ep: int
    backend: str
    fwd_ms: float | None = None
    fwd_steady_ms: float | None = None  # forward calls back to back
    fwd_bwd_ms: float | None = None
    steady_ms: float | None = None  # fwd+bwd, calls back to back (harness.steady_ms)
    clock_mhz: int | None = None  # SM clock right after the steady fwd+bwd (the clocks it ran at)
    peak_gib: float | None = None
    tflops: float | None = None
    pct_matmul: float | None = None
    note: str = ""


COLUMNS = [Column("shape", "shape", width=15), Column("tokens", "T", "d", width=5), Column("mode", "mode", width=6),
           Column("ep", "ep", "d"), Column("backend", "backend", width=16), Column("fwd_ms", "fwd ms", ".3f"),
           Column("fwd_steady_ms", "fwd st", ".3f"), Column("fwd_bwd_ms", "fwd+bwd ms", ".3f"),
           Column("steady_ms", "steady ms", ".3f"), Column("clock_mhz", "MHz", "d"),
           Column("peak_gib", "peak GiB", ".2f"), Column("tflops", "TFLOP/s", ".0f"),
           Column("pct_matmul", "%mm", ".0f")]


def layer_flops(valid_slots: int, H: int, I: int, rank: int, train_base: bool) -> float:
    """FLOPs of one fwd+bwd: the base GEMMs (dW only when trained) plus the LoRA products."""
    base = 2 * valid_slots * H * 3 * I          # gate_up (2I x H) + down (H x I)
    lora = 2 * valid_slots * rank * (2 * H + 3 * I)  # x A^T and (xA) B^T for both projections
    # backward: dX through the base and through the rank (= forward), dA + dB (= forward again)
    return base * (3 if train_base else 2) + lora * 3


def make_case(shape: str, T: int, mode: str, ep: int):
    """(experts, x, ids, weights, flops): the layer an EP rank of `ep` sees, owning the first E/ep experts."""
    s = SHAPES[shape]
    rank = {**MODES, **QUANT_MODES}[mode]
    gen = torch.Generator(device=CASE.device).manual_seed(0)
    w, ids = torch.randn(T, s.experts, device=CASE.device, generator=gen).softmax(-1).topk(s.top_k, dim=-1)
    E_local = s.experts // ep
    ids = torch.where(ids < E_local, ids, -1)
    ex = GroupedExperts(E_local, s.hidden, s.intermediate, lora_rank=rank, lora_alpha=2 * rank if rank else None,
                        device=CASE.device, dtype=CASE.dtype)
    if rank:
        ex.base_weight("gate_up").requires_grad_(False)
        ex.base_weight("down").requires_grad_(False)
    if mode == "full-fp8":
        ex.fp8_training = True
    elif mode in QUANT_MODES:
        quantize_experts(ex, mode.partition("-")[2])
    x = torch.randn(T, s.hidden, device=CASE.device, dtype=CASE.dtype, requires_grad=True)
    w = w.to(CASE.dtype).requires_grad_(True)
    flops = layer_flops(int((ids >= 0).sum()), s.hidden, s.intermediate, rank, train_base=not rank)
    return ex, x, ids, w, flops


def fwd_bwd_step(backend, ex, x, ids, w, dy=None):
    """One training step of the layer alone: grads set to None (as after an optimizer step), fwd, bwd;
    it returns the output. `backend`: a registered name or a callable with the backend signature. `ex`
    may also be a list of experts: that many layers in a row (x -> layer 1 -> layer 2 ...) under one
    backward call, as in a model. dy: the output gradient (random when not given)."""
    layers = ex if isinstance(ex, list) else [ex]
    backend = expert_backend(backend) if isinstance(backend, str) else backend
    dy = torch.randn_like(x) if dy is None else dy
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad] + [x, w]

    def fwd_bwd():
        for p in params:
            p.grad = None
        h = x
        for layer in layers:
            h = backend(h, ids, w, layer)
        h.backward(dy)
        return h
    return fwd_bwd


@contextlib.contextmanager
def forced_fused_lora():
    """scattermoe's fused-LoRA path at any shape, to compare it with the split path it picks there."""
    import moe.backends.scattermoe as sm
    saved = sm._SPLIT_MIN_WEIGHT_ELEMS
    sm._SPLIT_MIN_WEIGHT_ELEMS = 1 << 62
    try:
        yield
    finally:
        sm._SPLIT_MIN_WEIGHT_ELEMS = saved


VARIANTS = {"scattermoe-fused": forced_fused_lora}


def layer_case(row: Row):
    """(layer, backend, x, ids, w, flops) of the row: our experts and backend, or transformers' own."""
    ex, x, ids, w, flops = make_case(row.shape, row.tokens, row.mode, row.ep)
    if row.backend == TRANSFORMERS:
        layer, backend, ids = transformers_layer(ex, ids)
        return layer, backend, x, ids, w, flops
    backend = expert_backend("scattermoe" if row.backend in VARIANTS else row.backend)
    return ex, with_valid_slots(backend, ids), x, ids, w, flops


def with_valid_slots(backend, ids):
    """The backend as MoEBlock calls it under EP: with the dispatcher's valid-slot count (scattermoe sizes its
    expert-sorted buffers by it)."""
    return functools.partial(backend, valid_slots=int((ids >= 0).sum()))


def sync() -> None:
    if CASE.device == "cuda":
        torch.cuda.synchronize()


def bench_row(row: Row, iters: int, warmup: int, matmul: float | None) -> Row:
    variant = VARIANTS.get(row.backend)
    with variant() if variant else contextlib.nullcontext():
        ex, backend, x, ids, w, flops = layer_case(row)
        fwd_bwd = fwd_bwd_step(backend, ex, x, ids, w)

        def fwd():
            with torch.no_grad():
                backend(x, ids, w, ex)

        if row.backend == "eager":  # per-expert loop with host syncs: time one call, cap the repetitions
            t0 = time.perf_counter()
            fwd_bwd()
            sync()
            seconds = time.perf_counter() - t0
            if seconds > EAGER_MAX_SECONDS:
                row.fwd_bwd_ms, row.note = 1e3 * seconds, "eager: one wall-clock fwd+bwd, no repeats"
                return row
            iters, warmup = min(iters, 2), 0
        row.fwd_ms = statistics.median(event_times_ms(fwd, iters, warmup))
        if row.backend != "eager":
            row.fwd_steady_ms = steady_ms(fwd, iters)
        fwd_bwd()  # grads allocated before the memory baseline, as in a training step
        sync()
        on_gpu = CASE.device == "cuda"
        if on_gpu:
            base_bytes = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        row.fwd_bwd_ms = statistics.median(event_times_ms(fwd_bwd, iters, warmup))
        if on_gpu:
            row.peak_gib = (torch.cuda.max_memory_allocated() - base_bytes) / 2**30
        if row.backend != "eager":
            row.steady_ms = steady_ms(fwd_bwd, iters)
            row.clock_mhz = sm_clock_mhz()
        row.tflops = flops / row.fwd_bwd_ms / 1e9
        row.pct_matmul = 100 * row.tflops / matmul if matmul else None
    return row


def run_shape(shape: str, T: int, backends: list[str], modes: list[str], iters: int, matmul: float | None,
              report: Report) -> list[Row]:
    rows = []
    for mode in modes:
        for ep in (1, 2, 4):
            extra = ["scattermoe-fused"] if "scattermoe" in backends and mode == "lora16" and ep == 1 else []
            # the baseline has no quantized experts: its bf16 row of the mode is the comparison
            names = [b for b in backends if not (mode in QUANT_MODES and b == TRANSFORMERS)
                     and not (mode == "full-fp8" and not EXPERT_BACKENDS.capabilities(b).train_fp8)]
            for name in names + extra:
                row = Row(shape, T, mode, ep, name)
                try:
                    bench_row(row, iters, warmup=3, matmul=matmul)
                except Exception as exc:  # noqa: BLE001 (a failing row is reported in the table; the others still run)
                    first_line = str(exc).splitlines()[0][:90] if str(exc) else ""
                    row.note = f"n/a: {type(exc).__name__}: {first_line}"
                if CASE.device == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                report.add(row)
    return rows


def targets(rows: list[Row]) -> list[dict]:
    """The issue's targets, at Qwen3-30B-A3B shapes for scattermoe (set for one H200 at T=8192)."""
    def get(mode, ep, field, backend="scattermoe"):
        for r in rows:
            if (r.shape, r.mode, r.ep, r.backend) == ("qwen3-30b-a3b", mode, ep, backend):
                return getattr(r, field)
        return None

    def ratio(a, b):
        return a / b if a is not None and b else None

    checks = [
        ("full fine-tune fwd+bwd ms", get("full", 1, "fwd_bwd_ms"), 4.0),
        ("LoRA r=16 frozen base fwd+bwd ms", get("lora16", 1, "fwd_bwd_ms"), 3.0),
        ("LoRA fwd overhead over base fwd",
         ratio(get("lora16", 1, "fwd_ms"), get("full", 1, "fwd_ms")), 1.15),
        ("  same, fused-LoRA path forced", ratio(get("lora16", 1, "fwd_ms", "scattermoe-fused"),
                                                 get("full", 1, "fwd_ms")), 1.15),
        ("full: 75% -1 slots / all valid",
         ratio(get("full", 4, "fwd_bwd_ms"), get("full", 1, "fwd_bwd_ms")), 0.35),
        ("LoRA: 75% -1 slots / all valid",
         ratio(get("lora16", 4, "fwd_bwd_ms"), get("lora16", 1, "fwd_bwd_ms")), 0.35),
        ("steady: full fine-tune fwd+bwd ms", get("full", 1, "steady_ms"), 4.0),
        ("steady: LoRA r=16 fwd+bwd ms", get("lora16", 1, "steady_ms"), 3.0),
        ("steady: LoRA fwd overhead", ratio(get("lora16", 1, "fwd_steady_ms"), get("full", 1, "fwd_steady_ms")), 1.15),
        ("steady: full 75% -1 / all valid",
         ratio(get("full", 4, "steady_ms"), get("full", 1, "steady_ms")), 0.35),
        ("steady: LoRA 75% -1 / all valid",
         ratio(get("lora16", 4, "steady_ms"), get("lora16", 1, "steady_ms")), 0.35),
    ]
    out = []
    print("\ntargets (scattermoe, qwen3-30b-a3b; set for one H200, T=8192):")
    for name, value, limit in checks:
        verdict = "n/a" if value is None else ("PASS" if value <= limit else "FAIL")
        print(f"  {name:36} {'-' if value is None else format(value, '7.3f')}  <= {limit:<5} {verdict}")
        out.append({"target": name, "value": value, "limit": limit, "verdict": verdict})
    for mode in MODES:  # the users' alternative: transformers' grouped_mm experts (+ PEFT)
        for field in ("fwd_bwd_ms", "steady_ms"):
            theirs, ours = get(mode, 1, field, TRANSFORMERS), get(mode, 1, field)
            if theirs and ours:
                print(f"  {mode} {field}: transformers {theirs:.3f} / scattermoe {ours:.3f} = {theirs / ours:.2f}x")
    return out


def stacked_step(shape: str, T: int, mode: str, ep: int, layers: int):
    """scattermoe fwd+bwd of `layers` expert layers (each its own weights) under one backward call: the
    autograd engine's fixed cost per backward call is shared by the layers, as in a model."""
    cases = [make_case(shape, T, mode, ep) for _ in range(layers)]
    _, x, ids, w, _ = cases[0]
    return fwd_bwd_step(with_valid_slots(expert_backend("scattermoe"), ids), [case[0] for case in cases], x, ids, w)


def alternated_ratio(shape: str, T: int, mode: str, ep: int, layers: int, rounds: int = 3,
                     iters: int = 10) -> str:
    """Steady fwd+bwd per layer at `ep` over the all-valid (ep1) case, the two timed in turns so both
    run at the same clocks (in the table the ep4 rows come last, on a GPU hot from the rows before)."""
    steps = {e: stacked_step(shape, T, mode, e, layers) for e in (1, ep)}
    times = {1: [], ep: []}
    for step in steps.values():
        steady_ms(step, 3, warmup=2)
    for _ in range(rounds):
        for e, step in steps.items():
            times[e].append(steady_ms(step, iters) / layers)
    one, sparse = statistics.median(times[1]), statistics.median(times[ep])
    return (f"{mode} ep{ep} / ep1, {layers} layer(s) per backward, timed in turns: {sparse:.3f} / {one:.3f} "
            f"ms per layer = {sparse / one:.3f} (SM clock after {sm_clock_mhz()} MHz)")


def profile_kernels(shapes: list[str], T: int, backends: list[str], modes: list[str], ep: int = 1,
                    steps: int = 3) -> None:
    """CUDA kernels of `steps` fwd+bwd issued back to back (after warmup), for each backend, shape and mode
    at the given ep (its -1 slot layout): per step the kernel count, the sum of kernel times and the span
    from the first kernel's start to the last one's end (below the sum where streams overlap; later steps
    run at the clocks of a busy GPU, the first at those of an idle one), then the last step's kernels in
    start order (not a summary by name: scattermoe's GEMM variants share one kernel name)."""
    for shape in shapes:
        for mode in modes:
            for name in backends:
                ex, x, ids, w, _ = make_case(shape, T, mode, ep=ep)
                step = fwd_bwd_step(name, ex, x, ids, w)  # grads set to None: no accumulation kernels
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                except RuntimeError as exc:
                    print(f"== host sync in the step: {str(exc)[:120]}")
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
                kernels = profiled_kernels(step, steps)
                per_step = len(kernels) // steps
                print(f"\n== {shape} T={T} ep{ep} {mode} {name}: {per_step} kernels per step")
                for i in range(steps):
                    ks = kernels[i * per_step:(i + 1) * per_step]
                    total, span = kernel_sum_and_span(ks)
                    print(f"== step {i + 1}: kernel sum {total:.3f} ms, span {span:.3f} ms")
                    if i:
                        gap = ks[0].time_range.start - kernels[i * per_step - 1].time_range.end
                        print(f"   idle before it {gap / 1e3:.3f} ms")
                print("  last step: ms, start after the step's first kernel, idle before it, name")
                last = kernels[-per_step:]
                for prev, e in zip([None, *last], last):
                    start = (e.time_range.start - last[0].time_range.start) / 1e3
                    idle = (e.time_range.start - prev.time_range.end) / 1e3 if prev else 0.0
                    print(f"  {e.time_range.elapsed_us() / 1e3:8.3f} {start:8.3f} {idle:7.3f}  {e.name[:90]}")
                del ex, x, ids, w
                torch.cuda.empty_cache()
    print_autotuned()


def print_autotuned() -> None:
    """The config the autotuner chose for each grouped-GEMM variant this process ran (key -> config)."""
    from moe.kernels.grouped_linear import _grouped_linear_kernel
    for key, config in _grouped_linear_kernel.cache.items():
        print(f"== autotuned {key}: {config}")


def graph_ms(fn) -> str:
    """Median ms of `fn` captured once in a CUDA graph and replayed: the GPU time alone, no host gaps
    (the layer must be free of host syncs, which scattermoe and grouped_mm are)."""
    try:
        graph = capture_graph(fn)
    except RuntimeError as exc:  # a host sync inside: no graph, say why
        return f"n/a ({str(exc)[:60]})"
    ms = statistics.median(event_times_ms(graph.replay, 20, 2))
    del graph
    return f"{ms:.3f} ms"


def host_time(shapes: list[str], T: int, backends: list[str], modes: list[str]) -> None:
    """Host enqueue time of one fwd+bwd (GPU idle at the start) vs its GPU time, at ep1 and ep4, and the
    functions that spend the host time (cProfile, by own time). Host time above the GPU time is exposed
    whenever nothing else keeps the GPU busy."""
    for shape in shapes:
        for mode in modes:
            for name in backends:
                for ep in (1, 4):
                    ex, x, ids, w, _ = make_case(shape, T, mode, ep=ep)
                    fwd_bwd = fwd_bwd_step(name, ex, x, ids, w)
                    for _ in range(3):
                        fwd_bwd()
                    host = []
                    for _ in range(20):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fwd_bwd()
                        host.append(1e3 * (time.perf_counter() - t0))
                    gpu = statistics.median(event_times_ms(fwd_bwd, 10, 0))
                    t0 = time.perf_counter()
                    for _ in range(30):  # back to back: does the host keep up with the GPU?
                        fwd_bwd()
                    enqueued = time.perf_counter()
                    torch.cuda.synchronize()
                    done = time.perf_counter()
                    print(f"\n== host {shape} {mode} ep{ep} {name}: host {statistics.median(host):.3f} ms, "
                          f"call-to-done {gpu:.3f} ms, GPU only (CUDA graph) {graph_ms(fwd_bwd)}; "
                          f"30 back to back: host {(enqueued - t0) / 0.03:.3f} ms/call, "
                          f"done {(done - t0) / 0.03:.3f} ms/call")
                    if ep == 1 or mode == "lora16":
                        print_cprofile(fwd_bwd, 20, "tottime", 28)
                    del fwd_bwd
                    torch.cuda.empty_cache()


def cuda_graphs(shapes: list[str], T: int, modes: list[str], rounds: int = 3, iters: int = 10) -> None:
    """scattermoe steady fwd+bwd eager and under torch.compile(mode="reduce-overhead") (inductor's CUDA
    graphs: the moert::scattermoe_* ops hold no host sync and take every size from the shapes, so the
    graphs replay), at ep1 and ep4 timed in turns, and the compiled output and gradients against eager."""
    backend = expert_backend("scattermoe")
    for shape in shapes:
        for mode in modes:
            times, worst = {}, 0.0
            steps = {}
            for ep in (1, 4):
                ex, x, ids, w, _ = make_case(shape, T, mode, ep)
                compiled = torch.compile(lambda *a: backend(*a), mode="reduce-overhead", fullgraph=True)
                dy = torch.randn_like(x)
                params = [p for p in ex.parameters() if p.requires_grad] + [x, w]
                results = []
                for kind, fn in (("eager", backend), ("graphs", compiled)):
                    steps[kind, ep] = step = fwd_bwd_step(fn, ex, x, ids, w, dy)
                    steady_ms(step, 3, warmup=3)
                    y = step()
                    torch.cuda.synchronize()
                    results.append([y.detach().clone()] + [p.grad.detach().clone() for p in params])
                worst = max([worst] + [float((a.float() - b.float()).abs().max())
                                       for a, b in zip(*results)])
            for _ in range(rounds):
                for key, step in steps.items():
                    times.setdefault(key, []).append(steady_ms(step, iters))
            med = {key: statistics.median(t) for key, t in times.items()}
            for kind in ("eager", "graphs"):
                print(f"== graphs {shape} {mode} {kind}: ep1 {med[kind, 1]:.3f} / ep4 {med[kind, 4]:.3f} ms "
                      f"= {med[kind, 4] / med[kind, 1]:.3f}")
            print(f"== graphs {shape} {mode}: compiled vs eager max abs difference {worst:.3g} "
                  f"(SM clock after {sm_clock_mhz()} MHz)")


def clocks(shapes: list[str], T: int, modes: list[str]) -> None:
    """For each shape and mode (scattermoe, ep1): how the time per step and the SM clock change as the GPU
    stays busy, the GPU-only time of the step, and what the driver reports while it replays."""
    for shape in shapes:
        for mode in modes:
            ex, x, ids, w, _ = make_case(shape, T, mode, ep=1)
            step = fwd_bwd_step("scattermoe", ex, x, ids, w)
            steady_ms(step, 5)
            for n in (3, 10, 30, 100, 10):
                print(f"== {shape} {mode} steady n={n}: {steady_ms(step, n):.3f} ms/step, SM clock after "
                      f"{sm_clock_mhz()} MHz", flush=True)
            busy, span = kernel_sum_and_span(profiled_kernels(step, 10))
            print(f"== {shape} {mode} profiled 10 steps: span {span / 10:.3f} ms/step, kernel sum {busy / 10:.3f}")
            graph = capture_graph(step)
            for n in (10, 100):
                print(f"== {shape} {mode} graph replays back to back n={n}: {steady_ms(graph.replay, n, 2):.3f} "
                      f"ms/step, SM clock after {sm_clock_mhz()} MHz", flush=True)
            print(f"== {shape} {mode} graph replayed ~2 s, NVML: {clocks_under_load(graph.replay)}", flush=True)
            del graph, step, ex, x
            torch.cuda.empty_cache()


def packed_gemms(shape: str, T: int, iters: int) -> None:
    """Each GEMM that reads a packed weight in a LoRA step (split LoRA, r=16, all slots valid), ms per call: on
    the bf16 weights (our dispatch: CUTLASS or our Triton kernel) and on MXFP4 / NVFP4 weights (our Triton
    kernel, decoding in its K loop): where the FP4 layer's extra time goes. gate_up's row includes its rank
    product x A^T (gate_up_swiglu computes it); the others are given theirs (ia_Sr), as in the backend."""
    from moe.kernels import grouped_linear as gl
    from moe.kernels.fp4 import PackedWeight
    from moe.kernels.routing import sort_slots
    from quant import FP4Weight

    s, R = SHAPES[shape], 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    _, ids = torch.randn(T, s.experts, device="cuda", generator=gen).softmax(-1).topk(s.top_k, dim=-1)
    slots = sort_slots(ids, s.experts)
    E, H, I, S = s.experts, s.hidden, s.intermediate, T * s.top_k
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    x, hw, dy, dgu = (torch.randn(T, H, **bf), torch.randn(S, I, **bf), torch.randn(S, H, **bf),
                      torch.randn(S, 2 * I, **bf))
    w_gu, w_down = torch.randn(E, 2 * I, H, **bf) * 0.02, torch.randn(E, H, I, **bf) * 0.02
    ia, rw = torch.randn(S, R, **bf), torch.rand(T, s.top_k, **bf)

    def lora(N, K):
        return gl.LoraView(torch.randn(E, R, K, **bf) * 0.02, torch.randn(E, N, R, **bf) * 0.02, 2.0, True)
    lora_gu, lora_down, lora_dx = lora(2 * I, H), lora(H, I), lora(H, 2 * I)

    def t(w):
        return w.t() if isinstance(w, PackedWeight) else w.transpose(1, 2)

    def gemms(gu, down):
        return {"gate_up + SwiGLU (gathered)": lambda: gl.gate_up_swiglu(x, slots, gu, lora_gu, rw),
                "down + LoRA": lambda: gl.expert_linear(hw, slots, down, lora_down, gather=False, ia_Sr=ia),
                "down^T (g = dy W_down)": lambda: gl.expert_gemm(dy, slots, t(down)),
                "gate_up^T + LoRA (dx)": lambda: gl.expert_linear(dgu, slots, t(gu), lora_dx, gather=False, ia_Sr=ia)}

    columns = {"bf16": gemms(w_gu, w_down)}
    for fmt in ("mxfp4", "nvfp4"):
        columns[fmt] = gemms(*(PackedWeight.of(FP4Weight.from_dense(w, fmt)) for w in (w_gu, w_down)))
    print(f"packed GEMMs, {shape}, T={T}, ms per call (LoRA r=16 split):")
    print(f"{'GEMM':30s}" + "".join(f"{name:>10s}" for name in columns) + "  x bf16 (mxfp4, nvfp4)")
    for name in columns["bf16"]:
        times = [statistics.median(event_times_ms(fns[name], iters, 3)) for fns in columns.values()]
        print(f"{name:30s}" + "".join(f"{ms:10.3f}" for ms in times)
              + f"  {times[1] / times[0]:.2f}x {times[2] / times[0]:.2f}x", flush=True)


def fp8_gemms(shape: str, T: int, iters: int) -> None:
    """The expert layer's bare grouped GEMMs (all slots valid, rows already expert-sorted: no gather, LoRA or
    SwiGLU), ms per call: bf16 torch._grouped_mm against FP8 torch._scaled_grouped_mm on operands quantized
    beforehand, and with the activation's rowwise quantization included: the ceiling FP8 sets for a layer that
    keeps everything else. Forward, the dX GEMMs (the weight's transposed codes given) and, for the full
    fine-tune, the dW GEMMs (2d-2d, groups padded to 16 rows)."""
    from quant.fp8 import quantize_rows, scaled_grouped_mm
    from quant.fp8_training import grad_weight_operands, scaled_grouped_mm_2d2d

    s = SHAPES[shape]
    E, H, I, S = s.experts, s.hidden, s.intermediate, T * s.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.bincount(torch.randint(0, E, (S,), device="cuda", generator=gen), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    # (name, activation rows [S, K], weight [E, N, K]): y = a @ w_e^T for each GEMM of a step
    cases = [("gate_up fwd", torch.randn(S, H, **bf), torch.randn(E, 2 * I, H, **bf) * 0.02),
             ("down fwd", torch.randn(S, I, **bf), torch.randn(E, H, I, **bf) * 0.02),
             ("down dX", torch.randn(S, H, **bf), torch.randn(E, I, H, **bf) * 0.02),
             ("gate_up dX", torch.randn(S, 2 * I, **bf), torch.randn(E, H, 2 * I, **bf) * 0.02)]
    print(f"grouped GEMMs, {shape}, T={T} (S={S} rows), ms per call: bf16 | fp8 | fp8 + quantizing the rows")
    for name, a, w in cases:
        wq, ws = quantize_rows(w)
        aq, as_ = quantize_rows(a)
        calls = {"bf16": lambda a=a, w=w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs),
                 "fp8": lambda aq=aq, as_=as_, wq=wq, ws=ws: scaled_grouped_mm(aq, as_, wq.transpose(-2, -1), ws,
                                                                              offs, torch.bfloat16),
                 "fp8+q": lambda a=a, wq=wq, ws=ws: scaled_grouped_mm(*quantize_rows(a), wq.transpose(-2, -1), ws,
                                                                    offs, torch.bfloat16)}
        times = [statistics.median(event_times_ms(fn, iters, 3)) for fn in calls.values()]
        print(f"  {name:12s}" + "".join(f"{ms:9.3f}" for ms in times)
              + f"   fp8 {times[0] / times[1]:.2f}x, with quantization {times[0] / times[2]:.2f}x", flush=True)
    for name, dy, x in (("gate_up dW", torch.randn(S, 2 * I, **bf), torch.randn(S, H, **bf)),
                        ("down dW", torch.randn(S, H, **bf), torch.randn(S, I, **bf))):
        operands = grad_weight_operands(dy, x, offs)
        calls = {"bf16": lambda dy=dy, x=x: torch._grouped_mm(dy.t(), x, offs=offs),
                 "fp8": lambda operands=operands: scaled_grouped_mm_2d2d(*operands, torch.bfloat16)}
        times = [statistics.median(event_times_ms(fn, iters, 3)) for fn in calls.values()]
        print(f"  {name:12s}" + "".join(f"{ms:9.3f}" for ms in times) + f"   fp8 {times[0] / times[1]:.2f}x",
              flush=True)


def dense_floor(shape: str, T: int, iters: int) -> None:
    """The layer's GEMMs as plain dense matmuls over all T*k slots at once (no grouping, gather, tile tails or
    elementwise passes: what the expert layer cannot beat on this GPU), steady fwd+bwd beside scattermoe's
    steady layer in the same process; full fine-tune (6 GEMMs: 2 forward, dX and dW of each) and LoRA's frozen
    base (4: no dW; its rank-16 products are left out)."""
    s = SHAPES[shape]
    S, H, I = T * s.top_k, s.hidden, s.intermediate
    bf = {"device": CASE.device, "dtype": CASE.dtype}
    x, h, dy, dgu = (torch.randn(S, H, **bf), torch.randn(S, I, **bf), torch.randn(S, H, **bf),
                     torch.randn(S, 2 * I, **bf))
    w_gu, w_down = torch.randn(2 * I, H, **bf), torch.randn(H, I, **bf)

    def frozen():
        return x @ w_gu.t(), h @ w_down.t(), dy @ w_down, dgu @ w_gu

    def full():
        return (*frozen(), dy.t() @ h, dgu.t() @ x)
    print(f"dense floor, {shape}, T={T} ({S} slots), steady fwd+bwd ms (TFLOP/s), SM clock MHz after:", flush=True)
    for mode, gemms, train_base in (("full", full, True), ("lora16", frozen, False)):
        flops = layer_flops(S, H, I, 0, train_base)
        floor = steady_ms(gemms, iters, warmup=3)
        floor_mhz = sm_clock_mhz()
        layer = steady_ms(fwd_bwd_step("scattermoe", *make_case(shape, T, mode, 1)[:4]), iters, warmup=3)
        print(f"  {mode:7s} dense GEMMs {floor:.3f} ({flops / floor / 1e9:.0f}) @ {floor_mhz}  scattermoe layer "
              f"{layer:.3f} @ {sm_clock_mhz()}  layer / floor {layer / floor:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T=2048, qwen3-30b-a3b and mixtral-8x7b only")
    ap.add_argument("--dry", action="store_true",
                    help="CPU smoke run: tiny shape, T=64, fp32, eager/grouped_mm/transformers")
    ap.add_argument("--out", help="directory for bench_experts.json")
    ap.add_argument("--backends", default="eager,transformers,grouped_mm,scattermoe")
    ap.add_argument("--shapes", default=",".join(MOE_SHAPES), help="names in benchmarks.harness.SHAPES")
    ap.add_argument("--tokens", type=int, help="T (default 8192; --quick 2048)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--modes", default=",".join(MODES), help="a subset of " + ",".join([*MODES, *QUANT_MODES]))
    ap.add_argument("--quant", default="none",
                    help="none | mxfp4 | nvfp4, comma-separated: also the LoRA mode on FP4-packed experts (lora16-<fmt>)"
                         " beside the bf16 lora16 rows")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the table: per-kernel CUDA times of fwd+bwd steps (torch.profiler)")
    ap.add_argument("--ep", type=int, default=1, help="with --profile: the -1 slot layout of this ep")
    ap.add_argument("--host", action="store_true",
                    help="instead of the table: host time of one fwd+bwd and a cProfile of it")
    ap.add_argument("--graphs", action="store_true",
                    help="instead of the table: scattermoe eager vs torch.compile(mode='reduce-overhead')")
    ap.add_argument("--clocks", action="store_true",
                    help="instead of the table: steady time and SM clock over n steps, graph replays, NVML")
    ap.add_argument("--floor", action="store_true",
                    help="instead of the table: the layer's GEMMs as plain dense matmuls beside scattermoe's layer")
    ap.add_argument("--fp8-gemms", action="store_true",
                    help="instead of the table: the layer's bare grouped GEMMs, bf16 vs FP8 (GPU, sm90+)")
    ap.add_argument("--gemms", action="store_true",
                    help="instead of the table: each GEMM reading a packed weight, bf16 vs MXFP4 vs NVFP4 (GPU)")
    args = ap.parse_args()
    shapes = ["qwen3-30b-a3b", "mixtral-8x7b"] if args.quick else args.shapes.split(",")
    T = args.tokens or (2048 if args.quick else 8192)
    backends, modes = args.backends.split(","), with_quant(args.modes.split(","), args.quant)
    if args.dry:
        CASE.device, CASE.dtype = "cpu", torch.float32
        shapes, T, args.iters = ["tiny"], args.tokens or 64, 2
        backends = [b for b in backends if b in ("eager", "grouped_mm", TRANSFORMERS)]
    if args.profile:
        profile_kernels(shapes, T, backends, modes, args.ep)
        return
    if args.host:
        host_time(shapes, T, backends, modes)
        return
    if args.graphs:
        cuda_graphs(shapes, T, modes)
        return
    if args.clocks:
        clocks(shapes, T, modes)
        return
    if args.floor:
        for shape in shapes:
            dense_floor(shape, T, args.iters)
        return
    if args.fp8_gemms:
        for shape in shapes:
            fp8_gemms(shape, T, args.iters)
        return
    if args.gemms:
        for shape in shapes:
            packed_gemms(shape, T, args.iters)
        return
    report = Report("bench_experts", COLUMNS, args.out)
    matmul = None if args.dry else matmul_tflops()
    report.meta["matmul_tflops"] = matmul
    report.header(f"expert layer, fwd and fwd+bwd{'' if matmul is None else f', bf16 matmul {matmul:.0f} TFLOP/s'}")
    rows = []
    for shape in shapes:
        rows += run_shape(shape, T, backends, modes, args.iters, matmul, report)
        if shape == "qwen3-30b-a3b":  # the targets' shape: report them before the remaining shapes run
            report.meta["targets"] = targets(rows)
            report.save()
            if "scattermoe" in backends:
                for mode in modes:
                    for layers in (1, 4):
                        print("  steady 75% -1 ratio, " + alternated_ratio(shape, T, mode, 4, layers), flush=True)
    from moe.kernels.tuning import _FASTER  # the measured choices between CUTLASS and our kernels
    for key, winner in _FASTER.items():
        name, _, _, w_shape, w_layout = key
        print(f"== faster: {name} W{tuple(w_shape)} {'' if w_layout else '(transposed view) '}: {winner}")


if __name__ == "__main__":
    main()

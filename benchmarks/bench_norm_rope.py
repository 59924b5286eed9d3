"""Fused q/k RMSNorm + RoPE (attention/norm_rope.py) vs the alternatives, forward and forward+backward.

    python -m benchmarks.bench_norm_rope [--out DIR] [--shape qwen3-14b] [--seqlens 1024,4096] [--variants ...]
                                         [--sweep] [--host-breakdown] [--dry]

Shapes: the attention heads of a harness.SHAPES preset (default Qwen3-14B: 40 query heads, 8 kv heads,
head_dim 128), batch 1, bf16, q/k as the separate q_proj/k_proj outputs viewed [B, S, heads, D], cos/sin
[1, S, D] as transformers returns them. Variants: `eager` (our torch reference, = transformers'
numerics), `compile` (torch.compile of that same code), `liger-norm` (Liger's RMSNorm kernel + eager
RoPE), `liger-both` (Liger's RMSNorm + its RoPE kernel; both from benchmarks/baselines/liger_norm_rope.py,
pyproject extra `bench`), `ours` (the Triton op).

Methodology, the same for every variant (each step of a variant runs exactly the code a training step
would: fn(*inputs) for fwd, torch.autograd.grad(fn(*inputs), ...) for f+b):
- `fwd` / `f+b` (the headline numbers, used for the targets): GPU time. The call is captured once in a
  CUDA graph (after warmup on a side stream; torch.compile compiles in that warmup) and each rep
  replays it between two CUDA events, with a 256 MiB L2 flush before each rep. This removes the host
  (Python / dispatch / launch) time of every variant alike; it is what the GPU spends when the host
  keeps up, e.g. inside a model whose other layers keep the GPU busy.
- `fwd str` / `f+b str`: the same call made directly (no graph) between CUDA events after the L2 flush,
  i.e. stream time including any host overhead the GPU has to wait for (the methodology of the first
  benchmark run, 2026-11-22). When this is far above the graph time the variant is host-bound.
- `host f+b`: CPU time of one direct f+b call (perf_counter around the call, no sync inside; the
  GPU is synchronized between reps), the host overhead each variant adds per layer.
All are medians of --reps reps after --warmup warmup calls; plus the peak memory of one fwd+bwd above
the resident inputs. For `ours` also the bytes the kernels must move and the fraction of a device copy
bandwidth measured in the same run (graph-timed). Then the issue's target: one H200, 16k fwd+bwd
<= 0.45 ms and ours fastest at every length >= 2k (GPU time; the stream-time verdict is printed too).
A variant that fails prints its error and the table goes on.

--sweep           times the raw launches of `ours` (graph-timed) under other tile configs and
                  backward grid sizes at 4k and 16k (other LaunchSettings passed to the launches).
--host-breakdown  host time per call of `ours`, split into the triton_op call and the raw launches,
                  plus a cProfile of the f+b call.
--dry             runs the same code on the CPU at tiny lengths (wall-clock timer; `ours` needs
                  TRITON_INTERPRET=1 there): a smoke test of the script, its numbers mean nothing.
--out DIR         writes DIR/bench_norm_rope.json (rewritten after every measurement).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace

import torch

from attention.kernels import norm_rope as kernels
from attention.kernels.norm_rope import DEFAULT_LAUNCH_SETTINGS, LaunchSettings
from attention.norm_rope import qk_norm_rope, qk_norm_rope_reference
from benchmarks.baselines.liger_norm_rope import liger_qk_norm_rope
from benchmarks.harness import (
    SHAPES,
    Column,
    L2Flush,
    Report,
    copy_gbps,
    event_times_ms,
    graph_times_ms,
    print_cprofile,
)
from gpu.device import num_sms

BATCH = 1
EPS = 1e-6
SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
DRY_SEQLENS = (16, 32)
TARGET_SEQ, TARGET_FWD_BWD_MS, TARGET_MIN_SEQ = 16384, 0.45, 2048
SWEEP_SEQLENS = (4096, 16384)
# (elements per tile, num_warps)
SWEEP_FWD_CONFIGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16))
SWEEP_BWD_CONFIGS = ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16))
SWEEP_BWD_PROGRAMS_PER_SM = (2, 4, 8, 16)
HOST_BREAKDOWN_SEQ = 4096


@dataclass
class Heads:
    """The attention heads benchmarked (from a harness.SHAPES preset)."""

    q: int = SHAPES["qwen3-14b"].q_heads
    k: int = SHAPES["qwen3-14b"].kv_heads
    dim: int = SHAPES["qwen3-14b"].head_dim


HEADS = Heads()


@dataclass
class Result:
    seq: int
    variant: str
    fwd_ms: float | None = None          # GPU time (CUDA graph replay)
    fwd_bwd_ms: float | None = None
    fwd_stream_ms: float | None = None   # direct call between events (includes exposed host time)
    fwd_bwd_stream_ms: float | None = None
    host_fwd_bwd_ms: float | None = None  # CPU time of one direct f+b call
    peak_mib: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median milliseconds of fn() over `reps` after `warmup` calls. On a GPU: `gpu` = CUDA-graph
    replay between events, `stream` = direct call between events (both after an L2 flush), `host` =
    CPU time of a direct call. On the CPU (--dry) all three are perf_counter around a direct call."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.flush = L2Flush(device)

    def stream(self, fn) -> float:
        return statistics.median(event_times_ms(fn, self.reps, self.warmup, before=self.flush))

    def gpu(self, fn) -> float:
        return statistics.median(graph_times_ms(fn, self.reps, max(2, self.warmup), before=self.flush))

    def host(self, fn) -> float:
        on_gpu = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        if on_gpu:
            torch.cuda.synchronize()
        return statistics.median(times)


def peak_extra_mib(fn, device: torch.device) -> float | None:
    """Peak memory of one call above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# ----------------------------------------------------------------------------- variants


def make_inputs(seq: int, device: torch.device, dtype: torch.dtype):
    """q/k leaves [B, S, heads, D] (separate projections, so contiguous), weights [D], cos/sin [1, S, D]
    as transformers' rotary embedding computes them, and fixed upstream grads."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    q = randn(BATCH, seq, HEADS.q, HEADS.dim).requires_grad_()
    k = randn(BATCH, seq, HEADS.k, HEADS.dim).requires_grad_()
    q_w = (1.0 + 0.1 * randn(HEADS.dim)).requires_grad_()
    k_w = (1.0 + 0.1 * randn(HEADS.dim)).requires_grad_()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEADS.dim, 2, device=device).float() / HEADS.dim))
    freqs = torch.arange(seq, device=device).float()[None, :, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    grads = (randn(BATCH, seq, HEADS.q, HEADS.dim), randn(BATCH, seq, HEADS.k, HEADS.dim))
    return (q, k, q_w, k_w, emb.cos().to(dtype), emb.sin().to(dtype)), grads


def eager(q, k, q_w, k_w, cos, sin):
    return qk_norm_rope_reference(q, k, q_w, k_w, cos, sin, EPS)


def ours(q, k, q_w, k_w, cos, sin):
    return qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS, impl="triton")


def build_compiled():
    # One static graph per length (no dynamic-shape kernels); allow a recompile for each length.
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    return torch.compile(eager, dynamic=False)


VARIANTS = {
    "eager": lambda: eager,
    "compile": build_compiled,
    "liger-norm": lambda: liger_qk_norm_rope(with_rope=False, eps=EPS),
    "liger-both": lambda: liger_qk_norm_rope(with_rope=True, eps=EPS),
    "ours": lambda: ours,
}


def measure(fn, seq: int, timer: Timer, dtype: torch.dtype) -> Result:
    inputs, grads = make_inputs(seq, timer.device, dtype)
    leaves = inputs[:4]

    def forward():
        return fn(*inputs)

    def forward_backward():
        return torch.autograd.grad(fn(*inputs), leaves, grads)

    r = Result(seq, "")
    # Stream timings first: a compile variant compiles in this warmup, outside any graph capture.
    r.fwd_bwd_stream_ms = timer.stream(forward_backward)
    r.fwd_stream_ms = timer.stream(forward)
    r.host_fwd_bwd_ms = timer.host(forward_backward)
    r.peak_mib = peak_extra_mib(forward_backward, timer.device)
    try:
        r.fwd_bwd_ms = timer.gpu(forward_backward)
        r.fwd_ms = timer.gpu(forward)
    except Exception as exc:  # noqa: BLE001 (a failing row is reported in the table; the others still run)
        r.note = f"graph capture failed: {exc!r}"[:160]
    return r


def ours_bytes(seq: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """HBM bytes the kernels must move: forward reads q, k, cos, sin, w and writes q, k; backward reads
    q, k (the norm is recomputed), both upstream grads, cos, sin, w and writes dq, dk, dw and the dW
    partial rows (written once, read once by the sum). (The first version counted q/k-sized traffic 4x
    in the backward instead of 3x.)"""
    item = torch.empty((), dtype=dtype).element_size()
    qk = BATCH * seq * (HEADS.q + HEADS.k) * HEADS.dim * item
    table = 2 * seq * HEADS.dim * item          # cos + sin, [1, S, D] each
    weights = 2 * HEADS.dim * item
    sms = num_sms(device) if device.type == "cuda" else 4  # the interpreter's few programs, as the kernels do
    n_progs = DEFAULT_LAUNCH_SETTINGS.bwd_programs_per_sm * sms  # at most; rounded by tiles
    partials = 2 * n_progs * HEADS.dim * 4
    fwd = 2 * qk + table + weights
    bwd = 3 * qk + table + 2 * weights + partials  # q, k, grads in; dq, dk out; dW out
    return fwd, fwd + bwd


# ----------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(r: Result, mine: Result | None, attr: str) -> str:
    mine_ms, theirs_ms = getattr(mine, attr, None), getattr(r, attr)
    return f"{theirs_ms / mine_ms:.2f}x" if mine_ms and theirs_ms else "-"


def report_table(results: list[Result], copy_gbs: float, log) -> dict:
    by_seq: dict[int, dict[str, Result]] = {}
    for r in results:
        by_seq.setdefault(r.seq, {})[r.variant] = r
    log("GPU time = CUDA-graph replay (no host overhead, same for all variants); str = direct call between")
    log("events (includes host overhead the GPU waits for); host = CPU ms of one direct f+b call; ms, medians.")
    log(f"{'seq':>6} {'variant':<11} {'fwd':>7} {'f+b':>7} {'fwd x':>6} {'f+b x':>6} {'fwd str':>8} "
        f"{'f+b str':>8} {'host f+b':>8} {'peak MiB':>9}  note")
    for seq, rows in by_seq.items():
        mine = rows.get("ours")
        for name, r in rows.items():
            log(f"{seq:>6} {name:<11} {fmt(r.fwd_ms):>7} {fmt(r.fwd_bwd_ms):>7} {ratio(r, mine, 'fwd_ms'):>6} "
                f"{ratio(r, mine, 'fwd_bwd_ms'):>6} {fmt(r.fwd_stream_ms):>8} {fmt(r.fwd_bwd_stream_ms):>8} "
                f"{fmt(r.host_fwd_bwd_ms):>8} {fmt(r.peak_mib, '.1f'):>9}  {r.note}")
    log("(x = variant GPU time / ours GPU time: > 1 means ours is faster)")
    log(f"\nours vs the device copy bandwidth {copy_gbs:.0f} GB/s (read + write), GPU time:")
    log(f"{'seq':>6} {'fwd MB':>8} {'fwd GB/s':>9} {'fwd %':>6} {'f+b MB':>8} {'f+b GB/s':>9} {'f+b %':>6}")
    for seq, rows in by_seq.items():
        r = rows.get("ours")
        if r is None or not r.extra:
            continue
        e = r.extra
        log(f"{seq:>6} {e['fwd_bytes'] / 1e6:>8.1f} {fmt(e.get('fwd_gbs'), '.0f'):>9} "
            f"{fmt(e.get('fwd_roofline_pct'), '.0f'):>6} {e['fwd_bwd_bytes'] / 1e6:>8.1f} "
            f"{fmt(e.get('fwd_bwd_gbs'), '.0f'):>9} {fmt(e.get('fwd_bwd_roofline_pct'), '.0f'):>6}")
    checks = check_targets(by_seq, log, ("fwd_ms", "fwd_bwd_ms"), "GPU time (CUDA graphs)")
    stream = check_targets(by_seq, log, ("fwd_stream_ms", "fwd_bwd_stream_ms"), "stream time (direct calls)")
    checks["stream"] = stream
    return checks


def check_targets(by_seq: dict[int, dict[str, Result]], log, attrs: tuple[str, str], label: str) -> dict:
    at_target = getattr(by_seq.get(TARGET_SEQ, {}).get("ours"), attrs[1], None)
    slower = []  # (seq, pass, variant) where some other variant beat ours, or ours has no number
    judged = [seq for seq in by_seq if seq >= TARGET_MIN_SEQ]
    for seq, rows in by_seq.items():
        mine = rows.get("ours")
        for name, r in rows.items():
            for attr in attrs:
                theirs_ms, mine_ms = getattr(r, attr), getattr(mine, attr, None)
                if seq >= TARGET_MIN_SEQ and name != "ours" and theirs_ms is not None and (
                        mine_ms is None or theirs_ms <= mine_ms):
                    slower.append(f"{seq}:{attr}:{name}")
    checks = {
        "fwd_bwd_ms_at_16k": at_target,
        "fwd_bwd_16k_ok": at_target is not None and at_target <= TARGET_FWD_BWD_MS,
        "fastest_from_2k_ok": bool(judged) and not slower,
        "not_fastest": slower,
    }
    log(f"\ntarget (one H200), {label}: ours 16k fwd+bwd {fmt(at_target)} ms <= {TARGET_FWD_BWD_MS}: "
        f"{'PASS' if checks['fwd_bwd_16k_ok'] else 'FAIL'}; fastest at every length >= {TARGET_MIN_SEQ}: "
        f"{'n/a' if not judged else 'PASS' if not slower else 'FAIL ' + ', '.join(slower)}")
    return checks


def add_roofline(r: Result, dtype: torch.dtype, device: torch.device, copy_gbs: float) -> None:
    fwd_bytes, fwd_bwd_bytes = ours_bytes(r.seq, dtype, device)
    r.extra = {"fwd_bytes": fwd_bytes, "fwd_bwd_bytes": fwd_bwd_bytes}
    for key, n_bytes, ms in (("fwd", fwd_bytes, r.fwd_ms), ("fwd_bwd", fwd_bwd_bytes, r.fwd_bwd_ms)):
        if ms:
            gbs = n_bytes / (ms * 1e-3) / 1e9
            r.extra[f"{key}_gbs"], r.extra[f"{key}_roofline_pct"] = gbs, 100 * gbs / copy_gbs


def _raw_launches(seq: int, device: torch.device, dtype: torch.dtype,
                  settings: LaunchSettings = DEFAULT_LAUNCH_SETTINGS):
    """The forward and backward launches of `ours` without the op and autograd layers around them."""
    inputs, (grad_q, grad_k) = make_inputs(seq, device, dtype)
    q, k, q_w, k_w, cos, sin = (t.detach() for t in inputs)

    def fwd():
        return kernels.fwd_launch(q, k, q_w, k_w, cos, sin, EPS, False, settings)

    def bwd():
        return kernels.bwd_launch(q, k, q_w, k_w, cos, sin, grad_q, grad_k, EPS, False, settings)
    return fwd, bwd


def sweep(seqlens, timer: Timer, dtype: torch.dtype, log) -> list[dict]:
    """GPU time of the raw launches under other tile configs and backward grid sizes."""
    default = DEFAULT_LAUNCH_SETTINGS
    rows = []
    log(f"\nsweep of ours, GPU time of the raw launches (ms); defaults {default}")
    for seq in seqlens:
        for kind, configs, per_sms in (("fwd", SWEEP_FWD_CONFIGS, (None,)),
                                       ("bwd", SWEEP_BWD_CONFIGS, SWEEP_BWD_PROGRAMS_PER_SM)):
            for elements, warps in configs:
                for per_sm in per_sms:
                    row = {"seq": seq, "pass": kind, "tile_elements": elements, "num_warps": warps,
                           "bwd_programs_per_sm": per_sm}
                    if kind == "fwd":
                        settings = replace(default, fwd_tile_elements=elements, fwd_num_warps=warps)
                    else:
                        settings = replace(default, bwd_tile_elements=elements, bwd_num_warps=warps,
                                           bwd_programs_per_sm=per_sm)
                    fwd, bwd = _raw_launches(seq, timer.device, dtype, settings)
                    try:
                        row["ms"] = timer.gpu(fwd if kind == "fwd" else bwd)
                        log(f"{seq:>6} {kind} {elements:>5} elements {warps:>2} warps "
                            f"{'' if per_sm is None else f'{per_sm:>2} per SM'}: {row['ms']:.4f}")
                    except Exception as exc:  # noqa: BLE001 (a failing row is reported in the table; the others still run)
                        row["error"] = repr(exc)
                        log(f"{seq:>6} {kind} {elements} {warps} {per_sm}: error {exc!r}")
                    rows.append(row)
        for kind in ("fwd", "bwd"):
            done = [r for r in rows if r["seq"] == seq and r["pass"] == kind and "ms" in r]
            if done:
                best = min(done, key=lambda r: r["ms"])
                log(f"{seq:>6} best {kind}: {best}")
    return rows


def host_breakdown(seq: int, timer: Timer, dtype: torch.dtype, log) -> dict:
    """Where the host time of `ours` goes: the op call (dispatch, autograd) vs the raw launches."""
    inputs, grads = make_inputs(seq, timer.device, dtype)
    leaves = inputs[:4]
    raw_fwd, raw_bwd = _raw_launches(seq, timer.device, dtype)
    out = {}
    log(f"\nhost ms per call of ours at seq {seq} (CPU time, GPU synced between reps; median) / GPU ms:")
    for what, fn in (("fwd", lambda: ours(*inputs)),
                     ("f+b", lambda: torch.autograd.grad(ours(*inputs), leaves, grads))):
        out[f"op {what}"] = timer.host(fn)
        log(f"  op {what}: host {out[f'op {what}']:.4f}")
    q_leaf, grad_q = inputs[0], grads[0]
    out["autograd floor"] = timer.host(lambda: torch.autograd.grad(q_leaf * 2.0, q_leaf, grad_q))
    log(f"  autograd floor (autograd.grad of q * 2: one native fwd + bwd kernel): host {out['autograd floor']:.4f}")
    for what, fn in (("raw fwd launch", raw_fwd), ("raw bwd launch", raw_bwd)):
        out[what] = timer.host(fn)
        out[what + " gpu"] = timer.gpu(fn)
        log(f"  {what}: host {out[what]:.4f}  gpu {out[what + ' gpu']:.4f}")
    n_calls = 200 if timer.device.type == "cuda" else 2
    log(f"cProfile of {n_calls} f+b calls, by tottime:")
    print_cprofile(lambda: torch.autograd.grad(ours(*inputs), leaves, grads), n_calls, "tottime", 18)
    return out


COLUMNS = [Column("seq", "seq", "d"), Column("variant", "variant", width=10), Column("fwd_ms", "GPU fwd", ".3f"),
           Column("fwd_bwd_ms", "GPU f+b", ".3f"), Column("fwd_stream_ms", "fwd str", ".3f"),
           Column("fwd_bwd_stream_ms", "f+b str", ".3f"), Column("host_fwd_bwd_ms", "host f+b", ".3f"),
           Column("peak_mib", "peak MiB", ".1f")]


def log(line: str = "") -> None:
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for bench_norm_rope.json")
    parser.add_argument("--shape", default="qwen3-14b", help="the attention heads of this benchmarks.harness.SHAPES preset")
    parser.add_argument("--seqlens", help="comma-separated sequence lengths (default: 1k..32k)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of variants")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time ours under other tile configs")
    parser.add_argument("--host-breakdown", action="store_true", help="where the host time of ours goes")
    parser.add_argument("--dry", action="store_true", help="CPU smoke test at tiny lengths")
    args = parser.parse_args()

    if not args.dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --dry for a CPU smoke test")
    shape = SHAPES[args.shape]
    HEADS.q, HEADS.k, HEADS.dim = shape.q_heads, shape.kv_heads, shape.head_dim
    device = torch.device("cpu" if args.dry else "cuda")
    dtype = torch.float32 if args.dry else torch.bfloat16  # the Triton interpreter cannot do bf16
    seqlens = [int(s) for s in args.seqlens.split(",")] if args.seqlens else (DRY_SEQLENS if args.dry else SEQLENS)
    timer = Timer(device, reps=3 if args.dry else args.reps, warmup=1 if args.dry else args.warmup)

    report = Report("bench_norm_rope", COLUMNS, args.out)
    copy = copy_gbps(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    report.meta.update(dtype=str(dtype), copy_gbs=copy, settings=asdict(DEFAULT_LAUNCH_SETTINGS),
                       shape={"name": args.shape, "batch": BATCH, "heads_q": HEADS.q, "heads_k": HEADS.k,
                              "head_dim": HEADS.dim})
    report.header(f"q/k RMSNorm + RoPE, {args.shape} heads B={BATCH} Hq={HEADS.q} Hkv={HEADS.k} D={HEADS.dim}, "
                  f"{dtype}; median of {timer.reps} reps after {timer.warmup} warmup, L2 flushed before each;"
                  f" ours {DEFAULT_LAUNCH_SETTINGS}; copy {copy:.0f} GB/s")

    results: list[Result] = []
    names = args.variants.split(",")
    # ours first: a run cut short by a time limit still has its numbers (the table order stays fixed).
    for name in sorted(names, key=lambda n: n != "ours"):
        try:
            fn = VARIANTS[name]()
        except Exception as exc:  # noqa: BLE001 (a failing row is reported in the table; the others still run)
            for seq in seqlens:
                results.append(Result(seq, name, note=f"n/a: {exc!r}"[:120]))
                report.add(results[-1])
            continue
        for seq in seqlens:
            try:
                r = measure(fn, seq, timer, dtype)
                r.variant = name
                if name == "ours":
                    add_roofline(r, dtype, device, copy)
            except Exception as exc:  # noqa: BLE001 (a failing row is reported in the table; the others still run)
                traceback.print_exc()
                r = Result(seq, name, note=f"error: {exc!r}"[:160])
            results.append(r)
            report.add(r)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results.sort(key=lambda r: (r.seq, list(VARIANTS).index(r.variant)))
    log()
    report.meta["targets"] = report_table(results, copy, log)
    report.save()
    if args.host_breakdown:
        report.meta["host_breakdown"] = host_breakdown(DRY_SEQLENS[0] if args.dry else HOST_BREAKDOWN_SEQ,
                                                       timer, dtype, log)
        report.save()
    if args.sweep:
        report.meta["sweep"] = sweep(DRY_SEQLENS[:1] if args.dry else SWEEP_SEQLENS, timer, dtype, log)
        report.save()


if __name__ == "__main__":
    main()

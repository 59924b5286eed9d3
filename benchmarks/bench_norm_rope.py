"""Fused q/k RMSNorm + RoPE (attention/norm_rope.py) vs the alternatives, forward and forward+backward.

    python benchmarks/bench_norm_rope.py [--out DIR] [--seqlens 1024,4096] [--sweep] [--dry]

Shapes: Qwen3-14B attention (40 query heads, 8 kv heads, head_dim 128), batch 1, bf16, q/k as the
separate q_proj/k_proj outputs viewed [B, S, heads, D], cos/sin [1, S, D] as transformers returns them.
Variants: `eager` (our torch reference, = transformers' numerics), `compile` (torch.compile of that
same code), `liger-norm` (Liger's RMSNorm kernel + eager RoPE), `liger-both` (Liger's RMSNorm + its
RoPE kernel), `ours` (the Triton op). Per variant and length: median time over CUDA events (L2 flushed
before each rep, warmup first; compilation happens in the warmup), and the peak memory of one fwd+bwd
above the resident inputs. For `ours` also the bytes the kernels must move and the fraction of a device
copy bandwidth measured in the same run. Then the issue's target: one H200, 16k fwd+bwd <= 0.45 ms and
ours fastest at every length >= 2k. A variant that fails prints its error and the table goes on.

--sweep  times `ours` under a few tile configs (replacing norm_rope._launch_config) at 4k and 16k.
--dry    runs the same code on the CPU at tiny lengths (wall-clock timer; `ours` needs TRITON_INTERPRET=1
         there): a smoke test of the script, its numbers mean nothing.
--out DIR writes DIR/bench_norm_rope.json and DIR/bench_norm_rope.log.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention import norm_rope
from attention.norm_rope import qk_norm_rope, qk_norm_rope_reference, rope_reference

HEADS_Q, HEADS_K, HEAD_DIM, BATCH = 40, 8, 128, 1
EPS = 1e-6
SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
DRY_SEQLENS = (16, 32)
TARGET_SEQ, TARGET_FWD_BWD_MS, TARGET_MIN_SEQ = 16384, 0.45, 2048
SWEEP_SEQLENS = (4096, 16384)
SWEEP_CONFIGS = ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8))  # (elements per tile, num_warps)
SWEEP_BWD_PROGRAMS_PER_SM = (4, 16, 64)


@dataclass
class Result:
    seq: int
    variant: str
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    peak_mib: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median milliseconds of fn(): CUDA events with an L2 flush before each rep on a GPU,
    perf_counter on the CPU (--dry)."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        # Larger than any L2 (H100 50 MB, H200 60 MB), so each rep reads its inputs from HBM, as in training.
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.flush is None:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
                continue
            self.flush.zero_()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times)


def copy_bandwidth_gbs(timer: Timer) -> float:
    """Device copy bandwidth (bytes read + written per second): the roofline `ours` is held against."""
    n_bytes = (1 << 30) if timer.device.type == "cuda" else (64 << 20)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=timer.device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


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

    q = randn(BATCH, seq, HEADS_Q, HEAD_DIM).requires_grad_()
    k = randn(BATCH, seq, HEADS_K, HEAD_DIM).requires_grad_()
    q_w = (1.0 + 0.1 * randn(HEAD_DIM)).requires_grad_()
    k_w = (1.0 + 0.1 * randn(HEAD_DIM)).requires_grad_()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    freqs = torch.arange(seq, device=device).float()[None, :, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    grads = (randn(BATCH, seq, HEADS_Q, HEAD_DIM), randn(BATCH, seq, HEADS_K, HEAD_DIM))
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


def build_liger(with_rope: bool):
    """Liger's RMSNorm (llama casting: the Qwen3 cast order) + eager or Liger RoPE; raises when absent.
    (Liger's RoPE rotates its inputs and upstream grads in place; harmless for timing.)"""
    from liger_kernel.ops import LigerRMSNormFunction
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def norm(x, w):
        # in_place=False: the in-place variant would overwrite the upstream grad buffer in backward.
        return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)

    def fn(q, k, q_w, k_w, cos, sin):
        q_n, k_n = norm(q, q_w), norm(k, k_w)
        if not with_rope:
            return rope_reference(q_n, cos, sin), rope_reference(k_n, cos, sin)
        q_out, k_out = liger_rotary_pos_emb(q_n.transpose(1, 2), k_n.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return fn


VARIANTS = {
    "eager": lambda: eager,
    "compile": build_compiled,
    "liger-norm": lambda: build_liger(with_rope=False),
    "liger-both": lambda: build_liger(with_rope=True),
    "ours": lambda: ours,
}


def measure(fn, seq: int, timer: Timer, dtype: torch.dtype) -> Result:
    inputs, grads = make_inputs(seq, timer.device, dtype)
    leaves = inputs[:4]

    def forward():
        return fn(*inputs)

    def forward_backward():
        return torch.autograd.grad(fn(*inputs), leaves, grads)

    fwd_bwd_ms = timer(forward_backward)  # first: a compile variant compiles in this warmup
    return Result(seq, "", fwd_ms=timer(forward), fwd_bwd_ms=fwd_bwd_ms,
                  peak_mib=peak_extra_mib(forward_backward, timer.device))


def ours_bytes(seq: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """HBM bytes the kernels must move: forward reads q, k, cos, sin, w and writes q, k; backward reads
    q, k (the norm is recomputed), both upstream grads, cos, sin, w and writes dq, dk and the dW partials
    (written once, read once by the sum)."""
    item = torch.empty((), dtype=dtype).element_size()
    qk = BATCH * seq * (HEADS_Q + HEADS_K) * HEAD_DIM * item
    table = 2 * seq * HEAD_DIM * item          # cos + sin, [1, S, D] each
    weights = 2 * HEAD_DIM * item
    n_progs = norm_rope.BWD_PROGRAMS_PER_SM * norm_rope._num_sms(device)  # about; rounded by tiles
    partials = 2 * n_progs * HEAD_DIM * 4
    fwd = 2 * qk + table + weights
    bwd = 4 * qk + table + 2 * weights + partials  # q, k, grads in; dq, dk out; dW out
    return fwd, fwd + bwd


# ----------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(r: Result, mine: Result | None, attr: str) -> str:
    mine_ms, theirs_ms = getattr(mine, attr, None), getattr(r, attr)
    return f"{theirs_ms / mine_ms:.2f}x" if mine_ms and theirs_ms else "-"


def report(results: list[Result], copy_gbs: float, log) -> dict:
    by_seq: dict[int, dict[str, Result]] = {}
    for r in results:
        by_seq.setdefault(r.seq, {})[r.variant] = r
    log(f"{'seq':>6} {'variant':<11} {'fwd ms':>8} {'f+b ms':>8} {'peak MiB':>9} {'fwd x':>6} {'f+b x':>6}  note")
    for seq, rows in by_seq.items():
        mine = rows.get("ours")
        for name, r in rows.items():
            log(f"{seq:>6} {name:<11} {fmt(r.fwd_ms):>8} {fmt(r.fwd_bwd_ms):>8} {fmt(r.peak_mib, '.1f'):>9} "
                f"{ratio(r, mine, 'fwd_ms'):>6} {ratio(r, mine, 'fwd_bwd_ms'):>6}  {r.note}")
    log("(x = variant time / ours time: > 1 means ours is faster)")
    log(f"\nours vs the device copy bandwidth {copy_gbs:.0f} GB/s (read + write):")
    log(f"{'seq':>6} {'fwd MB':>8} {'fwd GB/s':>9} {'fwd %':>6} {'f+b MB':>8} {'f+b GB/s':>9} {'f+b %':>6}")
    for seq, rows in by_seq.items():
        r = rows.get("ours")
        if r is None or not r.extra:
            continue
        e = r.extra
        log(f"{seq:>6} {e['fwd_bytes'] / 1e6:>8.1f} {fmt(e.get('fwd_gbs'), '.0f'):>9} "
            f"{fmt(e.get('fwd_roofline_pct'), '.0f'):>6} {e['fwd_bwd_bytes'] / 1e6:>8.1f} "
            f"{fmt(e.get('fwd_bwd_gbs'), '.0f'):>9} {fmt(e.get('fwd_bwd_roofline_pct'), '.0f'):>6}")
    return check_targets(by_seq, log)


def check_targets(by_seq: dict[int, dict[str, Result]], log) -> dict:
    at_target = getattr(by_seq.get(TARGET_SEQ, {}).get("ours"), "fwd_bwd_ms", None)
    slower = []  # (seq, pass, variant) where some other variant beat ours, or ours has no number
    judged = [seq for seq in by_seq if seq >= TARGET_MIN_SEQ]
    for seq, rows in by_seq.items():
        mine = rows.get("ours")
        for name, r in rows.items():
            for attr in ("fwd_ms", "fwd_bwd_ms"):
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
    log(f"\ntarget (one H200): ours 16k fwd+bwd {fmt(at_target)} ms <= {TARGET_FWD_BWD_MS}: "
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


def sweep(seqlens, timer: Timer, dtype: torch.dtype, log) -> list[dict]:
    """`ours` under other tile configs and backward grid sizes; restores the defaults afterwards."""
    default_config, default_per_sm = norm_rope._launch_config, norm_rope.BWD_PROGRAMS_PER_SM
    rows = []
    log(f"\nsweep of ours ({'elements per tile, warps, bwd programs per SM'}): fwd ms, bwd ms (= f+b - fwd)")
    try:
        for seq in seqlens:
            for (elements, warps) in SWEEP_CONFIGS:
                for per_sm in SWEEP_BWD_PROGRAMS_PER_SM:
                    norm_rope._launch_config = lambda padded_row, backward, e=elements, w=warps: (
                        max(1, e // padded_row), w)
                    norm_rope.BWD_PROGRAMS_PER_SM = per_sm
                    try:
                        r = measure(ours, seq, timer, dtype)
                        row = {"seq": seq, "tile_elements": elements, "num_warps": warps,
                               "bwd_programs_per_sm": per_sm, "fwd_ms": r.fwd_ms, "bwd_ms": r.fwd_bwd_ms - r.fwd_ms}
                        log(f"{seq:>6} {elements:>5} {warps:>2} {per_sm:>2}: fwd {r.fwd_ms:.4f}  bwd {row['bwd_ms']:.4f}")
                    except Exception as exc:  # noqa: BLE001  (one failing config must not end the sweep)
                        row = {"seq": seq, "tile_elements": elements, "num_warps": warps,
                               "bwd_programs_per_sm": per_sm, "error": repr(exc)}
                        log(f"{seq:>6} {elements:>5} {warps:>2} {per_sm:>2}: error {exc!r}")
                    rows.append(row)
    finally:
        norm_rope._launch_config, norm_rope.BWD_PROGRAMS_PER_SM = default_config, default_per_sm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for bench_norm_rope.json and .log")
    parser.add_argument("--seqlens", help="comma-separated sequence lengths (default: 1k..32k)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of variants")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time ours under other tile configs")
    parser.add_argument("--dry", action="store_true", help="CPU smoke test at tiny lengths")
    args = parser.parse_args()

    lines: list[str] = []

    def log(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    if not args.dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --dry for a CPU smoke test")
    device = torch.device("cpu" if args.dry else "cuda")
    dtype = torch.float32 if args.dry else torch.bfloat16  # the Triton interpreter cannot do bf16
    seqlens = [int(s) for s in args.seqlens.split(",")] if args.seqlens else (DRY_SEQLENS if args.dry else SEQLENS)
    timer = Timer(device, reps=3 if args.dry else args.reps, warmup=1 if args.dry else args.warmup)

    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "n/a"
    log(f"device {device_name}, torch {torch.__version__}, triton {triton_version}, {dtype}, "
        f"Qwen3-14B attention: B={BATCH} Hq={HEADS_Q} Hkv={HEADS_K} D={HEAD_DIM}; "
        f"median of {timer.reps} reps after {timer.warmup} warmup")
    copy_gbs = copy_bandwidth_gbs(timer)

    results: list[Result] = []
    for name in args.variants.split(","):
        try:
            fn = VARIANTS[name]()
        except Exception as exc:  # noqa: BLE001  (e.g. liger not installed: the rows say n/a)
            results += [Result(seq, name, note=f"n/a: {exc!r}"[:120]) for seq in seqlens]
            continue
        for seq in seqlens:
            try:
                r = measure(fn, seq, timer, dtype)
                r.variant = name
                if name == "ours":
                    add_roofline(r, dtype, device, copy_gbs)
            except Exception as exc:  # noqa: BLE001  (one failing variant must not kill the table)
                traceback.print_exc()
                r = Result(seq, name, note=f"error: {exc!r}"[:160])
            results.append(r)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results.sort(key=lambda r: (r.seq, list(VARIANTS).index(r.variant)))
    log()
    checks = report(results, copy_gbs, log)
    sweep_rows = sweep(DRY_SEQLENS[:1] if args.dry else SWEEP_SEQLENS, timer, dtype, log) if args.sweep else []

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        payload = {"device": device_name, "torch": torch.__version__, "triton": triton_version,
                   "dtype": str(dtype), "date": time.strftime("%Y-%m-%d"), "copy_gbs": copy_gbs,
                   "shape": {"batch": BATCH, "heads_q": HEADS_Q, "heads_k": HEADS_K, "head_dim": HEAD_DIM},
                   "results": [asdict(r) for r in results], "targets": checks, "sweep": sweep_rows,
                   "command": " ".join(sys.argv)}
        with open(os.path.join(args.out, "bench_norm_rope.json"), "w") as f:
            json.dump(payload, f, indent=1)
        with open(os.path.join(args.out, "bench_norm_rope.log"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

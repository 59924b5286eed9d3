"""Autotuning configs and pruning for the scattermoe Triton kernels.

Contract:
    GEMM_CONFIGS / XTY_CONFIGS / FACTOR_GRAD_CONFIGS
                                 candidate triton.Configs (one fixed small config under TRITON_INTERPRET=1,
                                 where autotuning over several configs does not work)
    FP4_GEMM_CONFIGS             the grouped GEMM's candidates when its weight is FP4-packed (prune_gemm keeps
                                 each family to its own launches)
    force_fp4_gemm_config(bm, bn, bk, warps, stages, persistent=False)
                                 replaces them by that one config, before the first launch (a benchmark's
                                 sweep: benchmarks/gpu_fp4.sh)
    prune_gemm / prune_xty / prune_factor_grads
                                 `early_config_prune` hooks: clamp blocks to the problem, drop configs whose
                                 pipelined tiles exceed the device's shared memory or whose live fp32 tiles
                                 exceed a per-thread register budget; IEEE fp32 dots (FMA, no tensor
                                 cores) get the smallest remaining tile alone
    m_bucket(rows)               the autotune key for the routed-row count (the nearest power of two on a log
                                 scale), so a new token count re-tunes only when it crosses 2^(n + 1/2)
    bench                        a shorter do_bench for the autotuner (the kernels are short: the default over-samples)
    autotune(**kwargs)           triton.autotune, its results cached on disk where this Triton can, so a
                                 second run does not re-tune
    warm_up(group)               the window (the runtime's first step, after parallelize) in which `faster`
                                 times its choices: rank 0 of `group` times and broadcasts them over `group`
    faster(key, candidates)      which of several implementations of one operation is faster here,
                                 timed once per key, the same on every rank of the warm-up group,
                                 remembered and logged
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import triton
import triton.testing

from gpu.launch import next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
log = logging.getLogger(__name__)

# Per-thread registers for the fp32 accumulators. Measured on sm_90 (ptxas): at 128 the base kernels
# just fit, while a LoRA accumulator on top spills the accumulator inside the K loop, so it gets 96.
_ACC_REGS = 128
_ACC_REGS_LORA = 96
_MIN_DOT = 16  # tl.dot needs every dimension >= 16


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, names=("BLOCK_M", "BLOCK_N", "BLOCK_K"), **extra):
    return triton.Config({**dict(zip(names, (bm, bn, bk))), **extra}, num_warps=warps, num_stages=stages)


def _gemm_config(bm: int, bn: int, bk: int, warps: int, stages: int, persistent: bool = False):
    return _config(bm, bn, bk, warps, stages, PERSISTENT=persistent)


_XTY_NAMES = ("BLOCK_P", "BLOCK_Q", "BLOCK_K")
# lora_factor_grads: BLOCK_P is not tuned (one tile covers the rank).
_FACTOR_NAMES = ("BLOCK_Q", "BLOCK_K")


def _factor_config(bq: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(dict(zip(_FACTOR_NAMES, (bq, bk))), num_warps=warps, num_stages=stages)


# Narrow configs (BLOCK_N, or BLOCK_P / BLOCK_Q, of 16) serve the rank-sized products and LoRA-factor
# gradients (N, P or Q <= 32); the others the base GEMMs. The pruners keep one family per problem.
_NARROW = 32

if INTERPRET:
    # Persistent: the loop over tiles is what the interpreter should exercise (one tile per program is
    # its special case).
    GEMM_CONFIGS = [_gemm_config(16, 32, 16, 4, 1, persistent=True)]
    XTY_CONFIGS = [_config(32, 32, 16, 4, 1, _XTY_NAMES)]
    FACTOR_GRAD_CONFIGS = [_factor_config(32, 16, 4, 1)]
else:
    # Kept short on purpose: every config is compiled once per kernel variant on a cold cache. The set is
    # the winners of a sweep at Qwen3-30B-A3B shapes (docs/benchmarks.md#expert-layer: 128x256x64 for the
    # forward and dx, 64x128 for the LoRA-in-loop variants, 64x16 for the rank products, 128x128 and
    # 256x128 for the split-LoRA GEMMs, whose LoRA tiles held across the K loop cost registers; the
    # persistent 128x256 ones with TMA operands).
    GEMM_CONFIGS = [_gemm_config(*c) for c in (
        (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
        (128, 128, 128, 8, 3), (64, 16, 64, 4, 4), (64, 16, 128, 4, 3), (128, 16, 64, 4, 4),
        (128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, True))]
    XTY_CONFIGS = [_config(*c, _XTY_NAMES) for c in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                                                     (16, 128, 128, 4, 3), (16, 128, 64, 4, 4),
                                                     (64, 16, 64, 4, 4), (128, 16, 64, 8, 3))]
    # The best of a config sweep at Qwen3-30B-A3B shapes is in this set (docs/benchmarks.md#expert-layer).
    FACTOR_GRAD_CONFIGS = [_factor_config(*c) for c in ((128, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4),
                                                        (256, 64, 8, 3))]

# Packed FP4 weights are decoded in the K loop (ALU work in the MMA warps). Taller row blocks decode less per
# MMA but hold so many registers that one CTA fits an SM, which loses; only the three close configs are tried
# (docs/benchmarks.md#fp4-experts).
FP4_GEMM_CONFIGS = GEMM_CONFIGS if INTERPRET else [_gemm_config(*c) for c in (
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3))]


def _gemm_key(c: triton.Config) -> tuple:
    return (*(c.kwargs[n] for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PERSISTENT")), c.num_warps, c.num_stages)


_DENSE_KEYS = {_gemm_key(c) for c in GEMM_CONFIGS}
_FP4_KEYS = {_gemm_key(c) for c in FP4_GEMM_CONFIGS}
# The grouped GEMM's config list: both families, each config once.
ALL_GEMM_CONFIGS = GEMM_CONFIGS + [c for c in FP4_GEMM_CONFIGS if _gemm_key(c) not in _DENSE_KEYS]


def force_fp4_gemm_config(bm: int, bn: int, bk: int, warps: int, stages: int, persistent: bool = False) -> None:
    """Packed-weight GEMMs launch this one config instead of FP4_GEMM_CONFIGS (a benchmark's sweep). Call it
    before the first launch: the autotuner holds ALL_GEMM_CONFIGS (changed in place) and caches its choice."""
    if INTERPRET:
        return
    config = _gemm_config(bm, bn, bk, warps, stages, persistent)
    FP4_GEMM_CONFIGS[:] = [config]
    _FP4_KEYS.clear()
    _FP4_KEYS.add(_gemm_key(config))
    if _gemm_key(config) not in {_gemm_key(c) for c in ALL_GEMM_CONFIGS}:
        ALL_GEMM_CONFIGS.append(config)


def _family(configs: list[triton.Config], names: tuple[str, ...], dims: tuple[int, ...]) -> list[triton.Config]:
    """The narrow configs when one of `dims` is rank-sized, else the wide ones (all when none match)."""
    narrow_problem = min(dims) <= _NARROW
    kept = [c for c in configs if (min(c.kwargs[n] for n in names) <= _NARROW) == narrow_problem]
    return kept or configs


def m_bucket(rows: int) -> int:
    """The power of two nearest to `rows` on a log scale. Balanced routing's rows (tokens x top-k, often a power
    of two) then sit mid-bucket: under EP a rank's rows vary around them from step to step, and with the next
    power of two as the key they flipped between two buckets, the second tuned in whichever later step first
    met it."""
    upper = next_power_of_2(rows)
    return max(_MIN_DOT, upper if 2 * rows * rows >= upper * upper else upper // 2)


def _clamp(block: int, extent: int) -> int:
    return min(block, max(_MIN_DOT, triton.next_power_of_2(extent)))


@functools.cache
def _shared_memory_bytes(device: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def _fits(c: triton.Config, stage_elems: int, elem_bytes: int, acc_fp32: int, acc_budget: int,
          device: int) -> bool:
    smem_ok = c.num_stages * stage_elems * elem_bytes <= _shared_memory_bytes(device)
    return smem_ok and acc_fp32 <= acc_budget * 32 * c.num_warps


def _tile_size(c: triton.Config) -> tuple[int, int]:
    blocks = 1
    for name, value in c.kwargs.items():
        if name.startswith("BLOCK_"):
            blocks *= value
    return blocks, c.num_stages


def _dedupe_or_smallest(kept: dict, configs: list[triton.Config], args: dict) -> list[triton.Config]:
    """The kept configs (or the smallest of all when none fits). IEEE fp32 dots run on the FMA units,
    not the tensor cores: there only the smallest kept tile, since each FMA variant compiles slowly
    (the dot is unrolled per thread) and fp32 runs are for exact parity, not speed."""
    if args.get("DOT_PRECISION") == "ieee":
        return [min(list(kept.values()) or configs, key=_tile_size)]
    if kept:
        return list(kept.values())
    return [min(configs, key=lambda c: c.num_stages * sum(c.kwargs.values()))]


def prune_gemm(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    args = {**named_args, **kwargs}
    glu_fwd, block_r = args["GLU_FWD"], args["BLOCK_R"]
    # GLU_FWD tiles interleave gate and up columns: BLOCK_N covers 2x the output columns.
    cols = 2 * args["N"] if glu_fwd else args["N"]
    min_n = 2 * _MIN_DOT if glu_fwd else _MIN_DOT
    device = args["in_ptr"].device.index
    # A packed FP4 weight's launches take the FP4 family, the others the dense one (all configs when a caller
    # forced others: the tests' one_config).
    family = _FP4_KEYS if args["W_FMT"] in (1, 2) else _DENSE_KEYS  # FP8 codes (3) take the dense family
    configs = [c for c in configs if _gemm_key(c) in family] or configs
    kept = {}
    for c in _family(configs, ("BLOCK_N",), (cols,)):
        bm = c.kwargs["BLOCK_M"]
        bn = max(min_n, _clamp(c.kwargs["BLOCK_N"], cols))
        bk = _clamp(c.kwargs["BLOCK_K"], args["K"])
        stage = bm * bk + bn * bk + (block_r * bk if args["LORA_IN_LOOP"] else 0)
        acc = bm * bn + (bm * block_r if args["LORA_IN_LOOP"] else 0)
        budget = _ACC_REGS_LORA if args["LORA_IN_LOOP"] else _ACC_REGS
        if _fits(c, stage, args["in_ptr"].element_size(), acc, budget, device):
            persistent = c.kwargs["PERSISTENT"]
            kept[(bm, bn, bk, c.num_warps, c.num_stages, persistent)] = _gemm_config(
                bm, bn, bk, c.num_warps, c.num_stages, persistent)
    return _dedupe_or_smallest(kept, configs, args)


def prune_xty(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    args = {**named_args, **kwargs}
    device = args["l_ptr"].device.index
    kept = {}
    for c in _family(configs, ("BLOCK_P", "BLOCK_Q"), (args["P"], args["Q"])):
        bp = _clamp(c.kwargs["BLOCK_P"], args["P"])
        bq = _clamp(c.kwargs["BLOCK_Q"], args["Q"])
        bk = c.kwargs["BLOCK_K"]
        if _fits(c, bk * (bp + bq), args["l_ptr"].element_size(), bp * bq, _ACC_REGS, device):
            kept[(bp, bq, bk, c.num_warps, c.num_stages)] = _config(bp, bq, bk, c.num_warps, c.num_stages,
                                                                    _XTY_NAMES)
    return _dedupe_or_smallest(kept, configs, args)


def prune_factor_grads(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    args = {**named_args, **kwargs}
    bp, widest = args["BLOCK_P"], max(args[f"Q{i}"] for i in range(args["NUM"]))
    device = args["l0_ptr"].device.index
    kept = {}
    for c in configs:
        bq = _clamp(c.kwargs["BLOCK_Q"], widest)
        bk = c.kwargs["BLOCK_K"]
        if _fits(c, bk * (bp + bq), args["l0_ptr"].element_size(), bp * bq, _ACC_REGS, device):
            kept[(bq, bk, c.num_warps, c.num_stages)] = _factor_config(bq, bk, c.num_warps, c.num_stages)
    return _dedupe_or_smallest(kept, configs, args)


def bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# Triton keys the stored results by its version, the device target, the kernel source, the configs and
# the tuning key; releases before the option re-tune in every run.
_AUTOTUNE_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def autotune(**kwargs):
    """triton.autotune(**kwargs), with its results cached on disk where this Triton can."""
    return triton.autotune(**kwargs, **_AUTOTUNE_CACHE)


# Explicit registry: (operation, shape key) -> the name of its faster implementation on this device.
_FASTER: dict[tuple, str] = {}
# The open warm-up windows' groups (None: this process alone), innermost last.
_WARM_UP: list[dist.ProcessGroup | None] = []


@contextmanager
def warm_up(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Inside, `faster` times the choices it meets, on the first rank of `group` alone, and broadcasts them over
    `group` (None or one rank: no collective), so every rank of it runs the same kernels. The runtime opens it
    once, around its first step after parallelize; every rank of `group` must run the same forward inside."""
    _WARM_UP.append(group)
    try:
        yield
    finally:
        _WARM_UP.pop()


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def faster(key: tuple, candidates: Callable[[], dict[str, Callable[[], object]]]) -> str | None:
    """The name of the fastest of `candidates()` (name -> a call running that implementation) for `key`,
    timed on the first call and remembered for the process; None while undecided (`candidates()` was
    empty: nothing could be timed on this call), and then the next call tries again.

    Which one wins differs between machines of one kind, so it is measured, not assumed. Timing happens inside
    `warm_up(group)`, where the group's first rank alone times and broadcasts its winner: every rank of the group
    must then call this for the same keys in the same order (callers keep sizes that differ between ranks, row
    counts, out of both the key and the decision to call). Outside a warm-up window a process with a process
    group up never communicates here: an undecided key takes the first candidate, untimed (a single process
    times it). During CUDA-graph capture nothing can be timed or broadcast: the first candidate, unless a winner
    is known.
    """
    winner = _FASTER.get(key)
    if winner is not None:
        return winner
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return next(iter(candidates()), None)
    if _WARM_UP:
        group = _WARM_UP[-1]
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return next(iter(candidates()), None)  # no group to agree over: the same untimed choice on every rank
    else:
        group = None
    shared = _group_size(group) > 1
    times = {}
    if not shared or dist.get_rank(group) == 0:
        times = {name: bench(call, None) for name, call in candidates().items()}
        winner = min(times, key=times.get) if times else None
    if shared:
        verdict = [winner]
        dist.broadcast_object_list(verdict, src=dist.get_global_rank(group, 0), group=group)
        winner = verdict[0]
    if winner is not None:
        _FASTER[key] = winner
        log.info("kernel choice for %s: %s%s", key, winner,
                 f" (ms: {', '.join(f'{n} {t:.3f}' for n, t in times.items())})" if times else " (rank 0's)")
    return winner

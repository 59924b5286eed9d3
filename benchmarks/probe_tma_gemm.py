"""Does TMA (tensor descriptors), warp specialization or a persistent grid speed up our grouped GEMM?

    python benchmarks/probe_tma_gemm.py

A plain grouped expert GEMM (no LoRA, no epilogue) over expert-sorted rows at Qwen3-30B-A3B shapes
(T=8192, E=128, H=2048, I=768, k=8, random routing), in variants of one probe kernel:
    ptr      pointer loads (what grouped_linear did before this probe; it now takes TMA + persistent for
             expert-sorted rows, pointers for gathered ones)
    tma_w    the weight tile by a device-side tensor descriptor, the rows by pointers (works gathered)
    tma_all  both by descriptors (expert-sorted rows only: TMA cannot gather on sm90)
each also with a warp-specialized K loop (ws) and on a persistent grid (pers). Printed next to the
production kernel (autotuned) and torch._grouped_mm (CUTLASS) on the same operands, as ms and TFLOP/s.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.probe_expert_gemms import K_TOP, E, H, I, T, ms, routings
from moe.kernels import grouped_linear as gl
from moe.kernels.grouped_linear import _expert_block
from moe.kernels.routing import sort_slots
from gpu.launch import ensure_scratch_allocator


@triton.jit
def _probe_kernel(in_ptr, s_in_m, order_ptr, offsets_ptr, w_ptr, s_w_e, s_w_n, s_w_k, out_ptr, s_out_m,
                  E, N, S, K: tl.constexpr, TOPK: tl.constexpr, GATHER: tl.constexpr, W_T: tl.constexpr,
                  W_TMA: tl.constexpr, X_TMA: tl.constexpr, WS: tl.constexpr, PERSISTENT: tl.constexpr,
                  NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """W_T: the weight is the transposed view of a [E, K, N] tensor (dx's W_gu^T): its descriptor is
    built over [E, K, N] and loads [BLOCK_K, BLOCK_N] tiles."""
    num_n = tl.cdiv(N, BLOCK_N)
    if W_TMA:
        if W_T:
            w_desc = tl.make_tensor_descriptor(w_ptr, [E, K, N], [s_w_e, s_w_k, 1], [1, BLOCK_K, BLOCK_N])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, [E, N, K], [s_w_e, s_w_n, 1], [1, BLOCK_N, BLOCK_K])
    if X_TMA:
        x_desc = tl.make_tensor_descriptor(in_ptr, [S, K], [s_in_m, 1], [BLOCK_M, BLOCK_K])
    if PERSISTENT:
        num_tiles = (tl.cdiv(S, BLOCK_M) + E) * num_n
        first = tl.program_id(0)
        step = NUM_PROGRAMS
    else:
        num_tiles = tl.program_id(0) + 1
        first = tl.program_id(0)
        step = 1
    for tile in range(first, num_tiles, step):
        pid_m = tile // num_n
        pid_n = tile % num_n
        e, row0, row_end = _expert_block(offsets_ptr, pid_m, E, BLOCK_M, 256)
        if e < E:
            p_M = row0 + tl.arange(0, BLOCK_M)
            mask_M = p_M < row_end
            p_M = tl.where(mask_M, p_M, row0)
            if GATHER:
                rows_M = (tl.load(order_ptr + p_M) // TOPK).to(tl.int64)
            else:
                rows_M = p_M.to(tl.int64)
            n_N = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            k_K = tl.arange(0, BLOCK_K)
            in_ptrs = in_ptr + rows_M[:, None] * s_in_m + k_K[None, :]
            w_ptrs = w_ptr + e.to(tl.int64) * s_w_e + n_N[None, :] * s_w_n + k_K[:, None] * s_w_k
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WS):
                k0 = i * BLOCK_K
                if X_TMA:
                    x = x_desc.load([row0, k0])
                else:
                    x = tl.load(in_ptrs + k0, mask=(k_K < K - k0)[None, :], other=0.0)
                if W_TMA:
                    if W_T:
                        w = w_desc.load([e, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
                    else:
                        w = w_desc.load([e, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    w = tl.load(w_ptrs + k0 * s_w_k, mask=(k_K < K - k0)[:, None] & (n_N < N)[None, :],
                                other=0.0)
                acc = tl.dot(x, w, acc)
            out_ptrs = out_ptr + p_M.to(tl.int64)[:, None] * s_out_m + n_N[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_M[:, None] & (n_N < N)[None, :])


def cases():
    slots = sort_slots(routings()["random"], E)
    S = slots.num_slots
    bf = torch.bfloat16
    x = torch.randn(T, H, device="cuda", dtype=bf)
    hw = torch.randn(S, I, device="cuda", dtype=bf)
    dgu = torch.randn(S, 2 * I, device="cuda", dtype=bf)
    w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=bf) * 0.02
    w_down = torch.randn(E, H, I, device="cuda", dtype=bf) * 0.02
    # name: (input, gather, weight [E, N, K] view, transposed view of a [E, K, N] tensor)
    return slots, {"down": (hw, False, w_down, False), "dx": (dgu, False, w_gu.transpose(1, 2), True),
                   "gate_up (gathered)": (x, True, w_gu, False)}


def main() -> None:
    ensure_scratch_allocator()
    slots, named = cases()
    S = slots.num_slots
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4)]
    for name, (in_, gather, w, w_t) in named.items():
        N, K = w.shape[1], w.shape[2]
        flops = 2 * S * N * K
        out = torch.empty(S, N, device="cuda", dtype=torch.bfloat16)
        t_prod = ms(lambda in_=in_, w=w, gather=gather, out=out, N=N: gl._launch(
            in_, slots, w, N, None, None, out, gather=gather))
        line = f"== {name}: production {t_prod:.3f} ms ({flops / t_prod / 1e9:.0f} TFLOP/s)"
        if not gather:
            t_cut = ms(lambda in_=in_, w=w: gl.expert_gemm(in_, slots, w))
            line += f", CUTLASS {t_cut:.3f} ms ({flops / t_cut / 1e9:.0f})"
        print(line, flush=True)
        ref = out.clone()
        valid = slots.offsets_E1[-1].item()
        modes = [("ptr", False, False), ("tma_w", True, False)] + ([] if gather else [("tma_all", True, True)])
        for (mode, w_tma, x_tma), ws, pers, (bm, bn, bk, warps, stages) in itertools.product(
                modes, (False, True), (False, True), tiles):
            grid = (sms,) if pers else ((triton.cdiv(S, bm) + E) * triton.cdiv(N, bn),)
            s_w = w.stride()

            def run(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, grid=grid, w_tma=w_tma, x_tma=x_tma,
                    ws=ws, pers=pers, in_=in_, w=w, s_w=s_w, out=out, N=N, K=K, gather=gather, w_t=w_t):
                _probe_kernel[grid](in_, in_.stride(0), slots.order_S, slots.offsets_E1, w, *s_w, out,
                                    out.stride(0), E, N, S, K=K, TOPK=K_TOP, GATHER=gather, W_T=w_t,
                                    W_TMA=w_tma, X_TMA=x_tma, WS=ws, PERSISTENT=pers, NUM_PROGRAMS=sms,
                                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            tag = f"{mode:7}{' ws' if ws else '   '}{' pers' if pers else '     '} {bm}x{bn}x{bk} w{warps} s{stages}"
            try:
                out.zero_()
                run()
                err = (out[:valid].float() - ref[:valid].float()).abs().max().item()
                t = ms(run)
                print(f"   {tag}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s) max|diff| {err:.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile here: say so, go on
                print(f"   {tag}: n/a {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}",
                      flush=True)


if __name__ == "__main__":
    main()

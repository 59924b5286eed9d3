"""Gather -> grouped expert linear (+ fused LoRA) -> epilogue, over expert-sorted rows (ScatterMoE style).

Shapes: M routed rows, S the rows of expert-sorted buffers (slots.capacity: the valid slots when the caller
knows their number, else all M*k), E experts, N output columns, K reduction, r LoRA rank.
Each expert-sorted position p (see routing.SlotOrder) belongs to expert e and reads input row
`order[p] // k` of a token-layout input (gather=True) or row p of an expert-sorted input:

    out[p] = in[row(p)] @ W_e^T + scaling * (in[row(p)] @ A_e^T) @ B_e^T

with W_e = w_ENK[e] [N, K], A_e = A_ErK[e] [r, K], B_e = B_ENr[e] [N, r] read through their strides,
so a transposed view (the backward's W^T, B^T, A^T) costs nothing. The LoRA product is either fused
(in @ A^T accumulated in the K loop next to the base product, @ B^T in the epilogue; the rank-sized
intermediate is written once, by the first column block) or split (the intermediate is computed
beforehand by a rank-sized grouped product; its product with B^T is added to the accumulator after
the K loop, so the loop runs with the registers of the LoRA-free kernel). The forward SwiGLU is fused
into the epilogue (gate and up columns interleaved in one accumulator); the backward SwiGLU (with the
routing weight and its gradient, and the gate_up LoRA's rank product) is one pass after the GEMM.

Public launchers:
    gate_up_swiglu(x_MH, slots, w_E2IH, lora, weights_Mk)
                                                       -> gate_up_S2I, hw_SI, xa_Sr (SwiGLU fused, hw = w * h)
    expert_linear(in_, slots, w_ENK, lora, gather)     -> out_SN, ia_Sr
    expert_gemm(in_SK, slots, w_ENK)                   -> out_SN (the bare GEMM: CUTLASS or ours, the faster)
    swiglu_backward(g_SI, slots, gate_up_S2I, weights_Mk, gu_B_E2Ir)
                                                       -> d_gate_up_S2I, dgub_Sr, d_weights_Mk
A base weight w_ENK may also be an FP4-packed fp4.PackedWeight (its .t() the backward's transposed view): its
tiles are decoded in registers in the pointer K loop (W_FMT constexpr; no TMA, never CUTLASS; a dense weight
compiles to the same code as without that branch), so every row block of an expert decodes its weight tiles
again and no dequantized weight exists anywhere.
An FP8 weight (fp8.FP8View, quant.FP8Weight's e4m3 codes and per-row scales) runs the K loop on fp8 operands:
the input is quantized rowwise before the launch (fp8.fp8_input_rows), the fp32 accumulator is scaled after
the loop (W_FMT = fp8.FMT_FP8), and its LoRA always takes the split path.
Rows of the outputs at -1 slot positions are left unwritten. No per-expert loop, no host sync:
the grid is sized from S and E, and each program finds its expert from the segment offsets.
Every tl.dot takes its input precision from the DOT_PRECISION constexpr, set per launch by
precision.dot_precision (fp32: IEEE unless torch allows TF32).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu.launch import cdiv, ensure_scratch_allocator, launch, next_power_of_2
from moe.kernels.fp4 import (
    FMT_CODES,
    PackedWeight,
    fp4_tensor_scale,
    fp4_weight_ptrs,
    fp4_weight_tile,
)
from moe.kernels.fp8 import FMT_FP8, FP8View, fp8_input_rows
from moe.kernels.precision import dot_precision
from moe.kernels.routing import SlotOrder
from moe.kernels.tuning import ALL_GEMM_CONFIGS, INTERPRET, autotune, bench, faster, m_bucket, prune_gemm

# Segment search vector width; a floor keeps one compiled variant for every E up to 256.
_MIN_BLOCK_E = 256
# (BLOCK_M, BLOCK_N, warps) of the memory-bound SwiGLU-backward pass (one program per row block, a
# loop over the columns), without and with the gate_up LoRA's rank product; small under the
# interpreter. The measured best at Qwen3-30B-A3B shapes (docs/benchmarks.md#expert-layer).
_SWIGLU_BWD_TILE = (16, 32, 4) if INTERPRET else (32, 128, 4)
_SWIGLU_BWD_TILE_LORA = (16, 32, 4) if INTERPRET else (64, 32, 4)


# A base weight as the kernels take it: dense, FP4-packed or FP8.
Weight = torch.Tensor | PackedWeight | FP8View
_W_FP8 = tl.constexpr(FMT_FP8)


@dataclass(frozen=True)
class LoraView:
    """One projection's LoRA as the kernel reads it: A_ErK [E, r, K], B_ENr [E, N, r] (views allowed).

    split: compute the rank-sized intermediate with its own grouped product instead of in the K loop.
    """
    A_ErK: torch.Tensor
    B_ENr: torch.Tensor
    scaling: float
    split: bool

    @property
    def rank(self) -> int:
        return self.A_ErK.shape[1]


@triton.jit
def _expert_block(offsets_ptr, pid_m, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, segment end) of row block pid_m; expert >= E for surplus programs.

    Blocks are numbered expert by expert (ceil(count_e / BLOCK_M) each), so a block never spans two
    experts; computing the numbering here keeps BLOCK_M tunable without a host-side block table.
    """
    e_E = tl.arange(0, BLOCK_E)
    in_E = e_E < E
    start_E = tl.load(offsets_ptr + e_E, mask=in_E, other=0)
    end_E = tl.load(offsets_ptr + e_E + 1, mask=in_E, other=0)
    blocks_E = tl.cdiv(end_E - start_E, BLOCK_M)
    stop_E = tl.cumsum(blocks_E, 0)
    e = tl.sum((stop_E <= pid_m).to(tl.int32), 0)
    is_e = e_E == e
    first_block = tl.sum(tl.where(is_e, stop_E - blocks_E, 0), 0)
    row0 = tl.sum(tl.where(is_e, start_E, 0), 0) + (pid_m - first_block) * BLOCK_M
    return e, row0, tl.sum(tl.where(is_e, end_E, 0), 0)


@triton.jit
def _num_row_blocks(offsets_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row blocks of all expert segments together (the programs numbered below it have an expert)."""
    e_E = tl.arange(0, BLOCK_E)
    in_E = e_E < E
    counts_E = tl.load(offsets_ptr + e_E + 1, mask=in_E, other=0) - tl.load(offsets_ptr + e_E, mask=in_E, other=0)
    return tl.sum(tl.cdiv(counts_E, BLOCK_M), 0)


@triton.jit
def _block_rows(offsets_ptr, pid_m, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, positions p_M, row mask) of row block pid_m (expert >= E: a surplus program).
    Surplus rows of an expert's last block re-read its first row: loads need no row mask, stores drop
    them."""
    e, row0, row_end = _expert_block(offsets_ptr, pid_m, E, BLOCK_M, BLOCK_E)
    p_M = row0 + tl.arange(0, BLOCK_M)
    mask_M = p_M < row_end
    return e, row0, tl.where(mask_M, p_M, row0), mask_M


@triton.jit
def _k_loop(in_ptrs, step_in, w_ptrs, step_w, mask_N, a_ptrs, step_a, mask_R, K, acc, acc_r,
            LORA_IN_LOOP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """acc += in @ W^T and (fused LoRA) acc_r += in @ A^T over K. Rows are pre-clamped; weight columns
    and rank rows are masked, never clamped: a clamped index hides the contiguity of a transposed weight
    view (the backward's W^T) and its loads lose vectorization and async pipelining."""
    k_K = tl.arange(0, BLOCK_K)
    for i in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(in_ptrs)
            w = tl.load(w_ptrs, mask=mask_N[None, :], other=0.0)
        else:
            k_in = k_K < K - i * BLOCK_K
            x = tl.load(in_ptrs, mask=k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_in[:, None] & mask_N[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if LORA_IN_LOOP:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_R[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=k_in[:, None] & mask_R[None, :], other=0.0)
            acc_r = tl.dot(x, a, acc_r, input_precision=DOT_PRECISION)
            a_ptrs += step_a
        in_ptrs += step_in
        w_ptrs += step_w
    return acc, acc_r


@triton.jit
def _k_loop_fp4(in_ptrs, step_in, q_ptrs, s_ptrs, ts, mask_W, s_q_o, s_s_o, a_ptrs, step_a, mask_R, K, acc, acc_r,
                LORA_IN_LOOP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr, W_FMT: tl.constexpr, W_BLOCK: tl.constexpr, W_PACKED_T: tl.constexpr):
    """_k_loop with a packed FP4 weight (fp4.fp4_weight_ptrs' pointers, mask_W, ts): each weight tile is decoded
    in registers (fp4.fp4_weight_tile) and rounded to the input's dtype, the value torchao's dequantization
    gives, before the MMA."""
    k_K = tl.arange(0, BLOCK_K)
    for i in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(in_ptrs)
        else:
            k_in = k_K < K - i * BLOCK_K
            x = tl.load(in_ptrs, mask=k_in[None, :], other=0.0)
        # The tile-invariant pointers plus a scalar, not carried and advanced: Triton's axis info is lost on a
        # loop-carried pointer tile (offline sm90: 32 scale loads per thread and step instead of 2, 501 -> 848 SASS).
        w = fp4_weight_tile(q_ptrs, s_ptrs, ts, mask_W, i * BLOCK_K, K, s_q_o, s_s_o, W_FMT, W_BLOCK, W_PACKED_T,
                            EVEN_K, BLOCK_N, BLOCK_K, in_ptrs.dtype.element_ty)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if LORA_IN_LOOP:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_R[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=k_in[:, None] & mask_R[None, :], other=0.0)
            acc_r = tl.dot(x, a, acc_r, input_precision=DOT_PRECISION)
            a_ptrs += step_a
        in_ptrs += step_in
    return acc, acc_r


@triton.jit
def _fp8_scale(acc, in_scale_ptr, rows_M, ws_ptr, e64, s_ws_e, s_ws_o, wrow_N, mask_N, W_PACKED_T: tl.constexpr):
    """The fp32 sum of code products times each row's input scale and (a forward weight) each column's weight
    scale: the FP8 GEMM's value, before any LoRA term or epilogue reads it."""
    acc = acc * tl.load(in_scale_ptr + rows_M)[:, None]
    if not W_PACKED_T:
        acc = acc * tl.load(ws_ptr + e64 * s_ws_e + wrow_N * s_ws_o, mask=mask_N, other=0.0)[None, :]
    return acc


@triton.jit
def _columns(pid_n, N, GLU_FWD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Weight rows of this column block and their validity (loads mask, stores drop the rest).

    GLU_FWD interleaves gate row n and up row N + n in adjacent tile columns so one accumulator holds
    both and the SwiGLU pairs them with a reshape + split.
    """
    c_N = tl.arange(0, BLOCK_N)
    if GLU_FWD:
        n_N = pid_n * (BLOCK_N // 2) + c_N // 2
        wrow_N = n_N + (c_N % 2) * N
    else:
        n_N = pid_n * BLOCK_N + c_N
        wrow_N = n_N
    return wrow_N, n_N < N


@triton.jit
def _scaled_lora_b(b_ptrs, s_b_r, mask_N, R, scaling, BLOCK_R: tl.constexpr):
    """scaling * B^T for this tile's columns [BLOCK_R, BLOCK_N], in B's dtype: ia @ it adds straight into
    the fp32 accumulator (no second [BLOCK_M, BLOCK_N] fp32 tile). One rounding of scaling * B, exact
    for the usual power-of-two scalings."""
    r_R = tl.arange(0, BLOCK_R)
    b = tl.load(b_ptrs + r_R[:, None] * s_b_r, mask=(r_R < R)[:, None] & mask_N[None, :], other=0.0)
    return (b.to(tl.float32) * scaling).to(b.dtype)


@triton.jit
def _swiglu_forward_epilogue(acc, p_M, mask_M, slot_M, pid_n, N, gu_ptr, s_gu_m, h_ptr, s_h_m, rw_ptr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores gate_up and hw = w * silu(gate) * up: the routing weight w of each row is applied here, so
    the down projection yields w * z, the combine is a plain sum and dW_down = dy^T hw needs no
    weights (the routing-weight gradient <g, h> recomputes h from gate_up)."""
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    n_N = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask = mask_M[:, None] & (n_N < N)[None, :]
    row_M = p_M.to(tl.int64)[:, None]
    dtype = gu_ptr.dtype.element_ty
    tl.store(gu_ptr + row_M * s_gu_m + n_N[None, :], gate.to(dtype), mask=mask)
    tl.store(gu_ptr + row_M * s_gu_m + N + n_N[None, :], up.to(dtype), mask=mask)
    h = gate * tl.sigmoid(gate) * up * tl.load(rw_ptr + slot_M).to(tl.float32)[:, None]
    tl.store(h_ptr + row_M * s_h_m + n_N[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _k_loop_tma(x_desc, w_desc, row0, e, n0, K, acc, W_T: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += in[row0:row0+BLOCK_M] @ W_e^T[:, n0:n0+BLOCK_N] with both tiles by TMA (out-of-range rows,
    columns and K are zero-filled). W_T: w_desc is over [E, K, N] (a transposed weight view)."""
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([row0, k0])
        if W_T:
            w = w_desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        else:
            w = w_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    return acc


# The variant flags are in the key: variants of equal N, K, R (the split and fused LoRA forward, say)
# must not share a tuned config.
@autotune(configs=ALL_GEMM_CONFIGS, key=["M_BUCKET", "N", "K", "R", "GATHER", "HAS_LORA", "LORA_IN_LOOP",
                                            "GLU_FWD", "TMA", "DOT_PRECISION", "W_FMT", "W_PACKED_T"],
                 prune_configs_by={"early_config_prune": prune_gemm}, do_bench=bench)
@triton.jit
def _grouped_linear_kernel(
        in_ptr, s_in_m, s_in_k, in_scale_ptr, order_ptr, offsets_ptr, TOPK,
        w_ptr, s_w_e, s_w_n, s_w_k, ws_ptr, s_ws_e, s_ws_o, wts_ptr,
        a_ptr, s_a_e, s_a_r, s_a_k, b_ptr, s_b_e, s_b_n, s_b_r,
        ia_ptr, s_ia_m, out_ptr, s_out_m, aux_ptr, s_aux_m, rw_ptr,
        scaling, S, E, N, R, M_BUCKET, K: tl.constexpr,
        GATHER: tl.constexpr, HAS_LORA: tl.constexpr, LORA_IN_LOOP: tl.constexpr, GLU_FWD: tl.constexpr,
        TMA: tl.constexpr, W_T: tl.constexpr, BLOCK_E: tl.constexpr,
        BLOCK_R: tl.constexpr, PERSISTENT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr = "tf32", W_FMT: tl.constexpr = 0, W_BLOCK: tl.constexpr = 1,
        W_PACKED_T: tl.constexpr = False):
    """W_FMT: the weight is dense (0) or packed FP4 (fp4.FMT_CODES: w_ptr the codes [E, O, I/2] with strides
    s_w_e, s_w_n over E and O, ws_ptr the block scales, wts_ptr the NVFP4 tensor scales; W_PACKED_T: the
    logical weight is the stored one transposed), decoded in the K loop (_k_loop_fp4), or FP8 (fp8.FMT_FP8:
    w_ptr the e4m3 codes of the logical weight read through its strides as a dense one, in_ptr e4m3 codes with
    fp32 row scales at in_scale_ptr, ws_ptr the weight's scales [E, O] applied per column unless W_PACKED_T,
    where the caller folded them into the input rows; fp8.fp8_input_rows): the K loop's dot takes both fp8
    operands, and the fp32 accumulator is scaled right after it, before LoRA and the epilogue. Epilogue: GLU_FWD
    (SwiGLU; aux = hw output, rw the routing weights) or a plain store. LoRA: none, in the K loop
    (LORA_IN_LOOP, ia written) or read from ia. TMA: expert-sorted input rows and the weight tiles by tensor
    descriptors (W_T: the weight is a transposed view, its
    descriptor is over the [E, K, N] tensor underneath). PERSISTENT: one program per SM walks the
    tiles (row block major, so the programs running together share input rows and expert weights).
    K is a constexpr (a model has a few reduction sizes) so that the unmasked K loop is chosen at
    compile time, not by a per-launch heuristic. DOT_PRECISION: every tl.dot's input_precision
    (precision.dot_precision: IEEE for fp32 unless torch allows TF32)."""
    if GLU_FWD:
        num_n = tl.cdiv(N, BLOCK_N // 2)
    else:
        num_n = tl.cdiv(N, BLOCK_N)
    if TMA:
        x_desc = tl.make_tensor_descriptor(in_ptr, [S, K], [s_in_m, 1], [BLOCK_M, BLOCK_K])
        if W_T:
            w_desc = tl.make_tensor_descriptor(w_ptr, [E, K, N], [s_w_e, s_w_k, 1], [1, BLOCK_K, BLOCK_N])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, [E, N, K], [s_w_e, s_w_n, 1], [1, BLOCK_N, BLOCK_K])
    # The exact tile count (the grid is sized from an upper bound: surplus programs run no tile), so the
    # loop body needs no validity branch and a persistent program's loop over its tiles can be flattened
    # into one pipeline: the next tile's first loads are issued under this tile's epilogue (faster down
    # and dx GEMMs, docs/benchmarks.md#expert-layer).
    # Not with a split LoRA: Triton 3.6 miscompiles its rank tiles (loaded before the K loop) in the
    # flattened loop (the Qwen3.5-35B-A3B LoRA down gave 27% error; tests/gpu/test_grouped_gemm_paths_gpu.py).
    tiles = _num_row_blocks(offsets_ptr, E, BLOCK_M, BLOCK_E) * num_n
    if PERSISTENT:
        step = tl.num_programs(0)
    else:
        tiles = tl.minimum(tiles, tl.program_id(0) + 1)
        step = 1
    for tile in tl.range(tl.program_id(0), tiles, step, flatten=PERSISTENT and not HAS_LORA):
        pid_m = tile // num_n
        pid_n = tile % num_n
        e, row0, p_M, mask_M = _block_rows(offsets_ptr, pid_m, E, BLOCK_M, BLOCK_E)
        e64 = e.to(tl.int64)
        slot_M = tl.load(order_ptr + p_M)
        if GATHER:
            rows_M = (slot_M // TOPK).to(tl.int64)
        else:
            rows_M = p_M.to(tl.int64)
        wrow_N, mask_N = _columns(pid_n, N, GLU_FWD, BLOCK_N)
        k_K = tl.arange(0, BLOCK_K)
        in_ptrs = in_ptr + rows_M[:, None] * s_in_m + k_K[None, :] * s_in_k
        w_ptrs = w_ptr + e64 * s_w_e + wrow_N[None, :] * s_w_n + k_K[:, None] * s_w_k  # dense weights
        r_R = tl.arange(0, BLOCK_R)
        mask_R = r_R < R
        if LORA_IN_LOOP:
            a_ptrs = a_ptr + e64 * s_a_e + r_R[None, :] * s_a_r + k_K[:, None] * s_a_k
        else:
            a_ptrs = in_ptrs
        if HAS_LORA:
            ia_ptrs = ia_ptr + p_M.to(tl.int64)[:, None] * s_ia_m + r_R[None, :]
            b_ptrs = b_ptr + e64 * s_b_e + wrow_N[None, :] * s_b_n
        if HAS_LORA and not LORA_IN_LOOP:
            # Split LoRA: the rank-sized ia is already in memory. Its tile and B's are loaded before
            # the K loop, whose latency hides theirs; their product joins the accumulator after it
            # (as a seed before it, the loads stalled every tile).
            ia = tl.load(ia_ptrs, mask=mask_R[None, :], other=0.0)
            b = _scaled_lora_b(b_ptrs, s_b_r, mask_N, R, scaling, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_r = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        if W_FMT != 0 and W_FMT != _W_FP8:  # FP4 (fp4.FMT_CODES)
            q_ptrs, s_ptrs, mask_W = fp4_weight_ptrs(w_ptr, ws_ptr, e64, wrow_N, mask_N, pid_n * BLOCK_N, N, s_w_e,
                                                     s_w_n, s_ws_e, s_ws_o, W_BLOCK, W_PACKED_T, BLOCK_N, BLOCK_K)
            acc, acc_r = _k_loop_fp4(in_ptrs, BLOCK_K * s_in_k, q_ptrs, s_ptrs, fp4_tensor_scale(wts_ptr, e64, W_FMT),
                                     mask_W, s_w_n, s_ws_o, a_ptrs, BLOCK_K * s_a_k, mask_R, K, acc, acc_r,
                                     LORA_IN_LOOP, K % BLOCK_K == 0, BLOCK_N, BLOCK_K, DOT_PRECISION, W_FMT, W_BLOCK,
                                     W_PACKED_T)
        elif TMA:
            acc = _k_loop_tma(x_desc, w_desc, row0, e, pid_n * BLOCK_N, K, acc, W_T, BLOCK_N, BLOCK_K,
                              DOT_PRECISION)
        else:
            acc, acc_r = _k_loop(in_ptrs, BLOCK_K * s_in_k, w_ptrs, BLOCK_K * s_w_k, mask_N, a_ptrs,
                                 BLOCK_K * s_a_k, mask_R, K, acc, acc_r, LORA_IN_LOOP, K % BLOCK_K == 0,
                                 BLOCK_K, DOT_PRECISION)
        if W_FMT == _W_FP8:
            acc = _fp8_scale(acc, in_scale_ptr, rows_M, ws_ptr, e64, s_ws_e, s_ws_o, wrow_N, mask_N, W_PACKED_T)
        if LORA_IN_LOOP:
            ia = acc_r.to(ia_ptr.dtype.element_ty)
            if pid_n == 0:  # every column block computed the same ia: one writes it
                tl.store(ia_ptrs, ia, mask=mask_M[:, None] & mask_R[None, :])
            b = _scaled_lora_b(b_ptrs, s_b_r, mask_N, R, scaling, BLOCK_R)
        if HAS_LORA:
            acc = tl.dot(ia, b, acc, input_precision=DOT_PRECISION)
        if GLU_FWD:
            _swiglu_forward_epilogue(acc, p_M, mask_M, slot_M, pid_n, N, out_ptr, s_out_m, aux_ptr, s_aux_m,
                                     rw_ptr, BLOCK_M, BLOCK_N)
        else:
            n_N = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            out_ptrs = out_ptr + p_M.to(tl.int64)[:, None] * s_out_m + n_N[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_M[:, None] & mask_N[None, :])


# A dense weight's constexprs: the kernel's defaults, passed anyway: W_FMT and W_PACKED_T are autotune keys,
# and gpu.launch's direct launcher reads every key from the launch's arguments (a missing one: KeyError).
_DENSE_WEIGHT = {"W_FMT": FMT_CODES["dense"], "W_BLOCK": 1, "W_PACKED_T": False}


def _weight_args(w_ENK: Weight) -> tuple[tuple, dict]:
    """The kernel's weight arguments (pointer and strides, FP4 / FP8 scales) and constexprs."""
    if isinstance(w_ENK, FP8View):
        codes, sc = w_ENK.logical, w_ENK.scales
        return ((codes, *codes.stride(), sc, sc.stride(0), sc.stride(1), None),
                {"W_FMT": FMT_FP8, "W_BLOCK": 1, "W_PACKED_T": w_ENK.transposed})
    if isinstance(w_ENK, PackedWeight):
        q, sc = w_ENK.qdata, w_ENK.scale
        return ((q, q.stride(0), q.stride(1), 0, sc, sc.stride(0), sc.stride(1), w_ENK.tensor_scale),
                {"W_FMT": FMT_CODES[w_ENK.fmt], "W_BLOCK": w_ENK.block_size, "W_PACKED_T": w_ENK.transposed})
    return (w_ENK, *w_ENK.stride(), None, 0, 0, None), _DENSE_WEIGHT


def _launch(in_: torch.Tensor, slots: SlotOrder, w_ENK: Weight, N: int,
            lora: LoraView | None, ia_Sr: torch.Tensor | None, out: torch.Tensor, *, gather: bool,
            glu_fwd: bool = False, aux: torch.Tensor | None = None, rw_S: torch.Tensor | None = None) -> None:
    """glu_fwd: the SwiGLU epilogue (aux = hw output, rw_S the routing weights), else a plain store. A packed
    FP4 weight (fp4.PackedWeight) is decoded in the pointer K loop (no TMA). An FP8 weight (fp8.FP8View) takes
    `in_` quantized here (fp8.fp8_input_rows) and a split LoRA only (_fp8_lora)."""
    E, K = w_ENK.shape[0], w_ENK.shape[2]
    A, B = (lora.A_ErK, lora.B_ENr) if lora is not None else (None, None)
    R = lora.rank if lora is not None else 0
    S = slots.capacity
    lora_in_loop = lora is not None and not lora.split
    # TMA: expert-sorted rows only (sm90 TMA cannot gather); the fused LoRA's K loop stays on pointers.
    weight_args, weight_constexprs = _weight_args(w_ENK)
    packed = isinstance(w_ENK, (PackedWeight, FP8View))
    # The forward SwiGLU's interleaved columns are weight rows: never of a transposed packed view.
    assert not (packed and glu_fwd and w_ENK.transposed), "GLU_FWD over a transposed packed weight"
    dot_dtype, x_, x_scale = in_.dtype, in_, None
    if isinstance(w_ENK, FP8View):
        assert not lora_in_loop, "an FP8 weight takes the split LoRA (_fp8_lora)"
        x_, x_scale, gather = fp8_input_rows(in_, slots, w_ENK, gather)
    # An FP8 weight's codes take TMA like a dense weight's, but not transposed (pointer loads of that tile: the
    # conservative road for the GPU run to measure first).
    tma_fp8 = isinstance(w_ENK, FP8View) and not w_ENK.transposed
    tma = (not gather and not glu_fwd and not lora_in_loop and (tma_fp8 or not packed)
           and _tma_ok(x_, w_ENK.logical if tma_fp8 else w_ENK))
    if tma:
        ensure_scratch_allocator()

    def grid(meta):
        cols_per_block = meta["BLOCK_N"] // 2 if glu_fwd else meta["BLOCK_N"]
        # Upper bound on the row blocks: sum_e ceil(count_e / BM) <= S / BM + E; surplus programs exit.
        tiles = (cdiv(S, meta["BLOCK_M"]) + E) * cdiv(N, cols_per_block)
        return (min(tiles, _num_sms(in_.device.index)) if meta["PERSISTENT"] else tiles,)

    launch(_grouped_linear_kernel, grid, (
        x_, x_.stride(0), x_.stride(1), x_scale, slots.order_S, slots.offsets_E1, slots.topk,
        *weight_args, A, *_strides(A, 3), B, *_strides(B, 3),
        ia_Sr, _strides(ia_Sr, 2)[0], out, out.stride(0), aux, _strides(aux, 2)[0], rw_S,
        lora.scaling if lora is not None else 0.0, S, E, N, R, m_bucket(S)), {
        "K": K, "GATHER": gather, "HAS_LORA": lora is not None, "LORA_IN_LOOP": lora_in_loop,
        "GLU_FWD": glu_fwd, "TMA": tma, "W_T": tma and not tma_fp8 and w_ENK.stride(2) != 1,
        "BLOCK_E": _block_e(E), "BLOCK_R": _block_r(R), "DOT_PRECISION": dot_precision(dot_dtype),
        **weight_constexprs})


def _tma_ok(in_SK: torch.Tensor, w_ENK: torch.Tensor) -> bool:
    """Both operands can be read by tensor descriptors: 16-byte aligned bases and strides, one unit stride
    (rows of the input; K or N of the weight)."""
    size = in_SK.element_size()
    w_inner = 2 if w_ENK.stride(2) == 1 else 1 if w_ENK.stride(1) == 1 else None
    if in_SK.stride(1) != 1 or w_inner is None:
        return False
    strides = (in_SK.stride(0), *(st for i, st in enumerate(w_ENK.stride()) if i != w_inner))
    return in_SK.data_ptr() % 16 == 0 and w_ENK.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in strides)


@functools.cache
def _num_sms(device: int | None) -> int:
    if device is None:  # CPU tensors (the interpreter): a few programs, so the loop over tiles is exercised
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _strides(t: torch.Tensor | None, n: int) -> tuple:
    return t.stride() if t is not None else (0,) * n


def _block_e(E: int) -> int:
    return max(_MIN_BLOCK_E, next_power_of_2(E))


def _block_r(R: int) -> int:
    return max(16, next_power_of_2(R))


def _fp8_lora(lora: LoraView | None, w_ENK: Weight) -> LoraView | None:
    """The LoRA view a launch over w_ENK takes: split on an FP8 weight (the fused rank product would need the
    unquantized input beside the codes in the K loop), as given otherwise."""
    if lora is None or lora.split or not isinstance(w_ENK, FP8View):
        return lora
    return dataclasses.replace(lora, split=True)


def _rank_buffer(in_: torch.Tensor, slots: SlotOrder, lora: LoraView | None, gather: bool):
    """The [S, r] intermediate in @ A^T: computed now by a rank-sized grouped product when split,
    else allocated for the fused kernel to fill."""
    if lora is None:
        return None
    ia_Sr = slots.new_rows(in_, lora.rank)
    if lora.split:
        _launch(in_, slots, lora.A_ErK, lora.rank, None, None, ia_Sr, gather=gather)
    return ia_Sr


def gate_up_swiglu(x_MH: torch.Tensor, slots: SlotOrder, w_E2IH: Weight, lora: LoraView | None,
                   weights_Mk: torch.Tensor):
    """gate_up[p] = x[token(p)] @ W_e^T (+LoRA) and hw[p] = w[slot(p)] * silu(gate) * up, for valid
    positions p (w the routing weight of the slot)."""
    I2 = w_E2IH.shape[1]
    lora = _fp8_lora(lora, w_E2IH)
    gu_S2I = slots.new_rows(x_MH, I2)
    h_SI = slots.new_rows(x_MH, I2 // 2)
    xa_Sr = _rank_buffer(x_MH, slots, lora, gather=True)
    _launch(x_MH, slots, w_E2IH, I2 // 2, lora, xa_Sr, gu_S2I, gather=True, glu_fwd=True, aux=h_SI,
            rw_S=weights_Mk.reshape(-1))
    return gu_S2I, h_SI, xa_Sr


def expert_linear(in_: torch.Tensor, slots: SlotOrder, w_ENK: Weight, lora: LoraView | None,
                  gather: bool, ia_Sr: torch.Tensor | None = None):
    """out[p] = in[row(p)] @ W_e^T (+LoRA): [S, N], and the LoRA intermediate in @ A^T [S, r] (or None).
    A split LoRA's intermediate may be passed in (ia_Sr) when the caller already has it."""
    if lora is None and not gather:
        return expert_gemm(in_, slots, w_ENK), None
    lora = _fp8_lora(lora, w_ENK)
    out_SN = slots.new_rows(in_, w_ENK.shape[1])
    if ia_Sr is None or not lora.split:
        ia_Sr = _rank_buffer(in_, slots, lora, gather)
    _launch(in_, slots, w_ENK, w_ENK.shape[1], lora, ia_Sr, out_SN, gather=gather)
    return out_SN, ia_Sr


def cutlass_ok(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm (CUTLASS, sm90+) can take these bf16 operands (16-byte aligned rows)."""
    t = tensors[0]
    if not (hasattr(torch, "_grouped_mm") and t.is_cuda and t.numel() > 0):
        return False
    if _capability(t.device.index) < (9, 0):
        return False
    return all(u.dtype == torch.bfloat16 and u.shape[-1] % 8 == 0 and u.shape[-2] % 8 == 0 for u in tensors)


@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def expert_gemm(in_SK: torch.Tensor, slots: SlotOrder, w_ENK: Weight) -> torch.Tensor:
    """out[p] = in[p] @ W_e^T over expert-sorted rows, no LoRA, no epilogue: [S, N].

    The bare grouped GEMM: torch._grouped_mm (CUTLASS) or our kernel (TMA operands, persistent), the
    one measured faster for this weight on this device (tuning.faster: once per run, the same on every
    rank); ours where CUTLASS does not apply, and for a packed weight (decoded in our K loop). Rows at -1
    positions are left unspecified, as everywhere."""
    if isinstance(w_ENK, (PackedWeight, FP8View)):  # CUTLASS would need a dense copy of every expert
        return _triton_gemm(in_SK, slots, w_ENK)
    rows_ok = cutlass_ok(in_SK, w_ENK)

    def candidates():  # this call's rows may not suit CUTLASS: then nothing is timed yet
        return {"cutlass": lambda: _cutlass_gemm(in_SK, slots, w_ENK),
                "triton": lambda: _triton_gemm(in_SK, slots, w_ENK)} if rows_ok else {}
    # Whether to ask, and the key, depend on the weight only: ranks differ in their row counts, and
    # every rank must ask for the same keys in the same order (rank 0 decides for all).
    if not (cutlass_ok(w_ENK) and in_SK.dtype == torch.bfloat16):
        return _triton_gemm(in_SK, slots, w_ENK)
    key = ("expert_gemm", in_SK.device.index, in_SK.dtype, w_ENK.shape, w_ENK.stride(2) == 1)
    use_cutlass = faster(key, candidates) == "cutlass" and rows_ok
    return (_cutlass_gemm if use_cutlass else _triton_gemm)(in_SK, slots, w_ENK)


def _cutlass_gemm(in_SK: torch.Tensor, slots: SlotOrder, w_ENK: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(in_SK, w_ENK.transpose(1, 2), offs=slots.offsets_E1[1:])


def _triton_gemm(in_SK: torch.Tensor, slots: SlotOrder, w_ENK: Weight) -> torch.Tensor:
    out_SN = slots.new_rows(in_SK, w_ENK.shape[1])
    _launch(in_SK, slots, w_ENK, w_ENK.shape[1], None, None, out_SN, gather=False)
    return out_SN


@triton.jit
def _swiglu_backward_kernel(g_ptr, s_g_m, gu_ptr, s_gu_m, dgu_ptr, s_dgu_m, gub_ptr, s_gub_e, s_gub_n, s_gub_r,
                            dgub_ptr, s_dgub_m, order_ptr, offsets_ptr, rw_ptr, dw_ptr, S, E, N, R,
                            HAS_GU_B: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            DOT_PRECISION: tl.constexpr = "tf32"):
    """One expert-sorted row block, all N columns: g -> d(gate, up), the routing weight gradient <g, h>
    of each row (whole, so it is stored straight to its slot) and, for the gate_up LoRA,
    d gate_up @ B_gu_e [BLOCK_M, r]. Programs without an expert zero the -1 slots' dw."""
    pid_m = tl.program_id(0)
    e, _, p_M, mask_M = _block_rows(offsets_ptr, pid_m, E, BLOCK_M, BLOCK_E)
    if e >= E:
        first = tl.load(offsets_ptr + E) + (pid_m - _num_row_blocks(offsets_ptr, E, BLOCK_M, BLOCK_E)) * BLOCK_M
        q_M = first + tl.arange(0, BLOCK_M)
        slot_M = tl.load(order_ptr + q_M, mask=q_M < S, other=0)
        tl.store(dw_ptr + slot_M, tl.zeros((BLOCK_M,), tl.float32), mask=q_M < S)
        return
    e64 = e.to(tl.int64)
    slot_M = tl.load(order_ptr + p_M)
    w_M = tl.load(rw_ptr + slot_M).to(tl.float32)
    row_M = p_M.to(tl.int64)[:, None]
    r_R = tl.arange(0, BLOCK_R)
    mask_R = r_R < R
    dtype = dgu_ptr.dtype.element_ty
    dw_M = tl.zeros((BLOCK_M,), dtype=tl.float32)
    dgub = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n_N = n0 + tl.arange(0, BLOCK_N)
        mask_N = n_N < N
        g = tl.load(g_ptr + row_M * s_g_m + n_N[None, :], mask=mask_N[None, :], other=0.0).to(tl.float32)
        gate = tl.load(gu_ptr + row_M * s_gu_m + n_N[None, :], mask=mask_N[None, :], other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row_M * s_gu_m + N + n_N[None, :], mask=mask_N[None, :], other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dh = g * w_M[:, None]
        d_up = (dh * silu).to(dtype)
        d_gate = (dh * up * (sig + silu * (1.0 - sig))).to(dtype)  # d silu(g)/dg = sig + silu (1 - sig)
        mask = mask_M[:, None] & mask_N[None, :]
        tl.store(dgu_ptr + row_M * s_dgu_m + n_N[None, :], d_gate, mask=mask)
        tl.store(dgu_ptr + row_M * s_dgu_m + N + n_N[None, :], d_up, mask=mask)
        # Masked columns have gate = up = 0, hence h = 0 and d(gate, up) = 0: they add nothing.
        dw_M += tl.sum(g * silu * up, 1)
        if HAS_GU_B:
            b_NR = gub_ptr + e64 * s_gub_e + n_N[:, None] * s_gub_n + r_R[None, :] * s_gub_r
            mask_NR = mask_N[:, None] & mask_R[None, :]
            dgub = tl.dot(d_gate, tl.load(b_NR, mask=mask_NR, other=0.0), dgub, input_precision=DOT_PRECISION)
            dgub = tl.dot(d_up, tl.load(b_NR + N * s_gub_n, mask=mask_NR, other=0.0), dgub,
                          input_precision=DOT_PRECISION)
    tl.store(dw_ptr + slot_M, dw_M, mask=mask_M)
    if HAS_GU_B:
        tl.store(dgub_ptr + row_M * s_dgub_m + r_R[None, :], dgub.to(dtype), mask=mask_M[:, None] & mask_R[None, :])


def swiglu_backward(g_SI: torch.Tensor, slots: SlotOrder, gu_S2I: torch.Tensor, weights_Mk: torch.Tensor,
                    gu_B_E2Ir: torch.Tensor | None = None):
    """Backward through the routing weight and the SwiGLU, after the down projection's GEMM.

    g_SI = dy[token] @ W_down_e (with the down LoRA's part) in expert-sorted order. One pass over each
    row block (a SwiGLU-backward epilogue inside the GEMM measured slower than CUTLASS plus this pass): d gate_up = SwiGLU'(w g), d w = <g, h>, and with gu_B_E2Ir (the gate_up LoRA B
    [E, 2I, r]) also d gate_up @ B_gu. Returns d gate_up [S, 2I], d gate_up @ B_gu [S, r] (None without
    gu_B_E2Ir) and d weights [M, k] (fp32, zero at -1 slots: per slot, all M*k of them).
    """
    S, I, E = slots.num_slots, g_SI.shape[1], slots.num_experts
    dgu_S2I = slots.new_rows(g_SI, 2 * I)
    dw_S = torch.empty(S, device=g_SI.device, dtype=torch.float32)
    R = gu_B_E2Ir.shape[2] if gu_B_E2Ir is not None else 0
    dgub_Sr = slots.new_rows(g_SI, R) if gu_B_E2Ir is not None else None
    block_m, block_n, warps = _SWIGLU_BWD_TILE_LORA if gu_B_E2Ir is not None else _SWIGLU_BWD_TILE
    launch(_swiglu_backward_kernel, (cdiv(S, block_m) + E,), (
        g_SI, g_SI.stride(0), gu_S2I, gu_S2I.stride(0), dgu_S2I, dgu_S2I.stride(0), gu_B_E2Ir,
        *_strides(gu_B_E2Ir, 3), dgub_Sr, _strides(dgub_Sr, 2)[0], slots.order_S, slots.offsets_E1,
        weights_Mk.reshape(-1), dw_S, S, E, I, R), {
        "HAS_GU_B": gu_B_E2Ir is not None, "BLOCK_E": _block_e(E), "BLOCK_R": _block_r(R),
        "DOT_PRECISION": dot_precision(g_SI.dtype), "BLOCK_M": block_m, "BLOCK_N": block_n,
        "num_warps": warps})
    return dgu_S2I, dgub_Sr, dw_S.view(weights_Mk.shape)

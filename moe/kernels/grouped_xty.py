"""Per-expert reductions over expert-sorted rows: the weight and LoRA-factor gradients, without atomics.

Shapes: S the rows of expert-sorted operands (slots.capacity), E experts, P and Q the two output dimensions.

    out[e] = scaling * sum_{p in segment e} (w[p] *) L[row_L(p)]^T R[row_R(p)]       -> [E, P, Q]

row_X(p) is `order[p] // k` for a token-layout operand (gather) or p for an expert-sorted one; the
optional w[p] is the routing weight of the slot at p (dZ = w * dY is never materialized). One program
owns one [BLOCK_P, BLOCK_Q] tile of one expert and loops over that expert's rows, so each output
element is written exactly once; experts that received no rows get zeros. The output tensor's strides
are honored, so gradients land directly in the parameters' [E, out, in] layout.

    grouped_xty(L, R, slots, gather_l=, gather_r=, weights_Mk=None, scaling=1.0) -> [E, P, Q]
    grouped_xty_fp8(L_SP, R_SQ, slots, out_dtype) -> [E, P, Q]   both operands expert-sorted, in FP8
    lora_factor_grads([FactorGrad(L_Sr, R, gather_r, transposed) | None, ...], slots, scaling)
        -> [E, r, Q], or [E, Q, r] (contiguous) where transposed, per problem; None where None

lora_factor_grads computes up to four LoRA-factor gradients in ONE launch (the layer is host-bound at
small token counts). Each problem is the form above with L_Sr rank-sized and expert-sorted and no
routing weight; every program owns one [BLOCK_P >= r, BLOCK_Q] tile of one problem and one expert (the
grid's first axis runs over the problems' column tiles back to back). A transposed problem writes
through swapped strides into a contiguous [E, Q, r] tensor, a LoRA B's [out, r] layout, without a copy.
All operands share one dtype; outputs take it, accumulation is fp32; the dots' input precision is
precision.dot_precision's (fp32: IEEE unless torch allows TF32).

grouped_xty_fp8 (FP8 training's dW, quant.fp8_training's rule): L and R quantized to e4m3 per (expert, column)
along the expert's rows (scales [E, P], [E, Q]), their codes stored tokens-innermost (K-major for both sides
of the dot); the kernel accumulates tl.dot(codes, codes) in fp32 and scales the tile by the two column
scales after the row loop:  out[e, p, q] = sum_rows lq[row, p] rq[row, q] * ls[e, p] * rs[e, q].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu.launch import cdiv, launch, next_power_of_2
from moe.kernels.precision import dot_precision
from moe.kernels.routing import SlotOrder
from moe.kernels.tuning import (
    FACTOR_GRAD_CONFIGS,
    XTY_CONFIGS,
    autotune,
    bench,
    m_bucket,
    prune_factor_grads,
    prune_xty,
)
from quant.fp8 import group_of_rows
from quant.fp8_training import quantize_along_groups


@autotune(configs=XTY_CONFIGS, key=["M_BUCKET", "P", "Q", "GATHER_L", "GATHER_R", "SCALE_L",
                                          "DOT_PRECISION", "FP8"],
                 prune_configs_by={"early_config_prune": prune_xty}, do_bench=bench)
@triton.jit
def _grouped_xty_kernel(l_ptr, s_l_m, s_l_c, r_ptr, s_r_m, s_r_c, order_ptr, offsets_ptr, rw_ptr, TOPK,
                        out_ptr, s_o_e, s_o_p, s_o_q, scaling, P, Q, M_BUCKET, ls_ptr, rs_ptr,
                        GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, SCALE_L: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr = "tf32", FP8: tl.constexpr = False):
    """FP8: L and R are e4m3 codes, ls [E, P] and rs [E, Q] (contiguous) their per-expert column scales."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_q = tl.cdiv(Q, BLOCK_Q)
    i_P = (pid // num_q) * BLOCK_P + tl.arange(0, BLOCK_P)
    j_Q = (pid % num_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    # Column masks, not clamped indices: clamping hides the contiguity that vectorized async copies need.
    mask_P = i_P < P
    mask_Q = j_Q < Q
    row0 = tl.load(offsets_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for i in range(tl.cdiv(row_end - row0, BLOCK_K)):
        p_K = row0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_K = p_K < row_end
        p_K = tl.where(mask_K, p_K, row0)
        slot_K = tl.load(order_ptr + p_K)
        if GATHER_L:
            rows_l = (slot_K // TOPK).to(tl.int64)
        else:
            rows_l = p_K.to(tl.int64)
        if GATHER_R:
            rows_r = (slot_K // TOPK).to(tl.int64)
        else:
            rows_r = p_K.to(tl.int64)
        # Rows past the segment must load zeros: they are inside the reduction.
        lt = tl.load(l_ptr + rows_l[:, None] * s_l_m + i_P[None, :] * s_l_c,
                     mask=mask_K[:, None] & mask_P[None, :], other=0.0)
        if SCALE_L:
            lt = (lt * tl.load(rw_ptr + slot_K).to(tl.float32)[:, None]).to(l_ptr.dtype.element_ty)
        rt = tl.load(r_ptr + rows_r[:, None] * s_r_m + j_Q[None, :] * s_r_c,
                     mask=mask_K[:, None] & mask_Q[None, :], other=0.0)
        acc = tl.dot(tl.trans(lt), rt, acc, input_precision=DOT_PRECISION)
    if FP8:  # the scales are constant along the rows: applied once, after the loop
        acc *= tl.load(ls_ptr + e.to(tl.int64) * P + i_P, mask=mask_P, other=0.0)[:, None]
        acc *= tl.load(rs_ptr + e.to(tl.int64) * Q + j_Q, mask=mask_Q, other=0.0)[None, :]
    out_ptrs = out_ptr + e.to(tl.int64) * s_o_e + i_P[:, None] * s_o_p + j_Q[None, :] * s_o_q
    tl.store(out_ptrs, (acc * scaling).to(out_ptr.dtype.element_ty), mask=mask_P[:, None] & mask_Q[None, :])


def grouped_xty(L: torch.Tensor, R: torch.Tensor, slots: SlotOrder, *, gather_l: bool, gather_r: bool,
                weights_Mk: torch.Tensor | None = None, scaling: float = 1.0) -> torch.Tensor:
    """[E, P, Q] with out[e] = scaling * sum over expert e's positions of (w *) L[row]^T R[row]."""
    E, P, Q = slots.num_experts, L.shape[1], R.shape[1]
    out_EPQ = torch.empty(E, P, Q, device=L.device, dtype=L.dtype)
    rw_S = weights_Mk.reshape(-1) if weights_Mk is not None else None

    def grid(meta):
        return (cdiv(P, meta["BLOCK_P"]) * cdiv(Q, meta["BLOCK_Q"]), E)

    launch(_grouped_xty_kernel, grid, (
        L, L.stride(0), L.stride(1), R, R.stride(0), R.stride(1), slots.order_S, slots.offsets_E1, rw_S,
        slots.topk, out_EPQ, *out_EPQ.stride(), scaling, P, Q, m_bucket(slots.capacity), None, None),
        {"GATHER_L": gather_l, "GATHER_R": gather_r, "SCALE_L": rw_S is not None,
         "DOT_PRECISION": dot_precision(L.dtype), "FP8": False})
    return out_EPQ


def grouped_xty_fp8(L_SP: torch.Tensor, R_SQ: torch.Tensor, slots: SlotOrder, out_dtype: torch.dtype) -> torch.Tensor:
    """[E, P, Q] with out[e] = sum over expert e's rows of L[p]^T R[p] on e4m3 operands, both expert-sorted and
    quantized here per (expert, column) along the expert's rows (quant.fp8_training.quantize_along_groups's
    rule); rows past the last expert are never read, experts without rows get zeros."""
    E, S, P, Q = slots.num_experts, L_SP.shape[0], L_SP.shape[1], R_SQ.shape[1]
    gid_S = group_of_rows(slots.offsets_E1[1:], S)  # E past the last expert: outside every group's scale
    # [P, S] / [Q, S] codes, the rows innermost: the reduction dim contiguous in both dot operands
    lq_PS, ls_EP = quantize_along_groups(L_SP, gid_S, E)
    rq_QS, rs_EQ = quantize_along_groups(R_SQ, gid_S, E)
    lq_SP, rq_SQ = lq_PS.t(), rq_QS.t()
    out_EPQ = torch.empty(E, P, Q, device=L_SP.device, dtype=out_dtype)

    def grid(meta):
        return (cdiv(P, meta["BLOCK_P"]) * cdiv(Q, meta["BLOCK_Q"]), E)

    launch(_grouped_xty_kernel, grid, (
        lq_SP, *lq_SP.stride(), rq_SQ, *rq_SQ.stride(), slots.order_S, slots.offsets_E1, None,
        slots.topk, out_EPQ, *out_EPQ.stride(), 1.0, P, Q, m_bucket(slots.capacity), ls_EP.contiguous(),
        rs_EQ.contiguous()),
        {"GATHER_L": False, "GATHER_R": False, "SCALE_L": False, "DOT_PRECISION": "tf32", "FP8": True})
    return out_EPQ


# ----------------------------------------------------------------------------- LoRA-factor gradients


class FactorGrad(NamedTuple):
    """One LoRA-factor gradient: out[e] = scaling * sum over expert e's positions p of L_Sr[p]^T R[row(p)].

    L_Sr: [S, r] expert-sorted. R: [S, Q] expert-sorted, or [M, Q] token layout when gather_r (its row
    is slots.rows_S[p]). transposed: the result is a contiguous [E, Q, r] (a LoRA B's layout), else
    [E, r, Q] (a LoRA A's layout).
    """
    L_Sr: torch.Tensor
    R: torch.Tensor
    gather_r: bool = False
    transposed: bool = False


_MAX_PROBLEMS = 4
_FACTOR_KEY = ["M_BUCKET", "Q0", "Q1", "Q2", "Q3", "NUM", "GATHER_0", "GATHER_1", "GATHER_2", "GATHER_3",
               "BLOCK_P", "DOT_PRECISION"]


@triton.jit
def _factor_tile(l_ptr, s_l_m, s_l_c, r_ptr, s_r_m, s_r_c, out_ptr, s_o_e, s_o_p, s_o_q, P, Q, tile, e,
                 rows_ptr, row0, row_end, scaling, GATHER_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e, :, tile's columns] = scaling * sum over the positions [row0, row_end) of L[p]^T R[row(p)];
    nothing unless 0 <= tile < cdiv(Q, BLOCK_Q) (else the program's tile belongs to another problem)."""
    if (tile >= 0) & (tile < tl.cdiv(Q, BLOCK_Q)):
        i_P = tl.arange(0, BLOCK_P)
        j_Q = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
        mask_P = i_P < P
        mask_Q = j_Q < Q
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        for k0 in range(row0, row_end, BLOCK_K):
            p_K = k0 + tl.arange(0, BLOCK_K)
            # Positions past the segment load zeros on both sides: they are inside the reduction, and
            # the rows of the -1 slots behind the last segment hold anything (NaN * 0 is NaN).
            mask_K = p_K < row_end
            if GATHER_R:
                rows_K = tl.load(rows_ptr + p_K, mask=mask_K, other=0).to(tl.int64)
            else:
                rows_K = p_K.to(tl.int64)
            lt = tl.load(l_ptr + p_K.to(tl.int64)[:, None] * s_l_m + i_P[None, :] * s_l_c,
                         mask=mask_K[:, None] & mask_P[None, :], other=0.0)
            rt = tl.load(r_ptr + rows_K[:, None] * s_r_m + j_Q[None, :] * s_r_c,
                         mask=mask_K[:, None] & mask_Q[None, :], other=0.0)
            acc = tl.dot(tl.trans(lt), rt, acc, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + e.to(tl.int64) * s_o_e + i_P[:, None] * s_o_p + j_Q[None, :] * s_o_q
        tl.store(out_ptrs, (acc * scaling).to(out_ptr.dtype.element_ty),
                 mask=mask_P[:, None] & mask_Q[None, :])


@autotune(configs=FACTOR_GRAD_CONFIGS, key=_FACTOR_KEY,
                 prune_configs_by={"early_config_prune": prune_factor_grads}, do_bench=bench)
@triton.jit
def _factor_grads_kernel(l0_ptr, s_l0_m, s_l0_c, r0_ptr, s_r0_m, s_r0_c,
                         out0_ptr, s_o0_e, s_o0_p, s_o0_q, P0, Q0,
                         l1_ptr, s_l1_m, s_l1_c, r1_ptr, s_r1_m, s_r1_c,
                         out1_ptr, s_o1_e, s_o1_p, s_o1_q, P1, Q1,
                         l2_ptr, s_l2_m, s_l2_c, r2_ptr, s_r2_m, s_r2_c,
                         out2_ptr, s_o2_e, s_o2_p, s_o2_q, P2, Q2,
                         l3_ptr, s_l3_m, s_l3_c, r3_ptr, s_r3_m, s_r3_c,
                         out3_ptr, s_o3_e, s_o3_p, s_o3_q, P3, Q3,
                         rows_ptr, offsets_ptr, scaling, M_BUCKET, NUM: tl.constexpr,
                         GATHER_0: tl.constexpr, GATHER_1: tl.constexpr, GATHER_2: tl.constexpr,
                         GATHER_3: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr = "tf32"):
    """Problem i (i < NUM) owns the column tiles [start_i, start_i + cdiv(Q_i, BLOCK_Q)) of axis 0."""
    t = tl.program_id(0)
    e = tl.program_id(1)
    row0 = tl.load(offsets_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)
    start1 = tl.cdiv(Q0, BLOCK_Q)
    start2 = start1 + tl.cdiv(Q1, BLOCK_Q)
    start3 = start2 + tl.cdiv(Q2, BLOCK_Q)
    _factor_tile(l0_ptr, s_l0_m, s_l0_c, r0_ptr, s_r0_m, s_r0_c, out0_ptr, s_o0_e, s_o0_p, s_o0_q, P0, Q0,
                 t, e, rows_ptr, row0, row_end, scaling, GATHER_0, DOT_PRECISION, BLOCK_P, BLOCK_Q, BLOCK_K)
    # Absent problems have null pointers: their calls must not be traced at all.
    if NUM > 1:
        _factor_tile(l1_ptr, s_l1_m, s_l1_c, r1_ptr, s_r1_m, s_r1_c, out1_ptr, s_o1_e, s_o1_p, s_o1_q, P1, Q1,
                     t - start1, e, rows_ptr, row0, row_end, scaling, GATHER_1, DOT_PRECISION, BLOCK_P,
                     BLOCK_Q, BLOCK_K)
    if NUM > 2:
        _factor_tile(l2_ptr, s_l2_m, s_l2_c, r2_ptr, s_r2_m, s_r2_c, out2_ptr, s_o2_e, s_o2_p, s_o2_q, P2, Q2,
                     t - start2, e, rows_ptr, row0, row_end, scaling, GATHER_2, DOT_PRECISION, BLOCK_P,
                     BLOCK_Q, BLOCK_K)
    if NUM > 3:
        _factor_tile(l3_ptr, s_l3_m, s_l3_c, r3_ptr, s_r3_m, s_r3_c, out3_ptr, s_o3_e, s_o3_p, s_o3_q, P3, Q3,
                     t - start3, e, rows_ptr, row0, row_end, scaling, GATHER_3, DOT_PRECISION, BLOCK_P,
                     BLOCK_Q, BLOCK_K)


_ABSENT_ARGS = (None, 0, 0, None, 0, 0, None, 0, 0, 0, 0, 0)


def _factor_out(problem: FactorGrad, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The result in its parameter layout, and its [E, r, Q] view that the kernel writes."""
    L_Sr, R = problem.L_Sr, problem.R
    r, Q = L_Sr.shape[1], R.shape[1]
    like = {"device": L_Sr.device, "dtype": L_Sr.dtype}
    if problem.transposed:
        out_EQr = torch.empty(num_experts, Q, r, **like)
        return out_EQr, out_EQr.transpose(1, 2)
    out_ErQ = torch.empty(num_experts, r, Q, **like)
    return out_ErQ, out_ErQ


def _factor_args(problem: FactorGrad, out_ErQ: torch.Tensor) -> tuple:
    L_Sr, R = problem.L_Sr, problem.R
    return (L_Sr, *L_Sr.stride(), R, *R.stride(), out_ErQ, *out_ErQ.stride(), L_Sr.shape[1], R.shape[1])


def lora_factor_grads(problems: Sequence[FactorGrad | None], slots: SlotOrder,
                      scaling: float) -> list[torch.Tensor | None]:
    """The gradient of each FactorGrad (None for None) from one launch; see FactorGrad for layouts."""
    present = [p for p in problems if p is not None]
    if len(present) > _MAX_PROBLEMS:
        raise ValueError(f"at most {_MAX_PROBLEMS} problems per launch, got {len(present)}")
    outs = [_factor_out(p, slots.num_experts) for p in present]
    if present:
        _launch_factor_grads(present, [view for _, view in outs], slots, scaling)
    results = iter(result for result, _ in outs)
    return [None if p is None else next(results) for p in problems]


def _launch_factor_grads(present: list[FactorGrad], outs_ErQ: list[torch.Tensor], slots: SlotOrder,
                         scaling: float) -> None:
    absent = _MAX_PROBLEMS - len(present)
    args = [a for p, out in zip(present, outs_ErQ) for a in _factor_args(p, out)]
    args += _ABSENT_ARGS * absent
    gathers = [p.gather_r for p in present] + [False] * absent
    Qs = [p.R.shape[1] for p in present]
    # tl.dot needs every dimension >= 16; one tile covers the whole rank.
    block_p = max(16, next_power_of_2(max(p.L_Sr.shape[1] for p in present)))

    def grid(meta):
        return (sum(cdiv(Q, meta["BLOCK_Q"]) for Q in Qs), slots.num_experts)

    launch(_factor_grads_kernel, grid, (
        *args, slots.rows_S, slots.offsets_E1, scaling, m_bucket(slots.capacity)),
        {"NUM": len(present), **{f"GATHER_{i}": g for i, g in enumerate(gathers)}, "BLOCK_P": block_p,
         "DOT_PRECISION": dot_precision(present[0].L_Sr.dtype)})

"""Per-expert reductions over expert-sorted rows: the weight and LoRA-factor gradients, without atomics.

Shapes: S = M*k slots, E experts, P and Q the two output dimensions.

    out[e] = scaling * sum_{p in segment e} (w[p] *) L[row_L(p)]^T R[row_R(p)]       -> [E, P, Q]

row_X(p) is `order[p] // k` for a token-layout operand (gather) or p for an expert-sorted one; the
optional w[p] is the routing weight of the slot at p (dZ = w * dY is never materialized). One program
owns one [BLOCK_P, BLOCK_Q] tile of one expert and loops over that expert's rows, so each output
element is written exactly once; experts that received no rows get zeros. The output tensor's strides
are honored, so gradients land directly in the parameters' [E, out, in] layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.kernels.routing import SlotOrder
from moe.kernels.tuning import XTY_CONFIGS, bench, m_bucket, prune_xty
from quant.triton_launch import cdiv, launch


@triton.autotune(configs=XTY_CONFIGS, key=["M_BUCKET", "P", "Q", "GATHER_L", "GATHER_R", "SCALE_L"],
                 prune_configs_by={"early_config_prune": prune_xty}, do_bench=bench)
@triton.jit
def _grouped_xty_kernel(l_ptr, s_l_m, s_l_c, r_ptr, s_r_m, s_r_c, order_ptr, offsets_ptr, rw_ptr, TOPK,
                        out_ptr, s_o_e, s_o_p, s_o_q, scaling, P, Q, M_BUCKET,
                        GATHER_L: tl.constexpr, GATHER_R: tl.constexpr, SCALE_L: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
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
        acc = tl.dot(tl.trans(lt), rt, acc)
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
        slots.topk, out_EPQ, *out_EPQ.stride(), scaling, P, Q, m_bucket(slots.num_slots)),
        {"GATHER_L": gather_l, "GATHER_R": gather_r, "SCALE_L": rw_S is not None})
    return out_EPQ

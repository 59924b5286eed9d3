"""Expert-sorted slot order and the routing-weighted combine (sentinel-skip layout).

Shapes: M routed rows, k slots per row, S = M*k slots (slot s = m*k + j), E local experts, H hidden.

    slots = sort_slots(expert_ids_Mk, E)     # no host sync: every size comes from the shapes
    y_MH = combine(z_SH, slots, weights_Mk)  # y[m] = sum_j w[m,j] * z[pos(m,j)] over slots with id >= 0

Valid slots (id >= 0) are sorted by expert to the front; -1 slots get the sentinel key E, land behind
every expert segment and are never read or computed by any kernel. Rows of the sorted buffers that
belong to -1 slots stay unwritten (torch.empty) and are masked out wherever they could be seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SlotOrder:
    order_S: torch.Tensor      # int32: slot index at each expert-sorted position (valid slots first)
    inv_S: torch.Tensor        # int32: expert-sorted position of each slot
    offsets_E1: torch.Tensor   # int32: start of each expert's segment; offsets[E] = number of valid slots
    ids_S: torch.Tensor        # the flattened expert ids (validity of each slot)
    topk: int
    num_experts: int

    @property
    def num_slots(self) -> int:
        return self.order_S.numel()


def sort_slots(expert_ids_Mk: torch.Tensor, num_experts: int) -> SlotOrder:
    ids_S = expert_ids_Mk.reshape(-1)
    key_S = torch.where(ids_S >= 0, ids_S, num_experts)
    # Stable, so each expert's rows keep token order and the weight-gradient sums are deterministic.
    key_sorted_S, order_S = torch.sort(key_S, stable=True)
    bounds_E1 = torch.arange(num_experts + 1, device=ids_S.device, dtype=key_sorted_S.dtype)
    offsets_E1 = torch.searchsorted(key_sorted_S, bounds_E1).to(torch.int32)
    order_S = order_S.to(torch.int32)
    inv_S = torch.empty_like(order_S)
    inv_S[order_S.long()] = torch.arange(order_S.numel(), device=ids_S.device, dtype=torch.int32)
    return SlotOrder(order_S, inv_S, offsets_E1, ids_S, expert_ids_Mk.shape[1], num_experts)


@triton.jit
def _combine_kernel(z_ptr, s_z_m, inv_ptr, ids_ptr, w_ptr, y_ptr, s_y_m, H,
                    TOPK: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    m = tl.program_id(0)
    h_H = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_H = h_H < H
    acc_H = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        slot = m * TOPK + j
        # -1 slots are skipped entirely: their rows of z were never written.
        if tl.load(ids_ptr + slot) >= 0:
            pos = tl.load(inv_ptr + slot).to(tl.int64)
            z_H = tl.load(z_ptr + pos * s_z_m + h_H, mask=mask_H, other=0.0).to(tl.float32)
            if HAS_W:
                z_H = z_H * tl.load(w_ptr + slot).to(tl.float32)
            acc_H += z_H
    tl.store(y_ptr + m.to(tl.int64) * s_y_m + h_H, acc_H.to(y_ptr.dtype.element_ty), mask=mask_H)


def combine(z_SH: torch.Tensor, slots: SlotOrder, weights_Mk: torch.Tensor | None) -> torch.Tensor:
    """Sum each row's valid slots of the expert-sorted z (weighted by weights_Mk when given)."""
    M, H = slots.num_slots // slots.topk, z_SH.shape[1]
    y_MH = torch.empty(M, H, device=z_SH.device, dtype=z_SH.dtype)
    if M == 0:
        return y_MH
    w_S = weights_Mk.reshape(-1) if weights_Mk is not None else None
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(M, triton.cdiv(H, block_h))](
        z_SH, z_SH.stride(0), slots.inv_S, slots.ids_S, w_S, y_MH, y_MH.stride(0), H,
        TOPK=slots.topk, HAS_W=w_S is not None, BLOCK_H=block_h, num_warps=4)
    return y_MH

"""Expert-sorted slot order, the gather into it and the routing-weighted combine (sentinel-skip layout).

Shapes: M routed rows, k slots per row, S = M*k slots (slot s = m*k + j), E local experts, H hidden,
V valid slots (id >= 0).

    slots = sort_slots(expert_ids_Mk, E, valid_slots=None, bound=None)  # no host sync: every size is given
    y_MH = combine(z_VH, slots, weights_Mk)  # y[m] = sum_j w[m,j] * z[pos(m,j)] over slots with id >= 0
    xg_VH = gather_rows(x_MH, slots)         # xg[p] = x[rows[p]] for the valid positions p < offsets[E]

Valid slots (id >= 0) are sorted by expert to the front; -1 slots get the sentinel key E, land behind
every expert segment and are never read or computed by any kernel. Buffers in expert-sorted order
(slots.new_rows) have `slots.capacity` rows: V (rounded up to 16) when the caller knows it on the host
(under EP the all_to_all dispatcher does, and most slots are -1 there), else a SlotCapacity bound's rows
(the valid slots past it are dropped and counted), else S. Rows past the valid positions stay
unwritten (torch.empty) and are masked out wherever they could be seen; no kernel touches a position
>= offsets[E].

sort_slots is a stable counting sort in three launches (host time, not GPU time, is what the small
torch ops cost here), over blocks of BLOCK_S slots and keys 0..E (E = the -1 slots):
    _histogram_kernel  one program per block: counts[b, key] (tl.histogram)
    _scan_kernel       one program per 8 keys: exclusive scan of counts[:, key] over the blocks, in
                       place, and the key's total; the last program to finish scans the totals into
                       offsets_E1
    _scatter_kernel    one program per block: tl.sort of key*BLOCK_S + lane (stable), rank among equal
                       keys by a scan, position = offsets[key] + counts[b, key] + rank; writes order,
                       rows, inv
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu.launch import cdiv, launch, next_power_of_2
from moe.capacity import SlotCapacity


@dataclass(frozen=True)
class SlotOrder:
    order_S: torch.Tensor      # int32: slot index at each expert-sorted position (valid slots first)
    inv_S: torch.Tensor        # int32: expert-sorted position of each slot
    offsets_E1: torch.Tensor   # int32: start of each expert's segment; offsets[E] = number of valid slots
    ids_S: torch.Tensor        # the flattened expert ids (validity of each slot)
    topk: int
    num_experts: int
    rows_S: torch.Tensor       # int32: token row at each sorted position (order_S // topk)
    capacity: int              # rows of the expert-sorted buffers, >= offsets[E]: slot_capacity(S, V)

    @property
    def num_slots(self) -> int:
        return self.order_S.numel()

    def new_rows(self, like: torch.Tensor, cols: int) -> torch.Tensor:
        """An uninitialized expert-sorted buffer [capacity, cols] of like's dtype and device."""
        return like.new_empty(self.capacity, cols)


# Slots per program of the sort: each block is ranked by one tl.sort, whose cost per slot grows with
# the block (bitonic), while every block adds a fixed histogram cost (E+1 bins) and E+1 counts to
# scan. Between the bounds, aim for about _TARGET_BLOCKS blocks; the bounds are the measured winners
# (docs/benchmarks.md#expert-layer): larger blocks lose on their sort, smaller ones on histograms.
# Tests shrink the bounds to get many blocks at tiny S.
_MIN_BLOCK_S = 256
_MAX_BLOCK_S = 512
_TARGET_BLOCKS = 1024
# The scan program's tile: _SCAN_KEYS keys (one 32-byte sector of a counts row) x _SCAN_BLOCKS blocks.
_SCAN_KEYS = 8
_SCAN_BLOCKS = 512


def _block_s(num_slots: int) -> int:
    return min(_MAX_BLOCK_S, max(_MIN_BLOCK_S, next_power_of_2(cdiv(num_slots, _TARGET_BLOCKS))))


def _histogram_warps(block_s: int, bins: int) -> int:
    # Every warp keeps a whole histogram and merges it through shared-memory atomics, so with many
    # bins few warps win (the atomics contend; docs/benchmarks.md#expert-layer).
    return min(4, max(1, 2 * block_s // bins))


def _scatter_warps(block_s: int) -> int:
    return min(8, max(2, block_s // 64))


@triton.jit
def _slot_keys(ids_ptr, start, S, E, BLOCK_S: tl.constexpr):
    """Sort keys of the slots [start, start + BLOCK_S): the expert id, E for -1 slots, and E + 1 for
    lanes past S (they belong to no key that is counted and sort behind the sentinels)."""
    s_B = start + tl.arange(0, BLOCK_S)
    mask_B = s_B < S
    ids_B = tl.load(ids_ptr + s_B, mask=mask_B, other=-1).to(tl.int32)
    key_B = tl.where(ids_B >= 0, ids_B, E)
    return tl.where(mask_B, key_B, E + 1)


@triton.jit
def _ticket(counts_ptr, num_blocks, E):
    """The scratch buffer: counts [num_blocks, E+1], totals [E+1], then the scan's ticket."""
    return counts_ptr + (num_blocks + 1) * (E + 1)


# S = M*k and the block count follow the routed rows under EP: not specialized on (a recompile per new parity)
@triton.jit(do_not_specialize=["S"])
def _histogram_kernel(ids_ptr, counts_ptr, S, E, BLOCK_S: tl.constexpr, BINS: tl.constexpr):
    """counts[b, key] for key in 0..E: how many slots of block b have that key. Zeroes the scan's
    ticket (this kernel runs before the scan in stream order)."""
    b = tl.program_id(0)
    key_B = _slot_keys(ids_ptr, b * BLOCK_S, S, E, BLOCK_S)
    # Lanes past S land in bin E + 1 (< BINS), which is not stored, so tl.histogram needs no mask
    # (an argument that older Triton releases lack).
    counts_K = tl.histogram(key_B, BINS)
    k_K = tl.arange(0, BINS)
    tl.store(counts_ptr + b * (E + 1) + k_K, counts_K, mask=k_K <= E)
    if b == 0:
        tl.store(_ticket(counts_ptr, tl.num_programs(0), E), 0)


@triton.jit(do_not_specialize=["NUM_BLOCKS"])
def _scan_kernel(counts_ptr, offsets_ptr, NUM_BLOCKS, E, KEYS: tl.constexpr, CHUNK_B: tl.constexpr,
                 BINS: tl.constexpr):
    """Program i takes keys [i*KEYS, (i+1)*KEYS): counts[b, key] becomes the number of slots of that
    key in blocks < b (in place) and totals[key] the key's slot count. The last program to finish
    writes offsets[key] = slots of smaller keys, for key 0..E."""
    NK = E + 1
    totals_ptr = counts_ptr + NUM_BLOCKS * NK
    k_K = tl.program_id(0) * KEYS + tl.arange(0, KEYS)
    mask_K = k_K < NK
    carry_K = tl.zeros((KEYS,), dtype=tl.int32)
    for b0 in range(0, NUM_BLOCKS, CHUNK_B):
        b_C = b0 + tl.arange(0, CHUNK_B)
        ptrs_CK = counts_ptr + b_C[:, None] * NK + k_K[None, :]
        mask_CK = (b_C < NUM_BLOCKS)[:, None] & mask_K[None, :]
        c_CK = tl.load(ptrs_CK, mask=mask_CK, other=0)
        tl.store(ptrs_CK, tl.cumsum(c_CK, axis=0) - c_CK + carry_K[None, :], mask=mask_CK)
        carry_K += tl.sum(c_CK, axis=0)
    tl.store(totals_ptr + k_K, carry_K, mask=mask_K)
    # Last-program pattern (no spinning): the barrier puts every thread's totals store before the
    # ticket's release; the program that draws the last ticket acquires all of them.
    tl.debug_barrier()
    ticket = tl.atomic_add(_ticket(counts_ptr, NUM_BLOCKS, E), 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        a_A = tl.arange(0, BINS)
        # volatile: read past this SM's L1, which never saw the other programs' stores.
        t_A = tl.load(totals_ptr + a_A, mask=a_A < NK, other=0, volatile=True)
        tl.store(offsets_ptr + a_A, tl.cumsum(t_A, axis=0) - t_A, mask=a_A < NK)


@triton.jit
def _run_start(key_a, first_a, key_b, first_b):
    """Scan operator over a sorted sequence: index where the run of equal keys ending here starts."""
    return key_b, tl.where(key_a == key_b, first_a, first_b)


@triton.jit(do_not_specialize=["S"])
def _scatter_kernel(ids_ptr, before_ptr, offsets_ptr, order_ptr, rows_ptr, inv_ptr, S, E, TOPK,
                    BLOCK_S: tl.constexpr):
    """Stable rank of each slot of block b among its equal keys, and its sorted position: writes
    order[pos] = slot, rows[pos] = slot // TOPK and inv[slot] = pos."""
    b = tl.program_id(0)
    start = b * BLOCK_S
    key_B = _slot_keys(ids_ptr, start, S, E, BLOCK_S)
    # Sorting (key, lane) pairs orders the block by key and keeps slot order within a key: stable.
    # Lanes past S have the largest key, so the real slots come first.
    j_B = tl.arange(0, BLOCK_S)
    packed_B = tl.sort(key_B * BLOCK_S + j_B)
    key_B = packed_B // BLOCK_S
    slot_B = start + packed_B % BLOCK_S
    mask_B = slot_B < S
    _, first_B = tl.associative_scan((key_B, j_B), 0, _run_start)
    pos_B = (tl.load(offsets_ptr + key_B, mask=mask_B, other=0)
             + tl.load(before_ptr + b * (E + 1) + key_B, mask=mask_B, other=0) + j_B - first_B)
    tl.store(order_ptr + pos_B, slot_B, mask=mask_B)
    tl.store(rows_ptr + pos_B, slot_B // TOPK, mask=mask_B)
    tl.store(inv_ptr + slot_B, pos_B, mask=mask_B)


# Rows of a buffer sized by the valid slots are rounded up to this: CUTLASS's grouped GEMMs take bf16 operands
# whose row counts are multiples of 8 (grouped_linear.cutlass_ok), and Triton specializes an int argument on its
# divisibility by 16: with 8, the GEMMs that take the row count recompiled whenever an EP routing first flipped it.
_ROW_ALIGN = 16


def slot_capacity(num_slots: int, valid_slots: int | None, bound: SlotCapacity | None = None) -> int:
    """Rows of the expert-sorted buffers: the valid slots when known, else the bound's rows when given
    (either rounded up to _ROW_ALIGN, at most all slots), else all slots; at least one where there are slots
    (an empty buffer would reach the GEMMs' tensor descriptors). sym_min / sym_max where a count is symbolic
    under torch.compile: min / max would guard on which side wins (a recompile when it flips); plain ints take min / max (torch 2.11's dynamo refuses
    a torch.sym_* call that returns an int)."""
    if valid_slots is None and bound is not None:
        valid_slots = min(bound.rows, num_slots)
    if valid_slots is None:
        return num_slots
    if not 0 <= valid_slots <= num_slots:
        raise ValueError(f"valid_slots={valid_slots} outside [0, {num_slots}] (the M*k slots)")
    rounded = -(-valid_slots // _ROW_ALIGN) * _ROW_ALIGN
    if isinstance(num_slots, int) and isinstance(rounded, int):
        return min(num_slots, max(rounded, 1))
    return torch.sym_min(num_slots, torch.sym_max(rounded, 1))


def sort_slots(expert_ids_Mk: torch.Tensor, num_experts: int, valid_slots: int | None = None,
               bound: SlotCapacity | None = None) -> SlotOrder:
    """Expert-sorted order of the M*k slots, by three kernels and no host sync.

    valid_slots: the number of ids >= 0, when the caller knows it on the host (it must be exact: the
    buffers sized by it hold every valid position); the SlotOrder's capacity is slot_capacity(M*k, it, bound).
    bound (without valid_slots): the valid slots past its capacity are dropped: offsets_E1 is clamped to the
    capacity, so no kernel reaches them, and their number is added to bound.dropped.

    Key of a slot: its expert id, or num_experts for a -1 slot (the sentinels sort behind every
    expert segment). Stable: equal keys keep slot order, so each expert's rows stay in token order
    and the weight-gradient sums are deterministic. order_S is a full permutation of 0..S-1 (the -1
    slots at the tail, in slot order), inv_S its inverse, rows_S = order_S // k, offsets_E1 [E+1]
    the segment starts with offsets[E] = number of valid slots; all int32. Ids must lie in
    [-1, num_experts).
    """
    E, topk = num_experts, expert_ids_Mk.shape[1]
    ids_S = expert_ids_Mk.contiguous().view(-1)
    S, dev = ids_S.numel(), ids_S.device
    capacity = slot_capacity(S, valid_slots, bound)
    order_S = torch.empty(S, device=dev, dtype=torch.int32)
    rows_S = torch.empty(S, device=dev, dtype=torch.int32)
    inv_S = torch.empty(S, device=dev, dtype=torch.int32)
    if S == 0:  # no zero-size grids
        offsets_E1 = torch.zeros(E + 1, device=dev, dtype=torch.int32)
        return SlotOrder(order_S=order_S, inv_S=inv_S, offsets_E1=offsets_E1, ids_S=ids_S, topk=topk,
                         num_experts=E, rows_S=rows_S, capacity=capacity)
    block_s = _block_s(S)
    num_blocks = cdiv(S, block_s)
    assert (E + 2) * block_s < 2**31 and (num_blocks + 1) * (E + 1) < 2**31 and S < 2**31, "int32 indexing"
    bins = max(32, next_power_of_2(E + 2))  # keys 0..E+1; tl.histogram wants >= a warp of bins
    offsets_E1 = torch.empty(E + 1, device=dev, dtype=torch.int32)
    scratch = torch.empty((num_blocks + 1) * (E + 1) + 1, device=dev, dtype=torch.int32)  # see _ticket
    launch(_histogram_kernel, (num_blocks,), (ids_S, scratch, S, E),
           {"BLOCK_S": block_s, "BINS": bins, "num_warps": _histogram_warps(block_s, bins)})
    launch(_scan_kernel, (cdiv(E + 1, _SCAN_KEYS),), (scratch, offsets_E1, num_blocks, E),
           {"KEYS": _SCAN_KEYS, "CHUNK_B": _SCAN_BLOCKS, "BINS": bins, "num_warps": 4})
    launch(_scatter_kernel, (num_blocks,), (ids_S, scratch, offsets_E1, order_S, rows_S, inv_S, S, E, topk),
           {"BLOCK_S": block_s, "num_warps": _scatter_warps(block_s)})
    if valid_slots is None and bound is not None:
        _drop_past(offsets_E1, capacity, bound.dropped)
    return SlotOrder(order_S=order_S, inv_S=inv_S, offsets_E1=offsets_E1, ids_S=ids_S, topk=topk,
                     num_experts=E, rows_S=rows_S, capacity=capacity)


def _drop_past(offsets_E1: torch.Tensor, capacity: int, dropped: torch.Tensor) -> None:
    """Counts the valid slots sorted past `capacity` into `dropped` and clamps the segments to end by it."""
    dropped += (offsets_E1[-1] - capacity).clamp_min(0)
    offsets_E1.clamp_(max=capacity)


@triton.jit
def _combine_kernel(z_ptr, s_z_m, inv_ptr, offsets_ptr, w_ptr, y_ptr, s_y_m, H, E,
                    TOPK: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    m = tl.program_id(0)
    h_H = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_H = h_H < H
    acc_H = tl.zeros((BLOCK_H,), dtype=tl.float32)
    num_valid = tl.load(offsets_ptr + E)  # less than the valid slots where a bound dropped some
    for j in tl.static_range(TOPK):
        slot = m * TOPK + j
        # -1 slots sort behind the valid ones, dropped ones past the clamped end: never written, skipped whole
        pos = tl.load(inv_ptr + slot)
        if pos < num_valid:
            z_H = tl.load(z_ptr + pos.to(tl.int64) * s_z_m + h_H, mask=mask_H, other=0.0).to(tl.float32)
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
    block_h = min(1024, next_power_of_2(H))
    launch(_combine_kernel, (M, cdiv(H, block_h)), (
        z_SH, z_SH.stride(0), slots.inv_S, slots.offsets_E1, w_S, y_MH, y_MH.stride(0), H,
        slots.num_experts),
        {"TOPK": slots.topk, "HAS_W": w_S is not None, "BLOCK_H": block_h, "num_warps": 4})
    return y_MH


# Rows x columns of one gather program: the fastest shape measured; it beats index_select, which also
# copies the -1 tail (docs/benchmarks.md#expert-layer).
_GATHER_ROWS = 32
_GATHER_COLS = 256


@triton.jit
def _gather_rows_kernel(x_ptr, s_x_m, s_x_h, rows_ptr, offsets_ptr, out_ptr, s_out_m, H, E,
                        BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    p0 = tl.program_id(0) * BLOCK_P
    num_valid = tl.load(offsets_ptr + E)
    if p0 < num_valid:  # programs past the valid slots (the -1 tail) move nothing
        p_P = p0 + tl.arange(0, BLOCK_P)
        mask_P = p_P < num_valid
        row_P = tl.load(rows_ptr + p_P, mask=mask_P, other=0).to(tl.int64)
        h_H = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = mask_P[:, None] & (h_H < H)[None, :]
        v = tl.load(x_ptr + row_P[:, None] * s_x_m + h_H[None, :] * s_x_h, mask=mask)
        tl.store(out_ptr + p_P.to(tl.int64)[:, None] * s_out_m + h_H[None, :], v, mask=mask)


def gather_rows(x_MH: torch.Tensor, slots: SlotOrder) -> torch.Tensor:
    """[capacity, H] expert-sorted copy of the token rows: out[p] = x[rows[p]] for the valid positions; rows
    of -1 slot positions (capacity S) are left unwritten (index_select would copy all S, 4x the work at 75%
    -1 slots)."""
    P, H = slots.capacity, x_MH.shape[1]
    out_PH = slots.new_rows(x_MH, H)
    if P == 0 or H == 0:
        return out_PH
    block_h = min(_GATHER_COLS, next_power_of_2(H))
    launch(_gather_rows_kernel, (cdiv(P, _GATHER_ROWS), cdiv(H, block_h)), (
        x_MH, *x_MH.stride(), slots.rows_S, slots.offsets_E1, out_PH, out_PH.stride(0), H, slots.num_experts),
        {"BLOCK_P": _GATHER_ROWS, "BLOCK_H": block_h, "num_warps": 4})
    return out_PH

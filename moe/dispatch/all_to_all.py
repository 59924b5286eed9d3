"""`all_to_all` dispatcher: expert parallelism over one process group with uneven all_to_all_single.

Shapes: T tokens of this rank, H hidden, k top-k, R = ep ranks of the group, E experts in all,
S rows this rank sends (one per (token, destination rank) pair), M rows it receives and computes.

Placement: rank r of the group owns the global experts [r * E/ep, (r+1) * E/ep).

Dispatch
  1. needs_TR[t, r]: token t has at least one of its top-k experts on rank r. A token travels once
     to each such rank, not once per slot: its k slots arrive together and the backend sums the
     valid ones there, so combine receives one partial sum per (token, rank).
  2. The send buffer lists the (rank, token) pairs rank-major, tokens ascending (token_S); each row
     carries the token's ids remapped to the destination's local ids, -1 for slots owned elsewhere.
  3. The split sizes are exchanged with the valid-slot counts (the only host-device sync; the received
     valid slots size the backend's per-slot buffers: Routed.valid_slots), then x, weights and ids each
     travel in one uneven all_to_all. The M received rows are grouped by source rank, each source's rows
     in its token order.
Combine: the reverse all_to_all sends each row's partial sum back to its source rank, where
  index_add adds the partial sums of each token.
Autograd: the backward of an all_to_all is the reverse all_to_all, so dispatch's backward has the
  shape of combine and combine's the shape of dispatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.dispatch.base import (
    Dispatcher,
    Routed,
    check_combine_shape,
    check_routing_shapes,
    local_expert_count,
)
from moe.dispatch.collectives import all_to_all as _all_to_all
from moe.dispatch.load import LoadLog


@dataclass
class AllToAllRouted(Routed):
    token_S: torch.Tensor  # source token of each row this rank sent, in send order
    send_splits: list[int]  # rows sent to each rank of the group
    recv_splits: list[int]  # rows received from each rank (they sum to M)
    num_tokens: int        # T of this rank, the length of combine's output


class _DispatchAllToAll(torch.autograd.Function):
    """Rows (x, weights, ids) out to their destination ranks; gradients of x and weights back."""

    @staticmethod
    def forward(ctx, x_SH, w_Sk, ids_Sk, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        ids_Mk = _all_to_all(ids_Sk, recv_splits, send_splits, group)
        ctx.mark_non_differentiable(ids_Mk)
        return (_all_to_all(x_SH, recv_splits, send_splits, group),
                _all_to_all(w_Sk, recv_splits, send_splits, group), ids_Mk)

    @staticmethod
    def backward(ctx, grad_x_MH, grad_w_Mk, _grad_ids):
        # Both gradients travel even when this rank's are zeros (undefined grads are materialized):
        # every rank must issue the same collectives in the same order, or the group hangs.
        back = (ctx.send_splits, ctx.recv_splits, ctx.group)
        return _all_to_all(grad_x_MH, *back), _all_to_all(grad_w_Mk, *back), None, None, None, None


class _CombineAllToAll(torch.autograd.Function):
    """Partial sums back to their source ranks and added per token; their gradients out again along the
    dispatch path. It keeps only token_S for backward: autograd's own index_add would keep the received
    rows [S, H] (its source gradient's formula names the source), one more row buffer per layer.

    The dispatched x_MH and weights_Mk are inputs (gradient None) only to tie the dispatch node into
    this rank's backward graph: a backend that computed nothing (a rank that received no rows)
    returns a y_MH with no history, and without the tie this rank would skip the backward
    collectives the other ranks wait in.
    """

    @staticmethod
    def forward(ctx, y_MH, x_MH, w_Mk, token_S, num_tokens, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        ctx.save_for_backward(token_S)
        y_SH = _all_to_all(y_MH, send_splits, recv_splits, group)
        return y_SH.new_zeros(num_tokens, y_SH.shape[1]).index_add_(0, token_S, y_SH)

    @staticmethod
    def backward(ctx, grad_out_TH):
        (token_S,) = ctx.saved_tensors
        grad_y_MH = _all_to_all(grad_out_TH.index_select(0, token_S), ctx.recv_splits, ctx.send_splits, ctx.group)
        return grad_y_MH, None, None, None, None, None, None, None


def _send_order(needs_TR: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_S, rank_S) of the needed (rank, token) pairs, rank-major with tokens ascending."""
    T = needs_TR.shape[0]
    needs_P = needs_TR.t().reshape(-1)  # pair p = r * T + t
    # A stable sort moves the needed pairs to the front in pair order; unlike nonzero it costs no
    # host sync, since num_rows is already on the host after the split exchange.
    pair_S = torch.argsort((~needs_P).to(torch.uint8), stable=True)[:num_rows]
    return pair_S % T, pair_S // T


class AllToAllDispatcher(Dispatcher):
    traceable = False  # the split sizes reach the host (.tolist()) and M depends on the routing

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        ep = dist.get_world_size(group)
        self.group = group
        self.ep = ep
        self.num_local_experts = local_expert_count(num_experts, ep)
        self.loads = LoadLog()

    def dispatch(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor,
                 topk_w_Tk: torch.Tensor) -> AllToAllRouted:
        check_routing_shapes(x_TH, topk_ids_Tk, topk_w_Tk)
        T = x_TH.shape[0]
        owner_Tk = topk_ids_Tk // self.num_local_experts
        # slots of each token per rank: a token travels to the ranks with any, their sum is the valid slots there
        slots_TR = torch.zeros(T, self.ep, dtype=torch.int64, device=x_TH.device).scatter_add_(
            1, owner_Tk, torch.ones_like(owner_Tk))
        needs_TR = slots_TR > 0
        start = time.perf_counter()
        send_splits, recv_splits, valid_slots = self._exchange_counts(needs_TR.sum(0), slots_TR.sum(0))
        self.loads.add(valid_slots, time.perf_counter() - start)
        token_S, rank_S = _send_order(needs_TR, sum(send_splits))
        ids_Sk = self._local_ids(topk_ids_Tk.index_select(0, token_S), rank_S)
        x_MH, w_Mk, ids_Mk = _DispatchAllToAll.apply(
            x_TH.index_select(0, token_S), topk_w_Tk.index_select(0, token_S), ids_Sk,
            send_splits, recv_splits, self.group)
        return AllToAllRouted(x_MH, ids_Mk, w_Mk, token_S, send_splits, recv_splits, T, valid_slots=valid_slots)

    def combine(self, y_MH: torch.Tensor, routed: AllToAllRouted) -> torch.Tensor:
        check_combine_shape(y_MH, routed)
        return _CombineAllToAll.apply(y_MH, routed.x_MH, routed.weights_Mk, routed.token_S, routed.num_tokens,
                                      routed.send_splits, routed.recv_splits, self.group)

    def _exchange_counts(self, rows_R: torch.Tensor, slots_R: torch.Tensor) -> tuple[list[int], list[int], int]:
        """(rows sent to each rank, rows received from each, valid slots received in all) from the rows and
        valid slots this rank sends to each rank, in one all_to_all of [R, 2] counts."""
        send_R2 = torch.stack([rows_R, slots_R], dim=1)
        recv_R2 = _all_to_all(send_R2, None, None, self.group)
        # The one host-device sync of EP: the uneven all_to_alls need their split sizes on the host.
        send, recv = torch.stack([send_R2, recv_R2]).tolist()
        return [rows for rows, _ in send], [rows for rows, _ in recv], sum(slots for _, slots in recv)

    def _local_ids(self, ids_Sk: torch.Tensor, rank_S: torch.Tensor) -> torch.Tensor:
        """Global ids -> the destination rank's local ids, -1 where another rank owns the slot."""
        first_S1 = (rank_S * self.num_local_experts).unsqueeze(1)
        local_Sk = ids_Sk - first_S1
        owned_Sk = (local_Sk >= 0) & (local_Sk < self.num_local_experts)
        return torch.where(owned_Sk, local_Sk, -1)

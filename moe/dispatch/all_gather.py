"""`all_gather` dispatcher: expert parallelism without a host sync, by all-gather and reduce-scatter.

Shapes: T tokens of this rank, B = tokens_per_rank (the bound every rank pads to), R ep ranks of the
group, M = R * B rows every rank computes, H hidden, k top-k, E experts in all.

Placement: rank r of the group owns the global experts [r * E/ep, (r+1) * E/ep), as under all_to_all.

Dispatch: every rank pads its tokens to B rows (padding rows route nowhere: ids -1) and all-gathers x,
  weights and ids over the group (one all-gather of each row's bytes); each rank keeps the slots of its own
  experts (local ids) and marks the others -1. Combine: the backend's rows (each the weighted sum over this rank's valid slots of the row,
  zero where it has none) are reduce-scattered, so rank r receives the sum over the group of its own B rows.
Every size is known on the host before any data moves (B, R), so nothing waits for the device: the host runs
  ahead of the GPU through every layer, and dispatch and combine trace into a fullgraph torch.compile region.
The price: every token travels to every rank, not only to the ranks that own its experts. With top-k 8 of
  128 experts a token needs nearly every rank at ep 2 and 4 (1 - (1 - 1/ep)^k: 99.6%, 90%), so the bytes are
  about all_to_all's there; at ep 8 they are 1.5x (66%).
Buffers: valid_slots is not known on the host, so in training the backend gets a bound instead
  (moe.capacity.SlotCapacity): capacity x B * k rows, B * k being a rank's valid slots under perfectly balanced
  routing; the valid slots past it are dropped and counted, and runtime.train grows the bound (`grow`) and
  computes the step again, so nothing trained ever comes from a dropped slot. Without grad (evaluation) there
  is no bound: the buffers take all M * k slots for that forward only.
Autograd: all-gather's backward is a reduce-scatter of the gradients and vice versa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe.capacity import SlotCapacity
from moe.dispatch.base import (
    Dispatcher,
    Routed,
    check_combine_shape,
    check_routing_shapes,
    local_expert_count,
)
from moe.dispatch.collectives import all_gather, reduce_scatter_sum
from moe.dispatch.load import DeviceLoadLog


@dataclass
class AllGatherRouted(Routed):
    num_tokens: int  # T of this rank: combine's output keeps the first T of its B rows


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[B, n] of any dtype as [B, n * itemsize] uint8 (one row's values as its bytes)."""
    return t.contiguous().view(torch.uint8)


def _unpack(rows_MP: torch.Tensor, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The [M, n] tensors of `like`'s dtypes and widths, cut back out of gathered byte rows."""
    out, start = [], 0
    for t in like:
        width = t.shape[1] * t.element_size()
        out.append(rows_MP[:, start:start + width].contiguous().view(t.dtype))
        start += width
    return out


class _GatherRows(torch.autograd.Function):
    """Every rank's rows (x, weights and ids, as bytes in one all-gather: one collective's launch and latency
    instead of three) to every rank; the gradients of x and weights summed back to their owners."""

    @staticmethod
    def forward(ctx, x_BH, w_Bk, ids_Bk, group):
        ctx.group = group
        rows_MP = all_gather(torch.cat([_bytes(x_BH), _bytes(w_Bk), _bytes(ids_Bk)], dim=1), group)
        x_MH, w_Mk, ids_Mk = _unpack(rows_MP, (x_BH, w_Bk, ids_Bk))
        ctx.mark_non_differentiable(ids_Mk)
        return x_MH, w_Mk, ids_Mk

    @staticmethod
    def backward(ctx, grad_x_MH, grad_w_Mk, _):
        # Both travel even where this rank's are zeros: every rank issues the same collectives in the same order.
        return reduce_scatter_sum(grad_x_MH, ctx.group), reduce_scatter_sum(grad_w_Mk, ctx.group), None, None


class _SumRows(torch.autograd.Function):
    """Each rank's partial sums of every row to the row's owner, summed; the gradient back to every rank.

    The gathered x_MH and weights_Mk are inputs (gradient None) only to tie the gather into this rank's
    backward graph: a backend that computed nothing (no valid slot here) returns a y_MH with no history,
    and without the tie this rank would skip the backward reduce-scatter the other ranks wait in."""

    @staticmethod
    def forward(ctx, y_MH, x_MH, w_Mk, group):
        ctx.group = group
        return reduce_scatter_sum(y_MH, group)

    @staticmethod
    def backward(ctx, grad_out_BH):
        return all_gather(grad_out_BH, ctx.group), None, None, None


def _group_device(group: dist.ProcessGroup) -> torch.device:
    """The device the group's collectives run on (NCCL: this process's current CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AllGatherDispatcher(Dispatcher):
    traceable = True  # no host sync, no size that depends on the routing

    def __init__(self, group: dist.ProcessGroup, num_experts: int, tokens_per_rank: int, capacity: float):
        ep = dist.get_world_size(group)
        self.group = group
        self.ep = ep
        self.num_local_experts = local_expert_count(num_experts, ep)
        self.first_expert = dist.get_rank(group) * self.num_local_experts
        self.tokens_per_rank = tokens_per_rank
        self.capacity = capacity  # x a rank's valid slots under balanced routing
        device = _group_device(group)
        self.loads = DeviceLoadLog(ep, device)
        self.dropped = torch.zeros((), dtype=torch.int64, device=device)  # valid slots past the bound, since reset

    def bound(self, topk: int) -> SlotCapacity:
        return SlotCapacity(math.ceil(self.capacity * self.tokens_per_rank * topk), self.dropped)

    def grow(self) -> float:
        """The capacity x 1.5 (every rank alike, after a step that dropped slots); at most ep: every gathered
        slot, which nothing exceeds."""
        self.capacity = min(self.capacity * 1.5, float(self.ep))
        return self.capacity

    def dispatch(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor,
                 topk_w_Tk: torch.Tensor) -> AllGatherRouted:
        check_routing_shapes(x_TH, topk_ids_Tk, topk_w_Tk)
        T, B = x_TH.shape[0], self.tokens_per_rank
        if T > B:
            raise ValueError(f"all_gather dispatcher: {T} tokens on this rank, more than the {B} it was built for "
                             "(train.micro_batch_size * data.seq_len / parallelism.cp); use "
                             "parallelism.dispatcher=all_to_all for batches of other sizes")
        pad = (0, 0, 0, B - T)  # padding rows route nowhere
        x_MH, w_Mk, ids_Mk = _GatherRows.apply(F.pad(x_TH, pad), F.pad(topk_w_Tk, pad),
                                               F.pad(topk_ids_Tk, pad, value=-1), self.group)
        local_Mk = ids_Mk - self.first_expert
        owned_Mk = (local_Mk >= 0) & (local_Mk < self.num_local_experts)
        self.loads.add(ids_Mk, self.num_local_experts)
        # the bound only where a backward will keep the buffers; a forward without grad sizes them whole
        bound = self.bound(topk_ids_Tk.shape[1]) if torch.is_grad_enabled() else None
        return AllGatherRouted(x_MH, torch.where(owned_Mk, local_Mk, -1), w_Mk, T, bound=bound)

    def combine(self, y_MH: torch.Tensor, routed: AllGatherRouted) -> torch.Tensor:
        check_combine_shape(y_MH, routed)
        out_BH = _SumRows.apply(y_MH, routed.x_MH, routed.weights_Mk, self.group)
        return out_BH[:routed.num_tokens]

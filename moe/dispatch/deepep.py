"""`deepep` dispatcher: expert parallelism over one NVLink-connected EP group with DeepEP's intranode
kernels (https://github.com/deepseek-ai/DeepEP, built from commit 567632d, its last release of the
`deep_ep_cpp` API before EPv2; benchmarks/build_deepep.sh builds it intranode-only for sm90).

Shapes: T tokens of this rank, H hidden, k top-k, R = ep ranks of the group, E experts in all,
E_local = E / R, M rows this rank receives and computes.

Placement: rank r of the group owns the global experts [r * E_local, (r+1) * E_local), as all_to_all.

What DeepEP does (deep_ep/buffer.py, csrc/deep_ep.cpp, csrc/kernels/intranode.cu at 567632d):
  get_dispatch_layout(topk_idx, E) -> num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
      is_token_in_rank [T, R] bool: a token travels once to each rank owning one of its experts.
  dispatch(x, topk_idx, topk_weights, ...) -> recv_x [M, H], recv_topk_idx [M, k], recv_topk_weights
      [M, k], num_recv_tokens_per_expert_list (E_local host ints), handle: the sender rewrites each
      slot to the destination's local expert id, or -1 with weight 0 where another rank owns it (our
      layout exactly). Rows arrive grouped by source rank (rank_prefix_matrix[s, me] is the running
      end of source s's rows), each source's rows in its token order (channels are contiguous token
      ranges); recv_src_idx (handle[3]) is each row's token index on its source.
  combine(y, handle, topk_weights=None) -> [T, H]: the plain sum of a token's rows (no weights),
      and of their topk_weights when given.
  Backward (DeepEP's README, "Example use in model training"): the backward of dispatch is a
  combine of the gradients (x's and topk_weights') with the handle, the backward of combine a
  dispatch of the output gradient with the handle (cached mode: no layout, no top-k).
Constraints: R in {2, 4, 8}, all ranks on one node; x rows a multiple of 16 bytes (H % 8 for bf16);
  topk_idx of deep_ep.topk_idx_t (int64 unless built with TOPK_IDX_BITS=32); topk_weights float32;
  k <= 32; E_local <= 1024; combine only in bfloat16 (its kernels exist for nv_bfloat16 alone), while
  dispatch copies rows as bytes in any dtype. So this dispatcher dispatches x in its own dtype, and
  reduces (combine, and dispatch's backward) in bf16: an fp32 model's MoE output and x gradient carry
  bf16 rounding here.
Host sync: dispatch waits on the host for the received counts (like all_to_all's split exchange), so
  it is not traceable; nothing else reads the device.
Buffer: one deep_ep.Buffer per dispatcher (one dispatcher per EP group, shared by every block), made on
  the first dispatch (a collective over the group: every rank reaches its first MoE block together),
  sized by DeepEP's size hints for (row bytes, R) and made again, larger, if a later x needs more. Its
  NVLink buffer is a ring of num_max_nvl_chunked_recv_tokens per (channel, rank), so it does not grow
  with the tokens per rank. `close()` frees it (explicitly_destroy: DeepEP warns that freeing in a
  destructor can hang Python's exception handling).
Overlap: DeepEP can run the exchange on its own stream (async_finish / previous_event) while the caller
  computes; the contract returns rows the backend needs at once, so both calls finish on the current
  stream here. The chance left is the shared expert during dispatch, which needs MoEBlock to split
  dispatch into launch and wait (not done).

The conversions around DeepEP are small functions of tensors (`to_deepep_routing`, `source_splits`,
`row_sources`, `nvl_bytes`, `check_deepep_shapes`), checked on the CPU by tests/unit/test_deepep_layout.py,
which also holds torch statements of what DeepEP's layout and sender compute; tests/gpu/test_deepep_gpu.py
checks the kernels against those and against all_to_all.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from moe.dispatch.base import (
    Dispatcher,
    Routed,
    check_combine_shape,
    check_routing_shapes,
    local_expert_count,
)
from moe.dispatch.load import LoadLog

BUILD_HINT = ("build DeepEP intranode-only for sm90 with benchmarks/build_deepep.sh (`prepare` here from a "
              "DeepEP mirror, then `build` on a GPU machine) and install the wheel it writes")
SUPPORTED_EP = (2, 4, 8)  # intranode kernels are instantiated for these group sizes (SWITCH_RANKS)
MAX_TOPK = 32             # one warp lane per slot in the intranode kernels
MAX_LOCAL_EXPERTS = 1024  # NUM_MAX_LOCAL_EXPERTS
# deep_ep.Buffer.num_sms: SMs the exchange kernels take (even: send/recv pairs). Nothing computes while they
# run (no overlap here), so more SMs pay (docs/benchmarks.md#expert-parallelism).
DEFAULT_NUM_SMS = 48


def deepep_unavailable_reason() -> str | None:
    """None when the deep_ep package can be found (not imported: that would load CUDA), else why not."""
    if importlib.util.find_spec("deep_ep") is None:
        return f"the deep_ep package is not installed; {BUILD_HINT}"
    return None


def import_deep_ep():
    """deep_ep, or an ImportError naming the build script (also when the package is found but its
    extension does not load, e.g. undefined symbols of a build without device linking)."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as err:
        raise ImportError(f"dispatcher 'deepep' needs the deep_ep package, which did not import ({err}); "
                          f"{BUILD_HINT}") from err


# ---------------------------------------------------------------------------- pure conversions

def check_deepep_shapes(ep: int, num_experts: int, hidden: int | None = None, element_size: int | None = None,
                        k: int | None = None) -> None:
    """What DeepEP's intranode kernels accept, checked before any collective (shapes only, no data)."""
    if ep not in SUPPORTED_EP:
        raise ValueError(f"dispatcher 'deepep' runs DeepEP's intranode kernels, built for EP groups of "
                         f"{list(SUPPORTED_EP)} ranks on one node; this EP group has {ep}: use all_to_all")
    if local_expert_count(num_experts, ep) > MAX_LOCAL_EXPERTS:
        raise ValueError(f"dispatcher 'deepep': {num_experts // ep} experts per rank, DeepEP takes at most "
                         f"{MAX_LOCAL_EXPERTS}")
    if k is not None and not 0 < k <= MAX_TOPK:
        raise ValueError(f"dispatcher 'deepep': top-k {k}, DeepEP's kernels take 1..{MAX_TOPK}")
    if hidden is not None and element_size is not None and (hidden * element_size) % 16:
        raise ValueError(f"dispatcher 'deepep': rows of {hidden} x {element_size} bytes; DeepEP moves rows in "
                         "16-byte units (hidden % 8 == 0 for bf16)")


def to_deepep_routing(topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor,
                      idx_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Our routing -> DeepEP's: ids in deep_ep.topk_idx_t, weights float32, both contiguous."""
    return topk_ids_Tk.to(idx_dtype).contiguous(), topk_w_Tk.to(torch.float32).contiguous()


def source_splits(rank_prefix_matrix_RR: torch.Tensor, rank: int) -> list[int]:
    """Rows this rank received from each source rank: rank_prefix_matrix[s, rank] is the running total
    of the rows sources 0..s sent to `rank` (DeepEP's notify_dispatch)."""
    ends_R = rank_prefix_matrix_RR[:, rank].tolist()
    return [end - start for start, end in zip([0, *ends_R[:-1]], ends_R, strict=True)]


def row_sources(rank_prefix_matrix_RR: torch.Tensor, recv_src_idx_M: torch.Tensor, rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(source rank, token index on that rank) of every received row."""
    splits = source_splits(rank_prefix_matrix_RR, rank)
    src_rank_M = torch.repeat_interleave(torch.arange(len(splits), device=recv_src_idx_M.device),
                                         torch.tensor(splits, device=recv_src_idx_M.device))
    return src_rank_M, recv_src_idx_M.long()


def row_bytes(hidden: int, element_size: int) -> int:
    """Bytes DeepEP's size hints count per row: bf16 at least, as its README's get_hidden_bytes."""
    return hidden * max(element_size, 2)


def nvl_bytes(configs: Iterable[Any], hidden_bytes: int, ep: int) -> int:
    """NVLink buffer bytes for the given deep_ep.Config-likes: the largest of their size hints."""
    return max(config.get_nvl_buffer_size_hint(hidden_bytes, ep) for config in configs)


# ---------------------------------------------------------------------------- the dispatcher

@dataclass
class DeepEPRouted(Routed):
    handle: tuple                 # DeepEP's intranode handle: rank_prefix_matrix, channel_prefix_matrix,
                                  # recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head
    num_tokens: int               # T of this rank, the length of combine's output
    tokens_per_expert: list[int]  # valid slots per local expert (host ints DeepEP returns for free)
    rank: int                     # this rank in the EP group

    @property
    def recv_splits(self) -> list[int]:
        """Rows received from each source rank (reads the device: for tests and reports)."""
        return source_splits(self.handle[0].cpu(), self.rank)

    def sources(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(source rank, source token) of every row (reads the device: for tests and reports)."""
        return row_sources(self.handle[0].cpu(), self.handle[3], self.rank)


class _Exchange:
    """What one dispatch leaves for its combine and for both backwards (not a tensor, so it rides
    through autograd as a plain argument)."""
    handle: tuple | None = None
    tokens_per_expert: list[int] | None = None


class _DeepEPDispatch(torch.autograd.Function):
    """Rows (x, weights, ids) out to the ranks owning their experts; gradients of x and weights back by
    a combine with the same handle."""

    @staticmethod
    def forward(ctx, x_TH, w_Tk, ids_Tk, dispatcher, exchange):
        buffer = dispatcher.buffer_for(x_TH)
        ids_d, w_d = to_deepep_routing(ids_Tk, w_Tk, dispatcher.topk_idx_dtype)
        per_rank_R, _, per_expert_E, in_rank_TR, _ = buffer.get_dispatch_layout(ids_d, dispatcher.num_experts)
        recv_x, recv_ids, recv_w, per_local_expert, handle, _ = buffer.dispatch(
            x_TH.contiguous(), topk_idx=ids_d, topk_weights=w_d, num_tokens_per_rank=per_rank_R,
            is_token_in_rank=in_rank_TR, num_tokens_per_expert=per_expert_E, config=dispatcher.dispatch_config)
        exchange.handle, exchange.tokens_per_expert = handle, list(per_local_expert)
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.x_dtype, ctx.w_dtype = x_TH.dtype, w_Tk.dtype
        ids_Mk, w_Mk = recv_ids.to(ids_Tk.dtype), recv_w.to(w_Tk.dtype)  # back in the dtypes given
        ctx.mark_non_differentiable(ids_Mk)
        return recv_x, w_Mk, ids_Mk

    @staticmethod
    def backward(ctx, grad_x_MH, grad_w_Mk, _grad_ids):
        # Both gradients travel even when this rank's are zeros (undefined grads are materialized): every
        # rank of the group must run the same kernels in the same order, or the group hangs.
        d = ctx.dispatcher
        grad_x_TH, grad_w_Tk, _ = d.buffer.combine(
            grad_x_MH.to(torch.bfloat16).contiguous(), ctx.handle,
            topk_weights=grad_w_Mk.to(torch.float32).contiguous(), config=d.combine_config)
        return grad_x_TH.to(ctx.x_dtype), grad_w_Tk.to(ctx.w_dtype), None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """Partial sums back to their source tokens (summed there); their gradient out again by a cached
    dispatch. x_MH and w_Mk (gradient None) tie the dispatch node into this rank's backward graph: a
    rank that received no rows gets a y_MH with no history from its backend, and must still join the
    backward exchanges (as in all_to_all)."""

    @staticmethod
    def forward(ctx, y_MH, x_MH, w_Mk, dispatcher, handle):
        ctx.dispatcher, ctx.handle, ctx.y_dtype, ctx.x_dtype = dispatcher, handle, y_MH.dtype, x_MH.dtype
        out_TH, _, _ = dispatcher.buffer.combine(y_MH.to(torch.bfloat16).contiguous(), handle,
                                                 config=dispatcher.combine_config)
        return out_TH.to(y_MH.dtype)

    @staticmethod
    def backward(ctx, grad_out_TH):
        d = ctx.dispatcher
        # In the dispatched dtype: the buffer was sized for its rows.
        grad_y_MH, _, _, _, _, _ = d.buffer.dispatch(grad_out_TH.to(ctx.x_dtype).contiguous(), handle=ctx.handle,
                                                     config=d.dispatch_config)
        return grad_y_MH.to(ctx.y_dtype), None, None, None, None


class DeepEPDispatcher(Dispatcher):
    traceable = False  # DeepEP's dispatch waits on the host for the received counts

    def __init__(self, group, num_experts: int, num_sms: int = DEFAULT_NUM_SMS):
        import torch.distributed as dist

        ep = dist.get_world_size(group)
        check_deepep_shapes(ep, num_experts)
        if num_sms <= 0 or num_sms % 2:
            raise ValueError(f"dispatcher 'deepep': num_sms={num_sms} must be a positive even number "
                             "(DeepEP pairs a sending and a receiving block per channel)")
        self.deep_ep = import_deep_ep()
        self.group, self.ep, self.num_experts = group, ep, num_experts
        self.rank = dist.get_rank(group)
        self.num_local_experts = num_experts // ep
        self.topk_idx_dtype = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        # Cached dispatches and combines read the channel layout of the dispatch that made the handle,
        # so one num_sms serves all of them (Buffer.get_*_config reads the class attribute).
        Buffer = self.deep_ep.Buffer
        default_sms = Buffer.num_sms
        Buffer.set_num_sms(num_sms)
        try:
            self.dispatch_config = Buffer.get_dispatch_config(ep)
            self.combine_config = Buffer.get_combine_config(ep)
        finally:
            Buffer.num_sms = default_sms  # a class attribute: leave it as found
        self.buffer = None
        self._nvl_bytes = 0
        self.loads = LoadLog()

    def buffer_for(self, x_TH: torch.Tensor):
        """The buffer, made (collectively) on first use or when x's rows need more than it holds."""
        need = nvl_bytes((self.dispatch_config, self.combine_config),
                         row_bytes(x_TH.shape[1], x_TH.element_size()), self.ep)
        if self.buffer is None or need > self._nvl_bytes:
            self.close()
            self.buffer = self.deep_ep.Buffer(self.group, need, 0, explicitly_destroy=True)
            self._nvl_bytes = need
        return self.buffer

    def close(self) -> None:
        """Frees the buffer (a collective: every rank of the group calls it)."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer, self._nvl_bytes = None, 0

    def dispatch(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor) -> DeepEPRouted:
        check_routing_shapes(x_TH, topk_ids_Tk, topk_w_Tk)
        check_deepep_shapes(self.ep, self.num_experts, x_TH.shape[1], x_TH.element_size(), topk_ids_Tk.shape[1])
        exchange = _Exchange()
        start = time.perf_counter()  # the dispatch waits on the host for DeepEP's received counts
        x_MH, w_Mk, ids_Mk = _DeepEPDispatch.apply(x_TH, topk_w_Tk, topk_ids_Tk, self, exchange)
        valid_slots = sum(exchange.tokens_per_expert)
        self.loads.add(valid_slots, time.perf_counter() - start)
        return DeepEPRouted(x_MH, ids_Mk, w_Mk, exchange.handle, x_TH.shape[0], exchange.tokens_per_expert,
                            self.rank, valid_slots=valid_slots)

    def combine(self, y_MH: torch.Tensor, routed: DeepEPRouted) -> torch.Tensor:
        check_combine_shape(y_MH, routed)
        return _DeepEPCombine.apply(y_MH, routed.x_MH, routed.weights_Mk, self, routed.handle)

"""Chunked dispatch: the token exchange of one chunk beside the experts of another.

    dispatcher = ChunkedDispatcher(inner, chunks)   # config key parallelism.ep_chunks
    out_TH = dispatcher.run(x_TH, topk_ids_Tk, topk_w_Tk, compute)

Run whole, an EP MoE layer is exchange, experts, exchange back, and the GPU computes nothing while
tokens travel. Here this rank's tokens are cut into `chunks` contiguous pieces (the same count on every
rank, so every rank issues the same collectives in the same order; a piece may be empty). On CUDA the
inner dispatcher's dispatch and combine of each piece run on a side stream, the experts on the caller's:

    side:     D0  D1  C0  D2  C1  ...  (Ci waits for Ei)
    caller:       E0      E1      ...  (Ei waits for Di)

so only the first dispatch and the last combine are exposed. The backward overlaps the same way with no
code here: autograd runs each node's backward on the stream its forward ran on, joins the streams where
a gradient crosses them and records that gradient on its consumer's stream, and the exchange's
backward has no host sync. A token's output sums its own rows only, so chunking changes no result
except the summation order of the expert weights' gradients (one partial sum per chunk).

Forward bookkeeping done here: the side stream waits for the caller's routing, each piece's experts
wait for its dispatch only (an event, so they run beside the previous piece's combine), and every
tensor used on the stream it was not allocated on is recorded there, so the caching allocator does not
hand its memory out while that stream may still read it.

Not chunked (the inner dispatcher's own run) when `chunks` is 1, and when the collectives are issued in
their functional form (a dispatch mode such as selective checkpointing's, or a compile trace:
moe.dispatch.collectives), whose caching replays them op by op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe.dispatch.base import Dispatcher, Routed
from moe.dispatch.collectives import functional_form


class ChunkedDispatcher(Dispatcher):
    traceable = False  # a pipeline of host-synced exchanges

    def __init__(self, inner: Dispatcher, chunks: int):
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1 (config key parallelism.ep_chunks), got {chunks}")
        self.inner = inner
        self.chunks = chunks
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def dispatch(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor) -> Routed:
        return self.inner.dispatch(x_TH, topk_ids_Tk, topk_w_Tk)

    def combine(self, y_MH: torch.Tensor, routed: Routed) -> torch.Tensor:
        return self.inner.combine(y_MH, routed)

    def run(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor,
            compute: Callable[[Routed], torch.Tensor]) -> torch.Tensor:
        if self.chunks == 1 or functional_form():
            return self.inner.run(x_TH, topk_ids_Tk, topk_w_Tk, compute)
        pieces = list(zip(*(torch.tensor_split(t, self.chunks) for t in (x_TH, topk_ids_Tk, topk_w_Tk))))
        streams = self._streams(x_TH)
        if streams is None:  # no streams to overlap on (CPU): the same pieces in the same order
            return torch.cat([self.inner.run(*piece, compute) for piece in pieces])
        caller, side = streams
        side.wait_stream(caller)  # the routing
        _record(side, x_TH, topk_ids_Tk, topk_w_Tk)
        routed, ready = self._dispatch_on(side, pieces[0])
        outs = []
        for i in range(self.chunks):
            caller.wait_event(ready)
            _record(caller, routed.x_MH, routed.expert_ids_Mk, routed.weights_Mk)
            y_MH = compute(routed)
            _record(side, y_MH)
            this = routed
            if i + 1 < self.chunks:
                routed, ready = self._dispatch_on(side, pieces[i + 1])
            side.wait_stream(caller)  # this piece's experts
            with torch.cuda.stream(side):
                outs.append(self.inner.combine(y_MH, this))
        caller.wait_stream(side)
        _record(caller, *outs)
        return torch.cat(outs)

    def _dispatch_on(self, side: torch.cuda.Stream, piece) -> tuple[Routed, torch.cuda.Event]:
        with torch.cuda.stream(side):
            routed = self.inner.dispatch(*piece)
            ready = torch.cuda.Event()
            ready.record(side)
        return routed, ready

    def _streams(self, x_TH: torch.Tensor) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        if x_TH.device.type != "cuda":
            return None
        caller = torch.cuda.current_stream(x_TH.device)
        if x_TH.device not in self._side:
            # high priority: the exchange's small kernels should not queue behind the experts' GEMMs
            self._side[x_TH.device] = torch.cuda.Stream(x_TH.device, priority=-1)
        side = self._side[x_TH.device]
        return None if side == caller else (caller, side)


def _record(stream: torch.cuda.Stream, *tensors: torch.Tensor) -> None:
    """Marks the tensors' memory in use on `stream` until the work queued there so far is done."""
    for t in tensors:
        if t.numel():  # an empty tensor holds no memory to protect
            t.record_stream(stream)

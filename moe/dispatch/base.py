"""The dispatcher contract: where routed tokens are computed, and how their results come back.

Shapes: T tokens of this rank, H hidden, k top-k, M rows this rank computes.

    routed = dispatcher.dispatch(x_TH, topk_ids_Tk, topk_w_Tk)
    y_MH = backend(routed.x_MH, routed.expert_ids_Mk, routed.weights_Mk, experts)
    out_TH = dispatcher.combine(y_MH, routed)

`expert_ids_Mk` holds *local* expert ids, or -1 for a slot whose expert lives on another rank;
backends skip -1 slots. `valid_slots`, where the dispatcher knows it on the host without a sync (an EP
exchange brings its counts to the host anyway), is the number of slots with an id >= 0: backends size
their per-slot buffers by it instead of M*k (under EP most slots are -1). None: not known; then `bound`
(a moe.capacity.SlotCapacity) may cap those buffers, dropping and counting the valid slots past it. `y_MH` is
already the routing-weighted sum over the valid slots of each row, so combine only has to bring rows
home and add them per token. Both calls are differentiable:
the backward of dispatch is a combine-shaped op and vice versa, and gradients reach x_TH and
topk_w_Tk (the latter through the backend's multiplication by weights_Mk).

`traceable` says whether dispatch and combine trace into a fullgraph torch.compile region (no host
sync, no data-dependent shape); where not, the runtime compiles the MoE block around the exchange.
`load_reading` reads how evenly the exchanges spread the work over the EP ranks and how far apart the ranks'
hosts reach them (None without EP).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe.capacity import SlotCapacity
from moe.dispatch.load import LoadLog, LoadReading


@dataclass
class Routed:
    x_MH: torch.Tensor           # rows this rank computes
    expert_ids_Mk: torch.Tensor  # local expert id per slot, -1 where the expert lives elsewhere
    weights_Mk: torch.Tensor     # routing weights, dtype as given to dispatch; -1 slots are ignored
    valid_slots: int | None = field(default=None, kw_only=True)  # slots with an id >= 0, when known on the host
    # where valid_slots is not known: the bound a backend may size its buffers by (moe.capacity)
    bound: SlotCapacity | None = field(default=None, kw_only=True)


class Dispatcher(ABC):
    traceable: bool = False  # dispatch and combine trace into a fullgraph torch.compile region
    # An exchanging dispatcher's EP group and the log of its training dispatches' slot counts and host waits
    # (load_reading)
    group: dist.ProcessGroup | None = None
    loads: LoadLog | None = None
    # A dispatcher that bounds the backends' buffers (Routed.bound): the valid slots dropped past the bound
    # since the caller last zeroed it (a device int64 scalar), and `grow` to raise the bound
    dropped: torch.Tensor | None = None

    def grow(self) -> float:
        """Raises the bound after a step dropped slots; returns the new one. Only where `dropped` is set."""
        raise NotImplementedError(f"{type(self).__name__} bounds no buffers")

    @abstractmethod
    def dispatch(self, x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor) -> Routed:
        """Sends each token to the ranks that own its experts; returns the rows this rank computes."""

    @abstractmethod
    def combine(self, y_MH: torch.Tensor, routed: Routed) -> torch.Tensor:
        """Brings the backend's rows back to their tokens: out_TH[t] = sum of its rows' y."""

    def load_reading(self, device: torch.device) -> LoadReading | None:
        """Routing imbalance and host skew over the training dispatches since the last call
        (moe/dispatch/load.py); a collective over the EP group where there is one, else None."""
        return None if self.loads is None else self.loads.read(self.group, device)


def check_routing_shapes(x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_w_Tk: torch.Tensor) -> None:
    """Shape checks only: they read no tensor data, so they cost no host-device sync."""
    if x_TH.dim() != 2 or topk_ids_Tk.dim() != 2:
        raise ValueError(f"dispatch expects x [T, H] and topk_ids [T, k], got {tuple(x_TH.shape)} "
                         f"and {tuple(topk_ids_Tk.shape)}")
    if topk_ids_Tk.shape != topk_w_Tk.shape or topk_ids_Tk.shape[0] != x_TH.shape[0]:
        raise ValueError(f"dispatch: x {tuple(x_TH.shape)}, topk_ids {tuple(topk_ids_Tk.shape)} and "
                         f"topk_w {tuple(topk_w_Tk.shape)} disagree on T or k")


def local_expert_count(num_experts: int, ep: int) -> int:
    """The experts each EP rank owns; every rank must own as many."""
    if num_experts % ep != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {ep}: "
                         "every EP rank must own the same number of experts")
    return num_experts // ep


def check_combine_shape(y_MH: torch.Tensor, routed: Routed) -> None:
    """combine takes one output row per dispatched row."""
    if y_MH.shape != routed.x_MH.shape:
        raise ValueError(f"combine: y {tuple(y_MH.shape)} does not match the dispatched rows "
                         f"{tuple(routed.x_MH.shape)}")

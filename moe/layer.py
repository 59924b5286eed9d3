"""MoEBlock = router + dispatcher + grouped experts (+ sigmoid-gated shared expert).

    x_TH -> router -> (topk_ids_Tk, topk_w_Tk) -> dispatch -> backend -> combine -> out_TH
The dispatcher decides where tokens are computed (local or over an EP group); the backend how.
A block is built whole, with its dispatcher (`local` for a single process); what couples it to other
ranks is set in one step, `MoEBlock.wire(dispatcher, balance_group, aux_grad_scale)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.backends import expert_backend
from moe.dispatch import Dispatcher
from moe.experts import GroupedExperts
from moe.router import SoftmaxTopKRouter


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP (Qwen3 MLP and the shared expert); projections are plain nn.Linear."""

    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None):
        super().__init__()
        factory = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden, intermediate, **factory)
        self.up_proj = nn.Linear(hidden, intermediate, **factory)
        self.down_proj = nn.Linear(intermediate, hidden, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _AttachAuxLoss(torch.autograd.Function):
    """Returns x unchanged; in backward the balance loss `aux` receives gradient `scale`, as if
    scale * aux had been added to the training loss. This keeps forward free of side effects (no
    loss stored on the module), which torch.compile needs under activation checkpointing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        return grad_x, torch.full((), ctx.scale, device=grad_x.device, dtype=torch.float32), None


class MoEBlock(nn.Module):
    def __init__(self, router: SoftmaxTopKRouter, experts: GroupedExperts, dispatcher: Dispatcher,
                 backend: str = "grouped_mm", shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Linear | None = None):
        super().__init__()
        self.gate = router  # named as in HF checkpoints (mlp.gate.weight)
        self.experts = experts
        self.dispatcher = dispatcher
        expert_backend(backend)  # validates the name now, not inside a compiled forward
        self.backend = backend
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.aux_grad_scale = 1.0

    def wire(self, dispatcher: Dispatcher, balance_group: dist.ProcessGroup | None, aux_grad_scale: float) -> None:
        """Couples the block to the other ranks, in one step. `dispatcher` sends tokens to the EP ranks
        that own their experts; `balance_group` holds the ranks whose tokens form the balance loss's
        batch (None: this rank's tokens); `aux_grad_scale` weighs the balance loss's gradient per
        forward (1 / micro-batches per step, so that a step's balance loss is their mean)."""
        self.dispatcher = dispatcher
        self.gate.balance_group = balance_group
        self.aux_grad_scale = aux_grad_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])
        routing = self.gate(x_TH)
        self.gate.record_counts(routing.counts_E)
        routed = self.dispatcher.dispatch(x_TH, routing.topk_ids_Tk, routing.topk_w_Tk)
        y_MH = self.experts(routed.x_MH, routed.expert_ids_Mk, routed.weights_Mk, backend=self.backend,
                            valid_slots=routed.valid_slots, bound=routed.bound)
        out_TH = self.dispatcher.combine(y_MH, routed)
        return self.add_shared(x_TH, out_TH, routing.aux_loss).reshape(shape)

    def add_shared(self, x_TH: torch.Tensor, out_TH: torch.Tensor, aux_loss: torch.Tensor | None) -> torch.Tensor:
        """out_TH (the combined routed experts) + the gated shared expert of x_TH; attaches the balance
        loss's gradient. A method of its own: with a dispatcher that cannot be traced, the runtime
        compiles it apart from the exchange (runtime.distributed.compile)."""
        if self.shared_expert is not None:
            shared_TH = self.shared_expert(x_TH)
            if self.shared_expert_gate is not None:
                shared_TH = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared_TH
            out_TH = out_TH + shared_TH
        if aux_loss is not None:
            out_TH = _AttachAuxLoss.apply(out_TH, aux_loss, self.aux_grad_scale)
        return out_TH

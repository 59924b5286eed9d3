"""Top-k routers: token -> (expert ids, routing weights) and the load-balancing statistics.

Shapes: x_TH [T, H] tokens, logits_TE [T, E], topk_ids_Tk / topk_w_Tk [T, k].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe.dispatch.collectives import all_reduce_sum


@dataclass
class RouterOutput:
    topk_ids_Tk: torch.Tensor
    topk_w_Tk: torch.Tensor
    aux_loss: torch.Tensor | None  # Switch load-balancing loss of this layer, None when disabled


def switch_aux_loss(probs_TE: torch.Tensor, topk_ids_Tk: torch.Tensor, group=None) -> torch.Tensor:
    """Switch Transformer balance loss: E * sum_e f_e * P_e with f_e the top-k assignment share
    (sums to k, as transformers computes it) and P_e the mean router probability.

    With a data-parallel `group`, f_e and the token count are those of the global batch (one small
    all-reduce, no gradient needed) and P_e sums this rank's probabilities over the global count:
    the ranks' losses add up to the global-batch loss, and so do their gradients."""
    T, E = probs_TE.shape
    # One-hot sum instead of bincount: no host sync and a fixed shape for torch.compile.
    counts_E = F.one_hot(topk_ids_Tk.reshape(-1), E).sum(0).to(torch.float32)
    stats = torch.cat([counts_E, counts_E.new_tensor([T])])
    if group is not None:
        stats = all_reduce_sum(stats, group)
    counts_E, total_T = stats[:E], stats[E]
    return E * torch.sum(counts_E / total_T * probs_TE.sum(0) / total_T)


def balanced_ids(num_tokens: int, num_experts: int, top_k: int, device=None) -> torch.Tensor:
    """[T, k] expert ids independent of the router: token t's slot j gets (t + j * stride) % E with
    stride = E // k. The k ids of a token are distinct, every expert gets the same slot count when T is
    a multiple of E (within k otherwise), and a token's experts spread over all EP ranks."""
    stride = num_experts // top_k
    t = torch.arange(num_tokens, device=device).unsqueeze(1)
    j = torch.arange(top_k, device=device).unsqueeze(0)
    return (t + j * stride) % num_experts


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE router: softmax over all experts in fp32, top-k, optional renormalization.

    `force_balanced` (benchmarks only: it changes the model) picks the experts by `balanced_ids`
    instead of the top-k; the weights are still the router's probabilities at those ids, so the
    router keeps its gradient."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 aux_loss_coef: float = 0.0, force_balanced: bool = False, device=None, dtype=None):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.aux_loss_coef = aux_loss_coef
        self.force_balanced = force_balanced
        self.balance_group = None  # data-parallel group for a global-batch balance loss (set by the runtime)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if self.force_balanced:
            topk_ids_Tk = balanced_ids(probs_TE.shape[0], self.num_experts, self.top_k, probs_TE.device)
            topk_w_Tk = probs_TE.gather(1, topk_ids_Tk)
        else:
            topk_w_Tk, topk_ids_Tk = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_w_Tk = topk_w_Tk / topk_w_Tk.sum(dim=-1, keepdim=True)
        aux = None
        if self.aux_loss_coef > 0 and self.training:
            aux = self.aux_loss_coef * switch_aux_loss(probs_TE, topk_ids_Tk, self.balance_group)
        return RouterOutput(topk_ids_Tk, topk_w_Tk.to(x_TH.dtype), aux)

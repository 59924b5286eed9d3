"""Top-k routers: token -> (expert ids, routing weights) and the load-balancing statistics.

Shapes: x_TH [T, H] tokens, logits_TE [T, E], topk_ids_Tk / topk_w_Tk [T, k].

Aux-loss-free balancing (DeepSeek-V3): with `bias_update_rate` > 0 a per-expert bias is added to the
probabilities for the top-k choice only (the weights stay the unbiased probabilities). Training forwards
return their slot counts, which the MoE block adds to `expert_counts` (`record_counts`); once per optimizer
step the runtime sums them over the data ranks and calls `update_bias(global counts)`:
bias += rate * sign(mean count - count).
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
    counts_E: torch.Tensor | None = None  # slots per expert, for the bias balancing (training forwards only)


def expert_counts(topk_ids_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: the slots routed to each expert. A scatter-add, not bincount: no host sync and a fixed
    shape for torch.compile."""
    ids = topk_ids_Tk.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))


def switch_aux_loss(probs_TE: torch.Tensor, topk_ids_Tk: torch.Tensor, group=None,
                    counts_E: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer balance loss: E * sum_e f_e * P_e with f_e the top-k assignment share
    (sums to k, as transformers computes it) and P_e the mean router probability.

    With a data-parallel `group`, f_e and the token count are those of the global batch (one small
    all-reduce, no gradient needed) and P_e sums this rank's probabilities over the global count:
    the ranks' losses add up to the global-batch loss, and so do their gradients. `counts_E`: this
    rank's expert_counts of topk_ids_Tk when the caller has them."""
    T, E = probs_TE.shape
    counts_E = (expert_counts(topk_ids_Tk, E) if counts_E is None else counts_E).to(torch.float32)
    # T appended on the device: new_tensor([T]) copies from pageable host memory, which waits for the stream
    stats = F.pad(counts_E, (0, 1), value=T)
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


def _recomputing() -> bool:
    """Whether this eager forward is an activation checkpoint's recompute (it runs inside backward). A block
    compiled whole, checkpoint included, keeps its buffer updates out of its recompute, and dynamo must not
    trace the check."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE router: softmax over all experts in fp32, top-k, optional renormalization.

    `force_balanced` (benchmarks only: it changes the model) picks the experts by `balanced_ids`
    instead of the top-k; the weights are still the router's probabilities at those ids, so the
    router keeps its gradient. `bias_update_rate` > 0: aux-loss-free balancing (module docstring)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 aux_loss_coef: float = 0.0, force_balanced: bool = False, bias_update_rate: float = 0.0,
                 device=None, dtype=None):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.aux_loss_coef = aux_loss_coef
        self.force_balanced = force_balanced
        self.bias_update_rate = bias_update_rate
        if bias_update_rate > 0:
            # Persistent: checkpoints save and restore it. fp32 whatever the model dtype: it moves by rate steps.
            bias = torch.zeros(num_experts, device=device, dtype=torch.float32)
            self.register_buffer("e_score_correction_bias", bias)
            # The current step's slots per expert (this rank's tokens); the runtime reads and resets it.
            self.register_buffer("expert_counts", torch.zeros(num_experts, device=device, dtype=torch.int64),
                                 persistent=False)
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
        elif self.bias_update_rate > 0:
            topk_ids_Tk = torch.topk(probs_TE.detach() + self.e_score_correction_bias, self.top_k, dim=-1).indices
            topk_w_Tk = probs_TE.gather(1, topk_ids_Tk)
        else:
            topk_w_Tk, topk_ids_Tk = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_w_Tk = topk_w_Tk / topk_w_Tk.sum(dim=-1, keepdim=True)
        counts_E = None
        # Training forwards only (grad mode): eval batches must not move the bias.
        if self.bias_update_rate > 0 and self.training and torch.is_grad_enabled():
            counts_E = expert_counts(topk_ids_Tk, self.num_experts)
        aux = None
        if self.aux_loss_coef > 0 and self.training:
            aux = self.aux_loss_coef * switch_aux_loss(probs_TE, topk_ids_Tk, self.balance_group, counts_E)
        return RouterOutput(topk_ids_Tk, topk_w_Tk.to(x_TH.dtype), aux, counts_E)

    def record_counts(self, counts_E: torch.Tensor | None) -> None:
        """Adds a forward's `RouterOutput.counts_E` to this step's counts, once per micro-batch: not again in an
        activation checkpoint's recompute. Called by the MoE block, outside the router's compiled region (an
        eager checkpoint re-runs that region in its recompute)."""
        if counts_E is not None and not _recomputing():
            self.expert_counts.add_(counts_E)

    def reset_buffers(self, device) -> None:
        """Zero bias and counts on `device` (a meta model's buffers are left empty by materializing or
        loading; a checkpoint load then sets the bias)."""
        if self.bias_update_rate > 0:
            self.e_score_correction_bias = torch.zeros(self.num_experts, device=device, dtype=torch.float32)
            self.expert_counts = torch.zeros(self.num_experts, device=device, dtype=torch.int64)

    def take_counts(self) -> torch.Tensor:
        """This rank's slots per expert since the last call (int64 [E]); resets them."""
        counts = self.expert_counts.clone()
        self.expert_counts.zero_()
        return counts

    @torch.no_grad()
    def update_bias(self, global_counts_E: torch.Tensor, keep: torch.Tensor | float = 1.0) -> None:
        """bias += keep * rate * sign(mean - count) from the step's counts over all data ranks (the same on every
        rank, so the biases stay identical). `keep`: 0 for a step whose update was skipped (a device scalar
        the caller need not read)."""
        counts = global_counts_E.to(torch.float64)
        self.e_score_correction_bias.add_(self.bias_update_rate * torch.sign(counts.mean() - counts).float() * keep)

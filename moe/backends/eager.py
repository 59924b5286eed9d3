"""`eager` expert backend: a per-expert Python loop; the numerical reference for every other backend.

Sentinel-skip: only (row, slot) pairs with an expert id >= 0 are gathered and computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.device import compute_dtype
from moe.backends import EXPERT_BACKENDS


def lora_linear(x: torch.Tensor, w_OI: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None,
                scaling: float, dropout: float, training: bool) -> torch.Tensor:
    """x @ W^T (+ scaling * dropout(x) @ A^T @ B^T) for one expert."""
    y = F.linear(x, w_OI)
    if lora is not None:
        A_rI, B_Or = lora
        x_lora = F.dropout(x, dropout, training) if dropout > 0 else x
        y = y + scaling * F.linear(F.linear(x_lora, A_rI), B_Or)
    return y


def expert_forward(experts, e: int, x_NH: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP of local expert `e` on the rows x_NH."""
    def lora(proj: str):
        factors = experts.lora(proj)
        return None if factors is None else (factors.A_ErI[e], factors.B_EOr[e])
    def weight(proj: str):  # packed FP4 weights: only this expert is dequantized
        return experts.dense_weight(proj, torch.tensor([e], device=x_NH.device), x_NH.dtype)[0]
    args = (experts.lora_scaling, experts.lora_dropout, experts.training)
    gate_up_N2I = lora_linear(x_NH, weight("gate_up"), lora("gate_up"), *args)
    gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
    return lora_linear(F.silu(gate_NI) * up_NI, weight("down"), lora("down"), *args)


@EXPERT_BACKENDS.register("eager")
def eager_backend(x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                  experts, valid_slots: int | None = None, bound=None) -> torch.Tensor:
    # Under autocast the expert outputs come out in the compute dtype, not the fp32 stream's.
    y_MH = torch.zeros_like(x_MH, dtype=compute_dtype(x_MH))
    for e in range(experts.num_experts):
        rows_N, slots_N = torch.nonzero(expert_ids_Mk == e, as_tuple=True)  # host sync: reference only
        if rows_N.numel() == 0:
            continue
        out_NH = expert_forward(experts, e, x_MH[rows_N])
        w_N1 = weights_Mk[rows_N, slots_N].unsqueeze(-1).to(out_NH.dtype)
        y_MH = y_MH.index_add(0, rows_N, out_NH * w_N1)
    return y_MH

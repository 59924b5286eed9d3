"""`grouped_mm` expert backend: expert-sorted rows through torch._grouped_mm (one GEMM launch per
projection for all experts), LoRA as two rank-sized grouped products.

Sentinel-skip: only slots with id >= 0 are gathered; -1 slots never reach a GEMM. Where
torch._grouped_mm cannot run (CUDA below sm90, non-bf16 on CUDA, unaligned strides) the same sorted
layout goes through a per-expert loop, logged once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from moe.backends import register_backend

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _grouped_mm_supported(x: torch.Tensor, *dims: int) -> str | None:
    """None when torch._grouped_mm can run these operands, else the reason."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return "torch._grouped_mm needs sm90+"
        if x.dtype != torch.bfloat16:
            return f"torch._grouped_mm on CUDA needs bfloat16, got {x.dtype}"
    elif x.device.type != "cpu":
        return f"no torch._grouped_mm on {x.device.type}"
    if any(d * x.element_size() % 16 for d in dims):
        return f"dims {dims} are not 16-byte aligned"
    return None


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("grouped_mm backend falls back to a per-expert loop: %s", reason)


def grouped_linear(x_NI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor,
                   fallback: bool) -> torch.Tensor:
    """Rows x_NI sorted by expert (group e ends at offs_E[e]) times w_EOI[e]^T."""
    if not fallback:
        return torch._grouped_mm(x_NI, w_EOI.transpose(-2, -1), offs=offs_E)
    ends = offs_E.tolist()  # host sync: fallback path only
    starts = [0] + ends[:-1]
    return torch.cat([x_NI[s:e] @ w_EOI[i].T for i, (s, e) in enumerate(zip(starts, ends))])


def _lora_grouped_linear(x_NI, w_EOI, lora, scaling, dropout, training, offs_E, fallback):
    # torch._grouped_mm has no autocast rule: operands take the activations' dtype explicitly.
    y_NO = grouped_linear(x_NI, w_EOI.to(x_NI.dtype), offs_E, fallback)
    if lora is not None:
        A_ErI, B_EOr = lora
        x_lora = F.dropout(x_NI, dropout, training) if dropout > 0 else x_NI
        xa_Nr = grouped_linear(x_lora, A_ErI.to(x_NI.dtype), offs_E, fallback)
        y_NO = y_NO + scaling * grouped_linear(xa_Nr, B_EOr.to(x_NI.dtype), offs_E, fallback)
    return y_NO


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (the fp32 residual stream enters the experts), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def sort_valid_slots(expert_ids_Mk: torch.Tensor, num_experts: int):
    """Flat slot order sorted by expert with -1 slots dropped, and the per-expert end offsets."""
    ids_S = expert_ids_Mk.reshape(-1)
    # -1 sorts last as `num_experts`; stable so rows of one expert keep their token order.
    keys_S = torch.where(ids_S < 0, num_experts, ids_S)
    order_S = torch.sort(keys_S, stable=True).indices
    counts = torch.bincount(keys_S, minlength=num_experts + 1)
    offs_E = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    num_valid = int(offs_E[-1])  # host sync: the one per layer; sizes the gathered rows
    return order_S[:num_valid], offs_E


@register_backend("grouped_mm")
def grouped_mm_backend(x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                       experts) -> torch.Tensor:
    M, k = expert_ids_Mk.shape
    slots_N, offs_E = sort_valid_slots(expert_ids_Mk, experts.num_experts)
    rows_N = slots_N // k
    x_NH = x_MH.index_select(0, rows_N).to(compute_dtype(x_MH))
    lora_dims = (experts.lora_rank,) if experts.has_lora else ()
    reason = _grouped_mm_supported(x_NH, experts.hidden, 2 * experts.intermediate, experts.intermediate,
                                   *lora_dims)
    if reason:
        _warn_once(reason)
    lora_args = (experts.lora_scaling, experts.lora_dropout, experts.training, offs_E, reason is not None)
    gate_up_N2I = _lora_grouped_linear(x_NH, experts.gate_up, experts.lora_params("gate_up"), *lora_args)
    gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
    out_NH = _lora_grouped_linear(F.silu(gate_NI) * up_NI, experts.down, experts.lora_params("down"),
                                  *lora_args)
    w_N1 = weights_Mk.reshape(-1).index_select(0, slots_N).unsqueeze(-1).to(out_NH.dtype)
    return torch.zeros_like(x_MH).index_add(0, rows_N, (out_NH * w_N1).to(x_MH.dtype))

"""`grouped_mm` expert backend: expert-sorted rows through torch._grouped_mm (one GEMM launch per
projection for all experts), LoRA as two rank-sized grouped products.

Sentinel-skip: slots are sorted by expert with -1 slots last; the grouped GEMMs end at the last
valid slot, so no -1 row is ever computed. Eager runs read the valid count (one host sync per layer)
and gather only valid rows. Under torch.compile there is no sync and no data-dependent shape: the
buffers hold all M*k slots, their tail is never written by a GEMM, and torch.where sets it to 0 on
the input and on every GEMM output so that nothing unwritten reaches a result or a gradient. Where
torch._grouped_mm cannot run (CUDA below sm90, non-bf16 on CUDA, unaligned strides) the same sorted
layout goes through a per-expert loop, logged once.

Packed FP4 base weights (quant.FP4Weight, frozen) are dequantized per call, only for the experts that
received rows, in the forward and again in the backward (nothing dequantized is kept between them);
this reference path needs the eager mode's valid count, so it does not run under torch.compile.
FP8 base weights (quant.FP8Weight, frozen) run on FP8 GEMMs (quant.fp8_base), also under torch.compile;
experts.fp8_training runs the trainable base GEMMs, forward and both backward ones, in FP8 (quant.fp8_training).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from gpu.device import compute_dtype
from moe.backends import EXPERT_BACKENDS
from quant import FP8Weight, QuantizedWeight
from quant.fp8_base import fp8_base_grouped_linear
from quant.fp8_training import fp8_grouped_linear

log = logging.getLogger(__name__)
_warned: set[str] = set()


@torch._dynamo.assume_constant_result
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _grouped_mm_supported(x: torch.Tensor, *dims: int) -> str | None:
    """None when torch._grouped_mm can run these operands, else the reason."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if x.is_cuda:
        if _cuda_capability(x.device.index or 0) < (9, 0):
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
    """Rows x_NI sorted by expert (group e ends at offs_E[e]) times w_EOI[e]^T; rows past the last
    group are left unwritten."""
    if not fallback:
        return torch._grouped_mm(x_NI, w_EOI.transpose(-2, -1), offs=offs_E)
    ends = offs_E.tolist()  # host sync: fallback path only
    starts = [0] + ends[:-1]
    out = x_NI.new_zeros(x_NI.shape[0], w_EOI.shape[1])
    for i, (s, e) in enumerate(zip(starts, ends)):
        out[s:e] = x_NI[s:e] @ w_EOI[i].T
    return out


class _PackedGroupedLinear(torch.autograd.Function):
    """grouped_linear with a frozen FP4 weight, dequantized: the gradient flows to x only."""

    @staticmethod
    def forward(ctx, x_NI, offs_E, weight: QuantizedWeight, fallback: bool):
        ctx.save_for_backward(offs_E)
        ctx.weight, ctx.fallback = weight, fallback
        return _packed_linear(x_NI, offs_E, weight, fallback, transposed=False)

    @staticmethod
    def backward(ctx, dy_NO):
        (offs_E,) = ctx.saved_tensors
        return _packed_linear(dy_NO, offs_E, ctx.weight, ctx.fallback, transposed=True), None, None, None


def _packed_linear(x_NI, offs_E, weight: QuantizedWeight, fallback: bool, transposed: bool) -> torch.Tensor:
    """x @ W_e^T (or x @ W_e when transposed) with only the experts that have rows dequantized: the
    groups of the others are empty, so dropping their offsets leaves every row in its expert's group."""
    counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    active = torch.nonzero(counts_E).squeeze(1)  # host sync: eager mode only
    w_EOI = weight.dequantize(x_NI.dtype, active)
    return grouped_linear(x_NI, w_EOI.transpose(1, 2) if transposed else w_EOI, offs_E[active], fallback)


def _base_linear(x_NI, w_EOI, offs_E, fallback, fp8: bool) -> torch.Tensor:
    if fp8:  # FP8 training: quantized from the master weight as it is
        return fp8_grouped_linear(x_NI, w_EOI, offs_E)
    if isinstance(w_EOI, FP8Weight):
        return fp8_base_grouped_linear(x_NI, w_EOI, offs_E)
    if isinstance(w_EOI, QuantizedWeight):
        if torch.compiler.is_compiling():
            raise NotImplementedError("the grouped_mm backend dequantizes FP4 experts selectively, which needs "
                                      "eager mode; under torch.compile use the scattermoe backend")
        return _PackedGroupedLinear.apply(x_NI, offs_E, w_EOI, fallback)
    # torch._grouped_mm has no autocast rule: operands take the activations' dtype explicitly.
    return grouped_linear(x_NI, w_EOI.to(x_NI.dtype), offs_E, fallback)


def _keep_valid(t_NF: torch.Tensor, valid_N1: torch.Tensor | None) -> torch.Tensor:
    """Sets the unwritten -1 rows to 0 (compiled layout); no-op when only valid rows were gathered."""
    return t_NF if valid_N1 is None else torch.where(valid_N1, t_NF, 0)


def _lora_grouped_linear(x_NI, w_EOI, lora, scaling, dropout, training, offs_E, valid_N1, fallback, fp8):
    """Grouped x W^T (+ LoRA); in the compiled layout the unwritten -1 rows are zeroed so that no
    inf/NaN from them can reach any product or gradient (the GEMMs' backward may mix all rows)."""
    y_NO = _base_linear(x_NI, w_EOI, offs_E, fallback, fp8)
    if lora is not None:
        A_ErI, B_EOr = lora
        x_lora = F.dropout(x_NI, dropout, training) if dropout > 0 else x_NI
        xa_Nr = _keep_valid(grouped_linear(x_lora, A_ErI.to(x_NI.dtype), offs_E, fallback), valid_N1)
        y_NO = y_NO + scaling * grouped_linear(xa_Nr, B_EOr.to(x_NI.dtype), offs_E, fallback)
    return _keep_valid(y_NO, valid_N1)


def sort_slots(expert_ids_Mk: torch.Tensor, num_experts: int):
    """Flat slot order sorted by expert (-1 slots last), per-expert end offsets, and which sorted
    slots are valid. No host sync."""
    ids_S = expert_ids_Mk.reshape(-1)
    # -1 sorts last as `num_experts`; stable so rows of one expert keep their token order.
    keys_S = torch.where(ids_S < 0, num_experts, ids_S)
    order_S = torch.sort(keys_S, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids_S.device)
    counts.scatter_add_(0, keys_S, torch.ones_like(keys_S))
    offs_E = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    return order_S, offs_E, keys_S[order_S] < num_experts


@EXPERT_BACKENDS.register("grouped_mm")
def grouped_mm_backend(x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                       experts, valid_slots: int | None = None, bound=None) -> torch.Tensor:
    k = expert_ids_Mk.shape[1]
    slots_N, offs_E, valid_N = sort_slots(expert_ids_Mk, experts.num_experts)
    if torch.compiler.is_compiling():
        valid_N1 = valid_N.unsqueeze(-1)
    else:  # the valid-slot count from the dispatcher, else from the device (a host sync)
        slots_N, valid_N1 = slots_N[:valid_slots if valid_slots is not None else int(offs_E[-1])], None
    rows_N = slots_N // k
    # Also on the input: the GEMM backward leaves dx of the -1 rows unwritten, and this where's
    # backward keeps those rows out of dx_MH.
    x_NH = _keep_valid(x_MH.index_select(0, rows_N), valid_N1).to(compute_dtype(x_MH))
    lora_dims = (experts.lora_rank,) if experts.has_lora else ()
    reason = _grouped_mm_supported(x_NH, experts.hidden, 2 * experts.intermediate, experts.intermediate,
                                   *lora_dims)
    if reason and not torch.compiler.is_compiling():  # logging does not trace: the eager calls warn
        _warn_once(reason)
    lora_args = (experts.lora_scaling, experts.lora_dropout, experts.training, offs_E, valid_N1, reason is not None,
                 experts.fp8_training)
    gate_up_N2I = _lora_grouped_linear(x_NH, experts.base_weight("gate_up"), experts.lora("gate_up"), *lora_args)
    gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
    out_NH = _lora_grouped_linear(F.silu(gate_NI) * up_NI, experts.base_weight("down"), experts.lora("down"),
                                  *lora_args)
    w_N1 = weights_Mk.reshape(-1).index_select(0, slots_N).unsqueeze(-1).to(out_NH.dtype)
    return torch.zeros_like(x_MH).index_add(0, rows_N, (out_NH * w_N1).to(x_MH.dtype))

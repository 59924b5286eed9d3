"""`scattermoe` expert backend: ScatterMoE-style Triton kernels with fused LoRA and sentinel-skip.

    y_MH = expert_backend("scattermoe")(x_MH, expert_ids_Mk, weights_Mk, experts, valid_slots=None, bound=None)

Shapes: M routed rows, k slots, E local experts, H hidden, I intermediate, r LoRA rank, S the rows of the
expert-sorted buffers below: the valid slots when the caller passes their number (valid_slots: the EP
dispatchers know it on the host; at ep=4 with k=8 about 28% of the M*k slots are valid), else a SlotCapacity
bound's rows (the all_gather dispatcher's: valid slots past it are dropped and counted, moe.capacity),
else M*k.
Weights are read in the GroupedExperts layout through strides (gate_up [E, 2I, H], down [E, H, I],
A [E, r, in], B [E, out, r]); the backward's transposes are views, never copies.

Forward (valid slots only, expert-sorted; -1 slots are never sorted into a segment nor computed):
    gate_up, hw = SwiGLU(gather(x) @ W_gu^T + s (x A_gu^T) B_gu^T)     one kernel, [S, 2I] and [S, I]
                  (hw = w * h: the routing weight of the slot is applied in the SwiGLU epilogue)
    z' = hw @ W_down^T + s (hw A_down^T) B_down^T  (= w z)             [S, H]
    y[m] = sum_j z'[pos(m, j)]                                          combine, skipping -1 slots
Backward (dyg = dy gathered into expert-sorted order, only when dW_down is needed):
    g = dy[token] @ W_down + s (dy[token] B_down) A_down   grouped GEMM, split LoRA (reads dyg, or
                                                            gathers dy's rows in-kernel)
    d gate_up = SwiGLU'(w g), dw = <g, h>, d gate_up B_gu  one pass over each row block (swiglu_backward)
    dx[m] = sum_j d gate_up[pos] @ W_gu + s (d gate_up B_gu) A_gu                     GEMM + combine
    dW_gu = d gate_up^T x[token], dW_down = dyg^T hw: per-expert reductions over the rows, by
    torch._grouped_mm (CUTLASS, K-grouped) on sm90+ bf16, else grouped_xty;
    dA, dB: one lora_factor_grads launch over the [S, r] intermediates x A^T, hw A^T, dy B, d gate_up B
    and the rows of x, hw, dy and d gate_up (x and dy gathered in-kernel; no routing weights anywhere:
    they are inside hw). dW is skipped for a frozen base weight.
The bare GEMMs without LoRA or epilogue (down and dx of a full fine-tune, g) run on torch._grouped_mm
(CUTLASS) or our grouped kernel, whichever was measured faster on the device (grouped_linear.expert_gemm).
Eager calls go through an autograd.Function (least host time); under torch.compile the sort, the
forward and the backward are the custom ops moert::scattermoe_{sort,fwd,bwd}, which the fullgraph
trace keeps whole.
LoRA through the rank is split (`_split_lora`): the rank-sized intermediate is computed by its own
grouped product and its product with B joins the base GEMM's accumulator after the K loop, so the
base K loop runs with its own registers (the fused gate_up measured slower at Qwen3-30B-A3B shapes:
docs/benchmarks.md#expert-layer). Only small experts (out*in < 1M, where launches dominate) fuse it
into the K loop. lora_dropout > 0 in training raises NotImplementedError (use the eager backend for it).
fp32 operands: every Triton dot runs in IEEE fp32 unless torch allows TF32 for fp32 matmuls
(moe/kernels/precision.py); torch._grouped_mm is used for bf16 only (cutlass_ok), never for fp32.
FP4-packed base weights (quant.FP4Weight, frozen) enter as moe.kernels.fp4.PackedWeight views: every GEMM
that reads them (gate_up, down, g, dx) decodes them tile by tile in its K loop (the backward reads the
transposed view); nothing dequantized is ever materialized, and no dW is computed for them. (Dequantizing
chunks of experts into a reused buffer for the dense kernels measured slower: docs/benchmarks.md#fp4-experts.)
FP8 base weights (quant.FP8Weight, frozen) enter as moe.kernels.fp8.FP8View views: every GEMM that reads them
runs on fp8 operands, the activations (forward) or the weight-scaled dy / d gate_up rows (g, dx) quantized
rowwise per launch (moe/kernels/fp8.py); their LoRA takes the split path.
FP8 training (experts.fp8_training, quant.train_fp8; eager only), quant.fp8_training's math on these kernels:
the forward quantizes each master weight per (expert, output row) along I and runs it as an FP8View; g and dx
read W^T quantized along O per (expert, input column), its codes stored O-innermost and read as a plain FP8View
(the rule of quant.fp8_training._grad_input: K-major codes, dy / d gate_up quantized rowwise in token layout,
gathered in-kernel); dW_gu and dW_down run grouped_xty_fp8 (both operands per (expert, column) along the
expert's rows). The backward re-quantizes W from the saved master weight: its axis differs from the forward's,
so the forward's codes could not serve, and nothing quantized outlives a GEMM (the weight is never held twice).
dW is returned in the master weight's dtype (fp32 or bf16 masters, quantized as they are).
"""

from __future__ import annotations

import torch

from gpu.device import compute_dtype
from moe.backends import EXPERT_BACKENDS
from moe.kernels.fp4 import PackedWeight
from moe.kernels.fp8 import FP8View
from moe.kernels.grouped_linear import (
    LoraView,
    cutlass_ok,
    expert_linear,
    gate_up_swiglu,
    swiglu_backward,
)
from moe.kernels.grouped_xty import FactorGrad, grouped_xty, grouped_xty_fp8, lora_factor_grads
from moe.kernels.routing import (
    SlotCapacity,
    SlotOrder,
    combine,
    gather_rows,
    slot_capacity,
    sort_slots,
)
from quant import FP4Weight, FP8Weight, QuantizedWeight
from quant.fp8 import quantize_rows
from quant.fp8_training import quantize_transposed

_SPLIT_MIN_WEIGHT_ELEMS = 1_000_000
# The kernels' views of frozen quantized base weights (not tensors: they travel on ctx, not in saved tensors).
_VIEWS = (PackedWeight, FP8View)


def _split_lora(num_experts: int, out_features: int, in_features: int) -> bool:
    """Split unless the experts are small: the fused rank product costs registers and shared memory in
    the K loop (smaller tiles), more than the separate [S, r] pass costs."""
    return out_features * in_features >= _SPLIT_MIN_WEIGHT_ELEMS


def _weight_grad(L_SP: torch.Tensor, R_SQ: torch.Tensor, slots: SlotOrder,
                 fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[E, P, Q]: out[e] = sum over expert e's rows of L[p]^T R[p], both operands expert-sorted; fp8_dtype
    given (FP8 training: the master weight's dtype), on FP8 operands (grouped_xty_fp8) in that dtype.

    On sm90+ bf16: torch._grouped_mm grouped along the rows (CUTLASS, faster than grouped_xty there:
    docs/benchmarks.md#expert-layer); groups end at the last valid row, so the -1 rows are
    not read, and experts without rows get zeros.
    """
    if fp8_dtype is not None:
        return grouped_xty_fp8(L_SP, R_SQ, slots, fp8_dtype)
    if cutlass_ok(L_SP, R_SQ):
        return torch._grouped_mm(L_SP.t(), R_SQ, offs=slots.offsets_E1[1:])
    return grouped_xty(L_SP, R_SQ, slots, gather_l=False, gather_r=False)


def _lora(A_ErK, B_ENr, scaling: float) -> LoraView | None:
    if A_ErK is None:
        return None
    E, N, K = A_ErK.shape[0], B_ENr.shape[1], A_ErK.shape[2]
    return LoraView(A_ErK, B_ENr, scaling, _split_lora(E, N, K))


_GRAD_NAMES = ("x", "w", "gu", "down", "gu_A", "gu_B", "down_A", "down_B")


def _forward(x_MH, weights_Mk, w_gu_E2IH, w_down_EHI, gu_A_ErH, gu_B_E2Ir, down_A_ErI, down_B_EHr,
             slots: SlotOrder, scaling: float):
    """y [M, H] and what the backward needs: gate_up [S, 2I], hw [S, I], x A_gu^T and hw A_down^T [S, r]."""
    gu_S2I, hw_SI, xa_Sr = gate_up_swiglu(x_MH, slots, w_gu_E2IH, _lora(gu_A_ErH, gu_B_E2Ir, scaling), weights_Mk)
    z_SH, hwa_Sr = expert_linear(hw_SI, slots, w_down_EHI, _lora(down_A_ErI, down_B_EHr, scaling), gather=False)
    return combine(z_SH, slots, None), gu_S2I, hw_SI, xa_Sr, hwa_Sr


def _backward(dy_MH, saved: tuple, slots: SlotOrder, s: float, needs: tuple[bool, ...], fp8: bool = False) -> tuple:
    """The gradients of (x, weights, gate_up, down, gate_up A/B, down A/B); None where not needed. fp8: the
    base weights are FP8 training's master weights (_fp8_backward_view, dW by grouped_xty_fp8)."""
    x_MH, weights_Mk, w_gu, w_down, gu_A, gu_B, down_A, down_B, gu_S2I, hw_SI, xa_Sr, hwa_Sr = saved
    need = dict(zip(_GRAD_NAMES, needs))
    transposed = _fp8_backward_view if fp8 else _transposed
    has_lora = gu_A is not None
    # The down projection read backwards: A := B_down^T [E, r, H], B := A_down^T [E, I, r].
    down_T = _lora(down_B.transpose(1, 2), down_A.transpose(1, 2), s) if has_lora else None
    w_down_T = transposed(w_down)
    # dy in expert-sorted order only for dW_down (CUTLASS cannot gather); then g and dB_down read it too.
    # Otherwise they gather dy's rows in-kernel (dy fits in L2; the [S, H] copy is never written).
    dyg_SH = gather_rows(dy_MH, slots) if need["down"] else None
    dy_rows, gather_dy = (dy_MH, True) if dyg_SH is None else (dyg_SH, False)
    # g = dy W_down + s (dy B_down) A_down; dy B_down is kept (it feeds dA_down)
    g_SI, dyb_Sr = expert_linear(dy_rows, slots, w_down_T, down_T, gather=gather_dy)
    dgu_S2I, dgub_Sr, dw_Mk = swiglu_backward(g_SI, slots, gu_S2I, weights_Mk, gu_B if has_lora else None)
    # Each [S, *] intermediate is dropped once read, and what reads dy runs first, so that the peak holds
    # only buffers still to be read (a Python local would live to the end of the backward).
    del g_SI
    grads = dict.fromkeys(need)
    grads["w"] = dw_Mk.to(weights_Mk.dtype) if need["w"] else None
    if need["down"]:
        grads["down"] = _weight_grad(dyg_SH, hw_SI, slots, w_down.dtype if fp8 else None)
    if has_lora:  # the four factor gradients (those needed) in one launch
        factor_grads = {"gu_A": FactorGrad(dgub_Sr, x_MH, gather_r=True),
                        "gu_B": FactorGrad(xa_Sr, dgu_S2I, transposed=True),
                        "down_A": FactorGrad(dyb_Sr, hw_SI),
                        "down_B": FactorGrad(hwa_Sr, dy_rows, gather_r=gather_dy, transposed=True)}
        wanted = [problem if need[name] else None for name, problem in factor_grads.items()]
        grads.update(zip(factor_grads, lora_factor_grads(wanted, slots, s)))
        del factor_grads, wanted
    del dyg_SH, dy_rows
    if need["x"]:
        gu_T = _lora(gu_B.transpose(1, 2), gu_A.transpose(1, 2), s) if has_lora else None
        dxs_SH, _ = expert_linear(dgu_S2I, slots, transposed(w_gu), gu_T, gather=False, ia_Sr=dgub_Sr)
        grads["x"] = combine(dxs_SH, slots, None)
        del dxs_SH
    if need["gu"]:
        grads["gu"] = _weight_grad(dgu_S2I, gather_rows(x_MH, slots), slots, w_gu.dtype if fp8 else None)
    return tuple(grads.values())


def _transposed(w: torch.Tensor | PackedWeight | FP8View) -> torch.Tensor | PackedWeight | FP8View:
    """[E, N, K] -> [E, K, N] as a view (a packed or FP8 weight flips its read order)."""
    return w.t() if isinstance(w, _VIEWS) else w.transpose(1, 2)


def _fp8_forward_view(w_EOI: torch.Tensor) -> FP8View:
    """FP8 training's forward weight: the master quantized per (expert, output row) along I, as it is."""
    return FP8View(*quantize_rows(w_EOI.contiguous()))


def _fp8_backward_view(w_EOI: torch.Tensor) -> FP8View:
    """W^T [E, I, O] for g and dx: quantized along O per (expert, input column), the codes copied O-innermost
    (K-major for the MMA) and read as a plain FP8 weight, whose scales sit on its output rows."""
    return FP8View(*quantize_transposed(w_EOI))


def _tensors_only(w_gu, w_down) -> tuple:
    """What save_for_backward can hold: a quantized weight's view travels on ctx instead (None in its slot)."""
    return tuple(None if isinstance(w, _VIEWS) else w for w in (w_gu, w_down))


def _restore(saved: tuple, packed: tuple) -> tuple:
    """saved tensors with the packed weights put back in their slots (2 and 3)."""
    w_gu, w_down = (p if p is not None else t for p, t in zip(packed, saved[2:4]))
    return (*saved[:2], w_gu, w_down, *saved[4:])


class _ScatterMoE(torch.autograd.Function):
    """The eager path: the least host time per call (no custom-op dispatch)."""

    @staticmethod
    def forward(ctx, x_MH, weights_Mk, w_gu, w_down, gu_A, gu_B, down_A, down_B, slots: SlotOrder,
                scaling: float, fp8: bool):
        # FP8 training: the quantized forward weights live for this call only (the backward re-quantizes)
        w_fwd = (_fp8_forward_view(w) for w in (w_gu, w_down)) if fp8 else (w_gu, w_down)
        y_MH, *activations = _forward(x_MH, weights_Mk, *w_fwd, gu_A, gu_B, down_A, down_B, slots, scaling)
        ctx.save_for_backward(x_MH, weights_Mk, *_tensors_only(w_gu, w_down), gu_A, gu_B, down_A, down_B,
                              *activations)
        ctx.packed = tuple(w if isinstance(w, _VIEWS) else None for w in (w_gu, w_down))
        ctx.slots, ctx.scaling, ctx.fp8 = slots, scaling, fp8
        return y_MH

    @staticmethod
    def backward(ctx, dy_MH):
        saved = _restore(ctx.saved_tensors, ctx.packed)
        grads = _backward(dy_MH, saved, ctx.slots, ctx.scaling, ctx.needs_input_grad[:8], ctx.fp8)
        return (*grads, None, None, None)


# ----------------------------------------------------------------------------- opaque ops (torch.compile)
# Under torch.compile the same computation runs as three custom ops the trace keeps whole (the Triton
# launches inside are invisible to it): the sort, the forward (y plus the saved activations as outputs)
# and the backward (a gradient, or an empty tensor where none is needed). A packed FP4 weight enters as
# its codes (in the weight's slot), block scales and tensor scales, an FP8 one as its e4m3 codes and row scales
# (no tensor scales), with `fmt` naming the format ("" dense).


def _slots_of(ids_Mk: torch.Tensor, num_experts: int, order_S, inv_S, offsets_E1, rows_S, capacity: int) -> SlotOrder:
    return SlotOrder(order_S=order_S, inv_S=inv_S, offsets_E1=offsets_E1, ids_S=ids_Mk.contiguous().view(-1),
                     topk=ids_Mk.shape[1], num_experts=num_experts, rows_S=rows_S, capacity=capacity)


def _weight(w: torch.Tensor, scale: torch.Tensor | None, tensor_scale: torch.Tensor | None,
            fmt: str) -> torch.Tensor | PackedWeight | FP8View:
    if fmt == "fp8":
        return FP8View(w, scale)
    return PackedWeight(w, scale, tensor_scale, fmt) if fmt else w


def _weight_parts(w: torch.Tensor | PackedWeight | FP8View) -> tuple:
    """(weight or codes, block or row scales, tensor scales) of an operand, for the ops' flat signatures."""
    if isinstance(w, FP8View):
        return w.codes, w.scales, None
    if isinstance(w, PackedWeight):
        return w.qdata, w.scale, w.tensor_scale
    return w, None, None


def _op_format(w_gu, w_down) -> str:
    """The ops' one format string: "" (both dense) or the format both weights are quantized in."""
    formats = {w.fmt if isinstance(w, _VIEWS) else "" for w in (w_gu, w_down)}
    if len(formats) > 1:
        raise NotImplementedError(f"scattermoe under torch.compile: gate_up and down base weights in different "
                                  f"formats ({sorted(formats)}); quantize both (quant.quantize_experts) or neither")
    return formats.pop()


@torch.library.custom_op("moert::scattermoe_sort", mutates_args=("dropped",))
def _sort_op(ids_Mk: torch.Tensor, num_experts: int, capacity: int, dropped: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sort_slots; with `dropped` (a SlotCapacity's counter) the valid slots past `capacity` are dropped."""
    slots = sort_slots(ids_Mk, num_experts, bound=None if dropped is None else SlotCapacity(capacity, dropped))
    return slots.order_S, slots.inv_S, slots.offsets_E1, slots.rows_S


@_sort_op.register_fake
def _(ids_Mk, num_experts, capacity, dropped):
    S = ids_Mk.numel()
    def new(n):
        return ids_Mk.new_empty(n, dtype=torch.int32)
    return new(S), new(S), new(num_experts + 1), new(S)


def _rank_sized(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("moert::scattermoe_fwd", mutates_args=())
def _fwd_op(x_MH: torch.Tensor, weights_Mk: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor,
            gu_A: torch.Tensor | None, gu_B: torch.Tensor | None, down_A: torch.Tensor | None,
            down_B: torch.Tensor | None, gu_scale: torch.Tensor | None, gu_tscale: torch.Tensor | None,
            down_scale: torch.Tensor | None, down_tscale: torch.Tensor | None, ids_Mk: torch.Tensor,
            order_S: torch.Tensor, inv_S: torch.Tensor, offsets_E1: torch.Tensor, rows_S: torch.Tensor,
            capacity: int, scaling: float, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    slots = _slots_of(ids_Mk, w_gu.shape[0], order_S, inv_S, offsets_E1, rows_S, capacity)
    y_MH, gu_S2I, hw_SI, xa_Sr, hwa_Sr = _forward(x_MH, weights_Mk, _weight(w_gu, gu_scale, gu_tscale, fmt),
                                                  _weight(w_down, down_scale, down_tscale, fmt), gu_A, gu_B,
                                                  down_A, down_B, slots, scaling)
    return y_MH, gu_S2I, hw_SI, _rank_sized(xa_Sr, x_MH), _rank_sized(hwa_Sr, x_MH)


@_fwd_op.register_fake
def _(x_MH, weights_Mk, w_gu, w_down, gu_A, gu_B, down_A, down_B, gu_scale, gu_tscale, down_scale, down_tscale,
      ids_Mk, order_S, inv_S, offsets_E1, rows_S, capacity, scaling, fmt):
    S, I2 = capacity, w_gu.shape[1]  # dim 1 is the output dim, packed or not
    r_shape = (S, gu_A.shape[1]) if gu_A is not None else (0,)
    return (x_MH.new_empty(x_MH.shape), x_MH.new_empty(S, I2), x_MH.new_empty(S, I2 // 2),
            x_MH.new_empty(r_shape), x_MH.new_empty(r_shape))


@torch.library.custom_op("moert::scattermoe_bwd", mutates_args=())
def _bwd_op(dy_MH: torch.Tensor, x_MH: torch.Tensor, weights_Mk: torch.Tensor, w_gu: torch.Tensor,
            w_down: torch.Tensor, gu_A: torch.Tensor | None, gu_B: torch.Tensor | None,
            down_A: torch.Tensor | None, down_B: torch.Tensor | None, gu_scale: torch.Tensor | None,
            gu_tscale: torch.Tensor | None, down_scale: torch.Tensor | None, down_tscale: torch.Tensor | None,
            gu_S2I: torch.Tensor, hw_SI: torch.Tensor, xa_Sr: torch.Tensor, hwa_Sr: torch.Tensor,
            ids_Mk: torch.Tensor, order_S: torch.Tensor, inv_S: torch.Tensor, offsets_E1: torch.Tensor,
            rows_S: torch.Tensor, capacity: int, scaling: float, fmt: str, needs: list[bool]) -> list[torch.Tensor]:
    slots = _slots_of(ids_Mk, w_gu.shape[0], order_S, inv_S, offsets_E1, rows_S, capacity)
    saved = (x_MH, weights_Mk, _weight(w_gu, gu_scale, gu_tscale, fmt), _weight(w_down, down_scale, down_tscale, fmt),
             gu_A, gu_B, down_A, down_B, gu_S2I, hw_SI, xa_Sr, hwa_Sr)
    grads = _backward(dy_MH, saved, slots, scaling, tuple(needs))
    return [g if g is not None else x_MH.new_empty(0) for g in grads]


@_bwd_op.register_fake
def _(dy_MH, x_MH, weights_Mk, w_gu, w_down, gu_A, gu_B, down_A, down_B, gu_scale, gu_tscale, down_scale,
      down_tscale, gu_S2I, hw_SI, xa_Sr, hwa_Sr, ids_Mk, order_S, inv_S, offsets_E1, rows_S, capacity, scaling, fmt,
      needs):
    inputs = (x_MH, weights_Mk, w_gu, w_down, gu_A, gu_B, down_A, down_B)
    return [t.new_empty(t.shape) if need and t is not None else x_MH.new_empty(0)
            for t, need in zip(inputs, needs)]


def _setup_context(ctx, inputs, output):
    (x_MH, weights_Mk, w_gu, w_down, gu_A, gu_B, down_A, down_B, gu_scale, gu_tscale, down_scale, down_tscale,
     ids_Mk, order_S, inv_S, offsets_E1, rows_S, capacity, scaling, fmt) = inputs
    _, gu_S2I, hw_SI, xa_Sr, hwa_Sr = output
    ctx.save_for_backward(x_MH, weights_Mk, w_gu, w_down, gu_A, gu_B, down_A, down_B, gu_scale, gu_tscale,
                          down_scale, down_tscale, gu_S2I, hw_SI, xa_Sr, hwa_Sr, ids_Mk, order_S, inv_S,
                          offsets_E1, rows_S)
    ctx.capacity, ctx.scaling, ctx.fmt = capacity, scaling, fmt


def _op_backward(ctx, dy_MH, *_unused_activation_grads):
    needs = [bool(n) for n in ctx.needs_input_grad[:8]]
    grads = torch.ops.moert.scattermoe_bwd(dy_MH, *ctx.saved_tensors, ctx.capacity, ctx.scaling, ctx.fmt, needs)
    # no gradient for the scales, the routing and the scalars
    return (*[g if n else None for g, n in zip(grads, needs)], *[None] * 12)


_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def _check(experts) -> None:
    if experts.has_lora and experts.lora_dropout > 0 and experts.training:
        raise NotImplementedError(
            f"scattermoe: lora_dropout={experts.lora_dropout} in training mode is not implemented (the fused "
            "kernels read x once for the base and the LoRA path); set lora_dropout=0 or use the eager "
            "backend")


@EXPERT_BACKENDS.register("scattermoe")
def scattermoe_backend(x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                       experts, valid_slots: int | None = None, bound: SlotCapacity | None = None) -> torch.Tensor:
    _check(experts)
    # Under autocast the fp32 residual stream and fp32 master weights enter here; the kernels have no
    # autocast rule, so every operand takes the compute dtype (no copy when it already has it).
    dtype = compute_dtype(x_MH)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        # The dtype test first: a no-op .to() still costs a dispatcher round trip, per operand and step.
        return t if t is None or t.dtype == dtype else t.to(dtype)

    def base(proj: str) -> torch.Tensor | PackedWeight | FP8View:  # FP4 is decoded to `dtype` in the kernels
        w = experts.base_weight(proj)
        if isinstance(w, FP4Weight):
            return PackedWeight.of(w)
        if isinstance(w, FP8Weight):
            return FP8View.of(w)
        if isinstance(w, QuantizedWeight):  # runtime.plan refuses this pairing (Capabilities.quantized_base)
            raise NotImplementedError(f"the scattermoe kernels read FP4 and FP8 base weights, not {w.fmt}; "
                                      "run these experts on the grouped_mm backend")
        # FP8 training quantizes the master weight as it is (its dtype is also dW's)
        return w if experts.fp8_training else cast(w)

    gu = experts.lora("gate_up") or (None, None)
    down = experts.lora("down") or (None, None)
    w_gu, w_down = base("gate_up"), base("down")
    # A frozen quantized base already runs its GEMMs in FP8 / FP4 and has no dW: FP8 training is for tensors.
    fp8 = experts.fp8_training and not isinstance(w_gu, _VIEWS) and not isinstance(w_down, _VIEWS)
    if torch.compiler.is_compiling():
        if fp8:
            raise NotImplementedError("scattermoe under torch.compile: quant.train_fp8 runs on this backend in "
                                      "eager mode only; set compile.enabled: false, or model.expert_backend: "
                                      "grouped_mm (its FP8 GEMMs compile)")
        fmt = _op_format(w_gu, w_down)
        (w_gu, *gu_scales), (w_down, *down_scales) = _weight_parts(w_gu), _weight_parts(w_down)
        capacity = slot_capacity(expert_ids_Mk.numel(), valid_slots, bound)
        dropped = bound.dropped if bound is not None and valid_slots is None else None
        order_S, inv_S, offsets_E1, rows_S = torch.ops.moert.scattermoe_sort(expert_ids_Mk, experts.num_experts,
                                                                             capacity, dropped)
        return torch.ops.moert.scattermoe_fwd(cast(x_MH), weights_Mk, w_gu, w_down, *map(cast, gu), *map(cast, down),
                                              *gu_scales, *down_scales, expert_ids_Mk, order_S, inv_S, offsets_E1,
                                              rows_S, capacity, experts.lora_scaling, fmt)[0]
    slots = sort_slots(expert_ids_Mk, experts.num_experts, valid_slots, bound)
    return _ScatterMoE.apply(cast(x_MH), weights_Mk, w_gu, w_down, *map(cast, gu), *map(cast, down), slots,
                             experts.lora_scaling, fp8)

"""`sonicmoe` expert backend: SonicMoE (the optional `sonic-moe` package: QuACK's CuTe DSL grouped GEMMs,
Hopper / Blackwell) through its general-routing entry point, under our backend contract.

    y_MH = expert_backend("sonicmoe")(x_MH, expert_ids_Mk, weights_Mk, experts)

Shapes: M routed rows, k slots, P valid (row, slot) pairs (id >= 0), E local experts, E' of them with
rows (padded to a power of two), H hidden, I intermediate, r LoRA rank.

The call (sonic-moe 0.1.2.post1, sonicmoe/functional/__init__.py):

    y_MH, freq_E = sonicmoe.functional.moe_general_routing_inputs(
        x_MH, router_scores_P, token_indices_P, expert_indices_P, w1_2IHE, None, w2_HIE, None, E, stream_id,
        ActivationType.SWIGLU, is_inference_mode_enabled=False, concat_layout=True)

- token_indices_P (int32) must be sorted ascending; expert_indices_P (int32) index the last dim of w1/w2.
  Only the valid pairs are passed (`valid_pairs`): a -1 slot is never sorted, gathered or computed
  (sentinel-skip). A row with no valid slot gets y = 0 and dx = 0 (its token offset range is empty).
- w1 is [2I, H, E] with stride order (2, 0, 1) and w2 [H, I, E]: exactly our [E, out, in] weights
  permuted (1, 2, 0), as SonicMoE's own MoE module passes its [E, out, in] parameters; views, no copy
  (`sonic_weight_views`). concat_layout=True reads gate_up as [gate rows; up rows] (ours) instead of
  SonicMoE's default interleaved rows; the activation is silu(gate) * up.
- Autograd: its two autograd.Functions return dx, the fp32 router-score gradient and full dW1 / dW2 (zeros
  for experts without rows: QuACK's K-varlen GEMM zero-fills empty groups). dW is computed even for a frozen
  base (no way to skip it). bf16 / fp16 only; no torch.compile (it asserts eager mode): use scattermoe there.

Full fine-tune: the base weights go in as views (no per-step copy; under autocast with fp32 masters they are
cast to the compute dtype, as in scattermoe). LoRA and FP4-packed bases go through the merged per-step weight
of the experts that received rows (`layer_weights`): W'[e'] = W[a_e'] + s * B[a_e'] @ A[a_e'] for the E'
active experts a, with the expert ids renumbered into 0..E'-1; it is built with differentiable torch ops, so
SonicMoE's dW' flows back to A, B (and W when it trains) by autograd. That costs one [E', out, in] weight
copy per projection and step, and dW' (SonicMoE has no rank-sized LoRA hook). Quantized base weights
(quant.QuantizedWeight) are dequantized only for the active experts (as grouped_mm does) and SonicMoE keeps the
dequantized copy until the backward. lora_dropout > 0 in training is refused (the merge has no dropout).

QuACK's GEMMs run its default tile configs (`fixed_gemm_configs`): its autotuner keys on exact shapes and P
changes every step.

The package is imported on the first call (`load_sonic`), never by this module: the runtime imports and
runs without it. Without the package or without CUDA runtime.plan refuses the backend with the install hint
(`unavailable_reason`).

Tested on GPUs by tests/gpu/test_sonicmoe_gpu.py through benchmarks/gpu_sonicmoe.sh (the wheel set it runs
with: docs/validation.md). scattermoe is faster at every measured shape and mode but Mixtral's full fine-tune
(docs/benchmarks.md#expert-layer), so `auto` never picks this backend.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from gpu.device import compute_dtype
from gpu.launch import next_power_of_2
from moe.backends import EXPERT_BACKENDS

INSTALL_HINT = ("pip install 'moe-runtime[sonicmoe]' && pip install --no-deps sonic-moe==0.1.2.post1 (sonic-moe "
                "declares torch<=2.9.1, hence --no-deps; see pyproject.toml); GPU machines: "
                "bash benchmarks/sonicmoe_wheels.sh and benchmarks/gpu_sonicmoe.sh")
_DTYPES = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- pure layout helpers (CPU)

def valid_pairs(expert_ids_Mk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows_P, slots_P), int64: the (row, slot) of every slot with an expert id >= 0, rows ascending (row-major
    order: SonicMoE needs its token indices sorted). One host sync (the count P)."""
    rows_P, slots_P = torch.nonzero(expert_ids_Mk >= 0, as_tuple=True)
    return rows_P, slots_P


def active_experts(expert_P: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(active_A, local_P): the experts that received at least one pair, padded with idle ones to E' = the
    next power of two (at most E), ascending int64, and each pair's expert renumbered into 0..E'-1. SonicMoE
    compiles and autotunes its kernels per expert count: an exact count, new at nearly every layer and step,
    recompiled them all the time. One host sync (the count)."""
    counts_E = torch.bincount(expert_P, minlength=num_experts)
    count = int(torch.count_nonzero(counts_E))
    padded = min(num_experts, next_power_of_2(count))
    active_first_E = torch.argsort((counts_E == 0).to(torch.int8), stable=True)
    active_A = active_first_E[:padded].sort().values
    renumber_E = torch.full((num_experts,), -1, dtype=torch.int64, device=expert_P.device)
    renumber_E[active_A] = torch.arange(padded, device=expert_P.device)
    return active_A, renumber_E[expert_P]


def sonic_weight_views(w_gu_E2IH: torch.Tensor, w_down_EHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [E, out, in] weights as SonicMoE's w1 [2I, H, E] and w2 [H, I, E] (stride order (2, 0, 1)):
    permuted views, no copy (a non-contiguous weight is made contiguous first, a copy only then)."""
    return w_gu_E2IH.contiguous().permute(1, 2, 0), w_down_EHI.contiguous().permute(1, 2, 0)


def merged_weight(w_EOI: torch.Tensor, lora, scaling: float, active_A: torch.Tensor | None = None) -> torch.Tensor:
    """w_EOI (already restricted to the active experts when `active_A` is given) + scaling * B @ A of the same
    experts; differentiable in w, A and B. `lora`: (A_ErI, B_EOr) over all local experts, or None."""
    if lora is None:
        return w_EOI
    A_ErI, B_EOr = lora
    if active_A is not None:
        A_ErI, B_EOr = A_ErI.index_select(0, active_A), B_EOr.index_select(0, active_A)
    return torch.baddbmm(w_EOI, B_EOr.to(w_EOI.dtype), A_ErI.to(w_EOI.dtype), alpha=scaling)


def layer_weights(experts, active_A: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E', 2I, H], down [E', H, I]) as SonicMoE gets them, in `dtype`: the base weights as they are
    (cast when needed) when active_A is None (dense base, no LoRA), else those of the active experts only,
    dequantized when packed, plus the LoRA delta."""
    out = []
    for proj in ("gate_up", "down"):
        if active_A is None:
            w = experts.base_weight(proj)
            out.append(w if w.dtype == dtype else w.to(dtype))
            continue
        w = experts.dense_weight(proj, active_A, dtype)  # FP4: selective dequant; dense: index_select
        w = w if w.dtype == dtype else w.to(dtype)
        out.append(merged_weight(w, experts.lora(proj), experts.lora_scaling, active_A))
    return out[0], out[1]


def needs_merge(experts) -> bool:
    """LoRA or a packed base: the per-step weight of the active experts is built (`layer_weights`)."""
    return experts.has_lora or experts.is_quantized


def emulate_general_routing(x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id,
                            activation_type, is_inference_mode_enabled=False, concat_layout=False):
    """What sonicmoe.functional.moe_general_routing_inputs computes (SwiGLU, no bias), in plain differentiable
    torch, with the input checks its kernels rely on asserted: the CPU tests run the whole backend through it,
    and the GPU smoke compares the package with it. Returns (y [T, H] in x's dtype, expert_frequency [E])."""
    assert b1 is None and b2 is None, "no expert bias"
    assert concat_layout, "our gate_up is [gate rows; up rows]: concat_layout=True"
    assert str(getattr(activation_type, "value", activation_type)) == "swiglu", activation_type
    assert token_indices.dtype == torch.int32 and expert_indices.dtype == torch.int32
    TK = router_scores.shape[0]
    assert token_indices.shape == expert_indices.shape == (TK,)
    assert TK == 0 or bool((token_indices[1:] >= token_indices[:-1]).all()), "token indices must be sorted"
    I2, H, E_w = w1.shape
    assert w2.shape == (H, I2 // 2, E_w) and E == E_w, (w1.shape, w2.shape, E)
    assert w1.stride(1) == 1 and w1.stride(2) >= w1.stride(0) >= w1.stride(1), w1.stride()  # stride order (2,0,1)
    assert w2.stride(1) == 1 and w2.stride(2) >= w2.stride(0) >= w2.stride(1), w2.stride()
    assert x.shape[1] == H and x.stride(1) == 1
    assert TK == 0 or (0 <= int(expert_indices.min()) and int(expert_indices.max()) < E), "expert ids out of range"
    assert TK == 0 or (0 <= int(token_indices.min()) and int(token_indices.max()) < x.shape[0])
    w_gu_E2IH, w_down_EHI = w1.permute(2, 0, 1), w2.permute(2, 0, 1)
    tokens, experts_P = token_indices.long(), expert_indices.long()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(experts_P).tolist():
        sel = torch.nonzero(experts_P == e).squeeze(1)
        gate, up = F.linear(x[tokens[sel]], w_gu_E2IH[e]).float().chunk(2, dim=-1)
        out = F.linear((F.silu(gate) * up).to(x.dtype), w_down_EHI[e]).float()
        y = y.index_add(0, tokens[sel], out * router_scores[sel].float().unsqueeze(-1))
    return y.to(x.dtype), torch.bincount(experts_P, minlength=E).to(torch.int32)


# ----------------------------------------------------------------------------- the backend

def fixed_gemm_configs(modules) -> None:
    """Makes the QuACK GEMMs that `modules` call (their module globals gemm / gemm_gated / gemm_dgated) run
    QuACK's default config instead of autotuning: its autotuner keys on every tensor's shape, and the number
    of valid pairs P changes at nearly every training step under general routing, so each step would tune
    every GEMM anew. Only these modules' bindings change, not quack's."""
    for mod in modules:
        for name in ("gemm", "gemm_gated", "gemm_dgated"):
            fn = getattr(mod, name, None)
            if fn is not None and not isinstance(fn, functools.partial):
                setattr(mod, name, functools.partial(fn, tuned=False))


@functools.cache
def load_sonic():
    """(moe_general_routing_inputs, ActivationType.SWIGLU) of the installed sonic-moe; imported on first use.
    Its GEMMs run QuACK's default configs (fixed_gemm_configs)."""
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import backward, forward, moe_general_routing_inputs
    except ImportError as err:
        raise ImportError(f"the sonicmoe expert backend needs the sonic-moe package and its CuTe DSL stack "
                          f"(quack-kernels, nvidia-cutlass-dsl), which failed to import: {err}. "
                          f"Install: {INSTALL_HINT}") from err
    fixed_gemm_configs((forward, backward))
    return moe_general_routing_inputs, ActivationType.SWIGLU


def sonicmoe_forward(x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor, experts,
                     moe_fn, activation) -> torch.Tensor:
    """The backend with the general-routing function passed in (`moe_fn`: SonicMoE's, or
    `emulate_general_routing` on the CPU): valid pairs, weight layout, LoRA merge, the call."""
    dtype = compute_dtype(x_MH)
    rows_P, slots_P = valid_pairs(expert_ids_Mk)
    if rows_P.numel() == 0:  # nothing routed here (SonicMoE's kernels need at least one pair)
        return torch.zeros_like(x_MH, dtype=dtype)
    expert_P = expert_ids_Mk[rows_P, slots_P].long()
    scores_P = weights_Mk[rows_P, slots_P]  # differentiable: the gradient of a -1 slot stays 0
    active_A = None
    if needs_merge(experts):
        active_A, expert_P = active_experts(expert_P, experts.num_experts)
    w_gu, w_down = layer_weights(experts, active_A, dtype)
    w1, w2 = sonic_weight_views(w_gu, w_down)
    x = x_MH if x_MH.dtype == dtype else x_MH.to(dtype)
    stream_id = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    # is_inference_mode_enabled stays False: with True SonicMoE passes h=None to its _up_projection_forward
    # custom op, whose schema declares h a Tensor (0.1.2.post1); the cost is one [P, 2I] buffer in no_grad calls.
    with torch.autocast(x.device.type, enabled=False):  # operands are cast above; no autocast inside
        y_MH, _ = moe_fn(x=x.contiguous(), router_scores=scores_P, token_indices=rows_P.to(torch.int32),
                         expert_indices=expert_P.to(torch.int32), w1=w1, b1=None, w2=w2, b2=None,
                         E=w2.shape[-1], stream_id=stream_id, activation_type=activation,
                         is_inference_mode_enabled=False, concat_layout=True)
    return y_MH


def check_inputs(x_MH: torch.Tensor, experts) -> None:
    """Raises, naming the fix, for what SonicMoE cannot run."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("the sonicmoe backend runs in eager mode only (SonicMoE asserts it is not "
                                  "compiling); under torch.compile use the scattermoe backend")
    if experts.has_lora and experts.lora_dropout > 0 and experts.training:
        raise NotImplementedError(f"sonicmoe: lora_dropout={experts.lora_dropout} in training is not implemented "
                                  "(LoRA runs through the merged weight); set lora_dropout=0 or use the eager backend")
    if not x_MH.is_cuda:
        raise RuntimeError(f"the sonicmoe backend needs CUDA tensors, got {x_MH.device}")
    if torch.cuda.get_device_capability(x_MH.device) < (9, 0):
        raise RuntimeError("the sonicmoe backend needs a Hopper (sm90) or Blackwell GPU; use scattermoe")
    dtype = compute_dtype(x_MH)
    if dtype not in _DTYPES:
        raise NotImplementedError(f"the sonicmoe backend computes in bf16 / fp16 (QuACK GEMMs), got {dtype}: run "
                                  "the model in bfloat16 or under autocast, or use the eager / scattermoe backend")


def sonicmoe_backend(x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                     experts, valid_slots: int | None = None, bound=None) -> torch.Tensor:
    check_inputs(x_MH, experts)
    moe_fn, swiglu = load_sonic()
    return sonicmoe_forward(x_MH, expert_ids_Mk, weights_Mk, experts, moe_fn, swiglu)


def unavailable_reason() -> str | None:
    """Why the backend cannot run here (None when it can): the package (found, not imported) and CUDA."""
    if importlib.util.find_spec("sonicmoe") is None:
        return f"the sonic-moe package is not installed ({INSTALL_HINT})"
    if not torch.cuda.is_available():
        return "it needs CUDA (SonicMoE's kernels run on Hopper / Blackwell GPUs); use eager or grouped_mm here"
    return None


EXPERT_BACKENDS.register("sonicmoe")(sonicmoe_backend)

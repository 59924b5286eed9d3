"""GroupedExperts: the parameters of a set of routed SwiGLU experts (optionally with per-expert LoRA).

Shapes (E = local experts, H = hidden, I = intermediate, r = LoRA rank):
    gate_up      [E, 2I, H]   rows 0..I-1 are the gate projection, I..2I-1 the up projection
    down         [E, H, I]
    gate_up_lora_A [E, r, H],  gate_up_lora_B [E, 2I, r]    (only when lora_rank > 0)
    down_lora_A    [E, r, I],  down_lora_B    [E, H, r]
The layout is transformers v5's fused expert layout ([out, in] like nn.Linear). The module holds
weights only; the compute lives in `moe.backends` so backends stay interchangeable.

Backends read weights through accessors, never through attributes, so that the storage can change
under them (a quantized container from `quant/` instead of a tensor):
    experts.base_weight("gate_up" | "down")  -> a tensor, or a quant.QuantizedWeight (FP4 or FP8, frozen)
    experts.dense_weight(proj, experts=None) -> a tensor either way (quantized: dequantized, only `experts`)
    experts.lora("gate_up" | "down")         -> LoraFactors(A_ErI, B_EOr), or None without LoRA
    experts.fp8_training                     -> True: the trainable base GEMMs run in FP8 (quant.fp8_training)
quant.quantize_experts(experts, fmt) swaps the base weights for quantized containers (set_base_weight).
The accessors return plain tensors: a parameter that is a DTensor no wrapper gathers (the runtime's experts
alone on their FSDP mesh) is read as its local tensor, in its stored dtype (the backends cast operands to the
activations' dtype, as they do for fp32 master weights on one GPU).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe.backends import expert_backend
from quant import QuantizedWeight

PROJECTIONS = ("gate_up", "down")


class LoraFactors(NamedTuple):
    """Per-expert LoRA of one projection: delta_W[e] = scaling * B_EOr[e] @ A_ErI[e]."""
    A_ErI: torch.Tensor
    B_EOr: torch.Tensor


class GroupedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        expert_offset: int = 0,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        # Global id of local expert 0: EP ranks own a contiguous slice of the experts.
        self.expert_offset = expert_offset
        factory = {"device": device, "dtype": dtype}
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, **factory))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, **factory))
        self.lora_rank = 0
        self.lora_scaling = 0.0
        self.lora_dropout = 0.0
        self.fp8_training = False  # the base GEMMs train in FP8 (quant.train_fp8); backends read it
        if lora_rank > 0:
            self.add_lora(lora_rank, lora_alpha if lora_alpha is not None else lora_rank, lora_dropout)
        self.reset_parameters()

    def add_lora(self, rank: int, alpha: float, dropout: float = 0.0) -> None:
        """Adds per-expert LoRA factors; B starts at zero so the output is unchanged."""
        E, H, I = self.num_experts, self.hidden, self.intermediate
        factory = {"device": self.gate_up.device, "dtype": self.gate_up.dtype}
        self.lora_rank = rank
        self.lora_scaling = alpha / rank
        self.lora_dropout = dropout
        self.gate_up_lora_A = nn.Parameter(torch.empty(E, rank, H, **factory))
        self.gate_up_lora_B = nn.Parameter(torch.zeros(E, 2 * I, rank, **factory))
        self.down_lora_A = nn.Parameter(torch.empty(E, rank, I, **factory))
        self.down_lora_B = nn.Parameter(torch.zeros(E, H, rank, **factory))
        if not self.gate_up.is_meta:
            self._init_lora_A()

    def _init_lora_A(self) -> None:
        for A in (self.gate_up_lora_A, self.down_lora_A):
            # PEFT's default: kaiming-uniform with a=sqrt(5) over the fan-in of A.
            bound = 1.0 / math.sqrt(A.shape[-1])
            nn.init.uniform_(A, -bound, bound)

    @property
    def has_lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def is_quantized(self) -> bool:
        return isinstance(self.gate_up, QuantizedWeight)

    def base_weight(self, proj: str) -> torch.Tensor | QuantizedWeight:
        """The base weight of `proj` in {"gate_up" [E, 2I, H], "down" [E, H, I]}: a tensor, or quantized."""
        if proj not in PROJECTIONS:
            raise ValueError(f"unknown expert projection {proj!r}; choose one of {PROJECTIONS}")
        w = self.gate_up if proj == "gate_up" else self.down
        return w if isinstance(w, QuantizedWeight) else self._readable(w)

    def dense_weight(self, proj: str, experts: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight of `proj` as a tensor: packed weights dequantized (to `dtype`), only the local
        experts listed in `experts` when given ([E', out, in]); a dense weight as is (indexed)."""
        w = self.base_weight(proj)
        if isinstance(w, QuantizedWeight):
            return w.dequantize(dtype, experts)
        return w if experts is None else w.index_select(0, experts)

    def set_base_weight(self, proj: str, weight: nn.Parameter | QuantizedWeight) -> None:
        """Replaces the base weight of `proj` (quant.quantize_experts swaps in packed containers)."""
        old = self.base_weight(proj)
        if tuple(weight.shape) != tuple(old.shape):
            raise ValueError(f"{proj}: new base weight {tuple(weight.shape)} != {tuple(old.shape)}")
        delattr(self, proj)
        setattr(self, proj, weight)

    def lora(self, proj: str) -> LoraFactors | None:
        """The LoRA factors of `proj` in {"gate_up", "down"}, or None without LoRA."""
        if proj not in PROJECTIONS:
            raise ValueError(f"unknown expert projection {proj!r}; choose one of {PROJECTIONS}")
        if not self.has_lora:
            return None
        if proj == "gate_up":
            return LoraFactors(self._readable(self.gate_up_lora_A), self._readable(self.gate_up_lora_B))
        return LoraFactors(self._readable(self.down_lora_A), self._readable(self.down_lora_B))

    @staticmethod
    def _readable(t: torch.Tensor) -> torch.Tensor:
        """t as the backends read it: a DTensor's local tensor (differentiable: its gradient comes back as a
        DTensor of the same placement), a plain tensor as is."""
        return t.to_local() if isinstance(t, DTensor) else t

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.gate_up.is_meta:
            return
        std = 0.02
        if not self.is_quantized:  # packed weights are filled by quant (QuantizedWeight.fill_), not drawn here
            nn.init.normal_(self.gate_up, std=std)
            nn.init.normal_(self.down, std=std)
        if self.has_lora:
            self._init_lora_A()
            nn.init.zeros_(self.gate_up_lora_B)
            nn.init.zeros_(self.down_lora_B)

    def forward(self, x_MH: torch.Tensor, expert_ids_Mk: torch.Tensor, weights_Mk: torch.Tensor,
                backend: str = "grouped_mm", valid_slots: int | None = None, bound=None) -> torch.Tensor:
        """Runs the expert backend `backend` (a concrete name) on these weights (valid_slots, bound: see
        moe.backends).
        Calling the module (rather than the backend directly) lets wrappers such as FSDP gather the weights
        first."""
        return expert_backend(backend)(x_MH, expert_ids_Mk, weights_Mk, self, valid_slots=valid_slots, bound=bound)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"lora_rank={self.lora_rank}, expert_offset={self.expert_offset}"
                + (", fp8_training=True" if self.fp8_training else ""))

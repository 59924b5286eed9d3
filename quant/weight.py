"""FP4Weight: a frozen [E, N, K] expert weight held packed (MXFP4 or NVFP4), and `quantize_experts`, which
swaps a set of experts' base weights for such containers in place.

The packed tensors are non-persistent buffers: they are not parameters (nothing trains them, no optimizer
or FSDP state exists for them), and a training checkpoint does not hold them: on resume they are
quantized again from the base checkpoint (or the seeded init), which gives the same bits. They stay whole
on every rank that holds their experts (EP splits the experts; FSDP does not shard frozen buffers).

    w = FP4Weight.empty("mxfp4", (E, N, K), dtype=torch.bfloat16, device="meta")   # shapes only
    w.fill_(w_ENK)                   # quantize a dense weight into it (in place)
    w.dequantize()                   # [E, N, K] in w.dtype;  w.dequantize(experts=ids_E) -> [E', N, K]
    w.packed                         # PackedFP4(fmt, qdata, scale, tensor_scale fp32 | None): what kernels read
The buffers are integer tensors (tensor_scale stores the fp32 bits as int32), so that a model-wide
.to(dtype) leaves them alone; read them through `packed`.
"""

from __future__ import annotations

import torch
from torch import nn

from quant.fp4 import BLOCK_SIZE, PackedFP4, dequantize, packed_shapes, quantize


class FP4Weight(nn.Module):
    def __init__(self, fmt: str, shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.fmt = fmt
        self.shape = torch.Size(shape)
        self.dtype = dtype  # what dequantize returns by default: the dtype the model was built in
        # Integer buffers only (tensor_scale holds fp32 bits): a model-wide .to(dtype) must not cast them.
        shapes = packed_shapes(fmt, *shape)
        for name in ("qdata", "scale", "tensor_scale"):
            buffer_dtype = torch.int32 if name == "tensor_scale" else torch.uint8
            buffer = torch.zeros(shapes[name], dtype=buffer_dtype, device=device) if name in shapes else None
            self.register_buffer(name, buffer, persistent=False)

    @classmethod
    def empty(cls, fmt: str, shape: tuple[int, int, int], dtype: torch.dtype,
              device: torch.device | str | None = None) -> FP4Weight:
        return cls(fmt, shape, dtype, device)

    @classmethod
    def from_dense(cls, w_ENK: torch.Tensor, fmt: str) -> FP4Weight:
        weight = cls(fmt, tuple(w_ENK.shape), w_ENK.dtype, w_ENK.device)
        return weight.fill_(w_ENK)

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.fmt]

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def is_meta(self) -> bool:
        return self.qdata.is_meta

    @property
    def packed(self) -> PackedFP4:
        tensor_scale = None if self.tensor_scale is None else self.tensor_scale.view(torch.float32)
        return PackedFP4(self.fmt, self.qdata, self.scale, tensor_scale)

    def packed_bytes(self) -> int:
        """Bytes held: codes, block scales and tensor scales."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    @torch.no_grad()
    def fill_(self, w_ENK: torch.Tensor) -> FP4Weight:
        """Quantizes the dense weight w_ENK (its shape must be this one's) into these buffers."""
        if tuple(w_ENK.shape) != tuple(self.shape):
            raise ValueError(f"FP4Weight of shape {tuple(self.shape)} cannot take a weight of shape "
                             f"{tuple(w_ENK.shape)}")
        packed = quantize(w_ENK.to(self.device), self.fmt)
        self.qdata.copy_(packed.qdata)
        self.scale.copy_(packed.scale)
        if packed.tensor_scale is not None:
            self.tensor_scale.copy_(packed.tensor_scale.view(torch.int32))
        return self

    def dequantize(self, dtype: torch.dtype | None = None, experts: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight in `dtype` (default self.dtype); with `experts` (int64 indices) only those."""
        return dequantize(self.packed, dtype or self.dtype, experts)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}"


def quantize_experts(experts, fmt: str) -> None:
    """Replaces the base weights of `experts` (a moe.experts.GroupedExperts) by FP4Weight containers, in
    place. A meta-device module gets empty containers of the right shapes (fill them with fill_); a
    materialized one is quantized now. The LoRA factors, if any, are untouched."""
    for proj in ("gate_up", "down"):
        w = experts.base_weight(proj)
        if isinstance(w, FP4Weight):
            raise TypeError(f"the {proj} weight is already quantized ({w.fmt})")
        if w.is_meta:
            packed = FP4Weight.empty(fmt, tuple(w.shape), w.dtype, device="meta")
        else:
            packed = FP4Weight.from_dense(w.detach(), fmt)
        experts.set_base_weight(proj, packed)

"""Frozen expert base weights held quantized: FP4Weight (MXFP4 / NVFP4) and FP8Weight (e4m3, rowwise), one
contract (QuantizedWeight), and `quantize_experts`, which swaps a set of experts' base weights for such
containers in place.

The quantized tensors are non-persistent buffers: they are not parameters (nothing trains them, no optimizer
or FSDP state exists for them), and a training checkpoint does not hold them: on resume they are
quantized again from the base checkpoint (or the seeded init), which gives the same bits. They stay whole
on every rank that holds their experts (EP splits the experts; FSDP does not shard frozen buffers).

    w = FP4Weight.empty("mxfp4", (E, N, K), dtype=torch.bfloat16, device="meta")   # shapes only
    w.fill_(w_ENK)                   # quantize a dense weight into it (in place)
    w.dequantize()                   # [E, N, K] in w.dtype;  w.dequantize(experts=ids_E) -> [E', N, K]
    w.packed                         # FP4: PackedFP4(fmt, qdata, scale, tensor_scale fp32 | None)
    w.codes, w.scales                # FP8: e4m3 [E, N, K] and fp32 [E, N] (per expert and output row)
The buffers are integer tensors (fp32 scales are stored as their int32 bits, e4m3 codes as uint8), so that a
model-wide .to(dtype) leaves them alone; read them through the properties above.
"""

from __future__ import annotations

import torch
from torch import nn

from quant.fp4 import BLOCK_SIZE, PackedFP4, dequantize, packed_shapes, quantize
from quant.fp8 import E4M3, dequantize_rows, quantize_rows

FP4_FORMATS = ("mxfp4", "nvfp4")
FORMATS = (*FP4_FORMATS, "fp8")


class QuantizedWeight(nn.Module):
    """A frozen [E, N, K] weight held quantized; subclasses name their buffers and (de)quantize."""

    def __init__(self, fmt: str, shape: tuple[int, int, int], dtype: torch.dtype,
                 buffers: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device | str | None):
        super().__init__()
        self.fmt = fmt
        self.shape = torch.Size(shape)
        self.dtype = dtype  # what dequantize returns by default: the dtype the model was built in
        for name, (buffer_shape, buffer_dtype) in buffers.items():
            self.register_buffer(name, torch.zeros(buffer_shape, dtype=buffer_dtype, device=device),
                                 persistent=False)

    @classmethod
    def empty(cls, fmt: str, shape: tuple[int, int, int], dtype: torch.dtype,
              device: torch.device | str | None = None) -> QuantizedWeight:
        return cls(fmt, shape, dtype, device)

    @classmethod
    def from_dense(cls, w_ENK: torch.Tensor, fmt: str) -> QuantizedWeight:
        weight = cls(fmt, tuple(w_ENK.shape), w_ENK.dtype, w_ENK.device)
        return weight.fill_(w_ENK)

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def is_meta(self) -> bool:
        return next(self.buffers()).is_meta

    def packed_bytes(self) -> int:
        """Bytes held: codes and scales."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    @torch.no_grad()
    def fill_(self, w_ENK: torch.Tensor) -> QuantizedWeight:
        """Quantizes the dense weight w_ENK (its shape must be this one's) into these buffers."""
        if tuple(w_ENK.shape) != tuple(self.shape):
            raise ValueError(f"{type(self).__name__} of shape {tuple(self.shape)} cannot take a weight of shape "
                             f"{tuple(w_ENK.shape)}")
        self._store(w_ENK.to(self.device))
        return self

    def _store(self, w_ENK: torch.Tensor) -> None:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype | None = None, experts: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight in `dtype` (default self.dtype); with `experts` (int64 indices) only those."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}"


class FP4Weight(QuantizedWeight):
    """MXFP4 / NVFP4 (quant.fp4's layouts); kernels read `packed`."""

    def __init__(self, fmt: str, shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device | str | None = None):
        shapes = packed_shapes(fmt, *shape)
        dtypes = {"qdata": torch.uint8, "scale": torch.uint8, "tensor_scale": torch.int32}
        super().__init__(fmt, shape, dtype, {name: (shapes[name], dtypes[name]) for name in shapes}, device)
        if "tensor_scale" not in shapes:
            self.register_buffer("tensor_scale", None, persistent=False)

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.fmt]

    @property
    def packed(self) -> PackedFP4:
        tensor_scale = None if self.tensor_scale is None else self.tensor_scale.view(torch.float32)
        return PackedFP4(self.fmt, self.qdata, self.scale, tensor_scale)

    def _store(self, w_ENK: torch.Tensor) -> None:
        packed = quantize(w_ENK, self.fmt)
        self.qdata.copy_(packed.qdata)
        self.scale.copy_(packed.scale)
        if packed.tensor_scale is not None:
            self.tensor_scale.copy_(packed.tensor_scale.view(torch.int32))

    def dequantize(self, dtype: torch.dtype | None = None, experts: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize(self.packed, dtype or self.dtype, experts)


class FP8Weight(QuantizedWeight):
    """e4m3 codes [E, N, K] with one fp32 scale per expert and output row (quant.fp8): the FP8 GEMMs read
    `codes` and `scales`."""

    def __init__(self, fmt: str, shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device | str | None = None):
        if fmt != "fp8":
            raise ValueError(f"FP8Weight holds fmt 'fp8', not {fmt!r}")
        E, N, K = shape
        super().__init__(fmt, shape, dtype, {"qdata": ((E, N, K), torch.uint8), "scale": ((E, N), torch.int32)},
                         device)

    @property
    def codes(self) -> torch.Tensor:
        return self.qdata.view(E4M3)

    @property
    def scales(self) -> torch.Tensor:
        return self.scale.view(torch.float32)

    def _store(self, w_ENK: torch.Tensor) -> None:
        for e, w_NK in enumerate(w_ENK):  # one expert's fp32 temporaries at a time
            codes_NK, scale_N = quantize_rows(w_NK)
            self.qdata[e].copy_(codes_NK.view(torch.uint8))
            self.scale[e].copy_(scale_N.view(torch.int32))

    def dequantize(self, dtype: torch.dtype | None = None, experts: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = self.codes, self.scales
        if experts is not None:
            codes, scales = codes.index_select(0, experts), scales.index_select(0, experts)
        return dequantize_rows(codes, scales, dtype or self.dtype)


CONTAINERS: dict[str, type[QuantizedWeight]] = {"mxfp4": FP4Weight, "nvfp4": FP4Weight, "fp8": FP8Weight}


def quantize_experts(experts, fmt: str) -> None:
    """Replaces the base weights of `experts` (a moe.experts.GroupedExperts) by quantized containers of `fmt`
    (one of FORMATS), in place. A meta-device module gets empty containers of the right shapes (fill them with
    fill_); a materialized one is quantized now. The LoRA factors, if any, are untouched."""
    if fmt not in CONTAINERS:
        raise ValueError(f"unknown base weight format {fmt!r}; choose one of {FORMATS}")
    container = CONTAINERS[fmt]
    for proj in ("gate_up", "down"):
        w = experts.base_weight(proj)
        if isinstance(w, QuantizedWeight):
            raise TypeError(f"the {proj} weight is already quantized ({w.fmt})")
        if w.is_meta:
            packed = container.empty(fmt, tuple(w.shape), w.dtype, device="meta")
        else:
            packed = container.from_dense(w.detach(), fmt)
        experts.set_base_weight(proj, packed)

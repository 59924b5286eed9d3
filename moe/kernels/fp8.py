"""FP8 (e4m3, rowwise) frozen expert weights inside the grouped-linear kernel: the weight view the kernels
read (W_FMT = FMT_FP8) and the quantized input rows they multiply it with.

Shapes: E experts, O / I the stored weight's output / input dims, N / K the logical weight's, S expert-sorted
rows. quant.FP8Weight stores codes [E, O, I] (e4m3) and scales [E, O] (fp32, per expert and output row).

    forward  W [E, N, K] = codes [E, O, I]: the input rows are quantized along K before any gather (one pass
             over the token layout); the kernel gathers code rows, accumulates tl.dot(codes, codes) in fp32 and
             multiplies the accumulator by the row's scale and the column's weight scale after the K loop,
             before any epilogue:  out[p, n] = sum_k xq[row(p), k] wq[e, n, k] * xs[row(p)] * ws[e, n].
    backward W^T [E, I, O] (transposed=True): the reduction runs along O, where the weight's scales sit; they
             are folded into the input's rows first (in[p, o] * ws[e(p), o], exact, as quant.fp8_base does),
             those rows are quantized and the kernel applies the row scale only. A gathering caller's rows are
             gathered first (a token's slots see different experts' scales).
The transposed codes are read through their strides (no copy): on Hopper that tile is not K-major, which FP8
wgmma wants for both operands, so how fast the compiler's handling of it runs is the GPU's question.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.kernels.routing import SlotOrder, gather_rows
from quant import FP8Weight
from quant.fp8 import quantize_rows
from quant.fp8_base import quantize_rows_by_expert_scales

FMT_FP8 = 3  # W_FMT beside fp4.FMT_CODES (dense 0, mxfp4 1, nvfp4 2)


@dataclass(frozen=True)
class FP8View:
    """An FP8 weight as the kernels read it: the logical [E, N, K] is the stored [E, O, I], or its transpose
    when `transposed` (a strided view: nothing is copied)."""
    codes: torch.Tensor   # e4m3 [E, O, I]
    scales: torch.Tensor  # fp32 [E, O]
    transposed: bool = False

    fmt = "fp8"  # the format name PackedWeight's views carry too (the compiled ops' `fmt`)

    @classmethod
    def of(cls, weight: FP8Weight) -> FP8View:
        return cls(weight.codes, weight.scales)

    @property
    def shape(self) -> tuple[int, int, int]:
        E, O, I = self.codes.shape
        return (E, I, O) if self.transposed else (E, O, I)

    @property
    def logical(self) -> torch.Tensor:
        """The codes as the logical [E, N, K] (a view)."""
        return self.codes.transpose(1, 2) if self.transposed else self.codes

    def t(self) -> FP8View:
        return FP8View(self.codes, self.scales, not self.transposed)


def fp8_input_rows(in_: torch.Tensor, slots: SlotOrder, w: FP8View, gather: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(e4m3 codes, fp32 row scales, gather) of the input the kernel multiplies with w: `in_` quantized rowwise
    as it is (token layout when gathering), or, for the transposed weight, its expert-sorted rows (gathered
    here) times the weight scales of their expert, quantized; then the kernel no longer gathers."""
    if not w.transposed:
        codes, scale = quantize_rows(in_)
        return codes, scale, gather
    rows = gather_rows(in_, slots) if gather else in_
    codes, scale = quantize_rows_by_expert_scales(rows, w.scales, slots.offsets_E1[1:])
    return codes, scale, False

"""The input precision of our Triton dots: torch's own setting for fp32 matmuls, decided per launch.

    dot_precision(dtype) -> "ieee" | "tf32x3" | "tf32"   # DOT_PRECISION of every kernel with a tl.dot

fp32 operands get IEEE fp32 products unless the user allowed TF32 for fp32 matmuls
(torch.backends.cuda.matmul.fp32_precision = "tf32", or the legacy allow_tf32 = True /
torch.set_float32_matmul_precision("high" | "medium"), which set it too): the same rule cuBLAS follows,
so an fp32 run of our kernels is as exact as torch's matmuls. With TF32 allowed the dots run on the
tensor cores as Triton's "tf32x3" (each operand split into a TF32 high part and a TF32 remainder, three
TF32 products), not plain "tf32": Triton's plain TF32 dot drops the operands' low 13 mantissa bits
(truncation, where cuBLAS rounds to nearest), which biases every product low and gave 2.3e-3
norm-relative error against fp64 (cuBLAS TF32: 5e-4) over the 1e-3 that TF32 promises; tf32x3 is
within ~1e-6. 16-bit operands ignore the setting; they keep Triton's default ("tf32", exact for them)
so that their compiled kernels stay the ones they were.
"""

from __future__ import annotations

import torch


def tf32_allowed() -> bool:
    """Whether torch computes fp32 CUDA matmuls in TF32 now."""
    # The new API resolves "none" through its parents and reflects the legacy setters; its getter never
    # raises, whereas the legacy allow_tf32 getter does once both APIs were used.
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is None:  # a torch before the fp32_precision API
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return precision == "tf32"


def dot_precision(dtype: torch.dtype) -> str:
    """The tl.dot input_precision for operands of `dtype`."""
    if dtype != torch.float32:
        return "tf32"
    # tf32x3, not tf32: Triton's TF32 truncates fp32 operands (2.3e-3 vs fp64 > TF32's 1e-3); x3: ~1e-6.
    return "tf32x3" if tf32_allowed() else "ieee"

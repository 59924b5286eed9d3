"""The input precision of our Triton dots: torch's own setting for fp32 matmuls, decided per launch.

    dot_precision(dtype) -> "ieee" | "tf32"     # the DOT_PRECISION constexpr of every kernel with a tl.dot

fp32 operands get IEEE fp32 products unless the user allowed TF32 for fp32 matmuls
(torch.backends.cuda.matmul.fp32_precision = "tf32", or the legacy allow_tf32 = True /
torch.set_float32_matmul_precision("high" | "medium"), which set it too): the same rule cuBLAS follows,
so an fp32 run of our kernels is as exact as torch's matmuls. 16-bit operands ignore the setting; they
keep Triton's default ("tf32") so that their compiled kernels stay the ones they were.
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
    return "tf32" if tf32_allowed() else "ieee"

"""The cross-entropy of one chunk of logits rows in one Triton kernel (runtime.loss's "triton" implementation).

    loss_sum = cross_entropy_rows_(logits_CV, labels_C, with_grad)

C rows, V vocab. Per row, in fp32 whatever the logits' dtype: the logsumexp by an online max and sum over V in
blocks, loss = lse - logits[label]; with_grad: the row is overwritten IN PLACE by d loss / d logits =
softmax - onehot(label), rounded to the logits' dtype. That is the torch chunk's math (upcast, logsumexp,
exp, scatter -1, cast back: runtime.loss._chunk_loss_and_grad_logits) in two reads and one write of the row
instead of six fp32 passes over [C, V]. Every label lies in [0, V) or is negative (IGNORE_INDEX: the rows past
a bound's true count), which adds no loss and gets a zero gradient row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.launch import launch, next_power_of_2

_BLOCK_V = 4096  # vocab columns per step of a row's loops


@triton.jit
def _cross_entropy_rows_kernel(logits_ptr, stride_c, labels_ptr, loss_ptr, V, WITH_GRAD: tl.constexpr,
                               BLOCK_V: tl.constexpr):
    row_ptr = logits_ptr + tl.program_id(0).to(tl.int64) * stride_c
    label = tl.load(labels_ptr + tl.program_id(0)).to(tl.int64)
    kept = label >= 0
    label = tl.maximum(label, 0)
    cols = tl.arange(0, BLOCK_V)
    # The first block alone sets the running max, so it is finite before any exp of a difference.
    x = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    for start in range(BLOCK_V, V, BLOCK_V):
        x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    # Read before the gradient overwrites the row.
    tl.store(loss_ptr + tl.program_id(0), tl.where(kept, lse - tl.load(row_ptr + label).to(tl.float32), 0.0))
    if WITH_GRAD:
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            x = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.where(kept, tl.exp(x - lse) - tl.where(start + cols == label, 1.0, 0.0), 0.0)
            tl.store(row_ptr + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows_(logits_CV: torch.Tensor, labels_C: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """The summed fp32 cross-entropy of the rows; with_grad: logits_CV now holds its gradient (module docstring)."""
    C, V = logits_CV.shape
    if logits_CV.stride(1) != 1:
        raise ValueError("cross_entropy_rows_: the logits' rows must be contiguous")
    loss_C = torch.empty(C, device=logits_CV.device, dtype=torch.float32)
    if C == 0:
        return loss_C.sum()
    launch(_cross_entropy_rows_kernel, (C,), (logits_CV, logits_CV.stride(0), labels_C, loss_C, V),
           {"WITH_GRAD": with_grad, "BLOCK_V": min(_BLOCK_V, next_power_of_2(V)), "num_warps": 8})
    return loss_C.sum()

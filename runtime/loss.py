"""The language-model loss: lm_head + cross-entropy over label tokens, fused so that no implementation
but the reference materializes [tokens, vocab] logits (8192 tokens x 151936 vocab is 2.5 GB in bf16,
5 GB in fp32, and as much again for their gradient).

Contract, shared by every implementation in LOSS_IMPLS (config key model.loss_impl)::

    fn(h_TH, weight_VH, labels_T, num_labels=None) -> loss_sum

T tokens, H hidden, V vocab. `h_TH` is the final-norm hidden state (fp32 or bf16), `weight_VH` the lm_head
weight (an fp32 master or bf16; it may be tied to the embedding), `labels_T` the (pre-shifted) targets,
IGNORE_INDEX where a token has no loss. `loss_sum` is an fp32 scalar: the summed token cross-entropy over
label tokens; the caller divides by the global label count. Gradients flow to h and, only when it
requires grad, to the weight (a frozen lm_head under LoRA gets no [V, H] gradient, none is allocated).
`num_labels`: how many of labels_T are not IGNORE_INDEX, where the caller knows it on the host (the collator
counts them), or any bound above that count (a step replayed from a CUDA graph passes its shape bucket's: the
rows past the count cost their compute and add nothing); an implementation that sizes its work by it then
reads nothing back from the device.

Precision is that of `nn.Linear` + `F.cross_entropy(logits.float())`: under autocast the matmuls run in
the autocast dtype (h and weight cast to it), outside autocast in the inputs' (common) dtype;
logsumexp / softmax always in fp32.

Implementations:
- "plain": materialized logits, the reference semantics.
- "chunked": pure torch, CPU and CUDA. Walks the label tokens in chunks and computes, already in forward,
  the loss and the gradients wrt h and weight; only those are kept for backward, which scales them.
  Tokens without a label cost nothing (their loss and gradient are zero). One host sync per call (the label
  count sets the loop) unless `num_labels` is given.
- "triton": "chunked" with each chunk's softmax, loss and logits' gradient in one Triton kernel
  (runtime/loss_kernel.py) over the matmul-dtype logits, in place: two reads and a write of the chunk instead
  of six fp32 passes, and no fp32 [chunk, V] buffer.
- "liger": Liger-Kernel's fused linear cross-entropy (Triton, CUDA), when liger-kernel is installed.
- "cce": Apple's Cut Cross-Entropy (Triton, CUDA, bf16/fp16 only: under autocast), when installed; its
  gradient filtering is off (filter_eps=None: skipping softmax entries below bf16 resolution moves grad h
  further off). It sums grad h over the vocabulary blocks into a bf16 buffer, one rounding per block, so it
  sits just past the bf16 tolerance the other implementations meet: an opt-in, never "auto"
  (docs/benchmarks.md#loss).
"auto" is "triton" on CUDA, "chunked" elsewhere (runtime.plan, from the capabilities declared here).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from gpu.device import compute_dtype
from gpu.registry import TRITON_DEVICES, Capabilities, Registry, triton_missing

IGNORE_INDEX = -100  # the label of a token without loss (runtime.data.packing writes it)
LOGITS_CHUNK_BYTES = 1 << 30  # "chunked": one chunk's fp32 logits take about this much memory


LOSS_IMPLS: Registry = Registry("loss implementation", "model.loss_impl", auto=True)


def linear_cross_entropy_sum(h_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
                             impl: str = "chunked", num_labels: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of `h_TH @ weight_VH.T` against `labels_T`; see the module docstring."""
    _check_inputs(h_TH, weight_VH, labels_T)
    return LOSS_IMPLS.get(impl)(h_TH, weight_VH, labels_T, num_labels=num_labels)


def _check_inputs(h_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor) -> None:
    if h_TH.ndim != 2 or weight_VH.ndim != 2 or labels_T.ndim != 1:
        raise ValueError(f"expected h [T, H], weight [V, H], labels [T]; got {tuple(h_TH.shape)}, "
                         f"{tuple(weight_VH.shape)}, {tuple(labels_T.shape)}")
    if h_TH.shape[0] != labels_T.shape[0] or h_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"shapes disagree: h {tuple(h_TH.shape)}, weight {tuple(weight_VH.shape)}, "
                         f"labels {tuple(labels_T.shape)}")
    if labels_T.is_floating_point():
        raise ValueError(f"labels must be integer class indices; got {labels_T.dtype}")
    if not torch.is_autocast_enabled(h_TH.device.type) and h_TH.dtype != weight_VH.dtype:
        raise ValueError(f"h ({h_TH.dtype}) and weight ({weight_VH.dtype}) dtypes differ outside autocast")


@LOSS_IMPLS.register("plain", Capabilities(reference=True))
def plain(h_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
          num_labels: int | None = None) -> torch.Tensor:
    """Materialized [T, V] logits (upcast to fp32 for the loss): the reference."""
    logits_TV = F.linear(h_TH, weight_VH)
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="sum")


@LOSS_IMPLS.register("chunked", Capabilities(auto_on=("cpu", "cuda"), priority=1))
def chunked(h_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor, num_labels: int | None = None,
            chunk_size: int | None = None) -> torch.Tensor:
    """Label tokens in chunks of `chunk_size` (default: ~LOGITS_CHUNK_BYTES of fp32 logits per chunk)."""
    return _chunked(h_TH, weight_VH, labels_T, num_labels, chunk_size, _chunk_loss_and_grad_logits)


def _chunked(h_TH, weight_VH, labels_T, num_labels: int | None, chunk_size: int | None, chunk_fn) -> torch.Tensor:
    """The chunk loop of "chunked" and "triton", with `chunk_fn` computing each chunk's loss and logits' grad."""
    chunk_size = chunk_size or default_chunk_size(weight_VH.shape[0])
    # Decided here: inside Function.forward grad mode is off, and under no_grad no gradient is wanted.
    grad_h = torch.is_grad_enabled() and h_TH.requires_grad
    grad_w = torch.is_grad_enabled() and weight_VH.requires_grad
    return _ChunkedLinearCrossEntropy.apply(h_TH, weight_VH, labels_T, num_labels, compute_dtype(h_TH),
                                            chunk_size, grad_h, grad_w, chunk_fn)


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk such that one chunk's fp32 logits take about LOGITS_CHUNK_BYTES."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and the (unscaled) input gradients; backward only scales them."""

    @staticmethod
    def forward(ctx, h_TH, weight_VH, labels_T, num_labels, dtype, chunk_size, grad_h, grad_w, chunk_fn):
        with torch.autocast(h_TH.device.type, enabled=False):  # the casts below decide every dtype
            loss, grad_h_TH, grad_w_VH = _chunked_loss_and_grads(h_TH, weight_VH, labels_T, num_labels, dtype,
                                                                 chunk_size, grad_h, grad_w, chunk_fn)
        ctx.save_for_backward(grad_h_TH, grad_w_VH)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h_TH, grad_w_VH = ctx.saved_tensors
        # In place: these buffers exist only for this backward, and a [V, H] copy is what we avoid. A
        # second backward through the same graph (retain_graph) fails autograd's saved-version check.
        if grad_h_TH is not None:
            grad_h_TH.mul_(grad_loss)
        if grad_w_VH is not None:
            grad_w_VH.mul_(grad_loss)
        return grad_h_TH, grad_w_VH, None, None, None, None, None, None, None


def _chunked_loss_and_grads(h_TH, weight_VH, labels_T, num_labels, dtype, chunk_size, grad_h: bool, grad_w: bool,
                            chunk_fn):
    """(loss_sum, d loss_sum / d h or None, d loss_sum / d weight or None), visiting label tokens only."""
    T = labels_T.shape[0]
    rows_N = label_rows(labels_T, num_labels)
    # Past the true count (num_labels a bound), rows are T: they read row T-1 as an ignored label, and their zero
    # gradient lands in a spare row T that is cut off.
    read_N = rows_N.clamp_max(T - 1)
    labels_N = torch.where(rows_N < T, labels_T[read_N], IGNORE_INDEX)
    w_VH = weight_VH.to(dtype)  # once, not per chunk: autocast would cast (and cache) it the same way
    loss = torch.zeros((), dtype=torch.float32, device=h_TH.device)
    grad_h_TH = h_TH.new_zeros((T + 1, *h_TH.shape[1:])) if grad_h else None
    # fp32 accumulation over chunks whatever the weight dtype; rounded once at the end.
    grad_w_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if grad_w else None
    for start in range(0, rows_N.numel(), chunk_size):
        rows_C = rows_N[start:start + chunk_size]
        h_CH = h_TH[read_N[start:start + chunk_size]].to(dtype)
        chunk_loss, grad_logits_CV = chunk_fn(h_CH, w_VH, labels_N[start:start + chunk_size], grad_h or grad_w)
        loss += chunk_loss
        if grad_h:
            grad_h_TH.index_copy_(0, rows_C, (grad_logits_CV @ w_VH).to(h_TH.dtype))
        if grad_w:
            grad_w_VH += grad_logits_CV.T @ h_CH
    return loss, grad_h_TH[:T] if grad_h else None, grad_w_VH.to(weight_VH.dtype) if grad_w else None


def label_rows(labels_T: torch.Tensor, num_labels: int | None) -> torch.Tensor:
    """The positions of the label tokens, in order. Their count sets the chunk loop: given, nothing is read
    back; else nonzero syncs the host with the device. A count above the true one (a bound) pads with T."""
    mask_T = labels_T != IGNORE_INDEX
    if num_labels is None:
        return mask_T.nonzero().squeeze(1)
    return torch.nonzero_static(mask_T, size=num_labels, fill_value=labels_T.shape[0]).squeeze(1)


def _chunk_loss_and_grad_logits(h_CH, w_VH, labels_C, with_grad: bool):
    """One chunk's summed cross-entropy and, if asked, d loss / d logits (softmax - onehot) in the matmul
    dtype, i.e. what autograd through `logits.float()` hands the lm_head matmul. Rows labelled IGNORE_INDEX
    (past a bound's true count) add no loss and get a zero gradient row."""
    logits_CV = (h_CH @ w_VH.T).float()
    lse_C = logits_CV.logsumexp(dim=-1)
    kept_C = labels_C != IGNORE_INDEX
    target_C1 = labels_C.clamp_min(0)[:, None]
    loss = torch.where(kept_C, lse_C - logits_CV.gather(1, target_C1).squeeze(1), 0.0).sum()
    if not with_grad:
        return loss, None
    # in place: the fp32 logits are the chunk's largest buffer; an ignored row's exp(-inf) is its zero row
    probs_CV = logits_CV.sub_(torch.where(kept_C, lse_C, float("inf"))[:, None]).exp_()
    probs_CV.scatter_add_(1, target_C1, -kept_C.to(probs_CV.dtype)[:, None])
    return loss, probs_CV.to(h_CH.dtype)


def _load_triton():
    from runtime.loss_kernel import cross_entropy_rows_

    def chunk_fn(h_CH, w_VH, labels_C, with_grad: bool):
        """The torch chunk's math in one kernel over the matmul-dtype logits, which become their gradient."""
        logits_CV = h_CH @ w_VH.T
        return cross_entropy_rows_(logits_CV, labels_C, with_grad), logits_CV if with_grad else None

    def triton_loss(h_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
                    num_labels: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
        return _chunked(h_TH, weight_VH, labels_T, num_labels, chunk_size, chunk_fn)
    return triton_loss


def _missing(module: str, pip: str):
    def reason() -> str | None:
        return None if importlib.util.find_spec(module) else f"the {module} package is not installed (pip install {pip})"
    return reason


def _load_liger():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def liger(h_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
              num_labels: int | None = None) -> torch.Tensor:
        """Liger's chunked Triton loss. We cast to the matmul dtype ourselves and turn autocast off so it
        takes its same-dtype path; grad_weight accumulates in fp32 (accum_dtype) before its cast back."""
        dtype = compute_dtype(h_TH)
        with torch.autocast(h_TH.device.type, enabled=False):
            return liger_fused_linear_cross_entropy(h_TH.to(dtype), weight_VH.to(dtype), labels_T,
                                                    ignore_index=IGNORE_INDEX, reduction="sum",
                                                    accum_dtype=torch.float32)
    return liger


def _load_cce():
    from cut_cross_entropy import linear_cross_entropy

    def cce(h_TH: torch.Tensor, weight_VH: torch.Tensor, labels_T: torch.Tensor,
            num_labels: int | None = None) -> torch.Tensor:
        """Cut Cross-Entropy: its Triton kernels see no autocast, so h and weight are cast here (its
        backward takes bf16/fp16 h only)."""
        dtype = compute_dtype(h_TH)
        return linear_cross_entropy(h_TH.to(dtype), weight_VH.to(dtype), labels_T, ignore_index=IGNORE_INDEX,
                                    reduction="sum", impl="cce", filter_eps=None)
    return cce


# Imported when a layer is built (never inside a compiled region), so the config never loads Triton.
LOSS_IMPLS.declare("triton", Capabilities(devices=TRITON_DEVICES, unavailable=triton_missing, auto_on=("cuda",),
                                          priority=2), _load_triton)
LOSS_IMPLS.declare("liger", Capabilities(devices=("cuda",), unavailable=_missing("liger_kernel", "liger-kernel")),
                   _load_liger)
LOSS_IMPLS.declare("cce", Capabilities(devices=("cuda",), unavailable=_missing("cut_cross_entropy",
                                                                               "cut-cross-entropy")), _load_cce)

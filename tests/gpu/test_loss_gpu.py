"""GPU tests of runtime/loss.py: every loss implementation installed here against "plain".

- Qwen3 shapes (T=8192, H=2048, V=151936), fp32 h and fp32 master weight under bf16 autocast, a quarter
  of the labels ignored, the upstream grad 1 / label count as in the trainer: loss (norm-relative <= 1e-3)
  and the grads of h and weight (norm-relative <= 1e-2, cosine >= 0.9999) vs plain; the extra peak memory
  of one fwd+bwd (max_memory_allocated over what was allocated before it, the grads included) well below
  plain's; one table line per implementation with errors, extra peak memory and time (run with -s).
- Small shapes, every implementation: all labels ignored (zero loss and grads, finite), a frozen weight
  (no weight grad), a bf16 weight (bf16 master).

Shapes: h [T, H], weight [V, H], labels [T].
"""

from __future__ import annotations

import pytest
import torch

from runtime.loss import IGNORE_INDEX, LOSS_IMPLS, linear_cross_entropy_sum

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FUSED_IMPLS = ["chunked", "triton", "liger", "cce"]
# CCE 25.1.1 sums grad h over vocabulary blocks into a bf16 buffer (runtime/loss.py): 1.17e-2 unfiltered on an
# H200; its default filtering measured 1.9e-2, which this bound still catches.
GRAD_H_TOL = {"cce": 1.5e-2}
TIMED_ITERS = 3


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def cosine(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(actual.double().flatten(), expected.double().flatten(), dim=0).item()


def require(impl: str) -> None:
    reason = LOSS_IMPLS.unavailable_reason(impl, "cuda")
    if reason is not None:
        pytest.skip(reason)


def make_inputs(tokens, hidden, vocab, weight_dtype=torch.float32, ignore_frac=0.25, seed=0):
    """Final-norm-like h (unit RMS) and an lm_head weight with std 0.02, as leaves that require grad."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h_TH = torch.randn(tokens, hidden, device="cuda", generator=gen).requires_grad_()
    weight_VH = (0.02 * torch.randn(vocab, hidden, device="cuda", generator=gen)).to(weight_dtype).requires_grad_()
    labels_T = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    labels_T[torch.rand(tokens, device="cuda", generator=gen) < ignore_frac] = IGNORE_INDEX
    return h_TH, weight_VH, labels_T


def step(impl, h_TH, weight_VH, labels_T):
    """One trainer-like fwd (bf16 autocast) + bwd of loss_sum / label count; returns the loss sum."""
    h_TH.grad = weight_VH.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy_sum(h_TH, weight_VH, labels_T, impl=impl)
    (loss / (labels_T != IGNORE_INDEX).sum().clamp_min(1)).backward()
    return loss.detach()


def measure(impl, h_TH, weight_VH, labels_T) -> dict:
    """Loss, grads, extra peak memory (GiB) and mean time (ms) of one fwd+bwd after a warm-up step."""
    step(impl, h_TH, weight_VH, labels_T)
    h_TH.grad = weight_VH.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = step(impl, h_TH, weight_VH, labels_T)
    torch.cuda.synchronize()
    extra_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    out = {"loss": loss, "grad_h": h_TH.grad, "grad_w": weight_VH.grad, "extra_gib": extra_gib}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_ITERS):
        step(impl, h_TH, weight_VH, labels_T)
    end.record()
    torch.cuda.synchronize()
    h_TH.grad = weight_VH.grad = None
    return out | {"ms": start.elapsed_time(end) / TIMED_ITERS}


def table_line(impl, result, errors=None) -> str:
    errs = " ".join(f"{k}={v:.2e}" if "cos" not in k else f"{k}={v:.6f}" for k, v in (errors or {}).items())
    return f"[loss {impl:8s}] extra_peak={result['extra_gib']:6.2f} GiB  time={result['ms']:7.2f} ms  {errs}"


@pytest.fixture(scope="module")
def qwen3_case():
    inputs = make_inputs(8192, 2048, 151936)
    plain = measure("plain", *inputs)
    print("\n" + table_line("plain", plain))
    return inputs, plain


@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_qwen3_shapes_vs_plain(impl, qwen3_case):
    require(impl)
    inputs, plain = qwen3_case
    result = measure(impl, *inputs)
    errors = {"loss_rel": rel_err(result["loss"], plain["loss"]),
              "grad_h_rel": rel_err(result["grad_h"], plain["grad_h"]),
              "grad_h_cos": cosine(result["grad_h"], plain["grad_h"]),
              "grad_w_rel": rel_err(result["grad_w"], plain["grad_w"]),
              "grad_w_cos": cosine(result["grad_w"], plain["grad_w"])}
    print(table_line(impl, result, errors))
    assert result["grad_h"].dtype == result["grad_w"].dtype == torch.float32
    assert errors["loss_rel"] <= 1e-3
    assert errors["grad_h_rel"] <= GRAD_H_TOL.get(impl, 1e-2) and errors["grad_w_rel"] <= 1e-2
    assert errors["grad_h_cos"] >= 0.9999 and errors["grad_w_cos"] >= 0.9999
    assert result["extra_gib"] < 0.5 * plain["extra_gib"]


@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_all_labels_ignored(impl):
    require(impl)
    h_TH, weight_VH, labels_T = make_inputs(300, 64, 1000, ignore_frac=1.0)
    loss = step(impl, h_TH, weight_VH, labels_T)
    assert loss.item() == 0.0
    assert h_TH.grad is not None and not h_TH.grad.any()
    assert weight_VH.grad is not None and not weight_VH.grad.any()


@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_frozen_weight(impl):
    require(impl)
    h_TH, weight_VH, labels_T = make_inputs(300, 64, 1000)
    plain_loss = step("plain", h_TH, weight_VH.requires_grad_(False), labels_T)
    plain_grad_h = h_TH.grad
    loss = step(impl, h_TH, weight_VH, labels_T)
    assert weight_VH.grad is None
    assert rel_err(loss, plain_loss) <= 1e-3
    assert rel_err(h_TH.grad, plain_grad_h) <= 1e-2


@pytest.mark.parametrize("impl", FUSED_IMPLS)
def test_bf16_weight(impl):
    require(impl)
    h_TH, weight_VH, labels_T = make_inputs(300, 64, 1000, weight_dtype=torch.bfloat16)
    plain_loss = step("plain", h_TH, weight_VH, labels_T)
    plain_grads = h_TH.grad, weight_VH.grad
    loss = step(impl, h_TH, weight_VH, labels_T)
    assert weight_VH.grad.dtype == torch.bfloat16
    assert rel_err(loss, plain_loss) <= 1e-3
    assert rel_err(h_TH.grad, plain_grads[0]) <= 1e-2
    assert rel_err(weight_VH.grad, plain_grads[1]) <= 1e-2

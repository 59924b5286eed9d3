"""fp32 means fp32 in our Triton kernels: the dot precision follows torch's fp32 matmul setting.

The interpreter (CPU) computes every tl.dot in fp32 whatever its input_precision, so these tests check
the decision and its plumbing: precision.dot_precision reads torch's setting (new and legacy APIs), and
every scattermoe launch of a kernel with a tl.dot carries that choice as its DOT_PRECISION constexpr
(forward and backward, fused and split LoRA): "ieee" by default, "tf32x3" with TF32 allowed. The
numbers (IEEE <= 1e-5, TF32 <= 1e-3 against fp64) are checked on a GPU: tests/gpu/test_precision_gpu.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from moe.kernels import grouped_linear, grouped_xty, routing
from moe.kernels.precision import dot_precision

# The scattermoe kernels with a tl.dot; every other kernel it launches is a routing kernel (no dot).
DOT_KERNELS = {grouped_linear._grouped_linear_kernel, grouped_linear._swiglu_backward_kernel,
               grouped_xty._grouped_xty_kernel, grouped_xty._factor_grads_kernel}


@contextlib.contextmanager
def fp32_matmul(precision: str | None = None, legacy_allow_tf32: bool = False):
    """torch's fp32 matmul setting for a block (new API value, or the legacy allow_tf32 = True), restored
    after: the legacy flag back first (else the two APIs disagree and torch's getters raise)."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.fp32_precision
    try:
        if legacy_allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
        elif precision is not None:
            torch.backends.cuda.matmul.fp32_precision = precision
        yield
    finally:
        if legacy_allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.fp32_precision, torch.backends.fp32_precision = saved


def test_dot_precision_follows_torch_fp32_matmul_setting():
    assert dot_precision(torch.float32) == "ieee"  # torch's default: IEEE fp32 matmuls
    # TF32 allowed: tensor-core dots as tf32x3 (Triton's plain tf32 truncates the operands: 2.3e-3 > 1e-3)
    with fp32_matmul("tf32"):
        assert dot_precision(torch.float32) == "tf32x3"
    with fp32_matmul(legacy_allow_tf32=True):
        assert dot_precision(torch.float32) == "tf32x3"
    with fp32_matmul("ieee"):
        assert dot_precision(torch.float32) == "ieee"
    assert dot_precision(torch.float32) == "ieee"
    # 16-bit operands keep Triton's default whatever the setting (their compiled kernels unchanged)
    with fp32_matmul("ieee"):
        assert dot_precision(torch.bfloat16) == "tf32"
    torch.get_float32_matmul_precision()  # the restore left the two APIs consistent (else this raises)


def _launches(monkeypatch, split: bool) -> list[tuple[object, dict]]:
    """(kernel, constexprs) of every launch of one fp32 scattermoe forward + backward with LoRA. The
    launches are recorded, not run: only their arguments are checked (no host code reads a result)."""
    launched = []
    for module in (grouped_linear, grouped_xty, routing):
        monkeypatch.setattr(module, "launch", lambda kernel, grid, args, meta: launched.append((kernel, meta)))
    if split:
        monkeypatch.setattr("moe.backends.scattermoe._SPLIT_MIN_WEIGHT_ELEMS", 0)
    torch.manual_seed(0)
    experts = GroupedExperts(4, 40, 24, lora_rank=4, lora_alpha=8)
    x_MH = torch.randn(6, 40, requires_grad=True)
    ids_Mk = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2], [-1, 3], [0, 2]])
    weights_Mk = torch.rand(6, 2, requires_grad=True)
    y_MH = expert_backend("scattermoe")(x_MH, ids_Mk, weights_Mk, experts)
    y_MH.sum().backward()
    return launched


@pytest.mark.parametrize("split", [False, True], ids=["fused-lora", "split-lora"])
@pytest.mark.parametrize("setting,expected", [(None, "ieee"), ("tf32", "tf32x3")], ids=["default", "tf32"])
def test_every_scattermoe_dot_kernel_gets_the_precision(monkeypatch, split, setting, expected):
    with fp32_matmul(setting):
        launched = _launches(monkeypatch, split)
    assert {kernel for kernel, _ in launched} >= DOT_KERNELS  # fwd + bwd with LoRA reach all of them
    for kernel, meta in launched:
        if kernel in DOT_KERNELS:
            assert meta.get("DOT_PRECISION") == expected, (kernel, meta)
        else:
            assert kernel.fn.__module__ == routing.__name__, kernel
